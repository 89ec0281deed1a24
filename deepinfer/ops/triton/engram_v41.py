"""DeepSeek-V4.1's Engram lookup in one launch each: the twin of ``ops/ref/engram_v41.py`` (same signatures).

Why: the reference hashes with ~4 launches per n-gram order (xor, modulo, the concatenation, the offsets) and
gathers the table rows with ~10 (two gathers, the scale decoding and expansion, the product, the cast); and it
needs the table's codes in a layout torch can index, which is what lets the device build keep V4.1-Flash's
tables (384M rows x 256 per Engram layer) as their FP8 codes, half the bytes of a bf16 copy.

    hash    a program per (block of tokens, Engram layer): the lookback's compressed ids (the pad id before
            position 0), their int64 products with the layer's multipliers (< 2^63 by construction, so no
            wrap), the rolling xor of shifts 0..n-1 for each column of order n, modulo its prime (every operand
            non-negative: C's remainder is Python's), plus its offset. Integers: equal to the reference's.
    gather  a program per (token, block of its rows): e4m3 code times 2^(e-127) (the UE8M0 byte e, 0 being
            2^-127) in fp32, one rounding to the output dtype. Row addresses are int64 (R x C is ~1e11).

The gathered values equal the reference's bit for bit: a code times a power of two is exact in fp32, and the
one rounding is the same cast (``rounding.round_to`` on the interpreter, whose bf16 conversion truncates).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.model.v41.names import ENGRAM_TABLE_BLOCK
from deepinfer.ops.triton.rounding import round_to

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GROUP = ENGRAM_TABLE_BLOCK[1]  # columns per scale byte
BLOCK_Q = 16  # tokens per hash program
BLOCK_K = 8  # table rows per gather program: three programs for V4.1-Flash's 24 rows a token


@triton.jit
def _hash_kernel(lb_ptr, map_ptr, mult_ptr, prime_ptr, off_ptr, out_ptr, Q, L, pad_id, stride_lb,
                 N: tl.constexpr, HEADS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_C: tl.constexpr):
    layer = tl.program_id(1)
    q = tl.program_id(0).to(tl.int64) * BLOCK_Q + tl.arange(0, BLOCK_Q)
    qm = q < Q
    cols = tl.arange(0, BLOCK_C)
    cm = cols < (N - 1) * HEADS
    order = cols // HEADS + 1  # column c hashes shifts 0..order (its n-gram has order + 1 tokens)
    rolling = tl.zeros([BLOCK_Q, BLOCK_C], dtype=tl.int64)
    for s in tl.static_range(N):
        back = tl.load(lb_ptr + q * stride_lb + s, mask=qm, other=-1)
        token = tl.load(map_ptr + tl.maximum(back, 0), mask=qm & (back >= 0), other=0)
        token = tl.where(back < 0, pad_id, token).to(tl.int64)
        product = token * tl.load(mult_ptr + layer * N + s).to(tl.int64)
        rolling = tl.where(s <= order[None, :], rolling ^ product[:, None], rolling)
    prime = tl.load(prime_ptr + layer * (N - 1) * HEADS + cols, mask=cm, other=1)
    offset = tl.load(off_ptr + layer * (N - 1) * HEADS + cols, mask=cm, other=0)
    rows = rolling % prime[None, :] + offset[None, :]
    where = (q[:, None] * L + layer) * ((N - 1) * HEADS) + cols[None, :]
    tl.store(out_ptr + where, rows, mask=qm[:, None] & cm[None, :])


def hash_rows(lookback: torch.Tensor, token_map: torch.Tensor, pad_id: int, multipliers: torch.Tensor,
              primes: torch.Tensor, offsets: torch.Tensor, heads: int) -> torch.Tensor:
    q, n = lookback.shape
    layers, width = primes.shape
    assert multipliers.shape == (layers, n) and offsets.shape == (layers, width) and width == (n - 1) * heads, \
        (tuple(multipliers.shape), tuple(primes.shape), tuple(offsets.shape), n, heads)
    lb = lookback if lookback.stride(1) == 1 else lookback.contiguous()
    out = torch.empty((q, layers, width), dtype=torch.int64, device=lookback.device)
    if q and layers:
        _hash_kernel[(triton.cdiv(q, BLOCK_Q), layers)](
            lb, token_map.contiguous(), multipliers.contiguous(), primes.contiguous(), offsets.contiguous(), out, q,
            layers, int(pad_id), lb.stride(0), N=n, HEADS=heads, BLOCK_Q=BLOCK_Q,
            BLOCK_C=triton.next_power_of_2(width), num_warps=4)
    return out


@triton.jit
def _gather_kernel(code_ptr, scale_ptr, rows_ptr, out_ptr, K, C, stride_code, stride_scale, stride_rows,
                   stride_out, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, GROUP: tl.constexpr,
                   INTERPRET: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    km = k < K
    cols = tl.arange(0, BLOCK_C)
    mask = km[:, None] & (cols < C)[None, :]
    row = tl.load(rows_ptr + t * stride_rows + k, mask=km, other=0).to(tl.int64)
    at = row[:, None] * stride_code + cols[None, :]
    # A table's byte offsets pass 2^31 from row 2^23 on (C = 256): only a > 2 GB table could test it, so the
    # offsets' type is checked where they are made, whatever integer type the launch gives the strides.
    tl.static_assert(at.dtype == tl.int64, "engram gather: the table's offsets must be int64")
    codes = tl.load(code_ptr + at, mask=mask, other=0)
    values = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    e = tl.load(scale_ptr + row[:, None] * stride_scale + (cols // GROUP)[None, :], mask=mask, other=127)
    e = e.to(tl.int32)
    scale = tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)  # 2^(e-127); e = 0 is subnormal
    DT: tl.constexpr = out_ptr.dtype.element_ty
    y = round_to(values * scale, DT, INTERPRET)
    tl.store(out_ptr + t * stride_out + k[:, None] * C + cols[None, :], y.to(DT), mask=mask)


def gather_rows(codes: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    r, c = codes.shape
    assert c % GROUP == 0 and scales.shape == (r, c // GROUP), (tuple(codes.shape), tuple(scales.shape))
    assert codes.stride(1) == 1 and scales.stride(1) == 1, "the table's rows must have unit column stride"
    k = rows.shape[-1]
    flat = rows.reshape(rows.shape[:-1].numel(), k)
    flat = flat if flat.stride(-1) == 1 else flat.contiguous()
    out = torch.empty((flat.shape[0], k * c), dtype=dtype, device=codes.device)
    if flat.shape[0] and k:
        _gather_kernel[(flat.shape[0], triton.cdiv(k, BLOCK_K))](
            codes.view(torch.uint8), scales.view(torch.uint8), flat, out, k, c, codes.stride(0), scales.stride(0),
            flat.stride(0), out.stride(0), BLOCK_K=BLOCK_K, BLOCK_C=triton.next_power_of_2(c), GROUP=GROUP,
            INTERPRET=_INTERPRET, num_warps=4)
    return out.reshape(*rows.shape[:-1], k * c)
