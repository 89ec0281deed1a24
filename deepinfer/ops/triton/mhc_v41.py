"""DeepSeek-V4.1's mHC coefficients in one launch: the twin of ``ops/ref/mhc_v41.mix_finish``.

Why: on V4.1's CUDA path the reference Sinkhorn (20 rounds of ~4 launches on [T, N, N]) is twice per layer
and the step is launch-bound: 1,428 of a 6-layer decode step's 5,687 torch ops at batch 1 (counted on the CPU
build with the profiler), against 7.0 ms per layer on the H200 (``bench/results/layer_sweep_v41.md``).

One program per token (one warp: the N x N matrix is 16 values for N = 4), everything in registers: the
sigmoids, the row softmax, then V4's rounds (``ops/triton/mhc._sinkhorn_rounds``: correctly rounded
divisions, as torch's). Every token's result is computed alone, whatever T is (batch-invariant); T is not a
specialisation key (one binary for every step).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.ops.triton.mhc import _sinkhorn_rounds
from deepinfer.ops.triton.rounding import round_to

# Triton's CPU interpreter truncates fp32 -> bf16 (``rounding.py``): the stores pre-round there.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["iters"])
def _finish_kernel(logit_ptr, pre_ptr, post_ptr, comb_ptr, iters, hc_eps, N: tl.constexpr, NP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    j = tl.arange(0, NP)
    vi = i < N
    cm = vi[:, None] & (j[None, :] < N)
    row = logit_ptr + t * (2 + N) * N
    pre = tl.sigmoid(tl.load(row + i, mask=vi, other=0.0)) + hc_eps
    post = 2.0 * tl.sigmoid(tl.load(row + N + i, mask=vi, other=0.0))
    logit = tl.load(row + 2 * N + i[:, None] * N + j[None, :], mask=cm, other=float("-inf"))
    mx = tl.where(vi, tl.max(logit, axis=1), 0.0)  # padded rows: keep -inf - -inf out
    e = tl.where(cm, tl.exp(logit - mx[:, None]), 0.0)
    den = tl.where(vi, tl.sum(e, axis=1), 1.0)
    comb = tl.where(cm, tl.div_rn(e, den[:, None]) + hc_eps, 0.0)  # padded entries stay 0 through the rounds
    comb = _sinkhorn_rounds(comb, iters, hc_eps)
    tl.store(pre_ptr + t * N + i, pre, mask=vi)
    tl.store(post_ptr + t * N + i, post, mask=vi)
    tl.store(comb_ptr + t * N * N + i[:, None] * N + j[None, :], comb, mask=cm)


def mix_finish(logits: torch.Tensor, n: int, iters: int, hc_eps: float
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits [T, (2 + n) n] fp32 -> (pre [T, n], post [T, n], comb [T, n, n]), fp32."""
    assert logits.dtype == torch.float32 and logits.dim() == 2 and logits.shape[1] == (2 + n) * n, (
        f"logits {tuple(logits.shape)} {logits.dtype}, want [T, {(2 + n) * n}] float32")
    logits = logits.contiguous()
    t = logits.shape[0]
    pre = torch.empty((t, n), dtype=torch.float32, device=logits.device)
    post = torch.empty_like(pre)
    comb = torch.empty((t, n, n), dtype=torch.float32, device=logits.device)
    if t:
        _finish_kernel[(t,)](logits, pre, post, comb, iters, float(hc_eps), N=n, NP=triton.next_power_of_2(n),
                             num_warps=1)
    return pre, post, comb


# Channels per program of the collapse / expansion: [N, 1024] fp32 tiles, 8 values per thread at 4 warps.
STREAM_BLOCK_H = 1024


