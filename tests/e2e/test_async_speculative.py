"""Async scheduling together with MTP speculation changes no output: every request gets the tokens, texts,
finish reasons and logprobs of the synchronous speculative loop and of the plain engine without speculation.

Under async scheduling step N+1 is planned while verify step N runs, at the positions N's full acceptance
gives, and the device moves it back by N's rejected drafts (``runner/step_shift.py``). To make every
acceptance length occur (full acceptance, where nothing moves, as well as every rejection depth), the
drafts are planted on the device: the MTP layer's drafts are replaced, after each step's pass, by the plain
run's continuation from the sequence's real last emitted token, with an error planted at a random draft
position most of the time. Two models: a tiny random checkpoint (chunked prefill, preemption in a small
cache, greedy and seeded sampling, k = 1, 2, 4) and the bundled demo model (its own trained drafts, a mix of
stop strings, max_tokens reached mid-draft, n > 1, logprobs, aborts; and requests whose next step needs the
previous step's tokens on the host: a grammar, penalties, a pending min_tokens, which take the synchronous
order for such steps).

Logprob values are compared to 1e-4, as in ``test_async_scheduling.py``: which rows share a step may differ
between the loops, and on the CPU a GEMM row's last bits depend on the row count.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.assets import demo_model_dir
from deepinfer.testing.make_checkpoint import PRESETS, write_random_checkpoint
from tests.e2e.test_speculative import _drain

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_mtp_async")
    write_random_checkpoint(path, dict(PRESETS["tiny"], torch_dtype="float32"), seed=4)
    return path


def _engine(model=None, k: int = 0, async_scheduling: bool = False, **kw) -> LLMEngine:
    args = dict(model=str(model) if model else None, tokenizer=str(demo_model_dir()), device="cpu", dtype="float32",
                block_size=128, max_num_seqs=8, max_num_batched_tokens=40, load_progress=False,
                async_scheduling=async_scheduling)
    if k:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    args.update(kw)
    return LLMEngine.from_engine_args(**args)


class _Watch:
    """Counts, per engine, the verify works planned on a step in flight (placeholder drafts) and the steps
    that took the synchronous order."""

    def __init__(self, engine: LLMEngine) -> None:
        self.overlapped = self.synchronous = 0
        submit, apply_first = engine.runner.submit, engine._apply_first

        def counted_submit(plan, *args, **kwargs):
            self.overlapped += sum(w.num_placeholders > 1 for w in plan.work)
            return submit(plan, *args, **kwargs)

        def counted_apply_first():
            first = apply_first()
            self.synchronous += first
            return first

        engine.runner.submit, engine._apply_first = counted_submit, counted_apply_first


def _tokens(done: dict) -> dict:
    return {r: [list(c.token_ids) for c in o.outputs] for r, o in done.items()}


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for rid, w in want.items():
        g = got[rid]
        assert [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in g.outputs] == \
            [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in w.outputs], rid
        for gc, wc in zip(g.outputs, w.outputs):
            assert (gc.logprobs is None) == (wc.logprobs is None), rid
            for gp, wp in zip(gc.logprobs or (), wc.logprobs or ()):
                assert [(t, lp.rank) for t, lp in gp.items()] == [(t, lp.rank) for t, lp in wp.items()], rid
                assert [lp.logprob for lp in gp.values()] == pytest.approx([lp.logprob for lp in wp.values()],
                                                                          abs=1e-4), rid


def _plant(engine: LLMEngine, reference: dict, seed: int, reject_all: bool = False) -> None:
    """Replace the MTP layer's drafts, on the device after its pass, by the reference continuation from each
    proposer's real last emitted token (its position moved by the step's shift and accepted count, read here
    on the CPU), with an error at a random draft position in 60% of the steps (``reject_all``: at the first
    draft of every step)."""
    rng = random.Random(seed)
    drafter = engine.runner.drafter
    propose = drafter.propose

    def planted(streams, input_ids, index, work, starts, slots, draw_rows, tokens, kept, graphed=False, shift=None):
        out = propose(streams, input_ids, index, work, starts, slots, draw_rows, tokens, kept, graphed=graphed,
                      shift=shift)
        if out is None:
            return None
        seqs = {s.seq_id: s for r in engine.requests.values() for s in r.seqs}
        drawing = [(i, w) for i, w in enumerate(work) if w.num_samples]
        for j, (d, (i, w)) in enumerate((d, iw) for d, iw in enumerate(drawing) if iw[1].num_proposals):
            moved = int(shift[i]) if shift is not None else 0
            emitted = int(kept[d]) if kept is not None else w.num_samples
            last = w.first_pos + moved + w.num_tokens - w.num_samples + emitted  # its last emitted token's position
            seq = seqs[w.seq_id]
            ref = reference[seq.request.request_id][seq.index]
            at = last + 1 - seq.num_prompt
            drafts = list(ref[at : at + w.num_proposals])
            drafts += [3] * (w.num_proposals - len(drafts))
            if reject_all or rng.random() < 0.6:
                bad = 0 if reject_all else rng.randrange(len(drafts))
                drafts[bad] = (drafts[bad] + 1) % 90 + 3
            out[j, : len(drafts)] = torch.tensor(drafts)
        return out

    drafter.propose = planted


def _tiny_prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 97) for _ in range(n)] for n in (3, 121, 118, 40)]


TINY_PARAMS = {"greedy": SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1),
               "seeded": SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=MAX_TOKENS, ignore_eos=True,
                                        logprobs=1)}


@pytest.fixture(scope="module")
def tiny_plain(tiny_dir) -> dict:
    return {mode: _drain(_engine(tiny_dir, num_cache_blocks=2), _tiny_prompts(), params)
            for mode, params in TINY_PARAMS.items()}


@pytest.mark.parametrize("mode", sorted(TINY_PARAMS))
@pytest.mark.parametrize("k", [1, 2, 4])
def test_tiny_planted_drafts_under_chunking_and_preemption(tiny_dir, tiny_plain, k, mode) -> None:
    plain = tiny_plain[mode]
    reference = _tokens(plain)
    runs = {}
    for async_scheduling in (False, True):
        # 2 history blocks for sequences of up to 133 tokens: preemption; a 40-token budget chunks the prompts.
        engine = _engine(tiny_dir, k, async_scheduling, num_cache_blocks=2)
        watch = _Watch(engine)
        _plant(engine, reference, seed=k)
        runs[async_scheduling] = _drain(engine, _tiny_prompts(), TINY_PARAMS[mode])
        assert engine.scheduler.num_preemptions > 0
        st = engine.spec_stats
        assert st.accepted_per_pos[k - 1] > 0, "whole drafts accepted"
        assert st.num_accepted_tokens < st.num_draft_tokens, "drafts rejected"
        if async_scheduling:
            assert watch.overlapped > 0 and watch.synchronous == 0
    _assert_same(runs[True], plain)
    _assert_same(runs[False], plain)


# A small cache: the default CPU budget (zero-filled per engine) would dominate the run time.
DEMO = dict(max_num_batched_tokens=24, max_model_len=512, cache_memory_gb=0.05)


def _demo_requests() -> tuple[list[str], list[SamplingParams]]:
    prompts = ["The quick brown fox", "Once upon a time", "def fibonacci(n):", "import os\nimport sys\n",
               "In the beginning", "# Return the sum of a list of numbers\n" * 3 + "def total(xs):"]
    params = [
        SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),  # max_tokens mid-draft
        SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True, n=2, logprobs=2),
        SamplingParams(temperature=0.7, seed=3, max_tokens=24, stop=["\n", "the"]),
        SamplingParams(temperature=0, max_tokens=20, stop=["(", "sys"], logprobs=1),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.02, seed=5, max_tokens=18, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    ]
    return prompts, params


@pytest.fixture(scope="module")
def demo_plain() -> dict:
    prompts, params = _demo_requests()
    return _drain(_engine(**DEMO), prompts, params)


@pytest.mark.parametrize("k", [1, 3])
def test_demo_mix_with_stops_and_n(demo_plain, k) -> None:
    """The trained MTP layer's own drafts (right about half the time)."""
    prompts, params = _demo_requests()
    runs, accepted = {}, {}
    for async_scheduling in (False, True):
        engine = _engine(None, k, async_scheduling, **DEMO)
        watch = _Watch(engine)
        runs[async_scheduling] = _drain(engine, prompts, params)
        accepted[async_scheduling] = engine.spec_stats.accepted_per_pos
        assert engine.spec_stats.num_accepted_tokens > 0
        if async_scheduling:
            assert watch.overlapped > 0 and watch.synchronous == 0
    _assert_same(runs[True], demo_plain)
    _assert_same(runs[False], demo_plain)
    # The drafts are the synchronous loop's too (the MTP chain of a moved step is moved with it): each draft
    # depth is accepted as often. (Tokens cannot tell: drafts only decide how many positions a step covers.)
    assert accepted[True] == accepted[False]
    reasons = {(c.finish_reason, c.stop_reason is not None) for o in demo_plain.values() for c in o.outputs}
    assert {("stop", True), ("length", False)} <= reasons


