"""Routed FP4 experts as a grouped GEMM in Triton; twin of ``ops/ref/moe_experts.py`` (same signature).

Plan (all on the device, no host sync, so the whole call can be captured in a CUDA graph):
  align          group the T*k (token, slot) pairs by expert (stable), pad each expert's group to a multiple
                 of BLOCK_M -> ``pair_of_row`` (-1 = padding) and ``expert_of_block`` (-1 = unused block);
                 counting kernels in ``moe_align.py`` (one launch at decode sizes).
  kernel 1       per (m-block, n-block of I): gate and up tiles over the full H in fixed BLOCK_K steps, clamped
                 SwiGLU in fp32, h[pair, n] stored in bf16 (fp32 when x is fp32).
                 (``split_gate_up``: gate and up rows in separate programs of ``_matmul_kernel`` into fp32
                 sums, optionally in K chunks, then ``_swiglu_kernel``. Measured slower, kept as options:
                 bench/results/README.md runs 27-28.)
  kernel 2       per (m-block, n-block of H): y[pair, n] = W2 h, fp32 (``_matmul_kernel``).
  combine        per token: out[t] = sum_j w[t, j] * y[t*k + j] in slot order, fp32, one cast to x.dtype.
A program's share of kernels 1 and 2 (a tile) lives in ``moe_tiles.py``; ``TileConfig.one_launch`` runs both
kernels' tiles from one launch instead (``moe_one_launch.py``: down tiles start as soon as their m-block's
gate/up tiles are done, filling the gate/up tail), with the same bits.

Why these choices:
* No FP4 tensor cores on Hopper. Packed bytes stream from HBM into shared memory (cp.async, num_stages
  deep), each tile is dequantized in registers right before its MMA and fed to ``tl.dot`` as bf16: the
  packed bytes are the only weight traffic (4.25 bits/weight with UE8M0 scales) and dequantized weights
  never touch global memory. e2m1 times a power of two is exact in bf16, so dequantization rounds nothing
  (scales must be powers of two, as UE8M0 ones are, and at most 2; see ``fp4_codes.dequant_fp4``). Within
  each BLOCK_K step the inputs are taken in a fixed permuted order (same for weights and activations) that
  makes every thread's share of the packed tile one 16-byte run: 16-byte copies and shared-memory loads
  instead of one instruction per byte (decode 13-22% faster, bench/results/README.md run 20).
* The model stores the packed codes and their scales tile-major (``fp4_codes.tile_weights``): a program's
  K step reads one contiguous 4 KB block of codes and one 256-byte block of scales instead of 64 pieces
  of each, rows apart: the decode op 12-15% faster at T = 1..128 (runs 30, 36). The kernels also read the
  checkpoint layout (tests, the reference's tensors), with the same bits.
* The stored codes also have the bits of each 32-bit word permuted (``fp4_codes.place_codes``, int32
  words; the ``W_PLACED`` constexpr), so that decoding a word takes 8 integer ops instead of 15: about a
  quarter fewer instructions in the K loop (decode tile 461 -> 348 per step). Same bits out.
* Swap-AB: the weight tile is the MMA's M side (64-row multiples, what Hopper's wgmma wants) and the
  tokens are its N side (16..128). Decode then wastes no MMA rows on padding tokens, and every tile
  config uses the same instruction family (wgmma m64nNk16, bf16 -> fp32), differing only in N.
* Batch invariance (determinism.md §2.2): a pair's row is one column of a tile; its value depends on its
  own activations, the expert's weights and BLOCK_K only. BLOCK_K is a function of (H, I) alone; BLOCK_M
  and the rest vary with the shape bucket. No split-K, no atomics; the combine is a fixed slot-order sum.
  (The K-chunk options, ``splits1`` / ``splits2``, give up this property; no table config uses them.)
* fp32 activations are split into three bf16 parts (hi + mid + lo == x exactly), so fp32 inputs get
  fp32-grade results from bf16 MMAs (3x the MMA work; only when x is fp32).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer.ops.ref.moe_experts import FP4_GROUP, check_moe_experts_args
from deepinfer.ops.triton.fp4_codes import PLACED_DTYPE, TILE_ROWS, block_k, logical_shape
from deepinfer.ops.triton.moe_align import align_pairs
from deepinfer.ops.triton.moe_one_launch import launch_one, reset_counters
from deepinfer.ops.triton.moe_tiles import block_rows, clamped_swiglu, to_out, gate_up_tile, matmul_tile
from deepinfer.ops.triton.rounding import round_to

# Triton 3.6's CPU interpreter multiplies bf16 tensors as their raw uint16 bits, truncates fp32 -> bf16 and
# mis-converts bf16 subnormals, so interpreted runs take fp32 detours with the same exact values
# (see ``moe_tiles._mma``, ``to_out`` and ``dequant_fp4``); the GPU code path is the other branch of each.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Tests set this: scratch buffers (h, y) start as NaN so an element no program wrote cannot pass unnoticed.
POISON_SCRATCH = False


@dataclass(frozen=True)
class TileConfig:
    block_m: int  # pairs per program: the MMA N side (swap-AB)
    block_n1: int  # rows of W1 and of W3 per program (kernel 1); a multiple of 64 (one warpgroup's wgmma M)
    block_n2: int  # rows of W2 per program (kernel 2)
    num_warps: int
    num_stages: int
    max_regs: int | None = None  # register cap per thread (more resident programs per SM); None: compiler's pick
    # Gate rows and up rows in separate programs (one accumulator and one weight stream each: fewer registers
    # and less shared memory per program, so more programs per SM), their fp32 sums joined by a small SwiGLU
    # kernel. The same fp32 values meet the same epilogue code, so results are bit-identical to the fused form.
    split_gate_up: bool = False
    # K chunks of kernel 1 (with split_gate_up) and of kernel 2, each chunk a program of its own and an fp32
    # partial that the SwiGLU / combine kernel adds in chunk order: more programs when few experts are hit
    # (decode), deterministic, but a different summation order than unsplit configs (not batch invariant).
    splits1: int = 1
    splits2: int = 1
    # Kernels 1 and 2 as one launch of a tile queue (``moe_one_launch.py``): down tiles fill the gate/up
    # tiles' last wave. The same tiles, the same bits. Not with split_gate_up or splits2 > 1.
    one_launch: bool = False


# Keyed on the mean number of pairs per expert (T*k / E), i.e. on shapes only, never on routing data.
# Decode (a few pairs per hit expert) reads every weight once and is bound by bytes: narrow token tiles.
# Prefill (many pairs per expert) reuses each dequantized tile across BLOCK_M tokens: wide token tiles.
CONFIG_TABLE: tuple[tuple[float, TileConfig], ...] = (
    (0.03, TileConfig(block_m=16, block_n1=64, block_n2=128, num_warps=4, num_stages=4)),
    (0.08, TileConfig(block_m=16, block_n1=64, block_n2=128, num_warps=4, num_stages=4, one_launch=True)),
    (8.0, TileConfig(block_m=16, block_n1=128, block_n2=128, num_warps=4, num_stages=3, max_regs=168,
                     one_launch=True)),
    (24.0, TileConfig(block_m=32, block_n1=64, block_n2=128, num_warps=4, num_stages=4)),
    (64.0, TileConfig(block_m=64, block_n1=128, block_n2=128, num_warps=8, num_stages=3)),
    (math.inf, TileConfig(block_m=128, block_n1=128, block_n2=128, num_warps=8, num_stages=3)),
)
# The wide-token rows were re-swept after the K-order change (bench/results/README.md, run 20): at T=4096,
# 128-row weight tiles with 8 warps beat 64-row ones (m128: 4626 vs 6117 µs; m64: 5975 vs 6178 µs).
# Decode's gate/up tiles are 128 rows on one warpgroup from 4 tokens on (run 56: 15% fewer instructions per
# weight byte for 160 registers; the op at T = 32 / 128 583.8 / 1102.4 -> 559.7 / 1038.6 µs, model decode at
# b32 / b128 -3%); at T = 1 the 64-row tiles' twice as many programs are faster (48.2 vs 54.8 µs).
# From 2 tokens on (V4-Flash's k = 6 of 256), decode runs its two GEMMs as one launch of a tile queue
# (``moe_one_launch.py``); the 128-row tiles capped at 168 registers (3 programs per SM; 179 uncapped). The op,
# two launches -> one: T = 2 73.3 -> 63.8 µs (64-row tiles; 128-row: 87.6); T = 4 113.0 -> 110.9 (64-row),
# 106.3 -> 105.5 (128-row), hence 128 rows from 4 tokens (0.08 pairs per expert) on; 8 / 32 / 128: 193.5 /
# 528.4 / 974.9 -> 178.4 / 520.6 / 968.3; model decode b8 -3.7% (runs 61, 62). Not at T = 1 (48.5 vs 62.3 µs:
# every tile starts at once, so the waiting down tiles only compete with the gate/up ones) nor for the m32 row
# (T = 512: 1603 vs 1410 µs).
# Decode's down tiles are 128 rows since the tiled layout (run 36: T = 1 / 8 / 32 / 128 at 58.3 / 224 / 649 /
# 1157 µs vs 58.9 / 231 / 671 / 1207 with 64 rows), the m32 bucket's since run 41 (T=512: 1500 vs 1610 µs).
# fp32 activations triple the MMA operands (three bf16 parts); wider token tiles spill registers, and the
# fp32 path exists for parity checks, not speed, so it always runs the narrowest config.
FP32_CONFIG = CONFIG_TABLE[0][1]


def pick_config(num_pairs: int, num_experts: int, dtype: torch.dtype = torch.bfloat16) -> TileConfig:
    if dtype == torch.float32:
        return FP32_CONFIG
    per_expert = num_pairs / max(num_experts, 1)
    return next(cfg for bound, cfg in CONFIG_TABLE if per_expert <= bound)


def _check_config(cfg: TileConfig) -> None:
    if cfg.one_launch and (cfg.split_gate_up or cfg.splits2 > 1):
        raise ValueError(f"{cfg}: one_launch runs the fused gate/up tiles and an unsplit down GEMM")
    if cfg.splits1 > 1 and not cfg.split_gate_up:
        raise ValueError(f"{cfg}: splits1 > 1 needs split_gate_up (the SwiGLU kernel adds the K chunks)")
    for n in (cfg.block_n1, cfg.block_n2):
        if n % 64:
            raise ValueError(f"{cfg}: weight tiles must be multiples of 64 rows (wgmma M per warpgroup)")
    if cfg.block_m < 16 or cfg.block_m & (cfg.block_m - 1):
        raise ValueError(f"{cfg}: block_m must be a power of two >= 16 (MMA N side)")


@triton.jit
def _swiglu_kernel(gu_ptr, h_ptr, N, limit, stride_gu, stride_split, stride_h,
                   SPLITS: tl.constexpr, BLOCK: tl.constexpr, INTERPRET: tl.constexpr):
    """h[pair] = swiglu(g, u) with g|u = sum over K chunks s (in order) of gu[s, pair]: fp32 sums in, one
    rounding out (split gate/up)."""
    p = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    g = tl.load(gu_ptr + p * stride_gu + offs, mask=ok, other=0.0)
    u = tl.load(gu_ptr + p * stride_gu + N + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, SPLITS):
        g += tl.load(gu_ptr + s * stride_split + p * stride_gu + offs, mask=ok, other=0.0)
        u += tl.load(gu_ptr + s * stride_split + p * stride_gu + N + offs, mask=ok, other=0.0)
    hval = clamped_swiglu(g, u, limit)
    tl.store(h_ptr + p * stride_h + offs, to_out(hval, h_ptr.dtype.element_ty, INTERPRET), mask=ok)


@triton.jit
def _gate_up_kernel(
    x_ptr, w13_ptr, s13_ptr, h_ptr, pair_ptr, expert_ptr,
    K, N,  # K = H (reduction), N = I (rows of W1; W3 follows at row N)
    stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h,
    limit, topk,
    SCALE_U8: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, W_TILED: tl.constexpr, S_TILED: tl.constexpr,
    W_PLACED: tl.constexpr = False,
):
    e, pair = block_rows(pair_ptr, expert_ptr, tl.program_id(0), BM)
    if e < 0:
        return
    gate_up_tile(x_ptr, w13_ptr, s13_ptr, h_ptr, e, pair, tl.program_id(1), K, N, stride_x, stride_we, stride_wn,
                 stride_se, stride_sn, stride_h, limit, topk, SCALE_U8, SPLIT, INTERPRET, BM, BN, BK, W_TILED,
                 S_TILED, W_PLACED)


@triton.jit
def _matmul_kernel(
    h_ptr, w2_ptr, s2_ptr, y_ptr, pair_ptr, expert_ptr,
    K, N,  # K = I (reduction), N = H; or, for split gate/up, K = H, N = 2I
    stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_y,
    row_div,  # activation row of a pair: pair // row_div (1: h is per pair; topk: x is per token)
    k_per_split, stride_split,  # K chunk of program_id(2) (a multiple of BK) and where its partial goes
    SCALE_U8: tl.constexpr, SPLIT: tl.constexpr, INTERPRET: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, K_SPLITS: tl.constexpr,
    W_TILED: tl.constexpr, S_TILED: tl.constexpr, W_PLACED: tl.constexpr = False,
):
    """y[s, pair, n] = sum over k in chunk s of W_e[n, k] a[pair // row_div, k], fp32: the down projection
    (kernel 2), and with ``split_gate_up`` also kernel 1's gate|up rows as one [2I, H] matrix. One chunk
    (s = 0) unless a config splits K; the consumer then adds the chunks in order."""
    e, pair = block_rows(pair_ptr, expert_ptr, tl.program_id(0), BM)
    if e < 0:
        return
    matmul_tile(h_ptr, w2_ptr, s2_ptr, y_ptr, e, pair, tl.program_id(1), tl.program_id(2), K, N, stride_h,
                stride_we, stride_wn, stride_se, stride_sn, stride_y, row_div, k_per_split, stride_split, SCALE_U8,
                SPLIT, INTERPRET, BM, BN, BK, K_SPLITS, W_TILED, S_TILED, W_PLACED, "")


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, add_ptr, H, stride_split, counter_ptr, num_counters,
                    TOPK: tl.constexpr, SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, ADD: tl.constexpr,
                    INTERPRET: tl.constexpr, RESET: tl.constexpr):
    """out[t] = sum_j w[t, j] * y[t*k + j], slot order, fp32 (one program per token and H block), each y the
    in-order sum of its K chunks; with ADD, rounded to out's dtype and then + add[t], rounded again (the
    reference's two-tensor add). With RESET, program (0, 0) also zeroes the one-launch kernel's counters."""
    if RESET:
        if tl.program_id(0) == 0 and tl.program_id(1) == 0:
            reset_counters(counter_ptr, num_counters)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOPK):
        wj = tl.load(w_ptr + t * TOPK + j).to(tl.float32)  # the router's dtype, upcast exactly
        yj = tl.load(y_ptr + (t * TOPK + j) * H + offs, mask=ok, other=0.0)
        for s in tl.static_range(1, SPLITS):
            yj += tl.load(y_ptr + s * stride_split + (t * TOPK + j) * H + offs, mask=ok, other=0.0)
        acc += wj * yj
    dtype = out_ptr.dtype.element_ty
    if ADD:  # round_to: exact zeros (x + -x) stay zero under the interpreter too
        acc = round_to(acc, dtype, INTERPRET) + tl.load(add_ptr + t * H + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * H + offs, round_to(acc, dtype, INTERPRET).to(dtype), mask=ok)
    else:
        tl.store(out_ptr + t * H + offs, to_out(acc, dtype, INTERPRET), mask=ok)


def _k_chunk(k: int, bk: int, splits: int) -> int:
    """K per chunk for ``splits`` chunks of whole BK steps; the chunks must tile K exactly."""
    if k % (bk * splits):
        raise ValueError(f"K={k} does not split into {splits} chunks of whole {bk}-wide steps")
    return k // splits


def _scratch(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if POISON_SCRATCH:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def moe_experts_fp4_with_config(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                                w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                                limit: float, cfg: TileConfig, *, out: torch.Tensor | None = None,
                                add: torch.Tensor | None = None,
                                before_add: Callable[[], None] | None = None) -> torch.Tensor:
    """``moe_experts_fp4`` with an explicit tile config (benchmarks, invariance tests across configs)."""
    (w13_shape, tiled1), (w2_shape, tiled2) = logical_shape(w13), logical_shape(w2)
    (s13_shape, s_tiled1), (s2_shape, s_tiled2) = logical_shape(s13), logical_shape(s2)
    n_exp, inter = check_moe_experts_args(x, topk_ids, topk_weights, w13_shape, s13_shape, w2_shape, s2_shape)
    _check_config(cfg)
    t, h = x.shape
    placed1, placed2 = w13.dtype == PLACED_DTYPE, w2.dtype == PLACED_DTYPE  # fp4_codes.place_codes
    for name, w, tiled, k_dim, per in (("w13", w13, tiled1, h, 8 if placed1 else 2),
                                       ("w2", w2, tiled2, inter, 8 if placed2 else 2),
                                       ("s13", s13, s_tiled1, h, FP4_GROUP), ("s2", s2, s_tiled2, inter, FP4_GROUP)):
        if tiled and (w.shape[-1] * per != block_k(k_dim) or w.shape[3] != TILE_ROWS.value):
            raise ValueError(f"{name}: tiled as {w.shape[3]} rows x {w.shape[-1] * per}-wide K steps, the kernels "
                             f"take {TILE_ROWS.value} x {block_k(k_dim)} (fp4_codes.tile_weights)")
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
        if add is not None and before_add is not None:
            before_add()
        return out
    scale_u8 = s13.dtype != torch.float32
    if scale_u8:  # UE8M0 bytes: the kernels read the biased exponent directly
        s13, s2 = s13.view(torch.uint8), s2.view(torch.uint8)
    split = 3 if x.dtype == torch.float32 else 1
    act_dtype = torch.float32 if split == 3 else torch.bfloat16  # h keeps fp32 inputs fp32-accurate
    bk1, bk2 = block_k(h), block_k(inter)
    assert h % bk1 == 0 and inter % bk2 == 0 and bk1 % FP4_GROUP == 0 and bk2 % FP4_GROUP == 0

    w13, w2 = w13.view(torch.int32), w2.view(torch.int32)  # the kernels read the codes as 32-bit words
    # Row strides of the scales' checkpoint layout (the tiled offsets are derived from them).
    sn1, sn2 = h // FP4_GROUP, inter // FP4_GROUP
    pair_of_row, expert_of_block = align_pairs(topk_ids, n_exp, cfg.block_m)
    num_blocks = expert_of_block.numel()
    hid = _scratch((t * k, inter), act_dtype, x.device)
    y = _scratch((cfg.splits2, t * k, h), torch.float32, x.device)
    if cfg.split_gate_up:  # gate|up as one [2I, H] matrix into fp32 sums, then the activation
        gu = _scratch((cfg.splits1, t * k, 2 * inter), torch.float32, x.device)
        _matmul_kernel[(num_blocks, triton.cdiv(2 * inter, cfg.block_n1), cfg.splits1)](
            x, w13, s13, gu, pair_of_row, expert_of_block, h, 2 * inter,
            x.stride(0), w13.stride(0), h // 8, s13.stride(0), sn1, gu.stride(1), k,
            _k_chunk(h, bk1, cfg.splits1), gu.stride(0),
            SCALE_U8=scale_u8, SPLIT=split, INTERPRET=_INTERPRET, BM=cfg.block_m, BN=cfg.block_n1, BK=bk1,
            K_SPLITS=cfg.splits1, W_TILED=tiled1, S_TILED=s_tiled1, W_PLACED=placed1,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.max_regs,
        )
        block = min(1024, triton.next_power_of_2(inter))
        _swiglu_kernel[(t * k, triton.cdiv(inter, block))](
            gu, hid, inter, float(limit), gu.stride(1), gu.stride(0), hid.stride(0),
            SPLITS=cfg.splits1, BLOCK=block, INTERPRET=_INTERPRET, num_warps=4)
    elif cfg.one_launch:
        counters = launch_one(x, w13, s13, hid, w2, s2, y, pair_of_row, expert_of_block, limit, k, cfg, scale_u8=scale_u8,
                   split=split, interpret=_INTERPRET, bk1=bk1, bk2=bk2,
                   tiled=(tiled1, s_tiled1, tiled2, s_tiled2), placed=(placed1, placed2))
    else:
        _gate_up_kernel[(num_blocks, triton.cdiv(inter, cfg.block_n1))](
            x, w13, s13, hid, pair_of_row, expert_of_block, h, inter,
            x.stride(0), w13.stride(0), h // 8, s13.stride(0), sn1, hid.stride(0),
            float(limit), k,
            SCALE_U8=scale_u8, SPLIT=split, INTERPRET=_INTERPRET, BM=cfg.block_m, BN=cfg.block_n1, BK=bk1,
            W_TILED=tiled1, S_TILED=s_tiled1, W_PLACED=placed1,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.max_regs,
        )
    if not cfg.one_launch:
        _matmul_kernel[(num_blocks, triton.cdiv(h, cfg.block_n2), cfg.splits2)](
            hid, w2, s2, y, pair_of_row, expert_of_block, inter, h,
            hid.stride(0), w2.stride(0), inter // 8, s2.stride(0), sn2, y.stride(1), 1,
            _k_chunk(inter, bk2, cfg.splits2), y.stride(0),
            SCALE_U8=scale_u8, SPLIT=split, INTERPRET=_INTERPRET, BM=cfg.block_m, BN=cfg.block_n2, BK=bk2,
            K_SPLITS=cfg.splits2, W_TILED=tiled2, S_TILED=s_tiled2, W_PLACED=placed2,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, maxnreg=cfg.max_regs,
        )
    block_h = min(1024, triton.next_power_of_2(h))
    if add is not None and (add.shape != x.shape or add.dtype != x.dtype or not add.is_contiguous()):
        raise ValueError(f"add: expected contiguous {x.dtype} {tuple(x.shape)}")
    if add is not None and before_add is not None:
        before_add()  # only the combine reads add: the kernels above overlap whatever still writes it
    reset = counters if cfg.one_launch else pair_of_row  # (not written without one_launch)
    _combine_kernel[(t, triton.cdiv(h, block_h))](y, topk_weights, out, out if add is None else add, h, y.stride(0),
                                                 reset, reset.numel(), TOPK=k, SPLITS=cfg.splits2,
                                                 BLOCK_H=block_h, ADD=add is not None, INTERPRET=_INTERPRET,
                                                 RESET=cfg.one_launch, num_warps=4)
    return out


def moe_experts_fp4(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                    w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                    limit: float, *, out: torch.Tensor | None = None, add: torch.Tensor | None = None,
                    before_add: Callable[[], None] | None = None) -> torch.Tensor:
    """x [T, H] -> [T, H] in x.dtype; see ``ops/ref/moe_experts.py`` for the math, layouts, ``add`` and
    ``before_add``.

    The codes and scales may also come tile-major (``fp4_codes.expert_layout``, what the model stores on the
    device), each tensor in either layout, and the codes as placed int32 words (``fp4_codes.place_codes``);
    the results are the same bits. Expert ids are not range-checked
    here (that would need a host sync); the router guarantees them.
    """
    cfg = pick_config(topk_ids.numel(), w13.shape[0], x.dtype)
    return moe_experts_fp4_with_config(x, topk_ids, topk_weights, w13, s13, w2, s2, limit, cfg, out=out, add=add,
                                       before_add=before_add)
