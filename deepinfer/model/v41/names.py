"""V4.1 checkpoint names and storage formats (spec §7.1).

Two spellings reach the loader: the released (DeepSeek-native) names the model's parameters carry
(``embed.weight``, ``layers.N.attn.attn_sink``, ``layers.N.hc_attn_fn``, ``layers.N.ffn.experts.E.w1.weight``,
``layers.N.ffn.gate.bias``, ``head.weight``) and the Hugging Face module names of ports and exports
(``model.embed_tokens.weight``, ``model.layers.N.attn.sinks_param.weight``, ``model.layers.N.attn_hc.fn``,
``...experts.E.gate_proj.weight``, ``...gate.e_score_correction_bias``, ``lm_head.weight``; the DSpark
stages as ``mtp.S.attn_hc.fn`` ..., with or without ``model.``).

Quantized checkpoints store the dense projections (attention, indexer queries, shared expert, Engram
``wkv``) as FP8 e4m3 with one UE8M0 scale per 32x32 block (``weight_block_size``), routed experts as packed
FP4 (per ``expert_dtype``), and Engram tables as FP8 with one UE8M0 scale per row and 32 columns.
"""

from __future__ import annotations

import re
from typing import Literal

from deepinfer.config.v41 import V41Config

Format = Literal["fp8", "fp4", "float"]

_HF_TO_NATIVE: tuple[tuple[re.Pattern, str], ...] = tuple((re.compile(p), r) for p, r in (
    (r"^embed_tokens\.", "embed."),
    (r"^lm_head\.", "head."),
    (r"^((?:layers|mtp)\.\d+)\.(attn|ffn)_hc\.(fn|base|scale)$", r"\1.hc_\2_\3"),
    (r"\.attn\.sinks_param\.weight$", ".attn.attn_sink"),
    (r"(\.ffn\.(?:experts\.\d+|shared_experts))\.gate_proj\.", r"\1.w1."),
    (r"(\.ffn\.(?:experts\.\d+|shared_experts))\.up_proj\.", r"\1.w3."),
    (r"(\.ffn\.(?:experts\.\d+|shared_experts))\.down_proj\.", r"\1.w2."),
    (r"\.ffn\.gate\.e_score_correction_bias$", ".ffn.gate.bias"),
    (r"\.weight_scale_inv$", ".scale"),
))
# Tensors of parts this text model does not build: the vision tower, its aligner and image delimiters, and
# the DSpark drafter unless it is asked for. They are skipped (and listed as ignored).
NOT_BUILT = re.compile(r"^(vision\.|aligner\.|image_(start|end|newline|pad)$|mtp\.)")
NOT_BUILT_WITH_DSPARK = re.compile(r"^(vision\.|aligner\.|image_(start|end|newline|pad)$)")
# The DSpark stages (mtp.S) store their dense projections, main_proj included, like the backbone's; their
# norms, mHC, gate, Markov head (bf16) and confidence head (fp32) are unquantized.
_FP8_DENSE = re.compile(
    r"^(layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|engram\.wkv)"
    r"|mtp\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.w[123]|main_proj))\.weight$")
_ROUTED_EXPERT = re.compile(r"^(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
_ENGRAM_TABLE = re.compile(r"^layers\.\d+\.engram\.embed\.weight$")
FP4_GROUP = 32
ENGRAM_TABLE_BLOCK = (1, 32)  # one scale per row and 32 columns


def to_native(name: str) -> str:
    """Any accepted spelling -> the model's parameter name."""
    name = name.removeprefix("model.")
    for pattern, repl in _HF_TO_NATIVE:
        name = pattern.sub(repl, name)
    return name


def storage_format(name: str, cfg: V41Config) -> tuple[Format, tuple[int, int] | None]:
    """How a native weight is stored, and the (rows, cols) of the weight one scale covers."""
    q = cfg.quant
    if q is None:
        return "float", None
    if _FP8_DENSE.match(name):
        return "fp8", q.weight_block_size
    if _ENGRAM_TABLE.match(name):
        return "fp8", ENGRAM_TABLE_BLOCK
    if _ROUTED_EXPERT.match(name):
        if q.expert_dtype == "fp4":
            return "fp4", (1, FP4_GROUP)
        if q.expert_dtype == "fp8":
            return "fp8", q.weight_block_size
    return "float", None


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".scale"
