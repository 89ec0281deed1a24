"""Structured-output pieces on their own: the constraint's validation, the token-mask layout, and that a
constrained request under async scheduling gets exactly the synchronous loop's tokens."""

from __future__ import annotations

import pytest
import torch

from deepinfer.structured import StructuredOutputsParams

pytest.importorskip("llguidance")

from deepinfer.structured.backend import apply_masks, words_of  # noqa: E402


def test_apply_masks_follows_the_bit_layout() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word's high bits lie past the vocabulary
    words = torch.randint(-(2**31), 2**31 - 1, (3, 4), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(3, vocab, generator=g)
    out = apply_masks(logits, words)
    for b in range(3):
        for t in range(vocab):
            allowed = (int(words[b, t // 32]) >> (t % 32)) & 1
            assert out[b, t].item() == (logits[b, t].item() if allowed else float("-inf"))
    assert words_of(words[0].numpy().tobytes()).tolist() == words[0].tolist()


def test_params_validation_names_the_field() -> None:
    assert StructuredOutputsParams(json={"type": "object"}).json == '{"type": "object"}'
    assert StructuredOutputsParams.from_dict({"choice": ["a", "b"]}).choice == ("a", "b")
    with pytest.raises(ValueError, match="set exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match=r"structured_outputs\.choice"):
        StructuredOutputsParams(choice=["a", ""])
    with pytest.raises(ValueError, match=r"structured_outputs\.json_object"):
        StructuredOutputsParams(json_object="yes")
    with pytest.raises(ValueError, match=r"structured_outputs\.regex"):
        StructuredOutputsParams(regex=3)
    with pytest.raises(ValueError, match=r"structured_outputs\.extra: unknown key"):
        StructuredOutputsParams.from_dict({"extra": 1})


def test_async_scheduling_gives_the_synchronous_tokens() -> None:
    from deepinfer import LLM, SamplingParams

    constraints = [{"regex": r"[a-z]{3}=[0-9]{1,4};"}, None, {"json": {"type": "object", "properties": {
        "a": {"type": "integer"}}}}, {"choice": ["yes", "no"]}, None, {"grammar": 'start: "(" /[0-9]{1,3}/ ")"'}]
    params = [SamplingParams(temperature=1.0 if s % 3 else 0.0, seed=s, max_tokens=24, n=1 + s % 2,
                             stop=["="] if s == 4 else None, structured_outputs=c)
              for s, c in enumerate(constraints)]
    runs = []
    for async_scheduling in (False, True):
        llm = LLM(device="cpu", load_progress=False, block_size=128, num_cache_blocks=16,
                  async_scheduling=async_scheduling)
        outs = llm.generate(["x = ", "y = ", "z = "] * 2, params, use_tqdm=False)
        runs.append([[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs])
    assert runs[0] == runs[1]
    assert sum(c[1] == "stop" for o in runs[0] for c in o) >= 3


def test_batched_draft_masks_equal_one_matcher_at_a_time() -> None:
    """``fill`` (llguidance's parallel, draft-aware filler) writes, per job, the mask of the matcher advanced
    over each prefix of its drafts, stops at a draft the grammar forbids, and leaves every matcher as it was."""
    import random

    from deepinfer.assets import demo_model_dir
    from deepinfer.structured.backend import GrammarBackend, MaskJob
    from deepinfer.tokenizer import Tokenizer

    tok = Tokenizer(str(demo_model_dir()))
    backend = GrammarBackend(tok.backend.to_str(), 4096, 1)
    grammars = [backend.compile(StructuredOutputsParams(**c)) for c in (
        {"regex": r"[0-9]{3}-[a-z]{2,4}"}, {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        {"choice": ["yes", "no", "maybe so"]}, {"grammar": 'start: "(" N ("+" N)* ")"\nN: /[0-9]{1,3}/'})]
    texts = ["123-abcd", '{"a":12}', "maybe so", "(1+22+333)"]
    rng = random.Random(0)
    for trial in range(40):
        jobs, row, both = [], 0, []
        for g, text in zip(grammars, texts):
            ids = tok.encode(text, add_special_tokens=False)
            pre = rng.randrange(len(ids))
            drafts = list(ids[pre : pre + rng.randrange(0, 4)])
            if drafts and rng.random() < 0.4:  # a draft the grammar (most likely) forbids
                drafts[rng.randrange(len(drafts))] = rng.randrange(3, 4096)
            pair = []
            for _ in range(2):  # the same state twice: one for fill, one for the reference
                m = backend.matcher(g)
                assert m.consume_tokens(ids[:pre])
                pair.append(m)
            both.append(pair)
            jobs.append((row, tuple(drafts)))
            row += len(drafts) + 1 + rng.randrange(2)  # rows no job covers stay all allowed
        got = backend.fill([MaskJob(p[0], r, d) for p, (r, d) in zip(both, jobs)], row)
        want = backend.fill_one_at_a_time([MaskJob(p[1], r, d) for p, (r, d) in zip(both, jobs)], row)
        assert (got == want).all(), trial
        for m, ref in both:  # the matchers came back unchanged
            assert (backend.fill([MaskJob(m, 0)], 1) == backend.fill([MaskJob(ref, 0)], 1)).all()
            assert not m.is_error()


def test_fill_rows_and_batched_consume_equal_the_plain_calls(monkeypatch) -> None:
    """``fill_rows`` (the constrained rows only, written straight into the upload buffer) holds ``fill``'s rows
    for plain and draft-verifying jobs, whatever the buffer held before (poisoned here); ``consume`` (one call
    on llguidance's pool) leaves every matcher where ``consume_token`` one at a time does, a forbidden token
    included (an error state on both sides)."""
    import random

    import numpy as np

    from deepinfer.assets import demo_model_dir
    from deepinfer.structured import backend as backend_module
    from deepinfer.structured.backend import GrammarBackend, MaskJob, StepMasks
    from deepinfer.tokenizer import Tokenizer

    allocate = StepMasks.allocate.__func__

    def poisoned(cls, num_rows, num_words, pin_memory=False):
        out = allocate(cls, num_rows, num_words, pin_memory)
        out.host.fill_(0x2AAAAAAA)
        return out

    monkeypatch.setattr(StepMasks, "allocate", classmethod(poisoned))
    monkeypatch.setattr(backend_module, "_PAR_CONSUME_MIN", 2)  # the pool's path even for these few matchers
    pooled = []
    par = backend_module._PAR_CONSUME
    monkeypatch.setattr(backend_module, "_PAR_CONSUME", lambda ex, pairs: pooled.append(len(pairs)) or par(ex, pairs))
    tok = Tokenizer(str(demo_model_dir()))
    backend = GrammarBackend(tok.backend.to_str(), 4096, 1)
    backend.threads = max(backend.threads, 2)
    grammars = [backend.compile(StructuredOutputsParams(**c)) for c in (
        {"regex": r"[0-9]{3}-[a-z]{2,4}"}, {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
        {"choice": ["yes", "no", "maybe so"]})]
    texts = ["123-abcd", '{"a":12}', "maybe so"]
    rng = random.Random(1)
    for trial in range(20):
        jobs, row, pairs = [], 0, []
        for g, text in zip(grammars * 2, texts * 2):
            ids = tok.encode(text, add_special_tokens=False)
            pre = rng.randrange(len(ids))
            drafts = tuple(ids[pre : pre + rng.randrange(0, 3)]) if trial % 2 else ()
            if drafts and rng.random() < 0.4:
                drafts = drafts[:-1] + (rng.randrange(3, 4096),)
            ms = [backend.matcher(g) for _ in range(2)]
            for m in ms:
                assert m.consume_tokens(ids[:pre])
            pairs.append(ms)
            jobs.append((row, drafts))
            row += len(drafts) + 1 + rng.randrange(2)
        got = backend.fill_rows([MaskJob(p[0], r, d) for p, (r, d) in zip(pairs, jobs)], row)
        want = backend.fill([MaskJob(p[1], r, d) for p, (r, d) in zip(pairs, jobs)], row)
        covered = [r + i for r, d in jobs for i in range(len(d) + 1)]
        assert got.rows.tolist() == covered and (got.words == want[covered]).all(), trial
        # Batched advance: a random allowed-or-not token per matcher, the same on both sides.
        tokens = [rng.randrange(3, 4096) if rng.random() < 0.2 else
                  int(np.flatnonzero(np.unpackbits(want[r].view(np.uint8), bitorder="little"))[0])
                  for r, _ in jobs]
        ok = backend.consume([p[0] for p in pairs], tokens)
        assert ok == [p[1].consume_token(t) for p, t in zip(pairs, tokens)]
        for a, b in pairs:
            assert a.is_error() == b.is_error() and a.is_stopped() == b.is_stopped()
            if not a.is_error():
                assert (backend.fill([MaskJob(a, 0)], 1) == backend.fill([MaskJob(b, 0)], 1)).all()
    assert pooled == [6] * 20
