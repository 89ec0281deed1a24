"""Weights between Hugging Face names (merged experts) and deepinfer's native names (per-expert w1/w3/w2)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from deepinfer.model.names import MERGED_EXPERTS, split_merged_experts, to_native


def hf_state_to_native(state: dict[str, torch.Tensor], rename: Callable[[str], str] = to_native) -> dict:
    """HF-named tensors (merged experts) -> native names (per-expert w1/w3/w2)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        native = rename(name)
        if MERGED_EXPERTS.match(native):
            out.update(split_merged_experts(native, t))
        else:
            out[native] = t
    return out


def native_to_hf_state(hf_module: nn.Module, native: dict[str, torch.Tensor],
                       rename: Callable[[str], str] = to_native) -> dict[str, torch.Tensor]:
    """For every tensor of ``hf_module.state_dict()``, the value from ``native`` (experts re-merged)."""
    out: dict[str, torch.Tensor] = {}
    for name, ref in hf_module.state_dict().items():
        nat = rename(name)
        match = MERGED_EXPERTS.match(nat)
        if match is None:
            out[name] = native[nat]
            continue
        prefix, kind = match.groups()
        e_range = range(ref.shape[0])
        if kind == "gate_up_proj":
            out[name] = torch.stack([torch.cat([native[f"{prefix}.ffn.experts.{e}.w1.weight"],
                                                native[f"{prefix}.ffn.experts.{e}.w3.weight"]]) for e in e_range])
        else:
            out[name] = torch.stack([native[f"{prefix}.ffn.experts.{e}.w2.weight"] for e in e_range])
    return out
