"""The router's HTTP side: ``/v1/completions`` and ``/v1/chat/completions`` proxied to the replica the policy
picks, the response streamed through as it comes; ``/v1/models`` from a healthy replica; ``/health`` (200 while
any replica is healthy); ``/metrics`` (Prometheus: requests per replica and why it was picked, retries, the
prompt tokens the picked replica was known to hold, replicas' health and requests in flight).

Retries happen only before the response's first byte: a replica that refuses the connection or answers 5xx
(and is not the last one left) is charged a failure and the request goes to another; once bytes flow they
are the client's. The client's ``Authorization`` header goes to the replica (replicas check their own keys).
A client that disconnects closes the replica's response, which aborts the request there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from deepinfer.config.router import RouterConfig
from deepinfer.router.keys import SESSION_HEADER, PromptKeys
from deepinfer.router.policies import make_policy
from deepinfer.router.workers import Worker, Workers
from deepinfer.server.errors import error_body
from deepinfer.tokenizer import Tokenizer

log = logging.getLogger("deepinfer.router")
FORWARDED = ("authorization", "content-type", "x-request-id", SESSION_HEADER)
RETURNED = ("content-type", "x-request-id")


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("deepinfer_router_requests", "Requests sent to a replica, by why it was picked",
                                ["worker", "reason"], registry=r)
        self.retries = Counter("deepinfer_router_retries", "Requests moved on after a replica failed before its "
                               "first byte", ["worker"], registry=r)
        self.prompt_tokens = Counter("deepinfer_router_prompt_tokens", "Prompt tokens of routed requests "
                                     "(those the router could key)", registry=r)
        self.matched_tokens = Counter("deepinfer_router_matched_tokens", "Prompt tokens the picked replica was "
                                      "known to hold (whole blocks of earlier prompts routed there)", registry=r)
        self.healthy = Gauge("deepinfer_router_worker_healthy", "1 while a replica takes requests", ["worker"],
                             registry=r)
        self.in_flight = Gauge("deepinfer_router_requests_in_flight", "Requests in flight per replica", ["worker"],
                               registry=r)

    def publish(self, workers: Workers) -> None:
        for w in workers.all:
            self.healthy.labels(w.url).set(int(w.healthy))
            self.in_flight.labels(w.url).set(w.outstanding)


class Router:
    def __init__(self, config: RouterConfig, tokenizer: Tokenizer,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.config = config
        self.workers = Workers(config.worker_urls, config.max_tree_size)
        self.policy = make_policy(config)
        self.keys = PromptKeys(tokenizer, config.block_size)
        self.metrics = RouterMetrics()
        timeout = httpx.Timeout(config.request_timeout_secs, connect=10.0)
        self.client = httpx.AsyncClient(timeout=timeout, transport=transport)
        self._health: asyncio.Task | None = None

    async def check_health(self) -> None:
        """One round of health checks, every replica at once."""
        async def one(w: Worker) -> None:
            try:
                ok = (await self.client.get(f"{w.url}/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok != w.healthy:
                log.warning("replica %s is %s", w.url, "back" if ok else "out (health check failed)")
            w.checked(ok)

        await asyncio.gather(*(one(w) for w in self.workers.all))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_check_interval_secs)
            await self.check_health()

    async def start(self) -> None:
        await self.check_health()
        self._health = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health is not None:
            self._health.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health
        await self.client.aclose()

    async def route(self, request: Request, path: str) -> Response:
        body = await request.body()
        key = await asyncio.to_thread(self.keys.of, path, body, request.headers)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        tried: set[Worker] = set()
        while True:
            candidates = self.workers.healthy(exclude=tried)
            if not candidates:
                return JSONResponse(error_body("no replica is available (all failed or are out)",
                                               type="server_error", code="no_replica"), status_code=503)
            choice = self.policy.choose(candidates, key)
            w = choice.worker
            w.outstanding += 1
            try:
                upstream = await self.client.send(self.client.build_request("POST", f"{w.url}{path}", content=body,
                                                                            headers=headers), stream=True)
            except httpx.TransportError as e:
                upstream = None
                log.warning("replica %s failed before its first byte (%s): trying another", w.url, e)
            if upstream is not None and upstream.status_code >= 500 and len(candidates) > 1:
                await upstream.aclose()
                log.warning("replica %s answered %d: trying another", w.url, upstream.status_code)
                upstream = None
            if upstream is None:
                w.outstanding -= 1
                w.failed(self.config.max_failures)
                self.metrics.retries.labels(w.url).inc()
                tried.add(w)
                continue
            break
        if upstream.status_code >= 500:
            w.failed(self.config.max_failures)
        else:
            w.succeeded()
        self.policy.routed(choice, key)
        w.routed += 1
        self.metrics.requests.labels(w.url, choice.reason).inc()
        if key.tokens:
            self.metrics.prompt_tokens.inc(key.tokens)
            self.metrics.matched_tokens.inc(min(choice.matched_blocks * self.config.block_size, key.tokens))

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # done, or the client went away: closing the replica's response aborts the request there
                await upstream.aclose()
                w.outstanding -= 1

        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() in RETURNED}
        return StreamingResponse(relay(), status_code=upstream.status_code, headers=out_headers)

    async def models(self, request: Request) -> Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARDED}
        for w in self.workers.healthy():
            try:
                r = await self.client.get(f"{w.url}/v1/models", headers=headers, timeout=10.0)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code, media_type=r.headers.get("content-type"))
        return JSONResponse(error_body("no replica is available", type="server_error", code="no_replica"),
                            status_code=503)


def build_router_app(config: RouterConfig, tokenizer: Tokenizer,
                     transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    router = Router(config, tokenizer, transport)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="deepinfer router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.route(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.route(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.models(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        n = len(router.workers.healthy())
        if n:
            return JSONResponse({"status": "ok", "healthy_replicas": n})
        return JSONResponse(error_body("no healthy replica", type="server_error"), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        router.metrics.publish(router.workers)
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
