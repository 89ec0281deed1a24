"""``DEEPINFER_BATCH_INVARIANT=1`` with several ranks (2-process gloo worlds, the demo model in float32): every
rank runs the batch-invariant op table and sums over ranks in rank order, so a request's tokens and logprobs
are the same bits alone and batched.

* DP2 + expert parallelism moves rows only (each token's experts run on their owners' invariant GEMMs, the
  combine runs on the token's rank in slot order): the world's outputs equal the single-process engine's,
  bit for bit, each request run alone there.
* TP2 splits every projection's K over the ranks, so its bits differ from one process; within the world, the
  requests batched (8 at a time, chunked prefill at 256 tokens, arrivals over several steps) equal the same
  requests run one at a time.
The teeth: with the workers left on the default op table, both comparisons fail (checked when this file was
written); the default mode's batch dependence itself is shown on one process in test_batch_invariant.py.
"""

from __future__ import annotations

import random

import pytest

from deepinfer import SamplingParams
from deepinfer.assets import demo_model_dir
from deepinfer.testing.staggered import run_world, single_thread_reference

ARGS = dict(model=str(demo_model_dir()), device="cpu", dtype="float32", block_size=128, max_num_seqs=8,
            max_num_batched_tokens=256, max_model_len=512, load_progress=False, enable_prefix_caching=False)
LENGTHS = (1, 129, 200, 300)


def _requests() -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(4)
    out = []
    for i, n in enumerate(LENGTHS):
        params = (SamplingParams(temperature=0.9, top_p=0.9, seed=100 + i, max_tokens=5, logprobs=2, ignore_eos=True)
                  if i % 2 else SamplingParams(temperature=0, max_tokens=5, logprobs=2, ignore_eos=True))
        out.append((f"r{i}", [rng.randrange(3, 4096) for _ in range(n)], params))
    return out


def _result(out) -> tuple:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in pos.items())) for pos in c.logprobs)


def _drain(engine, requests, arrivals: dict[int, list[int]]) -> dict:
    done, step = {}, 0
    while engine.has_unfinished_requests() or any(k >= step for k in arrivals):
        for i in arrivals.get(step, []):
            rid, prompt, params = requests[i]
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = _result(out)
        step += 1
        assert step < 1000, "the engine did not finish"
    return done


def _alone(engine) -> dict:
    requests, done = _requests(), {}
    for i in range(len(requests)):
        done.update(_drain(engine, requests, {0: [i]}))
    return done


def _batched(engine) -> dict:
    order = list(range(len(LENGTHS)))
    random.Random(7).shuffle(order)  # arrivals over three steps, in another order than alone
    return _drain(engine, _requests(), {0: order[:2], 1: order[2:3], 3: order[3:]})


def _mode(monkeypatch, invariant: bool) -> None:
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1" if invariant else "0")  # read once, into the config


@pytest.fixture(scope="module")
def single_alone() -> dict:
    with pytest.MonkeyPatch.context() as mp:
        _mode(mp, True)
        return single_thread_reference(ARGS, _alone, must_preempt=False)  # one request at a time


def test_data_and_expert_parallel_equal_the_single_process(monkeypatch, single_alone) -> None:
    _mode(monkeypatch, True)

    def go(engine):
        assert engine.config.batch_invariant
        return _alone(engine), _batched(engine)

    (alone, batched), _ = run_world({**ARGS, "data_parallel_size": 2, "enable_expert_parallel": True}, go,
                                    monkeypatch)
    assert alone == single_alone
    assert batched == single_alone


def test_tensor_parallel_batched_equals_alone(monkeypatch) -> None:
    _mode(monkeypatch, True)
    (alone, batched), _ = run_world({**ARGS, "tensor_parallel_size": 2}, lambda e: (_alone(e), _batched(e)),
                                    monkeypatch)
    assert batched == alone
