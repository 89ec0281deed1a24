"""V41Config: the frozen description of a DeepSeek-V4.1 checkpoint (``model_type`` ``deepseek_v41``).

Spec: ``deepseek-v41-spec.md`` §1. The checkpoint's ``config.json`` nests the text model under
``text_config`` (and the vision tower under ``vision_config``); vLLM-style exports flatten the text fields
onto the top level. Both are accepted. The layer schedule is validated as the reference does: SWA-only
layers cannot be sources, every compressed layer needs a preceding KV source with the same ratio, KV
sources are index sources, the candidate source is a KV source, one Engram table size per Engram layer.
A config truncated to fewer layers keeps its full schedules (a prefix keeps its sharing and hashing).

Every rejection is a ValueError whose message starts with the offending field name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deepinfer.config.model import QuantConfig, RopeConfig

MODEL_TYPE = "deepseek_v41"
# V4.1's dense FP8 weights carry one UE8M0 scale per 32x32 block (V4: 128x128).
DEFAULT_BLOCK = (32, 32)

# Flash values (spec §1.2); the parser's defaults.
_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40, "num_attention_heads": 64,
    "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024,
    "o_groups": 8, "moe_intermediate_size": 2304, "n_routed_experts": 384, "num_experts_per_tok": 6,
    "n_shared_experts": 1, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "routed_scaling_factor": 1.5, "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "sliding_window": 128, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "max_position_embeddings": 1048576,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "engram_layer_ids": [1, 14],
    "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4, "engram_vocab_size": 16000000,
    "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092,
    "num_nextn_predict_layers": 3, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
    "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
    "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
    "dspark_confidence_input": "hidden",
}
# What the DSpark confidence head reads next to the Markov embedding: the final stage's collapsed residual
# before its norm (the released drafter, as vLLM serves it) or after it (drafts trained by NeMo AutoModel,
# whose DSpark module says so). Not a released config.json key: a checkpoint of the second kind sets it.
CONFIDENCE_INPUTS = ("hidden", "normed")
_DEFAULT_YARN = {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                 "original_max_position_embeddings": 65536}
_VISION_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 32, "hidden_size": 1024, "num_attention_heads": 16, "intermediate_size": 2816,
    "patch_size": 14, "rope_theta": 10000.0, "downsample_ratio": 3, "max_image_tokens": 1024, "min_pixels": 295936,
}
IMAGE_TOKEN_ID = 129264


def _err(name: str, msg: str) -> ValueError:
    return ValueError(f"{name}: {msg}")


class _Reader:
    """Typed reads of one dict with defaults; ``prefix`` names nested fields in errors (``text_config.x``)."""

    def __init__(self, d: dict, defaults: dict, prefix: str = "") -> None:
        self.d, self.defaults, self.prefix = d, defaults, prefix

    def get(self, key: str) -> Any:
        return self.d.get(key, self.defaults.get(key))

    def int(self, key: str, minimum: int = 1) -> int:
        v = self.get(key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise _err(self.prefix + key, f"expected an integer, got {v!r}")
        if v < minimum:
            raise _err(self.prefix + key, f"must be >= {minimum}, got {v}")
        return v

    def float(self, key: str, positive: bool = True) -> float:
        v = self.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise _err(self.prefix + key, f"expected a finite number, got {v!r}")
        if positive and v <= 0:
            raise _err(self.prefix + key, f"must be > 0, got {v}")
        return float(v)

    def bool(self, key: str) -> bool:
        v = self.get(key)
        if not isinstance(v, bool):
            raise _err(self.prefix + key, f"expected true or false, got {v!r}")
        return v

    def ints(self, key: str, minimum: int = 0) -> tuple[int, ...]:
        v = self.get(key)
        if not isinstance(v, list) or any(isinstance(x, bool) or not isinstance(x, int) or x < minimum for x in v):
            raise _err(self.prefix + key, f"expected a list of integers >= {minimum}, got {v!r}")
        return tuple(v)


@dataclass(frozen=True, slots=True)
class V41VisionConfig:
    """The vision tower's shape (spec §1.3). Parsed and validated; the tower itself is not built yet."""

    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int
    max_image_tokens: int
    min_pixels: int
    max_wh_ratio: float | None = None


