"""DeepSeek-V4.1's packed cache rows written and read in one launch each: the twin of ``ops/ref/cache_rows_v41.py``
(FP8 window rows: e4m3 per channel, one UE8M0 scale per 32 channels; MXFP4 index keys and NVFP4 entries: e2m1
codes two a byte, one UE8M0 / e4m3 scale per 32 / 16 channels), and ``qdq`` of the e2m1 formats (the index
queries' rounding).

Why: every layer writes its new window KV rows and reads its whole window each step; the reference quantizes
with ~20 launches (groups, amax, the power-of-two scale from the bits, division, clamp, cast, the exponent
bytes, a concatenation, the scatter) and dequantizes with ~8. Here one program per row does the same steps:

    store   amax of each 32 channels; scale = the smallest power of two >= max(amax, 1e-4) * (1/448) from the
            fp32 bits (exponent + 1 when a mantissa bit is set); code = e4m3(clamp(x / scale, +-448)), round to
            nearest even; codes then the scales' exponent bytes, at row where[n] of the table.
    load    e4m3 code times 2^(byte - 127) in fp32, one rounding to the activation dtype.

The same bytes as ``quantize`` and the same values as ``dequantize`` (x / scale by a power of two is exact; the
e4m3 conversion rounds to nearest even like torch's; ``tests/gpu/test_v41_ops.py`` checks bit equality).

e2m1 (``cache_quant.py``'s steps): scale = the power of two >= max(amax, 6 * 2^-126) / 6 (MXFP4), or e4m3(max(amax,
6 * 2^-9) / 6) rounded to nearest even (NVFP4); y = clamp(x / scale, +-6) (a correctly rounded division); the
magnitude code of the nearest e2m1 value, a value on a midpoint to the even code; the sign bit kept (-0.0 too);
qdq: the level times the scale in fp32, one rounding; packed: sign << 3 | code, the even channel in the low
nibble, then the scale bytes.
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


def _packed_table(table: torch.Tensor, channels: int, fmt: str) -> bool:
    """A uint8 table of rows of ``channels`` e2m1 codes (two a byte) then one scale byte per group, unit stride."""
    return table.dtype == torch.uint8 and table.dim() == 2 and table.stride(1) == 1 and \
        table.shape[1] == channels // 2 + channels // _E2M1[fmt][0]


def store_packed(table: torch.Tensor, where: torch.Tensor, values: torch.Tensor, fmt: str) -> None:
    """``ref.store_packed`` in one launch (partial groups and other layouts by the reference)."""
    c = values.shape[-1]
    if _e2m1_fits(fmt, c) and _packed_table(table, c, fmt):
        return _store_e2m1(table, where, values, fmt)
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
    """``ref.load_packed`` in one launch (partial groups and other layouts by the reference)."""
    if _e2m1_fits(fmt, channels) and _packed_table(table, channels, fmt) and where.dim() == 1:
        return _load_e2m1(table, where, fmt, channels, dtype)
    if fmt != "fp8" or not _fits(table, channels) or where.dim() != 1:
        return ref.load_packed(table, where, fmt, channels, dtype)
    out = torch.empty((where.shape[0], channels), dtype=dtype, device=table.device)
    if where.shape[0]:
        g = channels // GROUP
        _load_fp8_kernel[(where.shape[0],)](table, where.contiguous(), out, channels, table.stride(0), out.stride(0),
                                            G=g, BLOCK_G=triton.next_power_of_2(g), INTERPRET=_INTERPRET,
                                            num_warps=4)
    return out


# ---- the e2m1 formats: MXFP4 (32 channels, a power-of-two scale) and NVFP4 (16 channels, an e4m3 scale) ------
MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between the e2m1 magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6


@triton.jit
def _e2m1_level(code):
    """Magnitude code 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    return tl.where(code < 4, code * 0.5, tl.where(code < 6, code - 2.0, tl.where(code == 6, 4.0, 6.0)))


