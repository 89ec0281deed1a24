"""Clamped SwiGLU in one Triton kernel; twin of ``ops/ref/swiglu.py`` (same signature).

Follows the reference's roundings: silu is computed in fp32 as x / (1 + exp(-x)) (torch's formula) and
rounded to the output dtype, then multiplied by the clamped up value and rounded once more.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.ops.triton.rounding import round_to

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _swiglu_kernel(gu_ptr, out_ptr, inter, limit, stride_g, stride_o, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    gate = tl.minimum(tl.load(gu_ptr + t * stride_g + offs, mask=ok, other=0.0).to(tl.float32), limit)
    up = tl.load(gu_ptr + t * stride_g + inter + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    dtype = out_ptr.dtype.element_ty
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dtype, INTERPRET).to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, round_to(silu * up, dtype, INTERPRET).to(dtype), mask=ok)


def swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    assert gate_up.shape[-1] % 2 == 0, f"gate_up last dim {gate_up.shape[-1]} must be even"
    shape = gate_up.shape
    gu = gate_up.reshape(-1, shape[-1])
    if gu.stride(-1) != 1:
        gu = gu.contiguous()
    inter = shape[-1] // 2
    out = torch.empty((gu.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if gu.shape[0]:
        block = min(1024, triton.next_power_of_2(inter))
        _swiglu_kernel[(gu.shape[0], triton.cdiv(inter, block))](
            gu, out, inter, float(limit), gu.stride(0), out.stride(0), BLOCK=block, INTERPRET=_INTERPRET, num_warps=4)
    return out.reshape(*shape[:-1], inter)
