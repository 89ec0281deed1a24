"""The bundled demo model (a tiny DeepSeek-V4 trained on the Python stdlib by tools/train_demo.py).

It loads as a native FP8/FP4 checkpoint with every layer kind and an MTP layer, greedy decoding repeats itself
exactly, deepinfer's held-out perplexity equals Hugging Face's on the same dequantized weights, and the
``deepinfer eval`` entry point runs on it.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import corpus
from deepinfer.assets import demo_model_dir
from deepinfer.config.model import CSA, HASH_MOE, HCA, ROUTED_MOE, SWA
from deepinfer.eval.scoring import run_deepinfer, run_hf
from deepinfer.hf_bridge import load_hf
from deepinfer.model.loader import load_model
from deepinfer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model():
    return load_model(demo_model_dir(), dtype=torch.float32, progress=False, keep_quantized=True)


@pytest.fixture(scope="module")
def sample() -> list[list[int]]:
    """The first 256 tokens ([BOS] + text) of each of the first two held-out files."""
    tok = Tokenizer(demo_model_dir())
    base = corpus.stdlib_root()
    files = corpus.heldout_files(base)[:2]
    return [([tok.bos_id] + tok.encode((base / f).read_text(encoding="utf-8", errors="replace")))[:256]
            for f in files]


def test_demo_is_a_trained_native_quantized_v4_with_mtp(model) -> None:
    cfg = model.cfg
    assert set(cfg.layer_types) == {SWA, CSA, HCA}
    assert cfg.layer_compress_ratios == (0, 4, 16, 4, 16, 0)
    assert cfg.mlp_layer_types[0] == HASH_MOE and ROUTED_MOE in cfg.mlp_layer_types
    assert cfg.num_nextn_predict_layers == 1 and cfg.quant is not None and cfg.quant.expert_dtype == "fp4"
    formats = {name: q.format for name, q in model.quantized.items()}
    assert set(formats.values()) == {"fp8", "fp4"}
    assert formats["mtp.0.e_proj.weight"] == "fp8" and formats["layers.2.ffn.experts.0.w1.weight"] == "fp4"
    assert (demo_model_dir() / "model.safetensors").stat().st_size <= 12 * 2**20
    # A real hash table (distinct experts per token, not HF's all-zero init) and trained router biases.
    table = model.layers[0].ffn.gate.tid2eid
    assert bool((table[:, 0] != table[:, 1]).all()) and len(table.unique()) == cfg.n_routed_experts
    assert float(model.layers[1].ffn.gate.bias.abs().max()) > 0


def test_greedy_generation_is_deterministic() -> None:
    from deepinfer import LLM, SamplingParams

    llm = LLM(device="cpu", load_progress=False, block_size=128, num_cache_blocks=8)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = llm.generate("def fibonacci(n):", params, use_tqdm=False)[0].outputs[0]
    second = llm.generate("def fibonacci(n):", params, use_tqdm=False)[0].outputs[0]
    assert list(first.token_ids) == list(second.token_ids) and len(first.token_ids) == 24


def test_heldout_perplexity_matches_hf(model, sample) -> None:
    pytest.importorskip("transformers")
    ours = run_deepinfer(model, sample, chunk=100, batch=2)  # chunks not aligned to windows or blocks
    native = {k: v.detach() for k, v in model.state_dict().items()}
    hf, mtp = load_hf(model.cfg, native)
    theirs = run_hf(hf, mtp, sample)
    assert ours.tokens == theirs.tokens == 2 * 255
    assert abs(ours.ppl - theirs.ppl) <= 1e-3 * theirs.ppl
    assert ours.ppl < 60  # trained (38 on this sample); a random model scores ~4096
    assert abs(ours.correct - theirs.correct) <= 1
    assert ours.mtp_positions == theirs.mtp_positions == 2 * 254
    assert abs(ours.mtp_accepted - theirs.mtp_accepted) <= 1
    assert ours.mtp_acceptance > 0.2


def test_eval_entry_point_runs(tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    from deepinfer.cli import main

    out = tmp_path / "eval.json"
    rc = main(["eval", "--max-files", "1", "--max-tokens", "96", "--context", "64", "--json", str(out),
               "--spec-ks", "1", "2", "--spec-prompts", "2", "--spec-max-tokens", "24"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "deepinfer" in text and "transformers" in text
    import json

    r = json.loads(out.read_text())
    assert r["deepinfer"]["tokens"] == r["hf"]["tokens"] == 96
    assert r["ppl_rel_diff"] < 1e-3
    # measured by the engine: between one token per verify step (no draft accepted) and k + 1
    lengths = {int(k): v for k, v in r["acceptance_length"].items()}
    assert sorted(lengths) == [1, 2] and all(1.0 < v <= k + 1 for k, v in lengths.items())
    assert f"k=1: {lengths[1]:.2f}  k=2: {lengths[2]:.2f}" in text
