"""Continuous batching end to end: staggered arrivals, chunked prefill and preemption change nothing.

The engine serves a Hugging Face ``save_pretrained`` checkpoint of a tiny random DeepseekV4ForCausalLM
(fp32, parity-safe: 16 indexer heads so indexer top-k ties do not occur). Greedy outputs of 16 prompts
of varied lengths, submitted over several steps with a 48-token step budget and a cache too small for
all of them, must equal (a) each prompt run alone and (b) HF's own greedy generation.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.assets import demo_model_dir
from deepinfer.testing.staggered import Arrivals, drain
from tests.oracle.hf import build_hf, tiny_native_config

pytest.importorskip("transformers")

NUM_PROMPTS = 16
MAX_TOKENS = 24
NATIVE = tiny_native_config(num_hidden_layers=4, compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=1,
                            vocab_size=512)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    hf = build_hf(NATIVE, seed=3)
    path = tmp_path_factory.mktemp("hf_tiny")
    hf.save_pretrained(path)
    return path, hf


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    lengths = [1, 3, 7, 20, 45, 64, 90, 110, 127, 128, 129, 140, 160, 33, 5, 70]
    return [[rng.randrange(3, NATIVE["vocab_size"]) for _ in range(n)] for n in lengths[:NUM_PROMPTS]]


def _engine(path, **kw) -> LLMEngine:
    args = dict(model=str(path), tokenizer=str(demo_model_dir()), device="cpu", dtype="float32",
                block_size=128, max_num_seqs=16, max_num_batched_tokens=48, load_progress=False)
    args.update(kw)
    return LLMEngine.from_engine_args(**args)


def _drain(engine: LLMEngine, arrivals: Arrivals, params) -> dict[str, list[int]]:
    return drain(engine, arrivals, params, check_integrity=True)


def _hf_greedy(hf, ids: list[int]) -> list[int]:
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    out, x = [], torch.tensor([ids])
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            nxt = int(hf(x, past_key_values=cache, use_cache=True).logits[0, -1].argmax())
            out.append(nxt)
            x = torch.tensor([[nxt]])
    return out


def test_staggered_chunked_preempted_batch_equals_alone_and_hf(model_dir) -> None:
    path, hf = model_dir
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts()
    # Small history pool: 16 sequences of up to ~190 tokens need ~26 blocks; 4 forces preemption.
    engine = _engine(path, num_cache_blocks=4)
    arrivals: dict[int, list] = {}
    for i, ids in enumerate(prompts):
        arrivals.setdefault((i // 4) * 3, []).append((f"r{i}", ids))
    batched = _drain(engine, arrivals, params)
    assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert engine.cache.num_requests == 0

    alone_engine = _engine(path, num_cache_blocks=4)
    for i, ids in enumerate(prompts):
        alone = _drain(alone_engine, {0: [(f"a{i}", ids)]}, params)[f"a{i}"]
        assert batched[f"r{i}"] == alone, f"prompt {i} differs when batched"
        assert alone == _hf_greedy(hf, ids), f"prompt {i} differs from HF"
