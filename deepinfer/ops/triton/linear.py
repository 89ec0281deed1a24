"""Dense bf16 linear for decode-sized M in Triton; twin of ``ops/ref/linear.py`` (larger M: cuBLAS). And the
batch-invariant table's dense GEMM for every M (``linear_invariant``, end of file), the same kernel.

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
def _swap_ab_range(w_ptr, x_ptr, offs_n, offs_m, n_mask, m_mask, K, k_start, k_end, stride_wn, stride_xm,
                   BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    """fp32 [BLOCK_N, BLOCK_M] = w[offs_n, k_start:k_end] @ x[offs_m, k_start:k_end]ᵀ from zero, BLOCK_K at a
    time into one MMA accumulator."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        w, xt = load_swap_ab(w_ptr, x_ptr, offs_n, offs_m, k0 + offs_k, n_mask, m_mask, K, stride_wn, stride_xm)
        if IEEE:
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt, acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _linear_decode_kernel(
    x_ptr, w_ptr, y_ptr, part_ptr, ticket_ptr, M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym, stride_pm, stride_psplit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
    IEEE: tl.constexpr, SEGS: tl.constexpr = 1,
):
    """Program (n tile, K split, m tile). With SEGS > 1 (batch-invariant, many tiles) the program's K range
    is SEGS segments of ``k_per_split``, each summed from zero and added in order: the bits SPLIT = SEGS
    programs give through ``_write_tile``'s ordered reduction."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    if SEGS == 1:
        k_start = pid_k * k_per_split
        acc = _swap_ab_range(w_ptr, x_ptr, offs_n, offs_m, n_mask, m_mask, K, k_start,
                             tl.minimum(k_start + k_per_split, K), stride_wn, stride_xm, BLOCK_N, BLOCK_M, BLOCK_K,
                             IEEE)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for sg in range(SEGS):
            k_start = (pid_k * SEGS + sg) * k_per_split  # pid_k is 0 here (SEGS > 1 launches no K split)
            acc += _swap_ab_range(w_ptr, x_ptr, offs_n, offs_m, n_mask, m_mask, K, k_start,
                                  tl.minimum(k_start + k_per_split, K), stride_wn, stride_xm, BLOCK_N, BLOCK_M,
                                  BLOCK_K, IEEE)
    _write_tile(tl.trans(acc), offs_m, offs_n, m_mask[:, None] & n_mask[None, :], y_ptr, part_ptr, ticket_ptr,
                pid_m * tl.num_programs(0) + pid_n, pid_k, stride_ym, stride_pm, stride_psplit, SPLIT)


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
    _linear_decode_kernel[(tiles, split, 1)](
        x, weight, y, part, _tickets(x.device), m, n, k, k_per_split,
        x.stride(0), weight.stride(0), y.stride(0), part.stride(-2), part.stride(0),
        BLOCK_M=bm, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT=split, IEEE=_INTERPRET,
        num_warps=warps, num_stages=stages,
    )
    return y


# Batch-invariant table (``KernelTuning.batch_invariant``): this kernel for every M on the tuning's
# ``invariant_linear_tiles`` (the weight rows wgmma m64's M side, the tokens its N side: one instruction family
# for every bucket), K in the tuning's fixed segments, whose widths follow the 64-row tile of M = 1 whatever
# tile a larger M takes.


def linear_invariant(x: torch.Tensor, weight: torch.Tensor, tuning: KernelTuning = H200) -> torch.Tensor:
    """``linear`` whose every row has the same bits for any M: K summed in ``tuning.k_segment(N, K)``
    segments, added in order (as split-K programs while the tiles do not fill the GPU, else inside each
    program); operands of one dtype, bf16/fp16 (the GPU model's) or fp32 (exact fp32 products), accumulation
    in fp32."""
    m, k = x.shape
    n = weight.shape[0]
    assert x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32), (
        f"batch-invariant linear: x {x.dtype} and weight {weight.dtype} must be one of bf16, fp16, fp32")
    assert weight.shape[1] == k, f"x {tuple(x.shape)} vs weight {tuple(weight.shape)}"
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bn, bm, warps, stages = tuning.invariant_linear_tile(m)
    assert bn % 64 == 0 and warps % 4 == 0 and warps <= 4 * (bn // 64), "wgmma m64 over the weight rows, every tile"
    n_tiles, m_tiles = triton.cdiv(n, bn), triton.cdiv(m, bm)
    seg, split, segs = tuning.segment_launch(n, k, n_tiles * m_tiles, BLOCK_N)  # segments: M = 1's 64-row tiles
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    _linear_decode_kernel[(n_tiles, split, m_tiles)](
        x, weight, y, part, _tickets(x.device), m, n, k, seg,
        x.stride(0), weight.stride(0), y.stride(0), part.stride(-2), part.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, SPLIT=split, IEEE=x.dtype == torch.float32 or _INTERPRET,
        SEGS=segs,
        num_warps=warps, num_stages=stages,
    )
    return y


def dense_invariant(x: torch.Tensor, weight: torch.Tensor, tuning: KernelTuning = H200) -> torch.Tensor:
    """``ops/ref/linear.dense`` (x [..., K] -> [..., N]) through ``linear_invariant``."""
    return linear_invariant(x.reshape(-1, x.shape[-1]), weight, tuning).view(*x.shape[:-1], weight.shape[0])


def dense_grouped_invariant(x: torch.Tensor, weight: torch.Tensor, tuning: KernelTuning = H200) -> torch.Tensor:
    """``ops/ref/linear.dense_grouped`` (x [G, T, in] -> [G, T, r]) as one ``linear_invariant`` per group."""
    w = weight.view(x.shape[0], -1, x.shape[-1])
    return torch.stack([linear_invariant(x[g], w[g], tuning) for g in range(x.shape[0])])
