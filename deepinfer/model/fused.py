"""Weight layouts of the batched step path: projections that read the same input run as one GEMM.

A decode step of one layer is a chain of small kernels, so each launch saved is time saved. Several
places read one input through weights the checkpoint stores separately:
  * the attention input x feeds wq_a and wkv (FP8), and in compressed layers the compressor's kv and
    gate projections, in CSA layers also the indexer compressor's kv and gate and the indexer's head
    weights (bf16): one stack per weight format;
  * the normalised query latent feeds wq_b and, in CSA layers, the indexer's wq_b (FP8);
  * the shared expert's gate (w1) and up (w3) projections.
Every model is built with each set as a ``StackedLinear.side_by_side`` (the parts run one after another
and are concatenated; no weight of its own, so loading and the parameter names are unaffected).
``fuse_projections`` (the device transform) stacks each set once, after loading, into one weight and
points the original modules at row slices of it (views: no second copy). Parts that cannot share one
weight (FP8 rows that are not whole 128-row scale blocks, in tiny test models) run one GEMM each and are
concatenated: the caller sees the same [T, sum of rows] layout either way.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.model.linear import Linear
from deepinfer.ops.table import REF, OpTable


class StackedLinear(nn.Module):
    """Row-stacked projections of one input: ``forward(x)`` -> [T, sum(out)]; ``cols[name]`` -> column start."""

    ops: OpTable = REF  # bf16 stacks run ops.linear (replaced by model/device.py for accelerated runs)

    def __init__(self, parts: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.fused = True  # built by fuse_projections from the modules as they are now
        self._refs: tuple[nn.Module, ...] | None = None
        kinds = {type(m) for _, m in parts}
        if len(kinds) != 1:
            raise TypeError(f"cannot stack {sorted(k.__name__ for k in kinds)}: one weight format per stack")
        self.cols: dict[str, int] = {}
        start = 0
        for name, module in parts:
            self.cols[name] = start
            start += _rows(module)
        first = parts[0][1]
        self.parts: list[nn.Module] | None = None
        if len(parts) == 1:
            self.inner = first
        elif isinstance(first, Linear):
            self.inner = Linear(first.in_features, start, dtype=first.weight.dtype)
            self.inner.weight = nn.Parameter(torch.cat([m.weight.detach() for _, m in parts]), requires_grad=False)
            for name, module in parts:
                a = self.cols[name]
                module.weight = nn.Parameter(self.inner.weight[a : a + _rows(module)], requires_grad=False)
        elif all(_rows(m) % 128 == 0 for _, m in parts):  # FP8Linear: whole 128-row scale blocks
            self.inner = type(first).stacked([m for _, m in parts])
        else:
            self.parts = nn.ModuleList(m for _, m in parts)

    @classmethod
    def side_by_side(cls, parts: list[tuple[str, nn.Module]]) -> "StackedLinear":
        """The parts' outputs concatenated, computed one part at a time. The parts are referenced, not
        registered as submodules: their parameters keep their one name (``layers.N.attn.wq_a.weight``)."""
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.fused, out.parts, out.inner = False, None, None
        out._refs = tuple(m for _, m in parts)
        out.cols, start = {}, 0
        for name, module in parts:
            out.cols[name] = start
            start += module.out_features
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._refs is not None:
            return torch.cat([m(x) for m in self._refs], dim=-1) if len(self._refs) > 1 else self._refs[0](x)
        if self.parts is not None:
            return torch.cat([m(x) for m in self.parts], dim=-1)
        if isinstance(self.inner, Linear):
            return self.ops.linear(x, self.inner.weight)
        return self.inner(x)


def _rows(module: nn.Module) -> int:
    w = module.weight if hasattr(module, "weight") else module.weight_fp8
    return w.shape[0]


def projection_sets(module: nn.Module) -> dict[str, list[tuple[str, nn.Module]]]:
    """The stacks an Attention or MoE module has (attribute -> named parts), from its modules as they are."""
    from deepinfer.model.attention import Attention
    from deepinfer.model.moe import MoE

    if isinstance(module, Attention):
        ix = getattr(module, "indexer", None)
        sets = {"x_proj": [("q", module.wq_a), ("kv", module.wkv)],
                "q_proj": [("q", module.wq_b)] + ([("ix_q", ix.wq_b)] if ix is not None else [])}
        if hasattr(module, "compressor"):
            parts = [("kv", module.compressor.wkv), ("gate", module.compressor.wgate)]
            if ix is not None:
                parts += [("ix_kv", ix.compressor.wkv), ("ix_gate", ix.compressor.wgate), ("ix_w", ix.weights_proj)]
            sets["side_proj"] = parts
        return sets
    if isinstance(module, MoE) and module.shared_experts is not None:
        e = module.shared_experts
        return {"shared_w13": [("w1", e.w1), ("w3", e.w3)]}
    return {}


def fuse_projections(model: nn.Module) -> None:
    """Stack the projections above in every block into one weight each (idempotent)."""
    for module in list(model.modules()):
        for attr, parts in projection_sets(module).items():
            if not getattr(module, attr).fused:
                setattr(module, attr, StackedLinear(parts))
