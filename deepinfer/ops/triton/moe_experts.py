"""Routed FP4 experts as a grouped GEMM in Triton; twin of ``ops/ref/moe_experts.py`` (same signature).

Plan (all on the device, no host sync, so the whole call can be captured in a CUDA graph):
  align          group the T*k (token, slot) pairs by expert (stable), pad each expert's group to a multiple
                 of BLOCK_M -> ``pair_of_row`` (-1 = padding) and ``expert_of_block`` (-1 = unused block);
                 counting kernels in ``moe_align.py`` (one launch at decode sizes).
  kernel 1       per (m-block, n-block of I): gate and up tiles over the full H in fixed K chunks, clamped
                 SwiGLU in fp32, h[pair, n] stored in bf16 (fp32 when x is fp32).
  kernel 2       per (m-block, n-block of H): y[pair, n] = W2 h, fp32.
                 Both optionally split K (``TileConfig.split_k``): one program per (tile, K chunk), see below.
  combine        per token: out[t] = sum_j w[t, j] * y[t*k + j] in slot order, fp32, one cast to x.dtype.

Why these choices:
* No FP4 tensor cores on Hopper. Packed bytes stream from HBM into shared memory (cp.async, num_stages
  deep), each tile is dequantized in registers right before its MMA and fed to ``tl.dot`` as bf16: the
  packed bytes are the only weight traffic (4.25 bits/weight with UE8M0 scales) and dequantized weights
  never touch global memory. e2m1 times a power of two is exact in bf16, so dequantization rounds nothing
  (scales must be powers of two, as UE8M0 ones are, and at most 2; see ``_dequant_fp4``).
* Swap-AB: the weight tile is the MMA's M side (64-row multiples, what Hopper's wgmma wants) and the
  tokens are its N side (16..128). Decode then wastes no MMA rows on padding tokens, and every tile
  config uses the same instruction family (wgmma m64nNk16, bf16 -> fp32), differing only in N.
* Batch invariance (determinism.md §2.2): a pair's row is one column of a tile; its value depends on its
  own activations, the expert's weights, BLOCK_K and the K chunk only, all functions of (H, I) alone;
  BLOCK_M and the rest vary with the shape bucket. The combine is a fixed slot-order sum.
* Fixed K chunks (``k_chunk``): every config reduces as acc = 0; per chunk in order: part = 0, part += W x
  over its BLOCK_K steps, acc = acc + part. So a config may run each chunk in its own program (split-K)
  with the same bits: batch-1 decode gets 768 programs of 8 K steps instead of 192 of 32 (kernel 1) on
  132 SMs. Split programs store fp32 partials and take an atomic ticket per tile; the last one adds them
  in chunk order (the ticket picks who adds, never the order) and runs the epilogue, as in ``fp8_linear.py``.
* fp32 activations are split into three bf16 parts (hi + mid + lo == x exactly), so fp32 inputs get
  fp32-grade results from bf16 MMAs (3x the MMA work; only when x is fp32).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch
import triton
import triton.language as tl

from deepinfer.ops.ref.moe_experts import FP4_GROUP, check_moe_experts_args
from deepinfer.ops.triton.launch import PDL, pdl_wait
from deepinfer.ops.triton.moe_align import align_pairs
from deepinfer.ops.triton.rounding import round_to

# Triton 3.6's CPU interpreter multiplies bf16 tensors as their raw uint16 bits, truncates fp32 -> bf16 and
# mis-converts bf16 subnormals, so interpreted runs take fp32 detours with the same exact values
# (see ``_mma``, ``_to_out`` and ``_dequant_fp4``); the GPU code path is the other branch of each.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Tests set this: scratch buffers (h, y) start as NaN so an element no program wrote cannot pass unnoticed.
POISON_SCRATCH = False


@dataclasses.dataclass(frozen=True)
class TileConfig:
    block_m: int  # pairs per program: the MMA N side (swap-AB)
    block_n1: int  # rows of W1 and of W3 per program (kernel 1); a multiple of 64 (one warpgroup's wgmma M)
    block_n2: int  # rows of W2 per program (kernel 2)
    num_warps: int
    num_stages: int
    split_k: bool = False  # one program per (tile, K chunk); same bits either way, only speed differs


# Keyed on the mean number of pairs per expert (T*k / E), i.e. on shapes only, never on routing data.
# Decode (a few pairs per hit expert) reads every weight once and is bound by bytes: narrow token tiles.
# Prefill (many pairs per expert) reuses each dequantized tile across BLOCK_M tokens: wide token tiles.
CONFIG_TABLE: tuple[tuple[float, TileConfig], ...] = (
    (8.0, TileConfig(block_m=16, block_n1=64, block_n2=64, num_warps=4, num_stages=4)),
    (24.0, TileConfig(block_m=32, block_n1=64, block_n2=64, num_warps=4, num_stages=4)),
    (64.0, TileConfig(block_m=64, block_n1=64, block_n2=64, num_warps=4, num_stages=3)),
    (math.inf, TileConfig(block_m=128, block_n1=64, block_n2=128, num_warps=8, num_stages=3)),
)
# fp32 activations triple the MMA operands (three bf16 parts); wider token tiles spill registers, and the
# fp32 path exists for parity checks, not speed, so it always runs the narrowest config.
FP32_CONFIG = CONFIG_TABLE[0][1]
# Split-K in the decode bucket while its fp32 partials stay small: at most 24 MB for V4-Flash at 256 pairs
# (2% of the weights those pairs read); beyond that the unsplit grid fills the SMs by itself.
SPLIT_K_MAX_PAIRS = 256
# K chunk: 1024 = 8 K steps of 128, so a split program still streams 64 KB (kernel 1) or 32 KB (kernel 2) of
# packed weights against at most a few KB of partials, and batch-1 decode gets 768 programs (~6 per SM) in
# both kernels: H=4096 -> 4 chunks, I=2048 -> 2. A multiple of 64; tests lower it for interpreter shapes.
K_CHUNK = 1024


def pick_config(num_pairs: int, num_experts: int, dtype: torch.dtype = torch.bfloat16) -> TileConfig:
    if dtype == torch.float32:
        return FP32_CONFIG
    per_expert = num_pairs / max(num_experts, 1)
    cfg = next(cfg for bound, cfg in CONFIG_TABLE if per_expert <= bound)
    if cfg == CONFIG_TABLE[0][1] and num_pairs <= SPLIT_K_MAX_PAIRS:
        cfg = dataclasses.replace(cfg, split_k=True)
    return cfg


def k_chunk(dim: int) -> int:
    """The fixed K chunk of a reduction over ``dim`` (shape only): K_CHUNK when it divides ``dim`` into
    several chunks, else ``dim`` (one chunk, the plain reduction)."""
    return K_CHUNK if dim > K_CHUNK and dim % K_CHUNK == 0 else dim


def block_k(dim: int) -> int:
    """The reduction step over ``dim`` (shape only: fixed reduction order). It divides the chunk, and chunks
    of a split reduction get at least two steps: with one, Triton may fold ``acc + dot(a, b, 0)`` into
    ``dot(a, b, acc)`` (its dot-add combine) in the unsplit path only, and the bits would differ."""
    kc = k_chunk(dim)
    return next(bk for bk in (128, 64, 32) if kc % bk == 0 and (kc == dim or kc >= 2 * bk))


def _check_config(cfg: TileConfig) -> None:
    for n in (cfg.block_n1, cfg.block_n2):
        if n % 64:
            raise ValueError(f"{cfg}: weight tiles must be multiples of 64 rows (wgmma M per warpgroup)")
    if cfg.block_m < 16 or cfg.block_m & (cfg.block_m - 1):
        raise ValueError(f"{cfg}: block_m must be a power of two >= 16 (MMA N side)")


@triton.jit
def _dequant_fp4(packed, scale, BN: tl.constexpr, BK: tl.constexpr, SCALE_U8: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """int8 [BN, BK/2] (two e2m1 codes per byte, low nibble first) and scales [BN, BK/32] -> bf16 [BN, BK].

    Dequantization is the decode bottleneck (every weight byte needs it, and the bytes stream at
    4.25 TB/s), so it is done by bit placement, a handful of integer ops per byte, no table:
    * bf16 bits (sign << 15) | (magnitude << 6) put the e2m1 exponent in bf16's exponent field and its
      mantissa bit in bf16's top mantissa bit; that bf16 is the e2m1 value times 2^-126 for all 16 codes
      (0.5 becomes the bf16 subnormal 2^-127, which Hopper's bf16 multiply keeps).
    * Both nibbles of a byte b at once: v = b * 0x1001 holds copies of b at bits 0 and 12, so
      (v << 6) & 0x01C001C0 puts both magnitudes and (v << 12) & 0x80008000 both signs where a bf16 pair
      (low half = element 2k, high half = element 2k+1) wants them. The shifts are folded into the
      multipliers (b * 0x40040 == v << 6, b * 0x1001000 == v << 12).
    * One bf16 multiply by 2^126 * scale = 2^(e-1) then gives the exact weight. That factor must fit in
      bf16: scales <= 2 (UE8M0 bytes <= 128), far above any real expert weight's scale.
    """
    b = packed.to(tl.uint8, bitcast=True).to(tl.uint32)
    pair = ((b * 0x40040) & 0x01C001C0) | ((b * 0x1001000) & 0x80008000)
    if SCALE_U8:  # 2^(e-1) as bf16 bits: exponent field e - 1 + 127
        e = scale.to(tl.uint8, bitcast=True).to(tl.uint32)
        m = ((e + 126) << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        m = (scale * 8.507059173023462e37).to(tl.bfloat16)  # scale * 2^126, exact for powers of two
    m = tl.reshape(tl.broadcast_to(m[:, :, None], [BN, BK // 32, 32]), [BN, BK])
    if INTERPRET:
        # The interpreter neither multiplies bf16 tensors nor converts bf16 subnormals; the same bits read
        # as the upper half of an fp32 give the same (exact) values through numpy.
        lo = (pair << 16).to(tl.float32, bitcast=True)
        hi = (pair & 0xFFFF0000).to(tl.float32, bitcast=True)
        w = tl.reshape(tl.join(lo, hi), [BN, BK])
        return (w * m.to(tl.float32)).to(tl.bfloat16)
    lo, hi = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [pair],
                                       dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=1)
    w = tl.reshape(tl.join(lo, hi), [BN, BK])  # [n, j, 0] -> 2j (low nibble), [n, j, 1] -> 2j + 1
    return w * m


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
def _mma_act(w, a, acc, SPLIT: tl.constexpr, INTERPRET: tl.constexpr):
    """acc += w @ a for activations a: bf16, or fp32 as three exact bf16 parts (SPLIT == 3)."""
    if SPLIT == 1:
        return _mma(w, a.to(tl.bfloat16), acc, INTERPRET)
    a_hi, a_mid, a_lo = _split_bf16(a)
    acc = _mma(w, a_hi, acc, INTERPRET)
    acc = _mma(w, a_mid, acc, INTERPRET)
    return _mma(w, a_lo, acc, INTERPRET)


@triton.jit
def _to_out(v, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 -> dtype, round to nearest even (the interpreter truncates fp32 -> bf16: round its bits first)."""
    if INTERPRET:
        if dtype == tl.bfloat16:
            u = v.to(tl.uint32, bitcast=True)
            v = (u + 0x7FFF + ((u >> 16) & 1)).to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _block_rows(pair_ptr, expert_ptr, BM: tl.constexpr):
    """This m-block's expert (-1: unused block) and its BM pair ids (-1: padding)."""
    pid_m = tl.program_id(0)
    e = tl.load(expert_ptr + pid_m)
    pair = tl.load(pair_ptr + pid_m * BM + tl.arange(0, BM))
    return e, pair


@triton.jit
def _last_of_tile(ticket_ptr):
    """Split-K: take this tile's ticket; True in the program that draws the last one (it does the sum).
    acq_rel orders the ticket after this program's partial stores and the winner's loads after all tickets.
    Release covers the issuing thread's own writes (and those it has observed), so a CTA barrier first puts
    every thread's partial stores before the ticket. The winner zeroes the counter for the next call."""
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.debug_barrier()
    ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel")
    last = ticket == tl.num_programs(2) - 1
    if last:
        tl.atomic_xchg(ticket_ptr + tile, 0)
    return last


@triton.jit
def _sum_partials(p_tile, stride_pc, mask, BN: tl.constexpr, BM: tl.constexpr):
    """0 + p_0 + p_1 + ... in chunk order: the same fp32 adds as the unsplit path's acc = acc + part."""
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for c in range(0, tl.num_programs(2)):  # .cg: read from L2, where other SMs' stores landed
        acc += tl.load(p_tile + c * stride_pc, mask=mask, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, s13_ptr, h_ptr, part_ptr, ticket_ptr, pair_ptr, expert_ptr,
    K, N,  # K = H (reduction), N = I (rows of W1; W3 follows at row N)
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h, stride_pc, stride_pr,
    limit, topk,
    SCALE_U8: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pdl_wait()
    e, pair = _block_rows(pair_ptr, expert_ptr, BM)
    if e < 0:
        return
    valid = pair >= 0
    tok = tl.where(valid, pair // topk, 0).to(tl.int64)
    row = tl.where(valid, pair, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    w_mask = (offs_n < N)[:, None]
    x_mask = valid[None, :]
    out_mask = x_mask & w_mask
    # Loop-invariant offset tiles plus scalar bases: strides arrive as (16-divisible) arguments, so Triton
    # can prove 16-byte alignment and issue vector loads; carrying 64-bit pointer tiles would cost registers.
    w_off = offs_n[:, None] * stride_wn + tl.arange(0, BK // 2)[None, :]
    s_off = offs_n[:, None] * stride_sn + tl.arange(0, BK // 32)[None, :]
    x_off = tok[None, :] * stride_x + tl.arange(0, BK)[:, None]  # x^T tile [BK, BM]: the MMA's B operand
    g_w = w13_ptr + e.to(tl.int64) * stride_we
    u_w = g_w + N * stride_wn
    g_s = s13_ptr + e.to(tl.int64) * stride_se
    u_s = g_s + N * stride_sn
    acc_g = tl.zeros([BN, BM], dtype=tl.float32)
    acc_u = tl.zeros([BN, BM], dtype=tl.float32)
    # All chunks in order, or with SPLIT_K chunk program_id(2) alone. A split program's acc is then 0 + part,
    # what the unsplit loop adds for that chunk (0 + p only turns -0 into +0, which no later add can tell
    # apart: the running sum starts at +0 and can never become -0).
    c_begin = tl.program_id(2) * KC
    c_end = c_begin + KC if SPLIT_K else K
    for c0 in range(c_begin, c_end, KC):
        sg = tl.load(g_s + c0 // 32 + s_off, mask=w_mask, other=0)
        su = tl.load(u_s + c0 // 32 + s_off, mask=w_mask, other=0)
        part_g = tl.zeros([BN, BM], dtype=tl.float32)
        part_u = tl.zeros([BN, BM], dtype=tl.float32)
        for k0 in range(c0, c0 + KC, BK):
            # Weights and activations are software-pipelined by Triton (cp.async, num_stages deep). The
            # scale tiles are too narrow for that (4 bytes per row), so the next step's scales are fetched
            # here by hand, one step ahead, instead of stalling every step on a fresh load.
            kn = k0 + BK
            sg_n = tl.load(g_s + kn // 32 + s_off, mask=w_mask & (kn < c0 + KC), other=0)
            su_n = tl.load(u_s + kn // 32 + s_off, mask=w_mask & (kn < c0 + KC), other=0)
            pg = tl.load(g_w + k0 // 2 + w_off, mask=w_mask, other=0)
            pu = tl.load(u_w + k0 // 2 + w_off, mask=w_mask, other=0)
            wg = _dequant_fp4(pg, sg, BN, BK, SCALE_U8, INTERPRET)
            wu = _dequant_fp4(pu, su, BN, BK, SCALE_U8, INTERPRET)
            xt = tl.load(x_ptr + k0 + x_off, mask=x_mask, other=0.0)
            part_g = _mma_act(wg, xt, part_g, SPLIT, INTERPRET)
            part_u = _mma_act(wu, xt, part_u, SPLIT, INTERPRET)
            sg, su = sg_n, su_n
        acc_g = acc_g + part_g
        acc_u = acc_u + part_u
    last = True
    if SPLIT_K:  # partials [chunk, pair, 2N]: gate in columns 0..N-1, up in N..2N-1
        p_tile = part_ptr + row[None, :] * stride_pr + offs_n[:, None]
        tl.store(p_tile + tl.program_id(2) * stride_pc, acc_g, mask=out_mask)
        tl.store(p_tile + tl.program_id(2) * stride_pc + N, acc_u, mask=out_mask)
        last = _last_of_tile(ticket_ptr)
        if last:
            acc_g = _sum_partials(p_tile, stride_pc, out_mask, BN, BM)
            acc_u = _sum_partials(p_tile + N, stride_pc, out_mask, BN, BM)
    if last:
        gate = tl.minimum(acc_g, limit)
        up = tl.minimum(tl.maximum(acc_u, -limit), limit)
        hval = gate * tl.sigmoid(gate) * up
        tl.store(h_ptr + row[None, :] * stride_h + offs_n[:, None],
                 _to_out(hval, h_ptr.dtype.element_ty, INTERPRET), mask=out_mask)


@triton.jit
def _down_kernel(
    h_ptr, w2_ptr, s2_ptr, y_ptr, part_ptr, ticket_ptr, pair_ptr, expert_ptr,
    K, N,  # K = I (reduction), N = H
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_y, stride_pc, stride_pr,
    SCALE_U8: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, KC: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pdl_wait()
    e, pair = _block_rows(pair_ptr, expert_ptr, BM)
    if e < 0:
        return
    valid = pair >= 0
    row = tl.where(valid, pair, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    w_mask = (offs_n < N)[:, None]
    a_mask = valid[None, :]
    out_mask = a_mask & w_mask
    w_off = offs_n[:, None] * stride_wn + tl.arange(0, BK // 2)[None, :]
    s_off = offs_n[:, None] * stride_sn + tl.arange(0, BK // 32)[None, :]
    a_off = row[None, :] * stride_h + tl.arange(0, BK)[:, None]  # h^T tile [BK, BM]
    w_base = w2_ptr + e.to(tl.int64) * stride_we
    s_base = s2_ptr + e.to(tl.int64) * stride_se
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    c_begin = tl.program_id(2) * KC  # chunks as in _gate_up_kernel
    c_end = c_begin + KC if SPLIT_K else K
    for c0 in range(c_begin, c_end, KC):
        sw = tl.load(s_base + c0 // 32 + s_off, mask=w_mask, other=0)
        part = tl.zeros([BN, BM], dtype=tl.float32)
        for k0 in range(c0, c0 + KC, BK):
            kn = k0 + BK
            sw_n = tl.load(s_base + kn // 32 + s_off, mask=w_mask & (kn < c0 + KC), other=0)  # one step ahead
            pw = tl.load(w_base + k0 // 2 + w_off, mask=w_mask, other=0)
            w = _dequant_fp4(pw, sw, BN, BK, SCALE_U8, INTERPRET)
            at = tl.load(h_ptr + k0 + a_off, mask=a_mask, other=0.0)
            part = _mma_act(w, at, part, SPLIT, INTERPRET)
            sw = sw_n
        acc = acc + part
    y_tile = y_ptr + row[None, :] * stride_y + offs_n[:, None]
    if SPLIT_K:  # as in _gate_up_kernel; partials [chunk, pair, N]
        p_tile = part_ptr + row[None, :] * stride_pr + offs_n[:, None]
        tl.store(p_tile + tl.program_id(2) * stride_pc, acc, mask=out_mask)
        if _last_of_tile(ticket_ptr):
            tl.store(y_tile, _sum_partials(p_tile, stride_pc, out_mask, BN, BM), mask=out_mask)
    else:
        tl.store(y_tile, acc, mask=out_mask)


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, add_ptr, H,
                    TOPK: tl.constexpr, BLOCK_H: tl.constexpr, ADD: tl.constexpr, INTERPRET: tl.constexpr):
    """out[t] = sum_j w[t, j] * y[t*k + j], slot order, fp32 (one program per token and H block); with ADD,
    rounded to out's dtype and then + add[t], rounded again (the reference's two-tensor add)."""
    pdl_wait()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        wj = tl.load(w_ptr + t * TOPK + j)
        acc += wj * tl.load(y_ptr + (t * TOPK + j) * H + offs, mask=ok, other=0.0)
    dtype = out_ptr.dtype.element_ty
    if ADD:  # round_to: exact zeros (x + -x) stay zero under the interpreter too
        acc = round_to(acc, dtype, INTERPRET) + tl.load(add_ptr + t * H + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * H + offs, round_to(acc, dtype, INTERPRET).to(dtype), mask=ok)
    else:
        tl.store(out_ptr + t * H + offs, _to_out(acc, dtype, INTERPRET), mask=ok)


def _scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if POISON_SCRATCH:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


_TICKETS: dict[torch.device, torch.Tensor] = {}
MAX_TILES = 1 << 16


def _tickets(device: torch.device) -> torch.Tensor:
    """Per-device split-K tile counters, zero between launches; both kernels share them (one stream, one
    after the other). Allocated on the first call, before any graph capture (which follows a warm-up)."""
    if device not in _TICKETS:
        _TICKETS[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _TICKETS[device]


def _partials(cfg: TileConfig, tiles: int, dim: int, cols: int, y: torch.Tensor) -> torch.Tensor:
    """Split-K partials fp32 [chunks, pairs, cols], or y[None] (one chunk: run unsplit, untouched). split_k
    changes speed, never bits, so shapes it cannot serve run unsplit: one chunk, more tiles than tickets,
    or partial offsets past int32."""
    chunks = dim // k_chunk(dim)
    if not cfg.split_k or chunks == 1 or tiles > MAX_TILES or chunks * y.shape[0] * cols >= 2**31:
        return y[None]
    return _scratch((chunks, y.shape[0], cols), torch.float32, y.device)


def moe_experts_fp4_with_config(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                                w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                                limit: float, cfg: TileConfig, *, out: torch.Tensor | None = None,
                                add: torch.Tensor | None = None) -> torch.Tensor:
    """``moe_experts_fp4`` with an explicit tile config (benchmarks, invariance tests across configs)."""
    n_exp, inter = check_moe_experts_args(x, topk_ids, topk_weights, w13, s13, w2, s2)
    _check_config(cfg)
    t, h = x.shape
    k = topk_ids.shape[1]
    # The router's outputs are often column slices of a sort; they are tiny, so copy rather than refuse.
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    for name, ten in (("x", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights), ("w13", w13),
                      ("s13", s13), ("w2", w2), ("s2", s2)):
        if not ten.is_contiguous():
            raise ValueError(f"{name}: must be contiguous (the kernels compute row offsets from shapes)")
        if ten.device != x.device:
            raise ValueError(f"{name}: on {ten.device}, x on {x.device}")
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out: expected contiguous {x.dtype} {tuple(x.shape)} on {x.device}")
    if t == 0:
        return out
    scale_u8 = s13.dtype != torch.float32
    if scale_u8:  # UE8M0 bytes: the kernels read the biased exponent directly
        s13, s2 = s13.view(torch.uint8), s2.view(torch.uint8)
    split = 3 if x.dtype == torch.float32 else 1
    act_dtype = torch.float32 if split == 3 else torch.bfloat16  # h keeps fp32 inputs fp32-accurate
    bk1, bk2 = block_k(h), block_k(inter)
    assert k_chunk(h) % bk1 == 0 and k_chunk(inter) % bk2 == 0 and bk1 % FP4_GROUP == 0 and bk2 % FP4_GROUP == 0

    pair_of_row, expert_of_block = align_pairs(topk_ids, n_exp, cfg.block_m)
    num_blocks = expert_of_block.numel()
    hid = _scratch((t * k, inter), act_dtype, x.device)
    y = _scratch((t * k, h), torch.float32, x.device)
    tickets = _tickets(x.device)
    grid1 = (num_blocks, triton.cdiv(inter, cfg.block_n1))
    part1 = _partials(cfg, grid1[0] * grid1[1], h, 2 * inter, y)
    _gate_up_kernel[grid1 + (part1.shape[0],)](
        x, w13, s13, hid, part1, tickets, pair_of_row, expert_of_block, h, inter,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1), hid.stride(0),
        part1.stride(0), part1.stride(1), float(limit), k,
        SCALE_U8=scale_u8, SPLIT=split, INTERPRET=_INTERPRET, BM=cfg.block_m, BN=cfg.block_n1, BK=bk1,
        KC=k_chunk(h), SPLIT_K=part1.shape[0] > 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **PDL
    )
    grid2 = (num_blocks, triton.cdiv(h, cfg.block_n2))
    part2 = _partials(cfg, grid2[0] * grid2[1], inter, h, y)
    _down_kernel[grid2 + (part2.shape[0],)](
        hid, w2, s2, y, part2, tickets, pair_of_row, expert_of_block, inter, h,
        hid.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
        part2.stride(0), part2.stride(1),
        SCALE_U8=scale_u8, SPLIT=split, INTERPRET=_INTERPRET, BM=cfg.block_m, BN=cfg.block_n2, BK=bk2,
        KC=k_chunk(inter), SPLIT_K=part2.shape[0] > 1, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **PDL
    )
    block_h = min(1024, triton.next_power_of_2(h))
    if add is not None and (add.shape != x.shape or add.dtype != x.dtype or not add.is_contiguous()):
        raise ValueError(f"add: expected contiguous {x.dtype} {tuple(x.shape)}")
    _combine_kernel[(t, triton.cdiv(h, block_h))](y, topk_weights, out, out if add is None else add, h, TOPK=k,
                                                 BLOCK_H=block_h, ADD=add is not None, INTERPRET=_INTERPRET,
                                                 num_warps=4, **PDL)
    return out


def moe_experts_fp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                    limit: float, *, out: torch.Tensor | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype; see ``ops/ref/moe_experts.py`` for the math, layouts and ``add``.

    Expert ids are not range-checked here (that would need a host sync); the router guarantees them.
    """
    cfg = pick_config(topk_ids.numel(), w13.shape[0], x.dtype)
    return moe_experts_fp4_with_config(x, topk_ids, topk_weights, w13, s13, w2, s2, limit, cfg, out=out, add=add)
