"""The server's side of the engine core process (``engine_process.py``): the same bridge interface as the
in-process ``AsyncEngine`` (submit, abort, call, drain, shutdown, alive), over one pipe.

The split: this (HTTP) process parses and validates requests, tokenizes and renders prompts (it has its own
``Tokenizer`` and the engine's ``EngineConfig``), builds and streams the responses, and keeps /metrics;
the engine process schedules, runs the model, samples, detokenizes and checks stops (as ``LLMEngine``
always has), and sends each step's outputs as one message.

Two threads of this process touch the pipe, neither runs on the event loop:
  * the writer sends what ``_send`` queued (a ``SimpleQueue``, whose ``put`` is safe even from the signal
    handler that starts a graceful shutdown), so the loop never blocks on a full pipe;
  * the reader receives and decodes; a step's outputs reach the loop with ONE ``call_soon_threadsafe``
    (``_dispatch``: rebuild each ``RequestOutput`` from its delta, observe latencies, feed the streams,
    publish the engine's counters). Answers to ``call_sync`` are settled right on the reader thread.
When the pipe ends without ``CoreClosed`` the engine died: every open request fails with ``EngineClosed``
(the routes answer 503, or end a stream with an error event), new ones are refused, /health says 503,
and the ``on_death`` callbacks run (``serve`` stops the server, which exits 1).
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait as wait_for
from typing import Any

from deepinfer.config.engine import EngineConfig
from deepinfer.executor.codec import decode, encode
from deepinfer.server.async_engine import AsyncEngine, EngineClosed, RequestStream
from deepinfer.server.commands import EngineRequest, Reply
from deepinfer.server.core_messages import (MESSAGES, Abort, Answer, CallEngine, CoreClosed, CoreDied, CoreFailed,
                                            CoreReady, Drain, Shutdown, StepOutputs, Submit)
from deepinfer.server.engine_process import run_engine_core
from deepinfer.server.engine_stats import EngineStats, RequestTiming, observe, publish
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.output_wire import OutputAssembler
from deepinfer.server.stat_log import StatLog
from deepinfer.tokenizer import Tokenizer

log = logging.getLogger("deepinfer.server")


def serves_here(config: EngineConfig) -> bool:
    """Whether this process is the world's rank 0 (the one that serves); a follower node or a torchrun rank
    other than 0 only runs its ranks, in-process (``LLMEngine.from_config`` never returns there)."""
    from deepinfer.distributed.world import WorldEnv, launched_by_torchrun

    if config.launch.node_rank != 0:
        return False
    return not (launched_by_torchrun() and WorldEnv.from_env().rank != 0)


class EngineClient:
    """``launch`` starts the engine process and returns once its engine is built; ``build_app`` takes it in
    place of an ``LLMEngine``."""

    def __init__(self, config: EngineConfig, process, conn) -> None:
        self.config = config
        self.tokenizer = Tokenizer(config.tokenizer_dir)
        self.process, self._conn = process, conn
        self.metrics: ServerMetrics | None = None  # set by the app's ServerState
        self.stats = EngineStats()
        self.stat_log: StatLog | None = None  # the periodic log line (set by the app's ServerState)
        self.error: BaseException | None = None  # why the engine is gone (shutdown or death)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # the event loop only
        self._assembler = OutputAssembler()  # the event loop only
        self._lock = threading.Lock()  # guards _pending, error, _stopping
        self._pending: dict[int, Reply] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._death: list[Callable[[], None]] = []
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write, name="deepinfer-engine-writer", daemon=True)
        self._reader = threading.Thread(target=self._read, name="deepinfer-engine-reader", daemon=True)
        self._writer.start()
        self._reader.start()
        atexit.register(self._at_exit)  # runs before multiprocessing joins the (non-daemon) engine process

    @classmethod
    def launch(cls, config: EngineConfig, log_level: str | None = None) -> "EngineClient":
        """Start the engine process for ``config`` and wait until its engine is built. Raises what building
        it raised (a ValueError keeps its message naming the field) or RuntimeError when the process died.
        ``log_level``: the engine process's own log lines go to stderr at this level (None: not at all)."""
        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA state, no server threads
        conn, child = ctx.Pipe(duplex=True)
        # Not a daemon: the parallel engine starts its rank processes from there.
        process = ctx.Process(target=run_engine_core, args=(config, child, log_level), name="deepinfer-engine-core")
        process.start()
        child.close()
        first = None
        try:
            wait_for([conn, process.sentinel])
            first = decode(conn.recv_bytes(), MESSAGES)
        except (EOFError, OSError):
            pass
        if not isinstance(first, CoreReady):
            process.join(30)
            conn.close()
            if isinstance(first, CoreFailed):
                raise first.error.rebuild()
            raise RuntimeError(f"the engine process exited with code {process.exitcode} while starting")
        return cls(config, process, conn)

    # ---- lifecycle (AsyncEngine's interface) ---------------------------------------------------------
    def start(self) -> None:
        """Called on the server's event loop (the lifespan): outputs are delivered there."""
        self._loop = asyncio.get_running_loop()

    @property
    def alive(self) -> bool:
        return self.error is None and not self._stopping and self.process.is_alive()

    def on_death(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (from any thread) if the engine dies; not at a requested shutdown."""
        self._death.append(callback)

    def drain(self, grace: float) -> None:
        """``AsyncEngine.drain``: called from a signal handler, so it only queues a message."""
        self._send(Drain(grace), strict=False)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what runs, close the engine (cache tiers persisted) and wait for its process to exit."""
        with self._lock:
            self._stopping = True
        self._send(Shutdown(), strict=False)
        self.process.join(timeout)
        if self.process.is_alive():
            log.error("the engine process did not stop in %.0f s; killing it", timeout)
            self.process.kill()
            self.process.join(10)
        self._reader.join(timeout)
        self._outbox.put(None)
        self._writer.join(timeout)
        self._conn.close()

    def _at_exit(self) -> None:
        if self.process.is_alive():
            self.shutdown(timeout=30.0)

    # ---- the HTTP side -------------------------------------------------------------------------------
    async def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """As ``AsyncEngine.submit``: all admitted or none (the engine's ValueError), EngineClosed when gone."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            raise RuntimeError("EngineClient.submit: call it on the server's event loop (the one that started it)")
        stream = RequestStream(self, loop)
        ids = [r.request_id for r in requests]
        fut: asyncio.Future[None] = loop.create_future()

        def settle(value: Any, exc: BaseException | None) -> None:  # on the loop
            if exc is not None:
                for rid in ids:
                    if self._streams.get(rid) is stream:
                        del self._streams[rid]
            if not fut.done():  # else cancelled by the HTTP side meanwhile
                fut.set_exception(exc) if exc is not None else fut.set_result(value)

        # Registered before sending: an admitted request's outputs follow its answer on the pipe.
        now = time.monotonic()
        for rid in ids:
            self._streams[rid] = stream
            stream.timing[rid] = RequestTiming(now)
        try:
            call_id = self._register(lambda value, exc: self._on_loop(settle, value, exc))
        except EngineClosed:
            for rid in ids:
                self._streams.pop(rid, None)
            raise
        # Not strict: should the engine die from here on, its end fails the registered answer (and so fut).
        self._send(Submit(call_id, tuple(requests)), strict=False)
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(ids)  # the client left: aborts follow the submit on the pipe, so nothing leaks
            raise
        stream.request_ids = ids
        stream.unfinished = set(ids)
        return stream

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(Abort(tuple(request_ids)), strict=False)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(engine, *args)`` in the engine process between steps (``engine_queries.py``)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._call(fn, args, AsyncEngine._resolver(loop, fut))
        return await fut

    def call_sync(self, fn: Callable[..., Any], *args: Any, timeout: float = 30.0) -> Any:
        """``call`` for plain threads (tests, tools): blocks until the engine answered."""
        box: dict[str, Any] = {}
        ready = threading.Event()

        def done(value: Any, exc: BaseException | None) -> None:
            box["value"], box["exc"] = value, exc
            ready.set()

        self._call(fn, args, done)
        if not ready.wait(timeout):
            raise TimeoutError("the engine process did not answer in time")
        if box["exc"] is not None:
            raise box["exc"]
        return box["value"]

    def _call(self, fn: Callable[..., Any], args: tuple, reply: Reply) -> None:
        module = getattr(fn, "__module__", None) or ""
        if not (module == "deepinfer" or module.startswith("deepinfer.")) or "<" in getattr(fn, "__qualname__", "<"):
            raise TypeError(f"call: {fn!r} cannot cross to the engine process; pass a module-level function of "
                            "deepinfer (e.g. deepinfer.server.engine_queries)")
        self._send(CallEngine(self._register(reply), fn, tuple(args)))

    def _register(self, reply: Reply) -> int:
        with self._lock:
            if self.error is not None or self._stopping:
                raise EngineClosed("the engine is not running") from self.error
            call_id = next(self._ids)
            self._pending[call_id] = reply
            return call_id

    def _send(self, message, strict: bool = True) -> None:
        if strict and (self.error is not None or self._stopping):
            raise EngineClosed("the engine is not running") from self.error
        self._outbox.put(encode(message, MESSAGES))

    def _on_loop(self, fn: Callable, *args: Any) -> None:
        if self._loop is None:
            fn(*args)
            return
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    # ---- the pipe threads ----------------------------------------------------------------------------
    def _write(self) -> None:
        while (data := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError:  # the engine process is gone; the reader reports it
                return

    def _read(self) -> None:
        died = None
        try:
            while True:
                message = decode(self._conn.recv_bytes(), MESSAGES)
                if isinstance(message, StepOutputs):
                    self._on_loop(self._dispatch, message)
                elif isinstance(message, Answer):
                    with self._lock:
                        reply = self._pending.pop(message.call_id, None)
                    if reply is not None:
                        reply(message.value, None if message.error is None else message.error.rebuild())
                elif isinstance(message, CoreDied):
                    died = message.error
                elif isinstance(message, CoreClosed):
                    break
        except (EOFError, OSError):
            pass
        except BaseException as e:  # a message this side cannot read: treat the engine as lost
            log.exception("engine pipe failed")
            died = died or e
        self._ended(died)

    def _ended(self, died) -> None:
        """The pipe ended: a requested shutdown, or the engine's death."""
        requested = self._stopping
        if requested:
            error: BaseException = EngineClosed("the server is shutting down")
        else:
            self.process.join(5)
            why = f"{died.kind}: {died.message}" if hasattr(died, "kind") else \
                f"{type(died).__name__}: {died}" if died is not None else f"exit code {self.process.exitcode}"
            error = EngineClosed(f"the engine process died ({why})")
            log.error("%s", error)
        with self._lock:
            self.error = error
            pending, self._pending = list(self._pending.values()), {}
        for reply in pending:
            reply(None, error)
        self._on_loop(self._fail_streams, error)
        if not requested:
            for callback in self._death:
                callback()

    # ---- on the event loop ---------------------------------------------------------------------------
    def _dispatch(self, message: StepOutputs) -> None:
        now = time.monotonic()
        outs = [self._assembler.assemble(delta) for delta in message.outputs]
        for out in outs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            timing = stream.timing.pop(out.request_id) if out.finished else stream.timing[out.request_id]
            if self.metrics is not None:
                observe(self.metrics, timing, out, now)
            stream.queue.put_nowait(out)
        self.stats = message.stats
        if self.metrics is not None:
            publish(self.metrics, message.stats)
        if self.stat_log is not None:
            self.stat_log.step(outs, message.stats, now)

    def _fail_streams(self, error: BaseException) -> None:
        for stream in set(self._streams.values()):
            stream.queue.put_nowait(error)
        self._streams.clear()
