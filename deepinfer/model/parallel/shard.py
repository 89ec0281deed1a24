"""A rank's share of the model, two ways from the same specs (``TPAttention.shards``, ``TPMoE.shards``,
``expert_range``):

  * ``sharding_hook(pctx)``: what the engine loads with (``load_model(..., shard_model=sharding_hook(pctx))``).
    On the meta model, before anything is allocated, each module becomes its sharded type with parameters
    of its slice's shape and says what it owns (``param_shards``, ``owned_experts``: ``model/shard.py``);
    the loader then reads only those slices from disk, quantized-first (``model/weight_loaders.py``).
  * ``shard_model(model, pctx)``: a model loaded whole (with ``keep_quantized``) cut in place, its on-disk
    FP8/FP4 forms in ``model.quantized`` too (so ``prepare_for_device`` afterwards builds FP8 linears and
    fused FP4 experts of the slices). The oracle the hook's loads are checked against, bit for bit.
Both keep a slice dequantized where it falls off its scale blocks (tiny shapes), with its stack-mates.
"""

from __future__ import annotations

from collections.abc import Callable

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
            _cut(module, name, specs, quantized)
            routed = [k for k in specs if k.startswith("experts.")]
            if any(f"{name}.{k}" not in quantized for k in routed):
                # The fused FP4 experts need every expert quantized: one expert's slice off its scale
                # groups (tiny shapes; then every expert's is) sends the routed experts to the reference loop.
                for key in [k for k in quantized if k.startswith(f"{name}.experts.")]:
                    del quantized[key]
            _unify_stacks(module, name, quantized)
            module.__class__ = TPMoE
            module.became_sharded(pctx)
    return model


def sharding_hook(pctx: ParallelContext) -> Callable[[DeepseekV4], None]:
    """The loader's sharding hook for this rank (``load_model(..., shard_model=...)``), validated against the
    model's config; a world of one only records ``pctx``."""

    def hook(model: DeepseekV4) -> None:
        pctx.config.validate(model.cfg)
        model.parallel = pctx
        if pctx.config.is_single:
            return
        for module in list(model.modules()):
            if isinstance(module, Attention) and pctx.tp_size > 1:
                _declare(module, TPAttention.shards(pctx))
                module.__class__ = TPAttention
                module.became_sharded(pctx)
            elif isinstance(module, MoE) and pctx.ep_size > 1:
                local = expert_range(pctx, len(module.experts))
                module.__class__ = EPMoE
                module.became_sharded(pctx, local)
                module.owned_experts = local  # the loader reads these experts only, into experts[0..n)
            elif isinstance(module, MoE) and pctx.tp_size > 1:
                _declare(module, TPMoE.shards(pctx, len(module.experts), module.shared_experts is not None))
                module.__class__ = TPMoE
                module.became_sharded(pctx)

    return hook


def _declare(module: nn.Module, specs: dict[str, Shard]) -> None:
    """On the meta model: each named parameter takes its slice's shape, and its owner says which slice
    (``param_shards``) for the loader to read."""
    for rel, spec in specs.items():
        owner_name, _, attr = rel.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        old = getattr(owner, attr)
        lo, hi = spec.bounds(old.shape[spec.dim], rel)
        shape = [hi - lo if d == spec.dim else n for d, n in enumerate(old.shape)]
        owner._parameters[attr] = nn.Parameter(torch.empty(shape, dtype=old.dtype, device="meta"),
                                               requires_grad=False)
        if isinstance(owner, Linear):
            owner.out_features, owner.in_features = shape
        owner.param_shards = {**getattr(owner, "param_shards", {}), attr: spec}


def _cut(module: nn.Module, prefix: str, specs: dict[str, Shard], quantized: dict[str, QuantizedWeight]) -> None:
    """Replace each named weight by its slice (and its quantized form, dropped when not block-aligned)."""
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
            else:
                quantized[key] = piece


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


@torch.no_grad()
def empty_mtp_passes(model: DeepseekV4, count: int) -> None:
    """``count`` MTP passes without tokens (speculative decoding): the MTP layer's MoE with zero rows each
    time, so a rank with fewer passes in a step (no drafts to chain, or no work) joins the collectives of
    the ranks that run more."""
    if count <= 0:
        return
    pctx = model.parallel
    x = torch.empty(0, model.cfg.hidden_size, dtype=model.dtype, device=pctx.device)
    ids = torch.empty(0, dtype=torch.long, device=pctx.device)
    for _ in range(count):  # every pass runs the first MTP layer (``DeepseekV4.mtp_forward``'s depth 0)
        model.mtp[0].ffn(x, ids)
