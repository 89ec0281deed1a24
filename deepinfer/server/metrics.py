"""Prometheus metrics of one server, in a registry of its own (so several apps can live in one process,
as they do in tests), plus the pure-ASGI middleware that counts requests by endpoint and status.

The bridge observes latencies and token counts as it dispatches outputs (the engine thread, or the event
loop when the engine runs in its own process; ``engine_stats.py``) and publishes the engine's counters after
each step; the middleware observes HTTP statuses. prometheus_client's metric objects are thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Latency buckets for a CPU demo model up to a large model on a busy GPU.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = {"model_name": model_name}
        self.requests = Counter("deepinfer_http_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.ttft = Histogram("deepinfer_time_to_first_token_seconds", "Time from admission to the first token",
                              list(labels), buckets=_TTFT_BUCKETS, registry=r).labels(**labels)
        self.tpot = Histogram("deepinfer_time_per_output_token_seconds",
                              "Mean time between output tokens of a request, after the first",
                              list(labels), buckets=_TPOT_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram("deepinfer_e2e_request_latency_seconds", "Time from admission to the final output",
                             list(labels), buckets=_E2E_BUCKETS, registry=r).labels(**labels)
        self.running = Gauge("deepinfer_num_requests_running", "Requests with sequences in the running set",
                             list(labels), registry=r).labels(**labels)
        self.waiting = Gauge("deepinfer_num_requests_waiting", "Requests with sequences waiting to be scheduled",
                             list(labels), registry=r).labels(**labels)
        self._cache_usage = Gauge("deepinfer_cache_usage_ratio", "Fraction of a KV cache pool's blocks in use",
                                  ["model_name", "pool"], registry=r)
        self._model = model_name
        self.prompt_tokens = Counter("deepinfer_prompt_tokens", "Prompt tokens of finished requests",
                                     list(labels), registry=r).labels(**labels)
        self.generation_tokens = Counter("deepinfer_generation_tokens", "Generated tokens",
                                         list(labels), registry=r).labels(**labels)

        # Speculative decoding, with vLLM's names (prometheus_client adds the ``_total`` suffix).
        self.spec_drafts = Counter("deepinfer:spec_decode_num_drafts", "Verify steps of a sequence with drafts",
                                   list(labels), registry=r).labels(**labels)
        self.spec_draft_tokens = Counter("deepinfer:spec_decode_num_draft_tokens", "Draft tokens verified",
                                         list(labels), registry=r).labels(**labels)
        self.spec_accepted_tokens = Counter("deepinfer:spec_decode_num_accepted_tokens", "Draft tokens accepted",
                                            list(labels), registry=r).labels(**labels)
        self._spec_per_pos = Counter("deepinfer:spec_decode_num_accepted_tokens_per_pos",
                                     "Draft tokens accepted at each draft position", ["model_name", "position"],
                                     registry=r)
        self._spec_seen = (0, 0, 0, ())  # the engine's totals at the last publish

        # Prefix cache (vLLM's names for the first two), in tokens; evictions in blocks per pool.
        self.prefix_queries = Counter("deepinfer:prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      list(labels), registry=r).labels(**labels)
        self.prefix_hits = Counter("deepinfer:prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   list(labels), registry=r).labels(**labels)
        self._evictions = Counter("deepinfer:prefix_cache_evictions", "Cached blocks evicted from a device pool",
                                  ["model_name", "pool"], registry=r)
        self._cached_blocks = Gauge("deepinfer:prefix_cache_blocks", "Unused blocks kept for prefix reuse",
                                    ["model_name", "pool"], registry=r)
        self._prefix_seen: tuple[int, int, dict[str, int]] = (0, 0, {})
        # Cache tiers below the device (host memory, disk), per tier and per rank: monotone counts and the bytes
        # held. Every rank keeps its own store (executor/rank_tiers.py: its own share of the sizes, its own disk
        # directory), so the series carry a ``rank`` label (the global rank; "0" on one device) rather than
        # being summed: a rank whose disk fills or whose objects fail their checksums stays visible, and the
        # totals are one ``sum without (rank) (...)`` away. Per-rank series and sums in one family would count
        # every block twice under ``sum()``.
        self._tier_counters = {
            f: Counter(f"deepinfer:kv_tier_{f}", help_, ["model_name", "tier", "rank"], registry=r)
            for f, help_ in (("queried", "Block lookups that reached the tier"), ("hits", "Blocks found in the tier"),
                             ("hit_tokens", "Token positions of the blocks found"),
                             ("stored", "Blocks written into the tier"),
                             ("evictions", "Blocks pushed out of the tier by its size limit"),
                             ("checksum_failures", "Stored blocks dropped because they failed verification"))}
        self._tier_used = Gauge("deepinfer:kv_tier_used_bytes", "Bytes a cache tier holds",
                                ["model_name", "tier", "rank"], registry=r)
        self._tier_seen: dict[tuple[int, str, str], int] = {}  # (rank, tier, field) -> the last published total
        # How the engine runs (``EngineConfig.mode_labels``): deepinfer:engine_info{batch_invariant="1",...} 1.0
        self._engine_info = Info("deepinfer:engine", "How the engine runs: device, dtype, batch-invariant mode",
                                 list(labels), registry=r).labels(**labels)

    def publish_engine_info(self, labels: dict[str, str]) -> None:
        self._engine_info.info(labels)

    def publish_spec(self, num_drafts: int, num_draft_tokens: int, num_accepted_tokens: int,
                     accepted_per_pos: list[int]) -> None:
        """Bring the counters up to the engine's running totals (it counts; the server exports)."""
        drafts, tokens, accepted, per_pos = self._spec_seen
        self.spec_drafts.inc(num_drafts - drafts)
        self.spec_draft_tokens.inc(num_draft_tokens - tokens)
        self.spec_accepted_tokens.inc(num_accepted_tokens - accepted)
        for i, n in enumerate(accepted_per_pos):
            self._spec_per_pos.labels(model_name=self._model, position=str(i)).inc(n - (per_pos[i] if i < len(per_pos) else 0))
        self._spec_seen = (num_drafts, num_draft_tokens, num_accepted_tokens, tuple(accepted_per_pos))

    def publish_prefix(self, queries: int, hits: int, evictions: dict[str, int], cached: dict[str, int]) -> None:
        """Bring the prefix-cache counters up to the engine's running totals."""
        q, h, ev = self._prefix_seen
        self.prefix_queries.inc(queries - q)
        self.prefix_hits.inc(hits - h)
        for pool, n in evictions.items():
            self._evictions.labels(model_name=self._model, pool=pool).inc(n - ev.get(pool, 0))
        for pool, n in cached.items():
            self._cached_blocks.labels(model_name=self._model, pool=pool).set(n)
        self._prefix_seen = (queries, hits, dict(evictions))

    def publish_tiers(self, stats, rank: int = 0) -> None:
        """Bring rank ``rank``'s per-tier counters up to a ``TierStats`` snapshot of its store."""
        for t in stats.tiers:
            labels = {"model_name": self._model, "tier": t.tier, "rank": str(rank)}
            for f, counter in self._tier_counters.items():
                value = getattr(t, f)
                counter.labels(**labels).inc(value - self._tier_seen.get((rank, t.tier, f), 0))
                self._tier_seen[(rank, t.tier, f)] = value
            self._tier_used.labels(**labels).set(t.used_bytes)

    def publish(self, running: int, waiting: int, cache_usage: dict[str, float]) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        for pool, value in cache_usage.items():
            self._cache_usage.labels(model_name=self._model, pool=pool).set(value)


class RequestCounterMiddleware:
    """Counts every HTTP request by endpoint and final status, errors and streams included.

    Pure ASGI rather than BaseHTTPMiddleware: the latter re-wraps streaming bodies and gets in the way of
    disconnect detection. Unknown paths are counted under "other" so that a scanner cannot blow up the
    label cardinality.
    """

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, endpoints: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self.endpoints else "other"
        status = {"code": 499}  # nothing sent: the client went away first (nginx's "client closed request")

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            status["code"] = 500 if status["code"] == 499 else status["code"]
            raise
        finally:
            self.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()
