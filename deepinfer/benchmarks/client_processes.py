"""``deepinfer bench serve --num-client-processes N``: one run's requests sent from N client processes.

One asyncio client spends tens of microseconds of Python per streamed event; at tens of thousands of events a
second that is a whole core, and then the run measures the client rather than the server
(``bench/serve_cpu.py`` measures each process's share). Here process w of N sends the requests i with
i mod N == w, each at its arrival time of the one schedule, with its share of ``--max-concurrency``; all
processes start at one wall-clock instant once every one is ready, and the parent pools their outcomes in
request order. The run's duration spans the first send to the last completion of any process.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable, Sequence

from deepinfer.benchmarks.datasets import BenchRequest
from deepinfer.benchmarks.metrics import RequestOutcome
from deepinfer.benchmarks.options import ServeBenchConfig

# Seconds every process may take to start (imports, tokenizer) before the run is called failed.
_START_TIMEOUT = 120.0
# Seconds between the last process being ready and the common start (the start reaches every process first).
_START_MARGIN = 0.05


def concurrency_shares(limit: int | None, n: int) -> list[int | None]:
    """``limit`` split over ``n`` processes as evenly as possible (None: no limit for any)."""
    if limit is None:
        return [None] * n
    return [limit // n + (w < limit % n) for w in range(n)]


def _child(w: int, cfg: ServeBenchConfig, requests: list[BenchRequest], offsets: list[float], limit: int | None,
           model: str, events, start) -> None:
    """Process w: get ready, wait for the common start, send, report ("done" per request, then the outcomes)."""
    try:
        from deepinfer.benchmarks.serve import send_all
        from deepinfer.tokenizer import Tokenizer

        tokenizer = Tokenizer(cfg.tokenizer)
        events.put(("ready", w, None))
        start_at = start.get()
        _, outcomes, first, last = asyncio.run(send_all(cfg, requests, offsets, limit, tokenizer, model, start_at,
                                                        on_done=lambda: events.put(("done", w, None))))
        events.put(("result", w, (outcomes, first, last)))
    except BaseException:  # the parent names the process and shows why
        events.put(("error", w, traceback.format_exc()))


def run_processes(cfg: ServeBenchConfig, requests: Sequence[BenchRequest], offsets: Sequence[float],
                  on_done: Callable[[], None]) -> tuple[str, list[RequestOutcome], float]:
    """(model name, outcomes in request order, duration) of the requests sent from ``cfg.num_client_processes``
    processes."""
    from deepinfer.benchmarks.serve import served_model_name

    n = cfg.num_client_processes
    model = served_model_name(cfg)
    ctx = mp.get_context("spawn")  # a fresh interpreter: no event loop, threads or locks inherited
    events = ctx.Queue()
    starts = [ctx.Queue() for _ in range(n)]
    picks = [list(range(w, len(requests), n)) for w in range(n)]
    procs = [ctx.Process(target=_child, daemon=True,
                         args=(w, cfg, [requests[i] for i in picks[w]], [offsets[i] for i in picks[w]], limit, model,
                               events, starts[w]))
             for w, limit in enumerate(concurrency_shares(cfg.max_concurrency, n))]
    for p in procs:
        p.start()
    try:
        results = _collect(events, starts, procs, on_done)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    outcomes: list[RequestOutcome | None] = [None] * len(requests)
    for w, (got, _, _) in results.items():
        for i, o in zip(picks[w], got):
            outcomes[i] = o
    first = min(r[1] for r in results.values())
    last = max(r[2] for r in results.values())
    return model, outcomes, last - first


def _collect(events, starts, procs, on_done: Callable[[], None]) -> dict[int, tuple]:
    """Start every process at one instant once all are ready; forward completions; the processes' results."""
    ready: set[int] = set()
    results: dict[int, tuple] = {}
    deadline = time.monotonic() + _START_TIMEOUT
    while len(results) < len(procs):
        try:
            kind, w, payload = events.get(timeout=1.0)
        except queue.Empty:
            dead = [w for w, p in enumerate(procs) if not p.is_alive() and w not in results]
            if dead:
                raise RuntimeError(f"--num-client-processes: client process {dead[0]} exited "
                                   f"(code {procs[dead[0]].exitcode}) without a result")
            if len(ready) < len(procs) and time.monotonic() > deadline:
                raise RuntimeError(f"--num-client-processes: {len(procs) - len(ready)} client processes not ready "
                                   f"after {_START_TIMEOUT:.0f} s")
            continue
        if kind == "ready":
            ready.add(w)
            if len(ready) == len(procs):
                start_at = time.time() + _START_MARGIN
                for q in starts:
                    q.put(start_at)
        elif kind == "done":
            on_done()
        elif kind == "result":
            results[w] = payload
        else:
            raise RuntimeError(f"--num-client-processes: client process {w} failed:\n{payload}")
    return results
