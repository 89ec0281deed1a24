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

import numpy as np
import torch

from deepinfer.kv.storage import KVStorage
from deepinfer.model.batch import ForwardBatch
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.step_index import SlotTables, StepBuffer, StepIndex, build_step_index


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
                 logits: torch.Tensor, streams: torch.Tensor | None = None) -> None:
        self.graph, self.host, self.device, self.index, self.logits = graph, host, device, index, logits
        self.streams = streams  # the final streams (``keep_streams``): what the MTP layer reads
        self.ids = host.layout.ids(device)
        self.copied = torch.cuda.Event()


class DecodeGraphs:
    """Graphs for steps of B sequences with ``tokens_per_seq`` new tokens each (1: decode; k+1: verifying k
    drafts), logits at every token, for B up to each bucket size."""

    def __init__(self, model: DeepseekV4, storage: KVStorage, max_model_len: int, sizes: Sequence[int],
                 tokens_per_seq: int = 1, keep_streams: bool = False) -> None:
        if tokens_per_seq < 1:
            raise ValueError(f"tokens_per_seq: must be >= 1, got {tokens_per_seq}")
        self.model, self.storage = model, storage
        self.tokens_per_seq = tokens_per_seq
        # Verify steps also return the final streams (static outputs) for the MTP layer's graphs.
        self.keep_streams = keep_streams
        self.sizes = sorted(set(sizes))
        self.max_model_len = max_model_len
        self.device = next(model.buffers()).device
        self._graphs: dict[int, _Graph] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def _padding_index(self, b: int, batch: ForwardBatch | None = None) -> StepIndex:
        window = self.model.cfg.sliding_window
        return build_step_index(batch or ForwardBatch(()), self.storage, window, num_tokens=b * self.tokens_per_seq,
                                num_seqs=b, max_len=self.max_model_len)

    @torch.no_grad()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool (buckets never run concurrently)."""
        pool = None
        for b in reversed(self.sizes):
            host = StepBuffer(b * self.tokens_per_seq, b, self.max_model_len, self.storage.layout.block_size,
                              pin_memory=True)
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
                streams = self.model(ids, None, self.storage, index)
                logits = self.model.logits(streams)
            pool = graph.pool()
            self._graphs[b] = _Graph(graph, host, flat, index, logits, streams if self.keep_streams else None)
        torch.cuda.synchronize()

    def fits_slots(self, num_seqs: int, num_tokens: int) -> bool:
        """A step of ``num_seqs`` sequences with ``num_tokens`` new tokens in all can replay a bucket (the
        caller checks that each has the same count)."""
        return 0 < num_seqs <= self.max_batch and num_tokens == num_seqs * self.tokens_per_seq

    def run(self, input_ids: Sequence[int], batch: ForwardBatch) -> torch.Tensor:
        """Logits [B * tokens_per_seq, V] (a view into the graph's output: read it before the next replay)."""
        n = len(batch.runs)
        g = self._bucket(n)
        g.host.write(batch, self.storage, self.model.cfg.sliding_window)
        return self._replay(g, n, input_ids)

    def bucket(self, n: int) -> _Graph:
        """The graph a step of ``n`` sequences replays (its static index, ids and outputs)."""
        return self._graphs[next(s for s in self.sizes if s >= n)]

    def run_slots(self, input_ids, slots: np.ndarray, first: np.ndarray, tables: SlotTables,
                  placeholders: tuple[torch.Tensor, torch.Tensor] | None = None, shift=None) -> torch.Tensor:
        """``run`` for sequences kept in batch slots (the engine's runner): ``tokens_per_seq`` tokens each,
        sequence i in slot ``slots[i]`` from position ``first[i]``. ``placeholders`` (rows, values on the
        device): inputs the host does not know, written into the graph's token ids after the copy;
        ``shift`` (a ``runner/step_shift.StepShift``): moves the static index's positions after the copy."""
        n = len(slots)
        g = self._bucket(n)
        g.host.write_slots(slots, first, np.full(n, self.tokens_per_seq, dtype=np.int64), tables, self.storage,
                           self.model.cfg.sliding_window)
        return self._replay(g, n, input_ids, placeholders, shift)

    def _bucket(self, n: int) -> _Graph:
        g = self.bucket(n)
        # The last copy out of this bucket's pinned buffer may still be in flight (with async scheduling the
        # host builds step N+1 while N runs). Wait for that copy, not for the step, before rewriting.
        g.copied.synchronize()
        return g

    def _replay(self, g: _Graph, n: int, input_ids, placeholders=None, shift=None) -> torch.Tensor:
        n *= self.tokens_per_seq
        g.host.ids[:n] = input_ids
        g.host.ids[n:] = 0
        g.device.copy_(g.host.tensor, non_blocking=True)
        g.copied.record()
        if placeholders is not None:
            g.ids[placeholders[0]] = placeholders[1]
        if shift is not None:  # in the static inputs, after the copy: the captured region reads them
            shift.apply(g.index)
        g.graph.replay()
        return g.logits[:n]
