"""DeepSeek-V4.1's FP8 window rows (e4m3 per channel, one UE8M0 scale per 32 channels) written and read in one
launch each: the twin of ``ops/ref/cache_rows_v41.py`` for ``fmt="fp8"`` (the other formats: the reference's).

Why: every layer writes its new window KV rows and reads its whole window each step; the reference quantizes
with ~20 launches (groups, amax, the power-of-two scale from the bits, division, clamp, cast, the exponent
bytes, a concatenation, the scatter) and dequantizes with ~8. Here one program per row does the same steps:

    store   amax of each 32 channels; scale = the smallest power of two >= max(amax, 1e-4) * (1/448) from the
            fp32 bits (exponent + 1 when a mantissa bit is set); code = e4m3(clamp(x / scale, +-448)), round to
            nearest even; codes then the scales' exponent bytes, at row where[n] of the table.
    load    e4m3 code times 2^(byte - 127) in fp32, one rounding to the activation dtype.

The same bytes as ``quantize`` and the same values as ``dequantize`` (x / scale by a power of two is exact; the
e4m3 conversion rounds to nearest even like torch's; ``tests/gpu/test_v41_ops.py`` checks bit equality).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.ops.ref import cache_rows_v41 as ref
from deepinfer.ops.triton.rounding import round_to

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GROUP = 32


@triton.jit
def _store_fp8_kernel(v_ptr, where_ptr, t_ptr, C, stride_v, stride_t, G: tl.constexpr, BLOCK_G: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    row = tl.load(where_ptr + n).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    offs = g[:, None] * 32 + tl.arange(0, 32)[None, :]
    gm = g < G
    x = tl.load(v_ptr + n * stride_v + offs, mask=gm[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    bits = (tl.maximum(amax, 1e-4) * (1 / 448)).to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 255) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    y = tl.minimum(tl.maximum(tl.div_rn(x, scale[:, None]), -448.0), 448.0)
    codes = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(t_ptr + row * stride_t + offs, codes, mask=gm[:, None])
    tl.store(t_ptr + row * stride_t + C + g, exponent.to(tl.uint8), mask=gm)


@triton.jit
def _load_fp8_kernel(t_ptr, where_ptr, out_ptr, C, stride_t, stride_o, G: tl.constexpr, BLOCK_G: tl.constexpr,
                     INTERPRET: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    row = tl.load(where_ptr + n).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    offs = g[:, None] * 32 + tl.arange(0, 32)[None, :]
    gm = g < G
    codes = tl.load(t_ptr + row * stride_t + offs, mask=gm[:, None], other=0)
    values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    exponent = tl.load(t_ptr + row * stride_t + C + g, mask=gm, other=127).to(tl.int32)
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    y = round_to(values * scale[:, None], DT, INTERPRET)
    tl.store(out_ptr + n * stride_o + offs, y.to(DT), mask=gm[:, None])


def _fits(table: torch.Tensor, channels: int) -> bool:
    """Whole 32-channel groups and the packed row ``channels + channels / 32`` bytes wide, unit stride."""
    return channels % GROUP == 0 and table.dtype == torch.uint8 and table.dim() == 2 and \
        table.shape[1] == channels + channels // GROUP and table.stride(1) == 1


def store_packed(table: torch.Tensor, where: torch.Tensor, values: torch.Tensor, fmt: str) -> None:
    """``ref.store_packed``: FP8 rows in one launch, the other formats (and partial groups) by the reference."""
    c = values.shape[-1]
    if fmt != "fp8" or not _fits(table, c):
        return ref.store_packed(table, where, values, fmt)
    v = values.reshape(-1, c)
    v = v if v.stride(1) == 1 else v.contiguous()
    assert where.shape == (v.shape[0],), f"where {tuple(where.shape)} for {v.shape[0]} rows"
    if v.shape[0]:
        g = c // GROUP
        _store_fp8_kernel[(v.shape[0],)](v, where.contiguous(), table, c, v.stride(0), table.stride(0), G=g,
                                         BLOCK_G=triton.next_power_of_2(g), num_warps=4)


def load_packed(table: torch.Tensor, where: torch.Tensor, fmt: str, channels: int, dtype: torch.dtype
                ) -> torch.Tensor:
    """``ref.load_packed``: FP8 rows in one launch, the other formats (and partial groups) by the reference."""
    if fmt != "fp8" or not _fits(table, channels) or where.dim() != 1:
        return ref.load_packed(table, where, fmt, channels, dtype)
    out = torch.empty((where.shape[0], channels), dtype=dtype, device=table.device)
    if where.shape[0]:
        g = channels // GROUP
        _load_fp8_kernel[(where.shape[0],)](table, where.contiguous(), out, channels, table.stride(0), out.stride(0),
                                            G=g, BLOCK_G=triton.next_power_of_2(g), INTERPRET=_INTERPRET,
                                            num_warps=4)
    return out
