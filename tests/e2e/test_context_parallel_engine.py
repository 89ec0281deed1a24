"""Long prompts under context parallelism (``model/parallel/context.py``) draw the single-process engine's
greedy tokens, with logprobs within the parallel tests' tolerance, in 2- and 4-process gloo worlds: chunked
prefill (a 96-token step budget, so a 410-token prompt takes five chunks, each split zigzag over its CP
group), a short request's own tokens in the same steps, preemption (a small history pool), and a prefix
hit whose bounded replay runs as a CP chunk. The CP ranks keep each sequence's history between its chunks
(``model/parallel/context_history.py``): the worlds run chunks from the replica, drop it on preemption, catch
it up after chunks that ran outside CP, and free it when the sequence is aborted mid-prefill."""

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


# (DP2 + EP + CP2 alone is the union of the last layout and the DP2 + CP2 prefix-hit test below.)
@pytest.mark.parametrize("parallel", [
    dict(data_parallel_size=4, enable_expert_parallel=True, context_parallel_size=4),
    dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True, context_parallel_size=2),
], ids=["dp4-ep-cp4", "dp2-tp2-ep-cp2"])
def test_long_prompts_under_context_parallel_equal_single_process(single, parallel, monkeypatch) -> None:
    (got, history), engine = run_world({**ARGS, **parallel, **CP}, lambda e: (
        _drain(e, _prompts(), ARRIVALS), e.context_history()), monkeypatch)
    # 410 + 300 + 260 prompt tokens in chunks of up to 96: most of them split over the CP group.
    assert engine.context_parallel_chunks >= 6, engine.context_parallel_chunks
    # Later chunks of a prompt start from the history the CP ranks kept; none is held once the prompts are done.
    assert sum(h.chunks_from_replica for h in history) > 0 and all(h.nbytes == 0 and not h.seq_ids for h in history)
    if parallel["data_parallel_size"] == 2:  # two long prompts share a DP rank's 5 history blocks (DP4: one each)
        assert sum(s.num_preemptions for s in engine.schedulers) > 0, "the test must exercise preemption"
        assert sum(h.dropped_on_leave for h in history) > 0, "a preemption must drop a replica mid-prefill"
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


def _run_scored(engine, arrivals: dict[int, list[tuple[str, list[int]]]], each_step=None) -> Scored:
    """Step ``engine`` until every request arrived and finished (aborted ones left out); ``each_step(engine)``
    after every step."""
    got, step = {}, 0
    while engine.has_unfinished_requests() or any(k >= step for k in arrivals):
        for rid, ids in arrivals.get(step, ()):
            engine.add_request(rid, {"prompt_token_ids": ids}, PARAMS)
        for out in engine.step():
            if out.finished and out.outputs[0].finish_reason != "abort":
                c = out.outputs[0]
                got[out.request_id] = (list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        if each_step is not None:
            each_step(engine)
        step += 1
    return got


def test_replicas_catch_up_and_are_freed_on_abort(monkeypatch) -> None:
    """DP2 + EP + CP2, the group's pick (the longest chunk, ties to the lower DP rank) moving between two long
    prompts. A short request takes DP rank 0, so r1 (1000 tokens) goes to rank 1 and wins the first four steps
    (each chunk from its replica); a doomed prompt (700) joins rank 0 in the third, and once the short request
    is done its chunk ties r1's and wins (a catch-up from nothing: it starts at position 190). It is aborted
    right after, while rank 1 holds its replica: the next step frees it on every rank, and r1 wins again 96
    positions past its replica (a catch-up that keeps 31 of the replica's window rows on rank 0). Once r1's
    prefill ends no rank holds anything. r1's and the short request's tokens are the single-process engine's."""
    rng = random.Random(21)
    long, doomed, short = ([rng.randrange(3, 4096) for _ in range(n)] for n in (1000, 700, 9))
    args = dict(ARGS, num_cache_blocks=24)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        want = _run_scored(LLMEngine.from_engine_args(**args), {0: [("r0", short), ("r1", long)]})
    finally:
        torch.set_num_threads(threads)
    seen: dict[str, list] = {}

    def each_step(engine: ParallelLLMEngine) -> None:
        held = {h.rank: h for h in engine.context_history()}
        if "abort" not in seen and "doomed#0" in held[1].seq_ids:
            seen["abort"] = [held, engine.context_parallel_chunks]
            engine.abort_request("doomed")
        elif "abort" in seen and "after" not in seen:
            seen["after"] = [held]

    def run(engine: ParallelLLMEngine) -> Scored:
        out = _run_scored(engine, {0: [("r0", short), ("r1", long)], 2: [("doomed", doomed)]}, each_step)
        seen["end"] = engine.context_history()
        return out

    got, engine = run_world({**args, "data_parallel_size": 2, "enable_expert_parallel": True,
                             "context_parallel_size": 2, **CP}, run, monkeypatch)
    held, chunks = seen["abort"]
    assert chunks == 5 and held[0].seq_ids == ("r1#0", "doomed#0"), seen
    # Rank 1 helps rank 0's doomed prompt: its window rows (6 layers, 127 x 64 float32) and entries and index
    # keys up to position 286, kept for the next chunk; rank 0, the owner, keeps positions only.
    assert held[1].nbytes > 6 * 127 * 64 * 4 and held[0].nbytes > 0, seen  # rank 0 helps r1
    after = seen["after"][0]
    assert all("doomed#0" not in h.seq_ids for h in after.values()) and after[1].nbytes == 0, seen
    end = seen["end"]
    assert all(h.seq_ids == () and h.nbytes == 0 for h in end), end
    assert end[0].catch_ups == 2 and end[0].chunks_from_replica >= 7 and end[0].dropped_on_leave == 1, end
    assert engine.context_parallel_chunks == 11, engine.context_parallel_chunks
    _assert_same(got, want)
