"""Parse a ``config.json`` dict (DeepSeek-native or Hugging Face-folded) into a validated ModelConfig.

Every rejection is a ValueError whose message starts with the offending field name.
"""

from __future__ import annotations

import math
from typing import Any

from deepinfer.config.model import (
    ATTENTION_KINDS,
    CSA,
    DEFAULT_COMPRESS_RATES,
    HASH_MOE,
    HCA,
    ROUTED_MOE,
    SCORING_FUNCS,
    SUPPORTED_MODEL_TYPES,
    SWA,
    ModelConfig,
    QuantConfig,
    RopeConfig,
)

# Defaults are V4-Flash's published values (and equal Hugging Face's DeepseekV4Config defaults).
_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
}
_DEFAULT_HASH_LAYERS = 3
# Every config.json field the parser reads (an override of any other field would change nothing).
FIELDS = frozenset(_DEFAULTS) | {
    "model_type", "compress_ratios", "layer_types", "compress_rates", "compress_rate_csa", "compress_rate_hca",
    "mlp_layer_types", "num_hash_layers", "qk_rope_head_dim", "partial_rotary_factor", "rope_parameters",
    "rope_scaling", "quantization_config", "expert_dtype", "torch_dtype", "dtype", "scoring_func",
}
_PER_LAYER = ("compress_ratios", "layer_types", "mlp_layer_types")
_RATIO_KIND = {0: SWA}


def _err(field: str, msg: str) -> ValueError:
    return ValueError(f"{field}: {msg}")


def _int(d: dict, key: str, minimum: int = 1) -> int:
    v = d.get(key, _DEFAULTS.get(key))
    if isinstance(v, bool) or not isinstance(v, int):
        raise _err(key, f"expected an integer, got {v!r}")
    if v < minimum:
        raise _err(key, f"must be >= {minimum}, got {v}")
    return v


def _float(d: dict, key: str, minimum: float | None = None) -> float:
    v = d.get(key, _DEFAULTS.get(key))
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _err(key, f"expected a finite number, got {v!r}")
    if minimum is not None and v < minimum:
        raise _err(key, f"must be >= {minimum}, got {v}")
    return float(v)


def _bool(d: dict, key: str) -> bool:
    v = d.get(key, _DEFAULTS.get(key))
    if not isinstance(v, bool):
        raise _err(key, f"expected true or false, got {v!r}")
    return v


def _eos(d: dict) -> int:
    v = d.get("eos_token_id", 1)
    if isinstance(v, list):  # HF allows a list; the first is the canonical end of sentence
        if not v or not all(isinstance(x, int) for x in v):
            raise _err("eos_token_id", f"expected an int or a non-empty list of ints, got {v!r}")
        return v[0]
    if isinstance(v, bool) or not isinstance(v, int):
        raise _err("eos_token_id", f"expected an int, got {v!r}")
    return v


def _compress_rates(d: dict) -> dict[str, int]:
    rates = dict(DEFAULT_COMPRESS_RATES)
    given = d.get("compress_rates")
    if given is not None:
        if not isinstance(given, dict) or set(given) - {CSA, HCA}:
            raise _err("compress_rates", f"expected a dict with keys {CSA!r}/{HCA!r}, got {given!r}")
        rates.update(given)
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if d.get(legacy) is not None:
            rates[kind] = d[legacy]
    for kind, r in rates.items():
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise _err("compress_rates", f"{kind} rate must be a positive integer, got {r!r}")
    if rates[CSA] == rates[HCA]:
        raise _err("compress_rates", "CSA and HCA rates must differ")
    return rates


