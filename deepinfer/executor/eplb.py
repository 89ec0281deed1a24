"""The engine's side of expert-parallel load balancing: every ``step_interval`` steps, between two steps,
gather every rank's expert load counters, compute each MoE layer's next placement (``placement.py``) and
have every rank move its expert weights to it (``model/parallel/eplb.py``). The sequences in flight are not
touched (the experts hold no per-sequence state), so no request is dropped or recomputed.

Each rebalance leaves a ``RebalanceRecord``: the balancedness (mean / max tokens per rank, summed over the
layers) measured under the placement it replaces, and the window's loads under the old and new placements.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from deepinfer.config.eplb import EplbConfig
from deepinfer.executor.messages import CollectExpertLoad, MoveExperts
from deepinfer.model.parallel.placement import (ExpertPlacement, layers_balancedness, rank_loads, rebalanced,
                                                slot_rank_loads, static_placement)

log = logging.getLogger("deepinfer")


@dataclass(frozen=True, slots=True)
class RebalanceRecord:
    step: int  # engine steps run when it happened
    measured: float  # balancedness of the tokens each rank's slots computed since the previous placement
    expected_before: float  # the window's loads under the previous placement
    expected_after: float  # the window's loads under the new one
    static: float  # the window's loads under the start-up placement (what expert parallelism alone gives)
    moved_slots: int  # slots whose expert changed, over all layers
    seconds: float  # the whole rebalance: gathering the counters, planning, moving the weights


class EplbDriver:
    def __init__(self, config: EplbConfig) -> None:
        self.config = config
        self.steps = 0
        self.history: list[RebalanceRecord] = []

    def after_step(self, worker) -> None:
        """Count one step that ran on the ranks; rebalance when the interval is up."""
        self.steps += 1
        if self.steps % self.config.step_interval == 0:
            self.rebalance(worker)

    def _static(self, like: ExpertPlacement) -> ExpertPlacement:
        return static_placement(like.num_experts, like.num_ranks, self.config.num_redundant_experts)

    def rebalance(self, worker) -> RebalanceRecord:
        """``worker``: rank 0's ``RankWorker`` (its channel reaches every rank; it holds the placements,
        which are the same on every rank)."""
        start = time.perf_counter()
        channel = worker.channel
        order = CollectExpertLoad()
        channel.broadcast(order)
        reports = channel.gather(worker.handle(order))
        window = [[sum(col) for col in zip(*layer)] for layer in zip(*(r.window for r in reports))]
        slots = [[sum(col) for col in zip(*layer)] for layer in zip(*(r.slots for r in reports))]
        old = worker.balancer.placements
        new = tuple(rebalanced(loads, o, self.config.num_redundant_experts) for loads, o in zip(window, old))
        moved = sum(a != b for o, n in zip(old, new) for a, b in zip(o.slots, n.slots))
        if moved:
            order = MoveExperts(new)
            channel.broadcast(order)
            channel.gather(worker.handle(order))
        record = RebalanceRecord(
            step=self.steps,
            measured=layers_balancedness([slot_rank_loads(s, o.num_ranks) for s, o in zip(slots, old)]),
            expected_before=layers_balancedness([rank_loads(w, o) for w, o in zip(window, old)]),
            expected_after=layers_balancedness([rank_loads(w, n) for w, n in zip(window, new)]),
            static=layers_balancedness([rank_loads(w, self._static(o)) for w, o in zip(window, old)]),
            moved_slots=moved, seconds=time.perf_counter() - start)
        self.history.append(record)
        if self.config.log_balancedness:
            log.info("EPLB at step %d: balancedness %.3f measured since the last placement; the window's loads "
                     "%.3f -> %.3f with the new placement (%d slots moved in %.3f s)", record.step, record.measured,
                     record.expected_before, record.expected_after, record.moved_slots, record.seconds)
        return record