@triton.jit
def _collapse_kernel(x_ptr, pre_ptr, y_ptr, H, stride_xt, stride_xn, N: tl.constexpr, BLOCK_H: tl.constexpr,
                     INTERPRET: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(N):  # in stream order, each product rounded, as the reference's sum over N
        x = tl.load(x_ptr + t * stride_xt + j * stride_xn + offs, mask=hm, other=0.0).to(tl.float32)
        acc += tl.load(pre_ptr + t * N + j) * x
    DT: tl.constexpr = y_ptr.dtype.element_ty
    tl.store(y_ptr + t * H + offs, round_to(acc, DT, INTERPRET).to(DT), mask=hm)


@triton.jit
def _expand_kernel(x_ptr, o_ptr, post_ptr, comb_ptr, y_ptr, H, stride_xt, stride_xn, N: tl.constexpr,
                   NP: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = offs < H
    k = tl.arange(0, NP)
    km = k < N
    out = tl.load(o_ptr + t * H + offs, mask=hm, other=0.0).to(tl.float32)
    mixed = tl.zeros([NP, BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(N):  # stream j into every stream k: comb[j, k] * X_j, summed in stream order
        x = tl.load(x_ptr + t * stride_xt + j * stride_xn + offs, mask=hm, other=0.0).to(tl.float32)
        c = tl.load(comb_ptr + t * N * N + j * N + k, mask=km, other=0.0)
        mixed += c[:, None] * x[None, :]
    post = tl.load(post_ptr + t * N + k, mask=km, other=0.0)
    y = post[:, None] * out[None, :] + mixed
    DT: tl.constexpr = y_ptr.dtype.element_ty
    tl.store(y_ptr + (t * N + k[:, None]) * H + offs[None, :], round_to(y, DT, INTERPRET).to(DT),
             mask=km[:, None] & hm[None, :])


def _stream_rows(streams: torch.Tensor) -> torch.Tensor:
    """[T, N, H] with unit channel stride (the first layer's streams are one row expanded: stride 0 over N)."""
    return streams if streams.stride(2) == 1 else streams.contiguous()


def collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_j pre_j * X_j in fp32 -> streams' dtype, one launch (``ops/ref/mhc_v41.collapse``); each product
    rounded and summed in stream order without FMA contraction, as the reference's separate kernels."""
    t, n, h = streams.shape
    assert pre.shape == (t, n) and pre.dtype == torch.float32, (tuple(pre.shape), pre.dtype)
    x = _stream_rows(streams)
    y = torch.empty((t, h), dtype=streams.dtype, device=streams.device)
    if t:
        _collapse_kernel[(t, triton.cdiv(h, STREAM_BLOCK_H))](x, pre.contiguous(), y, h, x.stride(0), x.stride(1),
                                                              N=n, BLOCK_H=STREAM_BLOCK_H, INTERPRET=_INTERPRET,
                                                              num_warps=4, enable_fp_fusion=False)
    return y


def expand(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """new_k = post_k * out + sum_j comb[j, k] * X_j in fp32 -> out's dtype [T, N, H], one launch
    (``ops/ref/mhc_v41.expand``)."""
    t, n, h = streams.shape
    assert out.shape == (t, h) and post.shape == (t, n) and comb.shape == (t, n, n)
    x = _stream_rows(streams)
    y = torch.empty((t, n, h), dtype=out.dtype, device=out.device)
    if t:
        _expand_kernel[(t, triton.cdiv(h, STREAM_BLOCK_H))](x, out.contiguous(), post.float().contiguous(),
                                                            comb.float().contiguous(), y, h, x.stride(0),
                                                            x.stride(1), N=n, NP=triton.next_power_of_2(n),
                                                            BLOCK_H=STREAM_BLOCK_H, INTERPRET=_INTERPRET,
                                                            num_warps=4, enable_fp_fusion=False)
    return y


# The logits' split of the flat row (N H = 20,480 for V4.1-Flash) over programs: CHUNK values each, so a decode
# step's few tokens still spread the fn read (1.9 MB fp32) over ~64 programs per token.
MIX_CHUNK = 320
MIX_BLOCK_K = 64
# Above this many tokens the projection is a GEMM (fn read once for all tokens, not once per token).
MIX_GEMV_TOKENS = 64


@triton.jit
def _mix_partial_kernel(x_ptr, fn_ptr, part_ptr, H, K, CHUNK, stride_xt, stride_xn, n_chunks,
                        M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (t, c): the fn products and the sum of squares of flat columns [c CHUNK, (c + 1) CHUNK)."""
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    lo = c * CHUNK
    for k0 in range(lo, tl.minimum(lo + CHUNK, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < tl.minimum(lo + CHUNK, K)
        x = tl.load(x_ptr + t * stride_xt + (k // H) * stride_xn + k % H, mask=k_ok, other=0.0).to(tl.float32)
        sq += x * x
        w = tl.load(fn_ptr + offs_m[:, None] * K + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w * x[None, :], axis=1)
    base = part_ptr + (t * n_chunks + c) * (BLOCK_M + 1)
    tl.store(base + offs_m, acc, mask=m_ok)
    tl.store(base + BLOCK_M, tl.sum(sq, axis=0))


@triton.jit
def _mix_logits_kernel(part_ptr, base_ptr, scale_ptr, out_ptr, n_chunks, inv_k, eps, N: tl.constexpr,
                       M: tl.constexpr, BLOCK_M: tl.constexpr):
    """Program t: the chunks' partials summed in chunk order, the inverse RMS, the scaled logits."""
    t = tl.program_id(0).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    mixes = tl.zeros([BLOCK_M], dtype=tl.float32)
    sq = 0.0
    for c in range(0, n_chunks):
        row = part_ptr + (t * n_chunks + c) * (BLOCK_M + 1)
        mixes += tl.load(row + offs_m, mask=m_ok, other=0.0)
        sq += tl.load(row + BLOCK_M)
    r = 1.0 / tl.sqrt_rn(sq * inv_k + eps)
    which = tl.where(offs_m < N, 0, tl.where(offs_m < 2 * N, 1, 2))
    s = tl.load(scale_ptr + which, mask=m_ok, other=0.0)
    b = tl.load(base_ptr + offs_m, mask=m_ok, other=0.0)
    tl.store(out_ptr + t * M + offs_m, tl.fma(mixes * r, s, b), mask=m_ok)


def mix_logits(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float
               ) -> torch.Tensor:
    """``ops/ref/mhc_v41.mix_logits``. Up to ``MIX_GEMV_TOKENS`` tokens: two launches (the projection and the
    sum of squares in chunks over many programs, then a program per token reducing them in chunk order: the
    same sums whatever the batch); more: the reference's GEMM. The sums run in other orders than torch's: fp32
    values within a few ulps of the reference's."""
    t, n, h = streams.shape
    m, k = (2 + n) * n, n * h
    if t > MIX_GEMV_TOKENS or fn.dtype != torch.float32:
        from deepinfer.ops.ref.mhc_v41 import mix_logits as ref_mix_logits

        return ref_mix_logits(streams, fn, base, scale, norm_eps)
    assert fn.shape == (m, k) and base.shape == (m,) and scale.shape == (3,), (tuple(fn.shape), tuple(base.shape))
    x = _stream_rows(streams)
    out = torch.empty((t, m), dtype=torch.float32, device=streams.device)
    if t == 0:
        return out
    chunks = triton.cdiv(k, MIX_CHUNK)
    block_m = triton.next_power_of_2(m)
    part = torch.empty((t, chunks, block_m + 1), dtype=torch.float32, device=streams.device)
    _mix_partial_kernel[(t, chunks)](x, fn.contiguous(), part, h, k, MIX_CHUNK, x.stride(0), x.stride(1), chunks,
                                     M=m, BLOCK_M=block_m, BLOCK_K=MIX_BLOCK_K, num_warps=4)
    _mix_logits_kernel[(t,)](part, base.float().contiguous(), scale.float().contiguous(), out, chunks, 1.0 / k,
                             float(norm_eps), N=n, M=m, BLOCK_M=block_m, num_warps=1)
    return out
