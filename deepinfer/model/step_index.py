"""StepIndex: every cache row one step reads or writes, as flat index tensors built once per step.

The reference path (``attention.py``) walks the batch sequence by sequence in every layer and turns block
tables into rows with small tensor ops. The device path cannot afford that: it would launch hundreds of
tiny kernels per layer and stall on host syncs. Instead the host computes, once per step and with numpy,
where every token's rows live in the paged pools; every layer then reads and writes the cache through these
lists with a handful of batched kernels. The lists have fixed shapes when asked (``num_tokens``,
``num_seqs``, ``max_len``), which is what lets a decode step be captured once as a CUDA graph and replayed
with new contents.

All layers of a pool share one row numbering (every per-position tensor has stride 1, every compressed
tensor of ratio m has stride m), so one list serves all layers. Padding tokens (graph buckets) write to a
spare row past the last block of each pool (``KVStorage.spare_row``) and read nothing (-1 everywhere).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from itertools import chain

import numpy as np
import torch

from deepinfer.config.model import CSA, HCA
from deepinfer.kv.spec import HISTORY, STATE, WINDOW
from deepinfer.model.batch import ForwardBatch


@dataclass(frozen=True)
class CompressIndex:
    """Rows for the compressed layers of one (ratio m, overlap) kind: CSA (overlap) or HCA."""

    limits: torch.Tensor  # [T] int32: entries visible to each query, (p + 1) // m
    slot_rows: torch.Tensor  # [T, m or 2m] int32: state rows of the window the token closes (-1: none/empty)
    entry_rows: torch.Tensor  # [T] int64: history row that window's entry goes to (-1: token closes none)
    emit_pos: torch.Tensor  # [T] int64: start position of that window (its entry's RoPE angle)


@dataclass(frozen=True)
class StepIndex:
    token_seq: torch.Tensor  # [T] int32: the sequence (row of history_table) each token belongs to
    positions: torch.Tensor  # [T] int64
    window_rows: torch.Tensor  # [T] int64: where each token's window K=V row goes
    state_rows: torch.Tensor  # [T] int64: where each token's compressor-state rows go
    window_keys: torch.Tensor  # [T, window] int32: window K=V rows each query attends, oldest first
    history_table: torch.Tensor  # [B, blocks] int64: history-pool block ids per sequence (-1 past the end)
    seq_end: torch.Tensor  # [B] int64: positions each sequence covers after this step
    compress: dict[tuple[int, bool], CompressIndex]
    span: int  # positions the entry lists cover (fixed for graphs, else the batch's longest sequence)
    block_size: int

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "StepIndex":
        def move(t: torch.Tensor) -> torch.Tensor:
            if non_blocking and t.device.type == "cpu" and torch.device(device).type == "cuda":
                t = t.pin_memory()
            return t.to(device, non_blocking=non_blocking)

        comp = {k: CompressIndex(*(move(getattr(c, f.name)) for f in fields(c))) for k, c in self.compress.items()}
        return StepIndex(*(move(getattr(self, f.name)) for f in fields(self)[:7]), comp, self.span,
                         self.block_size)

    def copy_(self, src: "StepIndex") -> None:
        """Copy ``src`` (same shapes) into these tensors in place (CUDA-graph static inputs)."""
        assert src.span == self.span and src.block_size == self.block_size
        for f in fields(self)[:7]:
            getattr(self, f.name).copy_(getattr(src, f.name), non_blocking=True)
        for key, c in self.compress.items():
            for f in fields(c):
                getattr(c, f.name).copy_(getattr(src.compress[key], f.name), non_blocking=True)

    def entry_rows_per_seq(self, ratio: int) -> torch.Tensor:
        """[B, cdiv(span, m)] int32 history rows of entries 0.. of each sequence, -1 past its closed windows.

        Computed on the device from the block tables (inside a captured graph), not shipped from the host:
        for long contexts it is the largest list of the step, and it is a pure function of the tables.
        """
        per_block = self.block_size // ratio
        j = torch.arange(max(-(-self.span // ratio), 1), device=self.seq_end.device)
        col = (j // per_block).clamp(max=self.history_table.shape[1] - 1)
        blocks = self.history_table[:, col]
        valid = (j[None, :] < (self.seq_end // ratio)[:, None]) & (blocks >= 0)
        return torch.where(valid, blocks * per_block + j % per_block, -1).to(torch.int32)


def compress_kinds(layout) -> list[tuple[int, bool]]:
    """The (ratio, overlap) kinds of the compressed layers in ``layout``, in first-seen order."""
    kinds: list[tuple[int, bool]] = []
    for spec in layout.layers:
        if spec.kind in (CSA, HCA) and (spec.ratio, spec.kind == CSA) not in kinds:
            kinds.append((spec.ratio, spec.kind == CSA))
    return kinds


def _tables(batch: ForwardBatch, pool: str, num_seqs: int, width: int) -> np.ndarray:
    """[num_seqs, width] block ids (-1 padding); blocks past ``width`` cover positions no step reads."""
    out = np.full((num_seqs, width), -1, dtype=np.int64)
    tables = [r.block_tables[pool][:width] for r in batch.runs]
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    flat = np.fromiter(chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))
    # One scatter instead of a row-by-row copy: row i gets its table in columns 0..len-1.
    rows = np.repeat(np.arange(len(tables)), lens)
    out[rows, np.arange(len(flat)) - np.repeat(np.cumsum(lens) - lens, lens)] = flat
    return out


def _rows(table: np.ndarray, seq: np.ndarray, pos: np.ndarray, valid: np.ndarray, per_block: int,
          what: str) -> np.ndarray:
    """Rows of ``pos`` (positions or entry numbers) through each sequence's table; -1 where not valid."""
    col = np.where(valid, pos // per_block, 0)
    col = np.minimum(col, table.shape[1] - 1)
    blocks = table[seq, col] if seq.ndim == pos.ndim else table[seq[:, None], col]
    if np.any(valid & (blocks < 0)):
        raise IndexError(f"{what}: a needed block is missing or was released")
    return np.where(valid, blocks * per_block + pos % per_block, -1)


def build_step_index(batch: ForwardBatch, storage, window: int, *, num_tokens: int | None = None,
                     num_seqs: int | None = None, max_len: int | None = None) -> StepIndex:
    """Index lists for ``batch`` (CPU tensors). Optional fixed shapes (what a captured graph needs): tokens
    padded to ``num_tokens``, sequences to ``num_seqs``, entry lists and block tables sized for ``max_len``."""
    layout = storage.layout
    bs = layout.block_size
    runs = batch.runs
    t_real, b_real = batch.num_tokens, len(runs)
    t_all, b_all = num_tokens or t_real, num_seqs or b_real
    if t_all < t_real or b_all < b_real:
        raise ValueError(f"num_tokens/num_seqs: {t_all}/{b_all} is less than the batch's {t_real}/{b_real}")
    lengths = np.array([r.length for r in runs], dtype=np.int64)
    seq = np.repeat(np.arange(b_real), lengths)
    pos = np.concatenate([np.arange(r.first_pos, r.end_pos) for r in runs]) if runs else np.zeros(0, np.int64)
    end_pos = np.array([r.end_pos for r in runs] + [0] * (b_all - b_real), dtype=np.int64)
    span = max_len or max(int(end_pos.max(initial=0)), 1)
    if end_pos.max(initial=0) > span:
        raise ValueError(f"max_len: {span} is shorter than a sequence of the batch ({int(end_pos.max())})")
    real = np.ones(t_real, dtype=bool)

    width = -(-span // bs)
    win, state, hist = (_tables(batch, p, b_all, width) for p in (WINDOW, STATE, HISTORY))
    window_rows = _rows(win, seq, pos, real, bs, "window_kv")
    state_rows = _rows(state, seq, pos, real, bs, "compressor state") if _has_pool(layout, STATE) else pos * 0
    kp = pos[:, None] - window + 1 + np.arange(window)
    window_keys = _rows(win, seq, kp, kp >= 0, bs, "window keys")

    compress = {}
    for m, overlap in compress_kinds(layout):
        closes = (pos + 1) % m == 0
        w = (pos + 1) // m - 1
        entry_rows = _rows(hist, seq, w, closes, bs // m, "compressed entries")
        own = w[:, None] * m + np.arange(m)
        slots = np.concatenate([own - m, own], axis=1) if overlap else own
        slot_rows = _rows(state, seq, slots, closes[:, None] & (slots >= 0), bs, "compressor state")
        compress[(m, overlap)] = _pad_compress((pos + 1) // m, slot_rows, entry_rows, np.where(closes, w * m, 0),
                                               t_all)

    pad = t_all - t_real
    spare_w, spare_s = storage.spare_row(WINDOW), storage.spare_row(STATE)
    return StepIndex(
        token_seq=_t(np.concatenate([seq, np.full(pad, b_all - 1 if b_all > b_real else 0)]), torch.int32),
        positions=_t(np.concatenate([pos, np.zeros(pad, np.int64)]), torch.int64),
        window_rows=_t(np.concatenate([window_rows, np.full(pad, spare_w)]), torch.int64),
        state_rows=_t(np.concatenate([state_rows, np.full(pad, spare_s)]), torch.int64),
        window_keys=_t(np.concatenate([window_keys, np.full((pad, window), -1)]), torch.int32),
        history_table=_t(hist, torch.int64),
        seq_end=_t(end_pos, torch.int64),
        compress=compress,
        span=span,
        block_size=bs,
    )


def _pad_compress(limits, slot_rows, entry_rows, emit_pos, t_all: int) -> CompressIndex:
    pad = t_all - len(limits)
    return CompressIndex(
        limits=_t(np.concatenate([limits, np.zeros(pad, np.int64)]), torch.int32),
        slot_rows=_t(np.concatenate([slot_rows, np.full((pad, slot_rows.shape[1]), -1)]), torch.int32),
        entry_rows=_t(np.concatenate([entry_rows, np.full(pad, -1)]), torch.int64),
        emit_pos=_t(np.concatenate([emit_pos, np.zeros(pad, np.int64)]), torch.int64),
    )


def _has_pool(layout, pool: str) -> bool:
    return any(t.pool == pool for s in layout.layers for t in s.tensors)


def _t(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)
