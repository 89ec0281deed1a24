"""The OpenAI-compatible HTTP app: routes, authentication, streaming, disconnects, lifespan.

    app = build_app(EngineClient.launch(EngineConfig.create(args)), api_key="sk-...")  # engine process
    app = build_app(LLMEngine.from_engine_args(...), api_key="sk-...")  # engine thread
    uvicorn.run(app, host="127.0.0.1", port=8000)

Each route reads and validates the body (size limit, strict types), turns it into engine requests, submits
them to the engine (its own process through :class:`EngineClient`, the default of ``deepinfer serve``, or a
thread of this one through :class:`AsyncEngine`), and then either streams server-sent events or
waits for the final outputs. Whatever way a request ends (done, client gone, error, shutdown) its engine
requests are closed in a ``finally``, which aborts the unfinished ones and frees their cache blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from deepinfer.assets import demo_model_dir
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.outputs import RequestOutput
from deepinfer.server.async_engine import AsyncEngine, EngineClosed, RequestStream
from deepinfer.server.commands import EngineRequest
from deepinfer.server.engine_client import EngineClient
from deepinfer.server.completions import CompletionBuilder
from deepinfer.server.errors import (ApiError, api_error_handler, bad_request, error_body, http_error_handler,
                                     internal_error_handler, not_found_model, parse_body, read_body)
from deepinfer.server.metrics import RequestCounterMiddleware, ServerMetrics
from deepinfer.server.prompts import check_context, render_chat, resolve_completion_prompts
from deepinfer.server.protocol import ChatBuilder, ChatCompletionRequest, CompletionRequest
from deepinfer.server.stat_log import LOG_STATS_INTERVAL_S, StatLog

DEFAULT_MAX_REQUEST_BYTES = 1 << 20
DEMO_MODEL_NAME = "deepinfer-demo"
ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"})
_DONE = "data: [DONE]\n\n"
T = TypeVar("T")


def default_model_name(engine: LLMEngine | EngineClient) -> str:
    """The model directory's basename; the bundled demo model is "deepinfer-demo"."""
    path = Path(engine.config.model_dir).resolve()
    return DEMO_MODEL_NAME if path == demo_model_dir().resolve() else path.name