def _layer_schedule(d: dict, n: int, rates: dict[str, int]) -> tuple[tuple[str, ...], tuple[int, ...]]:
    ratios = d.get("compress_ratios")
    types = d.get("layer_types")
    if ratios is not None:
        if not isinstance(ratios, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ratios):
            raise _err("compress_ratios", f"expected a list of integers, got {ratios!r}")
        if len(ratios) < n:
            raise _err("compress_ratios", f"has {len(ratios)} entries but num_hidden_layers is {n}")
        by_ratio = {0: SWA, rates[CSA]: CSA, rates[HCA]: HCA}
        kinds = []
        for i, r in enumerate(ratios[:n]):
            if r not in by_ratio:
                raise _err(
                    "compress_ratios",
                    f"entry {i} is {r}; allowed values are {sorted(by_ratio)} (set compress_rates for others)",
                )
            kinds.append(by_ratio[r])
        derived = tuple(kinds)
        if types is not None and tuple(types[:n]) != derived:
            raise _err("layer_types", "disagrees with compress_ratios (layer kinds are taken from compress_ratios)")
        # Entries after the MTP slots are ignored, as Hugging Face does: configs truncated to fewer layers
        # (benchmarks) keep the full list, and later checkpoints append slots for their draft layers.
        num_mtp = d.get("num_nextn_predict_layers", _DEFAULTS["num_nextn_predict_layers"])
        mtp = ratios[n : n + num_mtp] if isinstance(num_mtp, int) else []
        if any(r != 0 for r in mtp):
            raise _err("compress_ratios", f"MTP slots {mtp} must be 0 (the MTP block is sliding-window only)")
        return derived, tuple(ratios[:n])
    if types is None:
        raise _err("compress_ratios", "missing (and no layer_types either): cannot tell the layer kinds")
    if not isinstance(types, list) or len(types) < n:
        raise _err("layer_types", f"expected a list of {n} layer kinds, got {types!r}")
    for i, t in enumerate(types[:n]):
        if t not in ATTENTION_KINDS:
            raise _err("layer_types", f"entry {i} is {t!r}; allowed: {', '.join(ATTENTION_KINDS)}")
    kinds = tuple(types[:n])
    return kinds, tuple(0 if k == SWA else rates[k] for k in kinds)


def _mlp_schedule(d: dict, n: int) -> tuple[str, ...]:
    types = d.get("mlp_layer_types")
    n_hash = d.get("num_hash_layers")
    if n_hash is not None and (isinstance(n_hash, bool) or not isinstance(n_hash, int) or n_hash < 0):
        raise _err("num_hash_layers", f"expected a non-negative integer, got {n_hash!r}")
    if types is not None:
        if not isinstance(types, list) or len(types) < n:
            raise _err("mlp_layer_types", f"expected a list of {n} entries, got {types!r}")
        for i, t in enumerate(types[:n]):
            if t not in (HASH_MOE, ROUTED_MOE):
                raise _err("mlp_layer_types", f"entry {i} is {t!r}; allowed: {HASH_MOE}, {ROUTED_MOE}")
        out = tuple(types[:n])
        if n_hash is not None and out != tuple([HASH_MOE] * min(n, n_hash) + [ROUTED_MOE] * max(0, n - n_hash)):
            raise _err("mlp_layer_types", "disagrees with num_hash_layers")
        return out
    k = _DEFAULT_HASH_LAYERS if n_hash is None else n_hash
    return tuple([HASH_MOE] * min(n, k) + [ROUTED_MOE] * max(0, n - k))


def _rope_dim(d: dict, head_dim: int) -> int:
    rope_dim = d.get("qk_rope_head_dim")
    prf = d.get("partial_rotary_factor")
    if rope_dim is None and prf is None:
        rope_dim = 64 if head_dim >= 64 else head_dim
    elif rope_dim is None:
        if not isinstance(prf, (int, float)) or not 0 < prf <= 1:
            raise _err("partial_rotary_factor", f"must be in (0, 1], got {prf!r}")
        rope_dim = int(head_dim * prf)
    elif prf is not None and int(head_dim * prf) != rope_dim:
        raise _err("partial_rotary_factor", f"{prf} * head_dim {head_dim} != qk_rope_head_dim {rope_dim}")
    if isinstance(rope_dim, bool) or not isinstance(rope_dim, int) or rope_dim <= 0 or rope_dim % 2:
        raise _err("qk_rope_head_dim", f"must be a positive even integer, got {rope_dim!r}")
    if rope_dim > head_dim:
        raise _err("qk_rope_head_dim", f"{rope_dim} exceeds head_dim {head_dim}")
    return rope_dim


