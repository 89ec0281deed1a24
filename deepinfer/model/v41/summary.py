"""``deepinfer info`` for a DeepSeek-V4.1 checkpoint: its layer plan, parameters and cache, from config.json
alone (a meta-device model; no weights are read).

The per-device memory plan is ``engine/memory_plan_v41.py``'s; the cache figures here are the engine's pools
as it allocates them at activation dtype bf16: ``cache_auto`` under ``kv_cache_dtype="auto"`` (the rounded rows
packed in the released FP8/FP4 formats), ``cache_bf16`` under ``kv_cache_dtype="bfloat16"`` (unpacked rows).
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

from deepinfer.config.v41 import V41Config
from deepinfer.kv.spec import HISTORY, POOLS
from deepinfer.kv.spec_v41 import build_v41_layout
from deepinfer.model.summary import Specs

CACHE_FORMATS = {
    "auto": "window KV FP8 e4m3 (scale per 32), indexer q/k MXFP4, compressed KV NVFP4, each rounded as the "
            "reference does; the cached rows stored packed in those formats",
    "bfloat16/float32": "no cache quantization (the activation dtype)",
}


def _role(cfg: V41Config, layer: int) -> dict[str, Any]:
    r = cfg.role(layer)
    if not r.ratio:
        kind = "window"
    elif r.kv_source:
        kind = f"ratio-{r.ratio} source"
    elif r.index_source:
        kind = "re-index"
    else:
        kind = "reuse"
    out: dict[str, Any] = {"layer": layer, "ratio": r.ratio, "role": kind}
    if r.candidate_source:
        out["candidate_source"] = True
    if r.uses_candidates:
        out["uses_candidates"] = True
    if r.engram:
        out["engram"] = True
    return out


def _parameters(cfg: V41Config, specs: Specs) -> dict[str, int]:
    total = dspark = experts = engram = 0
    for name, (shape, _) in specs.items():
        n = math.prod(shape)
        total += n
        dspark += n if name.startswith("mtp.") else 0
        experts += n if ".ffn.experts." in name and not name.startswith("mtp.") else 0
        engram += n if name.endswith(".engram.embed.weight") else 0
    main = total - dspark
    # A token reads its top-k experts and, per Engram layer, one table row per (n-gram order, head).
    lookups = len(cfg.active_engram_layers) * cfg.engram_hash_heads * cfg.engram_head_dim
    active = main - experts - engram + experts * cfg.num_experts_per_tok // cfg.n_routed_experts + lookups
    return {"total": main, "active_per_token": active, "engram_tables": engram, "dspark": dspark}


def summarize_v41(model_dir: str | Path, block_size: int = 256, specs: Specs | None = None) -> dict[str, Any]:
    """``specs``: ``v41_parameter_specs(cfg)`` when the caller has them already (seconds at full size)."""
    from deepinfer.engine.memory_plan_v41 import v41_parameter_specs

    cfg = V41Config.from_model_dir(model_dir)
    specs = specs if specs is not None else v41_parameter_specs(cfg)
    plan = [_role(cfg, i) for i in range(cfg.num_hidden_layers)]
    bf16 = 2
    per_token = {packed: {p: build_v41_layout(cfg, block_size, packed=packed).bytes_per_block(p, bf16) / block_size
                          for p in POOLS} for packed in (True, False)}
    return {
        "model_dir": str(model_dir),
        "model_type": cfg.model_type,
        "layers": cfg.num_hidden_layers,
        "layer_roles": dict(Counter(r["role"] for r in plan)),
        "layer_plan": plan,
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "routed_experts": cfg.n_routed_experts,
        "experts_per_token": cfg.num_experts_per_tok,
        "sliding_window": cfg.sliding_window,
        "index_topk": cfg.index_topk,
        "engram_layers": list(cfg.active_engram_layers),
        "dspark_stages": cfg.num_nextn_predict_layers,
        "vision": cfg.vision_enabled,
        "parameters": _parameters(cfg, specs),
        **{key: {
            "history_bytes_per_token": per_token[packed][HISTORY],  # grows with every sequence's length
            "window_bytes_per_token": per_token[packed]["window"],  # only the last sliding_window positions are kept
            "state_bytes_per_token": per_token[packed]["state"],  # ratio-2 pair inputs: one position kept
        } for key, packed in (("cache_auto", True), ("cache_bf16", False))},
        "kv_cache_dtype": CACHE_FORMATS,
        "engine": "CPU reference step (model/v41/paged.py) with DSpark drafts, decoder-side bounded replay and "
                  "encoder-side replay of prefix hits; several CPU ranks (data, tensor and expert parallelism); "
                  "not yet: GPU kernels, context parallelism, DSpark or EPLB on several ranks",
    }
