"""StepShift: a step planned before its sequences' verify step in flight was verified, moved on the device.

With async scheduling and speculation the scheduler plans step N+1 while step N still runs, as if each
sequence's drafts of N were all accepted: a sequence's inputs are placeholders (N's last emitted token and
N's next drafts, which the device fills from ``InputBatch``) at the positions full acceptance gives. Step
N's verification leaves per slot ``shift`` = accepted - verified drafts (<= 0) on the device
(``InputBatch.shift``); step N+1 gathers it per input row, per sequence and per drawn row, from one upload
of host-known owners, and adds it to

  * its step index's positions (per row) and lengths ``seq_end`` (per sequence): every row list the layers
    derive on the device (cache rows written and read, compressed entries, RoPE angles) follows from those,
    so the forward is the one a step planned after N's results would run;
  * the positions keying its seeded draws (per drawn row) and the MTP chain's positions (per sequence).

No host sync: the host never learns the shift before it applies step N's results, and then rolls its own
lengths back by the same amount (``Scheduler.rollback``). The eager path shifts the step's fresh index and
the CUDA graphs shift their static index after the step's copy into it, with the same function (``apply``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from deepinfer.model.step_index import StepIndex
from deepinfer.runner.input_batch import InputBatch
from deepinfer.runner.transfer import to_device
from deepinfer.sched.plan import SeqWork


@dataclass(frozen=True, slots=True, eq=False)
class StepShift:
    rows: torch.Tensor  # [T] int64: per input row of the step
    seqs: torch.Tensor  # [B] int64: per work (sequence of the index)
    draws: torch.Tensor  # [D] int64: per drawn row

    @staticmethod
    def of(work: tuple[SeqWork, ...], slots: list[int], batch: InputBatch) -> "StepShift | None":
        """The step's shift, or None when no work continues a step in flight (or the batch keeps no shift:
        without speculation a placeholder is the one token its step drew, at a known position)."""
        if batch.shift is None or not any(w.num_placeholders for w in work):
            return None
        none = batch.num_slots  # the entry that is always 0: works whose previous step was applied
        owner = np.fromiter((slot if w.num_placeholders else none for w, slot in zip(work, slots)), dtype=np.int64,
                            count=len(work))
        lens = np.fromiter((w.num_tokens for w in work), dtype=np.int64, count=len(work))
        draws = np.fromiter((w.num_samples for w in work), dtype=np.int64, count=len(work))
        host = np.concatenate([np.repeat(owner, lens), owner, np.repeat(owner, draws)])
        values = batch.shift[to_device(host, torch.int64, batch.device)]
        t, b = int(lens.sum()), len(work)
        return StepShift(values[:t], values[t : t + b], values[t + b :])

    def apply(self, index: StepIndex) -> None:
        """Move ``index``'s positions and lengths in place: its first T rows and B sequences (a graph's
        static index is padded past them; padding stays at position 0)."""
        index.positions[: len(self.rows)] += self.rows
        index.seq_end[: len(self.seqs)] += self.seqs
