"""Speculative decoding with the MTP layer changes no output: greedy and seeded sampled requests give the
same tokens (and logprobs, stop reasons, texts) with speculation on (k = 1..4) as off, under continuous
batching, chunked prefill and preemption, with the cache manager's integrity check clean after every step.

Two models: a tiny random checkpoint (its random MTP layer is almost never right, so nearly every draft is
rolled back; a second run replaces its drafts by the reference output with planted errors, so every
acceptance length and rollback depth occurs), and the bundled demo model (a trained MTP layer, ~45%).
"""

from __future__ import annotations

import random

import pytest

from deepinfer import LLMEngine, SamplingParams
from deepinfer.assets import demo_model_dir
from deepinfer.config.engine import EngineArgs, EngineConfig
from deepinfer.testing.make_checkpoint import PRESETS, write_random_checkpoint

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_mtp")
    native = dict(PRESETS["tiny"], torch_dtype="float32")
    write_random_checkpoint(path, native, seed=4)
    return path


def _engine(model=None, k: int = 0, **kw) -> LLMEngine:
    args = dict(model=str(model) if model else None, tokenizer=str(demo_model_dir()), device="cpu", dtype="float32",
                block_size=128, max_num_seqs=8, max_num_batched_tokens=40, load_progress=False)
    if k:
        args["speculative_config"] = {"method": "mtp", "num_speculative_tokens": k}
    args.update(kw)
    return LLMEngine.from_engine_args(**args)


def _prompts(vocab: int, lengths=(3, 121, 118, 40)) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _drain(engine: LLMEngine, prompts, params, stagger: int = 1, on_step=None,
           abort_at: dict[int, str] | None = None) -> dict:
    """Submit prompt i at step i * stagger (``params``: one for all, or a list), abort ``abort_at[step]``;
    return the final outputs by request id. The cache is checked after every step and must end empty."""
    done, step, pending = {}, 0, list(enumerate(prompts))
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] * stagger <= step:
            i, p = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": p} if isinstance(p, list) else p,
                               params[i] if isinstance(params, list) else params)
        if abort_at and step in abort_at:
            engine.abort_request(abort_at[step])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.cache.check_integrity()
        if on_step is not None:
            on_step(engine)
        step += 1
        assert step < 1000, "the engine did not finish"
    engine.step()  # an async engine may hold one more step's (ignored) results
    assert engine.cache.num_requests == 0
    engine.cache.check_integrity()
    return done


def _tokens(done: dict) -> dict:
    return {r: [list(c.token_ids) for c in o.outputs] for r, o in done.items()}


def _planted_drafts(reference: dict, k: int, seed: int):
    """After each step: replace every running sequence's drafts by its reference continuation with errors
    planted at random draft positions (or none), so acceptance lengths 0..k all occur."""
    rng = random.Random(seed)

    def hook(engine: LLMEngine) -> None:
        for seq in engine.scheduler.running:
            ref = reference[seq.request.request_id][seq.index]
            nxt = ref[seq.num_output : seq.num_output + k]
            drafts = list(nxt)
            if drafts and rng.random() < 0.6:
                bad = rng.randrange(len(drafts))
                drafts[bad] = (drafts[bad] + 1) % 90 + 3
            seq.drafts = tuple(drafts)
    return hook


