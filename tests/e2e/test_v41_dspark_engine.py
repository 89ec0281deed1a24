"""DSpark speculative decoding of DeepSeek-V4.1 in the engine changes no token, and drafts what the plain model
drafts.

A tiny random V4.1 checkpoint with its DSpark drafter (``v41_tiny.py``, float32, cache quantization off).
Its random drafter is almost never right, so two things are checked separately:

  * tokens: greedy requests give the plain model's greedy tokens (``DeepseekV41.greedy``) and the reference
    loop's (``model/v41/speculative.speculative_greedy``); seeded sampled requests give the tokens of the
    engine without speculation. Batched, prefill chunked by a small budget, a cache small enough to preempt,
    prefix hits, k = 1 and 5, fixed and confidence-aware verify length. After some steps the drafts are
    replaced by the reference continuation with planted errors, so every acceptance length and rollback
    depth occurs;
  * drafts: after every step, each decoding sequence's fresh drafts must be those the plain model proposes
    (``DeepseekV41.propose``, the oracle-checked module) from a cache of exactly its accepted tokens,
    verify length included -- so the context rows the engine keeps are right after rejected drafts (rolled
    back), preemption (recomputed) and prefix hits (found in the kept tails).
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.kv.spec_v41 import dspark_key
from deepinfer.model.v41.cache import V41Cache
from deepinfer.model.v41.loader import load_v41_model
from deepinfer.model.v41.speculative import speculative_greedy, verify_length
from deepinfer.ops.ref.step_rows import lookup
from deepinfer.sampling.rng import SALT_TARGET, gumbel_noise
from deepinfer.testing.staggered import drain
from tests.e2e.v41_tiny import write_tiny_v41

MAX_TOKENS = 12
VOCAB = 4096  # the demo tokenizer's
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    path = write_tiny_v41(tmp_path_factory.mktemp("v41_dspark"), seed=11, dspark=True)
    plain, _ = load_v41_model(path, torch.float32, cache_qdq=False, dspark=True)
    return path, plain


def _engine(path, k: int = 0, **kw) -> LLMEngine:
    args = dict(model=str(path), device="cpu", dtype="float32", kv_cache_dtype="float32", block_size=128,
                max_num_seqs=8, max_num_batched_tokens=48, max_model_len=512, num_cache_blocks=16,
                load_progress=False)
    if k:
        args["speculative_config"] = {"method": "dspark", "num_speculative_tokens": k}
    args.update(kw)
    return LLMEngine.from_engine_args(**args)


def _prompts(seed: int) -> list[list[int]]:
    """Several lengths; the last two share a 140-token prefix (a prefix hit of one 128-token block)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 30, 120, 124, 150, 150)]
    return prompts + [prompts[-1][:140] + [rng.randrange(3, VOCAB) for _ in range(20)]]


def _phases(prompts, rng: random.Random, prefix: str = "r") -> list[list[tuple[str, list[int]]]]:
    """Requests added together whenever the engine is idle: all but the last two at once in a random order
    (the long ones then outgrow the cache together), then the last two one after the other, so that the
    second finds the first's prefix still cached."""
    n = len(prompts)
    return [[(f"{prefix}{i}", prompts[i]) for i in rng.sample(range(n - 2), n - 2)],
            [(f"{prefix}{n - 2}", prompts[n - 2])], [(f"{prefix}{n - 1}", prompts[n - 1])]]


