"""The tiles of the FP4 expert GEMMs (``moe_experts.py``): one program's share of kernel 1 (gate and up rows,
clamped SwiGLU) and of kernel 2 (rows of a plain grouped GEMM), as functions of the tile's coordinates, so
that the two-launch kernels (``moe_experts.py``) and the one-launch queue kernel (``moe_one_launch.py``) run
the same code on the same data and get the same bits. Layouts and the K order: ``fp4_codes.py``; the
reasons for the tile shapes: ``moe_experts.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.ops.triton.fp4_codes import dequant_fp4, k_order_rows, tile_offsets, tile_step


@triton.jit
def _split_bf16(a):
    """fp32 -> (hi, mid, lo) bf16 with hi + mid + lo == a exactly (8 + 8 + 8 significand bits)."""
    a = a.to(tl.float32)
    hi = a.to(tl.bfloat16)
    r = a - hi.to(tl.float32)  # exact
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _mma(a, b, acc, INTERPRET: tl.constexpr):
    """acc += a @ b for bf16 a, b with fp32 accumulation."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def clamped_swiglu(g, u, limit):
    """The experts' activation on fp32 sums; one definition for the fused and the split gate/up paths."""
    gate = tl.minimum(g, limit)
    up = tl.minimum(tl.maximum(u, -limit), limit)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def to_out(v, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> dtype, round to nearest even (the interpreter truncates fp32 -> bf16: round its bits first)."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            u = v.to(tl.uint32, bitcast=True)
            v = (u + 0x7FFF + ((u >> 16) & 1)).to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def block_rows(pair_ptr, expert_ptr, mb, BM: tl.constexpr):
    """M-block ``mb``'s expert (-1: unused block) and its BM pair ids (-1: padding)."""
    e = tl.load(expert_ptr + mb)
    pair = tl.load(pair_ptr + mb * BM + tl.arange(0, BM))
    return e, pair


@triton.jit
def gate_up_tile(x_ptr, w13_ptr, s13_ptr, h_ptr, e, pair, nb, K, N, stride_x, stride_we, stride_wn, stride_se,
                 stride_sn, stride_h, limit, topk, SCALE_U8: tl.constexpr, SPLIT: tl.constexpr,
                 INTERPRET: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                 W_TILED: tl.constexpr, S_TILED: tl.constexpr, W_PLACED: tl.constexpr):
    """Kernel 1's tile: expert ``e``'s gate and up rows [nb*BN, (nb+1)*BN) for the m-block's pairs ``pair``."""
    valid = pair >= 0
    tok = tl.where(valid, pair // topk, 0).to(tl.int64)
    offs_n = nb * BN + tl.arange(0, BN)
    w_mask = (offs_n < N)[:, None]
    x_mask = valid[None, :]
    # Loop-invariant offset tiles plus scalar bases: strides arrive as (16-divisible) arguments, so Triton
    # can prove 16-byte alignment and issue vector loads; carrying 64-bit pointer tiles would cost registers.
    w_off = tile_offsets(offs_n, stride_wn, BK // 8, W_TILED)  # int32 words
    s_off = tile_offsets(offs_n, stride_sn, BK // 32, S_TILED)
    x_off = tok[None, :] * stride_x + tl.arange(0, BK)[:, None]  # x^T tile [BK, BM]: the MMA's B operand
    g_w = w13_ptr + e.to(tl.int64) * stride_we
    u_w = g_w + N * stride_wn
    g_s = s13_ptr + e.to(tl.int64) * stride_se
    u_s = g_s + N * stride_sn
    sg = tl.load(g_s + s_off, mask=w_mask, other=0)
    su = tl.load(u_s + s_off, mask=w_mask, other=0)
    acc_g = tl.zeros([BN, BM], dtype=tl.float32)
    acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, K, BK):  # the full reduction, always in this order (no split-K)
        # Weights and activations are software-pipelined by Triton (cp.async, num_stages deep). Scale
        # bytes are too narrow for that (2-byte loads per thread), so the next step's are fetched by hand,
        # one step ahead (reading them as 32-bit words through the pipeline measured 24% slower: bench/results run 27).
        kn = k0 + BK
        s_next = tile_step(kn, BK, BK // 32, S_TILED)
        sg_n = tl.load(g_s + s_next + s_off, mask=w_mask & (kn < K), other=0)
        su_n = tl.load(u_s + s_next + s_off, mask=w_mask & (kn < K), other=0)
        pg = tl.load(g_w + tile_step(k0, BK, BK // 8, W_TILED) + w_off, mask=w_mask, other=0)
        pu = tl.load(u_w + tile_step(k0, BK, BK // 8, W_TILED) + w_off, mask=w_mask, other=0)
        wg = dequant_fp4(pg, sg, BN, BK, SCALE_U8, INTERPRET, W_PLACED)
        wu = dequant_fp4(pu, su, BN, BK, SCALE_U8, INTERPRET, W_PLACED)
        xt = k_order_rows(tl.load(x_ptr + k0 + x_off, mask=x_mask, other=0.0), BK, BM)
        if SPLIT == 1:
            xb = xt.to(tl.bfloat16)
            acc_g = _mma(wg, xb, acc_g, INTERPRET)
            acc_u = _mma(wu, xb, acc_u, INTERPRET)
        else:
            x_hi, x_mid, x_lo = _split_bf16(xt)
            acc_g = _mma(wg, x_hi, acc_g, INTERPRET)
            acc_g = _mma(wg, x_mid, acc_g, INTERPRET)
            acc_g = _mma(wg, x_lo, acc_g, INTERPRET)
            acc_u = _mma(wu, x_hi, acc_u, INTERPRET)
            acc_u = _mma(wu, x_mid, acc_u, INTERPRET)
            acc_u = _mma(wu, x_lo, acc_u, INTERPRET)
        sg, su = sg_n, su_n
    hval = clamped_swiglu(acc_g, acc_u, limit)
    h_ptrs = h_ptr + tl.where(valid, pair, 0).to(tl.int64)[None, :] * stride_h + offs_n[:, None]
    tl.store(h_ptrs, to_out(hval, h_ptr.dtype.element_ty, INTERPRET), mask=x_mask & w_mask)


@triton.jit
def matmul_tile(h_ptr, w2_ptr, s2_ptr, y_ptr, e, pair, nb, pid_k, K, N, stride_h, stride_we, stride_wn, stride_se,
                stride_sn, stride_y, row_div, k_per_split, stride_split, SCALE_U8: tl.constexpr,
                SPLIT: tl.constexpr, INTERPRET: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, K_SPLITS: tl.constexpr, W_TILED: tl.constexpr, S_TILED: tl.constexpr,
                W_PLACED: tl.constexpr, A_CACHE: tl.constexpr):
    """Kernel 2's tile: expert ``e``'s rows [nb*BN, (nb+1)*BN), K chunk ``pid_k``, for the pairs ``pair``.
    ``A_CACHE``: the activations' load cache modifier (".cg" where another program wrote them this launch)."""
    valid = pair >= 0
    row = tl.where(valid, pair // row_div, 0).to(tl.int64)
    out_row = tl.where(valid, pair, 0).to(tl.int64)
    offs_n = nb * BN + tl.arange(0, BN)
    w_mask = (offs_n < N)[:, None]
    a_mask = valid[None, :]
    w_off = tile_offsets(offs_n, stride_wn, BK // 8, W_TILED)  # int32 words
    s_off = tile_offsets(offs_n, stride_sn, BK // 32, S_TILED)
    a_off = row[None, :] * stride_h + tl.arange(0, BK)[:, None]  # h^T tile [BK, BM]
    w_base = w2_ptr + e.to(tl.int64) * stride_we
    s_base = s2_ptr + e.to(tl.int64) * stride_se
    if K_SPLITS == 1:  # a loop over [0, K) compiles tighter (~6% fewer instructions per step)
        k_lo = 0
        k_hi = K
    else:
        k_lo = pid_k * k_per_split
        k_hi = k_lo + k_per_split
    sw = tl.load(s_base + tile_step(k_lo, BK, BK // 32, S_TILED) + s_off, mask=w_mask, other=0)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kn = k0 + BK
        sw_n = tl.load(s_base + tile_step(kn, BK, BK // 32, S_TILED) + s_off,  # one step ahead
                       mask=w_mask & (kn < k_hi), other=0)
        pw = tl.load(w_base + tile_step(k0, BK, BK // 8, W_TILED) + w_off, mask=w_mask, other=0)
        w = dequant_fp4(pw, sw, BN, BK, SCALE_U8, INTERPRET, W_PLACED)
        at = k_order_rows(tl.load(h_ptr + k0 + a_off, mask=a_mask, other=0.0, cache_modifier=A_CACHE), BK, BM)
        if SPLIT == 1:
            acc = _mma(w, at.to(tl.bfloat16), acc, INTERPRET)
        else:
            a_hi, a_mid, a_lo = _split_bf16(at)
            acc = _mma(w, a_hi, acc, INTERPRET)
            acc = _mma(w, a_mid, acc, INTERPRET)
            acc = _mma(w, a_lo, acc, INTERPRET)
        sw = sw_n
    y_ptr += tl.cast(pid_k, tl.int64) * stride_split
    tl.store(y_ptr + out_row[None, :] * stride_y + offs_n[:, None], acc, mask=a_mask & w_mask)
