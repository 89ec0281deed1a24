"""Checkpoint tensor names -> model parameter names, in one declarative table.

The model's parameters carry the DeepSeek-native names. Three spellings reach the loader:
  1. native (released checkpoints): ``embed.weight``, ``layers.3.attn.wq_a.weight`` (+ ``.scale``), ...
  2. Hugging Face ``save_pretrained`` output, a hybrid: a ``model.`` prefix on everything but
     ``head.weight``, ``model.embed_tokens.weight``, ``model.hc_head.hc_fn``, and ``layers.N.attn.norm``
     for the attention KV norm;
  3. Hugging Face module names (``model.layers.3.self_attn.q_a_proj.weight``, merged experts
     ``mlp.experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``), e.g. from ``state_dict()``.
``to_native`` maps a single name; merged expert tensors are split by ``split_merged_experts``.
"""

from __future__ import annotations

import re

import torch

# (pattern, replacement) applied in order to names without the leading "model." prefix. Patterns are
# anchored on dots so that e.g. the top-level "norm.weight" is never touched by a layer rule.
_HF_TO_NATIVE: tuple[tuple[str, str], ...] = (
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.sinks$", ".attn_sink"),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.weight_scale_inv$", ".scale"),
    (r"_scale_inv$", ".scale"),
)
_COMPILED = tuple((re.compile(p), r) for p, r in _HF_TO_NATIVE)
# save_pretrained writes the attention KV norm as "attn.norm"; the native name is "attn.kv_norm".
_ATTN_NORM = re.compile(r"^(layers\.\d+|mtp\.\d+)\.attn\.norm\.weight$")
MERGED_EXPERTS = re.compile(r"^(layers\.\d+|mtp\.\d+)\.ffn\.experts\.(gate_up_proj|down_proj)$")


def to_native(name: str) -> str:
    """Map any accepted spelling of a checkpoint tensor name to the model's native parameter name."""
    if name.startswith("model."):
        name = name[len("model."):]
    for pattern, repl in _COMPILED:
        name = pattern.sub(repl, name)
    name = _ATTN_NORM.sub(r"\1.attn.kv_norm.weight", name)
    return name


def split_merged_experts(native_name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF merged experts -> per-expert native tensors. gate_up_proj [E, 2I, H] holds w1 (gate) then w3 (up)."""
    match = MERGED_EXPERTS.match(native_name)
    if match is None:
        raise ValueError(f"{native_name}: not a merged expert tensor")
    prefix, kind = match.groups()
    out: dict[str, torch.Tensor] = {}
    for e in range(tensor.shape[0]):
        if kind == "gate_up_proj":
            w1, w3 = tensor[e].chunk(2, dim=0)
            out[f"{prefix}.ffn.experts.{e}.w1.weight"] = w1
            out[f"{prefix}.ffn.experts.{e}.w3.weight"] = w3
        else:
            out[f"{prefix}.ffn.experts.{e}.w2.weight"] = tensor[e]
    return out
