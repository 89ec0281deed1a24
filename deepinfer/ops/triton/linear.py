"""Dense bf16 linear for decode-sized M in Triton; twin of ``ops/ref/linear.py`` (larger M: cuBLAS).

Why: at small M cuBLAS runs these GEMVs (the compressor/indexer side projections, the MoE router: 2-17 MB
of weights per layer) as a split-K kernel plus a separate reduction kernel, ~6-10 µs per call at batch 1
(bench/results/README.md, run 53). Here one launch does both: swap-AB (the weight tile is the MMA's M side,
the tokens its N side), split over K until the GPU is full, and the split partials added in split order
by the tile's last program (``fp8_linear._write_tile``: deterministic, no second launch). Accumulation
in fp32, one rounding to x's dtype, as cuBLAS does (only the order of the K sums differs).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from deepinfer.ops.triton.fp8_linear import MAX_TILES, _split, _tickets, _write_tile, load_swap_ab
from deepinfer.ops.tuning import H200, KernelTuning

# The interpreter multiplies bf16 operands as raw bits: interpreted runs use fp32 dots (exact products).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Larger M goes to cuBLAS: at M = 32 it was as fast or faster (run 54: 6.2 vs 6.7 µs on the router, 6.5 vs
# 8.1 on a 1024-row stack); at M = 1 / 8 this kernel is 5-17% / up to 14% faster.
MAX_M = 16
BLOCK_N, BLOCK_K = 64, 64
CONFIGS = {16: (16, 4, 4), 32: (32, 4, 4), 64: (64, 4, 3)}  # M bucket -> (BLOCK_M, warps, stages), M <= MAX_M


@triton.jit
def _linear_decode_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym, stride_pm, stride_psplit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for k0 in range(k_start, tl.minimum(k_start + k_per_split, K), BLOCK_K):
        w, xt = load_swap_ab(w_ptr, x_ptr, offs_n, offs_m, k0 + offs_k, n_mask, m_mask, K, stride_wn, stride_xm)
        if IEEE:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    _write_tile(tl.trans(acc), offs_m, offs_n, m_mask[:, None] & n_mask[None, :], y_ptr, part_ptr, ticket_ptr, pid_n,
                pid_k, stride_ym, stride_pm, stride_psplit, SPLIT)


def linear(x: torch.Tensor, weight: torch.Tensor, tuning: KernelTuning = H200) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T -> [M, N] in x.dtype (see ``ops/ref/linear.py``)."""
    m, k = x.shape
    n = weight.shape[0]
    if (m == 0 or m > MAX_M or weight.dtype != x.dtype or x.dtype not in (torch.bfloat16, torch.float16)
            or weight.stride(1) != 1 or x.stride(1) != 1 or weight.shape[1] != k):
        return F.linear(x, weight)
    bm, warps, stages = next(cfg for bucket, cfg in sorted(CONFIGS.items()) if m <= bucket)
    tiles = triton.cdiv(n, BLOCK_N)
    split = _split(tiles, k, tuning)
    k_per_split = triton.cdiv(triton.cdiv(k, 128), split) * 128
    split = triton.cdiv(k, k_per_split)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    assert split == 1 or tiles <= MAX_TILES, f"{tiles} split-K tiles > {MAX_TILES}"
    _linear_decode_kernel[(tiles, split)](
        x, weight, y, part, _tickets(x.device), m, n, k, k_per_split,
        x.stride(0), weight.stride(0), y.stride(0), part.stride(-2), part.stride(0),
        BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT=split, IEEE=_INTERPRET,
        num_warps=warps, num_stages=stages,
    )
    return y
