"""Scheduler: one token-count abstraction for prefill chunks and decode steps.

Each step has a token budget (``max_num_batched_tokens``) and a sequence cap (``max_num_seqs``).
Running sequences are served first, decodes before unfinished prefills, then waiting sequences in
arrival order (FCFS, no skipping ahead). A sequence whose next tokens do not fit in the cache triggers
preemption by recompute of the most recently arrived running sequence not already planned this step;
a preempted sequence keeps its generated tokens and is recomputed later, so with seeded sampling its
output is unchanged. The cache is never overcommitted, so a full cache never crashes the engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from deepinfer.config.engine import SchedulerConfig
from deepinfer.engine.sequence import Sequence, Status
from deepinfer.kv.manager import CacheManager


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int
    first_pos: int

    @property
    def samples(self) -> bool:
        """True when this step completes the sequence's known tokens, so a new token is drawn."""
        return self.first_pos + self.num_new_tokens == self.seq.num_tokens


@dataclass(frozen=True, slots=True)
class StepPlan:
    scheduled: tuple[ScheduledSeq, ...]
    preempted: tuple[Sequence, ...]
    # Sequences that cannot fit even in an otherwise empty cache; the engine ends them ("length").
    unschedulable: tuple[Sequence, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache: CacheManager) -> None:
        self.config = config
        self.cache = cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # lifetime counter (metrics, tests)

    # ---- membership -----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence (finished or aborted) and release its cache blocks immediately."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.seq_id in self.cache:
            self.cache.free(seq.seq_id)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning -------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        budget = self.config.max_num_batched_tokens
        planned: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        for seq in self._running_order():
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_tokens - seq.num_computed, budget)
            if self._make_room(seq, n, planned, preempted):
                planned.append(self._take(seq, n))
                budget -= n
        while budget and self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if not self.cache.can_allocate(seq.seq_id, n):
                break  # FCFS: a later, smaller request does not overtake
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            planned.append(self._take(seq, n))
            budget -= n
        stuck: tuple[Sequence, ...] = ()
        if not planned and not self.running and self.waiting:
            stuck = (self.waiting.popleft(),)
        return StepPlan(tuple(planned), tuple(preempted), stuck)

    def _running_order(self) -> list[Sequence]:
        decodes = [s for s in self.running if s.num_tokens - s.num_computed == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed > 1]
        return decodes + prefills

    def _take(self, seq: Sequence, n: int) -> ScheduledSeq:
        self.cache.allocate(seq.seq_id, n)
        return ScheduledSeq(seq, n, seq.num_computed)

    def _make_room(self, seq: Sequence, n: int, planned: list[ScheduledSeq], preempted: list[Sequence]) -> bool:
        planned_seqs = {p.seq for p in planned}
        while not self.cache.can_allocate(seq.seq_id, n):
            victims = [s for s in self.running if s not in planned_seqs]
            victim = max(victims, key=lambda s: s.arrival)
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.num_preemptions += 1
        self.running.remove(seq)
        self.cache.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = Status.WAITING
        # Back to the head of the queue in arrival order, ahead of everything that arrived later.
        items = sorted([*self.waiting, seq], key=lambda s: s.arrival)
        self.waiting = deque(items)

    # ---- after the step -------------------------------------------------------------------------------
    def commit(self, plan: StepPlan) -> None:
        """The model computed the planned tokens: advance each sequence and settle its cache length."""
        for item in plan.scheduled:
            item.seq.num_computed += item.num_new_tokens
            self.cache.commit(item.seq.seq_id, item.seq.num_computed)