def test_demo_aborts() -> None:
    prompts, params = _demo_requests()
    aborts = {3: "1", 6: "4"}
    plain = _drain(_engine(**DEMO), prompts, params, abort_at=aborts)
    got = _drain(_engine(None, 2, True, **DEMO), prompts, params, abort_at=aborts)
    for rid in aborts.values():
        assert {c.finish_reason for c in got[rid].outputs} == {"abort"}
    _assert_same({r: o for r, o in got.items() if r not in aborts.values()},
                 {r: o for r, o in plain.items() if r not in aborts.values()})


def test_demo_grammar_penalties_and_min_tokens_take_the_synchronous_order() -> None:
    """Requests whose next step needs the step in flight's tokens on the host make the engine apply it before
    planning; once they are done (or past min_tokens), steps overlap again. Same outputs throughout."""
    pytest.importorskip("llguidance")
    prompts = ["Once upon a time", "def fibonacci(n):", "point = ", "The quick brown fox", "In the beginning",
               "import os\n"]
    point = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
             "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
    params = [
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, structured_outputs={"json": point}),
        SamplingParams(temperature=1.0, seed=5, max_tokens=8, repetition_penalty=1.2, presence_penalty=0.3,
                       frequency_penalty=0.2, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=3, max_tokens=10, min_tokens=6),
        SamplingParams(temperature=0, max_tokens=12, structured_outputs={"regex": r"[0-9]{3}-[a-z]{2,4}"}),
    ]
    kw = dict(max_num_batched_tokens=64, max_model_len=512, cache_memory_gb=0.05)
    plain = _drain(_engine(None, 0, False, **kw), prompts, params, stagger=2)
    runs = {}
    for async_scheduling in (False, True):
        engine = _engine(None, 2, async_scheduling, **kw)
        watch = _Watch(engine)
        runs[async_scheduling] = _drain(engine, prompts, params, stagger=2)
        if async_scheduling:
            assert watch.synchronous > 0 and watch.overlapped > 0
    _assert_same(runs[True], plain)
    _assert_same(runs[False], plain)
    assert {c.finish_reason for c in plain["2"].outputs} == {"stop"}  # the structure was completed


def test_tiny_long_sequences_keep_their_window_rows(tiny_dir) -> None:
    """Sequences past 2 blocks release their oldest window and state blocks as they go. With every draft
    rejected the host's lengths run 2k positions ahead of the real ones (two steps at full acceptance) at
    every commit: the cache keeps 2k positions of rollback slack (``engine/sizing.spec_slack``), so every
    rollback and every window read finds its rows."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 97) for _ in range(n)] for n in (250, 236)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = _drain(_engine(tiny_dir, max_num_batched_tokens=128), prompts, params)
    engine = _engine(tiny_dir, 4, True, max_num_batched_tokens=128)
    watch = _Watch(engine)
    _plant(engine, _tokens(plain), seed=3, reject_all=True)
    got = _drain(engine, prompts, params)
    assert watch.overlapped > 0 and engine.spec_stats.num_draft_tokens > 0
    assert engine.spec_stats.num_accepted_tokens == 0
    _assert_same(got, plain)
