"""A plain decode step's results travel as (seq ids, tokens) (``StepResult.plain``) and the engine applies them
on a path of its own: the outputs, step for step, equal those of the same engine given the per-sequence
``SeqSamples`` form of the same results."""

from __future__ import annotations

import dataclasses

import pytest

from deepinfer import LLMEngine, SamplingParams
from deepinfer.runner.model_runner import StepHandle


def _run(async_scheduling: bool, plain: bool, monkeypatch) -> list:
    if not plain:
        result = StepHandle.result

        def as_samples(self):
            r = result(self)
            return r if r.plain is None else dataclasses.replace(r, sampled=r.samples(), plain=None)

        monkeypatch.setattr(StepHandle, "result", as_samples)
    engine = LLMEngine.from_engine_args(device="cpu", block_size=128, load_progress=False, max_num_batched_tokens=48,
                                        num_cache_blocks=24, async_scheduling=async_scheduling)
    engine.add_request("greedy", "def f(x):", SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))
    engine.add_request("seeded", "class A:", SamplingParams(temperature=1.0, seed=3, max_tokens=12, stop=["e"]))
    engine.add_request("pair", "import", SamplingParams(n=2, temperature=0.8, seed=4, max_tokens=7))
    engine.add_request("stop_id", "x = 1", SamplingParams(temperature=1.0, seed=9, max_tokens=20,
                                                          stop_token_ids=[17, 18, 19, 20, 21, 22, 23]))
    engine.add_request("logprobs", "y =", SamplingParams(temperature=0, max_tokens=5, logprobs=1))
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    monkeypatch.undo()
    return steps


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_plain_results_give_the_same_outputs(async_scheduling: bool, monkeypatch) -> None:
    seen = []
    result = StepHandle.result

    def spy(self):
        r = result(self)
        seen.append(r.plain is not None)
        return r

    monkeypatch.setattr(StepHandle, "result", spy)
    fast = _run(async_scheduling, True, monkeypatch)
    assert sum(seen) > 5  # the plain form was taken
    assert fast == _run(async_scheduling, False, monkeypatch)
