"""Async scheduling changes nothing a user sees: every request gets exactly the synchronous loop's output.

The bundled demo model serves a mixed workload under both loops: greedy and seeded sampling, penalties,
min_tokens, logprobs, prompt_logprobs, stop strings and stop token ids, n > 1, chunked prefill (a small
token budget), preemption (a small cache), and aborts issued at fixed steps. Token ids, text, finish
and stop reasons must be equal, and the cache must end empty.

Logprob *values* are compared to 1e-4: async scheduling changes which rows share a step (a sequence that
stopped on a string occupies its slot one step longer, so other prefills are chunked differently), and
on the CPU a GEMM row's bits depend on how many rows the GEMM has (oneDNN picks its blocking by row count;
``torch.nn.functional.linear`` of row 0 alone differs from it inside 9 rows by ~2e-5). Which tokens
carry a logprob, and their ranks, must still be equal.
"""

from __future__ import annotations

import pytest

from deepinfer import LLMEngine, SamplingParams

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n" * 4 + "    parser.",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "# Return the sum of a list of numbers\n" * 9 + "def total(xs):",
    "for i in range(10):",
    "x = [",
]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=24),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=60, logprobs=2),
        SamplingParams(temperature=1.0, top_k=20, seed=3, n=3, max_tokens=20, repetition_penalty=1.2,
                       frequency_penalty=0.3),
        SamplingParams(temperature=0.7, seed=11, max_tokens=32, stop=["\n\n", "return"], min_tokens=4,
                       presence_penalty=0.5, prompt_logprobs=2),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[10], min_tokens=2, ignore_eos=True),
        SamplingParams(temperature=0.9, min_p=0.05, seed=5, n=2, max_tokens=20),
    ]


def _run(async_scheduling: bool, abort_at: dict[int, str] | None = None, **engine_kw) -> dict:
    kw = dict(device="cpu", block_size=128, max_num_seqs=8, max_num_batched_tokens=40, num_cache_blocks=3,
              load_progress=False, async_scheduling=async_scheduling)
    kw.update(engine_kw)
    engine = LLMEngine.from_engine_args(**kw)
    arrivals = {0: [0, 1, 2], 2: [3], 5: [4, 5]}
    outputs: dict[str, object] = {}
    step = 0
    while engine.has_unfinished_requests() or any(k >= step for k in arrivals):
        for i in arrivals.pop(step, []):
            engine.add_request(f"r{i}", PROMPTS[i], _params()[i])
        if abort_at and step in abort_at:
            engine.abort_request(abort_at[step])
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        engine.cache.check_integrity()
        step += 1
        assert step < 2000, "the engine did not finish"
    engine.step()  # an async engine may hold one more step's (ignored) results
    assert engine.cache.num_requests == 0
    engine.cache.check_integrity()
    return {"outputs": outputs, "preemptions": engine.scheduler.num_preemptions}


def _lp_values(position_logprobs) -> list[float]:
    return [lp.logprob for pos in position_logprobs or () if pos is not None for lp in pos.values()]


def _lp_keys(position_logprobs) -> list:
    return [None if pos is None else [(t, lp.rank) for t, lp in pos.items()] for pos in position_logprobs or ()]


def _assert_same(got, want, rid: str) -> None:
    assert len(got.outputs) == len(want.outputs), rid
    for g, w in zip(got.outputs, want.outputs):
        assert (g.index, g.token_ids, g.text, g.finish_reason, g.stop_reason) == \
            (w.index, w.token_ids, w.text, w.finish_reason, w.stop_reason), rid
        assert _lp_keys(g.logprobs) == _lp_keys(w.logprobs), rid
        assert _lp_values(g.logprobs) == pytest.approx(_lp_values(w.logprobs), abs=1e-4), rid
    assert _lp_keys(got.prompt_logprobs) == _lp_keys(want.prompt_logprobs), rid
    assert _lp_values(got.prompt_logprobs) == pytest.approx(_lp_values(want.prompt_logprobs), abs=1e-4), rid


@pytest.fixture(scope="module")
def sync_run() -> dict:
    return _run(False)


def test_async_equals_sync_under_chunking_and_preemption(sync_run) -> None:
    got = _run(True)
    assert sync_run["preemptions"] > 0 and got["preemptions"] > 0, "the workload must exercise preemption"
    assert sorted(got["outputs"]) == sorted(sync_run["outputs"]) == [f"r{i}" for i in range(len(PROMPTS))]
    for rid, out in sync_run["outputs"].items():
        _assert_same(got["outputs"][rid], out, rid)
    reasons = {c.finish_reason for o in sync_run["outputs"].values() for c in o.outputs}
    assert {"stop", "length"} <= reasons


def test_async_equals_sync_with_aborts() -> None:
    aborts = {3: "r1", 7: "r4"}
    sync, got = _run(False, aborts), _run(True, aborts)
    for rid in ("r1", "r4"):
        assert {c.finish_reason for c in got["outputs"][rid].outputs} == {"abort"}
    for rid, out in sync["outputs"].items():
        if rid not in aborts.values():
            _assert_same(got["outputs"][rid], out, rid)


def test_async_equals_sync_with_a_roomy_cache(sync_run) -> None:
    """No preemption, no chunking: the same tokens as the constrained run (batching changes nothing)."""
    got = _run(True, num_cache_blocks=64, max_num_batched_tokens=2048)
    assert got["preemptions"] == 0
    for rid, out in sync_run["outputs"].items():
        _assert_same(got["outputs"][rid], out, rid)
