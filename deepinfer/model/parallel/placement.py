"""Where the experts of one MoE layer live under expert parallelism: pure functions on integer ids.

Logical expert: one of the model's ``n_routed_experts`` sets of weights. Physical slot: a place for one
expert's weights on one rank; there are experts + redundant slots, the same number on every rank (rank r
holds the global slots ``[r*S, (r+1)*S)``, S slots per rank). A placement maps every slot to the logical
expert whose copy it holds; a logical expert may have several replicas, and the dispatch splits its tokens
over them (``EPMoE``). Load: tokens routed to a logical expert; a replica is assumed to take an equal share.

``balanced_placement`` is the rebalance (vLLM's and DeepSeek's EPLB idea, greedy): give the redundant slots
one at a time to the expert with the heaviest load per replica, then place the replicas heaviest-first, each
on the least loaded rank that has a free slot (and no replica of that expert yet, where one can be avoided).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ExpertPlacement:
    slots: tuple[int, ...]  # physical slot -> logical expert
    num_ranks: int
    num_experts: int

    def __post_init__(self) -> None:
        if self.num_ranks < 1 or len(self.slots) % self.num_ranks:
            raise ValueError(f"placement: {len(self.slots)} slots cannot be split evenly over {self.num_ranks} ranks")
        held = set(self.slots)
        if any(not 0 <= e < self.num_experts for e in held) or len(held) != self.num_experts:
            missing = sorted(set(range(self.num_experts)) - held)
            raise ValueError(f"placement: every logical expert needs a slot (missing {missing[:8]}), and slots "
                             f"hold expert ids in [0, {self.num_experts})")

    @property
    def slots_per_rank(self) -> int:
        return len(self.slots) // self.num_ranks

    @property
    def replicas(self) -> tuple[tuple[int, ...], ...]:
        """Logical expert -> its physical slots, ascending."""
        out: list[list[int]] = [[] for _ in range(self.num_experts)]
        for slot, e in enumerate(self.slots):
            out[e].append(slot)
        return tuple(tuple(r) for r in out)

    def rank_slots(self, rank: int) -> tuple[int, ...]:
        """The logical experts of ``rank``'s slots, in slot order."""
        s = self.slots_per_rank
        return self.slots[rank * s: (rank + 1) * s]


def static_placement(num_experts: int, num_ranks: int, num_redundant: int = 0) -> ExpertPlacement:
    """The placement before any load is known: rank r holds its contiguous range of experts (what expert
    parallelism loads), then its share of the redundant slots as copies of its own first experts (filled
    without any exchange; the first rebalance moves them where the load is)."""
    if num_experts % num_ranks or num_redundant % num_ranks:
        raise ValueError(f"placement: {num_experts} experts and {num_redundant} redundant slots must both divide "
                         f"by {num_ranks} ranks")
    per, extra = num_experts // num_ranks, num_redundant // num_ranks
    slots = [r * per + j % per for r in range(num_ranks) for j in (*range(per), *range(extra))]
    return ExpertPlacement(tuple(slots), num_ranks, num_experts)


def balanced_placement(loads: Sequence[float], num_ranks: int, num_redundant: int) -> ExpertPlacement:
    """Slots for ``len(loads)`` logical experts over ``num_ranks`` ranks with ``num_redundant`` extra slots,
    minimising (greedily) the most loaded rank's load; deterministic (ties go to the lower id)."""
    n = len(loads)
    slots_total = n + num_redundant
    if n < 1 or num_ranks < 1 or num_redundant < 0 or slots_total % num_ranks:
        raise ValueError(f"placement: {n} experts + {num_redundant} redundant slots must divide by {num_ranks} ranks")
    if any(x < 0 for x in loads):
        raise ValueError("placement: loads must be >= 0")
    per_rank = slots_total // num_ranks
    counts = [1] * n
    for _ in range(num_redundant):
        # A replica on a rank that already holds the expert takes no load off it: prefer experts that still
        # have a rank without a copy.
        open_ = [e for e in range(n) if counts[e] < num_ranks] or list(range(n))
        e = max(open_, key=lambda e: (loads[e] / counts[e], -e))
        counts[e] += 1
    replicas = sorted(((loads[e] / counts[e], e) for e in range(n) for _ in range(counts[e])),
                      key=lambda item: (-item[0], item[1]))
    rank_load = [0.0] * num_ranks
    held: list[list[int]] = [[] for _ in range(num_ranks)]
    for load, e in replicas:
        free = [r for r in range(num_ranks) if len(held[r]) < per_rank]
        apart = [r for r in free if e not in held[r]] or free
        r = min(apart, key=lambda r: (rank_load[r], r))
        rank_load[r] += load
        held[r].append(e)
    return ExpertPlacement(tuple(e for r in range(num_ranks) for e in sorted(held[r])), num_ranks, n)


