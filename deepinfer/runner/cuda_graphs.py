"""Decode steps as CUDA graphs: one graph per batch-size bucket, captured once at start-up, replayed each step.

A decode step launches a few hundred kernels whose work is microseconds each; launched from Python they
cost more than they compute. A captured graph replays them with one launch. Everything a step varies lives
in static tensors the graph reads: token ids and the step's row lists (``model/step_index.py``), built
with fixed shapes: the batch is padded to the bucket (padding tokens write only the storage's spare rows
and read nothing), and each compressed kind has ``cdiv(max_model_len, m)`` entry columns, so one graph
serves every context length. Steps with more sequences than the largest bucket, or with more than one
new token per sequence (prefill, verify), run eagerly on the same batched path, which computes the same
bits (the kernels' results do not depend on padding or entry-column count).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.kv.storage import KVStorage
from deepinfer.model.batch import ForwardBatch
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.step_index import StepIndex, build_step_index


def default_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to 64, of 32 up to 256, of 64 beyond; always max_num_seqs."""
    sizes, b = [1, 2, 4, 8], 16
    while b < max_num_seqs:
        sizes.append(b)
        b += 16 if b < 64 else 32 if b < 256 else 64
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, ids: torch.Tensor, index: StepIndex, logits: torch.Tensor):
        self.graph, self.ids, self.index, self.logits = graph, ids, index, logits


class DecodeGraphs:
    def __init__(self, model: DeepseekV4, storage: KVStorage, max_model_len: int, sizes: Sequence[int]) -> None:
        if not model.indexed:
            raise ValueError("DecodeGraphs needs the batched path (model.indexed, set by prepare_for_device)")
        self.model, self.storage = model, storage
        self.sizes = sorted(set(sizes))
        self.max_model_len = max_model_len
        self.device = next(model.buffers()).device
        self._graphs: dict[int, _Graph] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _padding_index(self, b: int, batch: ForwardBatch | None = None) -> StepIndex:
        window = self.model.cfg.sliding_window
        return build_step_index(batch or ForwardBatch(()), self.storage, window, num_tokens=b, num_seqs=b,
                                max_len=self.max_model_len)

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool (buckets never run concurrently)."""
        pool = None
        for b in reversed(self.sizes):
            ids = torch.zeros(b, dtype=torch.long, device=self.device)
            index = self._padding_index(b).to(self.device)
            # Warm up on a side stream (Triton compiles here), as graph capture requires.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.model.logits(self.model(ids, None, self.storage, index))
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model.logits(self.model(ids, None, self.storage, index))
            pool = graph.pool()
            self._graphs[b] = _Graph(graph, ids, index, logits)
        torch.cuda.synchronize()

    def fits(self, batch: ForwardBatch) -> bool:
        return 0 < len(batch.runs) <= self.max_batch and all(r.length == 1 for r in batch.runs)

    def run(self, input_ids: Sequence[int], batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] (a view into the graph's output: read it before the next replay)."""
        n = len(batch.runs)
        b = next(s for s in self.sizes if s >= n)
        g = self._graphs[b]
        g.index.copy_(self._padding_index(b, batch))
        ids = torch.zeros(b, dtype=torch.long)
        ids[:n] = torch.as_tensor(input_ids, dtype=torch.long)
        g.ids.copy_(ids, non_blocking=True)
        g.graph.replay()
        return g.logits[:n]
