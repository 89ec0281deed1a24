"""``DEEPINFER_BATCH_INVARIANT=1`` end to end on the CPU: a request's tokens and logprobs are the same bits
alone and in any batch, whatever the schedule.

Reference: every request alone, no prefix cache, no chunking, no speculation. Compared bit for bit (token
ids and every returned logprob) against: all requests at once in shuffled orders with up to 2, 7 and 64
sequences per step (64: every prompt twice); step budgets of 256 and 2048 tokens (chunked prefill); a small
cache that forces preemption and recompute; prefix-cache hits at block boundaries; async scheduling; a fresh
interpreter building its own engine (a restart); and, on
the bundled demo model (a trained MTP layer), speculative decoding with k = 2 against plain decoding alone
(greedy and seeded). Half of the tiny model's 32 requests are greedy, half seeded top-p sampling. And with
the mode off, two step budgets must give different bits somewhere, so that this file can fail.

A tiny random checkpoint (SWA, CSA m=4, HCA m=128 layers, 128-token window; vocabulary 512) with prompts of
1..400 tokens, so that chunks and hits fall on every kind of window boundary.
"""

from __future__ import annotations

import multiprocessing
import random

import pytest

from deepinfer import LLMEngine, SamplingParams
from deepinfer.assets import demo_model_dir
from deepinfer.testing.make_checkpoint import PRESETS, write_random_checkpoint

VOCAB = 512
N_PROMPTS = 32
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_bi")
    write_random_checkpoint(path, dict(PRESETS["tiny"], torch_dtype="float32", vocab_size=VOCAB), seed=11)
    return path


def _engine(model, invariant: bool = True, **kw) -> LLMEngine:
    args = dict(model=str(model) if model else None, tokenizer=str(demo_model_dir()), device="cpu", dtype="float32",
                block_size=128, max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=1024,
                load_progress=False)
    args.update(kw)
    with pytest.MonkeyPatch.context() as mp:  # the mode is read once, when the engine's config is built
        mp.setenv("DEEPINFER_BATCH_INVARIANT", "1" if invariant else "0")
        mp.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")  # fixed k: which positions a step covers is fixed
        engine = LLMEngine.from_engine_args(**args)
    assert engine.config.batch_invariant is invariant
    return engine


def _prompts(n: int = N_PROMPTS, seed: int = 3, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 127, 128, 129, 255, 256, 257, 400] + [rng.randrange(2, 400) for _ in range(n - 8)]
    return [[rng.randrange(3, vocab) for _ in range(k)] for k in lengths]


def _params(i: int, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.9, top_p=0.9, seed=1000 + i, max_tokens=max_tokens, logprobs=2,
                              ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)


def _result(out) -> tuple:
    c = out.outputs[0]
    return tuple(c.token_ids), tuple(tuple(sorted((t, lp.logprob) for t, lp in pos.items())) for pos in c.logprobs)