def _ropes(d: dict, rope_dim: int) -> tuple[RopeConfig, RopeConfig]:
    main_theta = _float(d, "rope_theta", 1.0)
    compress_theta = _float(d, "compress_rope_theta", 1.0)
    params = d.get("rope_parameters")
    scaling = d.get("rope_scaling")
    if isinstance(params, dict) and isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main_theta = float(params["main"].get("rope_theta", main_theta))
        if params["main"].get("rope_type", "default") != "default":
            raise _err("rope_parameters", "the 'main' table must be plain RoPE (rope_type 'default')")
        scaling = params["compress"]
        compress_theta = float(scaling.get("rope_theta", compress_theta))
    elif isinstance(params, dict) and scaling is None:
        scaling = params
    elif params is not None and not isinstance(params, dict):
        raise _err("rope_parameters", f"expected a dict, got {params!r}")
    main = RopeConfig(theta=main_theta, rope_dim=rope_dim)
    if scaling is None:
        return main, RopeConfig(theta=compress_theta, rope_dim=rope_dim)
    if not isinstance(scaling, dict):
        raise _err("rope_scaling", f"expected a dict, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return main, RopeConfig(theta=compress_theta, rope_dim=rope_dim)
    if kind != "yarn":
        raise _err("rope_scaling", f"type {kind!r} is not supported; allowed: yarn, default")
    try:
        compress = RopeConfig(
            theta=compress_theta,
            rope_dim=rope_dim,
            yarn_factor=float(scaling["factor"]),
            beta_fast=float(scaling.get("beta_fast") or 32),
            beta_slow=float(scaling.get("beta_slow") or 1),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
            attention_factor=float(scaling.get("attention_factor") or 1.0),
        )
    except KeyError as e:
        raise _err("rope_scaling", f"yarn needs {e.args[0]!r}") from None
    if compress.yarn_factor <= 0:
        raise _err("rope_scaling", f"factor must be > 0, got {compress.yarn_factor}")
    return main, compress


def _quant(d: dict) -> QuantConfig | None:
    q = d.get("quantization_config")
    expert_dtype = d.get("expert_dtype")
    if expert_dtype not in (None, "fp4", "fp8", "bf16"):
        raise _err("expert_dtype", f"{expert_dtype!r} is not supported; allowed: fp4, fp8, bf16")
    if q is None:  # a dequantized checkpoint may still carry the original expert_dtype: weights are floats
        return None
    if not isinstance(q, dict):
        raise _err("quantization_config", f"expected a dict, got {q!r}")
    method = q.get("quant_method", "fp8")
    if method != "fp8":
        raise _err("quantization_config.quant_method", f"{method!r} is not supported; allowed: fp8")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _err("quantization_config.fmt", f"{fmt!r} is not supported; allowed: e4m3")
    block = q.get("weight_block_size", [128, 128])
    if not isinstance(block, list) or len(block) != 2 or any(not isinstance(b, int) or b <= 0 for b in block):
        raise _err("quantization_config.weight_block_size", f"expected two positive ints, got {block!r}")
    scale_fmt = q.get("scale_fmt", "ue8m0")
    if scale_fmt not in ("ue8m0", None):
        raise _err("quantization_config.scale_fmt", f"{scale_fmt!r} is not supported; allowed: ue8m0")
    expert_dtype = q.get("expert_dtype", expert_dtype) or "fp8"
    if expert_dtype not in ("fp4", "fp8", "bf16"):
        raise _err("expert_dtype", f"{expert_dtype!r} is not supported; allowed: fp4, fp8, bf16")
    return QuantConfig(fmt=fmt, weight_block_size=(block[0], block[1]), scale_fmt="ue8m0", expert_dtype=expert_dtype)


def _check_shapes(c: ModelConfig) -> None:
    if c.num_attention_heads % c.o_groups:
        raise _err("o_groups", f"{c.o_groups} must divide num_attention_heads {c.num_attention_heads}")
    if c.num_experts_per_tok > c.n_routed_experts:
        raise _err("num_experts_per_tok", f"{c.num_experts_per_tok} exceeds n_routed_experts {c.n_routed_experts}")
    if c.scoring_func not in SCORING_FUNCS:
        raise _err("scoring_func", f"{c.scoring_func!r} is not one of {', '.join(SCORING_FUNCS)}")
    if c.index_head_dim < c.qk_rope_head_dim:
        raise _err("index_head_dim", f"{c.index_head_dim} is smaller than qk_rope_head_dim {c.qk_rope_head_dim}")
    if c.n_shared_experts not in (0, 1):
        raise _err("n_shared_experts", f"only 0 or 1 shared expert is supported, got {c.n_shared_experts}")
    if c.num_nextn_predict_layers > 1:
        raise _err("num_nextn_predict_layers", f"at most 1 MTP layer is supported, got {c.num_nextn_predict_layers}")


def apply_overrides(d: dict[str, Any], overrides: Any) -> dict[str, Any]:
    """``d`` with ``overrides`` (``hf_overrides``: config.json fields) applied. A key must be a field of
    ``d`` or one the parser reads. Fewer ``num_hidden_layers`` keep the first layers: each per-layer list
    (``compress_ratios``, ``layer_types``, ``mlp_layer_types``) keeps its first N entries and the MTP slots
    that followed the last layer, unless the overrides set that list themselves."""
    if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
        raise _err("hf_overrides", f"expected a JSON object of config.json fields, got {overrides!r}")
    for key in overrides:
        if key not in d and key not in FIELDS:
            raise _err("hf_overrides", f"{key!r} is neither a field of this config.json nor one deepinfer reads")
    out = {**d, **overrides}
    old, new = d.get("num_hidden_layers", _DEFAULTS["num_hidden_layers"]), overrides.get("num_hidden_layers")
    if isinstance(new, int) and isinstance(old, int) and not isinstance(new, bool) and 0 < new < old:
        for key in _PER_LAYER:
            if key not in overrides and isinstance(d.get(key), list):
                out[key] = d[key][:new] + d[key][old:]
    return out


def parse_model_config(d: dict[str, Any]) -> ModelConfig:
    if not isinstance(d, dict):
        raise ValueError(f"config: expected a dict, got {type(d).__name__}")
    model_type = d.get("model_type")
    if model_type == "deepseek_v41":
        raise _err("model_type", "'deepseek_v41' (DeepSeek-V4.1) is not a DeepSeek-V4 config: read it with "
                   "deepinfer.config.v41.V41Config (the engine picks the parser by model_type)")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _err("model_type", f"{model_type!r} is not supported; this build supports {SUPPORTED_MODEL_TYPES}")
    n = _int(d, "num_hidden_layers")
    if d.get("num_key_value_heads", 1) != 1:
        raise _err("num_key_value_heads", f"DeepSeek-V4 has one shared KV head, got {d['num_key_value_heads']}")
    head_dim = _int(d, "head_dim", 2)
    rope_dim = _rope_dim(d, head_dim)
    rates = _compress_rates(d)
    kinds, ratios = _layer_schedule(d, n, rates)
    main_rope, compress_rope = _ropes(d, rope_dim)
    cfg = ModelConfig(
        vocab_size=_int(d, "vocab_size"),
        hidden_size=_int(d, "hidden_size"),
        num_hidden_layers=n,
        num_attention_heads=_int(d, "num_attention_heads"),
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        q_lora_rank=_int(d, "q_lora_rank"),
        o_groups=_int(d, "o_groups"),
        o_lora_rank=_int(d, "o_lora_rank"),
        n_routed_experts=_int(d, "n_routed_experts"),
        num_experts_per_tok=_int(d, "num_experts_per_tok"),
        n_shared_experts=_int(d, "n_shared_experts", 0),
        moe_intermediate_size=_int(d, "moe_intermediate_size"),
        scoring_func=d.get("scoring_func", _DEFAULTS["scoring_func"]),
        norm_topk_prob=_bool(d, "norm_topk_prob"),
        routed_scaling_factor=_float(d, "routed_scaling_factor", 0.0),
        swiglu_limit=_float(d, "swiglu_limit", 0.0),
        sliding_window=_int(d, "sliding_window"),
        layer_types=kinds,
        layer_compress_ratios=ratios,
        mlp_layer_types=_mlp_schedule(d, n),
        index_n_heads=_int(d, "index_n_heads"),
        index_head_dim=_int(d, "index_head_dim"),
        index_topk=_int(d, "index_topk"),
        hc_mult=_int(d, "hc_mult"),
        hc_sinkhorn_iters=_int(d, "hc_sinkhorn_iters"),
        hc_eps=_float(d, "hc_eps", 0.0),
        rms_norm_eps=_float(d, "rms_norm_eps", 0.0),
        main_rope=main_rope,
        compress_rope=compress_rope,
        max_position_embeddings=_int(d, "max_position_embeddings"),
        num_nextn_predict_layers=_int(d, "num_nextn_predict_layers", 0),
        bos_token_id=_int(d, "bos_token_id", 0),
        eos_token_id=_eos(d),
        tie_word_embeddings=_bool(d, "tie_word_embeddings"),
        dtype=str(d.get("torch_dtype", d.get("dtype", "bfloat16"))),
        quant=_quant(d),
        model_type=model_type,
        raw=dict(d),
    )
    _check_shapes(cfg)
    return cfg
