"""deepinfer ``ModelConfig`` -> ``transformers`` ``DeepseekV4Config``."""

from __future__ import annotations

from deepinfer.config.model import CSA, DEFAULT_COMPRESS_RATES, HCA, ROUTED_MOE, SWA, ModelConfig


def hf_config(cfg: ModelConfig, extra_sliding_layers: int = 0):
    """A ``transformers`` ``DeepseekV4Config`` for ``cfg`` (eager attention). Layer kinds are passed explicitly as
    ``layer_types`` + ``compress_rates`` (HF's own ``compress_ratios`` parser knows only the ratios 0/4/128).
    ``extra_sliding_layers`` appends sliding-window, routed-MoE layers (used to build MTP blocks)."""
    from transformers import DeepseekV4Config

    d = cfg.to_native_dict()
    for key in ("compress_ratios", "num_hash_layers", "compress_rates", "quantization_config", "expert_dtype",
                "torch_dtype", "topk_method", "architectures"):
        d.pop(key, None)
    rates = dict(DEFAULT_COMPRESS_RATES)
    for kind, ratio in zip(cfg.layer_types, cfg.layer_compress_ratios):
        if kind in (CSA, HCA):
            rates[kind] = ratio
    d.update(num_hidden_layers=cfg.num_hidden_layers + extra_sliding_layers,
             layer_types=list(cfg.layer_types) + [SWA] * extra_sliding_layers,
             mlp_layer_types=list(cfg.mlp_layer_types) + [ROUTED_MOE] * extra_sliding_layers,
             compress_rates=rates)
    hc = DeepseekV4Config(**d)
    hc._attn_implementation = "eager"
    return hc
