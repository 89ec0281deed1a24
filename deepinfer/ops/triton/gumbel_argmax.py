"""Seeded Gumbel-max sampling in two launches: ``sampling/rng.gumbel_argmax`` fused.

The reference builds the noise as a chain of int64 tensor ops over [B, V] (about sixty launches and as many
full passes over a [B, V] int64 tensor per step: at B = 256 and a 129K vocabulary, gigabytes of traffic and
most of a served step's sampling time). Here each program hashes, converts and compares a slice of one
row's vocabulary in registers; a second launch reduces the slices. The contract is the reference's, bit for
bit: the same MurmurHash3 words in 32-bit arithmetic (wrap-around multiplies, logical shifts), the same
float64 ``-log(-log((h + 0.5) / 2**32))``, the same float64 sum with the scores, and the first (lowest) id
among equal maxima. Each row is computed alone, so the result never depends on the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.triton.argmax import slice_plan
from deepinfer.sampling import rng
from deepinfer.sampling.rng import Salt, _salt_rows

BLOCK = 2048
TARGET_PROGRAMS = 264  # two programs per SM of an H200: enough to fill it when the batch is small

# The hash's constants as constexprs (what a kernel may read from its module); turned into uint32 values
# before use, so every multiply wraps at 32 bits as the reference's masked int64 arithmetic does.
C1, C2, F1, F2 = tl.constexpr(rng._C1), tl.constexpr(rng._C2), tl.constexpr(rng._F1), tl.constexpr(rng._F2)
N, KEY_BYTES, MASK32 = tl.constexpr(rng._N), tl.constexpr(rng._KEY_BYTES), tl.constexpr(rng.MASK32)


@triton.jit
def _u32(value: tl.constexpr):
    return tl.full((), value, tl.uint32)


@triton.jit
def _rotl(x, r: tl.constexpr):
    return (x << r) | (x >> (32 - r))


@triton.jit
def _absorb(h, k):
    # scramble(k), then mix it into h (MurmurHash3_x86_32 body), all uint32 with wrap-around
    k = k * _u32(C1)
    k = _rotl(k, 15)
    k = k * _u32(C2)
    h = _rotl(h ^ k, 13)
    return h * _u32(5) + _u32(N)


# The slice count and length change with the batch size: not specialized on, so one binary serves every batch
# (a new variant would compile in the middle of serving).
@triton.jit(do_not_specialize=["per_slice", "num_slices"])
def _slices(scores_ptr, stride, seeds_ptr, positions_ptr, salts_ptr, best_ptr, index_ptr, vocab, per_slice,
            num_slices, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    seed = tl.load(seeds_ptr + row)
    h = (tl.load(salts_ptr + row) & MASK32).to(tl.uint32)
    h = _absorb(h, (seed & MASK32).to(tl.uint32))
    h = _absorb(h, (seed >> 32).to(tl.uint32))
    h = _absorb(h, (tl.load(positions_ptr + row) & MASK32).to(tl.uint32))
    best = tl.full((BLOCK,), float("-inf"), tl.float64)
    where = tl.full((BLOCK,), 2**31 - 1, tl.int32)
    start = part * per_slice
    stop = tl.minimum(start + per_slice, vocab)
    for lo in range(start, stop, BLOCK):
        ids = lo + tl.arange(0, BLOCK)
        live = ids < stop
        x = _absorb(h, ids.to(tl.uint32)) ^ _u32(KEY_BYTES)
        x = x ^ (x >> 16)
        x = x * _u32(F1)
        x = x ^ (x >> 13)
        x = x * _u32(F2)
        x = x ^ (x >> 16)
        u = (x.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)
        s = tl.load(scores_ptr + row * stride + ids, mask=live, other=float("-inf")).to(tl.float64)
        v = s - tl.log(-tl.log(u))
        v = tl.where(live, v, float("-inf"))
        # Per lane: a later id replaces the kept one only when strictly greater, so the lowest id of equal
        # values stays (ids grow with lo within a lane).
        take = v > best
        best = tl.where(take, v, best)
        where = tl.where(take, ids, where)
    top = tl.max(best, axis=0)
    first = tl.min(tl.where(best == top, where, 2**31 - 1), axis=0)
    tl.store(best_ptr + row * num_slices + part, top)
    tl.store(index_ptr + row * num_slices + part, first)


@triton.jit(do_not_specialize=["num_slices"])
def _reduce(best_ptr, index_ptr, out_ptr, num_slices, SLICES: tl.constexpr):
    row = tl.program_id(0)
    k = tl.arange(0, SLICES)
    live = k < num_slices
    best = tl.load(best_ptr + row * num_slices + k, mask=live, other=float("-inf"))
    where = tl.load(index_ptr + row * num_slices + k, mask=live, other=2**31 - 1)
    top = tl.max(best, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(best == top, where, 2**31 - 1), axis=0).to(tl.int64))


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """``t`` contiguous and starting on a 16-byte boundary (a copy only when it is not). Triton compiles one variant
    of a kernel per alignment of its pointers: a slice at an odd int64 offset would compile another one while the
    engine serves (about a second of a stalled step loop)."""
    return t if t.is_contiguous() and t.data_ptr() % 16 == 0 else t.clone(memory_format=torch.contiguous_format)


def gumbel_argmax(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, salt: Salt = 0) -> torch.Tensor:
    """``sampling.rng.gumbel_argmax`` on the device: [B] int64 tokens, the reference's to the bit."""
    if scores.dim() != 2 or scores.shape[0] != seeds.shape[0]:
        raise ValueError(f"scores must be [B, V] with B == len(seeds), got {tuple(scores.shape)}")
    salts = _salt_rows(seeds, positions, salt)
    rows, vocab = scores.shape
    out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    if rows == 0:
        return out
    scores = scores if scores.stride(1) == 1 else scores.contiguous()
    num_slices, per_slice, bound = slice_plan(rows, vocab, BLOCK, TARGET_PROGRAMS)
    best = torch.empty(rows, num_slices, dtype=torch.float64, device=scores.device)
    index = torch.empty(rows, num_slices, dtype=torch.int32, device=scores.device)
    _slices[(rows, num_slices)](scores, scores.stride(0), _aligned(seeds), _aligned(positions), _aligned(salts),
                                best, index, vocab, per_slice, num_slices, BLOCK=BLOCK)
    _reduce[(rows,)](best, index, out, num_slices, SLICES=bound)
    return out
