"""The messages between the engine (rank 0) and the ranks: frozen, plain data (``sched/plan.py``'s StepPlan
and the runner's StepResult are already that)."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.config.engine import RuntimeFacts
from deepinfer.executor.tier_messages import TIER_MESSAGES, TierWork
from deepinfer.kv.tiers.stats import TierStats
from deepinfer.model.parallel.context import ContextParallelChunk
from deepinfer.model.parallel.placement import ExpertPlacement
from deepinfer.runner.model_runner import StepResult
from deepinfer.sched.plan import StepPlan


@dataclass(frozen=True, slots=True)
class Ready:
    """A rank loaded its share of the model and sized its cache."""

    rank: int
    facts: RuntimeFacts


@dataclass(frozen=True, slots=True)
class RunStep:
    """One engine step: each DP rank's plan (an empty plan still carries departures). ``busy``: some DP rank
    has work, so ranks without any run an empty step to join the MoE collectives."""

    plans: tuple[StepPlan, ...]
    busy: bool
    # Per DP rank, cache blocks (pool, source, destination) to copy before the step: a prefix hit's bounded
    # replay rewrites its private copy of a cached block.
    copies: tuple[tuple[tuple[str, int, int], ...], ...] = ()
    # Context parallelism: at most one prefill chunk per CP group, split over the group's DP ranks.
    context_parallel: tuple[ContextParallelChunk, ...] = ()
    # Speculative decoding: the most MTP passes any DP rank runs this step (``runner.speculative.mtp_passes``);
    # a rank with fewer runs the rest without tokens, for the MTP layer's expert-parallel collectives.
    mtp_passes: int = 0
    # Async scheduling: this step stays in flight on the ranks, which reply with the results of the step before
    # it (an empty result where there was none); its own are read once the next step is submitted.
    in_flight: bool = False
    # Cache tiers (tier_messages.py): per DP rank, the blocks to save and load before the step.
    tiers: tuple[TierWork, ...] = ()


@dataclass(frozen=True, slots=True)
class StepDone:
    """A rank's step results (only each DP group's first TP rank reports them; the others send None).
    ``tiers``: the rank's cache-tier counters after the step when they changed since its last report (None:
    unchanged, or no tiers); carried here so that /metrics sees every rank's store without an order of its own."""

    rank: int
    result: StepResult | None
    tiers: TierStats | None = None


@dataclass(frozen=True, slots=True)
class CollectExpertLoad:
    """Between steps: every rank reports its expert load counters (expert-parallel load balancing)."""


@dataclass(frozen=True, slots=True)
class ClearExpertLoad:
    """Between steps: every rank reports its expert load counters, then zeroes them (after the start-up
    warm-up, whose prompts are not traffic the placement should follow)."""


@dataclass(frozen=True, slots=True)
class ExpertLoad:
    """A rank's counts, per MoE layer: (token, expert) pairs per logical expert over the window, and pairs
    sent to each physical slot since the placement was last set."""

    rank: int
    window: tuple[tuple[int, ...], ...]
    slots: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class MoveExperts:
    """Between steps: every rank moves expert weights to these placements (one per MoE layer) and routes
    by them from the next step on."""

    placements: tuple[ExpertPlacement, ...]


@dataclass(frozen=True, slots=True)
class ExpertsMoved:
    rank: int


@dataclass(frozen=True, slots=True)
class CollectContextHistory:
    """Between steps: every rank reports what it holds of sequences' history for context parallelism."""


@dataclass(frozen=True, slots=True)
class ContextHistory:
    """A rank's history replicas (``model/parallel/context_history.py``): the sequences, the bytes of rows held,
    and its counters (chunks that started from a replica, catch-ups, replicas dropped as their sequence left)."""

    rank: int
    seq_ids: tuple[str, ...]
    nbytes: int
    chunks_from_replica: int
    catch_ups: int
    dropped_on_leave: int


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


MESSAGES = (Ready, RunStep, StepDone, CollectExpertLoad, ClearExpertLoad, ExpertLoad, MoveExperts, ExpertsMoved, CollectContextHistory,
            ContextHistory, Shutdown)
MESSAGES += TIER_MESSAGES  # the cache tiers' orders and replies (tier_messages.py)
