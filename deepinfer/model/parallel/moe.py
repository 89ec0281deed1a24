"""Sharded MoE layers: tensor parallel (every expert's intermediate dimension split) and expert parallel
(experts spread whole over all ranks, tokens dispatched to them and combined back).

Expert parallel, one layer:
  1. every rank routes its own tokens (the router and the hash table are replicated). The TP ranks of one
     DP group hold the same tokens after attention: each takes a contiguous 1/TP of them, so every token
     is dispatched once;
  2. dispatch: each (token, expert) pair goes to one physical slot holding a copy of its expert (the
     placement, ``placement.py``: without load balancing slot = expert, experts owned in contiguous ranges;
     with replicas, (token index + EP rank) modulo the expert's replica count picks one: deterministic,
     never dependent on timing, and a decode step's few tokens per rank still spread over the replicas
     instead of all taking the first); the pairs, ordered by (slot, token), go to the slots' ranks, one
     all-to-all of rows after one of counts;
  3. the owner runs each local slot on its rows: source rank after source rank, each in token order, which
     without replicas is exactly the row order the single-process ``ExpertLoop`` gives that expert for the
     DP ranks' tokens concatenated in rank order (with replicas, a subset of those rows);
  4. combine: the outputs return by the reverse all-to-all and are put back in (expert, token) order; the
     token's own rank multiplies them by the routing weights and sums them per token with ``index_add_`` in
     ascending logical expert order, in the activation dtype, as ``ExpertLoop`` does. Given GEMMs that do
     not change a row's result with the other rows of the batch, each token's output is bit-identical to
     the single-process reference, replicas or not (each replica is a byte copy of its expert);
  5. the TP ranks all-gather their token slices back, and the replicated shared expert's output is added.
A rank with no tokens sends and receives zero rows but joins both all-to-alls (``model/parallel/shard.py``
runs such a rank's layers as an empty step), so the collectives never wait for it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.distributed.collectives import all_gather_rows, all_reduce, all_to_all_rows, exchange_counts
from deepinfer.distributed.world import ParallelContext
from deepinfer.model.fused import StackedLinear, projection_sets
from deepinfer.model.moe import ExpertLoop, MoE
from deepinfer.model.parallel.expert_load import ExpertLoadWindow
from deepinfer.model.parallel.placement import ExpertPlacement, static_placement
from deepinfer.model.shard import Shard


class TPMoE(MoE):
    """Every routed and the shared expert hold ``1/tp`` of their intermediate dimension (w1/w3 rows, w2
    columns); the layer's output (routed + shared partial sums) is summed over the TP group."""

    pctx: ParallelContext

    @staticmethod
    def shards(pctx: ParallelContext, n_experts: int, shared: bool) -> dict[str, Shard]:
        rows, cols = Shard(0, pctx.tp_rank, pctx.tp_size), Shard(1, pctx.tp_rank, pctx.tp_size)
        owners = [f"experts.{e}" for e in range(n_experts)] + (["shared_experts"] if shared else [])
        return {f"{o}.{w}.weight": spec for o in owners for w, spec in (("w1", rows), ("w3", rows), ("w2", cols))}

    def became_sharded(self, pctx: ParallelContext) -> None:
        self.pctx = pctx
        for attr, parts in projection_sets(self).items():
            setattr(self, attr, StackedLinear.side_by_side(parts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x, input_ids), self.pctx.tp_group, self.pctx.ordered_sums)


def expert_range(pctx: ParallelContext, n_experts: int) -> range:
    """The global ids of the experts this rank owns."""
    per = n_experts // pctx.ep_size
    return range(pctx.ep_rank * per, (pctx.ep_rank + 1) * per)


