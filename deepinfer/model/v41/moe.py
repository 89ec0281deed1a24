"""V4.1 MoE (spec §2.8): score-only routing, no hash layers. sqrt(softplus) scores in fp32; the top-k is
taken over score + bias, where the bias is ``gate.bias`` for text tokens and ``gate.bias_vl`` for image-span
tokens; the weights are the chosen scores normalised and scaled (the bias only selects; the selection rule
is V4's ``ops/ref/moe.route``). Experts (the shared one too) are V4's clamped SwiGLU, but computed in fp32
and cast once before the down projection, and the routed and shared outputs are combined in fp32 with a
single cast at the end (the V4.1 reference's rounding; V4's own loop stays as it is)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.config.v41 import V41Config
from deepinfer.model.linear import Linear
from deepinfer.ops.ref.moe import route
from deepinfer.ops.table import REF, OpTable


class Expert(nn.Module):
    """Checkpoint names: ``w1`` (gate), ``w3`` (up), ``w2`` (down)."""

    # The fp32 clamped SwiGLU (``ops.v41_swiglu``): the device build sets the device's table.
    ops: OpTable = REF

    def __init__(self, hidden: int, inter: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = Linear(hidden, inter, dtype=dtype)
        self.w2 = Linear(inter, hidden, dtype=dtype)
        self.w3 = Linear(hidden, inter, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.ops.v41_swiglu(self.w1(x), self.w3(x), self.limit))


class Gate(nn.Module):
    """``ffn.gate.``: weight [E, H], bias [E] fp32 (text tokens), bias_vl [E] fp32 (image-span tokens)."""

    def __init__(self, hidden: int, experts: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(experts, hidden, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(experts, dtype=torch.float32))


class MoE(nn.Module):
    # The router after the gate GEMM (``ops.moe_route``, text tokens): the device build sets the device's table.
    ops: OpTable = REF

    def __init__(self, cfg: V41Config, dtype: torch.dtype, experts: int | None = None, top_k: int | None = None
                 ) -> None:
        """``experts``/``top_k``: the routed experts and how many each token picks (default: the backbone's;
        the DSpark stages have their own)."""
        super().__init__()
        self.cfg = cfg
        experts = cfg.n_routed_experts if experts is None else experts
        self.top_k = cfg.num_experts_per_tok if top_k is None else top_k
        inter, limit = cfg.moe_intermediate_size, cfg.swiglu_limit
        self.gate = Gate(cfg.hidden_size, experts, dtype)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, inter, limit, dtype) for _ in range(experts))
        self.shared_experts = Expert(cfg.hidden_size, inter, limit, dtype)
        # The experts stacked as one FP4 module on a device (``device.py``: ``FusedFP4Experts``); None: the loop.
        self.routed: nn.Module | None = None

    def select(self, x: torch.Tensor, image_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k]); ``image_mask`` [T] bool, or None when the step
        has no image span (every token takes ``gate.bias``: one routing launch on a device)."""
        c = self.cfg
        logits = torch.nn.functional.linear(x.float(), self.gate.weight.float())
        if image_mask is None:
            return self.ops.moe_route(logits, "sqrtsoftplus", self.top_k, c.norm_topk_prob, c.routed_scaling_factor,
                                      bias=self.gate.bias)
        bias = torch.where(image_mask.unsqueeze(-1), self.gate.bias_vl, self.gate.bias)
        return route(logits, "sqrtsoftplus", self.top_k, c.norm_topk_prob, c.routed_scaling_factor, bias=bias)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None) -> torch.Tensor:
        """x [T, H], image_mask [T] bool (None: no image span) -> [T, H]."""
        weights, indices = self.select(x, image_mask)
        out = self.shared_experts(x).float()
        if self.routed is not None:  # the routed sum in x.dtype (V4's combine), added to the shared in fp32
            return (out + self.routed(x, indices, weights).float()).to(x.dtype)
        for e in torch.unique(indices).tolist():  # ascending expert order
            tok, slot = torch.where(indices == e)
            out.index_add_(0, tok, self.experts[e](x[tok]).float() * weights[tok, slot, None])
        return out.to(x.dtype)
