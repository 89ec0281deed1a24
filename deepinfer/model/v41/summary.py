"""``deepinfer info`` for a DeepSeek-V4.1 checkpoint: its layer plan, parameters and cache, from config.json
alone (a meta-device model; no weights are read).

The per-device memory plan of V4 (``engine/memory_plan.py``) sizes the GPU path's weight formats and
parallel layouts, which V4.1 does not have yet; the cache figures here are the engine's pools as the CPU
path allocates them.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from deepinfer.config.v41 import V41Config
from deepinfer.kv.spec import HISTORY, POOLS
from deepinfer.kv.spec_v41 import build_v41_layout

CACHE_FORMATS = {
    "auto": "window KV FP8 e4m3 (scale per 32), indexer q/k MXFP4, compressed KV NVFP4, each rounded as the "
            "reference does and stored in the activation dtype",
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


def _parameters(cfg: V41Config) -> dict[str, int]:
    from deepinfer.model.v41.model import DeepseekV41

    with torch.device("meta"):
        model = DeepseekV41(cfg, torch.bfloat16, shapes_only=True, dspark=cfg.num_nextn_predict_layers > 0)
    total = dspark = experts = 0
    for name, t in model.state_dict().items():
        n = math.prod(t.shape)
        total += n
        dspark += n if name.startswith("mtp.") else 0
        experts += n if ".ffn.experts." in name and not name.startswith("mtp.") else 0
    main = total - dspark
    active = main - experts + experts * cfg.num_experts_per_tok // cfg.n_routed_experts
    return {"total": main, "active_per_token": active, "dspark": dspark}


def summarize_v41(model_dir: str | Path, block_size: int = 256) -> dict[str, Any]:
    cfg = V41Config.from_model_dir(model_dir)
    layout = build_v41_layout(cfg, block_size)
    plan = [_role(cfg, i) for i in range(cfg.num_hidden_layers)]
    bf16 = 2
    per_token = {p: layout.bytes_per_block(p, bf16) / block_size for p in POOLS}
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
        "parameters": _parameters(cfg),
        "cache_bf16": {
            "history_bytes_per_token": per_token[HISTORY],  # grows with every sequence's length
            "window_bytes_per_token": per_token["window"],  # only the last sliding_window positions are kept
            "state_bytes_per_token": per_token["state"],  # ratio-2 pair inputs: one position kept
        },
        "kv_cache_dtype": CACHE_FORMATS,
        "engine": "CPU reference step (model/v41/paged.py); not yet: GPU kernels, several devices, DSpark drafts, "
                  "decoder-side bounded replay",
    }
