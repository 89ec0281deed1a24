"""ModelConfig: the frozen description of a DeepSeek-V4 checkpoint, parsed from its ``config.json``.

Two spellings of the same facts exist in the wild:
  * DeepSeek-native (the released checkpoints): ``compress_ratios`` (one int per layer, plus MTP slots),
    ``num_hash_layers``, ``qk_rope_head_dim``, a top-level ``rope_scaling``, ``expert_dtype``.
  * Hugging Face-folded (``save_pretrained`` of ``DeepseekV4Config``): ``layer_types``, ``mlp_layer_types``,
    ``rope_parameters = {"main": ..., "compress": ...}``, ``compress_rates``, ``partial_rotary_factor``.
Both are accepted. Layer kinds are derived from ``compress_ratios`` whenever it is present, and never from
Hugging Face's default schedule (which would put an HCA layer where V4-Pro has CSA).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

SWA = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
ATTENTION_KINDS = (SWA, CSA, HCA)
HASH_MOE = "hash_moe"
ROUTED_MOE = "moe"
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
SUPPORTED_MODEL_TYPES = ("deepseek_v4",)
DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """One RoPE table. ``yarn_factor`` is None for plain RoPE."""

    theta: float
    rope_dim: int
    yarn_factor: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 65536
    attention_factor: float = 1.0  # V4 applies no YaRN mscale; HF forces 1.0 unless a config sets it


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """On-disk weight format. Dense linears: FP8 e4m3 + UE8M0 block scales; experts per ``expert_dtype``."""

    fmt: str = "e4m3"
    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"  # "fp4" (e2m1, per-32 UE8M0 scales), "fp8" (as dense) or "bf16"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    moe_intermediate_size: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    sliding_window: int
    layer_types: tuple[str, ...]
    layer_compress_ratios: tuple[int, ...]  # 0 for SWA layers, else the layer's compression ratio m
    mlp_layer_types: tuple[str, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    main_rope: RopeConfig
    compress_rope: RopeConfig
    max_position_embeddings: int
    num_nextn_predict_layers: int
    bos_token_id: int
    eos_token_id: int
    tie_word_embeddings: bool = False
    dtype: str = "bfloat16"
    quant: QuantConfig | None = None
    model_type: str = "deepseek_v4"
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived views -------------------------------------------------------------------------------
    @property
    def num_hash_layers(self) -> int:
        return sum(1 for t in self.mlp_layer_types if t == HASH_MOE)

    def compress_ratio(self, layer: int) -> int:
        return self.layer_compress_ratios[layer]

    def rope_for(self, layer_type: str) -> RopeConfig:
        return self.main_rope if layer_type == SWA else self.compress_rope

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    def to_native_dict(self) -> dict[str, Any]:
        """The DeepSeek-native ``config.json`` spelling of this config (used by checkpoint writers)."""
        ratios = list(self.layer_compress_ratios) + [0] * self.num_nextn_predict_layers
        d: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "n_shared_experts": self.n_shared_experts,
            "moe_intermediate_size": self.moe_intermediate_size,
            "scoring_func": self.scoring_func,
            "topk_method": "noaux_tc",
            "norm_topk_prob": self.norm_topk_prob,
            "routed_scaling_factor": self.routed_scaling_factor,
            "num_hash_layers": self.num_hash_layers,
            "swiglu_limit": self.swiglu_limit,
            "sliding_window": self.sliding_window,
            "compress_ratios": ratios,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.main_rope.theta,
            "compress_rope_theta": self.compress_rope.theta,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.dtype,
        }
        if set(self.layer_compress_ratios) - {0, 4, 128}:
            # Non-default rates: also spell the layer kinds out, since readers that map compress_ratios
            # through the default {4: CSA, 128: HCA} table (Hugging Face) cannot place other values.
            d["compress_rates"] = _rates_of(self)
            d["layer_types"] = list(self.layer_types)
        r = self.compress_rope
        if r.yarn_factor is not None:
            d["rope_scaling"] = {
                "type": "yarn",
                "factor": r.yarn_factor,
                "beta_fast": r.beta_fast,
                "beta_slow": r.beta_slow,
                "original_max_position_embeddings": r.original_max_position_embeddings,
            }
        if self.quant is not None:
            d["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": self.quant.fmt,
                "activation_scheme": "dynamic",
                "weight_block_size": list(self.quant.weight_block_size),
                "scale_fmt": self.quant.scale_fmt,
            }
            d["expert_dtype"] = self.quant.expert_dtype
        return d

    # ---- construction --------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        from deepinfer.config.parse import parse_model_config

        return parse_model_config(d)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, overrides: dict[str, Any] | None = None) -> "ModelConfig":
        """``overrides``: config.json fields to change first (``hf_overrides``, e.g. fewer layers); an error
        about one of them says so."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json in the model directory")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(d, dict):
            raise ValueError(f"{path}: expected a JSON object at the top level")
        if overrides is None:
            return cls.from_dict(d)
        from deepinfer.config.parse import apply_overrides

        try:
            return cls.from_dict(apply_overrides(d, overrides))
        except ValueError as e:
            field = str(e).split(":")[0].split(".")[0]
            if field in overrides:
                raise ValueError(f"hf_overrides: {e}") from None
            raise

    def replace(self, **changes: Any) -> "ModelConfig":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return ModelConfig(**values)


def _rates_of(cfg: ModelConfig) -> dict[str, int]:
    rates = dict(DEFAULT_COMPRESS_RATES)
    for kind, ratio in zip(cfg.layer_types, cfg.layer_compress_ratios):
        if kind != SWA:
            rates[kind] = ratio
    return rates


def lcm_of_ratios(cfg: ModelConfig) -> int:
    out = 1
    for r in cfg.layer_compress_ratios:
        if r:
            out = math.lcm(out, r)
    return out
