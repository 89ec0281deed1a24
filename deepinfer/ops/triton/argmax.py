"""Greedy picks: ``torch.argmax(x, dim=-1)`` over a [B, V] row block in two launches with many programs.

Why: torch's argmax reduces a row of a 129K vocabulary in one thread block: about 27 µs per call on an H200
(graph replay, up to a hundred rows), where reading a 258 KB bf16 row takes well under a microsecond. A greedy
decode step calls it once, a speculative step once for the verified rows and once per draft of the MTP chain
(k = 3: four calls, 0.11-0.15 ms of a batch-1 step). Here each program reduces a slice of one row and a second
launch reduces the slices (``gumbel_argmax.py``'s plan, without the noise): 4.5 µs for one row.

The contract is torch's, to the bit: the index of the first maximum; NaN counts as the maximum (the first NaN
wins); -0.0 equals +0.0. Values are compared as int32 keys that order like the floats: the float32 bits with
the magnitude bits flipped for negatives, -0.0 merged into +0.0 and every NaN the largest key. Converting bf16
or fp16 to float32 is exact, so the keys order the inputs as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048
TARGET_PROGRAMS = 1056  # eight programs per SM of an H200: short loops at every batch (264: 38 µs at 128 rows)
NONE = tl.constexpr(2**31 - 1)  # index of no element (larger than any)
# Up to this many rows the slices beat torch's one block per row (H200, 129K bf16 vocabulary, graph replay:
# 1 / 4 / 32 / 128 rows 4.5 / 4.7 / 9.4 / 25.5 µs vs 26.6 / 27.2 / 27.4 / 27.5); at 256 rows they lose (86.5
# vs 46.7 µs: each program's loop waits on its loads). ``sampling.sampler.argmax_tokens`` goes by it.
MAX_ROWS = 128
# The keys are float32 bits: float64 would round (two values could tie or swap), so it stays with torch.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _keys(x):
    """float32 values -> int32 keys with the same order (NaN largest, -0.0 == +0.0)."""
    bits = x.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # arithmetic shift: negatives get their magnitude flipped
    key = tl.where(key == -1, 0, key)  # -0.0 (bits 0x80000000) -> the key of +0.0
    return tl.where(x != x, 2**31 - 1, key)


# The slice count and length change with the batch size: not specialized on, so one binary serves every batch.
@triton.jit(do_not_specialize=["per_slice", "num_slices"])
def _slices(x_ptr, stride, best_ptr, index_ptr, vocab, per_slice, num_slices, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    best = tl.full((BLOCK,), -(2**31), tl.int32)
    where = tl.full((BLOCK,), NONE, tl.int32)
    start = part * per_slice
    stop = tl.minimum(start + per_slice, vocab)
    for lo in range(start, stop, BLOCK):
        ids = lo + tl.arange(0, BLOCK)
        live = ids < stop
        key = _keys(tl.load(x_ptr + row.to(tl.int64) * stride + ids, mask=live, other=0.0).to(tl.float32))
        # Per lane, a later id replaces the kept one only when strictly greater: the lowest id of equal keys stays.
        take = live & ((key > best) | (where == NONE))
        best = tl.where(take, key, best)
        where = tl.where(take, ids, where)
    top = tl.max(best, axis=0)
    tl.store(best_ptr + row * num_slices + part, top)
    tl.store(index_ptr + row * num_slices + part, tl.min(tl.where(best == top, where, NONE), axis=0))


@triton.jit(do_not_specialize=["num_slices"])
def _reduce(best_ptr, index_ptr, out_ptr, num_slices, SLICES: tl.constexpr):
    row = tl.program_id(0)
    k = tl.arange(0, SLICES)
    live = k < num_slices
    best = tl.load(best_ptr + row * num_slices + k, mask=live, other=-(2**31))
    where = tl.load(index_ptr + row * num_slices + k, mask=live, other=NONE)
    top = tl.max(tl.where(where == NONE, -(2**31), best), axis=0)
    tl.store(out_ptr + row, tl.min(tl.where((best == top) & (where != NONE), where, NONE), axis=0).to(tl.int64))


def slice_plan(rows: int, vocab: int, block: int, target_programs: int) -> tuple[int, int, int]:
    """How a many-program row reduction (this file, ``gumbel_argmax.py``) cuts [rows, vocab]: (slices per row,
    columns per slice: whole ``block``s, about ``target_programs`` programs in all; and a power of two that bounds
    the slice count for every row count, so the reducing kernel compiles one variant per vocabulary size)."""
    blocks = triton.cdiv(vocab, block)
    num_slices = max(1, min(blocks, triton.cdiv(target_programs, rows)))
    per_slice = triton.cdiv(blocks, num_slices) * block
    return triton.cdiv(vocab, per_slice), per_slice, triton.next_power_of_2(min(blocks, target_programs))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` for a 2-D ``x`` [B, V] (V >= 1) in ``DTYPES``: [B] int64, the same indices."""
    if x.dim() != 2 or x.dtype not in DTYPES or x.shape[1] == 0:
        raise ValueError(f"argmax_rows: x must be a [B, V] tensor with V >= 1 and dtype one of bfloat16, float16, "
                         f"float32, got {tuple(x.shape)} {x.dtype}")
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    x = x if x.stride(1) == 1 else x.contiguous()
    num_slices, per_slice, bound = slice_plan(rows, vocab, BLOCK, TARGET_PROGRAMS)
    best = torch.empty(rows, num_slices, dtype=torch.int32, device=x.device)
    index = torch.empty(rows, num_slices, dtype=torch.int32, device=x.device)
    _slices[(rows, num_slices)](x, x.stride(0), best, index, vocab, per_slice, num_slices, BLOCK=BLOCK)
    _reduce[(rows,)](best, index, out, num_slices, SLICES=bound)
    return out
