"""Clamped SwiGLU of a stacked gate/up projection (the shared expert's activation); twin of
``ops/triton/swiglu.py``.

  swiglu(gate_up [T, 2I], limit) -> [T, I] in gate_up's dtype

Exactly ``Expert.forward``'s steps (model/moe.py) on the two halves: gate clamped from above, up clamped
on both sides, silu(gate) rounded to the dtype, times up, rounded again.

  swiglu_v41(gate [T, I], up [T, I], limit) -> [T, I] in gate's dtype

DeepSeek-V4.1's (``model/v41/moe.Expert``): the same clamps and silu, all in fp32, one rounding at the end.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.ops.ref.pointwise import direct


def swiglu(gate_up: torch.Tensor, limit: float, *, pointwise=direct) -> torch.Tensor:
    """``pointwise``: how SiLU is applied (``ops/ref/pointwise.py``)."""
    assert gate_up.shape[-1] % 2 == 0, f"gate_up last dim {gate_up.shape[-1]} must be even"
    gate, up = gate_up.chunk(2, dim=-1)
    return pointwise(F.silu, gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def swiglu_v41(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    g = gate.float().clamp(max=limit)
    u = up.float().clamp(min=-limit, max=limit)
    return (F.silu(g) * u).to(gate.dtype)
