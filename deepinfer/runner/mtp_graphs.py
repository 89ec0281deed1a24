"""The MTP layer's passes of a verify step as CUDA graphs (speculative decoding on the GPU).

A verify step of B sequences with k drafts each is, besides sampling, three kinds of forward: the target over
B x (k+1) tokens, the MTP layer over the same rows (filling its window and giving the first draft), and k - 1
chained MTP passes over the proposers' single rows. Launched from Python, each is hundreds of microsecond
kernels; the target runs in ``DecodeGraphs(tokens_per_seq=k+1, keep_streams=True)``, and this module holds
the other two:

  * ``rows``: per target bucket, ``mtp_forward`` over the bucket's rows, reading the target graph's static
    final streams and static step index (the same positions), with the next token of every row (the step's
    draws) in a static buffer;
  * ``chain``: per proposer bucket, one chained pass (``mtp_forward`` + ``mtp_logits``) of single rows at
    arbitrary positions, with a step index built on the host like a decode step's, the previous pass's
    streams and drafts copied into static inputs.

Padding rows of a bucket write the storage's spare rows and read nothing, as in ``DecodeGraphs``. The graphs
compute what the eager calls compute (the GPU tests compare them bit for bit at full buckets).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from deepinfer.kv.storage import KVStorage
from deepinfer.model.batch import ForwardBatch
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.step_index import SlotTables, StepBuffer, build_step_index
from deepinfer.runner.cuda_graphs import DecodeGraphs


@dataclasses.dataclass(eq=False)
class _Rows:
    graph: torch.cuda.CUDAGraph
    next_ids: torch.Tensor  # [b * q] static input
    out: torch.Tensor  # [b * q, hc, H] static output


@dataclasses.dataclass(eq=False)
class _Chain:
    graph: torch.cuda.CUDAGraph
    host: StepBuffer
    device: torch.Tensor  # the device twin of ``host`` (index and ids are views of it)
    ids: torch.Tensor  # [b] static draft tokens
    x: torch.Tensor  # [b, hc, H] static input streams
    out: torch.Tensor  # [b, hc, H]
    logits: torch.Tensor  # [b, V]
    copied: torch.cuda.Event


class MTPGraphs:
    def __init__(self, model: DeepseekV4, storage: KVStorage, target: DecodeGraphs, max_model_len: int,
                 chain_sizes: Sequence[int]) -> None:
        if not target.keep_streams:
            raise ValueError("target: the verify graphs must keep their final streams (keep_streams=True)")
        self.model, self.storage, self.target = model, storage, target
        self.max_model_len = max_model_len
        self.chain_sizes = sorted(set(chain_sizes))
        self.window = model.cfg.sliding_window
        self._rows: dict[int, _Rows] = {}
        self._chain: dict[int, _Chain] = {}

    @torch.no_grad()
    def capture(self) -> None:
        """Capture after the target graphs (their static streams and indexes are these graphs' inputs)."""
        model, storage = self.model, self.storage
        pool = None
        for b in reversed(self.target.sizes):
            g = self.target.bucket(b)
            next_ids = torch.zeros_like(g.ids)
            graph, (out,) = self._capture(lambda: (model.mtp_forward(g.streams, next_ids, None, storage,
                                                                     index=g.index),), pool)
            pool = graph.pool()
            self._rows[b] = _Rows(graph, next_ids, out)
        for b in reversed(self.chain_sizes):
            host = StepBuffer(b, b, self.max_model_len, storage.layout.block_size, pin_memory=True)
            host.write(ForwardBatch(()), storage, self.window)
            flat = host.tensor.to(self.target.device)
            index = dataclasses.replace(
                build_step_index(ForwardBatch(()), storage, self.window, num_tokens=b, num_seqs=b,
                                 max_len=self.max_model_len), **host.layout.tensors(flat))
            ids = host.layout.ids(flat)
            x = torch.zeros((b, *self.target.bucket(1).streams.shape[1:]), dtype=self.target.bucket(1).streams.dtype,
                            device=self.target.device)

            def chain_step():
                out = model.mtp_forward(x, ids, None, storage, index=index)
                return out, model.mtp_logits(out)

            graph, (out, logits) = self._capture(chain_step, pool)
            pool = graph.pool()
            self._chain[b] = _Chain(graph, host, flat, ids, x, out, logits, torch.cuda.Event())
        torch.cuda.synchronize()

    @staticmethod
    def _capture(fn, pool):
        side = torch.cuda.Stream()  # warm up (Triton compiles) on a side stream, as capture requires
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            outs = fn()
        return graph, outs

    @property
    def max_chain(self) -> int:
        return self.chain_sizes[-1]

    def run_rows(self, n: int, next_ids: torch.Tensor) -> torch.Tensor:
        """The MTP pass over the rows of the target graph replayed last for ``n`` sequences: [n * q, hc, H]
        (a view of the static output: read it before the next replay)."""
        b = next(s for s in self.target.sizes if s >= n)
        r = self._rows[b]
        rows = n * self.target.tokens_per_seq
        r.next_ids[:rows].copy_(next_ids)
        r.graph.replay()
        return r.out[:rows]

    def run_chain(self, x: torch.Tensor, draft: torch.Tensor, slots: np.ndarray, positions: np.ndarray,
                  tables: SlotTables) -> tuple[torch.Tensor, torch.Tensor]:
        """One chained pass for ``m`` proposers: MTP rows at ``positions`` fed ``x`` and ``draft``; returns
        (streams [m, hc, H], logits [m, V]), views of static outputs."""
        m = len(slots)
        c = self._chain[next(s for s in self.chain_sizes if s >= m)]
        c.copied.synchronize()  # the previous copy out of this pinned buffer may still be in flight
        c.host.write_slots(slots, positions, np.ones(m, dtype=np.int64), tables, self.storage, self.window)
        c.host.ids[:] = 0
        c.device.copy_(c.host.tensor, non_blocking=True)
        c.copied.record()
        c.ids[:m].copy_(draft)
        c.x[:m].copy_(x)
        c.graph.replay()
        return c.out[:m], c.logits[:m]