def keep_in_place(old: ExpertPlacement, new: ExpertPlacement) -> ExpertPlacement:
    """``new``'s experts per rank, ordered within each rank so that a slot already holding one of them keeps
    it (which slot of a rank holds an expert changes nothing else): only the changed slots move weights."""
    if (old.num_ranks, len(old.slots), old.num_experts) != (new.num_ranks, len(new.slots), new.num_experts):
        raise ValueError("placement: old and new placements differ in ranks, slots or experts")
    out: list[int] = []
    for r in range(new.num_ranks):
        want = Counter(new.rank_slots(r))
        mine: list[int | None] = []
        for e in old.rank_slots(r):
            if want[e] > 0:
                want[e] -= 1
                mine.append(e)
            else:
                mine.append(None)
        rest = iter(sorted(want.elements()))
        out.extend(e if e is not None else next(rest) for e in mine)
    return ExpertPlacement(tuple(out), new.num_ranks, new.num_experts)


def rank_loads(loads: Sequence[float], placement: ExpertPlacement) -> list[float]:
    """Each rank's expected load: every replica takes an equal share of its expert's load."""
    share = [loads[e] / len(slots) for e, slots in enumerate(placement.replicas)]
    s = placement.slots_per_rank
    return [sum(share[e] for e in placement.slots[r * s: (r + 1) * s]) for r in range(placement.num_ranks)]


def balancedness(per_rank: Sequence[float]) -> float:
    """Mean over max of the ranks' loads (vLLM's measure): 1.0 is perfectly even; no load counts as even."""
    top = max(per_rank, default=0)
    return 1.0 if top <= 0 else sum(per_rank) / len(per_rank) / top


@dataclass(frozen=True, slots=True)
class Transfer:
    """One slot's weights to copy: from ``src_rank``'s local slot ``src_slot`` to ``dst_rank``'s ``dst_slot``."""

    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int


def transfer_plan(old: ExpertPlacement, new: ExpertPlacement) -> tuple[Transfer, ...]:
    """The copies that turn ``old`` into ``new``: every changed slot takes its expert from a copy on its own
    rank where there is one, else from the lowest slot holding it (every rank computes the same plan)."""
    if (old.num_ranks, len(old.slots)) != (new.num_ranks, len(new.slots)):
        raise ValueError("placement: old and new placements differ in ranks or slots")
    s, holders = new.slots_per_rank, old.replicas
    plan = []
    for slot, (was, e) in enumerate(zip(old.slots, new.slots)):
        if was == e:
            continue
        dst = slot // s
        src = next((h for h in holders[e] if h // s == dst), holders[e][0])
        plan.append(Transfer(src // s, src % s, dst, slot % s))
    return tuple(plan)


def rebalanced(loads: Sequence[float], old: ExpertPlacement, num_redundant: int) -> ExpertPlacement:
    """One layer's next placement from its measured loads: ``old`` itself when nothing was measured, else
    ``balanced_placement`` ordered to keep as many slots in place as it can."""
    if sum(loads) <= 0:
        return old
    return keep_in_place(old, balanced_placement(loads, old.num_ranks, num_redundant))


def layers_balancedness(per_layer: Sequence[Sequence[float]]) -> float:
    """Over several layers (each a list of per-rank loads): the summed per-layer means over the summed
    per-layer maxima (vLLM's aggregate), 1.0 when there is no load."""
    top = sum(max(r, default=0) for r in per_layer)
    return 1.0 if top <= 0 else sum(sum(r) / len(r) for r in per_layer) / top


def slot_rank_loads(slot_loads: Sequence[float], num_ranks: int) -> list[float]:
    """Per-slot measured loads summed per rank (rank r holds slots [r*S, (r+1)*S))."""
    s = len(slot_loads) // num_ranks
    return [float(sum(slot_loads[r * s: (r + 1) * s])) for r in range(num_ranks)]
