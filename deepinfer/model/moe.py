"""MoE FFN: hash-routed (layers < num_hash_layers) or bias-corrected top-k routed experts, plus a shared
expert. Every layer of V4 is MoE; expert SwiGLU clamps the gate from above and the up projection on both
sides (the shared expert too, as the reference implementation does)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.config.model import HASH_MOE, ModelConfig
from deepinfer.model.branches import INLINE, Branches
from deepinfer.model.fused import StackedLinear, projection_sets
from deepinfer.model.linear import Linear
from deepinfer.ops.table import REF, OpTable


class Expert(nn.Module):
    """Checkpoint names: ``w1`` (gate), ``w3`` (up), ``w2`` (down)."""

    ops: OpTable = REF  # its ``pointwise`` applies SiLU (replaced by model/device.py for other tables)

    def __init__(self, hidden: int, inter: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = Linear(hidden, inter, bias=False, dtype=dtype)
        self.w2 = Linear(inter, hidden, bias=False, dtype=dtype)
        self.w3 = Linear(hidden, inter, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        up = self.w3(x).clamp(min=-self.limit, max=self.limit)
        return self.w2(self.ops.pointwise(F.silu, gate) * up)


class Gate(nn.Module):
    """Router. ``weight`` [E, H]; ``bias`` [E] fp32 (routed layers) or ``tid2eid`` [V, k] int64 (hash layers)."""

    def __init__(self, cfg: ModelConfig, is_hash: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.is_hash = is_hash
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))


class ExpertLoop(nn.Module):
    """The routed experts as the reference computes them: the dequantized experts one by one, in ascending
    expert order, accumulating in the activation dtype. The device transform replaces it with stacked
    quantized experts (``FusedFP4Experts``, model/device.py) of the same call signature. The experts are
    referenced, not registered: their parameters keep their names (``ffn.experts.E.w1.weight``)."""

    def __init__(self, experts: nn.ModuleList) -> None:
        super().__init__()
        self._experts = (experts,)

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, add: torch.Tensor | None = None,
                before_add=None) -> torch.Tensor:
        experts = self._experts[0]
        routed = torch.zeros_like(x)
        for e in torch.unique(indices).tolist():
            tok, slot = torch.where(indices == e)
            out = experts[e](x[tok]) * weights[tok, slot, None]
            routed.index_add_(0, tok, out.to(x.dtype))
        if add is None:
            return routed
        if before_add is not None:
            before_add()
        return routed + add


class MoE(nn.Module):
    ops: OpTable = REF  # replaced by model/device.py for accelerated runs (one fused routing kernel)
    branches: Branches = INLINE  # two streams on the GPU path (model/device.py)

    def __init__(self, cfg: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        is_hash = layer < cfg.num_hidden_layers and cfg.mlp_layer_types[layer] == HASH_MOE
        self.gate = Gate(cfg, is_hash, dtype)
        inter, limit = cfg.moe_intermediate_size, cfg.swiglu_limit
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, inter, limit, dtype) for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(cfg.hidden_size, inter, limit, dtype) if cfg.n_shared_experts else None
        self.routed: nn.Module = ExpertLoop(self.experts)  # FusedFP4Experts after the device transform
        for attr, parts in projection_sets(self).items():  # the shared expert's w1|w3 (model/fused.py)
            setattr(self, attr, StackedLinear.side_by_side(parts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        shared = None
        if self.shared_experts is not None:
            # The shared expert runs beside the router and the routed experts (model/branches.py; inline on
            # the CPU); the routed experts' combine adds it once it is done.
            with self.branches.side():
                shared = self._shared(x)
        weights, indices = self._route(x, input_ids)
        return self.routed(x, indices, weights, add=shared, before_add=self.branches.join)

    def _route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        logits = self.ops.linear(x, self.gate.weight)
        weights, indices = self.ops.moe_route(
            logits,
            c.scoring_func,
            c.num_experts_per_tok,
            c.norm_topk_prob,
            c.routed_scaling_factor,
            bias=None if self.gate.is_hash else self.gate.bias,
            hash_indices=self.gate.tid2eid[input_ids] if self.gate.is_hash else None,
        )
        return weights, indices

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        e = self.shared_experts
        return e.w2(self.ops.swiglu(self.shared_w13(x), e.limit))  # Expert.forward's math
