"""Parity of the DSpark drafter (model/v41/dspark.py) with its oracle, NeMo Automodel 0.7.0's
``DeepseekV41DSparkModel``, in float32 on a tiny random config (tests/oracle/v41.py).

The target and the drafter come through one quantized checkpoint on disk (FP8 32x32 dense weights and
``main_proj``, FP4 experts, fp32 confidence head) that the oracles then also hold, dequantized. The oracle
is a training adapter without a cache, so each block is compared with its backbone run for one fixed
anchor over the taps it captures from its own target: with the cache roundings off end to end (our taps,
context windows and block against its), and with them on from the same taps (the target's own top-k makes
its end-to-end rounding chaotic, see tests/unit/test_v41_parity.py). The Markov inputs of the oracle are our
greedy drafts, so equal logits and an argmax equal to each draft mean identical greedy drafts.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from deepinfer.config.v41 import V41Config
from deepinfer.model.v41.cache import LayerCache
from deepinfer.model.v41.loader import load_v41_model
from deepinfer.model.v41.rope import angles
from deepinfer.testing.v41_checkpoint import write_v41_checkpoint
from tests.oracle.v41 import (ORACLE, REASON, build_dspark_oracle, build_oracle, cache_quantization_off,
                              checkpoint_config, dspark_released_state, oracle_draft, oracle_taps, released_state,
                              tiny_text_config, tiny_tokenizer)

pytestmark = pytest.mark.skipif(importlib.util.find_spec(ORACLE.split(".")[0]) is None, reason=REASON)

TOL = 1e-4
PROMPT = 64
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
         "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
# Last target positions to draft after: a context shorter than the window (16), and longer ones.
ENDS = (5, 40, PROMPT - 1)


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # the oracle is ~30x faster single-threaded on a shared 2-core machine
    tok = tiny_tokenizer(512)
    text = tiny_text_config(tok)
    target = build_oracle(text, tok, seed=3)
    draft = build_dspark_oracle(target, seed=3)
    config = checkpoint_config(text)
    config["text_config"]["quantization_config"] = QUANT
    out = tmp_path_factory.mktemp("dspark")
    expected = write_v41_checkpoint(out, config, {**released_state(target), **dspark_released_state(draft)}, tok)
    target.load_state_dict(target.state_dict_adapter.from_hf(
        {k: v for k, v in expected.items() if not k.startswith("mtp.")}), strict=False)
    draft.load_state_dict(draft.state_dict_adapter.from_hf(
        {k: v for k, v in expected.items() if k.startswith("mtp.")}), strict=False)
    draft.initialize_embeddings_and_head(embed_tokens=target.get_input_embeddings(),
                                         lm_head=target.get_output_embeddings())
    ours, ignored = load_v41_model(out, torch.float32, cache_qdq=False, dspark=True)
    normed_config = checkpoint_config({**text, "dspark_confidence_input": "normed", "quantization_config": QUANT})
    normed, _ = load_v41_model(out, torch.float32, cfg=V41Config.from_dict(normed_config), cache_qdq=False,
                               dspark=True)
    hf = tmp_path_factory.mktemp("dspark_hf")
    write_v41_checkpoint(hf, config, {**released_state(target), **dspark_released_state(draft)}, tok, names="hf")
    g = torch.Generator().manual_seed(5)
    yield dict(target=target, draft=draft, ours=ours, normed=normed, ignored=ignored, hf=hf,
               prompt=torch.randint(3, 512, (PROMPT,), generator=g))
    torch.set_num_threads(saved)


def test_loaded_drafter_is_the_oracles(case):
    theirs = dspark_released_state(case["draft"])
    ours = case["ours"].state_dict()
    assert case["ignored"] == ()
    assert {k for k in ours if k.startswith("mtp.")} == set(theirs)
    assert all(torch.equal(ours[k], v) for k, v in theirs.items())
    from_hf, _ = load_v41_model(case["hf"], torch.float32, dspark=True)
    assert all(torch.equal(from_hf.state_dict()[k], v) for k, v in ours.items())


def _confidence_from(draft, hidden: torch.Tensor, previous: list[int]) -> torch.Tensor:
    """The oracle's confidence head on a given state (its Markov code of each row's previous token)."""
    last = draft.mtp[-1]
    return last.confidence_head(hidden, last.markov_head.embed(torch.tensor(previous)))


@pytest.mark.parametrize("end", ENDS)
def test_draft_block_matches_the_oracle(case, end):
    """Cache roundings off: our taps -> context windows -> block against the oracle's, after a prefill."""
    target, draft, prompt = case["target"], case["draft"], case["prompt"][:end + 1]
    for model in (case["ours"], case["normed"]):
        cache = model.new_cache()
        token = int(model(prompt, cache)[-1].argmax())
        block = model.propose(token, cache)
        previous = [token, *block.tokens[:-1].tolist()]
        with cache_quantization_off():
            ref, ref_conf, prenorm = oracle_draft(draft, oracle_taps(target, prompt, [7, 8, 9]), token,
                                                  previous[1:])
        assert block.first_position == end + 1
        assert (block.logits - ref).abs().max().item() <= TOL
        assert torch.equal(block.tokens, ref.argmax(dim=-1))
        if model.cfg.dspark.confidence_input == "normed":  # what the oracle's own head reads
            want = ref_conf
        else:  # the released drafter: the same head on the state before the final norm
            want = _confidence_from(draft, prenorm, previous)
        assert (block.confidence_logits - want).abs().max().item() <= TOL


@pytest.mark.parametrize("end", ENDS[1:])
def test_draft_block_with_cache_rounding_matches_the_oracle(case, end):
    """FP8 context and block KV on, both fed the oracle's taps (so only the drafter's own rounding counts)."""
    target, draft, ours = case["target"], case["draft"], case["ours"]
    prompt = case["prompt"][:end + 1]
    taps = oracle_taps(target, prompt, [7, 8, 9])
    windows = [LayerCache() for _ in ours.mtp]
    ours.mtp.write_context(taps.unflatten(-1, (3, -1)), 0, windows,
                           angles(ours.cfg.main_rope, torch.arange(end + 1)), True)
    token = int(case["prompt"][end + 1]) if end + 1 < PROMPT else 7
    block = ours.mtp.propose(ours.embed, ours.head, windows, token, True)
    previous = [token, *block.tokens[:-1].tolist()]
    ref, _, prenorm = oracle_draft(draft, taps, token, previous[1:])
    assert (block.logits - ref).abs().max().item() <= TOL
    assert torch.equal(block.tokens, ref.argmax(dim=-1))
    assert (block.confidence_logits - _confidence_from(draft, prenorm, previous)).abs().max().item() <= TOL
