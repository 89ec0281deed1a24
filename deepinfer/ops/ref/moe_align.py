"""Grouping of routed (token, slot) pairs by expert: the specification, twin of ``ops/triton/moe_align.py``.

The grouped-GEMM experts (``ops/triton/moe_experts.py``) run one program per block of ``block_m`` rows,
each block belonging to a single expert. This op decides which pair sits in which row.
"""

from __future__ import annotations

import torch


def num_align_blocks(n_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the blocks any routing needs, from shapes only (so nothing syncs).

    Each expert's group wastes less than one block, and at most min(E, P) experts are hit.
    """
    return -(-n_pairs // block_m) + min(num_experts, n_pairs)


def align_pairs_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (pair_of_row int32 [num_blocks * block_m], expert_of_block int32 [num_blocks]).

    Pairs are flattened row-major (pair = t * k + j), sorted by expert (stable: ascending pair within an
    expert), and each expert's group starts a fresh block. num_blocks is an upper bound computed from
    shapes (cdiv(P, block_m) + min(E, P)) so nothing syncs; blocks past the real count get expert -1.
    Only integer ops: the result is exact and deterministic. Ids must lie in [0, num_experts).
    """
    flat = topk_ids.reshape(-1)
    n_pairs = flat.numel()
    dev = flat.device
    num_blocks = num_align_blocks(n_pairs, num_experts, block_m)
    sorted_ids, order = torch.sort(flat, stable=True)
    group_start = torch.searchsorted(sorted_ids, torch.arange(num_experts + 1, device=dev))  # [E+1]
    blocks = (group_start[1:] - group_start[:-1] + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    block_start = block_end - blocks
    rank = torch.arange(n_pairs, device=dev) - group_start[sorted_ids]
    dest = block_start[sorted_ids] * block_m + rank
    pair_of_row = torch.full((num_blocks * block_m,), -1, dtype=torch.int32, device=dev)
    pair_of_row[dest] = order.to(torch.int32)  # unique destinations: a permutation, no accumulation
    expert = torch.searchsorted(block_end, torch.arange(num_blocks, device=dev), right=True)
    expert_of_block = torch.where(expert < num_experts, expert, -1).to(torch.int32)
    return pair_of_row, expert_of_block
