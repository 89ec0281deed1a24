"""Structured outputs' fast paths change no token, on the bundled demo model.

* Masks computed while the forward runs, for all constrained sequences in one llguidance call, give the
  tokens of masks computed before the step one matcher at a time and carried in the plan (JSON schema, any
  JSON object, regex, choice and Lark constraints mixed with unconstrained requests; greedy and seeded at
  temperature 1.0).
* Speculative decoding (MTP, k = 1..3) with constraints gives the non-speculative constrained tokens: with
  the MTP layer's own drafts, and with drafts planted from the reference output with errors (grammar-forbidden
  tokens among them), so that long accepted runs, rejections at every depth and drafts that complete the
  grammar all occur; also when the constraint starts after a ``</think>`` that is itself a draft.
"""

from __future__ import annotations

import random

import pytest

from deepinfer import LLMEngine, SamplingParams
from deepinfer.engine import llm_engine
from deepinfer.structured import step_masks

pytest.importorskip("llguidance")

POINT = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
         "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}
CONSTRAINTS = [{"json": POINT}, {"json_object": True}, {"regex": r"[0-9]{3}-[a-z]{2,4}"},
               {"choice": ["yes", "no", "maybe so"]}, {"grammar": 'start: "(" N ("+" N)* ")"\nN: /[0-9]{1,3}/'},
               None]
PROMPTS = ["point = ", "config = ", "code = ", "answer = ", "total = ", "def f(x):"]


def _requests(temperature: float) -> list[tuple[str, SamplingParams]]:
    return [(p, SamplingParams(temperature=temperature, seed=100 + i, max_tokens=24, structured_outputs=c))
            for i, (p, c) in enumerate(zip(PROMPTS * 2, CONSTRAINTS * 2))]


def _engine(k: int = 0) -> LLMEngine:
    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    # A small cache: the default CPU budget (up to 2 GiB, zero-filled per engine) would dominate the run time.
    return LLMEngine.from_engine_args(device="cpu", load_progress=False, block_size=128, max_num_seqs=16,
                                      max_num_batched_tokens=64, max_model_len=512, cache_memory_gb=0.1,
                                      speculative_config=spec)


def _run(engine: LLMEngine, requests, on_step=None) -> dict[str, tuple]:
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                done[out.request_id] = (tuple(c.token_ids), c.finish_reason)
        engine.cache.check_integrity()
        if on_step is not None:
            on_step(engine)
    return done


def _before_the_step_one_at_a_time(backend, seqs, work):
    """The reference order: every mask computed before the step is submitted, one matcher after another."""
    if backend is None:
        return None
    jobs, rows = step_masks.mask_jobs(seqs, work)
    if not jobs:
        return None
    bitmask = backend.fill_one_at_a_time(jobs, rows)
    return lambda: bitmask


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_overlapped_batched_masks_give_the_per_sequence_tokens(temperature, monkeypatch) -> None:
    requests = _requests(temperature)
    got = _run(_engine(), requests)
    monkeypatch.setattr(llm_engine, "mask_source", _before_the_step_one_at_a_time)
    want = _run(_engine(), requests)
    assert got == want
    assert sum(r == "stop" for _, r in got.values()) >= 4  # structures completed, not only cut by max_tokens


@pytest.mark.parametrize("k", [0, 2])
def test_masks_carried_in_the_plan_give_the_same_tokens(references, k, monkeypatch) -> None:
    """The parallel engine's route (masks computed before the step, inside the plan's work items; with drafts,
    one per verified position), in process: the non-speculative tokens."""
    from deepinfer.sched.scheduler import Scheduler

    engine = _engine(k)
    schedule, rows = Scheduler.schedule, []

    def planned(self):
        out = engine._with_grammar_masks(schedule(self))
        rows.extend(len(w.grammar_masks) for w in out.plan.work if w.grammar_masks)
        return out

    monkeypatch.setattr(llm_engine, "mask_source", lambda *a: None)
    monkeypatch.setattr(Scheduler, "schedule", planned)
    assert _run(engine, _requests(1.0)) == references[1.0]
    assert max(rows) == k + 1  # verify steps carried a mask per verified position


@pytest.fixture(scope="module")
def references() -> dict[float, dict]:
    return {t: _run(_engine(), _requests(t)) for t in (0.0, 1.0)}


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_constrained_tokens_equal_plain(references, k, temperature) -> None:
    engine = _engine(k)
    assert _run(engine, _requests(temperature)) == references[temperature]
    assert engine.spec_stats.num_draft_tokens > 0