def _drain(engine: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]]) -> dict:
    for rid, prompt, params in requests:
        engine.add_request(rid, {"prompt_token_ids": prompt}, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = _result(out)
        engine.cache.check_integrity()
    return done


def _alone(engine: LLMEngine, requests) -> dict:
    done = {}
    for r in requests:
        done.update(_drain(engine, [r]))
    return done


def _requests(prompts, order=None, tag: str = "") -> list:
    order = range(len(prompts)) if order is None else order
    return [(f"{tag}{i}", prompts[i], _params(i)) for i in order]


def _untagged(done: dict, tag: str) -> dict:
    return {rid[len(tag):]: v for rid, v in done.items() if rid.startswith(tag)}


@pytest.fixture(scope="module")
def reference(tiny_dir) -> dict:
    return _alone(_engine(tiny_dir, enable_prefix_caching=False), _requests(_prompts()))


@pytest.mark.parametrize("max_num_seqs,seed", [(2, 0), (7, 1), (64, 2)])
def test_batches_of_any_size_and_order_equal_alone(tiny_dir, reference, max_num_seqs, seed) -> None:
    prompts = _prompts()
    order = list(range(len(prompts)))
    random.Random(seed).shuffle(order)
    requests = _requests(prompts, order, "a")
    if max_num_seqs == 64:  # every prompt twice: 64 sequences in one step
        requests += _requests(prompts, order[::-1], "b")
    done = _drain(_engine(tiny_dir, max_num_seqs=max_num_seqs, enable_prefix_caching=False), requests)
    assert _untagged(done, "a") == reference
    if max_num_seqs == 64:
        assert _untagged(done, "b") == reference


@pytest.mark.parametrize("budget", [256, 2048])
def test_step_budget_chunking_equals_alone(tiny_dir, reference, budget) -> None:
    engine = _engine(tiny_dir, max_num_batched_tokens=budget, max_num_seqs=16)
    assert _drain(engine, _requests(_prompts())) == reference


def test_preemption_and_recompute_equal_alone(tiny_dir, reference) -> None:
    engine = _engine(tiny_dir, max_num_seqs=16, max_num_batched_tokens=512, num_cache_blocks=6)
    assert _drain(engine, _requests(_prompts())) == reference
    assert engine.scheduler.num_preemptions > 0, "the workload must exercise preemption"


def test_async_scheduling_equals_alone(tiny_dir, reference) -> None:
    engine = _engine(tiny_dir, async_scheduling=True, max_num_batched_tokens=256, max_num_seqs=16)
    assert _drain(engine, _requests(_prompts())) == reference


def test_prefix_cache_hits_equal_recompute(tiny_dir) -> None:
    """Requests extending earlier prompts hit their cached blocks (boundaries 128, 256); a hit changes which
    positions a step computes, never the bits."""
    rng = random.Random(9)
    bases = [p for p in _prompts() if len(p) >= 129][:4]
    extended = [b + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 90))] for b in bases]
    ref = _alone(_engine(tiny_dir, enable_prefix_caching=False), _requests(extended))
    engine = _engine(tiny_dir, max_num_seqs=8)
    _drain(engine, _requests(bases, tag="base"))
    queries, hits = engine.scheduler.prefix_queries, engine.scheduler.prefix_hits
    assert _drain(engine, _requests(extended)) == ref
    assert engine.scheduler.prefix_hits - hits >= 128 * len(extended), "every extended prompt must hit"
    assert engine.scheduler.prefix_queries > queries


def alone_in_this_process(model_dir: str, requests: list) -> dict:
    """``_alone`` on a new engine; what a freshly started interpreter runs (module level: spawn imports it)."""
    return _alone(_engine(model_dir, enable_prefix_caching=False), requests)


def test_fresh_process_equals_alone(tiny_dir, reference) -> None:
    """A restart: a new interpreter (its own allocator, thread pools and engine) gives the same bits."""
    requests = _requests(_prompts())[:4]  # the fixed lengths 1..129: greedy and seeded, across a block boundary
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = pool.apply(alone_in_this_process, (str(tiny_dir), requests))
    assert got == {rid: reference[rid] for rid, _, _ in requests}


def test_default_mode_differs_somewhere(tiny_dir) -> None:
    """Without the mode the CPU GEMMs round a row differently with the batch: the same kind of comparison (one
    step budget against another) finds a difference."""
    prompts = _prompts(16, seed=5)
    runs = [_drain(_engine(tiny_dir, invariant=False, enable_prefix_caching=False, max_num_batched_tokens=budget),
                   _requests(prompts)) for budget in (8192, 256)]
    assert runs[0].keys() == runs[1].keys()
    assert any(runs[0][r] != runs[1][r] for r in runs[0]), "expected the default mode to differ in some logprob"


def _demo_requests() -> list:
    rng = random.Random(8)
    return [(str(i), [rng.randrange(3, 4096) for _ in range(n)], _params(i, max_tokens=8))
            for i, n in enumerate((1, 60, 129, 200, 257))]


def test_demo_speculation_equals_plain_decoding_alone() -> None:
    """The demo model's trained MTP layer (~45% acceptance), k = 2 in batches: verify steps (k + 1 rows per
    sequence; fixed k, DEEPINFER_ENABLE_MTP_VARLEN unset) give the bits of plain decoding alone; greedy and
    seeded requests."""
    ref = _alone(_engine(None, enable_prefix_caching=False, max_model_len=512), _demo_requests())
    engine = _engine(None, max_model_len=512, max_num_seqs=5, max_num_batched_tokens=256,
                     speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert _drain(engine, _demo_requests()) == ref
    assert engine.spec_stats.num_accepted_tokens > 0, "the MTP layer's drafts must be accepted sometimes"
