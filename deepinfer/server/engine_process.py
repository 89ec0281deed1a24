"""The engine core: ``deepinfer serve``'s ``LLMEngine`` in a process of its own (design.md §4.11).

Why a process: in one process the HTTP event loop (request parsing, per-token SSE of every stream) and the
engine loop share one GIL, so the host work of the two cannot overlap and the engine waits for the server.
Split, the engine process only runs the engine loop; the HTTP process does what it did before (parse,
validate, tokenize and render prompts, build and stream responses) and talks to this one through
``engine_client.EngineClient``.

    HTTP process                                  engine core process (this module)
      EngineClient --Submit/Abort/CallEngine-->     pipe --> EngineCore.run: commands between steps
      reader thread <--StepOutputs (one per step)-- pipe <-- engine.step(), outputs as deltas + counters

One stdlib ``multiprocessing`` pipe, each message the codec's bytes (``executor/codec.py``, this channel's
types in ``core_messages.py``). The loop reads every waiting command before each step and blocks in the
pipe's read when the engine has nothing to do: no busy spin, no sleeps. The end of the pipe (the server
is gone, even killed) closes the engine and ends the process; ``Shutdown`` does the same after aborting
what runs. SIGINT is ignored here: Ctrl-C reaches the whole process group, and stopping is the server's
decision (it drains, then sends ``Shutdown``).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from multiprocessing.connection import Connection

from deepinfer.config.engine import EngineConfig
from deepinfer.executor.codec import decode, encode
from deepinfer.server.core_messages import (MESSAGES, Abort, Answer, CallEngine, CoreClosed, CoreDied, CoreFailed,
                                            CoreReady, Drain, RemoteError, Shutdown, StepOutputs, Submit)
from deepinfer.server.engine_stats import EngineStats, snapshot
from deepinfer.server.log_setup import log_to_stderr
from deepinfer.server.output_wire import DeltaBuilder, OutputDelta, PlainDelta

log = logging.getLogger("deepinfer.server")


class _ServerGone(Exception):
    """The pipe closed: the HTTP process exited or was killed."""


def run_engine_core(config: EngineConfig, conn: Connection, log_level: str | None = None) -> None:
    """The process's target: build the engine, report, serve commands until shutdown or the server leaves.
    ``log_level``: this process's ``deepinfer`` log lines to stderr at that level (a spawned interpreter starts
    without the server's handler)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if log_level is not None:
        log_to_stderr(log_level)
    from deepinfer.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine.from_config(config)
    except BaseException as e:  # bad arguments, no memory, a missing file: the server reports it and exits
        conn.send_bytes(encode(CoreFailed(RemoteError.of(e)), MESSAGES))
        raise SystemExit(1) from None
    conn.send_bytes(encode(CoreReady(os.getpid()), MESSAGES))
    core = EngineCore(engine, conn)
    try:
        core.run()
    except _ServerGone:
        engine.close()  # e.g. the cache tiers written down to the disk, for the next start
    except BaseException as e:  # a bug or a device error in step(): tell the server, then go down
        log.exception("engine core died")
        try:
            core.send(CoreDied(RemoteError.of(e)))
        except OSError:
            pass
        raise SystemExit(1) from None


class EngineCore:
    def __init__(self, engine, conn: Connection) -> None:
        self.engine, self.conn = engine, conn
        # Outputs leave the engine as deltas built from its sequences (no cumulative outputs made here).
        engine.build_output = DeltaBuilder().build
        self.known: set[str] = set()  # admitted requests whose final output is not sent yet
        self.flush = False  # an abort left outputs in the engine that only step() emits
        self.drain_at: float | None = None  # monotonic time after which every request is aborted
        self.last_stats: EngineStats | None = None

    def send(self, message) -> None:
        self.conn.send_bytes(encode(message, MESSAGES))

    def run(self) -> None:
        engine = self.engine
        while True:
            idle = not (self.flush or engine.has_unfinished_requests())
            for message in self._receive(block=idle):
                if isinstance(message, Shutdown):
                    self._abort_all()
                    engine.close()
                    self.send(CoreClosed())
                    return
                self._apply(message)
            if self.drain_at is not None and time.monotonic() >= self.drain_at:
                self._abort_all()
            if self.flush or engine.has_unfinished_requests():
                self.flush = False
                self._send_step(engine.step())

    def _receive(self, block: bool) -> list:
        try:
            messages = [decode(self.conn.recv_bytes(), MESSAGES)] if block else []
            while self.conn.poll(0):
                messages.append(decode(self.conn.recv_bytes(), MESSAGES))
        except (EOFError, OSError):
            raise _ServerGone from None
        return messages

    def _apply(self, message) -> None:
        if isinstance(message, Abort):
            live = [rid for rid in message.request_ids if rid in self.engine.requests]
            if live:
                self.engine.abort_request(live)
                self.flush = True
        elif isinstance(message, Submit):
            try:
                self._add(message)
            except Exception as e:  # ValueError for bad input (a 400 naming the field); a bug is a 500
                self.send(Answer(message.call_id, error=RemoteError.of(e)))
            else:
                self.send(Answer(message.call_id))
        elif isinstance(message, CallEngine):
            self.send(self._call(message))
        elif isinstance(message, Drain):
            if self.drain_at is None:
                self.drain_at = time.monotonic() + message.grace
        else:
            raise TypeError(f"engine core: unexpected message {type(message).__name__}")

    def _add(self, message: Submit) -> None:
        added: list[str] = []
        try:
            for r in message.requests:
                self.engine.add_request(r.request_id, r.prompt, r.params)
                added.append(r.request_id)
        except Exception:
            if added:  # all or nothing: their abort outputs are dropped (the server never saw them)
                self.engine.abort_request(added)
                self.flush = True
            raise
        self.known.update(added)

    def _call(self, message: CallEngine) -> Answer:
        try:
            answer = Answer(message.call_id, message.fn(self.engine, *message.args))
            decode(encode(answer, MESSAGES), MESSAGES)  # what the server could not read must not be sent
        except Exception as e:
            answer = Answer(message.call_id, error=RemoteError.of(e))
        return answer

    def _send_step(self, outputs: list[OutputDelta | PlainDelta]) -> None:
        deltas = []
        for out in outputs:
            if out.request_id not in self.known:
                continue
            if out.finished:
                self.known.discard(out.request_id)
            deltas.append(out)
        stats = snapshot(self.engine)
        if deltas or stats != self.last_stats:  # a prefill chunk alone changes nothing the server shows
            self.last_stats = stats
            self.send(StepOutputs(tuple(deltas), stats))

    def _abort_all(self) -> None:
        live = list(self.engine.requests)
        if live:
            self.engine.abort_request(live)
            self.flush = False
            self._send_step(self.engine.step())
