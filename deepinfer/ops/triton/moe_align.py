"""Grouping of routed (token, slot) pairs by expert, in Triton; twin of ``ops/ref/moe_align.py``.

Same contract and same bits as ``align_pairs_torch``: pair = t * k + j, pairs stable-sorted by expert,
each expert's group starting a fresh block of ``block_m`` rows, -1 in padding rows and unused blocks.

Why not the torch version: sort + searchsorted + cumsum + scatter is about ten small launches, a third of
a decode MoE call. No sort is needed, only counting:
  count   counts[e] = pairs routed to e. blocks[e] = cdiv(counts[e], block_m); an inclusive cumsum gives
          block_end, and block_start = block_end - blocks.
  place   row of pair p = block_start[e] * block_m + (pairs of expert e before p). Pairs are visited in
          chunks of CHUNK, in order: a running per-expert vector ``seen`` holds the rows taken so far, and
          the rank inside a chunk is a CHUNK x CHUNK comparison against earlier pairs, which keeps the
          order stable without atomics. Per-expert values are picked for each pair by a one-hot
          [CHUNK, E] select-and-sum (no gather through memory, so no barriers inside a program).
  fill    block b belongs to the expert e with block_start[e] <= b < block_end[e] (experts with no pair
          own no block), else -1; its rows past that expert's count are padding and get -1. Each expert
          writes its own blocks' ids and its last block's padding rows; blocks past the routed ones are
          all -1. Placement writes exactly the other rows, so the two never write the same element and
          need no ordering.

Up to ONE_PROGRAM_PAIRS pairs (small decode batches) one program does all three steps: one launch. Beyond
that, one program per ONE_PROGRAM_PAIRS pairs counts its range, a single program turns the counts into
per-range starting rows (an exclusive scan over ranges), and the range programs then place their pairs and
fill their share of the blocks: three launches whose cost grows linearly with P. Both paths run the same
helpers and produce the same rows. Grids and constexprs depend on shapes only (CUDA graphs), nothing
syncs with the host, and all arithmetic is on integers, so results are exact and deterministic.
Ids must lie in [0, num_experts); like the reference, nothing checks it (that would need a sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.ref.moe_align import num_align_blocks

# Pairs per program. One program's work grows with its pairs (place and fill are loops over pairs and
# blocks), so beyond a few dozen pairs the three-launch path with one program per 64 pairs is faster:
# bench/kernels/bench_align.py on the H200 (bench/results/README.md, run 18): 192 pairs (T=32) 33.2 -> 16.2 µs,
# 768 pairs 72.8 -> 12.9 µs, 24576 pairs 87.6 -> 46.7 µs; up to 64 pairs (T <= 10) it stays one launch.
ONE_PROGRAM_PAIRS = 64
# Scan tile: ranges per step of the exclusive scan over range programs.
SCAN_ROWS = 16
# Tests set this: outputs start filled with a value no kernel writes, so a missed element cannot pass by
# matching whatever a reused allocation held.
POISON_OUTPUTS = False


@triton.jit
def _one_hot(ids, E_PAD: tl.constexpr):
    """[C] expert ids -> [C, E_PAD] int32, 1 where column == id (ids of -1 match nothing)."""
    return (ids[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)


@triton.jit
def _count_range(ids_ptr, p0, p1, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Pairs per expert among pairs [p0, p1): int32 [E_PAD]."""
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    for c0 in range(p0, p1, CHUNK):
        p = c0 + tl.arange(0, CHUNK)
        ids = tl.load(ids_ptr + p, mask=p < p1, other=0).to(tl.int32)
        counts += tl.histogram(ids, E_PAD, mask=p < p1)
    return counts


@triton.jit
def _block_bounds(counts, BM: tl.constexpr):
    """Per-expert [block_start, block_end) from pair counts (padded experts: zero blocks)."""
    blocks = (counts + BM - 1) // BM
    block_end = tl.cumsum(blocks, axis=0)
    return block_end - blocks, block_end