class ServerState:
    """Everything the routes share; ``app.state.server`` (tests reach the engine through it)."""

    def __init__(self, engine: LLMEngine | EngineClient, model_name: str, api_key: str | None,
                 max_request_bytes: int, log_stats_interval: float | None = LOG_STATS_INTERVAL_S) -> None:
        self.metrics = ServerMetrics(model_name)
        self.metrics.publish_engine_info(engine.config.mode_labels())
        self.bridge: AsyncEngine | EngineClient
        if isinstance(engine, EngineClient):
            engine.metrics = self.metrics
            self.bridge = engine
        else:
            self.bridge = AsyncEngine(engine, self.metrics)
        self.bridge.stat_log = StatLog(log_stats_interval) if log_stats_interval is not None else None
        self.config, self.tokenizer = engine.config, engine.tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.created = int(time.time())

    def check_auth(self, request: Request) -> None:
        if self.api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "Missing API key: send 'Authorization: Bearer <key>'.", code="invalid_api_key")
        # Constant-time comparison: the key must not leak through response timing.
        if not hmac.compare_digest(token.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise not_found_model(model)

    async def body(self, request: Request) -> bytes:
        self.check_auth(request)  # before reading: an unauthenticated client does not get to upload
        return await read_body(request, self.max_request_bytes)

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    async def submit(self, requests: list[EngineRequest], renames: dict[str, str]) -> RequestStream:
        try:
            return await self.bridge.submit(requests)
        except ValueError as e:
            raise bad_request(e, {"seq_seed": "seed", **renames}) from None
        except EngineClosed as e:
            raise ApiError(503, str(e), type="server_error", code="engine_unavailable") from None


class EventStream(StreamingResponse):
    """Server-sent events for one RequestStream. Starlette cancels the body iterator when it sees the client
    disconnect, which runs the iterator's ``finally``; but a disconnect seen before the first chunk cancels
    the response before the iterator ever started (so its ``finally`` never runs), and a failed send leaves
    it suspended until garbage collection. Closing the request stream here covers every exit."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(body, headers={"Cache-Control": "no-cache"})
        self.request_stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.request_stream.close()  # synchronous and idempotent: safe under cancellation
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


# One encoder for every event: ``json.dumps`` with non-default options builds a new JSONEncoder per call
# (about a fifth of the cost of encoding a one-token chunk). Same options, same bytes.
_EVENT_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {_EVENT_JSON.encode(obj)}\n\n"


def _salted(prompt: dict, cache_salt: str | None) -> dict:
    """The engine prompt with the request's prefix-cache tenancy salt, when it has one."""
    return prompt if cache_salt is None else {**prompt, "cache_salt": cache_salt}


async def _events(stream: RequestStream, chunks: Callable[[RequestOutput], list[dict]],
                  usage_chunk: Callable[[list[RequestOutput]], dict] | None) -> AsyncIterator[str]:
    finals: list[RequestOutput] = []
    try:
        async for out in stream:
            for chunk in chunks(out):
                yield _sse(chunk)
            if out.finished:
                finals.append(out)
        if usage_chunk is not None:
            yield _sse(usage_chunk(finals))
    except EngineClosed as e:  # shutdown or an engine failure mid-stream: say so, then end the stream cleanly
        yield _sse(error_body(str(e), type="server_error", code="engine_unavailable"))
    finally:
        stream.close()
    yield _DONE


async def _disconnected(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work`` unless the client disconnects first (then cancel it and return None)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        return None
    finally:
        for t in (task, watcher):
            t.cancel()


async def _finals(request: Request, stream: RequestStream) -> list[RequestOutput] | None:
    """The final output of each engine request of a non-streaming call, in submission order."""

    async def gather() -> list[RequestOutput]:
        finals = {}
        async for out in stream:
            if out.finished:
                finals[out.request_id] = out
        return [finals[rid] for rid in stream.request_ids]

    try:
        return await _unless_disconnected(request, gather())
    except EngineClosed as e:
        raise ApiError(503, str(e), type="server_error", code="engine_unavailable") from None
    finally:
        stream.close()  # client gone (or any error): abort and free the cache now


def build_app(engine: LLMEngine | EngineClient, *, served_model_name: str | None = None, api_key: str | None = None,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              log_stats_interval: float | None = LOG_STATS_INTERVAL_S) -> FastAPI:
    """``log_stats_interval``: seconds between the periodic stats lines in the log (``server/stat_log.py``);
    None writes none (``--disable-log-stats``)."""
    state = ServerState(engine, served_model_name or default_model_name(engine), api_key or None,
                        max_request_bytes, log_stats_interval)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.bridge.start()
        try:
            yield
        finally:
            # uvicorn gets here after it stopped accepting and in-flight requests ended (or its graceful
            # timeout cancelled them); whatever is left in the engine is aborted.
            await asyncio.to_thread(state.bridge.shutdown)

    app = FastAPI(title="deepinfer", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.server = state
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    app.add_exception_handler(Exception, internal_error_handler)
    app.add_middleware(RequestCounterMiddleware, metrics=state.metrics, endpoints=ENDPOINTS)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = parse_body(CompletionRequest, await state.body(request))
        state.check_model(req.model)
        raw, params = req.prompts(), req.sampling_params()
        # Tokenizing (and, for echo, decoding) long prompts is CPU work: keep it off the event loop.
        prompts = await asyncio.to_thread(
            resolve_completion_prompts, raw, state.tokenizer, state.config.model.vocab_size, echo=req.echo,
            token_strings=req.echo and req.logprobs is not None, skip_special_tokens=req.skip_special_tokens)
        check_context([p.num_tokens for p in prompts], [p.field for p in prompts], req.max_tokens,
                      state.max_model_len, max_tokens_param="max_tokens")
        echoes = [p.echo for p in prompts] if req.echo else None
        b = CompletionBuilder(f"cmpl-{uuid.uuid4().hex}", state.model_name, req.n, req.logprobs, echoes,
                              req.prompt_only)
        engine_requests = [EngineRequest(b.engine_id(k), _salted(p.engine_prompt, req.cache_salt), params)
                           for k, p in enumerate(prompts)]
        stream = await state.submit(engine_requests, {"prompt_token_ids": "prompt"})
        if req.stream:
            return EventStream(_events(stream, b.chunks, b.usage_chunk if req.include_usage else None), stream)
        finals = await _finals(request, stream)
        return Response(status_code=499) if finals is None else JSONResponse(b.response(finals))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, await state.body(request))
        state.check_model(req.model)
        thinking, params = req.thinking(), req.sampling_params()
        try:  # rendering and tokenizing a long conversation is CPU work: keep it off the event loop
            prompt = await asyncio.to_thread(render_chat, req, state.tokenizer, thinking)
        except ValueError as e:
            raise bad_request(e) from None
        limit, limit_name = req.completion_limit()
        check_context([len(prompt["prompt_token_ids"])], ["messages"], limit, state.max_model_len,
                      max_tokens_param=limit_name, what="the rendered conversation")
        top = (req.top_logprobs or 0) if req.logprobs else None
        b = ChatBuilder(f"chatcmpl-{uuid.uuid4().hex}", state.model_name, req.n, thinking, top)
        stream = await state.submit([EngineRequest(b.id, _salted(prompt, req.cache_salt), params)],
                                    {"prompt": "messages", "prompt_token_ids": "messages", **req.constraint_renames()})
        if req.stream:
            return EventStream(_events(stream, b.chunks, b.usage_chunk if req.include_usage else None), stream)
        finals = await _finals(request, stream)
        return Response(status_code=499) if finals is None else JSONResponse(b.response(finals[0]))

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        state.check_auth(request)
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "deepinfer",
                "max_model_len": state.max_model_len}
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/health")
    async def health() -> JSONResponse:
        if state.bridge.alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse(error_body("engine is not running", type="server_error"), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def serve(app: FastAPI, *, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          graceful_timeout: float = 30.0) -> int:
    """Run ``app`` under uvicorn until SIGINT/SIGTERM, then shut down gracefully and return 0.

    On the signal uvicorn stops accepting connections and waits for the open ones; meanwhile the engine lets
    in-flight requests run for ``graceful_timeout`` seconds and then aborts them, so every client gets a
    final response. The lifespan shutdown then stops the engine. If the engine dies, its clients get errors,
    the server stops the same way and this returns 1 (a supervisor restarts it).
    """
    import signal

    import uvicorn

    bridge = app.state.server.bridge

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            bridge.drain(graceful_timeout)
            super().handle_exit(sig, frame)

    # uvicorn re-raises the signal once it has shut down, under the handlers that were installed before it
    # started; with these no-ops that re-raise ends nothing, run() returns and the process exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    # uvicorn's own graceful timeout is only the backstop for a request that ignores the abort.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=graceful_timeout + 10)
    server = _Server(config)
    died = threading.Event()

    def stop() -> None:  # any thread: uvicorn polls should_exit
        died.set()
        server.should_exit = True

    bridge.on_death(stop)
    server.run()
    return 1 if died.is_set() else 0
