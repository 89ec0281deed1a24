"""The MTP layer's passes of a verify step as CUDA graphs (speculative decoding on the GPU), head and draft
pick included.

A verify step of B sequences with k drafts each is, besides sampling, three kinds of forward: the target over
B x (k+1) tokens, the MTP layer over the same rows (filling its window and giving the first draft), and k - 1
chained MTP passes over the proposers' single rows. Launched from Python, each is hundreds of microsecond
kernels; the target runs in ``DecodeGraphs(tokens_per_seq=k+1, keep_streams=True)``, and this module holds
the other two, each a capture of the function the eager path calls (``runner/mtp_steps.py``):

  * ``rows``: per target bucket, ``rows_and_first_draft``: the MTP layer over the bucket's rows, reading the
    target graph's static final streams and static step index (the same positions), with the next token of
    every row (the step's draws) in a static buffer; then the head and the draft pick at the proposers'
    base rows (static device inputs, written from the accepted counts without a host read);
  * ``chain``: per proposer bucket, ``chain_step``: one chained pass of single rows, head and pick
    included, with a step index built on the host at the positions of full acceptance and a static
    ``shift`` that moves them back by the rejected drafts on the device.

Each is captured twice, without and with sampled rows (``pick_drafts``' flag: the seeded noise is a
[rows, vocabulary] hash a greedy batch does not need). The chain's host buffers form a ring per bucket, so
writing one chained pass's index never waits for the previous pass's copy of the same step to leave it.

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
from deepinfer.runner.mtp_steps import chain_step, rows_and_first_draft


@dataclasses.dataclass(eq=False)
class _Picks:
    """Static per-row inputs of the draft pick (padding rows: whatever the last step left; never read)."""

    temperature: torch.Tensor  # [b] float64
    seeds: torch.Tensor  # [b] int64

    @staticmethod
    def zeros(b: int, device) -> "_Picks":
        return _Picks(torch.zeros(b, dtype=torch.float64, device=device), torch.zeros(b, dtype=torch.int64,
                                                                                    device=device))

    def write(self, temperature: torch.Tensor, seeds: torch.Tensor) -> None:
        m = len(temperature)
        self.temperature[:m].copy_(temperature)
        self.seeds[:m].copy_(seeds)


@dataclasses.dataclass(eq=False)
class _Rows:
    graphs: tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]  # (greedy only, with sampled rows)
    next_ids: torch.Tensor  # [b * q] static input
    base_rows: torch.Tensor  # [b] static input: the proposers' base rows among the bucket's rows
    picks: _Picks
    outs: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per graph: (streams [b, hc, H], drafts [b])


@dataclasses.dataclass(eq=False)
class _HostSlot:
    buffer: StepBuffer
    copied: torch.cuda.Event  # recorded after the last copy out of ``buffer``


@dataclasses.dataclass(eq=False)
class _Chain:
    graphs: tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]
    ring: list[_HostSlot]  # host buffers used in turn (the device buffer is reused in stream order)
    device: torch.Tensor  # the device twin of the host buffers (index and ids are views of it)
    ids: torch.Tensor  # [b] static draft tokens
    x: torch.Tensor  # [b, hc, H] static input streams
    shift: torch.Tensor  # [b] static: accepted - drafts per row (padding: 0)
    picks: _Picks
    outs: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    turn: int = 0


class MTPGraphs:
    def __init__(self, model: DeepseekV4, storage: KVStorage, target: DecodeGraphs, max_model_len: int,
                 chain_sizes: Sequence[int]) -> None:
        if not target.keep_streams:
            raise ValueError("target: the verify graphs must keep their final streams (keep_streams=True)")
        self.model, self.storage, self.target = model, storage, target
        self.max_model_len = max_model_len
        # One draft per step (k = 1) has no chained pass to capture.
        self.chain_sizes = sorted(set(chain_sizes)) if target.tokens_per_seq > 2 else []
        self.window = model.cfg.sliding_window
        # Chained passes per step: k - 1; two steps' worth of host buffers, so a step's writes wait at most
        # for the copies of the step before the previous one.
        self.ring_size = 2 * max(1, target.tokens_per_seq - 2)
        self._rows: dict[int, _Rows] = {}
        self._chain: dict[int, _Chain] = {}

    @torch.no_grad()
    def capture(self) -> None:
        """Capture after the target graphs (their static streams and indexes are these graphs' inputs)."""
        model, storage, dev = self.model, self.storage, self.target.device
        pool = None
        for b in reversed(self.target.sizes):
            g = self.target.bucket(b)
            next_ids = torch.zeros_like(g.ids)
            base_rows = torch.zeros(b, dtype=torch.int64, device=dev)
            picks = _Picks.zeros(b, dev)
            graphs, outs = [], []
            for sampled in (False, True):
                graph, out = self._capture(lambda: rows_and_first_draft(
                    model, storage, g.streams, next_ids, g.index, base_rows, picks.temperature, picks.seeds,
                    sampled), pool)
                pool = graph.pool()
                graphs.append(graph)
                outs.append(out)
            self._rows[b] = _Rows(tuple(graphs), next_ids, base_rows, picks, tuple(outs))
        streams = self.target.bucket(1).streams
        for b in reversed(self.chain_sizes):
            ring = [_HostSlot(StepBuffer(b, b, self.max_model_len, storage.layout.block_size, pin_memory=True),
                              torch.cuda.Event()) for _ in range(self.ring_size)]
            for h in ring:
                h.buffer.write(ForwardBatch(()), storage, self.window)
            flat = ring[0].buffer.tensor.to(dev)
            index = dataclasses.replace(
                build_step_index(ForwardBatch(()), storage, self.window, num_tokens=b, num_seqs=b,
                                 max_len=self.max_model_len), **ring[0].buffer.layout.tensors(flat))
            ids = ring[0].buffer.layout.ids(flat)
            x = torch.zeros((b, *streams.shape[1:]), dtype=streams.dtype, device=dev)
            shift = torch.zeros(b, dtype=torch.int64, device=dev)
            picks = _Picks.zeros(b, dev)
            graphs, outs = [], []
            for sampled in (False, True):
                graph, out = self._capture(lambda: chain_step(model, storage, x, ids, index, shift,
                                                              picks.temperature, picks.seeds, sampled), pool)
                pool = graph.pool()
                graphs.append(graph)
                outs.append(out)
            self._chain[b] = _Chain(tuple(graphs), ring, flat, ids, x, shift, picks, tuple(outs))
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
        return self.chain_sizes[-1] if self.chain_sizes else 0

    def run_rows(self, n: int, next_ids: torch.Tensor, base_rows: torch.Tensor | None,
                 temperature: torch.Tensor | None, seeds: torch.Tensor | None,
                 sampled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows_and_first_draft`` over the rows of the target graph replayed last for ``n`` sequences, for
        ``m`` = len(base_rows) proposers (None: none); returns (streams [m, hc, H], drafts [m]), views of
        static outputs (read them before the next replay)."""
        b = next(s for s in self.target.sizes if s >= n)
        r = self._rows[b]
        rows = n * self.target.tokens_per_seq
        r.next_ids[:rows].copy_(next_ids)
        m = 0 if base_rows is None else len(base_rows)
        if m:
            r.base_rows[:m].copy_(base_rows)
            r.picks.write(temperature, seeds)
        r.graphs[sampled].replay()
        x, drafts = r.outs[sampled]
        return x[:m], drafts[:m]

    def run_chain(self, x: torch.Tensor, draft: torch.Tensor, slots: np.ndarray, positions: np.ndarray,
                  tables: SlotTables, shift: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  sampled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``chain_step`` for ``m`` proposers: MTP rows at ``positions`` (host, full acceptance) + ``shift``
        (device) fed ``x`` and ``draft``; returns (streams [m, hc, H], drafts [m]), views of static outputs."""
        m = len(slots)
        c = self._chain[next(s for s in self.chain_sizes if s >= m)]
        h = c.ring[c.turn]
        c.turn = (c.turn + 1) % len(c.ring)
        h.copied.synchronize()  # this host buffer's last copy (a step or more ago) may still be in flight
        h.buffer.write_slots(slots, positions, np.ones(m, dtype=np.int64), tables, self.storage, self.window)
        h.buffer.ids[:] = 0
        c.device.copy_(h.buffer.tensor, non_blocking=True)
        h.copied.record()
        c.ids[:m].copy_(draft)
        c.x[:m].copy_(x)
        c.shift[:m].copy_(shift)
        if m < len(c.shift):
            c.shift[m:].zero_()  # padding rows sit at position 0 and must stay there
        c.picks.write(temperature, seeds)
        c.graphs[sampled].replay()
        out, drafts = c.outs[sampled]
        return out[:m], drafts[:m]
