"""Async scheduling over a 2-process gloo world (TP2; DP2 with expert parallelism) gives every request exactly
the output of the single-process synchronous engine: greedy and seeded sampling, n > 1, stop strings found
a step late (the extra token is dropped), stop token ids, an abort, preemption (a small history pool) and
uneven load (requests arriving over many steps, so a DP rank is idle in some). The coordinator must plan
step N+1 before applying step N's results: the orders the ranks received carry placeholders."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.assets import demo_model_dir
from deepinfer.testing.staggered import run_world, single_thread_reference

ARGS = dict(model=str(demo_model_dir()), device="cpu", dtype="float32", block_size=128, max_num_seqs=8,
            max_num_batched_tokens=48, num_cache_blocks=2, load_progress=False)
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main(argv):\n" * 9,
    "class Stack:\n    def push(self, item):",
    "for i in range(10):\n    print(i)\n" * 10,
    "# Return the sum of a list of numbers\n" * 9 + "def total(xs):",
    "x = [",
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, stop=["\n\n"]),
    SamplingParams(temperature=0.8, seed=1, max_tokens=40, stop=["import"]),  # a late stop, a few tokens in
    SamplingParams(temperature=1.0, top_k=20, seed=3, n=2, max_tokens=18),
    SamplingParams(temperature=0.7, seed=11, max_tokens=30, stop_token_ids=[31], ignore_eos=True, logprobs=1),
    SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),  # aborted while running
    SamplingParams(temperature=0.9, seed=5, max_tokens=150),  # arrives late: it runs alone at the end
]
ARRIVALS = {0: [0], 2: [1, 2], 4: [3, 4], 12: [5]}
ABORT = ("r4", 30)  # aborted once it has this many tokens (as many in every engine)


def _run(engine: LLMEngine) -> dict:
    outputs: dict[str, tuple] = {}
    step = 0
    while engine.has_unfinished_requests() or any(k >= step for k in ARRIVALS):
        for i in ARRIVALS.get(step, []):
            engine.add_request(f"r{i}", PROMPTS[i], PARAMS[i])
        for out in engine.step():
            if out.request_id == ABORT[0] and len(out.outputs[0].token_ids) == ABORT[1] and not out.finished:
                engine.abort_request(ABORT[0])
            if out.finished:
                outputs[out.request_id] = tuple((c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason)
                                                for c in out.outputs)
        step += 1
        assert step < 1000, "the engine did not finish"
    engine.step()  # an async engine may hold one more step's (ignored) results
    return outputs


@pytest.fixture(scope="module")
def sync_single() -> dict:
    out = single_thread_reference(ARGS, _run)
    assert out["r1"][0][3] == "stop" and out["r4"][0][3] == "abort"
    return out


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(data_parallel_size=2, enable_expert_parallel=True)], ids=["tp2", "dp2-ep"])
def test_parallel_async_equals_single_process_sync(monkeypatch, sync_single, parallel) -> None:
    orders = []

    def go(engine):
        run = engine.worker.run
        engine.worker.run = lambda order: (orders.append(order), run(order))[1]  # rank 0's copy of each order
        out = _run(engine)
        assert sum(s.num_preemptions for s in engine.schedulers) > 0, "the test must exercise preemption"
        return out

    got, _ = run_world({**ARGS, **parallel, "async_scheduling": True}, go, monkeypatch)
    assert got == sync_single
    # Step N+1 was planned with step N's tokens in flight, and every order said so.
    assert all(o.in_flight for o in orders)
    assert sum(w.num_placeholders for o in orders for p in o.plans for w in p.work) > 10
    if parallel.get("data_parallel_size"):  # uneven load: some steps ran with one DP rank idle
        assert any(o.busy and any(p.empty for p in o.plans) for o in orders)


def test_async_scheduling_with_context_parallelism_is_refused() -> None:
    from deepinfer.config.engine import EngineArgs, EngineConfig

    with pytest.raises(ValueError, match="async_scheduling: not supported with context_parallel_size > 1"):
        EngineConfig.create(EngineArgs(**ARGS, data_parallel_size=2, enable_expert_parallel=True,
                                       context_parallel_size=2, async_scheduling=True))


def test_tiers_with_async_or_speculation_on_several_ranks_are_refused(tmp_path) -> None:
    from deepinfer.config.engine import EngineArgs, EngineConfig

    for extra in ({"async_scheduling": True},
                  {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}):
        with pytest.raises(ValueError, match="kv_cache_dir: cache tiers with several ranks"):
            EngineConfig.create(EngineArgs(**ARGS, data_parallel_size=2, kv_cache_dir=str(tmp_path), **extra))


def test_structured_outputs_under_parallel_async_scheduling() -> None:
    """A grammar's next mask needs the token in flight: the engine brings that step home first (an empty
    step), and the tokens are the synchronous single-process engine's."""
    constraints = [{"regex": r"[a-z]{3}=[0-9]{1,4};"}, None, {"choice": ["yes", "no"]},
                   {"grammar": 'start: "(" /[0-9]{1,3}/ ")"'}]
    params = [SamplingParams(temperature=1.0 if s % 3 else 0.0, seed=s, max_tokens=16, structured_outputs=c)
              for s, c in enumerate(constraints)]
    runs = []
    threads = torch.get_num_threads()
    for kw in (dict(), dict(data_parallel_size=2, enable_expert_parallel=True, async_scheduling=True)):
        if not kw:
            torch.set_num_threads(1)  # as each rank of the world
        engine = LLMEngine.from_engine_args(**ARGS, **kw)
        try:
            for i, p in enumerate(params):
                engine.add_request(f"s{i}", ["x = ", "y = "][i % 2], p)
            done = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = [(c.token_ids, c.finish_reason) for c in out.outputs]
            runs.append(done)
        finally:
            if kw:
                engine.close()
            torch.set_num_threads(threads)
    assert runs[0] == runs[1]
