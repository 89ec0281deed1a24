"""mHC in Triton: ``hc_pre``, ``hc_post`` and ``hc_head``, twins of ``ops/ref/mhc.py``.

Same signatures as the reference, plus keyword-only output tensors: ``out=`` (collapsed) for ``hc_pre`` and
``hc_head``, ``result=`` (new streams, may be ``streams`` itself) for ``hc_post``, whose ``out`` is taken.

Why: the reference spends ~60 tiny launches per ``hc_pre`` (the Sinkhorn rounds on [T, N, N]), twice per
layer; in decode the launches, not the bytes, set the step time. Here ``hc_pre`` is two launches,
``hc_post`` one, whatever ``sinkhorn_iters`` is.

Plan (no host sync, no atomics, so a call can be captured in a CUDA graph). Numbers for V4-Flash: N=4,
H=4096, K=N*H=16384, fn [24, K] fp32 = 1.5 MB, bf16 streams (32 KB per token); byte counts per program.
  mixes kernel   per (block of BLOCK_T=64 tokens, K chunk of K_CHUNK=128 columns): the partial products
                 x @ fn.T (``tl.dot`` in tf32x3, see below; one wgmma warpgroup, m64n32k8) and the
                 partial sum of squares of x, stored as one row of ROWS+1 = 25 floats per token and chunk
                 (the sum of squares last). Four BLOCK_K=32 steps, all four steps' loads in flight at
                 once (num_stages=5).
                 Decode: K/K_CHUNK = 128 programs (about one per SM), each one DRAM round trip for 12 KB
                 of fn and 256 B of x, then 4 x 12 wgmma. The old kernel had 16 programs, each 16 serial
                 steps of an fp32 FMA-loop dot.
                 Prefill T=4096: 64 x 128 programs, each reading 16 KB of x from DRAM (134 MB in all, once)
                 and a 12 KB fn tile from L2 (shared by 64 tokens: 96 MB of L2 reads in all), writing
                 6.4 KB of partials (52 MB). Compiled for sm_90: 116 registers (4 programs per SM), 40 KB
                 of shared memory, ~320 instructions per warp and step: ~42M warp instructions in all,
                 ~13 GFLOP of tf32 MMA (3 passes, 32 padded columns).
  finish kernel  grid (T, HS + 1) or (T, 1): the token's chunk rows summed (one [SPLIT, .] tile per field
                 reduced by ``tl.sum``), rsqrt(mean(x^2) + eps), then
                 - collapse programs: pre = sigmoid(...) and collapsed = sum_k pre_k * x_k over the
                   program's run of BLOCK_H=512 blocks (fp32, one cast; 4 KB of streams per block, the
                   next block's load issued before the current block's math);
                 - the Sinkhorn program (p == SINK): post, the softmax and the Sinkhorn rounds on the
                   N x N matrix in registers; it stores post and comb.
                 HS = min(H / BLOCK_H, ceil(FINISH_PROGRAMS / T)). Decode: 8 collapse programs, each
                 loading its 4 KB block first, beside one Sinkhorn program, so the collapse runs on 8 SMs
                 in parallel with the Sinkhorn (~20 dependent rounds of shuffles and divisions, the
                 critical path) instead of 8 serial 512-column steps after it (the old kernel: one
                 4-warp program per token). From T = FINISH_PROGRAMS on, one program per token does
                 it all: the tokens fill the GPU, and it reads 134 MB of streams + 52 MB of partials and
                 writes 33 MB. One warp per program: 16 values cannot use more (a 4-warp program ran
                 the Sinkhorn four times); 80 registers, so up to ~24 programs per SM.
  post kernel    per (token, POST_BLOCK_H=1024 columns): new_k = post_k * out + sum_j comb[j, k] * x_j.
                 4 warps x 32 lanes x one 16-byte bf16 vector per stream row: 8 KB of streams + 2 KB of
                 out in flight per program, 64 registers (8 programs, 80 KB in flight per SM). The N
                 streams of a column sit in one thread, so the 4-term mix is in registers (the old
                 [4, 512] tile split rows across warps: 19 barriers and shared-memory round trips per
                 program). post and comb are loaded once, and the [N, 1024] tile is stored once after
                 every load (the old kernel stored each stream, then loaded the next comb column: the
                 compiler cannot hoist a load above a store that may alias it, so each program waited
                 out 4 serial load round trips).
                 Prefill T=4096: 16384 programs moving 134 + 33 MB in and 134 MB out.

Why these choices:
* Split over K, not one program per token: a token's program would read all of fn from L2 alone,
  serialising decode on one SM. K chunks spread that read over K/K_CHUNK programs; tokens are blocked by
  BLOCK_T so prefill reuses each fn tile across 64 tokens. One launch for everything would need a
  grid-wide barrier (atomic ticket); the second launch is cheaper.
* tf32x3 (``tl.dot(..., input_precision="tf32x3")``, Triton's 3xTF32: a = a_hi + a_lo with a_hi rounded to
  tf32, then (a_lo*b_hi + a_hi*b_lo) + a_hi*b_hi on tensor cores, per BLOCK_K step): ~2^-21 relative
  error per product, so fp32-level on the 16384-term dot (bf16 streams are exact in tf32: only fn is
  really split). An emulation at V4 shapes gives rel_err ~6e-7 on comb and ~2e-7 on post against the
  reference, as an fp32 dot in another order does; plain tf32 gives ~4e-4 on comb. IEEE fp32 lowers to
  FMA loops (the old 39 us decode call). The CPU interpreter computes every precision as an fp32 matmul.
* Batch invariance: K_CHUNK, BLOCK_K, BLOCK_T, BLOCK_H, POST_BLOCK_H and the warp counts are constants, so
  a token's sums run in the same order whatever T is, and its row of a ``tl.dot`` does not depend on the
  other rows. The kernels are not specialised on T or on the finish grid's arguments
  (``do_not_specialize``): one binary for every batch. The finish grid depends on T, but only changes
  which program does a block or the Sinkhorn, not the arithmetic (one loop body computes every collapse
  block; the Sinkhorn code is the same whether its program also collapses or not).
* Normalise after the dot: r * (x @ fn.T) equals (r * x) @ fn.T, the reference's order, up to fp32
  rounding; it lets one pass over x give both the sums of squares and the products.
* Sinkhorn and the softmax use round-to-nearest division (``div_rn``) like torch: the default fp32 ``/``
  on the GPU is approximate (2 ulp) and 2*iters divisions would compound. The Sinkhorn rounds take the
  correctly rounded division's own fast path without its per-division branch (``_div_fast``, the same bits
  while the operands stay in a range the kernel checks, else the rounds are redone with ``div_rn``): the
  divisions of a round overlap instead of running one after another, hc_pre 11.7 -> 8.3 µs at T = 1
  (bench/results/README.md, run 55).
* ``hc_post`` rounds where the reference rounds (post and comb cast to the stream dtype, post*out rounded,
  the comb mix accumulated in fp32 and rounded as a matmul does, then the rounded sum), so bf16 results
  match it bit for bit except where the 4-term fp32 mix sums in another order (rare 1-ulp flips: 4e-6
  of the elements at V4 shapes under the interpreter). It is compiled with ``enable_fp_fusion=False``:
  with fusion, LLVM narrows rnd(post*out) to a bf16 multiply and then contracts fpext(that) + mix into
  one fp32 FMA (visible in the sm_90 PTX), dropping the rounding of post*out: the H200 run's rel_err
  1.7e-3 against the reference, which an emulation of the dropped rounding reproduces (1.4e-3 to 1.9e-3,
  ~20% of elements one ulp off). Without fusion the product is a correctly rounded ``mul.rn.bf16`` and
  the sum a correctly rounded bf16 add. (The mix's products, 8-bit by 8-bit significands, are exact in
  fp32 either way.)
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.ops.tuning import H200, KernelTuning

# Triton 3.6's CPU interpreter truncates fp32 -> bf16; interpreted runs round the bits first (``_to_out``).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Tests set this: the partial-sum scratch and internally allocated outputs start as NaN.
POISON_SCRATCH = False
K_CHUNK = 128  # columns of x per mixes program; a function of nothing but this constant (batch invariance)
BLOCK_T = 64  # tokens per mixes program (tl.dot M: one wgmma warpgroup; each fn tile serves 64 tokens)
BLOCK_K = 32  # inner step of the mixes loop; min(BLOCK_K, K_CHUNK) divides K_CHUNK
BLOCK_H = 512  # H elements per collapse step of the finish kernel (4 KB of bf16 streams per step)
POST_BLOCK_H = 1024  # H elements per post program: 4 warps x 32 lanes x 8 (one 16-byte bf16 vector each)
FINISH_PROGRAMS = 1024  # collapse programs per token: min(H blocks, ceil(FINISH_PROGRAMS / T))


@triton.jit
def _to_out(v, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> dtype, round to nearest even (the interpreter truncates fp32 -> bf16: round its bits first).

    The low 16 bits are cleared too, so the interpreter's conversion gets an exact bf16 value (it does not
    simply truncate subnormal fp32: 0 + 0x7FFF came out as a tiny non-zero bf16).
    """
    if INTERPRET:
        if dtype == tl.bfloat16:
            u = v.to(tl.uint32, bitcast=True)
            v = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit(do_not_specialize=["T"])
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
        acc = tl.dot(x, w, acc, input_precision="tf32x3")  # fp32-level; plain tf32: ~4e-4 on comb
    # fn's padded columns are zero, so column ROWS of acc is free for the sum of squares.
    acc = tl.where(offs_m[None, :] == ROWS, tl.sum(sq, axis=1)[:, None], acc)
    rows = (s * T + offs_t.to(tl.int64)) * (ROWS + 1)
    tl.store(part_ptr + rows[:, None] + offs_m[None, :], acc, mask=t_ok[:, None] & (offs_m[None, :] <= ROWS))