@dataclass(frozen=True, slots=True)
class V41DSparkConfig:
    """The DSpark block drafter (spec §5): ``num_nextn_predict_layers`` window-only stages stored as ``mtp.*``,
    drafting ``block_size`` tokens at once from the target's streams entering ``target_layer_ids``."""

    block_size: int  # draft tokens per block (the block's rows attend to each other: always all of them)
    noise_token_id: int  # input id of block slots 1..block_size - 1
    target_layer_ids: tuple[int, ...]  # taps: the stream mean entering these backbone layers
    markov_rank: int  # rank of the Markov head's token-transition bias
    n_routed_experts: int
    num_experts_per_tok: int
    confidence_input: str  # one of CONFIDENCE_INPUTS


@dataclass(frozen=True, slots=True)
class V41LayerRole:
    """What one backbone layer owns and reads (spec §1.4)."""

    ratio: int  # 0: window only; 1 or 2: attends compressed entries too
    kv_source: bool  # owns a compressor and the index-key projection ("Full")
    index_source: bool  # runs an indexer (its own queries); "Reindex" when not a KV source
    candidate_source: bool  # publishes the candidate blocks later index sources are restricted to
    uses_candidates: bool  # an index source after the candidate source
    engram: bool  # an Engram injection before this layer


@dataclass(frozen=True, slots=True)
class V41Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    sliding_window: int
    main_rope: RopeConfig
    compress_rope: RopeConfig
    max_position_embeddings: int
    compress_ratios: tuple[int, ...]  # the full schedule (may be longer than num_hidden_layers)
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int  # -1: no candidate level
    candidate_topk_blocks: int
    candidate_block_size: int
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int  # DSpark stages (mtp.*), built on request (DeepseekV41(..., dspark=True))
    bos_token_id: int
    eos_token_id: int
    image_token_id: int
    vision: V41VisionConfig | None
    dspark: V41DSparkConfig
    dtype: str = "bfloat16"
    quant: QuantConfig | None = None
    model_type: str = MODEL_TYPE
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived views -------------------------------------------------------------------------------
    def role(self, layer: int) -> V41LayerRole:
        cand = self.candidate_source_layer_id
        index_source = layer in self.index_source_layer_ids
        return V41LayerRole(
            ratio=self.compress_ratios[layer],
            kv_source=layer in self.kv_source_layer_ids,
            index_source=index_source,
            candidate_source=layer == cand,
            uses_candidates=index_source and 0 <= cand < layer,
            engram=layer in self.engram_layer_ids,
        )

    @property
    def active_engram_layers(self) -> tuple[int, ...]:
        return tuple(i for i in self.engram_layer_ids if i < self.num_hidden_layers)

    @property
    def engram_hash_heads(self) -> int:
        """Table lookups per position and Engram layer: (max n-gram - 1) orders x heads."""
        return (self.engram_max_ngram_size - 1) * self.engram_n_heads

    @property
    def vision_enabled(self) -> bool:
        return self.vision is not None and self.vision.num_hidden_layers > 0

    def check_dspark(self) -> None:
        """What building the drafter needs beyond the parse: stages, and taps inside the built backbone (a
        config truncated to fewer layers keeps its schedules, so only a drafter on it is refused)."""
        if self.num_nextn_predict_layers < 1:
            raise _err("num_nextn_predict_layers", "the DSpark drafter needs at least one stage, got 0")
        if not 0 <= self.dspark.noise_token_id < self.vocab_size:
            raise _err("dspark_noise_token_id", f"must lie in [0, vocab_size={self.vocab_size}), got "
                       f"{self.dspark.noise_token_id}")
        bad = [i for i in self.dspark.target_layer_ids if i >= self.num_hidden_layers]
        if bad:
            raise _err("dspark_target_layer_ids", f"layers {bad} are not among the {self.num_hidden_layers} built "
                       "backbone layers (num_hidden_layers)")

    def to_native_dict(self) -> dict[str, Any]:
        """The config.json this config was read from (what the prefix cache's model fingerprint hashes)."""
        return dict(self.raw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "V41Config":
        return parse_v41_config(d)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, overrides: dict[str, Any] | None = None) -> "V41Config":
        """``overrides``: ``hf_overrides`` (``config/v41_overrides.apply_v41_overrides``); an error the parse raises then starts with
        ``hf_overrides:`` so that it reads as a consequence of them."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json in the model directory")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        if overrides is None:
            return cls.from_dict(d)
        from deepinfer.config.v41_overrides import apply_v41_overrides  # it reads this module's field table

        d = apply_v41_overrides(d, overrides)
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"hf_overrides: {e} (after applying {overrides!r})") from None


def is_v41_config(d: dict[str, Any]) -> bool:
    return isinstance(d, dict) and d.get("model_type") == MODEL_TYPE


def _text_fields(d: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The text model's fields and the prefix naming them in errors (nested or flattened form)."""
    text = d.get("text_config")
    if text is None:
        return d, ""
    if not isinstance(text, dict):
        raise _err("text_config", f"expected a JSON object, got {type(text).__name__}")
    inner = text.get("model_type", "deepseek_v41_text")
    if inner != "deepseek_v41_text":
        raise _err("text_config.model_type", f"{inner!r} is not supported; allowed: deepseek_v41_text")
    # Top-level token ids apply when the text config leaves them out.
    merged = {k: d[k] for k in ("bos_token_id", "eos_token_id", "quantization_config", "expert_dtype") if k in d}
    merged.update(text)
    return merged, "text_config."


