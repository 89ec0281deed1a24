"""The engine over 4-process gloo worlds draws the single-process engine's greedy tokens on the demo model:
DP2 x TP2 with expert parallelism (each DP group's two TP ranks split the heads; the experts are spread over
all four ranks), DP4 with expert parallelism, and DP2 x TP2 + EP with expert-parallel load balancing
re-placing the experts (4 redundant slots) every 2 steps mid-generation. Chunked prefill (a 48-token step
budget per DP rank) and preemption (2 history blocks per DP rank) on all of them, with requests arriving
over several steps. Logprobs are compared too: random-id prompts leave the demo model's argmax insensitive
to much of its context, and the logprobs are not.

(TP4 cannot run on this model: its o_groups is 2.) Every rank runs one thread, as the single-process
reference does: the CPU's GEMMs pick their blocking by thread count too."""

from __future__ import annotations

import random

import pytest

from deepinfer.assets import demo_model_dir
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.executor.engine import ParallelLLMEngine
from deepinfer.sampling import SamplingParams
from deepinfer.testing.staggered import Scored, arrivals_by_step, assert_same, drain, run_world, single_thread_reference

MAX_TOKENS = 5
ARGS = dict(model=str(demo_model_dir()), device="cpu", dtype="float32", block_size=128, max_num_seqs=8,
            max_num_batched_tokens=48, num_cache_blocks=2, load_progress=False)
# Two arrivals of four (DP4: one request of each per rank). A prompt of 125+ tokens crosses into a second
# block while decoding; with another request beside it, its DP rank's 2 history blocks overflow, so every DP
# rank of both worlds preempts.
LENGTHS = (125, 126, 127, 125, 120, 7, 70, 126)
EPLB = dict(enable_eplb=True, eplb_config={"num_redundant_experts": 4, "window_size": 4, "step_interval": 2})
TOLERANCE = 1e-4  # logprob difference allowed (sums over TP ranks and split expert batches round differently)



def _drain(engine: LLMEngine) -> Scored:
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 4096) for _ in range(n)] for n in LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    return drain(engine, arrivals_by_step(prompts, {0: range(0, 4), 2: range(4, 8)}), params, logprobs=True)


def _assert_same(got: Scored, want: Scored) -> None:
    assert len(want) == len(LENGTHS)
    assert_same(got, want, TOLERANCE)


@pytest.fixture(scope="module")
def single() -> Scored:
    return single_thread_reference(ARGS, _drain)


def _run_world(monkeypatch, **parallel) -> tuple[Scored, ParallelLLMEngine]:
    return run_world({**ARGS, **parallel}, _drain, monkeypatch)


@pytest.mark.parametrize("parallel", [dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True),
                                      dict(data_parallel_size=4, enable_expert_parallel=True)],
                         ids=["dp2-tp2-ep", "dp4-ep"])
def test_four_process_engine_equals_single_process(single, parallel, monkeypatch) -> None:
    got, engine = _run_world(monkeypatch, **parallel)
    preemptions = [s.num_preemptions for s in engine.schedulers]
    assert all(p > 0 for p in preemptions), f"preemption on every DP rank wanted, got {preemptions}"
    _assert_same(got, single)


def test_four_process_engine_with_eplb_equals_single_process(single, monkeypatch) -> None:
    got, engine = _run_world(monkeypatch, data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True,
                             **EPLB)
    history = engine.eplb.history
    assert len(history) >= 3 and all(r.moved_slots > 0 for r in history[:3])  # re-placed mid-generation
    assert sum(s.num_preemptions for s in engine.schedulers) > 0
    _assert_same(got, single)
