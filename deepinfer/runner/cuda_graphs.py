"""Decode steps as CUDA graphs: one graph per batch-size bucket, captured once at start-up, replayed each step.

A decode step launches a few hundred kernels whose work is microseconds each; launched from Python they
cost more than they compute. A captured graph replays them with one launch. Everything a step varies lives
in static tensors the graph reads: token ids and the step's row lists (``model/step_index.py``), built
with fixed shapes: the batch is padded to the bucket (padding tokens write only the storage's spare rows
and read nothing), and each compressed kind has ``cdiv(max_model_len, m)`` entry columns, so one graph
serves every context length. Steps with more sequences than the largest bucket, or with more than one
new token per sequence (prefill, verify), run eagerly on the same batched path, which computes the same
bits (the kernels' results do not depend on padding or entry-column count).

Per step the host writes the token ids and the index into one pinned buffer per bucket (``StepBuffer``)
and ships it with one asynchronous copy; the graph's static inputs are views of that buffer's device twin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from deepinfer.kv.storage import KVStorage
from deepinfer.model.batch import ForwardBatch
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.step_index import StepBuffer, StepIndex, build_step_index


def default_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to 64, of 32 up to 256, of 64 beyond; always max_num_seqs."""
    sizes, b = [1, 2, 4, 8], 16
    while b < max_num_seqs:
        sizes.append(b)
        b += 16 if b < 64 else 32 if b < 256 else 64
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


class _Graph:
    """One bucket: its graph, its static inputs (token ids and ``index``: views of the flat ``device``
    buffer), the pinned ``host`` buffer each step is built in, and ``copied``: recorded after each copy
    out of ``host``."""

    def __init__(self, graph: torch.cuda.CUDAGraph, host: StepBuffer, device: torch.Tensor, index: StepIndex,
                 logits: torch.Tensor) -> None:
        self.graph, self.host, self.device, self.index, self.logits = graph, host, device, index, logits
        self.ids = host.layout.ids(device)
        self.copied = torch.cuda.Event()


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
            host = StepBuffer(b, b, self.max_model_len, self.storage.layout.block_size, pin_memory=True)
            host.write(ForwardBatch(()), self.storage, self.model.cfg.sliding_window)
            flat = host.tensor.to(self.device)  # blocking: warm-up and capture read it right away
            index = dataclasses.replace(self._padding_index(b), **host.layout.tensors(flat))
            ids = host.layout.ids(flat)
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
            self._graphs[b] = _Graph(graph, host, flat, index, logits)
        torch.cuda.synchronize()

    def fits(self, batch: ForwardBatch) -> bool:
        return 0 < len(batch.runs) <= self.max_batch and all(r.length == 1 for r in batch.runs)

    def run(self, input_ids: Sequence[int], batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] (a view into the graph's output: read it before the next replay)."""
        n = len(batch.runs)
        b = next(s for s in self.sizes if s >= n)
        g = self._graphs[b]
        # The last copy out of this pinned buffer may still be in flight: the engine reads the logits back
        # (a sync) before its next step, but a caller need not. Wait for that copy before rewriting.
        g.copied.synchronize()
        g.host.write(batch, self.storage, self.model.cfg.sliding_window)
        g.host.ids[:n] = input_ids
        g.host.ids[n:] = 0
        g.device.copy_(g.host.tensor, non_blocking=True)
        g.copied.record()
        g.graph.replay()
        return g.logits[:n]
