"""InputBatch: the runner's persistent per-slot state, edited by each plan instead of rebuilt each step.

Every sequence in the batch owns a slot from joining until it leaves. Per slot the batch keeps:
  * its block tables (``SlotTables``: host arrays edited by the plan's table edits; a step copies its
    slots' rows into the step index);
  * its sampling settings, on the host (to decide which sampler stages run, without a device read) and as
    device rows gathered by slot each step;
  * the last token it drew, on the device: a placeholder input (async scheduling) reads it from there;
  * penalty state on the device, created the first time a sequence with a penalty joins: the output-token
    counts (incremented on the device by every draw) and the prompt's token set;
  * with async scheduling and speculation (``max_drafts``), on the device: the drafts its last step proposed
    and that step's ``shift`` (accepted - verified drafts, <= 0): the next step, planned before they reach
    the host, takes its inputs from there and moves its positions by the shift (``runner/step_shift.py``).
No step walks a sequence's token history: joining costs O(its tokens) once, a step O(its rows).

A decode step usually draws for the same slots, in the same order, as the step before: when no slot joined
or left since and no row has a penalty, its sampler inputs are the previous step's with new positions (the
gathers, casts and host checks that build them are skipped; their values depend on the slots' settings
alone, and the sampler never writes into them).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from deepinfer.model.step_index import SlotTables
from deepinfer.runner.transfer import to_device
from deepinfer.sampling.params import GREEDY_TEMPERATURE_EPS
from deepinfer.sampling.rng import SALT_TARGET
from deepinfer.sampling.tensors import Penalties, SamplingTensors
from deepinfer.sched.plan import JoinedSeq, SeqSampling, StepPlan

# Columns of the per-slot parameter tables.
_F_COLS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_I_COLS = ("top_k", "seed")


class InputBatch:
    def __init__(self, num_slots: int, max_blocks: int, vocab_size: int, device: torch.device | str,
                 max_drafts: int = 0) -> None:
        self.num_slots, self.vocab_size, self.device = num_slots, vocab_size, torch.device(device)
        self.slot_of: dict[str, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))  # lowest slot first
        self.tables = SlotTables(num_slots, max_blocks)
        self.sampling: list[SeqSampling | None] = [None] * num_slots
        self.prompt_len = np.zeros(num_slots, dtype=np.int64)
        self._f = torch.zeros(num_slots, len(_F_COLS), dtype=torch.float64, device=self.device)
        self._i = torch.zeros(num_slots, len(_I_COLS), dtype=torch.int64, device=self.device)
        self.last_tokens = torch.zeros(num_slots, dtype=torch.int64, device=self.device)
        # Async speculation only (None otherwise): per slot the last proposed drafts, and the last verify
        # step's shift, with one more entry (always 0) that sequences without a shift gather.
        self.drafts = self.shift = None
        if max_drafts:
            self.drafts = torch.zeros(num_slots, max_drafts, dtype=torch.int64, device=self.device)
            self.shift = torch.zeros(num_slots + 1, dtype=torch.int64, device=self.device)
        self.counts: torch.Tensor | None = None  # [slots, V] float32 output-token counts
        self.prompt_seen: torch.Tensor | None = None  # [slots, V] bool
        # Bumped whenever a slot's sequence changes (join, leave): what the last sampler inputs were built under.
        self._epoch = 0
        # (epoch, slots, any min_tokens row, the SamplingTensors) of the last step without penalties.
        self._last_inputs: tuple[int, tuple[int, ...], bool, SamplingTensors] | None = None

    # ---- plan edits -----------------------------------------------------------------------------------
    def apply(self, plan: StepPlan) -> None:
        for seq_id in plan.left:
            slot = self.slot_of.pop(seq_id, None)
            if slot is not None:  # sequences that never joined (aborted while waiting) have nothing here
                self.sampling[slot] = None
                self._free.append(slot)
                self._epoch += 1
        for j in plan.joined:
            self._join(j)
        arrays = self.tables.arrays
        for e in plan.table_edits:
            slot = self.slot_of.get(e.seq_id)
            if slot is None:
                raise KeyError(f"table edit for {e.seq_id!r}, which is not in the batch")
            row = arrays[e.pool][slot]
            if e.length > len(row):
                raise ValueError(f"table edit for {e.seq_id!r}: {e.length} blocks exceed the {len(row)} a slot holds")
            row[e.start : e.start + len(e.block_ids)] = e.block_ids
            row[e.length :] = -1

    def _join(self, j: JoinedSeq) -> None:
        if j.seq_id in self.slot_of:
            raise ValueError(f"{j.seq_id!r} joined twice")
        if not self._free:
            raise RuntimeError(f"InputBatch: all {self.num_slots} slots are taken")
        slot = self._free.pop()
        self.slot_of[j.seq_id] = slot
        self._epoch += 1
        for table in self.tables.arrays.values():
            table[slot] = -1
        s = j.sampling
        self.sampling[slot] = s
        self.prompt_len[slot] = j.prompt_len
        self._f[slot] = to_device([getattr(s, c) for c in _F_COLS], torch.float64, self.device)
        self._i[slot] = to_device([getattr(s, c) for c in _I_COLS], torch.int64, self.device)
        if s.has_penalty and self.counts is None:
            shape = (self.num_slots, self.vocab_size)
            self.counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self.prompt_seen = torch.zeros(shape, dtype=torch.bool, device=self.device)
        if self.counts is not None:
            self.counts[slot] = 0
            self.prompt_seen[slot] = False
            if j.output_ids:
                ids = to_device(j.output_ids, torch.int64, self.device)
                self.counts[slot].index_add_(0, ids, torch.ones(len(ids), device=self.device))
            if j.prompt_ids:
                self.prompt_seen[slot, to_device(j.prompt_ids, torch.int64, self.device)] = True

    # ---- a step's sampler inputs ----------------------------------------------------------------------
    def plain_greedy(self, slots: list[int], positions: list[int]) -> bool:
        """True when every row is greedy with no penalty, no min_tokens mask and no logprobs: the draw is the
        argmax of the raw logits."""
        for slot, pos in zip(slots, positions):
            r = self.sampling[slot]
            if (r.temperature >= GREEDY_TEMPERATURE_EPS or r.has_penalty or r.num_logprobs is not None
                    or (r.min_tokens_masked and pos - int(self.prompt_len[slot]) < r.min_tokens)):
                return False
        return True

    def sampling_tensors(self, slots: list[int], positions: list[int],
                         history: list[tuple[int, ...]] | None = None,
                         shift: torch.Tensor | None = None) -> SamplingTensors:
        """Sampler inputs of rows drawing at ``positions`` for sequences in ``slots`` (one row each).
        ``history`` (verification): per row, the tokens between the slot's recorded ones and the row (the
        drafts before it), counted as generated by that row's penalties. ``shift`` (device, per row): moves
        the positions (the seeds' keys) of rows planned before their sequence's last step was verified."""
        dev = self.device
        last, key = self._last_inputs, tuple(slots)
        if last is not None and last[0] == self._epoch and last[1] == key:
            masked = self._min_tokens_masks([self.sampling[s] for s in slots], slots, positions) if last[2] else None
            return _shifted(dataclasses.replace(last[3], positions=to_device(positions, torch.int64, dev),
                                                masked=masked), shift)
        rows = [self.sampling[s] for s in slots]
        # Slots and positions travel in one copy: [slots | pad | positions]. The pad keeps ``positions`` on a 16-byte
        # boundary whatever the batch's parity: Triton specializes a kernel on its pointers' alignment, and an odd
        # batch would otherwise compile a second variant of the draw kernel in the middle of serving.
        n = len(slots)
        pad = n % 2
        both = to_device([*slots, *(0,) * pad, *positions], torch.int64, dev)
        idx, pos = both[:n], both[n + pad :]
        f, i = self._f[idx], self._i[idx]
        drawing = [b for b, r in enumerate(rows) if r.temperature >= GREEDY_TEMPERATURE_EPS]
        draw_rows = [rows[b] for b in drawing]
        t = SamplingTensors(
            temperature=f[:, 0].to(torch.float32), top_k=i[:, 0], top_p=f[:, 1], min_p=f[:, 2], seeds=i[:, 1],
            positions=pos, salts=torch.full((len(slots),), SALT_TARGET, dtype=torch.int64, device=dev),
            random_rows=tuple(drawing),
            random_idx=to_device(drawing, torch.int64, dev) if len(drawing) < len(rows) else torch.arange(
                len(rows), device=dev),
            use_truncation=any(r.top_k > 0 or r.top_p < 1.0 for r in draw_rows),
            use_top_p=any(r.top_p < 1.0 for r in draw_rows),
            use_min_p=any(r.min_p > 0.0 for r in draw_rows),
            penalties=self._penalties(rows, idx, f, history),
            masked=self._min_tokens_masks(rows, slots, positions),
            num_logprobs=tuple(r.num_logprobs for r in rows),
        )
        reusable = t.penalties.repetition is None and t.penalties.presence is None  # penalty counts move each step
        self._last_inputs = (self._epoch, key, any(r.min_tokens_masked for r in rows), t) if reusable else None
        return _shifted(t, shift)

    def draft_params(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(temperature float64, seed int64) of the slots ``idx`` (a device tensor): the draft pick's inputs,
        gathered on the device."""
        return self._f[idx, 0], self._i[idx, 1]

    def _penalties(self, rows: list[SeqSampling], idx: torch.Tensor, f: torch.Tensor,
                   history: list[tuple[int, ...]] | None = None) -> Penalties:
        rep = any(r.repetition_penalty != 1.0 for r in rows)
        count = any(r.presence_penalty != 0.0 or r.frequency_penalty != 0.0 for r in rows)
        if not (rep or count):
            return Penalties()
        counts = self.counts[idx]  # a gathered copy: adding a row's history leaves the slot's counts alone
        if history and any(history):
            row_idx = [b for b, h in enumerate(history) for _ in h]
            tok_idx = [t for h in history for t in h]
            pairs = to_device(row_idx + tok_idx, torch.int64, self.device)
            counts.index_put_((pairs[: len(row_idx)], pairs[len(row_idx) :]),
                              torch.ones(len(row_idx), device=self.device), accumulate=True)
        return Penalties(
            repetition=f[:, 3].to(torch.float32) if rep else None,
            seen=(self.prompt_seen[idx] | (counts > 0)) if rep else None,
            presence=f[:, 4].to(torch.float32) if count else None,
            frequency=f[:, 5].to(torch.float32) if count else None,
            counts=counts if count else None,
        )

    def _min_tokens_masks(self, rows, slots, positions) -> tuple[torch.Tensor, torch.Tensor] | None:
        row_idx: list[int] = []
        tok_idx: list[int] = []
        for b, (r, slot, pos) in enumerate(zip(rows, slots, positions)):
            # The token drawn at ``pos`` is output number pos - prompt_len (0-based).
            if r.min_tokens_masked and pos - int(self.prompt_len[slot]) < r.min_tokens:
                row_idx.extend([b] * len(r.min_tokens_masked))
                tok_idx.extend(r.min_tokens_masked)
        if not row_idx:
            return None
        pairs = to_device(row_idx + tok_idx, torch.int64, self.device)
        return pairs[: len(row_idx)], pairs[len(row_idx) :]

    def record(self, slots: list[int], tokens: torch.Tensor, last: list[int] | torch.Tensor,
               keep: torch.Tensor | None = None, row_slots: list[int] | None = None,
               shift: torch.Tensor | None = None) -> None:
        """After a draw: each slot's last emitted token (row ``last[k]`` of ``tokens`` for ``slots[k]``) and,
        with penalties on, the count of every emitted token (rows of ``tokens`` belong to ``row_slots``;
        ``keep``: the rows emitted, None: all; a rejected draft's draw is not counted). ``shift`` (async
        speculation, per slot): accepted - verified drafts of this step."""
        if not slots:
            return
        if row_slots is None or row_slots is slots:  # one row per slot: one copy serves both
            idx = rows = to_device(slots, torch.int64, self.device)
        else:
            both = to_device([*slots, *row_slots], torch.int64, self.device)
            idx, rows = both[: len(slots)], both[len(slots) :]
        if not isinstance(last, torch.Tensor):
            last = to_device(last, torch.int64, self.device) if len(last) != len(tokens) else None
        self.last_tokens.index_copy_(0, idx, tokens if last is None else tokens[last])
        if self.shift is not None and shift is not None:
            self.shift.index_copy_(0, idx, shift)
        if self.counts is not None:
            ones = keep.to(torch.float32) if keep is not None else torch.ones(len(tokens), device=self.device)
            self.counts.index_put_((rows, tokens), ones, accumulate=True)

    def record_drafts(self, slots: list[int], drafts: torch.Tensor) -> None:
        """Async speculation: the drafts [len(slots), most proposals] proposed for ``slots`` this step (-1
        past a slot's count), which the next step's placeholder inputs read."""
        if self.drafts is not None and slots:
            self.drafts[to_device(slots, torch.int64, self.device), : drafts.shape[1]] = drafts

    def placeholder_values(self, slots: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """Inputs drawn by the slots' last step, on the device: column 0 the last emitted token, column
        j > 0 the step's draft j (async speculation)."""
        if self.drafts is None:
            return self.last_tokens[slots]
        return torch.where(cols == 0, self.last_tokens[slots], self.drafts[slots, (cols - 1).clamp(min=0)])


def _shifted(t: SamplingTensors, shift: torch.Tensor | None) -> SamplingTensors:
    """``t`` with its draw positions moved by ``shift`` (built or reused inputs alike; the reused ones are
    kept unshifted)."""
    return t if shift is None else dataclasses.replace(t, positions=t.positions + shift)
