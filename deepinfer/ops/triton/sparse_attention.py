"""Index-list sparse attention with a per-head sink, in Triton; twin of ``ops/ref/sparse_attention.py``.

One program owns (head group of BLOCK_H heads, one query, one key split). It gathers BLOCK_N key rows per
step through the query's index list, loads each row once and uses it for both products of all its heads
(K = V): logits = q·kᵀ for BLOCK_H heads at once (an [BLOCK_H, D] x [D, BLOCK_N] MMA), an fp32 online
softmax, then P·V with the same tile. The sink is folded in once, at the end, never per split.

Key splits (determinism.md §2.3, §7 item 8). The split axis is the last source's columns
(``indices_extra`` when given, else ``indices``); split s holds its columns [s*SPLIT, (s+1)*SPLIT), and
split 0 also holds every column of the first source when there are two. SPLIT is a module constant,
not a function of the batch, so with entry j in column j of ``indices_extra`` the boundaries sit at
fixed absolute entry numbers. With SPLIT = 1024, CSA (<= 512 entries) and HCA up to 128K tokens of
context never split. More splits than a query needs (a batch padded wider) add splits with no valid key,
whose merge weight is exactly 0, and a single-split query's fused epilogue is the merge epilogue with
weight 1: the output bits do not depend on the padding width, the batch or the split count.
Partials (m, l, acc in fp32) are merged in split order by a second kernel; no atomics anywhere.

Small batches (fewer than ``attention_fill_programs`` programs at SPLIT, i.e. decode) split much finer
instead (``KernelTuning``, ops/tuning.py): every ``attention_small_split`` columns of the last source (at most ~8 such splits: wider for long HCA lists), with the first
source (the window) a split of its own. A decode query's walk over up to 640 keys in 20 dependent gather
steps, on 4 programs at batch 1, then spreads over 4 x (1 + N2 / small split) programs. This choice
depends on the batch and the index width, so a row's bits do too: a batch-invariant op table turns it
off (``attention_small_split=0``); prefill keeps SPLIT, whose partials would be gigabytes at 128 columns.

The batch-invariant table (``KernelTuning.batch_invariant``) splits every query the same way instead: the
window a split of its own, then every ``attention_invariant_split`` columns of the last source, each split
from a fresh state and the splits folded in order (``_fold``). Decode runs each split as a program and folds
in ``_merge_kernel``; prefill folds them one after another inside each program (no partials). The same fold
in the same order, so the same bits, and decode keeps most of the small-batch split's parallelism.

Within a program the reduction runs over key blocks in column order. All-invalid blocks (padding) leave
the state bit-identical (alpha = 1, p = 0), so trailing padding never changes a result.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.ops.tuning import H200, KernelTuning

# Triton's interpreter multiplies bf16 operands as raw uint16 bits: upcast (exactly) to fp32 dots there.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# Keys per split along the split axis (see module docstring). Changing it changes bits; fixed per build.
SPLIT = 1024
LOG2E = 1.4426950408889634
LOG2E_C: tl.constexpr = tl.constexpr(LOG2E)
# Running max starts finite: a block with no valid key then gives alpha = exp2(0) = 1, p = 0 (no NaN).
NEG_INIT: tl.constexpr = tl.constexpr(-1.0e30)


@triton.jit
def _attend_range(q, acc, m_i, l_i, kv_ptr, idx_row_ptr, start, end, stride_kv, qk_scale,
                  offs_d, d_mask, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    """Online softmax over index-list columns [start, end) of one source; returns (acc, m_i, l_i)."""
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + offs_n
        rows = tl.load(idx_row_ptr + cols, mask=cols < end, other=-1)
        valid = rows >= 0
        # The one read of these key rows: 16-byte vectors along D, masked rows fetch nothing.
        k = tl.load(kv_ptr + rows.to(tl.int64)[:, None] * stride_kv + offs_d[None, :],
                    mask=valid[:, None] & d_mask[None, :], other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))  # log2 domain, fp32
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Exactly 1 when the max did not move (ex2.approx need not return 1.0 for 0): padding is bit-neutral.
        alpha = tl.where(m_new == m_i, 1.0, tl.exp2(m_i - m_new))
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if IEEE:
            # p rounded to the key dtype first, as on the MMA path (a no-op for fp32).
            acc = tl.dot(p.to(k.dtype).to(tl.float32), k.to(tl.float32), acc * alpha[:, None],
                         input_precision="ieee")
        else:
            acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _finalize(acc, m_i, l_i, sink2):
    """Fold the sink (log2 domain) into the denominator once: out = acc·2^(m-mf) / (l·2^(m-mf) + 2^(sink-mf))."""
    mf = tl.maximum(m_i, sink2)
    alpha = tl.where(mf == m_i, 1.0, tl.exp2(m_i - mf))
    denom = l_i * alpha + tl.exp2(sink2 - mf)
    return acc * (alpha / denom)[:, None]


@triton.jit
def _fold(M, L, A, m_s, l_s, a_s):
    """Fold one split's state (m_s, l_s, a_s) into the running (M, L, A), splits taken in order: the merge of
    the batch-invariant path, the same code whether the splits ran as programs of their own (``_merge_kernel``)
    or one after another in one program. A split with no valid key (m_s = NEG_INIT) leaves the state as it
    is and the first split with one becomes it, both exactly (no 0 * x + y that could turn -0 into +0), so
    trailing padding splits and the split count never change a bit."""
    M2 = tl.maximum(M, m_s)
    a = tl.where(M2 == M, 1.0, tl.exp2(M - M2))
    b = tl.where(M2 == m_s, 1.0, tl.exp2(m_s - M2))
    empty_s = m_s == NEG_INIT
    empty = M == NEG_INIT
    L = tl.where(empty, l_s, tl.where(empty_s, L, L * a + l_s * b))
    A = tl.where(empty[:, None], a_s, tl.where(empty_s[:, None], A, A * a[:, None] + a_s * b[:, None]))
    return tl.where(empty_s, M, M2), L, A


@triton.jit
def _split_state(q, kv_ptr, idx_ptr, kv2_ptr, idx2_ptr, lq, s_idx, N, N2, split, stride_kv, stride_il, stride_kv2,
                 stride_i2l, qk_scale, offs_d, d_mask, HAS_EXTRA: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr, WINDOW_ALONE: tl.constexpr):
    """(acc, m, l) of split ``s_idx`` from a fresh state. Two sources: split 0 attends the first (the window)
    and, unless WINDOW_ALONE, columns [0, split) of the second; split s > 0 columns [(s - WINDOW_ALONE) * split,
    + split) of the second. One source: columns [s * split, (s + 1) * split). The batch-invariant path's splits
    are these with the window alone."""
    acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_H,), NEG_INIT, dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    if HAS_EXTRA:
        if s_idx == 0:
            acc, m_i, l_i = _attend_range(q, acc, m_i, l_i, kv_ptr, idx_ptr + lq * stride_il, 0, N, stride_kv,
                                          qk_scale, offs_d, d_mask, BLOCK_N, IEEE)
        lo = (s_idx - WINDOW_ALONE) * split
        if lo >= 0:
            acc, m_i, l_i = _attend_range(q, acc, m_i, l_i, kv2_ptr, idx2_ptr + lq * stride_i2l, lo,
                                          tl.minimum(lo + split, N2), stride_kv2, qk_scale, offs_d, d_mask,
                                          BLOCK_N, IEEE)
    else:
        lo = s_idx * split
        acc, m_i, l_i = _attend_range(q, acc, m_i, l_i, kv_ptr, idx_ptr + lq * stride_il, lo,
                                      tl.minimum(lo + split, N), stride_kv, qk_scale, offs_d, d_mask, BLOCK_N, IEEE)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["N", "N2", "split", "stride_il", "stride_i2l"])
def _sparse_attn_kernel(
    q_ptr, kv_ptr, idx_ptr, kv2_ptr, idx2_ptr, sink_ptr, out_ptr, mpart_ptr, lpart_ptr, apart_ptr,
    H, N, N2, D, qk_scale, split,
    stride_ql, stride_qh, stride_kv, stride_il, stride_kv2, stride_i2l, stride_ol, stride_oh,
    HAS_EXTRA: tl.constexpr, FUSED: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, IEEE: tl.constexpr, WINDOW_ALONE: tl.constexpr = 0, INVARIANT: tl.constexpr = False,
    segs=1,
):
    # Axis 0 = query * head groups + head group (axis 0 has no 65535 limit, prefill needs that), head group
    # fastest: the programs that read the same key rows run side by side and share them through L2.
    n_hg = tl.cdiv(H, BLOCK_H)
    hg = tl.program_id(0) % n_hg
    lq = (tl.program_id(0) // n_hg).to(tl.int64)
    sp = tl.program_id(1)
    num_splits = tl.num_programs(1)
    offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < H
    d_mask = offs_d < D
    q = tl.load(q_ptr + lq * stride_ql + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if INVARIANT:
        # Batch-invariant: this program's splits sp*segs .. sp*segs + segs - 1 (the window alone), each from a
        # fresh state, folded in order (segs = 1 when every split has a program of its own and _merge_kernel
        # folds them).
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        m_i = tl.full((BLOCK_H,), NEG_INIT, dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j in range(segs):
            a_s, m_s, l_s = _split_state(q, kv_ptr, idx_ptr, kv2_ptr, idx2_ptr, lq, sp * segs + j, N, N2, split,
                                         stride_kv, stride_il, stride_kv2, stride_i2l, qk_scale, offs_d, d_mask,
                                         HAS_EXTRA, BLOCK_H, BLOCK_N, BLOCK_D, IEEE, 1)
            m_i, l_i, acc = _fold(m_i, l_i, acc, m_s, l_s, a_s)
    else:
        acc, m_i, l_i = _split_state(q, kv_ptr, idx_ptr, kv2_ptr, idx2_ptr, lq, sp, N, N2, split, stride_kv,
                                     stride_il, stride_kv2, stride_i2l, qk_scale, offs_d, d_mask, HAS_EXTRA, BLOCK_H,
                                     BLOCK_N, BLOCK_D, IEEE, WINDOW_ALONE)
    if FUSED:
        sink2 = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0) * LOG2E_C
        out = _finalize(acc, m_i, l_i, sink2)
        tl.store(out_ptr + lq * stride_ol + offs_h[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])
    else:
        # Partials laid out [L, H, S] and [L, H, S, BLOCK_D], all fp32.
        base = (lq * H + offs_h) * num_splits + sp
        tl.store(mpart_ptr + base, m_i, mask=h_mask)
        tl.store(lpart_ptr + base, l_i, mask=h_mask)
        tl.store(apart_ptr + base[:, None] * BLOCK_D + offs_d[None, :], acc, mask=h_mask[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(mpart_ptr, lpart_ptr, apart_ptr, sink_ptr, out_ptr, H, D, num_splits,
                  stride_ol, stride_oh, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK_D: tl.constexpr,
                  SP: tl.constexpr, INVARIANT: tl.constexpr = False):
    """Merge split partials in split order (fixed), then the same epilogue as the fused path. One program per
    (query, head group, CHUNK_D columns); every split's loads are issued at once (SP >= num_splits, unrolled).

    Bits do not depend on SP or on trailing empty splits: those have weight exactly 0 and add exact zeros."""
    n_hg = tl.cdiv(H, BLOCK_H)
    hg = tl.program_id(0) % n_hg
    lq = (tl.program_id(0) // n_hg).to(tl.int64)
    offs_h = hg * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.program_id(1) * CHUNK_D + tl.arange(0, CHUNK_D)
    offs_s = tl.arange(0, SP)
    h_mask = offs_h < H
    hs_mask = h_mask[:, None] & (offs_s < num_splits)[None, :]
    base = (lq * H + offs_h) * num_splits
    if INVARIANT:  # the batch-invariant path: ``_fold`` over the splits in order, as inside its programs
        M = tl.full((BLOCK_H,), NEG_INIT, dtype=tl.float32)
        L = tl.zeros((BLOCK_H,), dtype=tl.float32)
        A = tl.zeros((BLOCK_H, CHUNK_D), dtype=tl.float32)
        for s in range(num_splits):
            m_s = tl.load(mpart_ptr + base + s, mask=h_mask, other=NEG_INIT)
            l_s = tl.load(lpart_ptr + base + s, mask=h_mask, other=0.0)
            a_s = tl.load(apart_ptr + (base + s)[:, None] * BLOCK_D + offs_d[None, :], mask=h_mask[:, None],
                          other=0.0)
            M, L, A = _fold(M, L, A, m_s, l_s, a_s)
        sink2 = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0) * LOG2E_C
        out = _finalize(A, M, L, sink2)
        tl.store(out_ptr + lq * stride_ol + offs_h[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & (offs_d < D)[None, :])
        return
    # A split with no valid key has m_s = NEG_INIT, l_s = 0, acc_s = 0: weight 0 (or 1 when no split has a
    # key, with l = 0 and acc = 0 all the same).
    m_s = tl.load(mpart_ptr + base[:, None] + offs_s[None, :], mask=hs_mask, other=NEG_INIT)
    m = tl.max(m_s, axis=1)
    w = tl.where(m_s == m[:, None], 1.0, tl.exp2(m_s - m[:, None]))
    l_i = tl.sum(tl.load(lpart_ptr + base[:, None] + offs_s[None, :], mask=hs_mask, other=0.0) * w, axis=1)
    acc = tl.zeros((BLOCK_H, CHUNK_D), dtype=tl.float32)
    for s in tl.static_range(SP):
        w_s = tl.sum(tl.where(offs_s[None, :] == s, w, 0.0), axis=1)
        # The split test as a [BLOCK_H] block, not a scalar: Triton's interpreter rejects a scalar mask joined
        # to a block one (the compiled code is the same).
        live = h_mask & (offs_h * 0 + s < num_splits)
        a = tl.load(apart_ptr + (base + s)[:, None] * BLOCK_D + offs_d[None, :], mask=live[:, None], other=0.0)
        acc += a * w_s[:, None]
    sink2 = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0) * LOG2E_C
    out = _finalize(acc, m, l_i, sink2)
    tl.store(out_ptr + lq * stride_ol + offs_h[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & (offs_d < D)[None, :])


def config(dtype: torch.dtype, d: int) -> dict[str, int]:
    """Tiles by (dtype, D) only -- never by batch or length, which would change the reduction order.

    bf16 at D=512: a 16-head x 512 q tile (16 KB, MMA operand) and a 32 KB fp32 accumulator per program;
    a [32, 512] bf16 key tile is 32 KB per pipeline stage, so two stages leave room for 3 programs per SM.
    fp32 (tests only) uses IEEE FMA dots: small key tiles and 8 warps to keep registers in check.
    """
    if dtype == torch.float32:
        return {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 8, "num_stages": 1}
    return dict(CONFIG_BF16)


# The bf16 tiles; bench/kernels/bench_attention.py sweeps alternatives (pick one, keep it fixed).
CONFIG_BF16: dict[str, int] = {"BLOCK_H": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


def sparse_attention_indexed(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    kv_extra: torch.Tensor | None = None,
    indices_extra: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    tuning: KernelTuning = H200,
) -> torch.Tensor:
    """q [L, H, D], kv [R, D], indices [L, N] int32 (-1 invalid), sinks [H] fp32 -> out [L, H, D] in q.dtype.

    Optional second source kv_extra [R2, D] with indices_extra [L, N2] (the split axis; see module doc).
    ``out`` (optional, [L, H, D] with unit stride along D) is written in place and returned.
    """
    if (kv_extra is None) != (indices_extra is None):
        raise ValueError("kv_extra and indices_extra go together")
    assert q.dim() == 3 and kv.dim() == 2 and kv.shape[1] == q.shape[2], f"q {tuple(q.shape)} kv {tuple(kv.shape)}"
    assert kv.dtype == q.dtype and q.dtype in (torch.bfloat16, torch.float16, torch.float32), (q.dtype, kv.dtype)
    L, H, D = q.shape
    assert indices.shape[0] == L and sinks.shape == (H,)
    q = q if q.stride(2) == 1 else q.contiguous()
    kv = kv if kv.stride(1) == 1 else kv.contiguous()
    indices = indices.to(torch.int32).contiguous()
    sinks = sinks.float().contiguous()
    has_extra = kv_extra is not None
    if has_extra:
        assert kv_extra.dtype == q.dtype and kv_extra.shape[1] == D and indices_extra.shape[0] == L
        kv2 = kv_extra if kv_extra.stride(1) == 1 else kv_extra.contiguous()
        idx2 = indices_extra.to(torch.int32).contiguous()
    else:
        kv2, idx2 = kv, indices  # unused placeholders
    n, n2 = indices.shape[1], idx2.shape[1] if has_extra else 0
    cfg = config(q.dtype, D)
    block_h, block_n = cfg["BLOCK_H"], cfg["BLOCK_N"]
    n_hg = triton.cdiv(H, block_h)
    width = n2 if has_extra else n  # the split axis: the last source
    if tuning.batch_invariant:
        # Splits of ``attention_invariant_split`` columns at fixed absolute columns, the window a split of its
        # own, each from a fresh state and folded in order (``_fold``): as programs of their own (folded by the
        # merge kernel) while the step has few queries (decode), else one after another inside each program.
        # The same fold in the same order, so the same bits whatever the batch, the padding or the step's shape.
        assert not tuning.attention_small_split, "batch-invariant attention: its own split only (invariant())"
        split, window_alone = tuning.attention_invariant_split, has_extra
        num_splits = max(1, int(has_extra) + triton.cdiv(width, split))
        programs = num_splits if num_splits > 1 and L * n_hg < tuning.attention_fill_programs else 1
    else:
        split, window_alone = SPLIT, False
        small = tuning.attention_small_split
        if small and L * n_hg < tuning.attention_fill_programs:
            # At most ~8 splits of the last source (long HCA lists get wider splits), window apart. The merge
            # order then depends on how many queries the step has: never in the batch-invariant table.
            split = max(small, triton.next_power_of_2(triton.cdiv(width, 8)))
            window_alone = has_extra and n > 0
        num_splits = programs = max(1, window_alone + triton.cdiv(width, split))
    block_d = max(16, triton.next_power_of_2(D))
    if out is None:
        out = torch.empty((L, H, D), dtype=q.dtype, device=q.device)
    assert out.shape == (L, H, D) and out.dtype == q.dtype and out.stride(2) == 1, "bad out tensor"
    if L == 0:
        return out
    fused = programs == 1
    if fused:
        mpart = lpart = apart = out  # unused placeholders
    else:
        mpart = torch.empty((L, H, num_splits), dtype=torch.float32, device=q.device)
        lpart = torch.empty_like(mpart)
        apart = torch.empty((L, H, num_splits, block_d), dtype=torch.float32, device=q.device)
    _sparse_attn_kernel[(n_hg * L, programs)](
        q, kv, indices, kv2, idx2, sinks, out, mpart, lpart, apart,
        H, n, n2, D, float(scale) * LOG2E, split,
        q.stride(0), q.stride(1), kv.stride(0), indices.stride(0), kv2.stride(0), idx2.stride(0),
        out.stride(0), out.stride(1),
        HAS_EXTRA=has_extra, FUSED=fused, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32 or _INTERPRET, WINDOW_ALONE=int(window_alone),
        INVARIANT=tuning.batch_invariant, segs=num_splits // programs,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    if not fused:
        chunk_d = min(block_d, 128)
        # The default merge issues every split's loads at once (one binary up to 8 splits); the invariant one
        # folds them in a loop.
        sp = 8 if tuning.batch_invariant else max(8, triton.next_power_of_2(num_splits))
        _merge_kernel[(n_hg * L, block_d // chunk_d)](
            mpart, lpart, apart, sinks, out, H, D, num_splits, out.stride(0), out.stride(1),
            BLOCK_H=block_h, BLOCK_D=block_d, CHUNK_D=chunk_d, SP=sp, INVARIANT=tuning.batch_invariant, num_warps=4,
        )
    return out
