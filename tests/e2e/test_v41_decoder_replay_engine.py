"""``v41_decoder_replay`` in the engine (``model/v41/paged.py`` with ``model/v41/replay.py``, spec §3.1).

The tiny random V4.1 of ``v41_tiny.py`` (window 16; the decoder is layers 6-9, so ``exact`` keeps a halo of
61 rows) in float32, cache quantization off, prefix caching off (the replay needs it off):

  * ``exact`` under batching, chunked prefill (chunks longer than the halo, so they are narrowed) and
    preemption: the greedy tokens of the plain model without replay, and the logprobs of an ``off`` engine
    run the same way within 1e-5;
  * ``v41``: one sequence in chunks of 24 gives the plain model's ``v41`` tokens on the same chunks (a
    narrowed chunk after another one within a window of it: the window bound at the kept rows is what the
    engine and the plain model agree on); in a batch, prompts no longer than the window give the tokens of no
    replay; prompt logprobs switch the narrowing off for their sequence (every row's output is read);
    DSpark speculation after narrowed prefills gives the tokens of no speculation;
  * the refusals: an unknown mode, the replay with prefix caching, the replay for a DeepSeek-V4 checkpoint.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.config.engine import EngineArgs, EngineConfig
from deepinfer.model.v41 import paged
from deepinfer.model.v41.loader import load_v41_model
from deepinfer.testing.staggered import assert_same, drain
from tests.e2e.v41_tiny import greedy_from, write_tiny_v41

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
MAX_TOKENS = 8
VOCAB = 4096  # the demo tokenizer's
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    path = write_tiny_v41(tmp_path_factory.mktemp("replay"), seed=1)
    plain, _ = load_v41_model(path, torch.float32, cache_qdq=False)
    return path, plain


@pytest.fixture
def narrowed_steps(monkeypatch) -> list[int]:
    """Counts the engine steps whose decoder layers ran on fewer rows than the step's."""
    count: list[int] = []
    original = paged._Step.narrowed

    def counting(self, kept):
        count.append(1)
        return original(self, kept)

    monkeypatch.setattr(paged._Step, "narrowed", counting)
    return count


def _engine(path, replay: str, **kw) -> LLMEngine:
    args = dict(model=str(path), device="cpu", dtype="float32", kv_cache_dtype="float32", block_size=128,
                max_num_seqs=8, max_num_batched_tokens=100, max_model_len=512, num_cache_blocks=16,
                load_progress=False, enable_prefix_caching=False, v41_decoder_replay=replay)
    args.update(kw)
    return LLMEngine.from_engine_args(**args)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("key_lists", [False, True])
def test_exact_equals_off_batched_chunked_preempted(tiny, narrowed_steps, key_lists) -> None:
    """Per sequence (the CPU reference) and with the device build's key lists (``PagedV41.key_lists``: the
    CSA2 state of every sequence at once, narrowed to the kept rows before the re-indexing layers 7 and 9)."""
    path, plain = tiny
    prompts = _prompts([5, 17, 62, 90, 122, 124, 126, 200, 230], seed=11)
    arrivals = {0: [(f"r{i}", p) for i, p in enumerate(prompts[:4])], 2: [(f"r{i}", p) for i, p in
                                                                           enumerate(prompts) if i >= 4]}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    runs = {}
    for mode in ("off", "exact"):
        # 4 blocks of 128 positions for 9 sequences of up to 238: preemption and recomputation.
        engine = _engine(path, mode, num_cache_blocks=4)
        engine.model.key_lists = key_lists
        runs[mode] = drain(engine, arrivals, params, logprobs=True, check_integrity=True)
        assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
        if mode == "off":
            assert not narrowed_steps
    assert narrowed_steps, "the test must narrow prefill chunks"
    assert_same(runs["exact"], runs["off"], 1e-5)
    for i, ids in enumerate(prompts):
        assert runs["exact"][f"r{i}"][0] == plain.greedy(torch.tensor(ids), MAX_TOKENS), f"prompt {i}"


