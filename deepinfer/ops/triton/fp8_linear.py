"""FP8 block-scaled linear in Triton (the DeepGEMM role); twin of ``ops/ref/fp8_linear.py``.

y[M, N] = x[M, K] @ (w_e4m3[N, K] * scale[n // 128, k // 128]).T with bf16/fp32 activations.

Why this shape: activations are not quantized (the reference path does not quantize them either), so
each K-block of 128 is one MMA over bf16 operands (e4m3 -> bf16 is exact) followed by one multiply of the
fp32 partial product by that block's scale — the DeepGEMM "promote per K-block" scheme. e4m3 -> bf16 is done
by integer bit placement (``e4m3.e4m3_to_bf16``) rather than the hardware's e4m3 -> f16 -> bf16 on the
quarter-rate conversion unit: a decode layer's FP8 GEMMs 11% faster at M=1, same bits (bench/results run 44).
Decode (tiny M) is bound by the weight bytes, so small M uses narrow N tiles plus a split over K to put
enough programs on the SMs (``KernelTuning``); the partial sums go to an fp32 buffer and the last split program of each tile
adds them in a fixed order (an atomic ticket only decides *who* adds, never the order), so results are
run-to-run deterministic and the reduction needs no second launch. (A stream-K decode path, one pipelined
loop per program over all (tile, K block) steps, measured 40% slower: bench/results run 42.) Tile and split choices are a function of (M bucket, N, K) only.
With power-of-two (UE8M0) scales, M <= 64 takes ``_fp8_decode_kernel`` instead: swap-AB, the weight as the
MMA's register operand read in a permuted order that needs no layout shuffle, the scale folded into the
conversion (half the instructions per K step; the decode layer's FP8 GEMMs 6-14% faster, bench/results run 48).
The batch-invariant table can take that kernel for every M (``KernelTuning.invariant_fp8_swap_ab``: token tiles
on a third grid axis, K in fixed segments), on weights it stores with each 128-column block in the kernel's
permuted order (``ops/fp8_layout.py``): the kernel then reads x as it is and sums K in natural order, at prefill
sizes too (4K prefill 1.14x -> 1.05x the default's time per layer, bench/results/batch_invariant_cuda.md).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.ops import fp8_layout, lanes
from deepinfer.ops.triton.e4m3 import e4m3_words_to_bf16, halves, to_bf16
from deepinfer.ops.tuning import H200, KernelTuning

SCALE_BLOCK = 128
# Triton's CPU interpreter mis-converts fp32 -> bf16 inside kernels, so interpreted runs use fp32 dots.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _write_tile(acc, offs_m, offs_n, mn_mask, y_ptr, part_ptr, ticket_ptr, tile, pid_k,
                stride_ym, stride_pm, stride_psplit, SPLIT: tl.constexpr):
    """Store an fp32 [BLOCK_M, BLOCK_N] tile: final (no K split), or this split's partial plus the in-kernel
    reduction by whichever program of the tile finishes last."""
    y = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    if SPLIT == 1:
        # Without a K split the tile is final: store it in the output dtype (no fp32 round trip).
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mn_mask)
    else:
        # Split K: store this split's fp32 partial, then take a ticket for the tile. The program that draws
        # the last ticket adds all partials in split order (fixed, whoever arrives last) and writes the
        # output, so the reduction costs no extra launch and stays deterministic. acq_rel orders each
        # program's partial store before its ticket and the last program's loads after all tickets; the
        # last program resets the counter, so the next call (or graph replay) starts from zero.
        part_tile = part_ptr + offs_m[:, None] * stride_pm + offs_n[None, :]
        tl.store(part_tile + pid_k * stride_psplit, acc, mask=mn_mask)
        # Release covers the issuing thread's own writes (and those it has observed): a CTA barrier first
        # puts every thread's partial stores before the ticket.
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + tile, 1, sem="acq_rel")
        if ticket == SPLIT - 1:
            # Unrolled (SPLIT is a compile-time constant): every partial's load is in flight at once, one
            # L2 round trip instead of SPLIT serial ones; the adds keep split order.
            total = tl.zeros(acc.shape, dtype=tl.float32)
            for sp in tl.static_range(SPLIT):
                total += tl.load(part_tile + sp * stride_psplit, mask=mn_mask, other=0.0, cache_modifier=".cg")
            tl.store(y, total.to(y_ptr.dtype.element_ty), mask=mn_mask)
            tl.atomic_xchg(ticket_ptr + tile, 0)


@triton.jit
def _fp8_k_range(x_ptr, w_ptr, s_ptr, offs_m, offs_n, m_mask, n_mask, K, k_start, k_len, stride_xm, stride_wn,
                 stride_sn, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                 BITS: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] sum over K in [k_start, k_start + k_len), from zero, one 128-wide block at a
    time: each block's MMA from zero, times its weight scale, added in K order."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, k_len, BLOCK_K):
        k0 = k_start + i
        k_idx = k0 + offs_k
        k_mask = k_idx < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k_idx[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k_idx[None, :], mask=n_mask[:, None] & k_mask[None, :],
                    other=0.0)
        if IEEE:
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(x.to(tl.bfloat16), tl.trans(to_bf16(w, BITS)))
        # One scale per 128x128 weight block: BLOCK_K == 128 keeps one k-block per iteration.
        # (k0 broadcast before the compare: Triton's interpreter rejects a scalar-and-vector mask here.)
        s = tl.load(s_ptr + (offs_n // 128) * stride_sn + k0 // 128, mask=n_mask & (offs_n * 0 + k0 < K), other=0.0)
        acc += part * s[None, :]
    return acc


@triton.jit(do_not_specialize=["M"])
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, ticket_ptr,
    M, N, K, k_per_split, group_rows,
    stride_xm, stride_wn, stride_sn, stride_ym, stride_pm, stride_psplit,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    SPLIT: tl.constexpr, BITS: tl.constexpr, SEGS: tl.constexpr = 1,
):
    """Program (m tile, n tile, K split): its K range is SEGS segments of ``k_per_split``; with SEGS > 1
    (batch-invariant, large M) each segment is summed from zero and the segments are added in order, which
    is exactly what SPLIT = SEGS programs and ``_write_tile``'s ordered reduction compute (small M)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    # Grouped (block-diagonal) use: output rows [g*r, (g+1)*r) read input columns [g*K, (g+1)*K).
    x_ptr += (pid_n * BLOCK_N // group_rows) * K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    mn_mask = m_mask[:, None] & n_mask[None, :]
    if SEGS == 1:
        acc = _fp8_k_range(x_ptr, w_ptr, s_ptr, offs_m, offs_n, m_mask, n_mask, K, pid_k * k_per_split, k_per_split,
                           stride_xm, stride_wn, stride_sn, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, BITS)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for sg in range(SEGS):
            k_start = (pid_k * SEGS + sg) * k_per_split  # pid_k is 0 here (SEGS > 1 launches no K split)
            acc += _fp8_k_range(x_ptr, w_ptr, s_ptr, offs_m, offs_n, m_mask, n_mask, K, k_start, k_per_split,
                                stride_xm, stride_wn, stride_sn, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, BITS)
    _write_tile(acc, offs_m, offs_n, mn_mask, y_ptr, part_ptr, ticket_ptr, pid_m * tl.num_programs(1) + pid_n, pid_k,
                stride_ym, stride_pm, stride_psplit, SPLIT)


@triton.jit
def _logical_cols(t, R: tl.constexpr):
    """[R, 64, 2] (a 128-wide K block as two joined 64-wide halves, h last) -> [R, 128] in the logical column
    order of ``_fp8_decode_kernel``: memory column 64h + 16a + 8b3 + 4b2 + 2b1 + b0 becomes logical column
    64h + 32b3 + 16b2 + 8b1 + 2a + b0. (a: the 16-byte run, one per lane of a quad; b0: the bf16 pair.)
    The weight tile takes the same order in the kernel, spelled out there for its converted pairs."""
    t = tl.reshape(t, [R, 4, 2, 2, 2, 2, 2])  # (r, a, b3, b2, b1, b0, h)
    return tl.reshape(tl.permute(t, (0, 6, 2, 3, 4, 1, 5)), [R, 128])


@triton.jit
def _row_order(t):
    """[64, ...] with rows in memory order -> rows in the MMA's order: memory row 32r5 + 16r4 + 8r3 + r
    becomes row 32r4 + 16r3 + 8r5 + r (the load puts rows 8 and 16 on warps and 32 on a register; the
    operand wants 16 and 32 on warps and 8 on a register)."""
    shape: tl.constexpr = t.shape
    t = tl.reshape(t, [2, 2, 2, 8, t.numel // 64])
    return tl.reshape(tl.permute(t, (1, 2, 0, 3, 4)), shape)


@triton.jit
def _memory_rows(t):
    """The inverse of ``_row_order``."""
    shape: tl.constexpr = t.shape
    t = tl.reshape(t, [2, 2, 2, 8, t.numel // 64])
    return tl.reshape(tl.permute(t, (2, 0, 1, 3, 4)), shape)


@triton.jit
def _decode_k_range(w_ptrs, w_rows_ok, x_ptrs, m_mask, s_row, k_start, k_end, BLOCK_M: tl.constexpr,
                    NATURAL_K: tl.constexpr):
    """fp32 yᵀ [64, BLOCK_M] (rows in the MMA's order) summed from zero over K in [k_start, k_end), one 128-wide
    block at a time, every block chained into the one accumulator (see ``_fp8_decode_kernel``). ``NATURAL_K``:
    the weight's columns are stored in the kernel's logical order (``ops/fp8_layout.py``), so x is read as it is
    (``x_ptrs`` then spans the 128 columns of a block)."""
    BLOCK_N: tl.constexpr = 64
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_start, k_end, 128):  # K % 128 == 0 (the launcher checks)
        k1 = k0 + 64
        w = tl.join(tl.load(w_ptrs + k0 // 4, mask=w_rows_ok, other=0), tl.load(w_ptrs + k1 // 4, mask=w_rows_ok,
                                                                                 other=0))
        if NATURAL_K:
            xl = tl.trans(tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0))
        else:
            xl = tl.trans(_logical_cols(tl.join(tl.load(x_ptrs + k0, mask=m_mask[:, None], other=0.0),
                                                tl.load(x_ptrs + k1, mask=m_mask[:, None], other=0.0)), BLOCK_M))
        s = tl.load(s_row + k0 // 128) * 1.329227995784916e36  # * 2^120
        bits = s.to(tl.uint32, bitcast=True) >> 16
        mul = tl.full([BLOCK_N, 16, 2], 0, tl.int32) + (bits | (bits << 16)).to(tl.int32, bitcast=True)
        p01, p23 = e4m3_words_to_bf16(w, mul)  # [64, 16, 2]: (row, word, half)
        lo01, hi01 = halves(p01)
        lo23, hi23 = halves(p23)
        # (row, word, half, byte pair, byte in pair): the last join is innermost, so each register keeps
        # one converted pair, as the MMA operand wants it.
        wb = tl.join(tl.join(lo01, lo23), tl.join(hi01, hi23))
        wb = tl.reshape(wb, [BLOCK_N, 4, 2, 2, 2, 2, 2])  # (row, a, b3, b2, half, b1, b0)
        wl = _row_order(tl.reshape(tl.permute(wb, (0, 4, 2, 3, 5, 1, 6)), [BLOCK_N, 128]))
        acc = tl.dot(wl, xl.to(tl.bfloat16), acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _fp8_decode_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, part_ptr, ticket_ptr,
    M, N, K, k_per_split, group_rows,
    stride_xm, stride_wn, stride_sn, stride_ym, stride_pm, stride_psplit,
    BLOCK_M: tl.constexpr, SPLIT: tl.constexpr, SEGS: tl.constexpr = 1, NATURAL_K: tl.constexpr = False,
):
    """Swap-AB path for power-of-two scales: yᵀ tile [64, BM] = (w · s) [64, K] @ xᵀ [K, BM], split over K like
    ``_fp8_linear_kernel``. Program (n tile, K split, token tile); the default table takes it for small M (one
    token tile), the batch-invariant table for every M, its K range then being SEGS segments of ``k_per_split``,
    each summed from zero and added in order: the bits of SEGS split-K programs and ``_write_tile``'s ordered
    reduction.

    The weight is wgmma's register operand, and the tile is read in an order in which the bytes each thread
    loads (16-byte runs) are exactly its share of the MMA's operand: the K columns of a 128-wide block are
    taken in a fixed permuted order (``_logical_cols``; xᵀ's rows in the same order, so the dot is the same
    sum) and the tile's 64 rows in another (``_row_order``; the output rows follow). Bytes then go from
    shared memory to registers 16 at a time and are converted in place (``e4m3_words_to_bf16``, the scale
    folded into its multiply), with no layout shuffle between conversion and MMA (``loop_sass.py``: 244
    instructions per K step against 326 for the split-K MMA kernel at M <= 16, 255 against 425 at M <= 32);
    all K blocks of a segment chain into one accumulator. ``NATURAL_K``: the weight's columns are stored in that
    order (``ops/fp8_layout.py``), so xᵀ is read as it is (copied straight into shared memory; permuting it went
    through registers: 373 against 324 instructions per K step at 128 tokens).
    """
    BLOCK_N: tl.constexpr = 64
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    x_ptr += (pid_n * BLOCK_N // group_rows) * K  # grouped use, as in _fp8_linear_kernel
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col = tl.arange(0, 64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    words = tl.arange(0, 16)
    w_ptrs = w_ptr + offs_n[:, None] * (stride_wn // 4) + words[None, :]  # [64, 16] words: half a K block
    w_rows_ok = (offs_n < N)[:, None]
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (tl.arange(0, 128) if NATURAL_K else col)[None, :]
    s_row = s_ptr + (pid_n * BLOCK_N // 128) * stride_sn  # 64 rows lie in one 128-row scale block
    if SEGS == 1:
        k_start = pid_k * k_per_split
        acc = _decode_k_range(w_ptrs, w_rows_ok, x_ptrs, m_mask, s_row, k_start,
                              tl.minimum(k_start + k_per_split, K), BLOCK_M, NATURAL_K)
    else:  # (no K split is launched with SEGS > 1)
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for sg in range(SEGS):
            acc += _decode_k_range(w_ptrs, w_rows_ok, x_ptrs, m_mask, s_row, sg * k_per_split,
                                   tl.minimum((sg + 1) * k_per_split, K), BLOCK_M, NATURAL_K)
    # Rows back in memory order (a relabeling, no data movement), so that the stores are contiguous along N
    # (stored in the MMA's row order, the split-K partials were scattered 4-byte writes: 2-4x slower at M >= 8).
    acc = _memory_rows(acc)
    # Each (token tile, n tile) pair counts its own split tickets.
    _write_tile(tl.trans(acc), offs_m, offs_n, m_mask[:, None] & (offs_n < N)[None, :], y_ptr, part_ptr, ticket_ptr,
                pid_m * tl.num_programs(0) + pid_n, pid_k, stride_ym, stride_pm, stride_psplit, SPLIT)


@triton.jit
def load_swap_ab(w_ptr, x_ptr, offs_n, offs_m, k_idx, n_mask, m_mask, K, stride_wn, stride_xm):
    """One K step of a swap-AB GEMM: the weight tile [BN, BK] (rows offs_n) and xᵀ [BK, BM] (tokens offs_m),
    zero outside N, M and K."""
    k_mask = k_idx < K
    w = tl.load(w_ptr + offs_n[:, None] * stride_wn + k_idx[None, :], mask=n_mask[:, None] & k_mask[None, :],
                other=0.0)
    xt = tl.load(x_ptr + offs_m[None, :] * stride_xm + k_idx[:, None], mask=m_mask[None, :] & k_mask[:, None],
                 other=0.0)
    return w, xt


@triton.jit(do_not_specialize=["M"])
def _fp8_linear_wa_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, group_rows,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    IEEE: tl.constexpr, BITS: tl.constexpr,
):
    """Large-M path for power-of-two (UE8M0) scales: yᵀ tile [BN, BM] = (w · s) [BN, K] @ xᵀ [K, BM].

    The weight is the MMA's A operand, converted and scaled in registers (e4m3 -> bf16 is exact and a
    power-of-two scale keeps it exact), so all K blocks chain into one accumulator and the MMAs pipeline,
    instead of one MMA per K block followed by an fp32 rescale.
    """
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped order: GROUP_M row tiles share each weight tile while it is hot in L2.
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows_m
    pid_n = (pid % per_group) // group_rows_m
    x_ptr += (pid_n * BLOCK_N // group_rows) * K  # grouped use, as in _fp8_linear_kernel
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w, xt = load_swap_ab(w_ptr, x_ptr, offs_n, offs_m, k0 + offs_k, n_mask, m_mask, K, stride_wn, stride_xm)
        s = tl.load(s_ptr + (offs_n // 128) * stride_sn + k0 // 128, mask=n_mask, other=0.0)
        if IEEE:
            acc = tl.dot(w.to(tl.float32) * s[:, None], xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(to_bf16(w, BITS) * s.to(tl.bfloat16)[:, None], xt.to(tl.bfloat16), acc)
    y = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[None, :] & n_mask[:, None])


_TICKETS: dict[tuple[torch.device, int], torch.Tensor] = {}
MAX_TILES = 1 << 16


def _tickets(device: torch.device) -> torch.Tensor:
    """Tile counters of the split-K epilogue, per device and lane (``ops/lanes.py``: two GEMMs running at once
    on two streams must not count into the same tiles); zero between calls (the last program resets its own).

    Allocated on first use (which precedes any graph capture: capture is always preceded by a warm-up run).
    """
    key = (device, lanes.current())
    if key not in _TICKETS:
        _TICKETS[key] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _TICKETS[key]


def _split(programs: int, k: int, tuning: KernelTuning) -> int:
    return tuning.split_for(programs, k)


def _config(m: int, n: int, k: int, tuning: KernelTuning) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, split_k, num_warps, num_stages) from the M bucket and (N, K)."""
    bucket, (bm, bn, warps, stages) = tuning.fp8_tile(m)
    split = _split(triton.cdiv(m, bm) * triton.cdiv(n, bn), k, tuning) if bucket is not None else 1
    return bm, bn, split, warps, stages


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] = (128, 128), pow2_scales: bool = False,
               tuning: KernelTuning = H200) -> torch.Tensor:
    """x [M, K] (bf16/fp32) @ dequant(weight [N, K] e4m3, scale fp32 [ceil(N/128), ceil(K/128)]).T -> x.dtype."""
    assert block == (SCALE_BLOCK, SCALE_BLOCK), f"only 128x128 weight blocks are supported, got {block}"
    return _launch(x, weight, scale, 1, pow2_scales, tuning)


def fp8_linear_grouped(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int,
                       pow2_scales: bool = False, tuning: KernelTuning = H200) -> torch.Tensor:
    """Block-diagonal: x [M, G*K] -> [M, G*r]; output rows [g*r, (g+1)*r) of weight [G*r, K] read input
    columns [g*K, (g+1)*K). One launch for all groups (r must be a multiple of 128: whole scale blocks)."""
    return _launch(x, weight, scale, groups, pow2_scales, tuning)


def _launch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int, pow2_scales: bool,
            tuning: KernelTuning):
    assert weight.dtype == torch.float8_e4m3fn, f"weight must be float8_e4m3fn, got {weight.dtype}"
    assert scale.dtype == torch.float32, f"scale must be decoded fp32, got {scale.dtype}"
    assert x.dim() == 2 and x.shape[1] == groups * weight.shape[1], f"x {tuple(x.shape)} vs weight {tuple(weight.shape)}"
    assert x.stride(1) == 1 and weight.stride(1) == 1 and scale.stride(1) == 1, "inner dims must be contiguous"
    m = x.shape[0]
    n, k = weight.shape
    assert scale.shape == (triton.cdiv(n, 128), triton.cdiv(k, 128)), f"scale shape {tuple(scale.shape)}"
    group_rows = n // groups
    assert n % groups == 0 and (groups == 1 or group_rows % 128 == 0), f"{n} rows in {groups} groups"
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    swap_ab_ok = (pow2_scales and x.dtype == torch.bfloat16 and not _INTERPRET and k % 128 == 0
                  and group_rows % 64 == 0)  # what the swap-AB kernel handles: never a function of M
    # The table's weight layout (``ops/fp8_layout.py``): in kernel order, a weight's logical K column j is its
    # checkpoint column j for the swap-AB kernel; any other kernel reads the columns as stored, x permuted to match.
    natural_k = fp8_layout.laid_out(k, tuning.fp8_k_order)
    assert tuning.batch_invariant or not natural_k, "only the batch-invariant table stores FP8 weights in kernel order"
    if tuning.batch_invariant:
        if swap_ab_ok and tuning.invariant_fp8_swap_ab:
            return _launch_invariant_swap_ab(x, weight, scale, y, group_rows, tuning, natural_k)
        if natural_k:
            x = fp8_layout.to_kernel_order(x)
        return _launch_invariant(x, weight, scale, y, group_rows, tuning)
    c = dict(tuning.fp8_wa_tile)
    bits = tuning.fp8_e4m3_by_bits
    if pow2_scales and m >= tuning.fp8_wa_min_m and x.dtype == torch.bfloat16 and group_rows % c["BLOCK_N"] == 0:
        grid = (triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]),)
        _fp8_linear_wa_kernel[grid](
            x, weight, scale, y, m, n, k, group_rows, x.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
            BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], BLOCK_K=128, GROUP_M=c["GROUP_M"], IEEE=_INTERPRET,
            BITS=bits,
            num_warps=c["num_warps"], num_stages=c["num_stages"],
        )
        return y
    if swap_ab_ok and m <= tuning.fp8_decode_max_m:
        return _launch_decode(x, weight, scale, y, group_rows, tuning)
    bm, bn, split, warps, stages = _config(m, n, k, tuning)
    k_per_split = triton.cdiv(triton.cdiv(k, 128), split) * 128
    split = triton.cdiv(k, k_per_split)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
    assert split == 1 or grid[0] * grid[1] <= MAX_TILES, f"{grid[0] * grid[1]} split-K tiles > {MAX_TILES}"
    _fp8_linear_kernel[grid](
        x, weight, scale, y, part, _tickets(x.device), m, n, k, k_per_split, group_rows,
        x.stride(0), weight.stride(0), scale.stride(0), y.stride(0), part.stride(-2), part.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, IEEE=x.dtype == torch.float32 or _INTERPRET, SPLIT=split,
        BITS=bits,
        num_warps=warps, num_stages=stages,
    )
    return y


def _launch_invariant(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, y: torch.Tensor, group_rows: int,
                      tuning: KernelTuning) -> torch.Tensor:
    """Batch-invariant launch (``tuning.batch_invariant``; unless ``_launch_invariant_swap_ab`` takes the weight):
    the MMA kernel for every M, K summed in ``tuning.k_segment(N, K)`` segments added in order. The tile (one wgmma
    family for every bucket) and whether the segments run as split-K programs (too few tiles to fill the GPU)
    or inside each program change with M; neither changes a row's bits (tests/gpu/test_batch_invariant_kernels.py)."""
    m = x.shape[0]
    n, k = weight.shape
    bm, bn, warps, stages = tuning.invariant_fp8_tile(m)
    assert bm >= 64 and warps % 4 == 0, "batch-invariant tiles must all use the wgmma m64 instruction"
    seg, split, segs = tuning.segment_launch(n, k, triton.cdiv(m, bm) * triton.cdiv(n, bn))
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    _fp8_linear_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn), split)](
        x, weight, scale, y, part, _tickets(x.device), m, n, k, seg, group_rows,
        x.stride(0), weight.stride(0), scale.stride(0), y.stride(0), part.stride(-2), part.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, IEEE=x.dtype == torch.float32 or _INTERPRET, SPLIT=split,
        BITS=tuning.fp8_e4m3_by_bits, SEGS=segs, num_warps=warps, num_stages=stages,
    )
    return y


def _launch_invariant_swap_ab(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, y: torch.Tensor,
                              group_rows: int, tuning: KernelTuning, natural_k: bool) -> torch.Tensor:
    """Batch-invariant launch for power-of-two scales: the swap-AB kernel for every M (the decode path's
    speed at small M, where the MMA kernel cost up to 1.5x), K in ``tuning.k_segment(N, K)`` segments added in
    order. The token tile (the wgmma N side; each warpgroup runs the m64 instruction over the 64 weight rows for
    every tile) and where the segments run follow M; neither changes a row's bits. ``natural_k``: the weight is
    in kernel order (x read as it is; the kernel's speed at prefill-sized M)."""
    m = x.shape[0]
    n, k = weight.shape
    bm, warps, stages = tuning.invariant_decode_tile(m)
    assert warps % 4 == 0, "batch-invariant swap-AB tiles run whole warpgroups (wgmma m64 over the weight rows)"
    tiles = triton.cdiv(n, 64) * triton.cdiv(m, bm)
    seg, split, segs = tuning.segment_launch(n, k, tiles)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    assert split == 1 or tiles <= MAX_TILES, f"{tiles} split-K tiles > {MAX_TILES}"
    _fp8_decode_kernel[(triton.cdiv(n, 64), split, triton.cdiv(m, bm))](
        x, weight.view(torch.int32), scale, y, part, _tickets(x.device), m, n, k, seg, group_rows,
        x.stride(0), weight.stride(0), scale.stride(0), y.stride(0), part.stride(-2), part.stride(0),
        BLOCK_M=bm, SPLIT=split, SEGS=segs, NATURAL_K=natural_k, num_warps=warps, num_stages=stages,
    )
    return y


def _launch_decode(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, y: torch.Tensor, group_rows: int,
                   tuning: KernelTuning):
    m = x.shape[0]
    n, k = weight.shape
    bm, warps, stages = tuning.fp8_decode_tile(m)
    split = _split(triton.cdiv(n, 64), k, tuning)
    k_per_split = triton.cdiv(k // 128, split) * 128
    split = triton.cdiv(k, k_per_split)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    grid = (triton.cdiv(n, 64), split, 1)
    assert split == 1 or grid[0] <= MAX_TILES, f"{grid[0]} split-K tiles > {MAX_TILES}"
    _fp8_decode_kernel[grid](
        x, weight.view(torch.int32), scale, y, part, _tickets(x.device), m, n, k, k_per_split, group_rows,
        x.stride(0), weight.stride(0), scale.stride(0), y.stride(0), part.stride(-2), part.stride(0),
        BLOCK_M=bm, SPLIT=split, num_warps=warps, num_stages=stages,
    )
    return y
