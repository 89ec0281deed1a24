"""The engine serves DeepSeek-V4.1: greedy tokens equal the plain model's (and hence the oracle's).

Tiny random V4.1 checkpoints (``v41_tiny.py``: window-only layers, ratio-2 sources and a reusing layer, a
ratio-1 candidate source, reusing and re-indexing layers, Engram, mHC, MoE) run in float32 with cache
quantization off (``kv_cache_dtype="float32"``). Prompts of many lengths arrive over several steps, with a
small step budget (prefill split into chunks that differ per sequence and per run) and a cache too small for
all of them (preemption and recomputation); every sequence's greedy tokens must equal
``DeepseekV41.greedy`` on that prompt alone, which ``tests/unit/test_v41_parity.py`` ties to the oracle.
Also: prefix-cache hits (exact for V4.1: a block boundary needs the window and Engram tails and no
compressor state), async scheduling, and ``kv_cache_dtype="auto"`` (the released FP8 / MXFP4 / NVFP4 cache
roundings, compared with the plain model's own roundings on one sequence, whose steps run the same shapes).
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.model.v41.cache_quant import PACKED, dequantize, qdq
from deepinfer.testing.staggered import Arrivals, assert_same, drain
from deepinfer.model.v41.loader import load_v41_model
from tests.e2e.v41_tiny import write_tiny_v41

MAX_TOKENS = 12
VOCAB = 4096  # the demo tokenizer's
LENGTHS = [1, 3, 9, 17, 30, 64, 100, 127, 128, 129, 150, 200]
CONFIGS = {
    "flash_like": {},
    # No candidate level, window 8, Engram (4-grams) only before a ratio-1 re-indexing layer.
    "window8_4grams": dict(candidate_source_layer_id=-1, sliding_window=8, engram_layer_ids=[7],
                           engram_num_embeddings=[700], engram_max_ngram_size=4, index_topk=6),
}
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def tiny(request, tmp_path_factory, one_thread):
    path = write_tiny_v41(tmp_path_factory.mktemp(request.param), seed=len(request.param), **CONFIGS[request.param])
    plain, _ = load_v41_model(path, torch.float32, cache_qdq=False)
    memo: dict[tuple[int, ...], list[int]] = {}

    def reference(ids: list[int]) -> list[int]:
        """The plain model's greedy tokens for ``ids`` alone (computed once per prompt)."""
        if tuple(ids) not in memo:
            memo[tuple(ids)] = plain.greedy(torch.tensor(ids), MAX_TOKENS)
        return memo[tuple(ids)]

    return path, reference


def _engine(path, **kw) -> LLMEngine:
    # A small cache: the default CPU budget's zero-fill would dominate these engines' start-up.
    args = dict(model=str(path), device="cpu", dtype="float32", kv_cache_dtype="float32", block_size=128,
                max_num_seqs=8, max_num_batched_tokens=48, max_model_len=512, num_cache_blocks=16,
                load_progress=False)
    args.update(kw)
    return LLMEngine.from_engine_args(**args)


def _drain(engine: LLMEngine, arrivals: Arrivals) -> dict[str, list[int]]:
    return drain(engine, arrivals, GREEDY, check_integrity=True)


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_batched_chunked_preempted_equals_plain_greedy(tiny, async_scheduling) -> None:
    path, reference = tiny
    rng = random.Random(7 + async_scheduling)
    budget = rng.choice([13, 29, 41])  # prefill chunks of every size, cut differently per run
    # 4 history blocks of 128 positions for 12 sequences of up to 212: preemption and recomputation.
    engine = _engine(path, max_num_batched_tokens=budget, num_cache_blocks=4, async_scheduling=async_scheduling)
    prompts = _prompts(5)
    arrivals: dict[int, list] = {}
    for i in rng.sample(range(len(prompts)), len(prompts)):
        arrivals.setdefault(rng.randrange(4), []).append((f"r{i}", prompts[i]))
    got = _drain(engine, arrivals)
    assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert engine.cache.num_requests == 0
    for i, ids in enumerate(prompts):
        assert got[f"r{i}"] == reference(ids), f"prompt {i} ({len(ids)} tokens)"


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "auto"])
def test_key_lists_attention_equals_the_per_sequence_attention(tiny, kv_cache_dtype) -> None:
    """The device build's attention core (``PagedV41.key_lists``: every sequence at once over per-query key
    lists, the indexer's top-k of every sequence at once, ``select_lists``) against the CPU reference's
    per-sequence loop, under batching, chunked prefill and preemption.
    float32, no cache quantization: the same greedy tokens (the plain model's) and logprobs to fp32 rounding
    (bound 2e-5; measured 4.8e-6). With the released cache formats an fp32-rounding difference moves cache rows
    across FP8 / FP4 rounding boundaries, which the next layers amplify (measured: 3.4e-3 at the first token,
    0.084 by the 9th): there the tokens must agree and the logprobs stay within 0.2 (a wrong key list moves them
    by whole units)."""
    path, reference = tiny
    rng = random.Random(11)
    prompts = _prompts(13)
    arrivals: dict[int, list] = {}
    for i in rng.sample(range(len(prompts)), len(prompts)):
        arrivals.setdefault(rng.randrange(4), []).append((f"r{i}", prompts[i]))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    got = {}
    for lists in (False, True):
        engine = _engine(path, max_num_batched_tokens=29, num_cache_blocks=4, kv_cache_dtype=kv_cache_dtype)
        engine.model.key_lists = lists
        got[lists] = drain(engine, arrivals, params, logprobs=True, check_integrity=True)
        assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
        assert len(got[lists]) == len(prompts)
    assert_same(got[True], got[False], 2e-5 if kv_cache_dtype == "float32" else 0.2)
    if kv_cache_dtype == "float32":
        for i, ids in enumerate(prompts):
            assert got[True][f"r{i}"][0] == reference(ids), f"prompt {i} ({len(ids)} tokens)"


