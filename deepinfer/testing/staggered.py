"""Run an engine over requests that arrive at given steps and collect what each finished request produced:
the harness of the tests that compare an engine (batched, chunked, preempted, parallel) with a plain run."""

from __future__ import annotations

from typing import Any

Arrivals = dict[int, list[tuple[str, list[int]]]]  # step -> (request id, prompt token ids) added before it
Tokens = dict[str, list[int]]
Scored = dict[str, tuple[list[int], list[float]]]  # request id -> (tokens, each token's logprob)


def arrivals_by_step(prompts: list[list[int]], steps: dict[int, Any], prefix: str = "r") -> Arrivals:
    """{step: prompt indices} -> the ``Arrivals`` of requests ``{prefix}{index}``."""
    return {s: [(f"{prefix}{i}", prompts[i]) for i in idx] for s, idx in steps.items()}


def drain(engine, arrivals: Arrivals, params, *, logprobs: bool = False, check_integrity: bool = False
          ) -> Tokens | Scored:
    """Step ``engine`` until every request has arrived and finished. Per request: its sample 0's tokens, or
    (tokens, their logprobs) with ``logprobs`` (``params`` must ask for them). ``check_integrity``: the cache
    pools' integrity check after every step (single-process engines)."""
    pending = dict(arrivals)
    done: dict[str, Any] = {}
    step = 0
    while engine.has_unfinished_requests() or any(k >= step for k in pending):
        for rid, ids in pending.pop(step, []):
            engine.add_request(rid, {"prompt_token_ids": ids}, params)
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                tokens = list(c.token_ids)
                done[out.request_id] = (tokens, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]) \
                    if logprobs else tokens
        if check_integrity:
            engine.cache.check_integrity()
        step += 1
    return done


def assert_same(got: Scored, want: Scored, tolerance: float) -> None:
    """The same requests, the same tokens, and logprobs within ``tolerance``."""
    assert sorted(got) == sorted(want)
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        assert max(abs(a - b) for a, b in zip(got[rid][1], logprobs)) < tolerance, rid


def single_thread_reference(engine_args: dict, run, must_preempt: bool = True):
    """``run(engine)`` on a single-process engine built from ``engine_args``, with torch on one thread as each
    rank of a multi-process world runs (tiny GEMMs: more threads only contend, and the reference then sums in
    the ranks' order); the run must have preempted (``must_preempt``), since the worlds compared with it are
    meant to."""
    import torch

    from deepinfer import LLMEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LLMEngine.from_engine_args(**engine_args)
        out = run(engine)
    finally:
        torch.set_num_threads(threads)
    assert engine.scheduler.num_preemptions > 0 or not must_preempt, "the test must exercise preemption"
    return out


def run_world(engine_args: dict, run, monkeypatch=None):
    """``run(engine)`` on the multi-process engine ``engine_args`` ask for, with this process (rank 0) on one
    thread and, given ``monkeypatch``, the ranks it spawns too (``OMP_NUM_THREADS``), as the single-thread
    reference runs; afterwards every DP rank's cache holds no request and passes its integrity check. Returns
    (what ``run`` returned, the closed engine)."""
    import torch

    from deepinfer import LLMEngine
    from deepinfer.executor.engine import ParallelLLMEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    if monkeypatch is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the spawned ranks, whatever the machine's core count
    engine = LLMEngine.from_engine_args(**engine_args)
    try:
        assert isinstance(engine, ParallelLLMEngine)
        got = run(engine)
        for sched in engine.schedulers:
            assert sched.cache.num_requests == 0
            sched.cache.check_integrity()
    finally:
        engine.close()
        torch.set_num_threads(threads)
    return got, engine
