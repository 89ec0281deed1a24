"""Rounding to the model dtype inside Triton kernels, shared by the kernels that mirror the reference's casts.

The reference casts intermediates to the activation dtype at fixed points (RMSNorm factor, RoPE result,
softmax weights...); kernels that want the same bits round at the same points with ``round_to``.

Triton 3.6's CPU interpreter converts fp32 -> bf16 by truncation instead of round-to-nearest-even, so
interpreted runs pre-round the bits (adding 0x7FFF plus the lowest kept bit) and the truncation is then
exact. Zeros and subnormals are left alone: the addition would turn them into subnormals, which the
interpreter's conversion mangles. On the GPU the cast itself rounds to nearest even.
"""

from __future__ import annotations

import triton
import triton.language as tl

MIN_NORMAL: tl.constexpr = tl.constexpr(1.1754943508222875e-38)  # 2^-126, smallest normal fp32


@triton.jit
def round_to(v, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> DTYPE (round to nearest even) -> fp32: a cast to the model dtype in the reference."""
    if DTYPE == tl.float32:
        return v
    if INTERPRET:
        if DTYPE == tl.bfloat16:
            u = v.to(tl.uint32, bitcast=True)
            v = tl.where(tl.abs(v) >= MIN_NORMAL, (u + 0x7FFF + ((u >> 16) & 1)).to(tl.float32, bitcast=True), v)
    return v.to(DTYPE).to(tl.float32)