def test_after_the_start_up_warm_up_equals_plain_greedy(tiny) -> None:
    """The warm-up (on by default on CUDA; engine/warm_up.py) runs V4.1's engine too and leaves nothing behind."""
    path, reference = tiny
    engine = _engine(path, warm_up=True)
    assert sum(engine.cache.num_cached_blocks().values()) == 0 and not engine.requests
    prompts = _prompts(9)[:6]
    got = _drain(engine, {0: [(f"r{i}", p) for i, p in enumerate(prompts)]})
    for i, ids in enumerate(prompts):
        assert got[f"r{i}"] == reference(ids), f"prompt {i} ({len(ids)} tokens)"


def test_prefix_hit_equals_plain_greedy(tiny) -> None:
    path, reference = tiny
    engine = _engine(path)
    rng = random.Random(3)
    shared = [rng.randrange(3, VOCAB) for _ in range(270)]
    first = shared + [rng.randrange(3, VOCAB) for _ in range(5)]
    second = shared[:260] + [rng.randrange(3, VOCAB) for _ in range(9)]
    outs = {}
    for rid, ids in (("a", first), ("b", second)):
        engine.add_request(rid, {"prompt_token_ids": ids}, GREEDY)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outs[rid] = out
    assert outs["a"].num_cached_tokens == 0
    assert outs["b"].num_cached_tokens == 256  # the last full block boundary of the common prefix
    for rid, ids in (("a", first), ("b", second)):
        assert list(outs[rid].outputs[0].token_ids) == reference(ids), rid


_ROUNDING = {"window_kv": "fp8", "entries": "nvfp4", "index_keys": "mxfp4"}


def _rounded(engine: LLMEngine) -> dict[str, bool]:
    """Per cache tensor kind: whether every stored row is a fixed point of its released format's rounding
    (packed rows: stored as that format's bytes, then read back)."""
    out: dict[str, bool] = {}
    for (key, name), t in engine.storage.tensors.items():
        if name in _ROUNDING:
            fmt, spec = _ROUNDING[name], engine.storage.spec(key, name)
            if spec.packed is not None:
                assert spec.packed == PACKED[fmt] and t.dtype == torch.uint8, (key, name)
                t = dequantize(t, fmt, spec.width, torch.float32)
            out[name] = out.get(name, True) and torch.equal(qdq(t, fmt), t)
    return out


def test_kv_cache_dtype_auto_rounds_as_the_reference(tiny) -> None:
    path, _ = tiny
    ids = _prompts(9)[4]  # 30 tokens
    tokens = {}
    for kv in ("auto", "float32"):
        engine = _engine(path, kv_cache_dtype=kv)  # the prompt in one chunk: the plain model's shapes
        engine.add_request("a", {"prompt_token_ids": ids}, GREEDY)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[kv] = list(out.outputs[0].token_ids)
        assert _rounded(engine) == dict.fromkeys(_ROUNDING, kv == "auto")
        plain, _ = load_v41_model(path, torch.float32, cache_qdq=kv == "auto")
        assert tokens[kv] == plain.greedy(torch.tensor(ids), MAX_TOKENS), kv