def test_config_errors_name_the_field(tiny_dir) -> None:
    bad = [({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
           ({"method": "mtp", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
           ({"method": "mtp", "num_speculative_tokens": 5}, "speculative_config.num_speculative_tokens"),
           ({"method": "mtp", "num_speculative_tokens": 2, "draft": 1}, "speculative_config.draft"),
           ({"method": "mtp", "num_speculative_tokens": 2, "draft_head": "int4"}, "speculative_config.draft_head"),
           ("{not json", "speculative_config")]
    for value, field in bad:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            EngineConfig.create(EngineArgs(model=str(tiny_dir), speculative_config=value))
    # Together with async scheduling on one device (several: tests/e2e/test_parallel_speculative.py).
    assert EngineConfig.create(EngineArgs(model=str(tiny_dir), async_scheduling=True,
                                          speculative_config='{"method": "mtp", "num_speculative_tokens": 1}'))
    cfg = EngineConfig.create(EngineArgs(model=str(tiny_dir),
                                         speculative_config='{"method": "mtp", "num_speculative_tokens": 3}'))
    assert cfg.speculative.num_speculative_tokens == 3 and cfg.speculative.varlen is False
    # The drafts' head: an FP8 copy of the LM head on CUDA by default, the model's own on the CPU
    assert cfg.speculative.draft_head == "auto" and not cfg.speculative.fp8_draft_head("cpu")
    assert cfg.speculative.fp8_draft_head("cuda")


@pytest.fixture(scope="module")
def tiny_reference(tiny_dir):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts(97)
    return prompts, params, _tokens(_drain(_engine(tiny_dir, num_cache_blocks=2), prompts, params))


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_tiny_greedy_identical_with_batching_chunking_and_preemption(tiny_dir, tiny_reference, k) -> None:
    prompts, params, ref = tiny_reference
    # 2 history blocks for sequences of up to 133 tokens (2 blocks each past 128): preemption happens; a
    # 40-token budget chunks the prompts. The drafts are the reference continuation with planted errors.
    engine = _engine(tiny_dir, k, num_cache_blocks=2)
    assert _tokens(_drain(engine, prompts, params, on_step=_planted_drafts(ref, k, seed=k))) == ref
    assert engine.scheduler.num_preemptions > 0
    st = engine.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert st.accepted_per_pos[k - 1] > 0  # whole drafts accepted, too


def test_tiny_greedy_identical_with_its_own_drafts(tiny_dir, tiny_reference) -> None:
    """The random MTP layer's own drafts: nearly all rejected and rolled back."""
    prompts, params, ref = tiny_reference
    engine = _engine(tiny_dir, 3, num_cache_blocks=2)
    assert _tokens(_drain(engine, prompts, params)) == ref
    assert engine.spec_stats.num_draft_tokens > 0


@pytest.fixture(scope="module")
def demo_reference():
    prompts = ["The quick brown fox", "Once upon a time", "In the beginning"]
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return prompts, greedy, _tokens(_drain(_engine(max_num_batched_tokens=16), prompts, greedy))


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_demo_greedy_identical(demo_reference, k) -> None:
    prompts, greedy, ref = demo_reference
    engine = _engine(None, k, max_num_batched_tokens=16)
    assert _tokens(_drain(engine, prompts, greedy)) == ref
    st = engine.spec_stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0
    assert st.mean_acceptance_length > 1.2  # the trained MTP layer is right about half the time


def test_demo_outputs_identical_with_an_fp8_draft_head(demo_reference) -> None:
    """Drafts picked from the FP8 copy of the LM head (``model/draft_head.py``, CUDA's default) change at most how
    many drafts are accepted: greedy and seeded outputs are those without speculation, and the drafts still hit."""
    from deepinfer.model.device import FP8Linear

    prompts, greedy, ref = demo_reference
    engine = _engine(None, 3, max_num_batched_tokens=16,
                     speculative_config={"method": "mtp", "num_speculative_tokens": 3, "draft_head": "fp8"})
    assert isinstance(engine.model.draft_head, FP8Linear)
    assert _tokens(_drain(engine, prompts, greedy)) == ref
    assert engine.spec_stats.mean_acceptance_length > 1.2
    seeded = SamplingParams(temperature=0.8, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = _tokens(_drain(_engine(max_num_batched_tokens=16), prompts, seeded))
    assert _tokens(_drain(engine, prompts, seeded)) == plain


def test_demo_sampled_outputs_identical_with_every_processor() -> None:
    """Seeded sampling with temperature, top-k/p, min-p, penalties, min_tokens, logprobs, stop strings and
    n > 1: tokens, texts and finish reasons are the same with speculation on and off; logprobs too, up to
    the CPU path's last bits (its logits move by ~1e-7 with the step's shape)."""
    prompts = ["Once upon a time", "Hello world, this is"]
    variants = [
        SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True, n=2, logprobs=2),
        SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.02, seed=5, max_tokens=16, min_tokens=8,
                       repetition_penalty=1.2, presence_penalty=0.3, frequency_penalty=0.2, logprobs=1),
        SamplingParams(temperature=0.7, seed=3, max_tokens=16, stop=["\n", "the"]),
    ]
    requests = [(p, v) for v in variants for p in prompts]

    def run(k):
        engine = _engine(None, k, max_num_batched_tokens=24)
        done = _drain(engine, [p for p, _ in requests], [v for _, v in requests])
        return {r: [(list(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
                for r, o in done.items()}, {r: [c.logprobs for c in o.outputs] for r, o in done.items()}, engine

    ref, ref_lp, _ = run(0)
    got, got_lp, engine = run(3)
    assert got == ref
    assert engine.spec_stats.num_accepted_tokens > 0
    for r in ref_lp:
        for a, b in zip(ref_lp[r], got_lp[r]):
            assert (a is None) == (b is None)
            for pa, pb in zip(a or (), b or ()):
                assert pa.keys() == pb.keys()
                for t in pa:
                    assert pa[t].rank == pb[t].rank and abs(pa[t].logprob - pb[t].logprob) < 1e-4


def test_max_tokens_mid_draft_and_abort_free_the_cache() -> None:
    engine = _engine(None, 4)
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    engine.add_request("a", "def fibonacci(n):", params)
    engine.add_request("b", "import os\n", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    outs = {}
    for _ in range(4):
        for o in engine.step():
            outs[o.request_id] = o
        engine.cache.check_integrity()
    engine.abort_request("b")
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
        engine.cache.check_integrity()
    assert len(outs["a"].outputs[0].token_ids) == 7 and outs["a"].outputs[0].finish_reason == "length"
    assert outs["b"].outputs[0].finish_reason == "abort"
    assert engine.cache.num_requests == 0


def test_variable_draft_length_follows_acceptance(tiny_dir, tiny_reference, monkeypatch) -> None:
    """DEEPINFER_ENABLE_MTP_VARLEN=1: a request whose drafts keep failing stops drafting (and probes again
    later); the outputs stay the same."""
    from deepinfer.sched.draft_length import draft_length, update_rate

    assert draft_length(1.0, 4) == 4 and draft_length(0.6, 4) == 2 and draft_length(0.1, 4) == 0
    rate = 0.0
    assert update_rate(rate, 0, 0) > rate  # a step without drafts recovers towards probing
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    prompts, params, ref = tiny_reference
    engine = _engine(tiny_dir, 4, num_cache_blocks=2)
    assert engine.config.speculative.varlen
    assert _tokens(_drain(engine, prompts, params)) == ref
    st = engine.spec_stats
    # The random MTP layer is nearly always wrong: fewer than k = 4 drafts per verify step on average.
    assert st.num_drafts > 0 and st.num_draft_tokens < 3 * st.num_drafts


@pytest.mark.parametrize("k", [1, 3])
def test_decode_steps_keep_k_drafts_up_to_the_output_limit(tiny_dir, tiny_reference, k) -> None:
    """With a fixed draft length every decoding sequence of a step verifies k drafts, up to its very last step
    (a step whose sequences differ in input count runs eagerly on a GPU instead of replaying a CUDA graph);
    the drafts past the output limit are drawn and dropped: the tokens stay the plain engine's."""
    prompts, params, ref = tiny_reference
    engine = _engine(tiny_dir, k, max_num_batched_tokens=512)
    shapes, submit = [], engine.runner.submit

    def record(plan, *a, **kw):
        shapes.extend((w.seq_id, len(w.token_ids) + w.num_placeholders, w.num_drafts) for w in plan.work
                      if w.num_samples and len(w.token_ids) + w.num_placeholders == w.num_samples)  # not prefill
        return submit(plan, *a, **kw)

    engine.runner.submit = record
    assert _tokens(_drain(engine, prompts, params)) == ref  # its own drafts (planted ones end with the reference)
    assert len(shapes) >= len(prompts) * 3
    assert all(n == k + 1 and d == k for _, n, d in shapes), shapes


@pytest.mark.parametrize("k,async_scheduling", [(1, False), (3, False), (4, True)])
def test_prompts_at_the_model_length_keep_their_drafts_inside_it(tiny_dir, k, async_scheduling) -> None:
    """Sequences that end exactly at ``max_model_len``, a multiple of the block size (a slot's block table holds
    no position past it): every verify step's drafts stay inside the length, and the tokens are the plain
    engine's."""
    kw = dict(max_model_len=256, max_num_batched_tokens=512)
    prompts = _prompts(97, lengths=(254, 255, 250, 200))
    params = [SamplingParams(temperature=0, max_tokens=256 - len(p), ignore_eos=True) for p in prompts]
    want = _tokens(_drain(_engine(tiny_dir, **kw), prompts, params))
    engine = _engine(tiny_dir, k, async_scheduling=async_scheduling, **kw)
    assert _tokens(_drain(engine, prompts, params)) == want
    assert engine.spec_stats.num_draft_tokens > 0
