"""Clamped SwiGLU in one Triton kernel; twin of ``ops/ref/swiglu.py`` (same signature).

Follows the reference's roundings: silu is computed in fp32 as x / (1 + exp(-x)) (torch's formula) and
rounded to the output dtype, then multiplied by the clamped up value and rounded once more.

``swiglu_v41``: DeepSeek-V4.1's, the gate and up halves given apart and everything in fp32, one rounding at
the end (``ops/ref/swiglu.swiglu_v41``); torch's CUDA silu is x / (1 + exp(-x)) with the fast exp, here
libdevice's, a last-bit fp32 difference before the rounding.
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


@triton.jit
def _swiglu_v41_kernel(g_ptr, u_ptr, out_ptr, inter, limit, stride_g, stride_u, stride_o, BLOCK: tl.constexpr,
                       INTERPRET: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    gate = tl.minimum(tl.load(g_ptr + t * stride_g + offs, mask=ok, other=0.0).to(tl.float32), limit)
    up = tl.load(u_ptr + t * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    dtype = out_ptr.dtype.element_ty
    y = tl.div_rn(gate, 1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + t * stride_o + offs, round_to(y, dtype, INTERPRET).to(dtype), mask=ok)


def swiglu_v41(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    assert gate.shape == up.shape and gate.dtype == up.dtype, (tuple(gate.shape), tuple(up.shape))
    shape = gate.shape
    g, u = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
    g = g if g.stride(-1) == 1 else g.contiguous()
    u = u if u.stride(-1) == 1 else u.contiguous()
    inter = shape[-1]
    out = torch.empty((g.shape[0], inter), dtype=gate.dtype, device=gate.device)
    if g.shape[0]:
        block = min(1024, triton.next_power_of_2(inter))
        _swiglu_v41_kernel[(g.shape[0], triton.cdiv(inter, block))](
            g, u, out, inter, float(limit), g.stride(0), u.stride(0), out.stride(0), BLOCK=block,
            INTERPRET=_INTERPRET, num_warps=4, enable_fp_fusion=False)
    return out.reshape(shape)
