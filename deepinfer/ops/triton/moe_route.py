"""MoE routing after the gate GEMM in one Triton kernel; twin of ``route`` in ``ops/ref/moe.py``.

Why: in PyTorch the router is ~10 launches per layer (score function, + bias, a radix sort for the top-k,
gather, sum, divide, scale, casts); in decode those launches, not the arithmetic (a [T, 256] row), set the
time. Here it is one launch: a program per token holds the whole row (E padded to a power of two) in
registers, a single warp for E <= 256 so that every reduction is a few shuffles.

Selection. The stable descending sort of the reference orders by value, then by lower expert index. Each
lane packs that order into one int64 key: the high 32 bits map the fp32 selection value to an int32 that
sorts like the float (+-0 made equal, every NaN made the largest, as torch's sort treats them), the low bits
hold ``BLOCK_E - 1 - e``. k rounds of "max key, then retire that lane" give the reference's indices, best
first and ties to the lower index, exactly: one int64 max-reduction per round, no sort, deterministic.

Numerics follow the reference's steps, rounding where it rounds (``DT`` = the logits dtype):
  sqrtsoftplus  s = rnd(sqrt(rnd(x > 20 ? x : log1p(exp(x)))))   (torch's softplus, threshold 20)
  sigmoid       s = rnd(1 / (1 + exp(-x)))
  softmax       s = rnd(exp(x - max) / sum)                         (fp32, one rounding, as ``.float()``)
  selection     s, or rnd_sel(s + bias) in fp32 (rnd_sel: to torch's promoted dtype of scores and bias)
  weights       the k unbiased scores, recomputed from their gathered logits (the same elementwise code,
                so the same bits); norm: w = rnd(w / rnd(rnd(sum(w)) + 1e-20)); then rnd(w * factor)
with IEEE division and square root (``div_rn``, ``sqrt_rn``) and libdevice exp/log1p, which are the
functions torch's CUDA kernels call. Left over, at fp32-rounding level: the softmax row sum and the
normalising sum of k weights run in another order than torch's reductions (fp32 results differ by an ulp or
two, bf16 sums of six bf16 values are exact in fp32 so bf16 weights do not move), and on the CPU
interpreter numpy's exp/log stand in for libdevice (log1p via log(u) * x / (u - 1), u = 1 + x), a few fp32
ulps from torch's CPU functions. In a bf16 or fp16 model an ulp in an fp32 score can move its rounded value
by one ulp (rarely: the fp32 value must lie next to a rounding boundary), which can reorder two nearly equal
scores; the selection is exact wherever the scores are.

Hash routing (``hash_indices`` = ``tid2eid[input_ids]``): the indices are the reference's
``hash_indices.long()`` (the same tensor when already int64); the kernel only gathers and normalises the
weights (out-of-range ids, an error in the reference, read no memory and are left out of the sum).

Weights come back in the logits dtype and indices int64, as from the reference. The grid is (T,) and every
tile is a function of E and k only: no host sync, safe to capture in a CUDA graph, and a token's result does
not depend on the batch it is in.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer.ops.triton.rounding import round_to

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SCORES = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.exp(x)
    return libdevice.exp(x)


@triton.jit
def _score(x, m, s, SCORE: tl.constexpr, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """Score of fp32 logits x (rounded to DT, returned in fp32); m, s = softmax row max and sum."""
    if SCORE == 0:
        e = _exp(x, INTERPRET)
        if INTERPRET:  # log1p(e) to a few ulps: the rounding error of u = 1 + e cancels in e / (u - 1)
            u = 1.0 + e
            lp = tl.where(u == 1.0, e, tl.log(u) * tl.div_rn(e, tl.where(u == 1.0, 1.0, u - 1.0)))
        else:
            lp = libdevice.log1p(e)
        sp = round_to(tl.where(x > 20.0, x, lp), DT, INTERPRET)
        return round_to(tl.sqrt_rn(sp), DT, INTERPRET)
    elif SCORE == 1:
        return round_to(tl.div_rn(1.0, 1.0 + _exp(-x, INTERPRET)), DT, INTERPRET)
    else:
        return round_to(tl.div_rn(_exp(x - m, INTERPRET), s), DT, INTERPRET)


@triton.jit
def _moe_route_kernel(
    logits_ptr, bias_ptr, hash_ptr, w_ptr, idx_ptr,
    E, stride_lt, stride_ht, stride_hk, factor,
    SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr, NORM: tl.constexpr,
    SEL_DT: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    DT: tl.constexpr = w_ptr.dtype.element_ty
    row = logits_ptr + t * stride_lt
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    m = 0.0
    s = 1.0
    if (not HASH) or SCORE == 2:
        offs_e = tl.arange(0, BLOCK_E)
        e_mask = offs_e < E
        x = tl.load(row + offs_e, mask=e_mask, other=float("-inf")).to(tl.float32)
        if SCORE == 2:
            m = tl.max(x, axis=0)
            s = tl.sum(_exp(x - m, INTERPRET), axis=0)  # padded lanes: exp(-inf) = 0
    if HASH:
        ids = tl.load(hash_ptr + t * stride_ht + offs_k * stride_hk, mask=k_mask, other=0).to(tl.int32)
        k_mask = k_mask & (ids >= 0) & (ids < E)
    else:
        sel = _score(x, m, s, SCORE, DT, INTERPRET)
        if HAS_BIAS:
            b = tl.load(bias_ptr + offs_e, mask=e_mask, other=0.0).to(tl.float32)
            sel = round_to(sel + b, SEL_DT, INTERPRET)
        bits = sel.to(tl.int32, bitcast=True)
        bits = tl.where(sel != sel, 0x7FC00000, tl.where(sel == 0.0, 0, bits))  # NaN largest, -0 == +0
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int32 order == float order
        key = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - offs_e).to(tl.int64)
        retired = tl.full([BLOCK_E], -9223372036854775808, tl.int64)
        key = tl.where(e_mask, key, retired)
        ids = tl.zeros([BLOCK_K], dtype=tl.int32)
        for r in tl.static_range(K):
            best = tl.max(key, axis=0)
            j = BLOCK_E - 1 - (best & (BLOCK_E - 1)).to(tl.int32)
            ids = tl.where(offs_k == r, j, ids)
            key = tl.where(offs_e == j, retired, key)
        tl.store(idx_ptr + t * K + offs_k, ids.to(tl.int64), mask=k_mask)
    xk = tl.load(row + ids, mask=k_mask, other=0.0).to(tl.float32)
    w = _score(xk, m, s, SCORE, DT, INTERPRET)
    if NORM:
        den = round_to(round_to(tl.sum(tl.where(k_mask, w, 0.0), axis=0), DT, INTERPRET) + 1e-20, DT, INTERPRET)
        w = round_to(tl.div_rn(w, den), DT, INTERPRET)
    w = round_to(w * factor, DT, INTERPRET)
    tl.store(w_ptr + t * K + offs_k, w.to(DT), mask=offs_k < K)


def moe_route(
    logits: torch.Tensor,
    scoring_func: str,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    bias: torch.Tensor | None = None,
    hash_indices: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in logits.dtype, expert indices [T, k] int64); see ``ops/ref/moe.py``."""
    if scoring_func not in SCORES:
        raise ValueError(f"scoring_func: {scoring_func!r} is not one of sqrtsoftplus, sigmoid, softmax")
    if logits.dim() != 2 or logits.dtype not in _TL_DTYPES:
        raise ValueError(f"logits: want [T, E] fp32/bf16/fp16, got {tuple(logits.shape)} {logits.dtype}")
    t, e = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device)
    if hash_indices is not None:
        indices = hash_indices.long()
        if indices.shape != (t, top_k):
            raise ValueError(f"hash_indices: want {(t, top_k)}, got {tuple(indices.shape)}")
        sel_dt = tl.float32
    else:
        if not 0 < top_k <= e:
            raise ValueError(f"top_k {top_k} not in 1..{e}")
        indices = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
        sel_dtype = logits.dtype if bias is None else torch.promote_types(logits.dtype, bias.dtype)
        if sel_dtype not in _TL_DTYPES or (bias is not None and bias.shape != (e,)):
            raise ValueError(f"bias: want [{e}] of a float dtype up to fp32, got {tuple(bias.shape)} {bias.dtype}")
        sel_dt = _TL_DTYPES[sel_dtype]
        if bias is not None:
            bias = bias.contiguous()
    if t == 0:
        return weights, indices
    block_e = max(2, triton.next_power_of_2(e))
    _moe_route_kernel[(t,)](
        logits, logits if bias is None or hash_indices is not None else bias,
        indices, weights, indices,
        e, logits.stride(0), indices.stride(0), indices.stride(1), float(routed_scaling_factor),
        SCORE=SCORES[scoring_func], HAS_BIAS=bias is not None and hash_indices is None,
        HASH=hash_indices is not None, NORM=bool(norm_topk_prob), SEL_DT=sel_dt, K=top_k,
        BLOCK_K=max(2, triton.next_power_of_2(top_k)), BLOCK_E=block_e, INTERPRET=_INTERPRET,
        num_warps=max(1, min(8, block_e // 256)),
    )
    return weights, indices
