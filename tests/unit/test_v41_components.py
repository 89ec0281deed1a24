"""V4.1 pieces checked bit for bit against the oracle's own functions (tests/oracle/v41.py): the cache
quantizers (FP8 window KV, MXFP4 indexer q/k, NVFP4 compressed KV; rounded in place and as packed rows read
back), Engram's compressed-token map and hash rows, and the whole model with the cache quantizers on against
the oracle with them on."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deepinfer.config.v41 import V41Config
from deepinfer.model.v41.cache_quant import dequantize, qdq, quantize
from deepinfer.model.v41.engram import EngramHasher, compressed_token_map, hash_plan
from tests.oracle.v41 import ORACLE, REASON, _quiet_env, checkpoint_config, tiny_text_config, tiny_tokenizer

pytestmark = pytest.mark.skipif(importlib.util.find_spec(ORACLE.split(".")[0]) is None, reason=REASON)


def _values(seed: int) -> torch.Tensor:
    """Magnitudes over many binades, exact e2m1 midpoints after scaling, zeros and tiny blocks."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 96, generator=g) * torch.exp2(torch.randint(-20, 12, (64, 1), generator=g).float())
    x[0] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 12)  # ties at scale 1
    x[1] = 0.0
    x[2] = 1e-30
    return x


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_quantizers_bit_exact(fmt, dtype):
    _quiet_env()
    from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache

    block = {"fp8": 32, "mxfp4": 32, "nvfp4": 16}[fmt]
    for seed in range(3):
        x = _values(seed).to(dtype)
        ours, theirs = qdq(x, fmt), quantize_cache(x, format=fmt, block_size=block)
        assert ours.dtype == dtype
        assert torch.equal(ours.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           theirs.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
        # The engine's packed cache rows read back as the oracle's rounding too.
        packed = dequantize(quantize(x, fmt), fmt, x.shape[-1], dtype)
        assert torch.equal(packed.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           theirs.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_e2m1_ties_go_to_even():
    x = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 4])
    assert qdq(x, "mxfp4")[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0]


def test_engram_token_map_and_hash_rows_equal_the_oracles():
    _quiet_env()
    from transformers import PreTrainedTokenizerFast

    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41TextConfig
    from nemo_automodel.components.models.deepseek_v41.engram import DeepseekV41NgramHash, _compressed_token_map

    tok = tiny_tokenizer(512)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok)
    ours_map, size = compressed_token_map(tok)
    theirs_map, theirs_size = _compressed_token_map(fast)
    assert (ours_map, size) == (theirs_map, theirs_size) and size < 512  # some entries collapse
    text = tiny_text_config(tok, engram_layer_ids=[1, 4], engram_max_ngram_size=4, engram_num_embeddings=[700, 800])
    cfg = V41Config.from_dict(checkpoint_config(text))
    oracle = DeepseekV41NgramHash(DeepseekV41TextConfig(**text), fast)
    plan = hash_plan(cfg)
    assert plan.primes == oracle._prime_values and plan.multipliers == oracle._multiplier_values
    ids = torch.randint(0, 512, (1, 70), generator=torch.Generator().manual_seed(3))
    want = oracle(ids)[0]
    hasher = EngramHasher(cfg, ours_map, size)
    assert torch.equal(hasher(ids[0], 0), want)
    assert torch.equal(hasher(ids[0], 50), want[50:])  # a later chunk reads its lookback from the history


def test_flash_hash_constants():
    """Spec §2.2: the released tables' prime sums and the layer-1 multipliers (numpy PCG64, seed 10007)."""
    cfg = V41Config.from_dict({"model_type": "deepseek_v41", "text_config": {}})
    plan = hash_plan(cfg)
    assert [sum(p) for p in plan.primes] == [384006168, 384016682]
    assert plan.multipliers[0] == (76632096046245, 4839876093313, 35959672319349, 73987337458391)
    assert plan.primes[0][:2] == (16000057, 16000079)


def test_tokenizer_with_another_vocabulary_is_refused():
    tok = tiny_tokenizer(512)
    text = tiny_text_config(tok)
    cfg = V41Config.from_dict(checkpoint_config({**text, "engram_compressed_vocab_size": 99092}))
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        EngramHasher(cfg, *compressed_token_map(tok))
