"""``hf_overrides`` on a DeepSeek-V4.1 config.json: V4's semantics (fields merged into the config before the
model is built) on V4.1's nested layout (``text_config`` / ``vision_config``). The parse in ``config/v41.py``
then checks the result as it checks a checkpoint."""

from __future__ import annotations

from typing import Any

from deepinfer.config.v41 import _TEXT_DEFAULTS, _err

# Top-level config.json keys an override sets where it stands (the rest of the top level is the checkpoint's
# description: architectures, model_type). ``text_config`` / ``vision_config`` objects merge into those.
_TOP_LEVEL_KEYS = frozenset({"image_token_id", "bos_token_id", "eos_token_id", "pad_token_id", "dtype", "torch_dtype",
                             "quantization_config", "tie_word_embeddings"})
_NESTED = ("text_config", "vision_config")


def apply_v41_overrides(d: dict[str, Any], overrides: Any) -> dict[str, Any]:
    """``d`` (a V4.1 config.json) with ``overrides`` (``hf_overrides``) applied; V4's semantics (a dict of fields
    merged into the config before the model is built) on V4.1's nested layout:

    - ``{"text_config": {...}}`` / ``{"vision_config": {...}}`` merge their keys into that object (one level);
    - a plain key the text model reads (``num_hidden_layers``, ``n_routed_experts``, ``engram_num_embeddings``,
      ...: every ``text_config`` field and every field the parser defaults) is written into ``text_config``
      when the config nests one, at the top level when it is flattened, so that ``{"num_hidden_layers": 4}``
      means what it means for V4;
    - a key already in ``text_config`` wins over the top level (``bos_token_id``, ``tie_word_embeddings``, ...
      that both carry are set in ``text_config``, which the parser reads first); other top-level fields
      (``image_token_id``, ``quantization_config``, ``dtype``) stay at the top level.

    Fewer ``num_hidden_layers`` keep every per-layer schedule whole (``compress_ratios``, the KV / index /
    candidate sources, the Engram layers, the DSpark taps): the model keeps its first layers with the sharing
    and hashing the full model has there, as a truncated checkpoint does. The parse then checks the result as
    it checks a checkpoint (a compressed layer without its KV source, Engram layers without their table sizes,
    fewer schedule entries than layers, ...), and an error it raises names the field; DSpark taps past the
    kept layers are refused when speculation asks for the drafter (``V41Config.check_dspark``)."""
    if not isinstance(overrides, dict) or not all(isinstance(k, str) for k in overrides):
        raise _err("hf_overrides", f"expected a JSON object of config.json fields, got {overrides!r}")
    out = dict(d)
    nested = isinstance(d.get("text_config"), dict)
    text = dict(d["text_config"]) if nested else out  # where the text model's fields live
    text_fields = set(_TEXT_DEFAULTS) | {"rope_scaling", "quantization_config", "expert_dtype", "dtype", "torch_dtype"}
    for key, value in overrides.items():
        if key in _NESTED:
            if not isinstance(value, dict):
                raise _err(f"hf_overrides.{key}", f"expected a JSON object of {key} fields, got {value!r}")
            if "model_type" in value:
                raise _err(f"hf_overrides.{key}.model_type", "the model family cannot be overridden")
            if key == "text_config":
                text.update(value)
            else:
                base = out.get(key) or {}
                if not isinstance(base, dict):
                    raise _err(f"hf_overrides.{key}", f"this config.json's {key} is not an object to merge into")
                out[key] = {**base, **value}
        elif key == "model_type":
            raise _err("hf_overrides.model_type", "the model family cannot be overridden")
        elif nested and key in text:
            text[key] = value
        elif key in d or key in _TOP_LEVEL_KEYS:
            out[key] = value
        elif key in text_fields:
            text[key] = value
        else:
            raise _err("hf_overrides", f"{key!r} is neither a field of this config.json nor one deepinfer reads for "
                       "DeepSeek-V4.1 (nested objects: text_config, vision_config)")
    if nested:
        out["text_config"] = text
    return out
