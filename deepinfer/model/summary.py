"""``deepinfer info``: what a model directory holds, computed from its config (no weights are read)."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import torch

from deepinfer.config.model import ModelConfig
from deepinfer.kv.spec import HISTORY, STATE, WINDOW, build_layout


Specs = dict[str, tuple[tuple[int, ...], torch.dtype]]


def parameter_specs(cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16) -> Specs:
    """Every state-dict tensor's (shape, dtype) in a model of activation dtype ``dtype`` (parameters and the
    hash layers' tid2eid), from a meta-device model."""
    from deepinfer.model.deepseek_v4 import DeepseekV4

    with torch.device("meta"):
        model = DeepseekV4(cfg, dtype)
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


def _param_counts(cfg: ModelConfig, specs: Specs) -> dict[str, int]:
    total = mtp = experts = 0
    for name, (shape, _) in specs.items():
        if name.endswith(".tid2eid"):
            continue  # a lookup table, not a parameter
        n = math.prod(shape)
        total += n
        mtp += n if name.startswith("mtp.") else 0
        experts += n if ".ffn.experts." in name and not name.startswith("mtp.") else 0
    main = total - mtp
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    active = main - experts + experts * k // e
    return {"total": main, "active_per_token": active, "mtp": mtp}


def summarize(model_dir: str | None, specs: Specs | None = None) -> dict[str, Any]:
    """``specs``: ``parameter_specs(cfg)`` when the caller has them already (building them takes seconds at
    full size)."""
    from deepinfer.assets import demo_model_dir

    path = model_dir or str(demo_model_dir())
    cfg = ModelConfig.from_model_dir(path)
    specs = specs if specs is not None else parameter_specs(cfg)
    layout = build_layout(cfg, 256, include_mtp=True)
    bf16 = 2
    per_block = {p: layout.bytes_per_block(p, bf16) for p in (HISTORY, WINDOW, STATE)}
    return {
        "model_dir": path,
        "model_type": cfg.model_type,
        "layers": cfg.num_hidden_layers,
        "layer_kinds": dict(Counter(cfg.layer_types)),
        "hash_moe_layers": cfg.num_hash_layers,
        "hidden_size": cfg.hidden_size,
        "heads": cfg.num_attention_heads,
        "routed_experts": f"{cfg.num_experts_per_tok} of {cfg.n_routed_experts}",
        "vocab_size": cfg.vocab_size,
        "mtp_layers": cfg.num_nextn_predict_layers,
        "parameters": _param_counts(cfg, specs),
        "weights_format": None if cfg.quant is None else {
            "dense": f"fp8 {cfg.quant.fmt} with ue8m0 {cfg.quant.weight_block_size[0]}x"
                     f"{cfg.quant.weight_block_size[1]} block scales",
            "experts": cfg.quant.expert_dtype},
        "cache_bf16": {
            "history_bytes_per_token": per_block[HISTORY] / layout.block_size,
            "window_bytes_per_sequence": per_block[WINDOW] / layout.block_size * (layout.tail(WINDOW) + 1),
            "compressor_state_bytes_per_sequence": per_block[STATE] / layout.block_size * (layout.tail(STATE) + 1),
        },
    }