def _vision(d: dict[str, Any]) -> V41VisionConfig | None:
    v = d.get("vision_config")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _err("vision_config", f"expected a JSON object, got {type(v).__name__}")
    r = _Reader(v, _VISION_DEFAULTS, "vision_config.")
    layers = r.int("num_hidden_layers", 0)
    hidden, heads = r.int("hidden_size"), r.int("num_attention_heads")
    if hidden % heads or (hidden // heads) % 4:
        raise _err("vision_config.hidden_size", f"{hidden} / {heads} heads must give a head size divisible by 4 "
                   "(2-D rope)")
    ratio = v.get("max_wh_ratio")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))
                              or not math.isfinite(ratio) or ratio < 1):
        raise _err("vision_config.max_wh_ratio", f"expected null or a number >= 1, got {ratio!r}")
    return V41VisionConfig(layers, hidden, heads, r.int("intermediate_size"), r.int("patch_size"),
                           r.float("rope_theta"), r.int("downsample_ratio"), r.int("max_image_tokens"),
                           r.int("min_pixels"), None if ratio is None else float(ratio))


def _ropes(r: _Reader, rope_dim: int) -> tuple[RopeConfig, RopeConfig]:
    main = RopeConfig(theta=r.float("rope_theta"), rope_dim=rope_dim)
    theta = r.float("compress_rope_theta")
    scaling = r.d.get("rope_scaling", _DEFAULT_YARN)
    if scaling is None:
        return main, RopeConfig(theta=theta, rope_dim=rope_dim)
    if not isinstance(scaling, dict):
        raise _err(r.prefix + "rope_scaling", f"expected a JSON object or null, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return main, RopeConfig(theta=theta, rope_dim=rope_dim)
    if kind != "yarn":
        raise _err(r.prefix + "rope_scaling", f"type {kind!r} is not supported; allowed: yarn, default")
    factor = scaling.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
        raise _err(r.prefix + "rope_scaling.factor", f"expected a number > 0, got {factor!r}")
    return main, RopeConfig(theta=theta, rope_dim=rope_dim, yarn_factor=float(factor),
                            beta_fast=float(scaling.get("beta_fast") or 32),
                            beta_slow=float(scaling.get("beta_slow") or 1),
                            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings")
                                                                 or 65536))


def _quant(d: dict[str, Any]) -> QuantConfig | None:
    q = d.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise _err("quantization_config", f"expected a JSON object, got {q!r}")
    if q.get("quant_method", "fp8") != "fp8":
        raise _err("quantization_config.quant_method", f"{q.get('quant_method')!r} is not supported; allowed: fp8")
    if q.get("fmt", "e4m3") != "e4m3":
        raise _err("quantization_config.fmt", f"{q.get('fmt')!r} is not supported; allowed: e4m3")
    if q.get("scale_fmt", "ue8m0") not in ("ue8m0", None):
        raise _err("quantization_config.scale_fmt", f"{q.get('scale_fmt')!r} is not supported; allowed: ue8m0")
    block = q.get("weight_block_size", list(DEFAULT_BLOCK))
    if not isinstance(block, list) or len(block) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b <= 0
                                                             for b in block):
        raise _err("quantization_config.weight_block_size", f"expected two positive ints, got {block!r}")
    expert = q.get("expert_dtype", d.get("expert_dtype", "fp4"))
    if expert not in ("fp4", "fp8", "bf16"):
        raise _err("quantization_config.expert_dtype", f"{expert!r} is not supported; allowed: fp4, fp8, bf16")
    return QuantConfig(weight_block_size=(block[0], block[1]), expert_dtype=expert)


