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

import torch
import triton
import triton.language as tl

from deepinfer.ops.triton.mhc import _sinkhorn_rounds


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