def _planted(reference: dict, k: int, seed: int, vocab: int):
    """After each step: every running sequence's drafts become its reference continuation with, half the time,
    one token replaced by a random one (which the grammar almost always forbids)."""
    rng = random.Random(seed)

    def hook(engine: LLMEngine) -> None:
        for seq in engine.scheduler.running:
            ref = reference[seq.request.request_id][0]
            drafts = list(ref[seq.num_output : seq.num_output + k])
            if drafts and rng.random() < 0.5:
                drafts[rng.randrange(len(drafts))] = rng.randrange(3, vocab)
            seq.drafts = tuple(drafts)
    return hook


@pytest.mark.parametrize("k", [1, 3])
def test_planted_drafts_accepted_and_rejected_at_every_depth(references, k) -> None:
    for temperature in (0.0, 1.0):
        engine = _engine(k)
        hook = _planted(references[temperature], k, seed=k, vocab=engine.config.model.vocab_size)
        assert _run(engine, _requests(temperature), hook) == references[temperature]
        st = engine.spec_stats
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens and st.accepted_per_pos[k - 1] > 0


def test_thinking_constraint_starting_inside_the_drafts(monkeypatch) -> None:
    """The prompt opens a thinking block; the draw at the third output position is steered to ``</think>``
    (the demo model never closes one itself). With the reference output planted as drafts, ``</think>`` is a
    draft and the rows after it are masked from the grammar's start: the tokens equal plain decoding's."""
    from deepinfer.runner.model_runner import ModelRunner

    engine = _engine()
    tok = engine.tokenizer
    think, think_end = tok.token_to_id("<think>"), tok.token_to_id("</think>")
    prompt = tok.encode("a code?", add_special_tokens=True) + [think]
    original = ModelRunner._draw

    def steered(self, logits, work, slots, positions, *rest):
        logits = logits.float().clone()
        for row, pos in enumerate(positions):
            if pos == len(prompt) + 2:
                logits[row, think_end] = 1e4
        return original(self, logits, work, slots, positions, *rest)

    monkeypatch.setattr(ModelRunner, "_draw", steered)
    requests = [({"prompt_token_ids": prompt}, SamplingParams(temperature=t, seed=7, max_tokens=20,
                                                             structured_outputs={"regex": r"[0-9]{3}-[a-z]{2,4}"}))
                for t in (0.0, 1.0)]
    ref = _run(engine, requests)
    assert all(ids[2] == think_end and think_end not in ids[:2] for ids, _ in ref.values())
    for k in (2, 3):
        spec = _engine(k)
        assert _run(spec, requests, _planted(ref, k, seed=0, vocab=spec.config.model.vocab_size)) == ref


def test_masks_are_computed_after_the_forward_is_launched(monkeypatch) -> None:
    """The order the GPU needs: the step's forward and logits are queued before the host computes the masks."""
    from deepinfer.model.deepseek_v4 import DeepseekV4
    from deepinfer.runner.model_runner import ModelRunner

    events: list[str] = []
    forward, logits = ModelRunner._forward, DeepseekV4.logits
    monkeypatch.setattr(ModelRunner, "_forward", lambda self, *a: events.append("forward") or forward(self, *a))
    monkeypatch.setattr(DeepseekV4, "logits", lambda self, x: events.append("logits") or logits(self, x))

    def source(backend, seqs, work):
        inner = step_masks.mask_source(backend, seqs, work)
        return None if inner is None else (lambda: events.append("masks") or inner())

    monkeypatch.setattr(llm_engine, "mask_source", source)
    _run(_engine(), _requests(0.0)[:3])
    steps = "".join(e[0] for e in events)
    assert "m" in steps and "fm" not in steps and steps.count("flm") == steps.count("m")


def test_tpot_benchmark_runs_on_the_cpu(tmp_path) -> None:
    """``bench/structured_tpot.py`` end to end at a tiny size: both kinds of rounds time full-batch decode
    steps, and the constrained ones did compute masks."""
    from types import SimpleNamespace

    from bench.structured_tpot import run

    args = SimpleNamespace(device="cpu", tokens=4, rounds=1, model=None, load_format="auto", hf_overrides=None)
    row = run(args, 2)
    assert row["batch"] == 2 and row["steps"] == 3 and row["mask_ms_per_step"] > 0  # the first token: prefill
    assert row["tpot_none_ms"] > 0 and row["ratio"] > 0
    assert row["advance_ms_per_step"] > 0 and row["apply_ms_per_step"] > 0  # the split of the constrained steps