class DraftCheck:
    """The hook run after every step: checks fresh drafts against the plain model, then plants drafts.

    ``reference``: request id -> the expected tokens; ``plant``: chance that a sequence's next drafts are
    replaced by its reference continuation (with an error at a random draft, or none)."""

    def __init__(self, engine: LLMEngine, plain, k: int, varlen: bool, reference: dict, plant: float,
                 seed: int, device: str = "cpu") -> None:
        self.plain, self.k, self.varlen, self.reference, self.plant = plain, k, varlen, reference, plant
        self.device = device  # the plain model's
        self.rng = random.Random(seed)
        self.checked = self.full = 0
        self.drew: set[str] = set()  # the sequences the last step drew for: their drafts are fresh
        submit = engine.runner.submit

        def watch(plan, *a, **kw):
            self.drew = {w.seq_id for w in plan.work if w.num_samples}
            return submit(plan, *a, **kw)

        engine.runner.submit = watch

    def __call__(self, engine: LLMEngine) -> None:
        for seq in engine.scheduler.running:
            if seq.seq_id not in self.drew or seq.num_computed != seq.num_tokens - 1:
                continue  # no new drafts (or, after a preemption in this step, none any more)
            self._check(seq)
            if self.rng.random() < self.plant:
                ref = self.reference[seq.request.request_id]
                drafts = list(ref[seq.num_output:seq.num_output + self.k])
                if drafts and self.rng.random() < 0.6:
                    bad = self.rng.randrange(len(drafts))
                    drafts[bad] = (drafts[bad] + 1) % VOCAB
                seq.drafts = tuple(drafts)

    def _check(self, seq) -> None:
        ids = list(seq.token_ids)
        dev = self.device
        cache = self.plain.new_cache()
        self.plain(torch.tensor(ids[:-1], device=dev), cache)
        kw = {}
        if seq.params.temperature > 0:  # the target's seeded noise at the drafted positions
            block = self.plain.cfg.dspark.block_size
            drafted = torch.arange(len(ids), len(ids) + block, device=dev)  # positions of the drafts' tokens
            kw = dict(temperature=seq.params.temperature,
                      noise=gumbel_noise(torch.full((block,), seq.seed, device=dev), drafted, VOCAB, SALT_TARGET))
        block = self.plain.propose(ids[-1], cache, **kw)
        want = verify_length(block.confidence, self.k, self.varlen)
        got = seq.drafts
        assert len(got) <= want and got == tuple(block.tokens[:len(got)].tolist()), seq.seq_id
        if seq.max_output - seq.num_output >= self.k + 2:  # the output limit did not cut the block
            assert len(got) == want, seq.seq_id
            self.full += 1
        self.checked += 1