def _plain_chunked_greedy(plain, ids: list[int], chunk: int, replay: str) -> tuple[list[int], list[float]]:
    """The plain model's greedy tokens and their logprobs after a prefill fed in chunks of ``chunk`` tokens."""
    cache, t = plain.new_cache(), torch.tensor(ids)
    for lo in range(0, len(ids), chunk):
        logits = plain(t[lo : lo + chunk], cache, replay)
    return greedy_from(plain, logits, cache, MAX_TOKENS)


def test_v41_equals_the_plain_model_on_the_same_chunks(tiny, narrowed_steps) -> None:
    path, plain = tiny
    prompts = _prompts([17, 40, 100, 200], seed=12)
    engine = _engine(path, "v41", max_num_seqs=1, max_num_batched_tokens=24)  # one sequence: chunks of 24
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    got = drain(engine, {0: [(f"r{i}", p) for i, p in enumerate(prompts)]}, params, logprobs=True)
    assert narrowed_steps
    assert_same(got, {f"r{i}": _plain_chunked_greedy(plain, ids, 24, "v41") for i, ids in enumerate(prompts)}, 1e-5)
    assert any(got[f"r{i}"][0] != plain.greedy(torch.tensor(ids), MAX_TOKENS) for i, ids in enumerate(prompts)), \
        "v41 mode should change some tokens on these prompts"


def test_v41_short_prompts_equal_off_in_a_batch(tiny) -> None:
    path, plain = tiny
    prompts = _prompts([1, 7, 16, 16, 150, 200], seed=13)  # the long ones are narrowed next to the short ones
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    got = drain(_engine(path, "v41", max_num_batched_tokens=64), {0: [(f"r{i}", p) for i, p in enumerate(prompts)]},
                params, logprobs=True)
    short = {f"r{i}": _plain_chunked_greedy(plain, ids, len(ids), "off") for i, ids in enumerate(prompts[:4])}
    assert_same({rid: got[rid] for rid in short}, short, 1e-5)


def test_prompt_logprobs_keep_every_row(tiny, narrowed_steps) -> None:
    path, plain = tiny
    ids = _prompts([100], seed=14)[0]
    engine = _engine(path, "v41", max_num_batched_tokens=128)
    engine.add_request("a", {"prompt_token_ids": ids},
                       SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=1))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                result = out
    assert not narrowed_steps
    assert list(result.outputs[0].token_ids) == plain.greedy(torch.tensor(ids), MAX_TOKENS)
    assert all(math.isfinite(lp.logprob) for pos in result.prompt_logprobs[1:] for lp in pos.values())


def test_dspark_drafts_after_a_narrowed_prefill(tmp_path) -> None:
    """The DSpark context is written for the kept rows only: exactly the window the first block reads.
    Speculation stays lossless: the tokens of the same mode without it."""
    path = write_tiny_v41(tmp_path, seed=1, dspark=True)
    prompts = _prompts([10, 70, 150], seed=15)
    arrivals = {0: [(f"r{i}", p) for i, p in enumerate(prompts)]}
    plain = drain(_engine(path, "v41"), arrivals, GREEDY)
    spec = _engine(path, "v41", speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    assert drain(spec, arrivals, GREEDY) == plain


def test_refusals(tiny) -> None:
    path, _ = tiny
    base = dict(model=str(path), device="cpu", dtype="float32", enable_prefix_caching=False)
    with pytest.raises(ValueError, match=r"v41_decoder_replay: 'on' .*allowed: off, v41, exact"):
        EngineConfig.create(EngineArgs(**base, v41_decoder_replay="on"))
    with pytest.raises(ValueError, match=r"v41_decoder_replay: 'v41' .*enable_prefix_caching=False"):
        EngineConfig.create(EngineArgs(**{**base, "enable_prefix_caching": True}, v41_decoder_replay="v41"))
    with pytest.raises(ValueError, match=r"v41_decoder_replay: 'exact' applies to DeepSeek-V4.1 .*allowed .*: off"):
        EngineConfig.create(EngineArgs(device="cpu", v41_decoder_replay="exact"))  # the bundled V4 demo model
    assert EngineConfig.create(EngineArgs(**base, v41_decoder_replay="exact")).v41_decoder_replay == "exact"