@triton.jit
def _place_range(ids_ptr, pair_ptr, p0, p1, seen, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Write pair_of_row for pairs [p0, p1); ``seen[e]`` is the row of this range's first pair of e."""
    i = tl.arange(0, CHUNK)
    for c0 in range(p0, p1, CHUNK):
        p = c0 + i
        ok = p < p1
        ids = tl.load(ids_ptr + p, mask=ok, other=-1).to(tl.int32)
        hot = _one_hot(ids, E_PAD)
        first = tl.sum(hot * seen[None, :], axis=1)  # row of the chunk's first pair of this pair's expert
        # Earlier pairs of the chunk with the same expert: masked tail pairs (id -1) all come after any
        # valid pair, so they never count towards one.
        before = (ids[None, :] == ids[:, None]) & (i[None, :] < i[:, None])
        rank = tl.sum(before.to(tl.int32), axis=1)
        tl.store(pair_ptr + first + rank, p, mask=ok)
        seen += tl.histogram(tl.where(ok, ids, 0), E_PAD, mask=ok)


@triton.jit
def _fill_blocks(pair_ptr, expert_ptr, e0, e1, b0, b1, counts, block_start, block_end,
                 E_PAD: tl.constexpr, BM: tl.constexpr, NB_TILE: tl.constexpr):
    """For experts [e0, e1): expert_of_block of their blocks and -1 in the padding rows of their last block.
    For blocks [b0, b1) past all routed blocks: expert -1 and every row -1.

    Written from the experts' side (each expert stores its id into its own blocks, one store per block
    index k < blocks[e]), so no [blocks, experts] tile is compared and reduced."""
    e = tl.arange(0, E_PAD)
    mine = (e >= e0) & (e < e1)
    blocks = block_end - block_start
    for k in range(0, tl.max(tl.where(mine, blocks, 0), axis=0)):
        tl.store(expert_ptr + block_start + k, e, mask=mine & (k < blocks))
    # An expert's pairs fill its rows from the first one on: only its last block can have padding rows.
    r = tl.arange(0, BM)
    used = counts - (blocks - 1) * BM
    pad = (mine & (blocks > 0))[:, None] & (r[None, :] >= used[:, None])
    tl.store(pair_ptr + (block_end - 1)[:, None] * BM + r[None, :], tl.full([E_PAD, BM], -1, tl.int32), mask=pad)
    for t0 in range(tl.maximum(b0, tl.max(block_end, axis=0)), b1, NB_TILE):
        b = t0 + tl.arange(0, NB_TILE)
        ok = b < b1
        tl.store(expert_ptr + b, tl.full([NB_TILE], -1, tl.int32), mask=ok)
        tl.store(pair_ptr + b[:, None] * BM + r[None, :], tl.full([NB_TILE, BM], -1, tl.int32), mask=ok[:, None])


@triton.jit(do_not_specialize=["n_pairs", "num_blocks"])
def _align_one_program_kernel(ids_ptr, pair_ptr, expert_ptr, n_pairs, num_blocks,
                              E_PAD: tl.constexpr, BM: tl.constexpr, CHUNK: tl.constexpr,
                              NB_TILE: tl.constexpr):
    counts = _count_range(ids_ptr, 0, n_pairs, E_PAD, CHUNK)
    block_start, block_end = _block_bounds(counts, BM)
    _place_range(ids_ptr, pair_ptr, 0, n_pairs, block_start * BM, E_PAD, CHUNK)
    _fill_blocks(pair_ptr, expert_ptr, 0, E_PAD, 0, num_blocks, counts, block_start, block_end, E_PAD, BM, NB_TILE)


@triton.jit(do_not_specialize=["n_pairs"])
def _count_kernel(ids_ptr, hist_ptr, n_pairs, PER: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """hist[c] = pairs per expert in range c."""
    c = tl.program_id(0)
    p0 = c * PER
    counts = _count_range(ids_ptr, p0, tl.minimum(p0 + PER, n_pairs), E_PAD, CHUNK)
    tl.store(hist_ptr + c * E_PAD + tl.arange(0, E_PAD), counts)


@triton.jit(do_not_specialize=["n_ranges"])
def _scan_kernel(hist_ptr, n_ranges, E_PAD: tl.constexpr, ROWS: tl.constexpr):
    """hist[c] -> pairs per expert in ranges before c (exclusive scan); row n_ranges <- totals."""
    e = tl.arange(0, E_PAD)
    carry = tl.zeros([E_PAD], dtype=tl.int32)
    for r0 in range(0, n_ranges, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        ptrs = hist_ptr + rows[:, None] * E_PAD + e[None, :]
        ok = (rows < n_ranges)[:, None]
        h = tl.load(ptrs, mask=ok, other=0)
        tl.store(ptrs, tl.cumsum(h, axis=0) - h + carry[None, :], mask=ok)
        carry += tl.sum(h, axis=0)
    tl.store(hist_ptr + n_ranges * E_PAD + e, carry)


@triton.jit(do_not_specialize=["n_pairs", "n_ranges", "num_blocks"])
def _place_kernel(ids_ptr, hist_ptr, pair_ptr, expert_ptr, n_pairs, n_ranges, num_blocks,
                  PER: tl.constexpr, E_PAD: tl.constexpr, BM: tl.constexpr, CHUNK: tl.constexpr,
                  NB_TILE: tl.constexpr):
    c = tl.program_id(0)
    e = tl.arange(0, E_PAD)
    counts = tl.load(hist_ptr + n_ranges * E_PAD + e)
    block_start, block_end = _block_bounds(counts, BM)
    seen = block_start * BM + tl.load(hist_ptr + c * E_PAD + e)
    p0 = c * PER
    _place_range(ids_ptr, pair_ptr, p0, tl.minimum(p0 + PER, n_pairs), seen, E_PAD, CHUNK)
    # Experts and the blocks past the routed ones are split evenly over the range programs.
    e_share = tl.cdiv(E_PAD, n_ranges)
    share = tl.cdiv(num_blocks, n_ranges)
    b0 = c * share
    _fill_blocks(pair_ptr, expert_ptr, c * e_share, (c + 1) * e_share, b0, tl.minimum(b0 + share, num_blocks), counts,
                 block_start, block_end, E_PAD, BM, NB_TILE)


def _output(n: int, device: torch.device) -> torch.Tensor:
    if POISON_OUTPUTS:
        return torch.full((n,), -7, dtype=torch.int32, device=device)
    return torch.empty(n, dtype=torch.int32, device=device)


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (pair_of_row int32 [num_blocks * block_m], expert_of_block int32 [num_blocks]).

    See ``align_pairs_torch`` (``ops/ref/moe_align.py``) for the contract; the outputs are bitwise equal.
    """
    if block_m < 1 or block_m & (block_m - 1):
        raise ValueError(f"block_m: {block_m} is not a power of two (a block's rows are one tl.arange)")
    flat = topk_ids.reshape(-1)
    n_pairs = flat.numel()
    dev = flat.device
    num_blocks = num_align_blocks(n_pairs, num_experts, block_m)
    # Every element of both outputs is written by the kernels (placement or fill): no memset needed.
    pair_of_row, expert_of_block = _output(num_blocks * block_m, dev), _output(num_blocks, dev)
    if n_pairs == 0:
        return pair_of_row, expert_of_block
    e_pad = max(16, triton.next_power_of_2(num_experts))
    # Tiles of [CHUNK, E_PAD] and [NB_TILE, E_PAD] hold up to 16K int32: 64 registers a thread at 8 warps.
    chunk = max(16, min(64, triton.next_power_of_2(n_pairs), 16384 // e_pad))
    nb_tile = max(16, min(64, 16384 // e_pad))
    warps = 8 if e_pad >= 256 else 4
    if n_pairs <= ONE_PROGRAM_PAIRS:
        _align_one_program_kernel[(1,)](flat, pair_of_row, expert_of_block, n_pairs, num_blocks, E_PAD=e_pad,
                                        BM=block_m, CHUNK=chunk, NB_TILE=nb_tile, num_warps=warps)
        return pair_of_row, expert_of_block
    n_ranges = triton.cdiv(n_pairs, ONE_PROGRAM_PAIRS)
    hist = torch.empty((n_ranges + 1, e_pad), dtype=torch.int32, device=dev)  # last row: totals
    _count_kernel[(n_ranges,)](flat, hist, n_pairs, PER=ONE_PROGRAM_PAIRS, E_PAD=e_pad, CHUNK=chunk,
                               num_warps=warps)
    _scan_kernel[(1,)](hist, n_ranges, E_PAD=e_pad, ROWS=SCAN_ROWS, num_warps=4)
    _place_kernel[(n_ranges,)](flat, hist, pair_of_row, expert_of_block, n_pairs, n_ranges, num_blocks,
                               PER=ONE_PROGRAM_PAIRS, E_PAD=e_pad, BM=block_m, CHUNK=chunk, NB_TILE=nb_tile,
                               num_warps=warps)
    return pair_of_row, expert_of_block
