"""StepContext: what every layer of one forward step reads besides its activations."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kv.spec import CacheLayout
from deepinfer.kv.storage import KVStorage
from deepinfer.model.batch import ForwardBatch, SeqRun
from deepinfer.model.step_index import StepRows


@dataclass(frozen=True)
class StepContext:
    input_ids: torch.Tensor  # [T] token ids (hash routing needs them in every forward)
    positions: torch.Tensor  # [T] absolute positions
    batch: ForwardBatch | None  # None on the batched path (everything it needs is in ``index``)
    storage: KVStorage
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # table name ("main"/"compress") -> cos, sin [T, R/2]
    index: StepRows | None = None  # row lists of the batched path (model/attention_indexed.py)
    emit_rope: dict | None = None  # (ratio, overlap) -> cos, sin at each token's closing-window start

    @property
    def layout(self) -> CacheLayout:
        return self.storage.layout

    def slice(self, run: SeqRun) -> slice:
        return slice(run.start, run.start + run.length)