@triton.jit
def _sinkhorn_rounds(comb, iters, hc_eps):
    """One column normalisation, then (iters - 1) row/column rounds, each a correctly rounded division."""
    comb = tl.div_rn(comb, tl.sum(comb, axis=0)[None, :] + hc_eps)
    for _ in range(iters - 1):
        comb = tl.div_rn(comb, tl.sum(comb, axis=1)[:, None] + hc_eps)
        comb = tl.div_rn(comb, tl.sum(comb, axis=0)[None, :] + hc_eps)
    return comb


@triton.jit
def _div_fast(x, d):
    """x / d by the fast path of the GPU's correctly rounded fp32 division (reciprocal estimate, one Newton
    step, one residual correction), without its range check and its branch to the slow path. The compiled
    ``div_rn`` puts each division behind that branch, so a Sinkhorn round's divisions ran one after the
    other (~50 cycles each, 8 per round, ~20 rounds: most of the finish kernel's time); these overlap. The
    result equals ``div_rn``'s wherever the check would pass: both operands' magnitudes well inside the
    normal range (the caller tracks them)."""
    return tl.inline_asm_elementwise(
        "{ .reg .f32 r, e, q, nd; rcp.approx.ftz.f32 r, $2; neg.f32 nd, $2; fma.rn.f32 e, nd, r, 0f3F800000; "
        "fma.rn.f32 r, r, e, r; mul.rn.f32 q, $1, r; fma.rn.f32 e, nd, q, $1; fma.rn.f32 $0, e, r, q; }",
        "=f,f,f", [x, tl.broadcast_to(d, x.shape)], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _span(bounds, v, cm):
    """(lo, hi): running min / max of the magnitudes of ``v`` (dividends, divisors) over the valid entries."""
    lo, hi = bounds
    a = tl.where(cm, tl.abs(tl.broadcast_to(v, lo.shape)), 1.0)
    return tl.minimum(lo, a), tl.maximum(hi, a)


@triton.jit(do_not_specialize=["T", "BLOCKS", "SINK"])
def _finish_kernel(x_ptr, part_ptr, base_ptr, scale_ptr, col_ptr, post_ptr, comb_ptr,
                   T, H, ROWS, iters, hc_eps, norm_eps, BLOCKS, SINK,
                   N: tl.constexpr, NP: tl.constexpr, SPLIT: tl.constexpr, SP: tl.constexpr,
                   BLOCK_H: tl.constexpr, HEAD: tl.constexpr, INTERPRET: tl.constexpr,
                   FAST_DIV: tl.constexpr = False):
    """Token t, program p: collapsed for H blocks [p*BLOCKS, (p+1)*BLOCKS); post and comb if p == SINK."""
    t = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    b0 = p * BLOCKS
    b1 = tl.minimum(b0 + BLOCKS, tl.cdiv(H, BLOCK_H))  # b1 <= b0 for a Sinkhorn-only program
    h_end = tl.minimum(b1 * BLOCK_H, H)
    i = tl.arange(0, NP)
    j = tl.arange(0, NP)
    vi = i < N
    cm = vi[:, None] & (j[None, :] < N)
    # Loads first, so their latencies overlap: the first x block (not needed until the collapse), the
    # scale and bases, and the token's SPLIT chunk rows, one tile per field, reduced by tl.sum (a fixed
    # shape, so a fixed order).
    x_row = x_ptr + t * N * H + i[:, None] * H
    offs = b0 * BLOCK_H + tl.arange(0, BLOCK_H)
    x = tl.load(x_row + offs[None, :], mask=vi[:, None] & (offs < h_end)[None, :], other=0.0)
    pre_s = tl.load(scale_ptr)
    pre_b = tl.load(base_ptr + i, mask=vi, other=0.0)
    s = tl.arange(0, SP)
    vs = s < SPLIT
    row = part_ptr + (s.to(tl.int64) * T + t) * (ROWS + 1)
    ss = tl.sum(tl.load(row + ROWS, mask=vs, other=0.0), axis=0)
    m_pre = tl.sum(tl.load(row[:, None] + i[None, :], mask=vs[:, None] & vi[None, :], other=0.0), axis=0)
    if not HEAD:  # post and comb inputs: loaded by the Sinkhorn program only (masked off elsewhere)
        sv = vs & (p == SINK)
        post_s = tl.load(scale_ptr + 1)
        comb_s = tl.load(scale_ptr + 2)
        post_b = tl.load(base_ptr + N + i, mask=vi, other=0.0)
        comb_b = tl.load(base_ptr + 2 * N + i[:, None] * N + j[None, :], mask=cm, other=0.0)
        m_post = tl.sum(tl.load(row[:, None] + N + i[None, :], mask=sv[:, None] & vi[None, :], other=0.0), axis=0)
        m_comb = tl.sum(tl.load(row[:, None, None] + 2 * N + i[None, :, None] * N + j[None, None, :],
                                mask=sv[:, None, None] & cm[None, :, :], other=0.0), axis=0)
    r = tl.rsqrt(ss / (N * H) + norm_eps)  # the token's RMS factor (exact division for a power-of-two N*H)
    if not HEAD:
        if p == SINK:
            post = 2.0 * tl.sigmoid(m_post * r * post_s + post_b)
            logit = tl.where(cm, m_comb * r * comb_s + comb_b, float("-inf"))
            mx = tl.where(vi, tl.max(logit, axis=1), 0.0)  # padded rows: keep -inf - -inf out
            e = tl.where(cm, tl.exp(logit - mx[:, None]), 0.0)
            den = tl.where(vi, tl.sum(e, axis=1), 1.0)
            comb = tl.where(cm, tl.div_rn(e, den[:, None]) + hc_eps, 0.0)  # padded entries stay 0 below
            if FAST_DIV:
                # The rounds with the division's fast path, branch-free (``_div_fast``). Its result is the
                # correctly rounded quotient whenever the operands stay inside [2^-60, 2^60]; the extreme
                # operands are tracked, and outside that range (never for softmax weights) the rounds are
                # run again with div_rn. One result either way: the same bits as div_rn.
                lo = tl.full(comb.shape, 1.0, tl.float32)
                hi = lo
                d = tl.sum(comb, axis=0)[None, :] + hc_eps
                lo, hi = _span(_span((lo, hi), comb, cm), d, cm)
                fast = _div_fast(comb, d)
                for _ in range(iters - 1):
                    d = tl.sum(fast, axis=1)[:, None] + hc_eps
                    lo, hi = _span(_span((lo, hi), fast, cm), d, cm)
                    fast = _div_fast(fast, d)
                    d = tl.sum(fast, axis=0)[None, :] + hc_eps
                    lo, hi = _span(_span((lo, hi), fast, cm), d, cm)
                    fast = _div_fast(fast, d)
                in_range = (tl.min(lo) >= 8.673617379884035e-19) & (tl.max(hi) <= 1.152921504606847e18)  # 2^+-60
                if in_range:
                    comb = fast
                else:
                    comb = _sinkhorn_rounds(comb, iters, hc_eps)
            else:
                comb = _sinkhorn_rounds(comb, iters, hc_eps)
            tl.store(post_ptr + t * N + i, post, mask=vi)
            tl.store(comb_ptr + t * N * N + i[:, None] * N + j[None, :], comb, mask=cm)
    # collapsed = sum_k pre_k * x_k in fp32 (the reference's promotion), one cast to the stream dtype. One
    # loop body for every block, whichever program runs it; the next block's load is issued first.
    pre = tl.where(vi, tl.sigmoid(m_pre * r * pre_s + pre_b) + hc_eps, 0.0)
    for b in range(b0, b1):
        offs = b * BLOCK_H + tl.arange(0, BLOCK_H)
        nxt = offs + BLOCK_H
        x_next = tl.load(x_row + nxt[None, :], mask=vi[:, None] & (nxt < h_end)[None, :], other=0.0)
        c = tl.sum(pre[:, None] * x.to(tl.float32), axis=0)
        tl.store(col_ptr + t * H + offs, _to_out(c, col_ptr.dtype.element_ty, INTERPRET), mask=offs < h_end)
        x = x_next


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
    dt: tl.constexpr = y_ptr.dtype.element_ty
    tile = t * N * H + j[:, None] * H + offs[None, :]
    ok = vj[:, None] & h_ok[None, :]
    x = tl.load(x_ptr + tile, mask=ok, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + t * H + offs, mask=h_ok, other=0.0).to(tl.float32)
    y = tl.zeros([NP, BLOCK_H], dtype=tl.float32)
    for k in tl.static_range(N):
        p = _round(tl.load(post_ptr + t * N + k), dt, INTERPRET)
        c = _round(tl.load(comb_ptr + t * N * N + j * N + k, mask=vj, other=0.0), dt, INTERPRET)
        # p * o is exact in fp32 for bf16 operands, then rounded as torch's bf16 multiply does.
        a = _round(p * o, dt, INTERPRET)
        mix = _round(tl.sum(c[:, None] * x, axis=0), dt, INTERPRET)
        y = tl.where(j[:, None] == k, (a + mix)[None, :], y)
    # One store after every load: y may alias x (in-place update).
    tl.store(y_ptr + tile, _to_out(y, dt, INTERPRET), mask=ok)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if POISON_SCRATCH:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _collapse(streams, fn, base, scale, iters, hc_eps, norm_eps, head, out, fast_div):
    """Shared by hc_pre and hc_head: mixes kernel, then finish kernel; returns (collapsed, post, comb)."""
    t, n, h = streams.shape
    rows, k = fn.shape
    assert k == n * h and rows == (n if head else (2 + n) * n), (tuple(fn.shape), tuple(streams.shape))
    block_k = min(BLOCK_K, K_CHUNK)
    assert K_CHUNK % block_k == 0
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
    part = _empty((split, t, rows + 1), torch.float32, dev)
    _mixes_kernel[(triton.cdiv(t, BLOCK_T), split)](x, fn, part, t, k, rows,
                                                    K_CHUNK=K_CHUNK, BLOCK_T=BLOCK_T, BLOCK_K=block_k, MP=mp,
                                                    num_warps=4, num_stages=min(5, K_CHUNK // block_k + 1))
    block_h = min(BLOCK_H, triton.next_power_of_2(h))
    n_blocks = triton.cdiv(h, block_h)
    # Collapse programs per token: every H block apart for small T, one program per token once T fills the
    # GPU. With more than one, an extra program runs the Sinkhorn alone (in parallel with the collapse).
    per_prog = triton.cdiv(n_blocks, max(1, min(n_blocks, triton.cdiv(FINISH_PROGRAMS, t))))
    progs = triton.cdiv(n_blocks, per_prog)
    sink = progs if progs > 1 and not head else 0
    _finish_kernel[(t, progs + (sink > 0))](
        x, part, base, scale, collapsed, post, comb, t, h, rows, int(iters), float(hc_eps), float(norm_eps),
        per_prog, sink, N=n, NP=triton.next_power_of_2(n), SPLIT=split, SP=triton.next_power_of_2(split),
        BLOCK_H=block_h, HEAD=head, INTERPRET=_INTERPRET, FAST_DIV=fast_div and not _INTERPRET, num_warps=1)
    return collapsed, post, comb


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           sinkhorn_iters: int, hc_eps: float, norm_eps: float, *, out: torch.Tensor | None = None,
           tuning: KernelTuning = H200) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [T, N, H] -> (collapsed [T, H] in streams.dtype, post [T, N] fp32, comb [T, N, N] fp32)."""
    assert sinkhorn_iters >= 1
    return _collapse(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, False, out, tuning.mhc_fast_div)


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Final collapse [T, N, H] -> [T, H] with a sigmoid ``pre`` (fn [N, N*H], base [N], scale [1])."""
    return _collapse(streams, fn, base, scale, 1, hc_eps, norm_eps, True, out, False)[0]  # no Sinkhorn here


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
    block_h = min(POST_BLOCK_H, triton.next_power_of_2(h))
    # No FMA contraction: it would drop the rounding of post*out (module docstring).
    _post_kernel[(t, triton.cdiv(h, block_h))](x, out.contiguous(), post.float().contiguous(),
                                               comb.float().contiguous(), y, h,
                                               N=n, NP=triton.next_power_of_2(n), BLOCK_H=block_h,
                                               INTERPRET=_INTERPRET, num_warps=4, enable_fp_fusion=False)
    return y
