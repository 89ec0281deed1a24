"""One mHC site's ``hc_post`` and the next site's ``hc_pre`` in two launches instead of three.

Twin of ``ops/ref/mhc.py:hc_post_pre`` (``hc_post`` then ``hc_pre`` on its result). Between two blocks of
the model (attention -> MoE, and one layer -> the next) the new streams that ``hc_post`` writes are exactly
what the next ``hc_pre``'s mixes kernel reads. Here one kernel does both per tile: it computes the new
streams of a 128-column chunk, stores them, and multiplies the same values into that chunk's mixes
partials (two passes, below). The finish kernel (Sinkhorn + collapse) is ``mhc.finish``, unchanged.

Why: in a decode step the mHC launches are latency-bound (post ~2.5 µs, mixes ~4.9 µs, finish ~5 µs at one
token; bench/results/NOTES.md run 57), and four sites per layer run on the critical path. Folding the post
kernel into the mixes kernel drops one launch and one DRAM round trip of the streams per site (the mixes
kernel re-read what the post kernel had just written); in prefill it also saves that re-read (T x 32 KB).

Program (stream k, chunk c, block of BLOCK_T tokens), grid (N, H / K_CHUNK, T / BLOCK_T), stream fastest:
  * new_k[t, chunk] = rnd(rnd(rnd(post_k) * out) + rnd(sum_j rnd(comb[j, k]) * x_j)), rounding where
    ``hc_post`` and the reference round (rnd = the stream dtype). The 4-term mix sums in stream order
    (exact products, so FMA contraction does not matter there); ``enable_fp_fusion=False`` keeps
    rnd(post * out) (see ``mhc.py``).
  * Pass 1 (no stores): per BLOCK_K-column step, the new values feed ``tl.dot(new, fn[:, k*H + chunk].T)``
    in tf32x3 and the sum of squares: the mixes kernel's tiles, steps and precision on chunk
    s = k * H / K_CHUNK + c. The steps are unrolled, so every load can issue at once.
  * Pass 2: the same values again from the inputs (now in L1), stored. Stores in pass 1 would keep the
    compiler from hoisting later loads above them (the output may alias the inputs as far as it knows):
    run 66 measured that form slower than the two kernels it replaces.
  * Each program reads all N streams of its chunk but writes one: the N programs of a chunk start together
    (stream is the fastest grid axis), so the re-reads come from L2.
  8 warps: 188 registers, no spills (4 warps: 255 and a spill; ``bench/kernels/loop_sass.py``-style compile).
  Needs H % K_CHUNK == 0 (each chunk inside one stream) and an output that is not the input (other
  programs still read a stream that a program writes); otherwise ``hc_post`` then ``hc_pre``, same math.
Batch invariance: a token's arithmetic does not depend on T or on its neighbours (constant blocks, the dot's
rows independent), as in ``mhc.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.triton import mhc
from deepinfer.ops.triton.mhc import _round, _to_out

# One launch for the post and the mixes; A/Bs switch it off to compare with hc_post then hc_pre.
FUSE = True
NUM_WARPS = 8


@triton.jit
def _new_stream(x_ptr, o_ptr, comb_ptr, p, t, t_ok, k, H, K, offs_h, N: tl.constexpr, dt: tl.constexpr,
                INTERPRET: tl.constexpr):
    """hc_post's value of stream k on the columns offs_h, rounded to the stream dtype, as fp32."""
    ok = t_ok[:, None] & (offs_h < H)[None, :]
    o = tl.load(o_ptr + t[:, None] * H + offs_h[None, :], mask=ok, other=0.0).to(tl.float32)
    a = _round(p[:, None] * o, dt, INTERPRET)  # p * o is exact in fp32 for bf16 operands
    mix = tl.zeros(o.shape, dtype=tl.float32)
    for j in tl.static_range(N):
        cj = _round(tl.load(comb_ptr + t * N * N + j * N + k, mask=t_ok, other=0.0), dt, INTERPRET)
        xj = tl.load(x_ptr + t[:, None] * K + j * H + offs_h[None, :], mask=ok, other=0.0).to(tl.float32)
        mix += cj[:, None] * xj
    return _round(a + _round(mix, dt, INTERPRET), dt, INTERPRET)


