"""Write a DeepSeek-V4.1 checkpoint directory from given fp32 weights (released names), in the released
quantized formats when the config has a ``quantization_config``: FP8 e4m3 dense weights with UE8M0 scales
per 32x32 block, packed FP4 e2m1 experts with a UE8M0 scale per row and 32 columns, FP8 Engram tables with
per-row, per-32-column scales. The DSpark drafter's ``mtp.*`` tensors, when given, are written the same way
(dense projections and ``main_proj`` FP8, experts FP4, the confidence head fp32). Returns the fp32 values a
correct loader must produce (the weights after one quantization round trip), by native name. Optional extra
tensors (e.g. ``vision.*``) are written as given.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from deepinfer.config.v41 import V41Config
from deepinfer.model.quant import dequant_fp4, dequant_fp8_block, quant_fp4, quant_fp8_block
from deepinfer.model.v41.names import scale_name, storage_format

_STORE = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_NATIVE_TO_HF = tuple((re.compile(p), r) for p, r in (
    (r"\.scale$", ".weight_scale_inv"),  # first: the mHC rule below makes names that end in ".scale"
    (r"^embed\.", "model.embed_tokens."),
    (r"^head\.", "lm_head."),
    (r"^(layers\.\d+)\.hc_(attn|ffn)_(fn|base|scale)$", r"model.\1.\2_hc.\3"),
    (r"^(mtp\.\d+)\.hc_(attn|ffn)_(fn|base|scale)$", r"\1.\2_hc.\3"),  # NeMo's DSpark names: no "model."
    (r"\.attn\.attn_sink$", ".attn.sinks_param.weight"),
    (r"(\.ffn\.(?:experts\.\d+|shared_experts))\.w1\.", r"\1.gate_proj."),
    (r"(\.ffn\.(?:experts\.\d+|shared_experts))\.w3\.", r"\1.up_proj."),
    (r"(\.ffn\.(?:experts\.\d+|shared_experts))\.w2\.", r"\1.down_proj."),
    (r"\.ffn\.gate\.bias$", ".ffn.gate.e_score_correction_bias"),
    (r"^(layers|norm)\.", r"model.\1."),
))


def hf_name(native: str) -> str:
    """The Hugging Face module spelling of a released name (what ports and their exports write)."""
    for pattern, repl in _NATIVE_TO_HF:
        native = pattern.sub(repl, native)
    return native


def _encode(name: str, w: torch.Tensor, cfg: V41Config, store: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    fmt, block = storage_format(name, cfg)
    if fmt == "fp8":
        q, s = quant_fp8_block(w.float(), block)
        return q, s, dequant_fp8_block(q, s, block)
    if fmt == "fp4":
        q, s = quant_fp4(w.float())
        return q, s, dequant_fp4(q, s)
    keep = torch.float32 if w.dtype == torch.float32 and (name.endswith(("_fn", "_base", "_scale", "attn_sink"))
                                                          or ".gate.bias" in name or ".confidence_head." in name
                                                          ) else store
    stored = w.to(keep)
    return stored, None, stored.float()


def write_v41_checkpoint(out_dir: str | Path, config: dict, weights: dict[str, torch.Tensor], tokenizer=None,
                         names: Literal["native", "hf"] = "native",
                         extra: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    if names not in ("native", "hf"):
        raise ValueError(f"names: expected 'native' or 'hf', got {names!r}")
    cfg = V41Config.from_dict(config)
    store = _STORE.get(cfg.dtype.removeprefix("torch."), torch.bfloat16)
    rename = hf_name if names == "hf" else (lambda n: n)
    tensors: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        value, scale, expected[name] = _encode(name, w, cfg, store)
        tensors[rename(name)] = value.contiguous()
        if scale is not None:
            tensors[rename(scale_name(name))] = scale.contiguous()
    tensors.update({k: v.contiguous() for k, v in (extra or {}).items()})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(str(out / "tokenizer.json"))
    return expected