def _check_dims(r: _Reader, c: dict[str, Any]) -> None:
    p = r.prefix
    if r.get("num_key_value_heads") != 1:
        raise _err(p + "num_key_value_heads", f"V4.1 has one shared latent KV head, got {r.get('num_key_value_heads')}")
    if r.get("n_shared_experts") != 1:
        raise _err(p + "n_shared_experts", f"V4.1 has exactly one shared expert, got {r.get('n_shared_experts')}")
    if r.get("scoring_func") != "sqrtsoftplus":
        raise _err(p + "scoring_func", f"{r.get('scoring_func')!r} is not supported; allowed: sqrtsoftplus")
    if r.get("topk_method") not in ("noaux_tc", None):
        raise _err(p + "topk_method", f"{r.get('topk_method')!r} is not supported; allowed: noaux_tc")
    if r.get("hidden_act") != "silu":
        raise _err(p + "hidden_act", f"{r.get('hidden_act')!r} is not supported; allowed: silu")
    if r.get("tie_word_embeddings"):
        raise _err(p + "tie_word_embeddings", "V4.1 has an untied head; allowed: false")
    if c["num_attention_heads"] % c["o_groups"]:
        raise _err(p + "o_groups", f"{c['o_groups']} must divide num_attention_heads {c['num_attention_heads']}")
    rope = c["qk_rope_head_dim"]
    if rope % 2 or rope > min(c["head_dim"], c["index_head_dim"]):
        raise _err(p + "qk_rope_head_dim", f"must be even and at most head_dim and index_head_dim, got {rope}")
    if c["num_experts_per_tok"] > c["n_routed_experts"]:
        raise _err(p + "num_experts_per_tok", f"{c['num_experts_per_tok']} exceeds n_routed_experts "
                   f"{c['n_routed_experts']}")


def _check_schedule(p: str, c: dict[str, Any]) -> None:
    ratios, n = c["compress_ratios"], c["num_hidden_layers"]
    if len(ratios) < n:
        raise _err(p + "compress_ratios", f"has {len(ratios)} entries but num_hidden_layers is {n}")
    for i, r in enumerate(ratios[:n]):
        if r not in (0, 1, 2):
            raise _err(p + "compress_ratios", f"entry {i} is {r}; allowed values are 0, 1, 2 (V4.1 has no HCA)")
    for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
        ids = c[key]
        if list(ids) != sorted(set(ids)):
            raise _err(p + key, f"must be strictly increasing, got {list(ids)}")
        if any(i >= len(ratios) for i in ids):
            raise _err(p + key, f"refers to a layer past compress_ratios ({len(ratios)} entries): {list(ids)}")
    kv, index = c["kv_source_layer_ids"], c["index_source_layer_ids"]
    if not set(kv) <= set(index):
        raise _err(p + "index_source_layer_ids", f"must contain every KV source {list(kv)}")
    owner = None
    for layer, r in enumerate(ratios[:n]):
        if r == 0:
            if layer in index:
                raise _err(p + "index_source_layer_ids", f"layer {layer} is window-only (ratio 0) and cannot be a "
                           "KV or index source")
            continue
        if layer in kv:
            owner = r
        if owner != r:
            raise _err(p + "kv_source_layer_ids", f"compressed layer {layer} (ratio {r}) needs a preceding KV "
                       "source with the same ratio")
    cand = c["candidate_source_layer_id"]
    if cand < -1:
        raise _err(p + "candidate_source_layer_id", f"must be -1 (off) or a layer id, got {cand}")
    if cand >= 0 and cand not in kv:
        raise _err(p + "candidate_source_layer_id", f"{cand} must be one of the KV sources {list(kv)}")
    if cand >= 0 and any(cand < i < n for i in kv):
        # A new source resets the shared state, so index sources after it would have no candidates.
        raise _err(p + "kv_source_layer_ids", f"no KV source may follow the candidate source {cand}, got {list(kv)}")
    if len(c["engram_num_embeddings"]) != len(c["engram_layer_ids"]):
        raise _err(p + "engram_num_embeddings", f"needs one row count per Engram layer {list(c['engram_layer_ids'])}, "
                   f"got {list(c['engram_num_embeddings'])}")
    if c["engram_layer_ids"] and c["engram_max_ngram_size"] < 2:
        raise _err(p + "engram_max_ngram_size", f"must be >= 2 when Engram layers exist, got "
                   f"{c['engram_max_ngram_size']}")
    if not 0 <= c["engram_pad_token_id"] < c["vocab_size"]:
        raise _err(p + "engram_pad_token_id", f"must lie in [0, vocab_size), got {c['engram_pad_token_id']}")


