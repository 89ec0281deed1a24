"""mHC in Triton: ``hc_pre``, ``hc_post`` and ``hc_head``, twins of ``ops/ref/mhc.py``.

Same signatures as the reference, plus keyword-only output tensors: ``out=`` (collapsed) for ``hc_pre`` and
``hc_head``, ``result=`` (new streams, may be ``streams`` itself) for ``hc_post``, whose ``out`` is taken.

Why: the reference spends ~60 tiny launches per ``hc_pre`` (the Sinkhorn rounds on [T, N, N]), twice per
layer; in decode the launches, not the bytes, set the step time. Here ``hc_pre`` is two launches,
``hc_post`` one, whatever ``sinkhorn_iters`` is.

Plan (no host sync, no atomics, so a call can be captured in a CUDA graph):
  mixes kernel   per (block of BLOCK_T tokens, K chunk of K_CHUNK columns), K = N*H: the partial products
                 x @ fn.T (fp32 ``tl.dot``, IEEE, not tf32) and the partial sum of squares of x, stored as
                 one [BLOCK_T, MP] tile (the sum of squares in the spare column ``rows``).
  finish kernel  per token: the K chunks summed in chunk order, rsqrt(mean(x^2) + eps) applied to the sums,
                 sigmoid/softmax with scales and bases, Sinkhorn on the N x N matrix in registers, then
                 collapsed = sum_k pre_k * x_k over H in fp32 with one cast to the stream dtype.
  post kernel    per (token, H block): new_k = post_k * out + sum_j comb[j, k] * x_j.

Why these choices:
* Split over K, not one program per token: fn is (2+N)*N x N*H fp32 (1.5 MB for V4-Flash); a token's
  program would read all of it from L2 alone, serialising decode on one SM. K chunks spread that read over
  K/K_CHUNK programs; tokens are blocked by BLOCK_T so prefill reuses each fn tile across 16 tokens. One
  launch for everything would need a grid-wide barrier (atomic ticket); the second launch is cheaper.
* Batch invariance: K_CHUNK, BLOCK_K and BLOCK_T are constants, so a token's sums run in the same order
  whatever T is, and its row of a ``tl.dot`` does not depend on the other rows.
* Normalise after the dot: r * (x @ fn.T) equals (r * x) @ fn.T, the reference's order, up to fp32
  rounding; it lets one pass over x give both the sums of squares and the products.
* Sinkhorn and the softmax use round-to-nearest division (``div_rn``) like torch: the default fp32 ``/``
  on the GPU is approximate (2 ulp) and 2*iters divisions would compound.
* ``hc_post`` rounds where the reference rounds (post and comb cast to the stream dtype, post*out rounded,
  the comb mix accumulated in fp32 and rounded as a matmul does, then the rounded sum), so bf16 results
  match it bit for bit except where the 4-term fp32 mix sums in another order (rare 1-ulp flips).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton 3.6's CPU interpreter truncates fp32 -> bf16; interpreted runs round the bits first (``_to_out``).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Tests set this: the partial-sum scratch and internally allocated outputs start as NaN.
POISON_SCRATCH = False
K_CHUNK = 1024  # columns of x per mixes program; a function of nothing but this constant (batch invariance)
BLOCK_T = 16  # tokens per mixes program (tl.dot's minimum M)
BLOCK_K = 64  # inner step of the mixes loop; divides K_CHUNK
BLOCK_H = 512  # H elements per post program and per collapse step


@triton.jit
def _to_out(v, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> dtype, round to nearest even (the interpreter truncates fp32 -> bf16: round its bits first)."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            u = v.to(tl.uint32, bitcast=True)
            v = (u + 0x7FFF + ((u >> 16) & 1)).to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _mixes_kernel(x_ptr, fn_ptr, part_ptr, T, K, ROWS,
                  K_CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, MP: tl.constexpr):
    """part[s, t, :ROWS] = x[t, chunk s] @ fn[:, chunk s].T and part[s, t, ROWS] = sum x[t, chunk s]^2."""
    s = tl.program_id(1)
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_m = tl.arange(0, MP)
    t_ok = offs_t < T
    x_rows = x_ptr + offs_t.to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_T, MP], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    for kk in range(0, K_CHUNK, BLOCK_K):
        offs_k = s * K_CHUNK + kk + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + offs_m[None, :] * K + offs_k[:, None], mask=(offs_m[None, :] < ROWS) & k_ok[:, None],
                    other=0.0)
        sq += x * x
        acc = tl.dot(x, w, acc, input_precision="ieee")  # fp32 FMAs: tf32 would cost ~1e-3 on the mixes
    # fn's padded columns are zero, so column ROWS of acc is free for the sum of squares.
    acc = tl.where(offs_m[None, :] == ROWS, tl.sum(sq, axis=1)[:, None], acc)
    tl.store(part_ptr + (s * T + offs_t.to(tl.int64)[:, None]) * MP + offs_m[None, :], acc, mask=t_ok[:, None])


@triton.jit
def _finish_kernel(x_ptr, part_ptr, base_ptr, scale_ptr, col_ptr, post_ptr, comb_ptr,
                   T, H, ROWS, iters, hc_eps, norm_eps,
                   N: tl.constexpr, NP: tl.constexpr, SPLIT: tl.constexpr, MP: tl.constexpr,
                   BLOCK_H: tl.constexpr, HEAD: tl.constexpr, INTERPRET: tl.constexpr):
    """One token: chunk sums -> pre (and post, Sinkhorn comb unless HEAD) -> collapsed row."""
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, NP)
    j = tl.arange(0, NP)
    vi = i < N
    cm = vi[:, None] & (j[None, :] < N)
    m_pre = tl.zeros([NP], dtype=tl.float32)
    m_post = tl.zeros([NP], dtype=tl.float32)
    m_comb = tl.zeros([NP, NP], dtype=tl.float32)
    ss = tl.zeros([1], dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # chunk order: fixed, whatever T is
        row = part_ptr + (s * T + t) * MP
        m_pre += tl.load(row + i, mask=vi, other=0.0)
        ss += tl.load(row + ROWS + tl.zeros([1], dtype=tl.int32))
        if not HEAD:
            m_post += tl.load(row + N + i, mask=vi, other=0.0)
            m_comb += tl.load(row + 2 * N + i[:, None] * N + j[None, :], mask=cm, other=0.0)
    r = tl.rsqrt(ss / (N * H) + norm_eps)  # [1]: the token's RMS factor (exact for a power-of-two N*H)
    pre = tl.sigmoid(m_pre * r * tl.load(scale_ptr) + tl.load(base_ptr + i, mask=vi, other=0.0)) + hc_eps
    pre = tl.where(vi, pre, 0.0)
    if not HEAD:
        post = 2.0 * tl.sigmoid(m_post * r * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + i, mask=vi, other=0.0))
        tl.store(post_ptr + t * N + i, post, mask=vi)
        cb = tl.load(base_ptr + 2 * N + i[:, None] * N + j[None, :], mask=cm, other=0.0)
        logit = tl.where(cm, m_comb * r[:, None] * tl.load(scale_ptr + 2) + cb, float("-inf"))
        mx = tl.where(vi, tl.max(logit, axis=1), 0.0)  # padded rows: keep -inf - -inf out
        e = tl.where(cm, tl.exp(logit - mx[:, None]), 0.0)
        den = tl.where(vi, tl.sum(e, axis=1), 1.0)
        comb = tl.where(cm, tl.div_rn(e, den[:, None]) + hc_eps, 0.0)  # padded entries stay 0 below
        comb = tl.div_rn(comb, tl.sum(comb, axis=0)[None, :] + hc_eps)
        for _ in range(iters - 1):
            comb = tl.div_rn(comb, tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = tl.div_rn(comb, tl.sum(comb, axis=0)[None, :] + hc_eps)
        tl.store(comb_ptr + t * N * N + i[:, None] * N + j[None, :], comb, mask=cm)
    # collapsed = sum_k pre_k * x_k in fp32 (the reference's promotion), one cast to the stream dtype.
    x_row = x_ptr + t * N * H + i[:, None] * H
    for h0 in range(0, H, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        h_ok = offs < H
        x = tl.load(x_row + offs[None, :], mask=vi[:, None] & h_ok[None, :], other=0.0).to(tl.float32)
        c = tl.sum(pre[:, None] * x, axis=0)
        tl.store(col_ptr + t * H + offs, _to_out(c, col_ptr.dtype.element_ty, INTERPRET), mask=h_ok)


@triton.jit
def _round(v, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    return _to_out(v, dtype, INTERPRET).to(tl.float32)


@triton.jit
def _post_kernel(x_ptr, o_ptr, post_ptr, comb_ptr, y_ptr, H,
                 N: tl.constexpr, NP: tl.constexpr, BLOCK_H: tl.constexpr, INTERPRET: tl.constexpr):
    """y[t, k, h-block] = rnd(rnd(rnd(post_k) * out) + rnd(sum_j rnd(comb[j, k]) * x_j)), rnd = stream dtype."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs < H
    j = tl.arange(0, NP)
    vj = j < N
    # The whole [N, BLOCK_H] tile is loaded before any store, so y may alias x (in-place update).
    x = tl.load(x_ptr + t * N * H + j[:, None] * H + offs[None, :], mask=vj[:, None] & h_ok[None, :],
                other=0.0).to(tl.float32)
    o = tl.load(o_ptr + t * H + offs, mask=h_ok, other=0.0).to(tl.float32)
    for k in tl.static_range(N):
        p = _round(tl.load(post_ptr + t * N + k), y_ptr.dtype.element_ty, INTERPRET)
        c = _round(tl.load(comb_ptr + t * N * N + j * N + k, mask=vj, other=0.0), y_ptr.dtype.element_ty, INTERPRET)
        # p * o is exact in fp32 for bf16 operands, then rounded as torch's bf16 multiply does.
        a = _round(p * o, y_ptr.dtype.element_ty, INTERPRET)
        mix = _round(tl.sum(c[:, None] * x, axis=0), y_ptr.dtype.element_ty, INTERPRET)
        tl.store(y_ptr + (t * N + k) * H + offs, _to_out(a + mix, y_ptr.dtype.element_ty, INTERPRET), mask=h_ok)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if POISON_SCRATCH:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _collapse(streams, fn, base, scale, iters, hc_eps, norm_eps, head, out):
    """Shared by hc_pre and hc_head: mixes kernel, then finish kernel; returns (collapsed, post, comb)."""
    t, n, h = streams.shape
    rows, k = fn.shape
    assert k == n * h and rows == (n if head else (2 + n) * n), (tuple(fn.shape), tuple(streams.shape))
    assert K_CHUNK % BLOCK_K == 0
    x = streams.contiguous()
    fn, base, scale = fn.float().contiguous(), base.float().contiguous(), scale.float().contiguous()
    dev = streams.device
    collapsed = out if out is not None else torch.empty((t, h), dtype=streams.dtype, device=dev)
    assert collapsed.shape == (t, h) and collapsed.dtype == streams.dtype and collapsed.is_contiguous()
    # hc_head has no post/comb: the finish kernel never touches them, so pass the output as a stand-in.
    post = collapsed if head else _empty((t, n), torch.float32, dev)
    comb = collapsed if head else _empty((t, n, n), torch.float32, dev)
    if t == 0:
        return collapsed, post, comb
    mp = max(16, triton.next_power_of_2(rows + 1))  # tl.dot's minimum N; one spare column for sum x^2
    split = triton.cdiv(k, K_CHUNK)
    part = _empty((split, t, mp), torch.float32, dev)
    _mixes_kernel[(triton.cdiv(t, BLOCK_T), split)](x, fn, part, t, k, rows,
                                                    K_CHUNK=K_CHUNK, BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K, MP=mp,
                                                    num_warps=4)
    _finish_kernel[(t,)](x, part, base, scale, collapsed, post, comb, t, h, rows, int(iters),
                         float(hc_eps), float(norm_eps),
                         N=n, NP=triton.next_power_of_2(n), SPLIT=split, MP=mp,
                         BLOCK_H=min(BLOCK_H, triton.next_power_of_2(h)), HEAD=head, INTERPRET=_INTERPRET,
                         num_warps=4)
    return collapsed, post, comb


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           sinkhorn_iters: int, hc_eps: float, norm_eps: float, *, out: torch.Tensor | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, H] -> (collapsed [T, H] in streams.dtype, post [T, N] fp32, comb [T, N, N] fp32)."""
    assert sinkhorn_iters >= 1
    return _collapse(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, False, out)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Final collapse [T, N, H] -> [T, H] with a sigmoid ``pre`` (fn [N, N*H], base [N], scale [1])."""
    return _collapse(streams, fn, base, scale, 1, hc_eps, norm_eps, True, out)[0]


def hc_post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
            result: torch.Tensor | None = None) -> torch.Tensor:
    """new_k = post_k * out + sum_j comb[j, k] * streams_j -> [T, N, H] in streams.dtype.

    ``result`` may be ``streams`` itself (in-place update: each program reads its tile before writing it).
    """
    t, n, h = streams.shape
    assert out.shape == (t, h) and out.dtype == streams.dtype, (tuple(out.shape), out.dtype, streams.dtype)
    assert post.shape == (t, n) and comb.shape == (t, n, n)
    x = streams.contiguous()
    y = result if result is not None else torch.empty_like(x)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    if t == 0:
        return y
    block_h = min(BLOCK_H, triton.next_power_of_2(h))
    _post_kernel[(t, triton.cdiv(h, block_h))](x, out.contiguous(), post.float().contiguous(),
                                               comb.float().contiguous(), y, h,
                                               N=n, NP=triton.next_power_of_2(n), BLOCK_H=block_h,
                                               INTERPRET=_INTERPRET, num_warps=4)
    return y
