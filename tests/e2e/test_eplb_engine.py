"""The engine over a 2-process gloo world (DP2 + EP) with expert-parallel load balancing on draws the
single-process engine's greedy tokens, while its experts are re-placed every 2 steps mid-generation; on a
router skewed towards two experts of one rank, the per-rank load measured after the first re-placement is
flatter than before it.

bfloat16: this CPU's bf16 GEMMs give a row the same result whatever else is in the batch, so splitting an
expert's rows over replicas changes no bits (float32 would move last bits; see test_parallel_model.py)."""

from __future__ import annotations

import logging
import random

import pytest
import torch

from deepinfer.assets import demo_model_dir
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.executor.engine import ParallelLLMEngine
from deepinfer.executor.messages import CollectExpertLoad
from deepinfer.sampling import SamplingParams
from deepinfer.testing.make_checkpoint import PRESETS, write_random_checkpoint
from deepinfer.testing.skewed_router import skew_router

MAX_TOKENS = 6
EPLB = dict(enable_eplb=True, eplb_config={"num_redundant_experts": 2, "window_size": 4, "step_interval": 2,
                                           "log_balancedness": True})


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("tiny_skewed")
    write_random_checkpoint(out, PRESETS["tiny"], seed=5)
    skew_router(out, experts=(0, 1), boost=4.0)
    return dict(model=str(out), tokenizer=str(demo_model_dir()), device="cpu", dtype="bfloat16", block_size=128,
                max_num_seqs=8, max_num_batched_tokens=48, load_progress=False)


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 97) for _ in range(n)] for n in (60, 7, 41, 20)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    done: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests() or step <= 2:
        if step in (0, 2):  # two arrivals, the second while the first requests are running
            for i in range(step // 2 * 2, step // 2 * 2 + 2):
                engine.add_request(f"r{i}", {"prompt_token_ids": prompts[i]}, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    return done


@pytest.fixture(scope="module")
def want(args) -> dict[str, list[int]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank of the world (tiny GEMMs: threads only contend)
    try:
        return _drain(LLMEngine.from_engine_args(**args))
    finally:
        torch.set_num_threads(threads)


def test_eplb_engine_equals_single_process(args, want, caplog) -> None:
    threads = torch.get_num_threads()
    engine = LLMEngine.from_engine_args(**args, data_parallel_size=2, enable_expert_parallel=True, **EPLB)
    try:
        assert isinstance(engine, ParallelLLMEngine)
        with caplog.at_level(logging.INFO, logger="deepinfer"):
            got = _drain(engine)
        history = engine.eplb.history
    finally:
        engine.close()
        torch.set_num_threads(threads)
    assert got == want and len(want) == 4
    assert len(history) >= 3 and history[0].moved_slots > 0  # re-placed mid-generation
    assert history[0].measured < 0.75 < history[1].measured  # flatter measured load once re-placed
    assert history[0].expected_after > history[0].expected_before
    assert sum("EPLB at step" in r.getMessage() for r in caplog.records) == len(history)


def test_the_warm_up_leaves_no_expert_load_and_no_rebalance(args, want) -> None:
    """The start-up warm-up's prompts are not traffic: after it every rank's load counters are zero, no
    rebalance has run (the interval is 2 steps, the warm-up runs more) and the step count starts at 0; the
    engine then draws the single-process tokens and rebalances on its own traffic."""
    threads = torch.get_num_threads()
    engine = LLMEngine.from_engine_args(**args, data_parallel_size=2, enable_expert_parallel=True, warm_up=True,
                                        **EPLB)
    try:
        reports = engine._ask(CollectExpertLoad())
        assert len(reports) == 2
        assert all(sum(map(sum, r.window)) == 0 and sum(map(sum, r.slots)) == 0 for r in reports)
        assert engine.eplb.steps == 0 and engine.eplb.history == []
        got = _drain(engine)
        reports = engine._ask(CollectExpertLoad())
        history = engine.eplb.history
    finally:
        engine.close()
        torch.set_num_threads(threads)
    assert got == want
    assert sum(sum(map(sum, r.window)) for r in reports) > 0 and len(history) >= 3
