"""Expert-parallel load balancing on one rank: redundant expert slots, the load counters, and moving expert
weights to a new placement (``placement.py``) between engine steps.

Moving weights: every slot's new expert is copied from a rank that holds it now, over the EP group with
torch.distributed (an all-to-all of the slots' bytes per weight tensor; a copy on the rank itself is used
where there is one). Not re-read from the checkpoint: a rank can read any expert, but the exchange needs no
disk or file system on the worker nodes, moves the bytes in exactly the form the rank runs them (dequantized
linears of the reference loop, or the fused FP4 experts' tile-major codes and scales: that layout is laid out
per expert, so a slot is one index of the stacks) and so is a byte copy by construction, and runs at
interconnect speed. Only the slots whose expert changes move (``keep_in_place``).

Start-up: each rank loads its contiguous range of experts as expert parallelism does, then fills its share
of the redundant slots with copies of its own first experts (``static_placement``; no exchange); the first
rebalance puts replicas where the load is.
"""

from __future__ import annotations

import copy

import torch

from deepinfer.config.eplb import EplbConfig
from deepinfer.distributed.collectives import all_to_all_rows
from deepinfer.model.device import FusedFP4Experts
from deepinfer.model.moe import ExpertLoop
from deepinfer.model.parallel.expert_load import ExpertLoadWindow
from deepinfer.model.parallel.moe import EPMoE
from deepinfer.model.parallel.placement import ExpertPlacement, Transfer, static_placement, transfer_plan

_FUSED = ("w13", "s13", "w2", "s2")
_LOOP = ("w1", "w3", "w2")


def slot_tensors(moe: EPMoE) -> dict[str, list[torch.Tensor]]:
    """Each weight tensor of the layer's slots, per slot (views: writing one writes the slot)."""
    routed = moe.routed
    if isinstance(routed, FusedFP4Experts):
        return {name: list(getattr(routed, name).unbind(0)) for name in _FUSED}
    if isinstance(routed, ExpertLoop):
        experts = routed._experts[0]
        return {w: [getattr(e, w).weight.data for e in experts] for w in _LOOP}
    raise TypeError(f"expert load balancing: no slot storage for {type(routed).__name__}")


def add_slots(moe: EPMoE, copies: list[int]) -> None:
    """Append slots holding copies of local slots ``copies``, in that order."""
    if not copies:
        return
    routed = moe.routed
    if isinstance(routed, FusedFP4Experts):
        for name in _FUSED:
            stack = getattr(routed, name)
            setattr(routed, name, torch.cat([stack, stack[copies]]))  # replaces the registered buffer
    elif isinstance(routed, ExpertLoop):
        experts = routed._experts[0]  # the module's ``experts``: the list grows in place
        for i in copies:
            experts.append(copy.deepcopy(experts[i]))
    else:
        raise TypeError(f"expert load balancing: no slot storage for {type(routed).__name__}")


@torch.no_grad()
def move_experts(moe: EPMoE, new: ExpertPlacement) -> None:
    """Fill the layer's slots with ``new``'s experts and route by it. Every EP rank calls this with the same
    ``new`` (the transfers are derived from the two placements alone, so all ranks agree on them)."""
    plan = transfer_plan(moe.placement, new)
    pctx = moe.pctx
    me, ranks = pctx.ep_rank, pctx.ep_size
    outgoing = sorted((t for t in plan if t.src_rank == me != t.dst_rank), key=lambda t: (t.dst_rank, t.dst_slot))
    incoming = sorted((t for t in plan if t.dst_rank == me != t.src_rank), key=lambda t: (t.src_rank, t.dst_slot))
    local = [t for t in plan if t.src_rank == me == t.dst_rank]
    crossing = any(t.src_rank != t.dst_rank for t in plan)  # the same answer on every rank
    send = [sum(t.dst_rank == r for t in outgoing) for r in range(ranks)]
    recv = [sum(t.src_rank == r for t in incoming) for r in range(ranks)]
    for views in slot_tensors(moe).values():
        _exchange(views, outgoing, incoming, local, send, recv, pctx.ep_group if crossing else None)
    moe.set_placement(new)


def _exchange(views: list[torch.Tensor], outgoing: list[Transfer], incoming: list[Transfer], local: list[Transfer],
              send: list[int], recv: list[int], group) -> None:
    """One weight tensor's slot copies. Everything read is copied before anything is written (a slot may be
    both a source and a destination)."""
    proto = views[0]
    payload = torch.stack([views[t.src_slot] for t in outgoing]) if outgoing else proto.new_empty(0, *proto.shape)
    payload = payload.reshape(len(outgoing), proto.numel()).view(torch.uint8)  # raw bytes: any dtype travels
    kept = [views[t.src_slot].clone() for t in local]
    if group is not None:
        rows = all_to_all_rows(payload, send, recv, group)
        for t, row in zip(incoming, rows):
            views[t.dst_slot].copy_(row.view(proto.dtype).view(proto.shape))
    for t, value in zip(local, kept):
        views[t.dst_slot].copy_(value)


class ExpertBalancer:
    """One rank's side of EPLB over its model's (non-MTP) expert-parallel MoE layers: the load window they
    record into, the load report, and applying new placements."""

    def __init__(self, model, config: EplbConfig) -> None:
        self.layers = [layer.ffn for layer in model.layers if isinstance(layer.ffn, EPMoE)]
        if not self.layers:
            raise ValueError("enable_eplb: the model has no expert-parallel MoE layers (needs enable_expert_parallel)")
        pctx = model.parallel
        n_experts, redundant = model.cfg.n_routed_experts, config.num_redundant_experts
        start = static_placement(n_experts, pctx.ep_size, redundant)
        self.window = ExpertLoadWindow(len(self.layers), n_experts, len(start.slots), config.window_size, pctx.device)
        for i, moe in enumerate(self.layers):
            loaded = list(moe.placement.rank_slots(pctx.ep_rank))
            add_slots(moe, [loaded.index(e) for e in start.rank_slots(pctx.ep_rank)[len(loaded):]])
            moe.set_placement(start)
            moe.load, moe.layer_index = self.window, i

    @property
    def placements(self) -> tuple[ExpertPlacement, ...]:
        return tuple(moe.placement for moe in self.layers)

    def advance(self) -> None:
        """A new engine step begins (its counts replace the window's oldest step)."""
        self.window.advance()

    def report(self) -> tuple[list[list[int]], list[list[int]]]:
        """(per layer, per logical expert: pairs over the window; per layer, per slot: pairs since the last
        placement), this rank's counts."""
        return self.window.window_loads(), self.window.slot_loads()

    def clear(self) -> None:
        self.window.clear()

    def apply(self, placements: tuple[ExpertPlacement, ...]) -> None:
        if len(placements) != len(self.layers):
            raise ValueError(f"expert load balancing: {len(placements)} placements for {len(self.layers)} layers")
        for moe, new in zip(self.layers, placements):
            if new != moe.placement:
                move_experts(moe, new)
        self.window.placement_changed()
