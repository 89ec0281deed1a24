"""What /metrics shows of the engine, in one place for both ways of running it (a thread of the server,
or its own process): the engine-side counters as one frozen snapshot taken after a step, and the
per-request latencies observed as outputs reach the server.

The snapshot is plain data, so the engine core process sends it with each step's outputs and the server
publishes it exactly as the in-process bridge publishes its own; the counters are the engine's running
totals (``ServerMetrics.publish_*`` turn them into Prometheus increments).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.engine.outputs import RequestOutput
from deepinfer.kv.tiers.stats import TierStats

if TYPE_CHECKING:  # the engine process builds snapshots without the HTTP side's prometheus_client
    from deepinfer.server.metrics import ServerMetrics


@dataclass(frozen=True, slots=True)
class PrefixCounts:
    queries: int  # prompt tokens looked up
    hits: int  # prompt tokens found
    evictions: dict[str, int]  # per pool, blocks
    cached: dict[str, int]  # per pool, unused blocks kept for reuse


@dataclass(frozen=True, slots=True)
class SpecCounts:
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine after a step; read by /metrics (and tests)."""

    running: int = 0  # requests with a sequence in the running set
    waiting: int = 0
    cache_usage: dict[str, float] = field(default_factory=dict)
    prefix: PrefixCounts | None = None  # None: prefix caching is off
    # Cache tiers, per rank that has reported its store's counters (one process: rank 0 alone); {}: none.
    tiers: dict[int, TierStats] = field(default_factory=dict)
    spec: SpecCounts | None = None  # None: no speculative decoding


_request_of = operator.attrgetter("request")


def snapshot(engine) -> EngineStats:
    """``engine``'s counters now (an ``LLMEngine``, or the parallel one: every DP rank's scheduler and cache,
    summed, and every rank's cache tiers as their last step's results carried them: ``executor/rank_tiers.py``).
    Cache usage is per pool the share of all DP ranks' blocks in use."""
    ranks = getattr(engine, "schedulers", None)  # the parallel engine's DP ranks
    schedulers = ranks if ranks else [engine.scheduler]
    caches = [s.cache for s in ranks] if ranks else [engine.cache]
    prefix = spec = None
    tiers: dict[int, TierStats] = {}
    if getattr(schedulers[0], "prefix", None) is not None:
        prefix = PrefixCounts(sum(s.prefix_queries for s in schedulers), sum(s.prefix_hits for s in schedulers),
                              {p: sum(c.pools[p].num_evictions for c in caches) for p in caches[0].pools},
                              {p: sum(c.pools[p].num_cached for c in caches) for p in caches[0].pools})
    per_rank = getattr(engine, "rank_tier_stats", None)
    if per_rank is not None:
        tiers = {r: t for r, t in enumerate(per_rank) if t is not None}
    elif getattr(engine, "tiers", None) is not None:
        tiers = {0: engine.tiers.store.stats()}
    s = getattr(engine, "spec_stats", None)
    if s is not None and s.num_speculative_tokens:
        spec = SpecCounts(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, tuple(s.accepted_per_pos))
    if len(caches) == 1:
        usage = dict(caches[0].usage())
    else:
        blocks = {p: sum(c.pools[p].num_blocks for c in caches) for p in caches[0].pools}
        usage = {p: sum(c.pools[p].num_used for c in caches) / n if n else 0.0 for p, n in blocks.items()}
    return EngineStats(
        # Distinct request objects (identity-hashed, one per live request id), gathered in C: read every step.
        running=sum(len(set(map(_request_of, s.running))) for s in schedulers),
        waiting=sum(len(set(map(_request_of, s.waiting))) for s in schedulers),
        cache_usage=usage, prefix=prefix, tiers=tiers, spec=spec)


def publish(metrics: ServerMetrics, stats: EngineStats) -> None:
    metrics.publish(stats.running, stats.waiting, stats.cache_usage)
    if stats.prefix is not None:
        p = stats.prefix
        metrics.publish_prefix(p.queries, p.hits, p.evictions, p.cached)
    for rank, tiers in stats.tiers.items():
        metrics.publish_tiers(tiers, rank)
    if stats.spec is not None:
        s = stats.spec
        metrics.publish_spec(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_pos))


@dataclass
class RequestTiming:
    arrival: float
    first_token: float | None = None


def observe(metrics: ServerMetrics, timing: RequestTiming, out: RequestOutput, now: float) -> None:
    """Token counts and latencies of one output of a request admitted at ``timing.arrival``."""
    new_tokens = sum(len(d) for d in out.delta_token_ids)
    metrics.generation_tokens.inc(new_tokens)
    if timing.first_token is None and new_tokens:
        timing.first_token = now
        metrics.ttft.observe(now - timing.arrival)
    if out.finished:
        metrics.prompt_tokens.inc(len(out.prompt_token_ids))
        metrics.e2e.observe(now - timing.arrival)
        produced = max((len(c.token_ids) for c in out.outputs), default=0)
        if timing.first_token is not None and produced > 1:
            metrics.tpot.observe((now - timing.first_token) / (produced - 1))