@triton.jit
def _e2m1_code(a):
    """|value| in [0, 6] -> the nearest magnitude code, a value on a midpoint to the even code (``_e2m1_code``)."""
    code = (a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + \
        (a > 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a > 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    on_mid = (a == 0.25) | (a == 0.75) | (a == 1.25) | (a == 1.75) | (a == 2.5) | (a == 3.5) | (a == 5.0)
    return code + (on_mid & ((code % 2) == 1)).to(tl.int32)


@triton.jit
def _e2m1_kernel(v_ptr, where_ptr, out_ptr, C, stride_v, stride_o, G: tl.constexpr, BLOCK_G: tl.constexpr,
                 GROUP_C: tl.constexpr, NV: tl.constexpr, PACK: tl.constexpr, INTERPRET: tl.constexpr):
    """Row n of v: its groups' scales, e2m1 codes; PACK: codes and scale bytes to row where[n] of out, else the
    rounded values (``qdq``) to row n of out."""
    n = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    offs = g[:, None] * GROUP_C + tl.arange(0, GROUP_C)[None, :]
    gm = g < G
    x = tl.load(v_ptr + n * stride_v + offs, mask=gm[:, None], other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    if NV:
        s8 = tl.div_rn(tl.maximum(amax, 6 * 2.0 ** -9), 6.0).to(tl.float8e4nv)
        scale = s8.to(tl.float32)
        scale_byte = s8.to(tl.uint8, bitcast=True)
    else:
        bits = (tl.maximum(amax, 6 * 2.0 ** -126) * (1 / 6)).to(tl.int32, bitcast=True)
        exponent = ((bits >> 23) & 255) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
        scale = (exponent << 23).to(tl.float32, bitcast=True)
        scale_byte = exponent.to(tl.uint8)
    y = tl.minimum(tl.maximum(tl.div_rn(x, scale[:, None]), -6.0), 6.0)
    code = _e2m1_code(tl.abs(y))
    neg = (y.to(tl.int32, bitcast=True) >> 31) != 0  # the sign bit: -0.0 keeps its sign, as copysign does
    if PACK:
        row = tl.load(where_ptr + n).to(tl.int64)
        nib = code | (neg.to(tl.int32) << 3)
        lo, hi = tl.split(tl.reshape(nib, [BLOCK_G * GROUP_C // 2, 2]))
        pairs = tl.arange(0, BLOCK_G * GROUP_C // 2)
        tl.store(out_ptr + row * stride_o + pairs, (lo | (hi << 4)).to(tl.uint8), mask=pairs < C // 2)
        tl.store(out_ptr + row * stride_o + C // 2 + g, scale_byte, mask=gm)
    else:
        level = _e2m1_level(code)
        value = tl.where(neg, -level, level) * scale[:, None]
        DT: tl.constexpr = out_ptr.dtype.element_ty
        tl.store(out_ptr + n * stride_o + offs, round_to(value, DT, INTERPRET).to(DT), mask=gm[:, None])


@triton.jit
def _load_e2m1_kernel(t_ptr, where_ptr, out_ptr, C, stride_t, stride_o, G: tl.constexpr, BLOCK_G: tl.constexpr,
                      GROUP_C: tl.constexpr, NV: tl.constexpr, INTERPRET: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    row = tl.load(where_ptr + n).to(tl.int64)
    pairs = tl.arange(0, BLOCK_G * GROUP_C // 2)
    b = tl.load(t_ptr + row * stride_t + pairs, mask=pairs < C // 2, other=0).to(tl.int32)
    nib = tl.reshape(tl.join(b & 15, b >> 4), [BLOCK_G, GROUP_C])  # the even channel in the low nibble
    level = _e2m1_level(nib & 7)
    value = tl.where(nib >= 8, -level, level)
    g = tl.arange(0, BLOCK_G)
    gm = g < G
    byte = tl.load(t_ptr + row * stride_t + C // 2 + g, mask=gm, other=0)
    if NV:
        scale = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        scale = (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    y = round_to(value * scale[:, None], DT, INTERPRET)
    offs = g[:, None] * GROUP_C + tl.arange(0, GROUP_C)[None, :]
    tl.store(out_ptr + n * stride_o + offs, y.to(DT), mask=gm[:, None])


_E2M1 = {"mxfp4": (32, False), "nvfp4": (16, True)}  # format -> (channels per scale, e4m3 scales)


def _e2m1_fits(fmt: str, channels: int) -> bool:
    return fmt in _E2M1 and channels % _E2M1[fmt][0] == 0


def qdq(values: torch.Tensor, fmt: str) -> torch.Tensor:
    """``model/v41/cache_quant.qdq`` in one launch for the e2m1 formats (the others, and partial groups, by it)."""
    from deepinfer.model.v41.cache_quant import qdq as ref_qdq

    c = values.shape[-1]
    if not _e2m1_fits(fmt, c):
        return ref_qdq(values, fmt)
    v = values.reshape(-1, c)
    v = v if v.stride(1) == 1 else v.contiguous()
    out = torch.empty(v.shape, dtype=values.dtype, device=values.device)
    if v.shape[0]:
        group, nv = _E2M1[fmt]
        g = c // group
        _e2m1_kernel[(v.shape[0],)](v, v, out, c, v.stride(0), out.stride(0), G=g, BLOCK_G=triton.next_power_of_2(g),
                                    GROUP_C=group, NV=nv, PACK=False, INTERPRET=_INTERPRET, num_warps=4)
    return out.view(values.shape)


def _store_e2m1(table: torch.Tensor, where: torch.Tensor, values: torch.Tensor, fmt: str) -> None:
    c = values.shape[-1]
    v = values.reshape(-1, c)
    v = v if v.stride(1) == 1 else v.contiguous()
    assert where.shape == (v.shape[0],), f"where {tuple(where.shape)} for {v.shape[0]} rows"
    if v.shape[0]:
        group, nv = _E2M1[fmt]
        g = c // group
        _e2m1_kernel[(v.shape[0],)](v, where.contiguous(), table, c, v.stride(0), table.stride(0), G=g,
                                    BLOCK_G=triton.next_power_of_2(g), GROUP_C=group, NV=nv, PACK=True,
                                    INTERPRET=_INTERPRET, num_warps=4)


def _load_e2m1(table: torch.Tensor, where: torch.Tensor, fmt: str, channels: int, dtype: torch.dtype
               ) -> torch.Tensor:
    out = torch.empty((where.shape[0], channels), dtype=dtype, device=table.device)
    if where.shape[0]:
        group, nv = _E2M1[fmt]
        g = channels // group
        _load_e2m1_kernel[(where.shape[0],)](table, where.contiguous(), out, channels, table.stride(0), out.stride(0),
                                             G=g, BLOCK_G=triton.next_power_of_2(g), GROUP_C=group, NV=nv,
                                             INTERPRET=_INTERPRET, num_warps=4)
    return out