def _dspark(r: _Reader) -> V41DSparkConfig:
    p = r.prefix
    noise = r.int("dspark_noise_token_id", 0)  # its range is checked with the drafter (the default is Flash's)
    taps = r.ints("dspark_target_layer_ids")
    if not taps or list(taps) != sorted(set(taps)):
        raise _err(p + "dspark_target_layer_ids", f"must be a non-empty, strictly increasing list, got {list(taps)}")
    experts, top_k = r.int("dspark_n_routed_experts"), r.int("dspark_num_experts_per_tok")
    if top_k > experts:
        raise _err(p + "dspark_num_experts_per_tok", f"{top_k} exceeds dspark_n_routed_experts {experts}")
    conf = r.get("dspark_confidence_input")
    if conf not in CONFIDENCE_INPUTS:
        raise _err(p + "dspark_confidence_input", f"{conf!r} is not supported; allowed: "
                   f"{', '.join(CONFIDENCE_INPUTS)}")
    return V41DSparkConfig(r.int("dspark_block_size"), noise, taps, r.int("dspark_markov_rank"), experts, top_k, conf)


def parse_v41_config(d: dict[str, Any]) -> V41Config:
    if not isinstance(d, dict):
        raise ValueError(f"config: expected a dict, got {type(d).__name__}")
    if d.get("model_type") != MODEL_TYPE:
        raise _err("model_type", f"{d.get('model_type')!r} is not {MODEL_TYPE!r}")
    text, p = _text_fields(d)
    defaults = dict(_TEXT_DEFAULTS)
    if "engram_layer_ids" in text and "engram_num_embeddings" not in text and not text["engram_layer_ids"]:
        defaults["engram_num_embeddings"] = []
    r = _Reader(text, defaults, p)
    c: dict[str, Any] = {k: r.int(k) for k in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim",
        "q_lora_rank", "o_lora_rank", "o_groups", "moe_intermediate_size", "n_routed_experts", "num_experts_per_tok",
        "hc_mult", "hc_sinkhorn_iters", "sliding_window", "max_position_embeddings", "index_n_heads",
        "index_head_dim", "index_topk", "candidate_topk_blocks", "candidate_block_size", "engram_n_heads",
        "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size")}
    c.update({k: r.int(k, 0) for k in ("engram_max_ngram_size", "engram_pad_token_id", "num_nextn_predict_layers",
                                       "bos_token_id", "eos_token_id")})
    c["candidate_source_layer_id"] = r.int("candidate_source_layer_id", -(2**31))
    c.update({k: r.ints(k) for k in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids",
                                     "engram_layer_ids")})
    c["engram_num_embeddings"] = r.ints("engram_num_embeddings", 1)
    _check_dims(r, c)
    _check_schedule(p, c)
    main_rope, compress_rope = _ropes(r, c["qk_rope_head_dim"])
    image = d.get("image_token_id", IMAGE_TOKEN_ID)
    if isinstance(image, bool) or not isinstance(image, int) or image < 0:
        raise _err("image_token_id", f"expected a non-negative integer, got {image!r}")
    dtype = text.get("dtype", text.get("torch_dtype", d.get("dtype", d.get("torch_dtype", "bfloat16"))))
    return V41Config(
        **c,
        norm_topk_prob=r.bool("norm_topk_prob"),
        routed_scaling_factor=r.float("routed_scaling_factor"),
        swiglu_limit=r.float("swiglu_limit"),
        rms_norm_eps=r.float("rms_norm_eps"),
        hc_eps=r.float("hc_eps"),
        main_rope=main_rope,
        compress_rope=compress_rope,
        image_token_id=image,
        vision=_vision(d),
        dspark=_dspark(r),
        dtype=str(dtype),
        quant=_quant(text),
        raw=dict(d),
    )
