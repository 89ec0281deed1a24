"""Prometheus metrics of one server, in a registry of its own (so several apps can live in one process,
as they do in tests), plus the pure-ASGI middleware that counts requests by endpoint and status.

The engine thread observes latencies and token counts as it dispatches outputs (it is the one place that
sees every token as it is produced); the middleware observes HTTP statuses. prometheus_client's metric
objects are thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
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
