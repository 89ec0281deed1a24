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
    batch: ForwardBatch | None  # the runs, when the caller gave them (the per-sequence oracle reads them)
    storage: KVStorage
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # table name ("main"/"compress") -> cos, sin [T, R/2]
    index: StepRows  # every cache row the step reads or writes (model/step_index.py)
    emit_rope: dict  # (ratio, overlap) -> cos, sin at each token's closing-window start
    # A context-parallel step (``model/parallel/context.py`` ShareStep): the attention layers run this
    # rank's own tokens and its share of a long chunk through it; the fields above are then unused but
    # ``input_ids`` (own tokens, then the share's: what the MoE routes).
    cp: object | None = None

    @property
    def layout(self) -> CacheLayout:
        return self.storage.layout

    def slice(self, run: SeqRun) -> slice:
        return slice(run.start, run.start + run.length)
