"""``shard_model``: a loaded single-process model -> this rank's share of it, in place.

Each sharded module type says what it cuts (``TPAttention.shards``, ``TPMoE.shards``, ``expert_range``);
this module applies that to the dequantized weights and to their on-disk FP8/FP4 forms in
``model.quantized`` (so ``prepare_for_device`` afterwards builds FP8 linears and fused FP4 experts of the
slices), then turns the module into its sharded type. The loaded modules are converted rather than
rebuilt so that no weight is copied twice; a loader that reads only the rank's slices will build the
sharded types directly and use the same specs.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.distributed.world import ParallelContext
from deepinfer.model.attention import Attention
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.fused import projection_sets
from deepinfer.model.linear import Linear
from deepinfer.model.moe import MoE
from deepinfer.model.parallel.attention import TPAttention
from deepinfer.model.parallel.moe import EPMoE, TPMoE, expert_range
from deepinfer.model.parallel.slices import take, take_quantized
from deepinfer.model.shard import Shard
from deepinfer.model.quant import QuantizedWeight


def shard_model(model: DeepseekV4, pctx: ParallelContext) -> DeepseekV4:
    """Keep this rank's slices of ``model`` (validated against ``pctx.config``); a world of one is a no-op."""
    pctx.config.validate(model.cfg)
    model.parallel = pctx
    if pctx.config.is_single:
        return model
    quantized: dict[str, QuantizedWeight] = getattr(model, "quantized", {}) or {}
    for name, module in list(model.named_modules()):
        if isinstance(module, Attention) and pctx.tp_size > 1:
            _cut(module, name, TPAttention.shards(pctx), quantized)
            _unify_stacks(module, name, quantized)
            module.__class__ = TPAttention
            module.became_sharded(pctx)
        elif isinstance(module, MoE) and pctx.ep_size > 1:
            local = expert_range(pctx, len(module.experts))
            _renumber_experts(quantized, name, local)
            module.__class__ = EPMoE
            module.became_sharded(pctx, local)
        elif isinstance(module, MoE) and pctx.tp_size > 1:
            specs = TPMoE.shards(pctx, len(module.experts), module.shared_experts is not None)
            if not _cut(module, name, specs, quantized):
                # The fused FP4 experts need every expert quantized: one slice off its scale blocks (tiny
                # shapes) sends the whole layer to the dequantized reference loop.
                for key in [k for k in quantized if k.startswith(f"{name}.experts.")]:
                    del quantized[key]
            _unify_stacks(module, name, quantized)
            module.__class__ = TPMoE
            module.became_sharded(pctx)
    return model


def _cut(module: nn.Module, prefix: str, specs: dict[str, Shard], quantized: dict[str, QuantizedWeight]) -> bool:
    """Replace each named weight by its slice (and its quantized form, dropped when not block-aligned);
    False when some quantized form was dropped."""
    whole = True
    for rel, spec in specs.items():
        owner_name, _, attr = rel.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        owner._parameters[attr] = nn.Parameter(take(getattr(owner, attr).detach(), spec, f"{prefix}.{rel}"), requires_grad=False)
        if isinstance(owner, Linear):
            owner.out_features, owner.in_features = owner.weight.shape
        key = f"{prefix}.{rel}"
        if key in quantized:
            piece = take_quantized(quantized[key], spec, key)
            if piece is None:
                del quantized[key]
                whole = False
            else:
                quantized[key] = piece
    return whole


def _unify_stacks(module: nn.Module, prefix: str, quantized: dict[str, QuantizedWeight]) -> None:
    """A stack of projections (``model/fused.py``) needs one weight format: where a slice lost its quantized
    form, its stack-mates run dequantized too."""
    names = {id(m): n for n, m in module.named_modules()}
    for parts in projection_sets(module).values():
        keys = [f"{prefix}.{names[id(m)]}.weight" for _, m in parts]
        if any(k not in quantized for k in keys):
            for k in keys:
                quantized.pop(k, None)


def _renumber_experts(quantized: dict[str, QuantizedWeight], prefix: str, local: range) -> None:
    """Keep the owned experts' quantized weights, under their local numbers (``EPMoE``'s ``experts[i]``)."""
    head = f"{prefix}.experts."
    mine = {}
    for key in [k for k in quantized if k.startswith(head)]:
        e, _, rest = key[len(head):].partition(".")
        q = quantized.pop(key)
        if int(e) in local:
            mine[f"{head}{int(e) - local.start}.{rest}"] = q
    quantized.update(mine)


def needs_empty_steps(model: DeepseekV4) -> bool:
    """Whether a rank without tokens must still run its layers' collectives (expert parallel worlds)."""
    pctx = getattr(model, "parallel", None)
    return pctx is not None and pctx.ep_size > 1


@torch.no_grad()
def empty_step(model: DeepseekV4) -> None:
    """A step without tokens: every layer's MoE with zero rows, so this rank joins the dispatch/combine
    collectives of the ranks that have tokens (attention needs nothing: its all-reduce is within the TP
    group, whose ranks all share this rank's empty batch)."""
    pctx = model.parallel
    x = torch.empty(0, model.cfg.hidden_size, dtype=model.dtype, device=pctx.device)
    ids = torch.empty(0, dtype=torch.long, device=pctx.device)
    for layer in model.layers:
        layer.ffn(x, ids)
