"""The bridge between the asyncio HTTP loop and the (synchronous, not thread-safe) ``LLMEngine`` in a thread
of the server process (``deepinfer serve --no-engine-process``; by default the engine runs in its own
process behind ``engine_client.EngineClient``, which keeps this interface).

One engine thread owns the engine. Everything else talks to it through a command queue:

    HTTP coroutine --Submit/Abort/Call--> command deque (under a Condition) --> engine thread
    engine thread --a step's RequestOutputs--> loop.call_soon_threadsafe(put each) --> HTTP coroutines

The engine thread drains commands, then runs ``step()`` while the engine has work, and otherwise waits on
the Condition: no busy spin and no sleeps. A command is only ever appended under the Condition's lock and
the thread re-checks the deque under the same lock before waiting, so a wake-up cannot be lost. The HTTP
loop never runs model code; it awaits an asyncio future (submission) or a per-request asyncio queue.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.engine.outputs import RequestOutput, merge_deltas
from deepinfer.server.commands import Abort, Call, Command, EngineRequest, Reply, Submit
from deepinfer.server.engine_stats import EngineStats, RequestTiming, observe, publish, snapshot
from deepinfer.server.metrics import ServerMetrics
from deepinfer.server.stat_log import StatLog

log = logging.getLogger("deepinfer.server")


class EngineClosed(RuntimeError):
    """The engine thread has stopped (shutdown) or died (an exception in ``step()``)."""


class RequestStream:
    """The outputs of one HTTP request: one or more engine requests (a completion with several prompts)
    sharing one asyncio queue. Iterate it for RequestOutputs; ``close()`` aborts whatever is unfinished."""

    def __init__(self, bridge: "AsyncEngine", loop: asyncio.AbstractEventLoop) -> None:
        self._bridge = bridge
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.request_ids: list[str] = []
        self.unfinished: set[str] = set()
        self.timing: dict[str, RequestTiming] = {}  # the bridge's thread only

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        held: RequestOutput | BaseException | None = None  # taken from the queue, not yet merged or given out
        while self.unfinished:
            item, held = (held, None) if held is not None else (await self.queue.get(), None)
            # A reader that fell behind (many streams on one event loop) finds several outputs of its request
            # waiting: they go out as one, with both steps' deltas, so a busy server sends fewer, larger events.
            while isinstance(item, RequestOutput) and not item.finished and not self.queue.empty():
                nxt = self.queue.get_nowait()
                if not isinstance(nxt, RequestOutput) or nxt.request_id != item.request_id \
                        or len(nxt.delta_text) != len(item.delta_text):
                    held = nxt
                    break
                item = merge_deltas(item, nxt)
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.unfinished.discard(item.request_id)
            yield item

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def close(self) -> None:
        """Abort the unfinished requests (client gone, error, shutdown). Synchronous on purpose: it is
        called from ``finally`` blocks that may be running under cancellation, where awaiting is unsafe."""
        if self.unfinished:
            self._bridge.abort(list(self.unfinished))
            self.unfinished.clear()


def _put_all(items: list) -> None:
    for queue, item in items:
        queue.put_nowait(item)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._cv = threading.Condition()
        self._commands: deque[Command] = deque()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._flush = False  # an abort left outputs in the engine that only step() emits
        self._drain_at: float | None = None  # monotonic time after which every request is aborted
        self.error: BaseException | None = None
        self.stats = EngineStats()
        self.stat_log: StatLog | None = None  # the periodic log line (set by the app's ServerState)
        self._death: list[Callable[[], None]] = []

    # ---- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None and not self._stop

    def on_death(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (on the engine thread) if the engine dies; not at a requested shutdown."""
        self._death.append(callback)

    def drain(self, grace: float) -> None:
        """Shutdown has begun: requests may run on for ``grace`` seconds, then the engine thread aborts them
        (their clients get a final chunk with finish_reason "abort" and a clean end of stream).

        Called from a signal handler, so it takes no lock (the interrupted thread may hold it): one attribute
        store, read by the engine thread at its next iteration. An idle engine has nothing to abort."""
        if self._drain_at is None:
            self._drain_at = time.monotonic() + grace

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread: in-flight requests are aborted (their clients see finish_reason "abort"),
        queued commands are refused. Blocking; call it off the event loop."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the HTTP side -------------------------------------------------------------------------------
    async def submit(self, requests: list[EngineRequest]) -> RequestStream:
        """Add requests atomically: all are admitted or none.

        Raises the engine's ValueError (naming the field) when one is invalid, EngineClosed when the engine
        thread is gone. Returns once the engine thread has accepted them.
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, loop)
        fut: asyncio.Future[None] = loop.create_future()
        ids = [r.request_id for r in requests]
        self._send(Submit(stream, tuple(requests), self._resolver(loop, fut)))
        try:
            await fut
        except asyncio.CancelledError:
            # The client left while we waited: the requests may have been added meanwhile. Aborts run after
            # the submit in command order, so this cannot leak them.
            self.abort(ids)
            raise
        stream.request_ids = ids
        stream.unfinished = set(stream.request_ids)
        return stream

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(Abort(tuple(request_ids)), strict=False)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps (safe inspection, e.g. cache integrity)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._send(Call(fn, self._resolver(loop, fut)))
        return await fut

    def call_sync(self, fn: Callable[[LLMEngine], Any], timeout: float = 30.0) -> Any:
        """``call`` for plain threads (tests, tools): blocks until the engine thread ran ``fn``."""
        box: dict[str, Any] = {}
        ready = threading.Event()

        def done(value: Any, exc: BaseException | None) -> None:
            box["value"], box["exc"] = value, exc
            ready.set()

        self._send(Call(fn, done))
        if not ready.wait(timeout):
            raise TimeoutError("the engine thread did not answer in time")
        if box["exc"] is not None:
            raise box["exc"]
        return box["value"]

    def _send(self, cmd: Command, strict: bool = True) -> None:
        with self._cv:
            if self._stop or self.error is not None:
                if strict:
                    raise EngineClosed("the engine is not running") from self.error
                return  # an abort after shutdown: the shutdown already aborted everything
            self._commands.append(cmd)
            self._cv.notify()

    @staticmethod
    def _resolver(loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> Reply:
        def settle(value: Any, exc: BaseException | None) -> None:
            if fut.done():  # cancelled by the HTTP side meanwhile
                return
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(value)

        def done(value: Any, exc: BaseException | None) -> None:
            try:
                loop.call_soon_threadsafe(settle, value, exc)
            except RuntimeError:  # the event loop is closed: nobody is waiting any more
                pass

        return done

    # ---- the engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not (self._commands or self._stop or self._flush
                               or self.engine.has_unfinished_requests()):
                        self._cv.wait()
                    commands = list(self._commands)
                    self._commands.clear()
                    stop = self._stop
                for cmd in commands:
                    self._apply(cmd)
                if stop:
                    self._abort_all(commands_left=True)
                    self.engine.close()  # e.g. the cache tiers write down to the disk for the next start
                    return
                if self._drain_at is not None and time.monotonic() >= self._drain_at:
                    self._abort_all(commands_left=False)
                if self._flush or self.engine.has_unfinished_requests():
                    self._flush = False
                    self._dispatch(self.engine.step())
        except BaseException as exc:  # a bug or a device error: fail every waiting client, then stop
            log.exception("engine thread died")
            self.error = exc
            err = EngineClosed(f"the engine failed: {type(exc).__name__}: {exc}")
            for stream in set(self._streams.values()):
                self._deliver(stream, err)
            self._streams.clear()
            self._refuse_commands(err)
            for callback in self._death:
                callback()

    def _apply(self, cmd: Command) -> None:
        if isinstance(cmd, Abort):
            live = [rid for rid in cmd.request_ids if rid in self._streams]
            if live:
                self.engine.abort_request(live)
                self._flush = True
            return
        value, exc = None, None
        try:
            if isinstance(cmd, Submit):
                self._add(cmd.stream, cmd.requests)
            else:
                value = cmd.fn(self.engine)
        except Exception as e:  # ValueError for bad input; anything from a call() goes back to its caller
            exc = e
        cmd.reply(value, exc)

    def _add(self, stream: RequestStream, requests: tuple[EngineRequest, ...]) -> None:
        added: list[str] = []
        try:
            for r in requests:
                self.engine.add_request(r.request_id, r.prompt, r.params)
                added.append(r.request_id)
        except ValueError:
            if added:  # all or nothing: a multi-prompt completion with one bad prompt is refused whole
                self.engine.abort_request(added)
                self._flush = True  # their abort outputs are dropped: no stream is registered for them
            raise
        now = time.monotonic()
        for rid in added:
            self._streams[rid] = stream
            stream.timing[rid] = RequestTiming(now)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        # One hand-off per event loop per step, not one per output: each call_soon_threadsafe writes to the
        # loop's wake-up pipe (measured: 64 outputs one by one 0.43-0.49 ms of this thread per step, in one
        # batch 0.05 ms).
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            if self.metrics is not None:
                self._observe(stream, out, now)
            batches.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that client's event loop is closed
                pass
        self._publish_stats()
        if self.stat_log is not None:
            self.stat_log.step(outputs, self.stats, now)

    def _observe(self, stream: RequestStream, out: RequestOutput, now: float) -> None:
        assert self.metrics is not None
        observe(self.metrics, stream.timing[out.request_id], out, now)
        if out.finished:
            del stream.timing[out.request_id]

    @staticmethod
    def _deliver(stream: RequestStream, item: RequestOutput | BaseException) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # that client's event loop is closed
            pass

    def _publish_stats(self) -> None:
        stats = snapshot(self.engine)
        self.stats = stats  # one reference assignment: readers see the old or the new snapshot
        if self.metrics is not None:
            publish(self.metrics, stats)

    def _abort_all(self, commands_left: bool) -> None:
        """Abort every request and hand each client its final "abort" output; at shutdown (``commands_left``)
        also fail any stream still open and refuse the commands that arrived too late."""
        live = list(self.engine.requests)
        if live:
            self.engine.abort_request(live)
            self._flush = False
            self._dispatch(self.engine.step())
        if not commands_left:
            return
        closed = EngineClosed("the server is shutting down")
        for stream in set(self._streams.values()):  # requests that never produced their final output
            self._deliver(stream, closed)
        self._streams.clear()
        self._refuse_commands(closed)

    def _refuse_commands(self, exc: BaseException) -> None:
        with self._cv:
            left = list(self._commands)
            self._commands.clear()
        for cmd in left:
            if not isinstance(cmd, Abort):  # an abort has nobody waiting for its answer
                cmd.reply(None, exc)
