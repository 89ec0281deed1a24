"""StepIndex / StepRows: every cache row one step reads or writes, as flat index tensors.

Walking the batch sequence by sequence in every layer, turning block tables into rows with small tensor
ops (the per-sequence oracle, ``tests/oracle/per_sequence.py``), would launch hundreds of tiny kernels per
layer and stall on host syncs. Instead one step works in two stages:

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

The host half runs before every decode step, so it is built for few Python operations per sequence: the
tensors of a StepIndex are views of one flat int64 buffer (``FlatLayout``; the step's token ids have a
slot there too), so a step ships with one host-to-device copy. Block tables come from one of two sources:
the engine's runner keeps them per batch slot as int64 arrays (``SlotTables``, edited by the scheduler's
table diffs), so a step's tables are one fancy-indexed copy per pool (``build_slot_index``,
``StepBuffer.write_slots``); direct model use (``ForwardBatch`` of per-run tuples, ``build_step_index``)
converts them, and a ``StepBuffer`` (one per graph bucket) converts only the rows that changed since its
previous step: turning Python ints into int64 costs tens of ns each.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from dataclasses import dataclass, fields
from itertools import chain
from operator import eq, itemgetter

import numpy as np
import torch

from deepinfer.config.model import CSA, HCA
from deepinfer.kv.spec import HISTORY, STATE, WINDOW
from deepinfer.model.batch import ForwardBatch
from deepinfer.model.flat_layout import FlatLayout, covering
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
class HostRuns:
    """Per sequence of a step, host values the runner has anyway: its tokens in the step, its end after it and
    its bounded replay's boundary (0: none). V4.1's step lays its per-sequence work out from them
    (``model/v41/paged.py``) instead of reading them back from the device index (a host sync)."""

    lens: tuple[int, ...]
    ends: tuple[int, ...]
    emit_from: tuple[int, ...]

    @classmethod
    def of(cls, first: np.ndarray, lens: np.ndarray, emit_from) -> "HostRuns":
        """From the runs' first positions and token counts (``build_slot_index``'s) and their boundaries."""
        return cls(tuple(np.asarray(lens).tolist()), tuple((np.asarray(first) + lens).tolist()),
                   tuple(map(int, emit_from)))


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
    # [B] int64 or None: per sequence, windows closing before this position are not emitted (their entries
    # are cached: a prefix hit's bounded replay recomputes those positions' window and state rows only).
    emit_from: torch.Tensor | None = None
    # Per sequence or None (every row may be read): whether the step reads the output of the sequence's last
    # row only, or of none (no prompt logprobs, no verified drafts). V4.1's decoder-side bounded replay
    # (model/v41/replay.py) narrows only such sequences' prefill chunks. Host values: the CPU step reads them.
    last_row_only: tuple[bool, ...] | None = None
    host: HostRuns | None = None  # the same facts as host values, for models that ask (``HostRuns``)

    def _tensors(self) -> list[str]:
        return [f.name for f in fields(self) if f.type == "torch.Tensor"]

    def to(self, device: torch.device | str) -> "StepIndex":
        """The index on ``device``: one copy when its tensors are views of one buffer (``build_step_index``
        makes them so), else one per tensor; the index itself when it is there already (the CPU runner's
        every step: re-viewing its buffer would cost a dozen tensor calls and give the same tensors)."""
        if self.token_seq.device == torch.device(device) and (self.emit_from is None or
                                                             self.emit_from.device == self.token_seq.device):
            tensors = [self.positions, self.window_table, self.state_table, self.history_table, self.seq_end]
            if all(t.device == self.token_seq.device for t in tensors):
                return self
        tensors = {n: getattr(self, n) for n in self._tensors()}
        filled = {n: t for n, t in tensors.items() if t.numel()}  # empty ones need no data (nor valid offsets)
        moved = {n: t.to(device, non_blocking=True) for n, t in tensors.items() if n not in filled}
        region = covering(list(filled.values())) if filled else None
        if region is None:
            moved.update({n: t.to(device, non_blocking=True) for n, t in filled.items()})
        else:
            flat, lo = region
            dst = flat.to(device, non_blocking=True)  # ``flat`` itself when already there
            # as_strided offsets count from the start of the storage, not of ``dst``.
            base = dst.storage_offset() - lo
            moved.update({n: dst.as_strided(t.shape, t.stride(), base + t.storage_offset()) for n, t in filled.items()})
        if self.emit_from is not None:
            moved["emit_from"] = self.emit_from.to(device, non_blocking=True)
        return StepIndex(**{**{f.name: getattr(self, f.name) for f in fields(self)}, **moved})

    def rows(self, derive: Callable = ref_step_rows) -> StepRows:
        """Every row list of the step, computed where the tensors live (no host sync; graph-capturable) by
        ``derive`` (the op table's ``step_rows``: ``ops/ref/step_rows.py`` or its one-launch Triton twin)."""
        window_rows, state_rows, window_keys, kinds = derive(
            self.token_seq, self.positions, self.window_table, self.state_table, self.history_table, self.seq_end,
            self.span, self.block_size, self.window, self.kinds, self.spare_window, self.spare_state)
        compress = {kind: CompressIndex(*k) for kind, k in zip(self.kinds, kinds)}
        if self.emit_from is not None:
            done = self.positions < self.emit_from[self.token_seq]  # closes a window ending at or before it
            compress = {kind: dataclasses.replace(ci, entry_rows=torch.where(done, -1, ci.entry_rows))
                        for kind, ci in compress.items()}
        return StepRows(token_seq=self.token_seq, window_rows=window_rows, state_rows=state_rows,
                        window_keys=window_keys, compress=compress)


def compress_kinds(layout) -> tuple[tuple[int, bool], ...]:
    """The (ratio, overlap) kinds of the compressed layers in ``layout``, in first-seen order."""
    kinds: list[tuple[int, bool]] = []
    for spec in layout.layers:
        if spec.kind in (CSA, HCA) and (spec.ratio, spec.kind == CSA) not in kinds:
            kinds.append((spec.ratio, spec.kind == CSA))
    return tuple(kinds)


_TABLE_POOLS = (WINDOW, STATE, HISTORY)  # order of the tables in a flat buffer
_pool_tables = itemgetter(*_TABLE_POOLS)
# Up to this many runs, per-run table copies and residency checks cost less than the vectorized versions'
# dozen numpy calls each.
_SMALL_BATCH = 8


_layout_facts: dict[int, tuple] = {}


def _facts(layout) -> tuple[tuple[tuple[int, bool], ...], int]:
    """(compress_kinds(layout), layout.tail(STATE)), once per layout: both walk every layer (~10 us for V4's
    43 on a slow host), and so would hashing the layout, hence the identity key (the entry holds the
    layout, so its id stays its own)."""
    hit = _layout_facts.get(id(layout))
    if hit is None or hit[0] is not layout:
        if len(_layout_facts) >= 64:
            _layout_facts.clear()
        hit = _layout_facts[id(layout)] = (layout, compress_kinds(layout), layout.tail(STATE))
    return hit[1], hit[2]


def _fill_tables(block: np.ndarray, tables: tuple, stride: int, runs) -> None:
    """Copy every run's tables into the three [B, width] ``tables`` (which hold -1; ``block`` spans them,
    ``stride`` apart); columns past ``width`` cover positions no step reads and are dropped."""
    width = tables[0].shape[1]
    src = [t for r in runs for t in _pool_tables(r.block_tables)]  # table k: run k // 3, pool k % 3
    lens = list(map(len, src))
    # struct converts Python ints about twice as fast as np.fromiter (the bulk of this function).
    flat = np.frombuffer(struct.pack(f"{sum(lens)}q", *chain.from_iterable(src)), dtype=np.int64)
    if len(runs) <= _SMALL_BATCH:  # a few slice copies cost less than the scatter's dozen numpy calls
        start = 0
        for k, n in enumerate(lens):
            m = min(n, width)
            tables[k % 3][k // 3, :m] = flat[start : start + m]
            start += n
        return
    lens = np.array(lens, dtype=np.int64)
    starts = np.cumsum(lens) - lens
    k = np.arange(len(lens))
    dest = np.repeat((k % 3) * stride + (k // 3) * width - starts, lens) + np.arange(len(flat))
    if lens.max() > width:
        keep = np.arange(len(flat)) - np.repeat(starts, lens) < width
        dest, flat = dest[keep], flat[keep]
    block[dest] = flat


class StepBuffer:
    """A host buffer that fixed-shape steps (one CUDA-graph bucket) are built in, one after another.

    ``tensor`` is laid out by ``layout`` (``FlatLayout``); ``write`` fills it with a step's index (what
    ``build_step_index`` with the same shapes returns the views of); ``ids`` is its token-id segment, which
    the caller fills. Steps of a bucket mostly carry the same sequences with the same block tables (a
    table changes once per ``block_size`` tokens), so the buffer remembers which tables each row of its
    three [B, width] tables holds and rewrites only the rows whose tables changed, instead of resetting
    all of them (3 x B x width int64s: MBs for a long ``max_len``) and converting every table's Python
    ints again. A row is compared to what it holds by equality, which for the same tuple objects
    (``CacheManager.block_tables`` and ``SequenceCache.plan`` hand them out until a table changes) is a
    pointer comparison; only tuples are remembered, as a list may change in place. Nothing but ``write``
    may write the tables.
    """

    def __init__(self, num_tokens: int, num_seqs: int, max_len: int, block_size: int,
                 pin_memory: bool = False) -> None:
        self.layout = FlatLayout.for_span(num_tokens, num_seqs, max_len, block_size)
        self.max_len = max_len
        self.tensor = torch.zeros(self.layout.size, dtype=torch.int64, pin_memory=pin_memory)
        flat = self.tensor.numpy()
        self.ids = self.layout.ids(flat)
        self._tables = self.layout.split(flat)[3:]
        self.layout.table_block(flat).fill(-1)
        self._held: list = []  # row i < len: the (window, state, history) tables it holds; None: rewrite
        self._used = [num_seqs, self.layout.width]  # [rows, cols] of the tables the last slot write set

    def write(self, batch: ForwardBatch, storage, window: int) -> None:
        """Build the step's index into ``tensor`` (all of it but ``ids``); errors as ``build_step_index``."""
        self._used = [self.layout.num_seqs, self.layout.width]  # slot writes after this reset everything
        _write_runs(batch, storage.layout, window, self.layout.num_tokens, self.layout.num_seqs, self.max_len, self)

    def write_slots(self, slots: np.ndarray, first: np.ndarray, lens: np.ndarray, tables: SlotTables, storage,
                    window: int) -> None:
        """``write`` for runs kept in batch slots (``build_slot_index``'s arguments)."""
        self._held = [None] * self.layout.num_seqs  # run-table writes after this rewrite every row
        _write_slots(slots, first, lens, tables, storage.layout, window, self.layout.num_tokens,
                     self.layout.num_seqs, self.max_len, self)

    def _update_tables(self, runs) -> None:
        """Rewrite the rows whose tables differ from what they hold; reset rows no run uses any more."""
        tables, held = self._tables, self._held
        width = self.layout.width
        now = [_pool_tables(r.block_tables) for r in runs]
        if now == held:
            return
        same = list(map(eq, now, held))
        # Should a row's write raise, the rows stay unknown and the next write rewrites them all.
        self._held = [None] * max(len(held), len(now))
        for i in [i for i, s in enumerate(same) if not s] + list(range(len(same), len(now))):
            trip = now[i]
            for table, t in zip(tables, trip):
                m = min(len(t), width)
                table[i, :m] = t[:m]
                table[i, m:] = -1
            if not type(trip[0]) is type(trip[1]) is type(trip[2]) is tuple:
                now[i] = None
        for table in tables:
            table[len(now) : len(held)] = -1
        self._held = now


def _all_resident(block: np.ndarray, stride: int, width: int, first: np.ndarray, end: np.ndarray, window: int,
                  state_tail: int, block_size: int) -> bool:
    """``_check_resident`` on the filled tables (``block``, as in ``_fill_tables``), for all runs at once: True
    when every block it needs is resident. False when one is not, or when some run's block range is empty
    or reaches past ``width`` (only malformed batches): the per-run check then decides and names the run."""
    backs = np.array([window - 1, state_tail] if state_tail else [window - 1], dtype=np.int64)
    pools, b = len(backs), len(first)
    lo = np.maximum(first - backs[:, None], 0) // block_size  # [pools, b]
    hi = (end - 1) // block_size  # [b]
    count = hi - lo  # blocks - 1
    if count.min() < 0 or hi.max() >= width:
        return False
    # Every run's range as k columns, the shorter ones repeating their last block.
    cols = np.minimum(lo[:, :, None] + np.arange(count.max() + 1), hi[:, None])
    at = (np.arange(pools) * stride)[:, None, None] + (np.arange(b) * width)[:, None] + cols
    return bool(block[at].min() >= 0)


def _check_resident(first: np.ndarray, end: np.ndarray, table_of: Callable[[int, str], object], layout,
                    window: int) -> None:
    """Host-side guard (per run): every window/state block the step reads or writes is resident. The device
    derivation would otherwise turn a released block into "no key" silently. Large batches run the
    vectorized ``_all_resident`` first and come here only to name the failing run. ``table_of(i, pool)``:
    run i's block table of ``pool`` (a sequence of block ids, -1 released)."""
    bs, state_tail = layout.block_size, _facts(layout)[1]
    for i, (f, e) in enumerate(zip(first.tolist(), end.tolist())):
        for pool, back, what in ((WINDOW, window - 1, "window keys"), (STATE, state_tail, "compressor state")):
            if pool == STATE and not state_tail:
                continue
            table = table_of(i, pool)
            lo, hi = max(0, f - back) // bs, (e - 1) // bs
            if hi >= len(table) or min(table[lo : hi + 1]) < 0:
                raise IndexError(f"runs[{i}] {what}: a needed block of pool {pool!r} is missing or was released")


def _write(first: np.ndarray, lens: np.ndarray, layout, window: int, num_tokens: int | None,
           num_seqs: int | None, max_len: int | None, fill: Callable, table_of: Callable,
           buffer: StepBuffer | None = None, pin_memory: bool = False) -> tuple[torch.Tensor, FlatLayout, int]:
    """Build a step's index into ``buffer.tensor`` (or a new tensor); returns it, its layout and the span.

    ``first``/``lens``: each run's first position and token count; ``fill(block, tables, stride, fresh)``
    writes the runs' block tables into the three [B, width] ``tables`` (``fresh``: they hold -1, else they
    hold the buffer's previous step); ``table_of(i, pool)`` names run i's table for error messages."""
    bs = layout.block_size
    b_real = len(first)
    t_real = int(lens.sum())
    t_all, b_all = num_tokens or t_real, num_seqs or b_real
    if t_all < t_real or b_all < b_real:
        raise ValueError(f"num_tokens/num_seqs: {t_all}/{b_all} is less than the batch's {t_real}/{b_real}")
    if t_all > t_real and b_all == b_real:
        raise ValueError("num_seqs: padding tokens need a padding sequence (num_seqs > the batch's sequences)")
    end = first + lens
    longest = int(end.max(initial=0))
    span = max_len or max(longest, 1)
    flat_layout = FlatLayout.for_span(t_all, b_all, span, bs)
    if buffer is None:
        out = torch.empty(flat_layout.size, dtype=torch.int64, pin_memory=pin_memory)
    elif flat_layout != buffer.layout:
        raise ValueError(f"storage: block size {bs} does not match the buffer's layout {buffer.layout}")
    else:
        out = buffer.tensor
    flat = out.numpy()
    token_seq, positions, seq_end, *tables = flat_layout.split(flat)
    block, stride, width = flat_layout.table_block(flat), flat_layout.table_stride, flat_layout.width
    if buffer is None:
        block.fill(-1)
    if b_real or buffer is not None:
        fill(block, tables, stride, buffer is None)
    if b_real and (b_real <= _SMALL_BATCH or
                   not _all_resident(block, stride, width, first, end, window, _facts(layout)[1], bs)):
        _check_resident(first, end, table_of, layout, window)
    if longest > span:
        raise ValueError(f"max_len: {span} is shorter than a sequence of the batch ({longest})")
    if t_real == b_real and int(lens.max(initial=1)) == 1:  # decode: one token per sequence
        token_seq[:t_real] = np.arange(b_real)
        positions[:t_real] = first
    else:
        token_seq[:t_real] = np.repeat(np.arange(b_real), lens)
        positions[:t_real] = np.repeat(first - (np.cumsum(lens) - lens), lens) + np.arange(t_real)
    token_seq[t_real:] = b_all - 1  # padding tokens belong to the padding sequence (empty tables)
    positions[t_real:] = 0
    seq_end[:b_real] = end
    seq_end[b_real:] = 0
    return out, flat_layout, span


def _write_runs(batch: ForwardBatch, layout, window: int, num_tokens: int | None, num_seqs: int | None,
                max_len: int | None, buffer: StepBuffer | None = None) -> tuple[torch.Tensor, FlatLayout, int]:
    """``_write`` for a ForwardBatch (tables as per-run tuples of Python ints)."""
    runs = batch.runs
    first = np.array([r.first_pos for r in runs], dtype=np.int64)
    lens = np.array([r.length for r in runs], dtype=np.int64)

    def fill(block, tables, stride, fresh):
        if fresh:
            _fill_tables(block, tables, stride, runs)
        else:
            buffer._update_tables(runs)

    return _write(first, lens, layout, window, num_tokens, num_seqs, max_len, fill,
                  lambda i, pool: runs[i].block_tables[pool], buffer)


class SlotTables:
    """Block tables kept per batch slot as [slots, max_blocks] int64 arrays (-1: none or released), one per
    pool: the runner's persistent batch state (``runner/input_batch.py``) edits them in place as the
    scheduler's table diffs arrive, and a step's tables are a fancy-indexed copy of its slots' rows."""

    def __init__(self, num_slots: int, max_blocks: int) -> None:
        self.arrays = {p: np.full((num_slots, max_blocks), -1, dtype=np.int64) for p in _TABLE_POOLS}

    def write(self, tables: tuple, slots: np.ndarray, fresh: bool, used: list[int] | None = None) -> None:
        """Copy rows ``slots`` into the step's ``tables`` (columns past a table's width are dropped).
        ``used``: [rows, cols] the previous write covered, when ``tables`` still hold it (a graph bucket's
        buffer): only what this step does not overwrite is reset to -1."""
        b, width = len(slots), tables[0].shape[1]
        cols = min(width, self.arrays[WINDOW].shape[1])
        for table, pool in zip(tables, _TABLE_POOLS):
            table[:b, :cols] = self.arrays[pool][slots, :cols]
        if used is not None and not fresh:
            rows, prev_cols = used
            for table in tables:
                table[b:rows] = -1
                table[:b, cols:prev_cols] = -1
        if used is not None:
            used[:] = [b, cols]


def _write_slots(slots: np.ndarray, first: np.ndarray, lens: np.ndarray, tables: SlotTables, layout,
                 window: int, num_tokens: int | None, num_seqs: int | None, max_len: int | None,
                 buffer: StepBuffer | None = None, pin_memory: bool = False) -> tuple[torch.Tensor, FlatLayout, int]:
    """``_write`` for runs that live in batch slots (tables from ``SlotTables``)."""

    def fill(block, step_tables, stride, fresh):
        tables.write(step_tables, slots, fresh, None if buffer is None else buffer._used)

    return _write(first, lens, layout, window, num_tokens, num_seqs, max_len, fill,
                  lambda i, pool: tables.arrays[pool][slots[i]], buffer, pin_memory)


def _index(out: torch.Tensor, flat_layout: FlatLayout, span: int, storage, window: int,
           last_row_only: tuple[bool, ...] | None = None) -> StepIndex:
    return StepIndex(
        **flat_layout.tensors(out),
        span=span,
        block_size=storage.layout.block_size,
        window=window,
        kinds=_facts(storage.layout)[0],
        spare_window=storage.spare_row(WINDOW),
        spare_state=storage.spare_row(STATE),
        last_row_only=last_row_only,
    )


def build_step_index(batch: ForwardBatch, storage, window: int, *, num_tokens: int | None = None,
                     num_seqs: int | None = None, max_len: int | None = None) -> StepIndex:
    """The host half of a step's index (CPU tensors). Optional fixed shapes (what a captured graph needs):
    tokens padded to ``num_tokens``, sequences to ``num_seqs``, tables sized for ``max_len`` positions.
    The tensors are views of one new buffer laid out by ``FlatLayout`` (so ``StepIndex.to`` copies once)."""
    out, flat_layout, span = _write_runs(batch, storage.layout, window, num_tokens, num_seqs, max_len)
    return _index(out, flat_layout, span, storage, window)


def build_slot_index(slots: np.ndarray, first: np.ndarray, lens: np.ndarray, tables: SlotTables, storage,
                     window: int, pin_memory: bool = False,
                     last_row_only: tuple[bool, ...] | None = None) -> StepIndex:
    """``build_step_index`` for runs kept in batch slots: run i is slot ``slots[i]``, its new tokens at
    positions ``first[i]`` .. ``first[i] + lens[i] - 1``. ``pin_memory``: build it in pinned memory, so that
    its copy to the GPU does not wait for the queued steps. ``last_row_only``: the index's field of that name
    (set here rather than by a replace of the whole index afterwards)."""
    out, flat_layout, span = _write_slots(slots, first, lens, tables, storage.layout, window, None, None, None,
                                          pin_memory=pin_memory)
    return _index(out, flat_layout, span, storage, window, last_row_only)
