"""Long prompts under context parallelism (``model/parallel/context.py``) draw the single-process engine's
greedy tokens, with logprobs within the parallel tests' tolerance, in 2- and 4-process gloo worlds: chunked
prefill (a 96-token step budget, so a 410-token prompt takes five chunks, each split zigzag over its CP
group), a short request's own tokens in the same steps, preemption (a small history pool), and a prefix
hit whose bounded replay runs as a CP chunk."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.assets import demo_model_dir
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.executor.engine import ParallelLLMEngine
from deepinfer.sampling import SamplingParams
from deepinfer.testing.staggered import Scored, arrivals_by_step, assert_same, drain, run_world

MAX_TOKENS = 4
ARGS = dict(model=str(demo_model_dir()), device="cpu", dtype="float32", block_size=128, max_num_seqs=8,
            max_num_batched_tokens=96, num_cache_blocks=5, load_progress=False)
CP = dict(context_parallel_min_tokens=32)
LENGTHS = (410, 9, 300, 260)
TOLERANCE = 1e-4  # as tests/e2e/test_four_process_engine.py
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)

def _drain(engine: LLMEngine, prompts: list[list[int]], arrivals: dict[int, list[int]]) -> Scored:
    return drain(engine, arrivals_by_step(prompts, arrivals), PARAMS, logprobs=True)


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 4096) for _ in range(n)] for n in LENGTHS]


ARRIVALS = {0: [0, 1, 2], 3: [3]}


def _assert_same(got: Scored, want: Scored) -> None:
    assert_same(got, want, TOLERANCE)


def _single(args: dict, prompts, arrivals) -> tuple[Scored, LLMEngine]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank of the worlds
    try:
        engine = LLMEngine.from_engine_args(**args)
        return _drain(engine, prompts, arrivals), engine
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def single() -> Scored:
    out, engine = _single(ARGS, _prompts(), ARRIVALS)
    assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    return out


def _world(monkeypatch, args: dict, prompts, arrivals, **parallel) -> tuple[Scored, ParallelLLMEngine]:
    return run_world({**args, **parallel}, lambda engine: _drain(engine, prompts, arrivals), monkeypatch)


# (DP2 + EP + CP2 alone is the union of the last layout and the DP2 + CP2 prefix-hit test below.)
@pytest.mark.parametrize("parallel", [
    dict(data_parallel_size=4, enable_expert_parallel=True, context_parallel_size=4),
    dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True, context_parallel_size=2),
], ids=["dp4-ep-cp4", "dp2-tp2-ep-cp2"])
def test_long_prompts_under_context_parallel_equal_single_process(single, parallel, monkeypatch) -> None:
    got, engine = _world(monkeypatch, ARGS, _prompts(), ARRIVALS, **parallel, **CP)
    # 410 + 300 + 260 prompt tokens in chunks of up to 96: most of them split over the CP group.
    assert engine.context_parallel_chunks >= 6, engine.context_parallel_chunks
    if parallel["data_parallel_size"] == 2:  # two long prompts share a DP rank's 5 history blocks (DP4: one each)
        assert sum(s.num_preemptions for s in engine.schedulers) > 0, "the test must exercise preemption"
    _assert_same(got, single)


def test_prefix_hit_replay_under_context_parallel(monkeypatch) -> None:
    """DP2 + CP2 without expert parallelism (replicated experts): requests sharing a 300-token prefix hit on
    the rank that holds it; with the state blocks dropped, the third hit's bounded replay (windows closing
    before the hit are not re-emitted) is a CP chunk too."""
    rng = random.Random(12)
    shared = [rng.randrange(3, 4096) for _ in range(300)]
    prompts = [shared + [rng.randrange(3, 4096) for _ in range(40 + 7 * i)] for i in range(3)]
    args = dict(ARGS, num_cache_blocks=16, max_num_batched_tokens=128)
    ref = {}
    plain_args = dict(args, enable_prefix_caching=False)
    for i in range(3):
        ref.update(_single(plain_args, prompts, {0: [i]})[0])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    engine = LLMEngine.from_engine_args(**args, data_parallel_size=2, context_parallel_size=2, **CP)
    try:
        got = {}
        for i in range(3):
            if i == 2:
                for sched in engine.schedulers:  # the next hit must replay
                    sched.cache.pools["state"].reset_cache()
            chunks_before = engine.context_parallel_chunks
            got.update(_drain(engine, prompts, {0: [i]}))
            assert engine.context_parallel_chunks > chunks_before, f"request {i} ran no CP chunk"
        assert sum(s.prefix_replayed for s in engine.schedulers) > 0
    finally:
        engine.close()
        torch.set_num_threads(threads)
    _assert_same(got, ref)
