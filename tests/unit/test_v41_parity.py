"""Parity of the plain-PyTorch DeepSeek-V4.1 text model with its oracle, NeMo Automodel 0.7.0's
``DeepseekV41ForCausalLM``, in float32 on tiny random configs with cache quantization off (tests/oracle/v41.py).

The configs exercise window-only layers, ratio-2 and ratio-1 KV sources, reusing and re-indexing layers,
candidate blocks (3 blocks of 8 kept out of up to 12), Engram before a window-only and a compressed layer,
mHC with 4 streams and MoE with a shared expert; prompts are long enough that the top-k (8) and the
candidate level both drop entries. Greedy decoding runs through our cache, one position per step; the
oracle has no decode path, so each step is compared with its full forward over the prefix. The model
weights come through a quantized checkpoint on disk (FP8 32x32 dense, FP4 experts, FP8 Engram tables)
that the oracle then also holds, dequantized.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deepinfer.model.v41.loader import load_v41_model
from deepinfer.testing.v41_checkpoint import write_v41_checkpoint
from tests.oracle.v41 import (ORACLE, REASON, build_oracle, cache_quantization_off, checkpoint_config, oracle_logits,
                              released_state, tiny_text_config, tiny_tokenizer)

pytestmark = pytest.mark.skipif(importlib.util.find_spec(ORACLE.split(".")[0]) is None, reason=REASON)

TOL = 1e-4
PROMPT = 96
DECODE = 8
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
         "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
CONFIGS = {
    "flash_like": {},
    # No candidate level, Engram only before a ratio-1 re-indexing layer, window 8, 4-grams.
    "no_candidates": dict(candidate_source_layer_id=-1, sliding_window=8, engram_layer_ids=[7],
                          engram_num_embeddings=[700], engram_max_ngram_size=4, index_topk=6),
    # One ratio-2 source then a ratio-1 one, no Engram, a flattened (vLLM-style) config.json.
    "no_engram": dict(engram_layer_ids=[], engram_num_embeddings=[], num_hidden_layers=8,
                      compress_ratios=[0, 2, 2, 1, 1, 1, 1, 1], kv_source_layer_ids=[1, 3],
                      index_source_layer_ids=[1, 3, 5, 7], candidate_source_layer_id=3, candidate_topk_blocks=2),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory, one_thread):
    tok = tiny_tokenizer(512)
    text = tiny_text_config(tok, **CONFIGS[request.param])
    oracle = build_oracle(text, tok, seed=len(request.param))
    config = checkpoint_config(text, nested=request.param != "no_engram")
    target = config.get("text_config", config)
    target["quantization_config"] = QUANT
    out = tmp_path_factory.mktemp(request.param)
    expected = write_v41_checkpoint(out, config, released_state(oracle), tok)
    oracle.load_state_dict(oracle.state_dict_adapter.from_hf(expected), strict=False)
    ours, ignored = load_v41_model(out, torch.float32, cache_qdq=False)
    g = torch.Generator().manual_seed(11)
    return oracle, ours, torch.randint(3, 512, (PROMPT,), generator=g)


def test_loaded_weights_are_the_oracles(case):
    oracle, ours, _ = case
    theirs = released_state(oracle)
    assert set(theirs) == set(ours.state_dict())
    assert all(torch.equal(ours.state_dict()[k], v) for k, v in theirs.items())


def test_prompt_logits(case):
    oracle, ours, prompt = case
    with cache_quantization_off():
        ref = oracle_logits(oracle, prompt)
    got = ours(prompt)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert (got - ref).abs().max().item() <= TOL


def test_chunked_prefill_equals_one_shot(case):
    _, ours, prompt = case
    whole = ours(prompt)
    cache = ours.new_cache()
    parts = [ours(chunk, cache) for chunk in torch.split(prompt, [37, 1, 30, 28])]
    # Only GEMM shapes differ (rows per call): fp32 rounding, no selection flips.
    assert (torch.cat(parts) - whole).abs().max().item() <= TOL


def test_greedy_decode_matches_prefix_forwards(case):
    oracle, ours, prompt = case
    tokens = ours.greedy(prompt[:PROMPT // 2], DECODE)
    seq = prompt[:PROMPT // 2]
    cache = ours.new_cache()
    logits = ours(seq, cache)
    with cache_quantization_off():
        for step, token in enumerate(tokens):
            ref = oracle_logits(oracle, seq)[-1]
            assert int(ref.argmax()) == token, f"step {step}"
            assert (logits[-1] - ref).abs().max().item() <= TOL
            seq = torch.cat((seq, torch.tensor([token])))
            logits = ours(torch.tensor([token]), cache)