class ExpertDispatch:
    """The expert-parallel exchange of one MoE layer (steps 2-4 of the module docstring up to the weighting),
    shared by V4's ``EPMoE`` and V4.1's (``model/v41/parallel.py``), whose expert math and combine differ: a rank
    holds its physical expert slots, routes by ``placement`` and exchanges (token, expert) pairs with the slots'
    ranks over the EP group."""

    pctx: ParallelContext
    placement: ExpertPlacement
    load: ExpertLoadWindow | None  # the rank's load counters when load balancing is on
    layer_index: int  # this layer's row in ``load``

    def set_placement(self, placement: ExpertPlacement) -> None:
        """Route by ``placement`` from now on (the slots must already hold its experts' weights). The
        replica table is padded with each expert's first slot (never read: the index is taken modulo the
        expert's replica count)."""
        self.placement = placement
        replicas = placement.replicas
        width = max(len(r) for r in replicas)
        table = [list(r) + [r[0]] * (width - len(r)) for r in replicas]
        device = self.pctx.device
        self._slot_of = torch.tensor(table, dtype=torch.long, device=device)
        self._replica_count = torch.tensor([len(r) for r in replicas], dtype=torch.long, device=device)

    def _exchange(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                  run_slots: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dispatch this rank's pairs, run ``run_slots(rows, local slot ids)`` (each received row through its one
        slot, unweighted) on what arrives, and bring the outputs back. Returns, in (expert, token) order (the
        combine's), each pair's expert, token, routing weight and output row."""
        p, per = self.pctx, self.placement.slots_per_rank
        k = indices.shape[1]
        expert = indices.reshape(-1)
        token = torch.arange(len(x), device=x.device).repeat_interleave(k)
        n = max(len(x), 1)
        order = torch.argsort(expert * n + token, stable=True)  # by (expert, token): the combine's order
        expert, token = expert[order], token[order]
        pair_weight = weights.reshape(-1)[order]
        slot = self._slot_of[expert, (token + p.ep_rank) % self._replica_count[expert]]
        if self.load is not None:
            self.load.record(self.layer_index, expert, slot)
        sent = torch.argsort(slot * n + token, stable=True)  # by (slot, token): the identity without replicas
        dest = slot[sent] // per
        send = torch.bincount(dest, minlength=p.ep_size).tolist()
        recv = exchange_counts(send, p.ep_group, x.device)
        rows = all_to_all_rows(x[token[sent]], send, recv, p.ep_group)
        local_ids = all_to_all_rows(slot[sent] - dest * per, send, recv, p.ep_group)
        # Rows of one slot keep their received order, so each slot's GEMM sees the rows the single-process
        # loop gives its expert (all of them without replicas).
        out = run_slots(rows, local_ids)
        back = out.new_empty(len(expert), *out.shape[1:])
        back[sent] = all_to_all_rows(out, recv, send, p.ep_group)  # back in (expert, token) order
        return expert, token, pair_weight, back


def expert_groups(expert: torch.Tensor) -> list[tuple[int, int]]:
    """The [a, b) runs of each expert in pairs sorted by expert (ascending ids, as the loops add them)."""
    bounds = torch.searchsorted(expert, torch.unique(expert)).tolist() + [len(expert)]
    return list(zip(bounds[:-1], bounds[1:]))


class EPMoE(ExpertDispatch, MoE):
    """Holds this rank's physical expert slots as ``experts[0..n)`` (local numbering: ``routed``, the
    ``ExpertLoop`` or, after the device transform, the fused FP4 experts, runs them by local slot id). Loaded
    as the experts of ``expert_range``; load balancing (``model/parallel/eplb.py``) may add redundant slots
    and change which expert each slot holds (``set_placement``)."""

    first_expert: int
    num_local: int  # ``experts`` is emptied when the device transform fuses them

    def became_sharded(self, pctx: ParallelContext, local: range) -> None:
        self.pctx, self.first_expert, self.num_local = pctx, local.start, len(local)
        self.experts = nn.ModuleList(self.experts[e] for e in local)
        self.routed = ExpertLoop(self.experts)
        self.load, self.layer_index = None, 0
        self.set_placement(static_placement(self.cfg.n_routed_experts, pctx.ep_size))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        p = self.pctx
        # A rank without tokens (an empty step) has no shared-expert rows: its FP8 GEMMs are not launched on zero.
        shared = self._shared(x) if self.shared_experts is not None and len(x) else None
        weights, indices = self._route(x, input_ids)
        sizes = [len(c) for c in torch.arange(len(x)).tensor_split(p.tp_size)]
        start = sum(sizes[: p.tp_rank])
        mine = slice(start, start + sizes[p.tp_rank])
        routed = self._dispatch_combine(x[mine], indices[mine], weights[mine])
        routed = all_gather_rows(routed, sizes, p.tp_group)
        return routed if shared is None else routed + shared  # ExpertLoop's ``routed + add``

    def _dispatch_combine(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        def run_slots(rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
            ones = torch.ones(len(rows), 1, dtype=weights.dtype, device=x.device)  # weight 1 is exact
            return self.routed(rows, local_ids.view(-1, 1), ones)

        expert, token, pair_weight, back = self._exchange(x, indices, weights, run_slots)
        back = (back * pair_weight[:, None]).to(x.dtype)  # ExpertLoop: expert(x) * weight, in this order
        routed = torch.zeros_like(x)
        for a, b in expert_groups(expert):  # ascending expert ids, as ExpertLoop adds them
            routed.index_add_(0, token[a:b], back[a:b])
        return routed
