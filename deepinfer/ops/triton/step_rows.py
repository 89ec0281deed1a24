"""A step's cache row lists in one launch; twin of ``ops/ref/step_rows.py`` (same signature, same values).

Why: the reference derives the lists with ~100 tiny tensor ops per step (lookups, masks, concatenations).
Inside a captured decode graph each is a dependent node of ~2-3 µs, so the preamble took ~0.28 ms per
step, about a 43-layer model's 2-3% at batch 1 (bench/results/README.md, run 50). Here every output comes
from one kernel with no intermediate tensors:
  * program t < T (one per token): its window and state rows, its window keys, and per compressed kind
    the visible-entry limit, the closing window's state slots, that window's entry row and start position,
    and (HCA) its list of visible entry rows, read straight from the history table (no dependency on the
    per-sequence lists, so no ordering between programs);
  * program T + b (one per sequence): the sequence's entry rows per kind.
All index math is integer; positions are >= 0, so truncating and flooring division agree wherever a
result is used (negative positions only produce masked lookups).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.ops.ref.step_rows import KindRows

CHUNK = 1024  # entry-list columns per inner step


@triton.jit
def _lookup(table_ptr, s, p, per_block, width, stride):
    """Row of position p (tensor) of sequence s through a block table; -1 where p < 0 or the block is -1."""
    ok = p >= 0
    blk = tl.minimum(tl.where(ok, p, 0) // per_block, width - 1)
    b = tl.load(table_ptr + s * stride + blk, mask=ok, other=-1)
    return tl.where(ok & (b >= 0), b * per_block + tl.where(ok, p, 0) % per_block, -1)


@triton.jit
def _entry_list(out_ptr, hist_ptr, s, end, limit, per_block, width, stride_h, n_cols, M: tl.constexpr,
                CHUNK: tl.constexpr):
    """out[j] = entry j's history row of sequence s for j < min(end // M, limit), else -1; j < n_cols."""
    for j0 in range(0, n_cols, CHUNK):
        j = j0 + tl.arange(0, CHUNK)
        rows = _lookup(hist_ptr, s, j, per_block, width, stride_h)
        rows = tl.where((j < end // M) & (j < limit), rows, -1)
        tl.store(out_ptr + j, rows.to(tl.int32), mask=j < n_cols)


@triton.jit
def _token_kind(t, s, p, end, hist_ptr, state_ptr, width, stride_h, stride_s, block_size, n_cols,
                limits_ptr, slots_ptr, entry_ptr, emit_ptr, visible_ptr,
                M: tl.constexpr, OVERLAP: tl.constexpr, CHUNK: tl.constexpr):
    closes = (p + 1) % M == 0
    w = tl.where(closes, (p + 1) // M - 1, -1)
    limit = (p + 1) // M
    tl.store(limits_ptr + t, limit.to(tl.int32))
    NS: tl.constexpr = 2 * M if OVERLAP else M
    j = tl.arange(0, NS)
    # The window's own M slots, preceded with overlap by the previous window's M: w*M - M + j, or w*M + j.
    slot = tl.where(closes, w * M + j - (M if OVERLAP else 0), -1)
    tl.store(slots_ptr + t * NS + j, _lookup(state_ptr, s, slot, block_size, width, stride_s).to(tl.int32))
    per_block = block_size // M
    tl.store(entry_ptr + t, tl.sum(_lookup(hist_ptr, s, tl.full([1], 0, tl.int64) + w, per_block, width,
                                           stride_h), axis=0))
    tl.store(emit_ptr + t, tl.where(closes, w * M, 0))
    if not OVERLAP:
        _entry_list(visible_ptr + t * n_cols, hist_ptr, s, end, limit, per_block, width, stride_h, n_cols, M,
                    CHUNK)


# Ints that change from step to step are not specialized on (Triton would compile one binary per class of
# value: == 1, divisible by 16, other, for each): T and the entry-list widths move with the step's token
# count and its longest sequence, and serving kept compiling new variants of this kernel minutes in (a
# quarter of the engine core's samples at concurrency 256 on the H200). Nothing here gains from the hints.
@triton.jit(do_not_specialize=["cols0", "cols1", "T", "spare_window", "spare_state"])
def _step_rows_kernel(
    seq_ptr, pos_ptr, win_tab, state_tab, hist_tab, end_ptr,
    window_rows_ptr, state_rows_ptr, keys_ptr,
    lim0, slots0, entry0, emit0, seqrows0, vis0, cols0,
    lim1, slots1, entry1, emit1, seqrows1, vis1, cols1,
    T, width, stride_w, stride_s, stride_h, block_size, spare_window, spare_state,
    WINDOW: tl.constexpr, WP: tl.constexpr, KINDS: tl.constexpr,
    M0: tl.constexpr, OV0: tl.constexpr, M1: tl.constexpr, OV1: tl.constexpr, CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < T:
        t = pid
        s = tl.load(seq_ptr + t)
        p = tl.load(pos_ptr + t)
        end = tl.load(end_ptr + s)
        one = tl.full([1], 0, tl.int64) + p
        wr = tl.sum(_lookup(win_tab, s, one, block_size, width, stride_w), axis=0)
        sr = tl.sum(_lookup(state_tab, s, one, block_size, width, stride_s), axis=0)
        tl.store(window_rows_ptr + t, tl.where(wr >= 0, wr, spare_window))
        tl.store(state_rows_ptr + t, tl.where(sr >= 0, sr, spare_state))
        i = tl.arange(0, WP)
        keys = _lookup(win_tab, s, p - WINDOW + 1 + i, block_size, width, stride_w)
        tl.store(keys_ptr + t * WINDOW + i, keys.to(tl.int32), mask=i < WINDOW)
        if KINDS > 0:
            _token_kind(t, s, p, end, hist_tab, state_tab, width, stride_h, stride_s, block_size, cols0,
                        lim0, slots0, entry0, emit0, vis0, M0, OV0, CHUNK)
        if KINDS > 1:
            _token_kind(t, s, p, end, hist_tab, state_tab, width, stride_h, stride_s, block_size, cols1,
                        lim1, slots1, entry1, emit1, vis1, M1, OV1, CHUNK)
    else:
        b = pid - T
        end = tl.load(end_ptr + b)
        if KINDS > 0:
            _entry_list(seqrows0 + b * cols0, hist_tab, b, end, end // M0, block_size // M0, width, stride_h,
                        cols0, M0, CHUNK)
        if KINDS > 1:
            _entry_list(seqrows1 + b * cols1, hist_tab, b, end, end // M1, block_size // M1, width, stride_h,
                        cols1, M1, CHUNK)


def step_rows(token_seq: torch.Tensor, positions: torch.Tensor, window_table: torch.Tensor,
              state_table: torch.Tensor, history_table: torch.Tensor, seq_end: torch.Tensor, span: int,
              block_size: int, window: int, kinds: tuple[tuple[int, bool], ...], spare_window: int,
              spare_state: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[KindRows]]:
    """See ``ops/ref/step_rows.py``."""
    if len(kinds) > 2:
        raise ValueError(f"kinds: at most 2 compressed kinds (V4 has CSA and HCA), got {kinds}")
    tables = (window_table, state_table, history_table)
    if len({t.shape for t in tables}) != 1 or any(t.stride(1) != 1 for t in tables):
        raise ValueError(f"block tables: one shape, unit column stride: {[tuple(t.shape) for t in tables]}")
    t_all, b_all = positions.shape[0], seq_end.shape[0]
    dev = positions.device
    i32, i64 = torch.int32, torch.int64
    window_rows = torch.empty(t_all, dtype=i64, device=dev)
    state_rows = torch.empty(t_all, dtype=i64, device=dev)
    keys = torch.empty((t_all, window), dtype=i32, device=dev)
    per_kind, args, consts = [], [], {}
    for k in range(2):
        if k < len(kinds):
            m, overlap = kinds[k]
            cols = max(-(-span // m), 1)
            rows = KindRows(torch.empty(t_all, dtype=i32, device=dev),
                            torch.empty((t_all, 2 * m if overlap else m), dtype=i32, device=dev),
                            torch.empty(t_all, dtype=i64, device=dev), torch.empty(t_all, dtype=i64, device=dev),
                            torch.empty((b_all, cols), dtype=i32, device=dev),
                            None if overlap else torch.empty((t_all, cols), dtype=i32, device=dev))
            per_kind.append(rows)
            args += [rows.limits, rows.slot_rows, rows.entry_rows, rows.emit_pos, rows.seq_rows,
                     rows.slot_rows if overlap else rows.visible_rows, cols]  # (no list with overlap: unused)
            consts.update({f"M{k}": m, f"OV{k}": overlap})
        else:
            args += [window_rows] * 6 + [1]  # unused placeholders
            consts.update({f"M{k}": 1, f"OV{k}": True})
    if t_all + b_all == 0:
        return window_rows, state_rows, keys, per_kind
    _step_rows_kernel[(t_all + b_all,)](
        token_seq, positions, window_table, state_table, history_table, seq_end, window_rows, state_rows, keys,
        *args, t_all, window_table.shape[1], window_table.stride(0), state_table.stride(0),
        history_table.stride(0), block_size, spare_window, spare_state,
        WINDOW=window, WP=triton.next_power_of_2(window), KINDS=len(kinds), CHUNK=CHUNK, **consts, num_warps=4)
    return window_rows, state_rows, keys, per_kind
