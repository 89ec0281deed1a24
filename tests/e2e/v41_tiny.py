"""Tiny random DeepSeek-V4.1 checkpoints for the engine tests (no oracle needed).

The layer schedule is the oracle tests' (``tests/oracle/v41.py``: window-only layers, ratio-2 sources with a
reusing layer, a ratio-1 candidate source, reusing and re-indexing layers, Engram on two layers, mHC, MoE),
in float32, stored in the released quantized formats (FP8 32x32 dense, FP4 experts, FP8 Engram tables).
The tokenizer is the bundled demo model's (a byte-level BPE with DeepSeek's special tokens, so chat prompts
render), which also defines Engram's compressed vocabulary. The plain model that the engine is compared
with is the one ``tests/unit/test_v41_parity.py`` checks against the oracle.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from deepinfer.assets import demo_model_dir
from deepinfer.config.v41 import V41Config
from deepinfer.model.v41.model import DeepseekV41
from deepinfer.testing.v41_checkpoint import write_v41_checkpoint
from deepinfer.tokenizer import load_tokenizer
from tests.oracle.v41 import checkpoint_config, tiny_text_config

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
         "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


def _randomize(model: torch.nn.Module, g: torch.Generator) -> dict[str, torch.Tensor]:
    """Every tensor random (released names); norms, mHC scales and sinks around 1, routing biases small."""
    out = {}
    for name, p in model.state_dict().items():
        r = torch.randn(p.shape, generator=g)
        if name.endswith(("norm.weight", "q_weight", "k_weight")):
            out[name] = 1.0 + 0.2 * r
        elif name.endswith(("_scale", "attn_sink")):
            out[name] = 1.0 + 0.3 * r
        elif name.endswith("_base"):
            out[name] = 0.5 * r
        elif "engram.embed" in name:
            out[name] = r
        elif name.endswith((".gate.bias", ".gate.bias_vl")):
            out[name] = 0.1 * r
        else:
            out[name] = 0.15 * r
    return out


def write_tiny_v41(out_dir: Path, seed: int = 0, dspark: bool = False, **overrides) -> Path:
    """A checkpoint directory (config.json, model.safetensors, the demo tokenizer) of a tiny random V4.1;
    ``dspark``: with the DSpark drafter's tensors (``mtp.*``)."""
    tok = load_tokenizer(demo_model_dir())
    text = tiny_text_config(tok, vocab_size=tok.get_vocab_size(with_added_tokens=True), **overrides)
    config = checkpoint_config(text)
    config["text_config"]["quantization_config"] = QUANT
    cfg = V41Config.from_dict(config)
    with torch.device("meta"):
        shapes = DeepseekV41(cfg, torch.float32, shapes_only=True, dspark=dspark)
    write_v41_checkpoint(out_dir, config, _randomize(shapes, torch.Generator().manual_seed(seed)))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir() / name, out_dir / name)
    return out_dir


def greedy_from(plain: DeepseekV41, logits: torch.Tensor, cache, max_tokens: int) -> tuple[list[int], list[float]]:
    """The plain model's greedy tokens and their logprobs, decoding on from ``logits`` (the prefill's last rows)."""
    tokens, logprobs = [], []
    while True:
        scores = logits[-1].log_softmax(-1)
        tokens.append(int(scores.argmax()))
        logprobs.append(float(scores[tokens[-1]]))
        if len(tokens) == max_tokens:
            return tokens, logprobs
        logits = plain(torch.tensor(tokens[-1:]), cache)
