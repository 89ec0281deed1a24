"""DeepSeek-V4.1 on its published shapes without a checkpoint: ``load_format="dummy"`` on
``assets/shapes/v41-flash`` with ``hf_overrides`` cutting it to four layers and CPU-sized widths (the Flash
layer schedule, KV sources, Engram before layer 1 and the DSpark drafter kept).

The engine's greedy tokens (batched, prefill in chunks) equal the plain model's on the same dummy weights;
dummy weights are a function of the seed (bit-identical twice, different for another seed, the backbone the
same with the drafter built or not) and stored in the native formats (FP8 32x32 dense, FP4 experts, FP8 Engram
tables with one scale per row and 32 columns)."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.assets import demo_model_dir, shapes_dir
from deepinfer.config.v41 import V41Config
from deepinfer.model.v41.dummy import dummy_v41_tensor, load_dummy_v41
from deepinfer.model.v41.engram import compressed_token_map
from deepinfer.model.v41.loader import load_tokenizer
from deepinfer.testing.staggered import drain

FLASH = shapes_dir("v41-flash")
VOCAB = 4096  # the demo tokenizer's (Engram hashes with the engine's tokenizer: a shapes directory has none)
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def overrides() -> dict:
    """Four Flash layers (window-only 0-1, Engram before 1, the ratio-2 KV source 2 and its reuser 3) at
    CPU-sized widths; the DSpark taps moved into them."""
    tok = load_tokenizer(demo_model_dir())
    return {"num_hidden_layers": 4, "vocab_size": VOCAB, "hidden_size": 128, "num_attention_heads": 8,
            "head_dim": 64, "q_lora_rank": 64, "o_lora_rank": 32, "o_groups": 4, "moe_intermediate_size": 64,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "index_n_heads": 4, "index_head_dim": 64,
            "index_topk": 16, "sliding_window": 32, "engram_vocab_size": 64, "engram_num_embeddings": [1000, 1000],
            "engram_n_heads": 2, "engram_head_dim": 32, "engram_compressed_vocab_size": compressed_token_map(tok)[1],
            "dspark_target_layer_ids": [1, 2, 3], "dspark_noise_token_id": VOCAB - 96, "dspark_markov_rank": 16,
            "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2}


@pytest.fixture(scope="module")
def cfg(overrides) -> V41Config:
    return V41Config.from_model_dir(FLASH, overrides)


def _engine(overrides, **kw) -> LLMEngine:
    args = dict(model=str(FLASH), tokenizer=str(demo_model_dir()), device="cpu", dtype="float32",
                kv_cache_dtype="float32", load_format="dummy", hf_overrides=overrides, block_size=128,
                max_num_seqs=4, max_num_batched_tokens=40, max_model_len=512, num_cache_blocks=16,
                load_progress=False)
    args.update(kw)
    return LLMEngine.from_engine_args(**args)


def test_engine_on_the_flash_shapes_equals_plain_greedy(overrides, cfg) -> None:
    rng = random.Random(4)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 31, 70, 150)]
    engine = _engine(overrides)
    assert engine.model.cfg.num_hidden_layers == 4 and engine.model.model.hasher is not None
    got = drain(engine, {0: [(f"r{i}", p) for i, p in enumerate(prompts)]}, GREEDY, check_integrity=True)
    plain = load_dummy_v41(cfg, torch.float32, tokenizer=load_tokenizer(demo_model_dir()), cache_qdq=False)
    for i, p in enumerate(prompts):
        assert got[f"r{i}"] == plain.greedy(torch.tensor(p), MAX_TOKENS), i
    assert len({t for toks in got.values() for t in toks}) > 3, "dummy weights must not collapse to one token"


def test_dspark_on_dummy_weights_keeps_greedy_tokens(overrides) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (9, 60)]
    arrivals = {0: [(f"r{i}", p) for i, p in enumerate(prompts)]}
    plain = drain(_engine(overrides), arrivals, GREEDY)
    spec = _engine(overrides, speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    assert spec.model.model.mtp is not None
    assert drain(spec, arrivals, GREEDY) == plain


def test_dummy_weights_are_a_function_of_the_seed(cfg) -> None:
    tok = load_tokenizer(demo_model_dir())
    a = load_dummy_v41(cfg, torch.float32, tokenizer=tok, seed=3, dspark=True).state_dict()
    b = load_dummy_v41(cfg, torch.float32, tokenizer=tok, seed=3, dspark=True).state_dict()
    c = load_dummy_v41(cfg, torch.float32, tokenizer=tok, seed=4).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert c.keys() < a.keys() and all(torch.equal(a[k], c[k]) is False for k in c if c[k].numel() > 8)
    d = load_dummy_v41(cfg, torch.float32, tokenizer=tok, seed=3).state_dict()
    assert all(torch.equal(a[k], d[k]) for k in d), "the backbone must not depend on the drafter being built"
    assert all(bool(torch.isfinite(v).all()) for v in a.values())


def test_dummy_tensors_are_in_the_native_formats(cfg) -> None:
    fmt, codes, scale = dummy_v41_tensor("layers.0.attn.wq_a.weight", (64, 128), cfg, 0)
    assert (fmt, codes.dtype, tuple(scale.shape), scale.dtype) == ("fp8", torch.float8_e4m3fn, (2, 4),
                                                                    torch.float8_e8m0fnu)
    fmt, codes, scale = dummy_v41_tensor("layers.0.ffn.experts.3.w1.weight", (64, 128), cfg, 0)
    assert (fmt, codes.dtype, tuple(codes.shape), tuple(scale.shape)) == ("fp4", torch.int8, (64, 64), (64, 4))
    fmt, codes, scale = dummy_v41_tensor("layers.1.engram.embed.weight", (1000, 32), cfg, 0)
    assert (fmt, codes.dtype, tuple(scale.shape)) == ("fp8", torch.float8_e4m3fn, (1000, 1))
    fmt, value, scale = dummy_v41_tensor("layers.0.attn_norm.weight", (128,), cfg, 0)
    assert (fmt, scale) == ("float", None) and abs(float(value.mean()) - 1) < 0.1