def _run(engine: LLMEngine, phases, params, hook=None) -> dict:
    """Step ``engine`` through ``phases`` (``_phases``) with the cache's integrity check and ``hook`` after
    every step; the finished requests' tokens by request id."""
    done: dict[str, list[int]] = {}
    for phase in phases:
        for rid, ids in phase:
            engine.add_request(rid, {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
            engine.cache.check_integrity()
            if hook is not None:
                hook(engine)
    return done


# k = 1 with the fixed verify length and k = 5 with the variable one: each k and each mode once (the one-sequence
# test below runs both modes at the drafter's block size).
@pytest.mark.parametrize("k,varlen", [(1, False), (5, True)], ids=["1-fixed", "5-varlen"])
def test_greedy_identical_batched_chunked_preempted_and_drafts_are_the_plain_models(tiny, k, varlen,
                                                                                    monkeypatch) -> None:
    path, plain = tiny
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1" if varlen else "0")
    prompts = _prompts(5)
    reference = {f"r{i}": plain.greedy(torch.tensor(p), MAX_TOKENS) for i, p in enumerate(prompts)}
    rng = random.Random(10 * k + varlen)
    # 2 history blocks: admitted at 120 and 124 tokens, two sequences outgrow them (preemption). Budgets cut
    # prompts differently.
    engine = _engine(path, k, max_num_batched_tokens=rng.choice([13, 29, 41]), num_cache_blocks=2)
    assert engine.config.speculative.varlen is varlen
    check = DraftCheck(engine, plain, k, varlen, reference, plant=0.5, seed=k)
    got = _run(engine, _phases(prompts, rng), GREEDY, check)
    assert got == reference
    assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert engine.scheduler.prefix_hits > 0, "the test must exercise a prefix hit"
    assert engine.cache.num_requests == 0
    assert check.checked >= 20 and check.full >= 10
    st = engine.spec_stats  # the engine's speculative metrics: every acceptance length occurred
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens and st.accepted_per_pos[k - 1] > 0
    assert st.mean_acceptance_length > 1


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_one_sequence_steps_are_the_reference_loops(tiny, varlen, monkeypatch) -> None:
    """Without planted drafts: the engine verifies the very drafts of ``speculative_greedy``, step by step."""
    path, plain = tiny
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1" if varlen else "0")
    prompt = _prompts(6)[2]
    ref = speculative_greedy(plain, torch.tensor(prompt), MAX_TOKENS + 10, 5, varlen)
    engine = _engine(path, 5, max_num_batched_tokens=64)
    verified = []
    real = engine.runner.submit

    def submit(plan, *a, **kw):
        verified.extend(w.token_ids[len(w.token_ids) - w.num_drafts:] for w in plan.work if w.num_drafts)
        return real(plan, *a, **kw)

    engine.runner.submit = submit
    assert drain(engine, {0: [("a", prompt)]}, GREEDY) == {"a": ref.tokens[:MAX_TOKENS]}
    # The reference's steps, to the engine's last: it drafts past the output limit as everywhere else (every
    # sequence of a verify step keeps its k + 1 inputs), and the reference ran 10 tokens longer.
    want = [tuple(d) for d in ref.drafts if len(d)][:len(verified)]  # (steps without drafts verify none)
    assert len(verified) >= 4 and [tuple(v) for v in verified] == want


def test_seeded_sampling_identical_to_no_speculation(tiny) -> None:
    path, plain = tiny
    prompts = _prompts(8)
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=MAX_TOKENS, ignore_eos=True, seed=123)
    rng = random.Random(4)
    phases = _phases(prompts, rng)
    plain_run = _run(_engine(path, max_num_batched_tokens=29, num_cache_blocks=2), phases, params)
    engine = _engine(path, 3, max_num_batched_tokens=29, num_cache_blocks=2)
    check = DraftCheck(engine, plain, 3, False, plain_run, plant=0.5, seed=2)
    assert _run(engine, phases, params, check) == plain_run
    assert engine.scheduler.num_preemptions > 0 and check.checked >= 10
    st = engine.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens and st.accepted_per_pos[2] > 0


def test_context_rows_and_draft_are_the_plain_modules(tiny) -> None:
    """The engine's stored context rows equal the plain model's (its prompt in chunks), and the plain module
    drafting from the engine's rows proposes the engine's drafts."""
    path, plain = tiny
    prompt = _prompts(9)[4]  # 150 tokens: prefill in chunks of 48 across a block boundary
    engine = _engine(path, 5)
    engine.add_request("a", {"prompt_token_ids": prompt}, GREEDY)
    while engine.scheduler.waiting or engine.scheduler.running[0].num_output == 0:
        engine.step()
    seq = engine.scheduler.running[0]
    ids = list(seq.token_ids)
    assert len(ids) == len(prompt) + 1 and len(seq.drafts) == 5
    cache = plain.new_cache()
    plain(torch.tensor(ids[:-1]), cache)
    table = torch.from_numpy(engine.input_batch.tables.arrays["window"][engine.input_batch.slot_of[seq.seq_id]])
    pos = torch.arange(len(prompt))
    rows = lookup(table.unsqueeze(0), torch.zeros_like(pos), pos, engine.config.cache.block_size)
    held = rows >= 0  # older window blocks may be released; the last sliding_window positions are not
    assert bool(held[-plain.cfg.sliding_window:].all())
    mine = V41Cache(plain.cfg.num_hidden_layers, len(plain.mtp)).draft  # the engine's rows where it has them
    for s, lc in enumerate(mine):
        lc.window = torch.zeros_like(cache.draft[s].window)
        lc.window[held] = engine.storage.get(dspark_key(s), "window_kv")[rows[held]]
        diff = (lc.window[held] - cache.draft[s].window[held]).abs().max().item()
        assert diff <= 1e-4, (s, diff)  # fp32 rounding: the prompt ran in chunks of other shapes
    from_engine = plain.mtp.propose(plain.embed, plain.head, mine, ids[-1], cache_qdq=False)
    assert tuple(from_engine.tokens.tolist()) == seq.drafts
    assert torch.equal(from_engine.tokens, plain.propose(ids[-1], cache).tokens)
