"""``DEEPINFER_BATCH_INVARIANT=1`` end to end on the GPU (Triton kernels, CUDA graphs, bf16): a request's tokens
and logprobs are the same bits alone and in any batch, whatever the schedule.

The CPU file (tests/e2e/test_batch_invariant.py) with the bundled demo model on CUDA: 32 requests of 1..600
tokens, half greedy, half seeded top-p sampling, each first run alone (no prefix cache, no chunking below
8192 tokens, no speculation); then compared bit for bit (token ids and every returned logprob) with all of
them at once in shuffled orders with up to 7 and 64 sequences per step (64: every prompt twice); step budgets
of 256 and 2048 tokens (chunked prefill); a small cache that forces preemption; prefix-cache hits; async
scheduling; speculative decoding with the trained MTP layer (k = 2, fixed) against plain decoding alone; and
a fresh interpreter building its own engine (a restart). With the mode off, batching must change some bits,
so that the file can fail.
"""

from __future__ import annotations

import multiprocessing
import random

import pytest
import torch

from tests.e2e.test_batch_invariant import _alone, _drain, _engine, _params, _requests, _untagged

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

N_PROMPTS = 32
MAX_TOKENS = 16
VOCAB = 4096  # the demo model's


def _gpu(invariant: bool = True, **kw):
    args = dict(device="cuda", dtype="bfloat16", max_model_len=1024, cache_memory_gb=2.0)
    args.update(kw)
    return _engine(None, invariant, **args)


def _prompts(n: int = N_PROMPTS, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 127, 128, 129, 255, 256, 257, 600] + [rng.randrange(2, 600) for _ in range(n - 8)]
    return [[rng.randrange(3, VOCAB) for _ in range(k)] for k in lengths]


def _reqs(prompts, order=None, tag: str = "") -> list:
    return [(rid, p, _params(int(rid[len(tag):]), MAX_TOKENS)) for rid, p, _ in _requests(prompts, order, tag)]


@pytest.fixture(scope="module")
def reference() -> dict:
    return _alone(_gpu(enable_prefix_caching=False), _reqs(_prompts()))


@pytest.mark.parametrize("max_num_seqs,seed", [(2, 0), (7, 1), (64, 2)])
def test_batches_of_any_size_and_order_equal_alone(reference, max_num_seqs, seed) -> None:
    prompts = _prompts()
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    requests = _reqs(prompts, order, "a")
    if max_num_seqs == 64:
        requests += _reqs(prompts, order[::-1], "b")
    done = _drain(_gpu(max_num_seqs=max_num_seqs, enable_prefix_caching=False), requests)
    assert _untagged(done, "a") == reference
    if max_num_seqs == 64:
        assert _untagged(done, "b") == reference


@pytest.mark.parametrize("budget", [256, 2048])
def test_step_budget_chunking_equals_alone(reference, budget) -> None:
    assert _drain(_gpu(max_num_batched_tokens=budget, max_num_seqs=16), _reqs(_prompts())) == reference


def test_preemption_async_and_restart_equal_alone(reference) -> None:
    engine = _gpu(max_num_seqs=16, max_num_batched_tokens=512, num_cache_blocks=8)
    assert _drain(engine, _reqs(_prompts())) == reference
    assert engine.scheduler.num_preemptions > 0, "the workload must exercise preemption"
    assert _drain(_gpu(async_scheduling=True, max_num_seqs=16), _reqs(_prompts())) == reference


def test_prefix_cache_hits_equal_recompute() -> None:
    rng = random.Random(9)
    bases = [p for p in _prompts() if len(p) >= 129][:6]
    extended = [b + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 200))] for b in bases]
    ref = _alone(_gpu(enable_prefix_caching=False), _reqs(extended))
    engine = _gpu(max_num_seqs=8)
    _drain(engine, _reqs(bases, tag="base"))
    hits = engine.scheduler.prefix_hits
    assert _drain(engine, _reqs(extended)) == ref
    assert engine.scheduler.prefix_hits - hits >= 128 * len(extended), "every extended prompt must hit"


def test_speculation_equals_plain_decoding_alone() -> None:
    prompts = _prompts(8, seed=8)
    ref = _alone(_gpu(enable_prefix_caching=False), _reqs(prompts))
    engine = _gpu(max_num_seqs=8, max_num_batched_tokens=256,
                  speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert _drain(engine, _reqs(prompts)) == ref
    assert engine.spec_stats.num_accepted_tokens > 0, "the MTP layer's drafts must be accepted sometimes"


def alone_in_this_process(requests: list) -> dict:
    """``_alone`` on a new engine; what a freshly started interpreter runs (module level: spawn imports it)."""
    return _alone(_gpu(enable_prefix_caching=False), requests)


def test_fresh_process_equals_alone(reference) -> None:
    """A restart: a new interpreter (its own CUDA context, allocator, graphs and compiled kernels' launch state)
    gives the same bits."""
    requests = _reqs(_prompts())[:8]
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = pool.apply(alone_in_this_process, (requests,))
    assert got == {rid: reference[rid] for rid, _, _ in requests}


def test_default_mode_differs_somewhere() -> None:
    prompts = _prompts(16, seed=5)
    alone = _alone(_gpu(invariant=False, enable_prefix_caching=False), _reqs(prompts))
    batched = _drain(_gpu(invariant=False, enable_prefix_caching=False, max_num_seqs=16), _reqs(prompts))
    assert any(alone[r] != batched[r] for r in alone), "expected the default mode to differ in some logprob"
