"""Speculative decoding over a 2-process gloo world: each DP rank verifies its own sequences' drafts, runs the
MTP passes for them and rolls rejected drafts back on its own cache; ranks with fewer MTP passes in a step (no
drafts to chain, or no work) join the others' expert-parallel collectives without tokens. The tokens equal
the single-process engine's without speculation (greedy and seeded sampled requests in one batch), under
chunked prefill, preemption (a small history pool) and uneven load (requests arrive over several steps, so
a rank is idle or only prefills while the other verifies). The acceptance counters show the drafts were
really verified, and that some were accepted and some rolled back. With structured outputs too: constrained
requests (JSON schema, regex, choice) mixed with unconstrained ones give the plain tokens, every verified
position masked by the grammar advanced over the drafts before it."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from deepinfer.assets import demo_model_dir
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.executor.engine import ParallelLLMEngine
from deepinfer.runner.speculative import mtp_passes
from deepinfer.sampling import SamplingParams
from deepinfer.testing.staggered import arrivals_by_step, run_world, single_thread_reference

MAX_TOKENS = 10
ARGS = dict(model=str(demo_model_dir()), device="cpu", dtype="float32", block_size=128, max_num_seqs=8,
            max_num_batched_tokens=48, num_cache_blocks=2, load_progress=False)


def _prompts() -> list[list[int]]:
    rng = random.Random(21)
    return [[rng.randrange(3, 4096) for _ in range(n)] for n in (125, 124, 120, 30, 9)]


def _params(i: int) -> SamplingParams:
    if i % 2:  # seeded sampled: the draws are keyed by (seed, position), so any engine draws the same
        return SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _drain(engine: LLMEngine) -> dict[str, list[int]]:
    """The first request runs alone (the other DP rank idle), the next two arrive together (one shares the
    first one's rank: preemption there), the last two later."""
    arrivals = arrivals_by_step(_prompts(), {0: [0], 1: [1, 2], 7: [3], 10: [4]})
    done, step = {}, 0
    while engine.has_unfinished_requests() or any(k >= step for k in arrivals):
        for rid, ids in arrivals.pop(step, []):
            engine.add_request(rid, {"prompt_token_ids": ids}, _params(int(rid[1:])))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
    return done


@pytest.fixture(scope="module")
def plain() -> dict[str, list[int]]:
    return single_thread_reference(ARGS, _drain)


@pytest.mark.parametrize("parallel,k", [(dict(data_parallel_size=2, enable_expert_parallel=True), 1),
                                        (dict(data_parallel_size=2, enable_expert_parallel=True), 3),
                                        (dict(tensor_parallel_size=2), 2)],
                         ids=["dp2-ep-k1", "dp2-ep-k3", "tp2-k2"])
def test_parallel_speculative_equals_plain(plain, parallel, k) -> None:
    threads = torch.get_num_threads()
    engine = LLMEngine.from_engine_args(**ARGS, **parallel,
                                        speculative_config={"method": "mtp", "num_speculative_tokens": k})
    try:
        assert isinstance(engine, ParallelLLMEngine)
        got = _drain(engine)
        stats = engine.spec_stats
        preemptions = sum(s.num_preemptions for s in engine.schedulers)
        assert all(s.cache.num_requests == 0 for s in engine.schedulers)
        assert not engine.has_unfinished_requests()
    finally:
        engine.close()
        torch.set_num_threads(threads)
    assert got == plain
    assert preemptions > 0, "the test must exercise preemption"
    # Drafts were verified on the ranks: some accepted (fewer steps), some rejected (rolled back).
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_draft_tokens > stats.num_drafts or k == 1


# Structured outputs with speculation: constrained requests (JSON schema, regex, choice) among unconstrained
# ones, greedy and seeded; half of them verify the MTP layer's own drafts, the other half drafts planted from
# the plain output with, half the time, one token replaced by a random one (which the grammar almost always
# forbids), so full acceptances and rejections at every depth occur on constrained sequences.
POINT = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
         "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
CODE = r"[0-9]{3}-[a-z]{2,4}"
ANSWERS = ["yes", "no", "maybe so"]
CONSTRAINED = [("point = ", {"json": POINT}), ("code = ", {"regex": CODE}), ("answer = ", {"choice": ANSWERS}),
               ("def f(x):", None)]
VALID = {"json": lambda t: pytest.importorskip("jsonschema").validate(json.loads(t), POINT) is None,
         "regex": lambda t: re.fullmatch(CODE, t) is not None, "choice": lambda t: t in ANSWERS}
STRUCTURED_ARRIVALS = {0: [0, 1, 2, 3, 4, 5], 3: [6, 7]}  # the late two join steps that verify drafts
K = 2


def _structured_request(i: int) -> tuple[str, SamplingParams]:
    prompt, constraint = CONSTRAINED[i % 4]
    return prompt, SamplingParams(temperature=0.8 if i % 3 else 0, seed=300 + i, max_tokens=24,
                                  structured_outputs=constraint)


def _structured_drain(engine: LLMEngine, plant=None) -> dict[str, tuple]:
    done, step = {}, 0
    while engine.has_unfinished_requests() or any(k >= step for k in STRUCTURED_ARRIVALS):
        for i in STRUCTURED_ARRIVALS.get(step, []):
            engine.add_request(f"s{i}", *_structured_request(i))
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (tuple(c.token_ids), c.text, c.finish_reason)
        if plant is not None:
            plant(engine)
        step += 1
    return done


def _planted(reference: dict, seed: int):
    """After each step: the even requests' drafts become their plain continuation, one token replaced by a
    random one half the time (on the coordinator, where the schedulers plan the drafts)."""
    rng = random.Random(seed)

    def plant(engine) -> None:
        for sched in engine.schedulers:
            for seq in sched.running:
                if int(seq.request.request_id[1:]) % 2 == 0:
                    drafts = list(reference[seq.request.request_id][0][seq.num_output : seq.num_output + K])
                    if drafts and rng.random() < 0.5:
                        drafts[rng.randrange(len(drafts))] = rng.randrange(3, 4096)
                    seq.drafts = tuple(drafts)
    return plant


@pytest.fixture(scope="module")
def structured_plain() -> dict[str, tuple]:
    pytest.importorskip("llguidance")
    out = single_thread_reference(ARGS, _structured_drain, must_preempt=False)
    for i in range(len(out)):
        constraint = _structured_request(i)[1].structured_outputs
        if constraint is not None:  # every structure completes within max_tokens: each output is validated
            assert out[f"s{i}"][2] == "stop"
    return out


@pytest.mark.parametrize("parallel", [dict(data_parallel_size=2, enable_expert_parallel=True),
                                      dict(tensor_parallel_size=2)], ids=["dp2-ep", "tp2"])
def test_parallel_speculative_structured_equals_plain(structured_plain, parallel, monkeypatch) -> None:
    """The plan carries a constrained sequence's masks of every verified position, the ranks apply them before
    the acceptance and the coordinator's matchers advance over the accepted tokens only: the tokens are the
    single-process engine's without speculation, and every output obeys its constraint."""
    verified = []  # per constrained verify: (drafts, masks in the plan, accepted)

    def go(engine):
        apply = engine._apply

        def observed(schedule, handle):
            sampled = {s.seq_id: s for s in handle.result().samples()}
            for w in schedule.plan.work:
                if w.grammar_masks and w.num_drafts:
                    verified.append((w.num_drafts, len(w.grammar_masks), len(sampled[w.seq_id].token_ids) - 1))
            return apply(schedule, handle)

        engine._apply = observed
        return _structured_drain(engine, _planted(structured_plain, seed=K))

    got, _ = run_world({**ARGS, **parallel, "speculative_config": {"method": "mtp", "num_speculative_tokens": K}},
                       go, monkeypatch)
    assert got == structured_plain
    for i in range(len(got)):
        constraint = _structured_request(i)[1].structured_outputs
        if constraint is not None:
            assert VALID[constraint.kind](got[f"s{i}"][1]), got[f"s{i}"]
    assert all(masks == drafts + 1 for drafts, masks, _ in verified)  # a mask per verified position
    assert any(acc == drafts == K for drafts, _, acc in verified), "some constrained drafts all accepted"
    assert any(acc < drafts for drafts, _, acc in verified), "some constrained drafts rejected"


def test_speculative_refused_with_async_scheduling_on_several_ranks() -> None:
    from deepinfer.config.engine import EngineArgs, EngineConfig

    # A step's drafts and accepted count decide the next plan; async scheduling plans it before they arrive.
    args = EngineArgs.from_kwargs(**ARGS, data_parallel_size=2, enable_expert_parallel=True, async_scheduling=True,
                                  speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="speculative_config: cannot be combined with async_scheduling.*allowed: "):
        EngineConfig.create(args)


def test_speculative_refused_with_context_parallel() -> None:
    from deepinfer.config.engine import EngineArgs, EngineConfig

    args = EngineArgs.from_kwargs(**ARGS, data_parallel_size=2, context_parallel_size=2, enable_expert_parallel=True,
                                  speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    with pytest.raises(ValueError, match="speculative_config: .*context_parallel_size"):
        EngineConfig.create(args)


def test_mtp_passes_counts_the_drafters_passes(monkeypatch) -> None:
    """``mtp_passes(plan)`` (what the ranks pad to) is the number of MTP-layer passes a step really runs, on
    every step of a speculative run with prefill chunks, mixed draft lengths and preemption: a ran-more or
    ran-fewer pass would leave an expert-parallel rank waiting in a collective. (Draft lengths per request
    from their acceptance, DEEPINFER_ENABLE_MTP_VARLEN=1, give the mixed chains.)"""
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    engine = LLMEngine.from_engine_args(**ARGS, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    calls, seen = [0], []
    engine.model.mtp[0].ffn.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    submit = engine.runner.submit

    def counted(plan, *a, **kw):
        before = calls[0]
        handle = submit(plan, *a, **kw)
        seen.append((mtp_passes(plan), calls[0] - before))
        return handle

    engine.runner.submit = counted
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny GEMMs: threads only contend
    try:
        _drain(engine)
    finally:
        torch.set_num_threads(threads)
    assert all(want == ran for want, ran in seen), seen
    assert {ran for _, ran in seen} >= {1, 2, 3}, "steps without drafts, with short and with full chains"
