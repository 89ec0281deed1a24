"""StepIndex / StepRows: every cache row one step reads or writes, as flat index tensors.

The reference path (``attention.py``) walks the batch sequence by sequence in every layer and turns block
tables into rows with small tensor ops. The device path cannot afford that: it would launch hundreds of
tiny kernels per layer and stall on host syncs. Instead one step works in two stages:

  * ``StepIndex`` (host, numpy): the few per-step facts only the scheduler knows — each token's sequence
    and position, each sequence's block tables and length — padded to fixed shapes when asked
    (``num_tokens``, ``num_seqs``, ``max_len``), which is what lets a decode step be captured once as a
    CUDA graph and replayed with new contents. Small: a prefill chunk of 4096 tokens ships ~70 KB.
  * ``StepRows`` (device, ``StepIndex.rows()``): every row list the layers need (window writes and keys,
    compressor-state writes, closing windows' slots and entry rows, entry lists per sequence), derived
    once per step by the op table's ``step_rows`` (``ops/ref/step_rows.py``; on the GPU one Triton launch)
    — inside the captured graph for decode.

All layers of a pool share one row numbering (every per-position tensor has stride 1, every compressed
tensor of ratio m has stride m), so one list serves all layers. Padding tokens (graph buckets) belong to
a padding sequence whose tables are empty: they write to a spare row past the last block of each pool
(``KVStorage.spare_row``) and read nothing (-1 everywhere).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from itertools import chain

import numpy as np
import torch

from deepinfer.config.model import CSA, HCA
from deepinfer.kv.spec import HISTORY, STATE, WINDOW
from deepinfer.model.batch import ForwardBatch
from deepinfer.ops.ref.step_rows import step_rows as ref_step_rows


@dataclass(frozen=True)
class CompressIndex:
    """Rows for the compressed layers of one (ratio m, overlap) kind: CSA (overlap) or HCA."""

    limits: torch.Tensor  # [T] int32: entries visible to each query, (p + 1) // m
    slot_rows: torch.Tensor  # [T, m or 2m] int32: state rows of the window the token closes (-1: none/empty)
    entry_rows: torch.Tensor  # [T] int64: history row that window's entry goes to (-1: token closes none)
    emit_pos: torch.Tensor  # [T] int64: start position of that window (its entry's RoPE angle)
    seq_rows: torch.Tensor  # [B, cdiv(span, m)] int32: entry j's history row per sequence, -1 past its end
    visible_rows: torch.Tensor | None  # HCA: [T, cdiv(span, m)] int32, seq_rows of the token's sequence
    #                                    masked to the entries it sees (j < limit), -1 elsewhere; CSA: None


@dataclass(frozen=True)
class StepRows:
    token_seq: torch.Tensor  # [T] int64: the sequence (row of the tables) each token belongs to
    window_rows: torch.Tensor  # [T] int64: where each token's window K=V row goes
    state_rows: torch.Tensor  # [T] int64: where each token's compressor-state rows go
    window_keys: torch.Tensor  # [T, window] int32: window K=V rows each query attends, oldest first
    compress: dict[tuple[int, bool], CompressIndex]


@dataclass(frozen=True)
class StepIndex:
    token_seq: torch.Tensor  # [T] int64 (padding tokens: the padding sequence, or 0 with position 0)
    positions: torch.Tensor  # [T] int64
    window_table: torch.Tensor  # [B, blocks] int64 block ids per sequence, -1 released / past the end
    state_table: torch.Tensor  # [B, blocks] int64
    history_table: torch.Tensor  # [B, blocks] int64
    seq_end: torch.Tensor  # [B] int64: positions each sequence covers after this step
    span: int  # positions the entry lists cover (fixed for graphs, else the batch's longest sequence)
    block_size: int
    window: int
    kinds: tuple[tuple[int, bool], ...]  # (ratio, overlap) of the compressed layers
    spare_window: int  # spare rows padding tokens write to
    spare_state: int

    def _tensors(self) -> list[str]:
        return [f.name for f in fields(self) if f.type == "torch.Tensor"]

    def to(self, device: torch.device | str) -> "StepIndex":
        moved = {n: getattr(self, n).to(device, non_blocking=True) for n in self._tensors()}
        return StepIndex(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **moved})

    def copy_(self, src: "StepIndex") -> None:
        """Copy ``src`` (same shapes) into these tensors in place (CUDA-graph static inputs)."""
        assert (src.span, src.block_size, src.kinds) == (self.span, self.block_size, self.kinds)
        for n in self._tensors():
            getattr(self, n).copy_(getattr(src, n), non_blocking=True)

    def rows(self, derive: Callable = ref_step_rows) -> StepRows:
        """Every row list of the step, computed where the tensors live (no host sync; graph-capturable) by
        ``derive`` (the op table's ``step_rows``: ``ops/ref/step_rows.py`` or its one-launch Triton twin)."""
        window_rows, state_rows, window_keys, kinds = derive(
            self.token_seq, self.positions, self.window_table, self.state_table, self.history_table, self.seq_end,
            self.span, self.block_size, self.window, self.kinds, self.spare_window, self.spare_state)
        return StepRows(token_seq=self.token_seq, window_rows=window_rows, state_rows=state_rows,
                        window_keys=window_keys,
                        compress={kind: CompressIndex(*k) for kind, k in zip(self.kinds, kinds)})


def compress_kinds(layout) -> tuple[tuple[int, bool], ...]:
    """The (ratio, overlap) kinds of the compressed layers in ``layout``, in first-seen order."""
    kinds: list[tuple[int, bool]] = []
    for spec in layout.layers:
        if spec.kind in (CSA, HCA) and (spec.ratio, spec.kind == CSA) not in kinds:
            kinds.append((spec.ratio, spec.kind == CSA))
    return tuple(kinds)


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


def _check_resident(batch: ForwardBatch, layout, window: int) -> None:
    """Host-side guard (cheap, per run): every window/state block the step reads or writes is resident.
    The device derivation would otherwise turn a released block into "no key" silently."""
    bs, state_tail = layout.block_size, layout.tail(STATE)
    for i, r in enumerate(batch.runs):
        for pool, back, what in ((WINDOW, window - 1, "window keys"), (STATE, state_tail, "compressor state")):
            if pool == STATE and not state_tail:
                continue
            table = r.block_tables[pool]
            lo, hi = max(0, r.first_pos - back) // bs, (r.end_pos - 1) // bs
            if hi >= len(table) or min(table[lo : hi + 1]) < 0:
                raise IndexError(f"runs[{i}] {what}: a needed block of pool {pool!r} is missing or was released")


def build_step_index(batch: ForwardBatch, storage, window: int, *, num_tokens: int | None = None,
                     num_seqs: int | None = None, max_len: int | None = None) -> StepIndex:
    """The host half of a step's index (CPU tensors). Optional fixed shapes (what a captured graph needs):
    tokens padded to ``num_tokens``, sequences to ``num_seqs``, tables sized for ``max_len`` positions."""
    layout = storage.layout
    bs = layout.block_size
    runs = batch.runs
    t_real, b_real = batch.num_tokens, len(runs)
    t_all, b_all = num_tokens or t_real, num_seqs or b_real
    if t_all < t_real or b_all < b_real:
        raise ValueError(f"num_tokens/num_seqs: {t_all}/{b_all} is less than the batch's {t_real}/{b_real}")
    if t_all > t_real and b_all == b_real:
        raise ValueError("num_seqs: padding tokens need a padding sequence (num_seqs > the batch's sequences)")
    _check_resident(batch, layout, window)
    lengths = np.array([r.length for r in runs], dtype=np.int64)
    seq = np.repeat(np.arange(b_real), lengths)
    pos = np.concatenate([np.arange(r.first_pos, r.end_pos) for r in runs]) if runs else np.zeros(0, np.int64)
    end_pos = np.array([r.end_pos for r in runs] + [0] * (b_all - b_real), dtype=np.int64)
    span = max_len or max(int(end_pos.max(initial=0)), 1)
    if end_pos.max(initial=0) > span:
        raise ValueError(f"max_len: {span} is shorter than a sequence of the batch ({int(end_pos.max())})")
    width = -(-span // bs)
    pad = t_all - t_real
    pad_seq = b_all - 1  # padding tokens belong to the padding sequence (empty tables)
    return StepIndex(
        token_seq=_t(np.concatenate([seq, np.full(pad, pad_seq)])),
        positions=_t(np.concatenate([pos, np.zeros(pad, np.int64)])),
        window_table=_t(_tables(batch, WINDOW, b_all, width)),
        state_table=_t(_tables(batch, STATE, b_all, width)),
        history_table=_t(_tables(batch, HISTORY, b_all, width)),
        seq_end=_t(end_pos),
        span=span,
        block_size=bs,
        window=window,
        kinds=compress_kinds(layout),
        spare_window=storage.spare_row(WINDOW),
        spare_state=storage.spare_row(STATE),
    )


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
