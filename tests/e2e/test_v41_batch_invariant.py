"""``DEEPINFER_BATCH_INVARIANT=1`` for DeepSeek-V4.1 on the CPU (``model/v41/invariant.py``): a request's tokens
and logprobs are the same bits alone and in any batch, whatever the schedule.

Reference: every request alone, no prefix cache, each prompt in one chunk, no speculation. Compared bit for
bit (token ids and every returned logprob) against: all requests at once in shuffled orders with 3 and 8
sequences per step, with a step budget that cuts prefills into chunks of other sizes and a cache small enough
to force preemption and recompute; prefix-cache hits at a block boundary (exact hits); and DSpark speculative decoding
with a fixed verify length (k = 3), greedy and seeded. Half of the requests are greedy, half seeded top-p
sampling. With the mode off, two step budgets must give different bits somewhere, so that this file can fail.

The tiny random V4.1 checkpoint of the engine tests (``v41_tiny.py``: window-only layers, ratio-2 KV sources
and a reusing layer, a ratio-1 candidate source, reusing and re-indexing layers (the two-level indexer),
Engram, the lagged mHC, score-only routing; a 16-token window), with the DSpark drafter.
"""

from __future__ import annotations

import random

import pytest

from deepinfer import LLMEngine, SamplingParams
from tests.e2e.test_batch_invariant import _alone, _drain  # the V4 file's drivers: alone vs batched
from tests.e2e.v41_tiny import write_tiny_v41

VOCAB = 4096  # the demo tokenizer's
MAX_TOKENS = 4
LENGTHS = [1, 9, 23, 40, 131]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # Eight of the ten layers keep every kind (the re-indexing layer 7 included); fewer Sinkhorn iterations:
    # the mode runs each token alone, so a token's layer cost is what the test pays.
    return write_tiny_v41(tmp_path_factory.mktemp("v41_bi"), seed=21, dspark=True, num_hidden_layers=8,
                          dspark_target_layer_ids=[5, 6, 7], hc_sinkhorn_iters=4)


def _engine(path, invariant: bool = True, **kw) -> LLMEngine:
    args = dict(model=str(path), device="cpu", dtype="float32", block_size=128, max_num_seqs=8,
                max_num_batched_tokens=2048, max_model_len=512, num_cache_blocks=24, load_progress=False)
    args.update(kw)
    with pytest.MonkeyPatch.context() as mp:  # the mode is read once, when the engine's config is built
        mp.setenv("DEEPINFER_BATCH_INVARIANT", "1" if invariant else "0")
        mp.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")  # fixed k: which positions a step covers is fixed
        engine = LLMEngine.from_engine_args(**args)
    assert engine.config.batch_invariant is invariant
    return engine


def _prompts(seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.9, top_p=0.9, seed=1000 + i, max_tokens=MAX_TOKENS, logprobs=2,
                              ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, ignore_eos=True)


def _requests(prompts, order=None) -> list:
    order = range(len(prompts)) if order is None else order
    return [(str(i), prompts[i], _params(i)) for i in order]


@pytest.fixture(scope="module")
def reference(tiny_dir) -> dict:
    return _alone(_engine(tiny_dir, enable_prefix_caching=False), _requests(_prompts()))


@pytest.mark.parametrize("max_num_seqs,budget,blocks,seed", [(4, 37, 2, 0), (8, 2048, 24, 1)])
def test_batches_in_any_order_chunked_preempted_equal_alone(tiny_dir, reference, max_num_seqs, budget, blocks,
                                                            seed) -> None:
    order = list(range(len(LENGTHS)))
    random.Random(seed).shuffle(order)
    engine = _engine(tiny_dir, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, num_cache_blocks=blocks,
                     enable_prefix_caching=False)
    assert _drain(engine, _requests(_prompts(), order)) == reference
    if blocks == 2:
        assert engine.scheduler.num_preemptions > 0, "the workload must exercise preemption"


def test_prefix_cache_hits_equal_recompute(tiny_dir) -> None:
    """Requests extending earlier prompts hit their cached first block; a hit changes which positions a step
    computes, never the bits."""
    rng = random.Random(9)
    bases = [p for p in _prompts() if len(p) >= 129]
    extended = [b + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 40))] for b in bases]
    ref = _alone(_engine(tiny_dir, enable_prefix_caching=False), _requests(extended))
    engine = _engine(tiny_dir, max_num_batched_tokens=64)
    _drain(engine, [(f"base{i}", p, _params(i)) for i, p in enumerate(bases)])
    hits = engine.scheduler.prefix_hits
    assert _drain(engine, _requests(extended)) == ref
    assert engine.scheduler.prefix_hits - hits >= 128 * len(extended), "every extended prompt must hit"


def test_dspark_fixed_verify_length_equals_plain(tiny_dir, reference) -> None:
    engine = _engine(tiny_dir, max_num_batched_tokens=64,
                     speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    assert _drain(engine, _requests(_prompts(), list(range(len(LENGTHS)))[::-1])) == reference
    assert engine.spec_stats.num_draft_tokens > 0


def test_default_mode_differs_somewhere(tiny_dir) -> None:
    """Teeth: without the mode, cutting the same prompts into other chunks changes some bits."""
    a = _drain(_engine(tiny_dir, invariant=False, enable_prefix_caching=False), _requests(_prompts()))
    b = _drain(_engine(tiny_dir, invariant=False, enable_prefix_caching=False, max_num_batched_tokens=23),
               _requests(_prompts()))
    assert a.keys() == b.keys() and a != b