@triton.jit(do_not_specialize=["T"])
def _post_mixes_kernel(x_ptr, o_ptr, post_ptr, comb_ptr, y_ptr, fn_ptr, part_ptr, T, H, ROWS,
                       N: tl.constexpr, K_CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                       MP: tl.constexpr, INTERPRET: tl.constexpr):
    """y[t, k, chunk c] (hc_post) and part[k*H/K_CHUNK + c, t, :] (hc_pre's mixes partials of y)."""
    k = tl.program_id(0)
    c = tl.program_id(1)
    offs_t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = offs_t < T
    t = offs_t.to(tl.int64)
    dt: tl.constexpr = y_ptr.dtype.element_ty
    K = N * H
    offs_m = tl.arange(0, MP)
    p = _round(tl.load(post_ptr + t * N + k, mask=t_ok, other=0.0), dt, INTERPRET)
    acc = tl.zeros([BLOCK_T, MP], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    # Pass 1, no stores: the mixes of the new values, every step's loads free to issue at once (unrolled).
    for kk in tl.static_range(0, K_CHUNK, BLOCK_K):
        offs_h = c * K_CHUNK + kk + tl.arange(0, BLOCK_K)
        w = tl.load(fn_ptr + offs_m[None, :] * K + (k * H + offs_h)[:, None],
                    mask=(offs_m[None, :] < ROWS) & (offs_h < H)[:, None], other=0.0)
        y = _new_stream(x_ptr, o_ptr, comb_ptr, p, t, t_ok, k, H, K, offs_h, N, dt, INTERPRET)
        sq = tl.fma(y, y, sq)
        acc = tl.dot(y, w, acc, input_precision="tf32x3")  # fp32-level, as the mixes kernel
    # fn's padded columns are zero, so column ROWS of acc is free for the sum of squares (as _mixes_kernel).
    acc = tl.where(offs_m[None, :] == ROWS, tl.sum(sq, axis=1)[:, None], acc)
    s = k * tl.cdiv(H, K_CHUNK) + c
    rows = (s * T + t) * (ROWS + 1)
    tl.store(part_ptr + rows[:, None] + offs_m[None, :], acc, mask=t_ok[:, None] & (offs_m[None, :] <= ROWS))
    # Pass 2: the same values again from the L1-resident inputs, stored. A store per step in pass 1 kept the
    # compiler from hoisting the next step's loads above it (y may alias x): four serial DRAM round trips,
    # slower than the two kernels it replaced (run 66).
    for kk in tl.static_range(0, K_CHUNK, BLOCK_K):
        offs_h = c * K_CHUNK + kk + tl.arange(0, BLOCK_K)
        y = _new_stream(x_ptr, o_ptr, comb_ptr, p, t, t_ok, k, H, K, offs_h, N, dt, INTERPRET)
        tl.store(y_ptr + t[:, None] * K + k * H + offs_h[None, :], _to_out(y, dt, INTERPRET),
                 mask=t_ok[:, None] & (offs_h < H)[None, :])


def hc_post_pre(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int, hc_eps: float,
                norm_eps: float, *, result: torch.Tensor | None = None, collapsed: torch.Tensor | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hc_post(streams, out, post, comb) -> new streams, then hc_pre(new streams, fn, base, scale, ...):
    returns (new streams [T, N, H], collapsed [T, H], post' [T, N] fp32, comb' [T, N, N] fp32)."""
    t, n, h = streams.shape
    rows, k = fn.shape
    assert k == n * h and rows == (2 + n) * n and sinkhorn_iters >= 1, (tuple(fn.shape), tuple(streams.shape))
    assert out.shape == (t, h) and out.dtype == streams.dtype, (tuple(out.shape), out.dtype, streams.dtype)
    assert post.shape == (t, n) and comb.shape == (t, n, n)
    x = streams.contiguous()
    block_k = min(mhc.BLOCK_K, mhc.K_CHUNK)
    aliased = result is not None and result.data_ptr() == x.data_ptr()
    if not FUSE or t == 0 or h % mhc.K_CHUNK or mhc.K_CHUNK % block_k or aliased:
        new = mhc.hc_post(x, out, post, comb, result=result)
        return (new, *mhc.hc_pre(new, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, out=collapsed))
    y = result if result is not None else torch.empty_like(x)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    fn = fn.float().contiguous()
    mp = max(16, triton.next_power_of_2(rows + 1))
    split = k // mhc.K_CHUNK
    part = mhc._empty((split, t, rows + 1), torch.float32, x.device)
    grid = (n, h // mhc.K_CHUNK, triton.cdiv(t, mhc.BLOCK_T))
    _post_mixes_kernel[grid](x, out.contiguous(), post.float().contiguous(), comb.float().contiguous(), y, fn,
                             part, t, h, rows, N=n, K_CHUNK=mhc.K_CHUNK, BLOCK_T=mhc.BLOCK_T, BLOCK_K=block_k, MP=mp,
                             INTERPRET=mhc._INTERPRET, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return (y, *mhc.finish(y, part, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, False, collapsed))
