"""The engine over a 2-process gloo world (TP2; DP2 with expert parallelism) draws the single-process
engine's greedy tokens on the demo model, under chunked prefill (a 48-token step budget) and preemption
(a small history pool), with requests arriving over several steps. 4-process worlds:
test_four_process_engine.py; ranks started as on several nodes (deepinfer's flags, torchrun):
test_multi_node_launch.py."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.assets import demo_model_dir
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.executor.engine import ParallelLLMEngine
from deepinfer.sampling import SamplingParams
from deepinfer.testing.staggered import arrivals_by_step, drain, single_thread_reference

MAX_TOKENS = 5
ARGS = dict(model=str(demo_model_dir()), device="cpu", dtype="float32", block_size=128, max_num_seqs=8,
            max_num_batched_tokens=48, num_cache_blocks=2, load_progress=False)


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 4096) for _ in range(n)] for n in (125, 7, 124, 33)]


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts()
    return drain(engine, arrivals_by_step(prompts, {2 * b: range(3 * b, min(3 * b + 3, len(prompts)))
                                                     for b in range((len(prompts) + 2) // 3)}), params)


@pytest.fixture(scope="module")
def single() -> dict[str, list[int]]:
    return single_thread_reference(ARGS, _drain)


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(data_parallel_size=2, enable_expert_parallel=True)], ids=["tp2", "dp2-ep"])
def test_two_process_engine_equals_single_process(single, parallel) -> None:
    threads = torch.get_num_threads()  # a CPU world divides the cores among its ranks
    engine = LLMEngine.from_engine_args(**ARGS, **parallel)
    try:
        assert isinstance(engine, ParallelLLMEngine)
        got = _drain(engine)
        assert sum(s.num_preemptions for s in engine.schedulers) > 0, "the test must exercise preemption"
        if parallel.get("data_parallel_size"):
            assert all(s.cache.num_requests == 0 for s in engine.schedulers)
    finally:
        engine.close()
        torch.set_num_threads(threads)
    assert got == single


def test_data_parallel_prefix_hits_and_bounded_replay() -> None:
    """DP2 + EP with prefix caching: requests sharing a 300-token prefix go to the rank whose cache holds it,
    hit there (one of them by bounded replay: the state blocks were dropped) and draw the tokens of a
    single-process engine without prefix caching."""
    rng = random.Random(12)
    shared = [rng.randrange(3, 4096) for _ in range(300)]
    prompts = [shared + [rng.randrange(3, 4096) for _ in range(5 + 7 * i)] for i in range(3)]
    # Logprobs too: random-id prompts leave the demo model's argmax insensitive to much of its context.
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    args = dict(ARGS, num_cache_blocks=16, max_num_batched_tokens=128)

    def values(out):
        return [lp[t].logprob for t, lp in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]

    def run(engine, ids, rid):
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
        out = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                out = o if o.finished else out
        return out

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain = LLMEngine.from_engine_args(**args, enable_prefix_caching=False)
        ref = [run(plain, ids, f"p{i}") for i, ids in enumerate(prompts)]
    finally:
        torch.set_num_threads(threads)
    engine = LLMEngine.from_engine_args(**args, data_parallel_size=2, enable_expert_parallel=True)
    try:
        first = run(engine, prompts[0], "r0")
        second = run(engine, prompts[1], "r1")
        for sched in engine.schedulers:  # drop every cached state block: the next hit must replay
            sched.cache.pools["state"].reset_cache()
        third = run(engine, prompts[2], "r2")
        got = (first, second, third)
        assert (first.num_cached_tokens, second.num_cached_tokens, third.num_cached_tokens) == (0, 256, 252)
        assert sum(s.prefix_replayed for s in engine.schedulers) == 4
        for sched in engine.schedulers:
            sched.cache.check_integrity()
    finally:
        engine.close()
        torch.set_num_threads(threads)
    for a, b in zip(got, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert max(abs(x - y) for x, y in zip(values(a), values(b))) < 1e-4


def test_the_warm_up_runs_on_every_data_parallel_rank_and_leaves_no_trace(single, monkeypatch) -> None:
    """``warm_up=True`` on DP2 + EP: each rung's prompts reach both DP ranks (so each compiles its kernels'
    variants); afterwards no cached block, no request and zeroed counters on either rank, and the same tokens."""
    owners: dict[str, int] = {}
    add = ParallelLLMEngine.add_request

    def recording(self, request_id, *a, **kw):
        add(self, request_id, *a, **kw)
        owners[request_id] = self._owner[request_id]

    monkeypatch.setattr(ParallelLLMEngine, "add_request", recording)
    threads = torch.get_num_threads()
    engine = LLMEngine.from_engine_args(**ARGS, data_parallel_size=2, enable_expert_parallel=True, warm_up=True)
    try:
        rungs: dict[str, set[int]] = {}
        for rid, dp in owners.items():
            rungs.setdefault(rid.rsplit("-", 1)[0], set()).add(dp)
        assert len(rungs) >= 5 and all(dps == {0, 1} for dps in rungs.values()), rungs
        assert not engine.requests
        for s in engine.schedulers:
            assert sum(s.cache.num_cached_blocks().values()) == 0 and s.cache.num_requests == 0
            assert s.prefix_queries == s.prefix_hits == 0
        owners.clear()
        assert _drain(engine) == single
    finally:
        engine.close()
        torch.set_num_threads(threads)


def test_server_counters_cover_every_data_parallel_rank() -> None:
    """What /metrics and the server's stats line read (``server/engine_stats.snapshot``) on DP2 + EP: the
    running and waiting requests, cache usage and prefix counters of both DP ranks, not of rank 0 alone (two
    requests, one on each rank)."""
    from deepinfer.server.engine_stats import snapshot

    threads = torch.get_num_threads()  # a CPU world divides the cores among its ranks
    engine = LLMEngine.from_engine_args(**dict(ARGS, num_cache_blocks=8), data_parallel_size=2,
                                        enable_expert_parallel=True)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        for i, ids in enumerate(_prompts()[:2]):
            engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
        engine.step()
        assert [len(s.running) + len(s.waiting) for s in engine.schedulers] == [1, 1]
        stats = snapshot(engine)
        assert (stats.running, stats.waiting) == (sum(len(s.running) for s in engine.schedulers),
                                                  sum(len(s.waiting) for s in engine.schedulers))
        assert stats.running + stats.waiting == 2
        pools = engine.schedulers[0].cache.pools
        for p in pools:
            used = sum(s.cache.pools[p].num_used for s in engine.schedulers)
            total = sum(s.cache.pools[p].num_blocks for s in engine.schedulers)
            assert stats.cache_usage[p] == used / total
        assert stats.prefix.queries == sum(s.prefix_queries for s in engine.schedulers) > 0
        while engine.has_unfinished_requests():
            engine.step()
        assert (snapshot(engine).running, snapshot(engine).waiting) == (0, 0)
    finally:
        engine.close()
        torch.set_num_threads(threads)
