"""The messages between the engine (rank 0) and the ranks: frozen, plain data (``sched/plan.py``'s StepPlan
and the runner's StepResult are already that)."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.config.engine import RuntimeFacts
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


@dataclass(frozen=True, slots=True)
class StepDone:
    """A rank's step results (only each DP group's first TP rank reports them; the others send None)."""

    rank: int
    result: StepResult | None


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


MESSAGES = (Ready, RunStep, StepDone, Shutdown)
