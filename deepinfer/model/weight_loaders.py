"""Quantized-first model building: empty modules in their final layout, and one weight loader per tensor.

``build_model`` builds DeepseekV4 on the meta device, swaps in the device transform's module types while
nothing is allocated yet (``FP8Linear`` for FP8 dense linears, one ``FusedFP4Experts`` per MoE with FP4
experts: ``model/device.py``), materializes every buffer empty on the target device and stacks the
projections (``model/fused.py``; the parts become views of the stacks). No weight exists in any other
layout at any time: the dequantized experts and linears of the reference model are never allocated.

``weight_loaders`` then gives each checkpoint tensor (native name) its destination, vLLM style: a loader
takes that one tensor as stored (codes + scale for FP8/FP4) and writes it into its final buffer, e.g.
expert e's w1 codes into rows of the stacked w13 at expert e, in the op table's layout. Loaders say which
part of the tensor they need (``selection``, ``model/shard.py``): the whole tensor, a ``Shard`` a sharded
module declared (``param_shards``), or ``SKIP`` for experts another rank owns. A sharded MoE holds only its
``owned_experts``, numbered locally (``experts[i]``, or row i of the fused stacks, is expert ``owned.start + i``).
A slice that does not fall on its scale blocks (tiny test shapes only) cannot be held quantized: that module
(with its stack-mates, or a layer's routed experts) stays a dequantized reference module even with an op
table, as ``shard_model`` leaves it.

Without an op table (the CPU reference path) the model keeps its reference modules and FP8/FP4 tensors
are dequantized one at a time as they arrive (``keep`` also keeps the stored form in ``model.quantized``,
for the load-then-transform path ``prepare_for_device`` takes).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from deepinfer.config.model import ModelConfig
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.device import FP8Linear, FusedFP4Experts, finish_transform
from deepinfer.model.fused import StackedLinear, projection_sets
from deepinfer.model.linear import Linear
from deepinfer.model.moe import ExpertLoop, MoE
from deepinfer.model.quant import QuantizedWeight, dequant_fp4, dequant_fp8_block
from deepinfer.model.rope import RopeTables
from deepinfer.model.shard import SKIP, Selection, Shard, on_scale_blocks, plain_index, whole_shape
from deepinfer.ops.table import OpTable

_EXPERT = re.compile(r"^(.*)\.experts\.(\d+)\.(w[123])\.weight$")
_UE8M0 = (torch.uint8, torch.float8_e8m0fnu)


@dataclass(frozen=True)
class StoredWeight:
    """How one FP8/FP4 weight is stored (from the checkpoint's headers, or what dummy weights use)."""

    fmt: str  # "fp8" | "fp4"
    block: tuple[int, int]  # weight elements per scale
    scale_dtype: torch.dtype


class WeightLoader(Protocol):
    selection: Selection

    def load(self, data: torch.Tensor, scale: torch.Tensor | None) -> None: ...


def _shard(module: nn.Module, attr: str) -> Shard | None:
    return getattr(module, "param_shards", {}).get(attr)


def _fits(name: str, got: tuple[int, ...], dst: torch.Tensor) -> None:
    if got != tuple(dst.shape):
        raise ValueError(f"{name}: the checkpoint's part has shape {got}, the model's tensor {tuple(dst.shape)}")


@dataclass
class PlainLoader:
    """bf16/fp16/fp32/int64 tensors into a parameter or buffer (converted to its dtype, as the model keeps it)."""

    name: str
    dst: torch.Tensor
    selection: Selection = None

    def load(self, data: torch.Tensor, scale: torch.Tensor | None) -> None:
        _fits(self.name, tuple(data.shape), self.dst)
        self.dst.copy_(data)


@dataclass
class DequantLoader:
    """The reference path: FP8/FP4 codes + scale, dequantized (fp32, exact) into the parameter's dtype.

    ``cut``: a slice the module holds that does not fall on the scale blocks (tiny test shapes; V4's never
    do): the whole tensor is read and dequantized, then cut, the values a load-whole-then-cut gives."""

    name: str
    dst: torch.Tensor
    fmt: str
    block: tuple[int, int]
    keep: dict[str, QuantizedWeight] | None = None
    selection: Selection = None
    cut: Shard | None = None

    def load(self, data: torch.Tensor, scale: torch.Tensor | None) -> None:
        assert scale is not None
        w = dequant_fp8_block(data, scale, self.block) if self.fmt == "fp8" else dequant_fp4(data, scale)
        if self.cut is not None:
            w = w[plain_index(tuple(w.shape), self.cut, self.name)]
        _fits(self.name, tuple(w.shape), self.dst)
        self.dst.copy_(w)
        if self.keep is not None and self.cut is None:  # a cut slice has no whole scales to keep
            device = self.dst.device
            self.keep[self.name] = QuantizedWeight(self.fmt, data.to(device), scale.to(device), self.block)  # type: ignore[arg-type]


@dataclass
class FP8Loader:
    module: FP8Linear
    selection: Selection = None

    def load(self, data: torch.Tensor, scale: torch.Tensor | None) -> None:
        assert scale is not None
        self.module.load(data.to(self.module.weight_fp8.device), scale)


@dataclass
class ExpertLoader:
    """One expert's w1 / w3 / w2 (or its tensor-parallel slice) into a stacked ``FusedFP4Experts``; experts
    it does not own are skipped."""

    module: FusedFP4Experts
    expert: int
    which: str

    @property
    def selection(self) -> Selection:
        return self.module.shards.get(self.which) if self.expert in self.module.owned else SKIP

    def load(self, data: torch.Tensor, scale: torch.Tensor | None) -> None:
        assert scale is not None
        self.module.load(self.expert, self.which, data, scale)


@dataclass
class Skipped:
    """A tensor of an expert another rank owns: never read."""

    name: str
    selection: Selection = SKIP

    def load(self, data: torch.Tensor, scale: torch.Tensor | None) -> None:
        raise AssertionError(f"{self.name}: skipped, yet read")


def _parent(model: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    owner, _, leaf = dotted.rpartition(".")
    return model.get_submodule(owner), leaf


def _fits_scale_blocks(module: nn.Module, attr: str, fmt: str, block: tuple[int, int], what: str) -> bool:
    """Whether the slice ``module.attr`` holds (if any) can be held quantized: whole scale blocks."""
    shard = _shard(module, attr)
    if shard is None:
        return True
    return on_scale_blocks(fmt, whole_shape(tuple(getattr(module, attr).shape), shard), block, shard, what)


def _quantized_modules(model: DeepseekV4, stored: dict[str, StoredWeight], ops: OpTable) -> None:
    """The device transform's module swap, on the meta device (nothing is allocated)."""
    for name, st in stored.items():
        if st.fmt != "fp8" or _EXPERT.match(name):
            continue
        if st.block != (128, 128):
            raise ValueError(f"{name}: the FP8 kernels need 128x128 scale blocks, the checkpoint has {st.block}")
        parent, leaf = _parent(model, name.removesuffix(".weight"))
        linear = getattr(parent, leaf)
        if not _fits_scale_blocks(linear, "weight", "fp8", st.block, name):
            continue  # its slice stays a dequantized reference Linear
        fp8 = FP8Linear.empty(linear.out_features, linear.in_features, ops)
        if hasattr(linear, "param_shards"):
            fp8.param_shards = linear.param_shards
        setattr(parent, leaf, fp8)
    _one_format_per_stack(model)
    for name, module in list(model.named_modules()):
        first = stored.get(f"{name}.experts.0.w1.weight")
        if not (isinstance(module, MoE) and first is not None and first.fmt == "fp4"):
            continue
        expert = module.experts[0]  # every expert is held alike: whole, or the same slice
        parts = {w: getattr(expert, w) for w in ("w1", "w3", "w2")}
        if not all(_fits_scale_blocks(m, "weight", "fp4", first.block, f"{name}.experts.0.{w}.weight")
                   for w, m in parts.items()):
            continue  # slices off their 32-wide scale groups: the dequantized reference loop
        shards = {w: s for w, m in parts.items() if (s := _shard(m, "weight")) is not None}
        c = module.cfg
        module.routed = FusedFP4Experts.empty(c.n_routed_experts, c.hidden_size, parts["w1"].out_features,
                                              first.scale_dtype in _UE8M0, c.swiglu_limit, ops, "meta",
                                              owned=getattr(module, "owned_experts", None), shards=shards)
        module.experts = nn.ModuleList()  # the reference's per-expert linears are never materialized


def _one_format_per_stack(model: nn.Module) -> None:
    """A stack of projections (``model/fused.py``) has one weight format: where a part's slice stays a
    dequantized Linear, its FP8 stack-mates are dequantized Linears too (as ``shard_model`` cuts them)."""
    names = {id(m): n for n, m in model.named_modules()}
    for module in list(model.modules()):
        for parts in projection_sets(module).values():
            kinds = {type(m) for _, m in parts}
            if FP8Linear not in kinds or len(kinds) == 1:
                continue
            for _, part in parts:
                if isinstance(part, FP8Linear):
                    parent, leaf = _parent(model, names[id(part)])
                    out, inp = part.weight_fp8.shape
                    with torch.device("meta"):
                        linear = Linear(inp, out, dtype=model.dtype)
                    if hasattr(part, "param_shards"):
                        linear.param_shards = part.param_shards
                    setattr(parent, leaf, linear)


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device, stored: dict[str, StoredWeight],
                ops: OpTable | None = None, overlap: bool | None = None,
                shard_model: Callable[[DeepseekV4], None] | None = None) -> DeepseekV4:
    """An unfilled model on ``device``: with ``ops``, the device transform's modules in their final layout;
    without, the reference model. Every tensor is allocated once, in the form it keeps.

    ``shard_model``: called on the meta model first, to put a rank's modules in place (the sharding hook):
    a module whose parameter holds a slice sets ``param_shards = {attr: Shard(...)}`` (and has the slice's
    shape), an MoE that holds experts lo..hi-1 sets ``owned_experts = range(lo, hi)``; the quantized
    modules are built from those shapes and every loader reads only what its module owns."""
    with torch.device("meta"):
        model = DeepseekV4(cfg, dtype)
    if shard_model is not None:
        shard_model(model)
        _own_experts_only(model)
        _restack_side_by_side(model)
    if ops is not None:
        _quantized_modules(model, stored, ops)
    model.to_empty(device=device)
    for p in model.parameters():
        p.requires_grad_(False)
    model.ropes = RopeTables(cfg).to(device)  # non-persistent buffers: recomputed, never read from disk
    model.quantized = {}
    if ops is not None:
        finish_transform(model, ops, overlap)
    return model.eval()


def _own_experts_only(model: nn.Module) -> None:
    """An MoE with ``owned_experts`` keeps only those expert modules, in order (``experts[i]`` is expert
    ``owned.start + i``), so the unowned ones are never allocated."""
    for module in model.modules():
        owned = getattr(module, "owned_experts", None)
        if isinstance(module, MoE) and owned is not None and len(module.experts) != len(owned):
            module.experts = nn.ModuleList(module.experts[e] for e in owned)
            if isinstance(module.routed, ExpertLoop):
                module.routed = ExpertLoop(module.experts)


def _restack_side_by_side(model: nn.Module) -> None:
    """The reference path's side-by-side stacks reference their parts: point them at the modules in place."""
    for module in list(model.modules()):
        for attr, parts in projection_sets(module).items():
            if not getattr(module, attr).fused:
                setattr(module, attr, StackedLinear.side_by_side(parts))


def weight_loaders(model: DeepseekV4, names: Iterable[str], stored: dict[str, StoredWeight],
                   keep_quantized: bool = False) -> dict[str, WeightLoader]:
    """Native tensor name -> the loader that puts it in ``model`` (as ``build_model`` built it)."""
    keep = model.quantized if keep_quantized else None
    loaders: dict[str, WeightLoader] = {}
    for name in names:
        expert = _EXPERT.match(name)
        if expert is not None:
            moe, e, which = model.get_submodule(expert.group(1)), int(expert.group(2)), expert.group(3)
            if isinstance(moe.routed, FusedFP4Experts):
                loaders[name] = ExpertLoader(moe.routed, e, which)
                continue
            owned = getattr(moe, "owned_experts", None)
            if owned is not None:
                if e not in owned:
                    loaders[name] = Skipped(name)
                    continue
                module, attr = getattr(moe.experts[e - owned.start], which), "weight"  # local numbering
            else:
                module, attr = _parent(model, name)
        else:
            module, attr = _parent(model, name)
        if isinstance(module, FP8Linear):
            loaders[name] = FP8Loader(module, _shard(module, "weight"))
            continue
        dst = module._parameters.get(attr)
        dst = module._buffers[attr] if dst is None else dst
        st = stored.get(name)
        shard = _shard(module, attr)
        if st is not None:
            if _fits_scale_blocks(module, attr, st.fmt, st.block, name):
                loaders[name] = DequantLoader(name, dst, st.fmt, st.block, keep, shard)
            else:
                loaders[name] = DequantLoader(name, dst, st.fmt, st.block, keep, None, cut=shard)
        else:
            loaders[name] = PlainLoader(name, dst, shard)
    return loaders


def finish_load(model: DeepseekV4) -> None:
    """After every loader ran: FP8 modules learn whether their scales are powers of two; the FP4 experts
    still in the checkpoint's layout are laid out; no expert may be left with half of its w13."""
    for module in model.modules():
        if isinstance(module, FP8Linear):
            module.refresh()
        if isinstance(module, FusedFP4Experts):
            module.lay_out_arrived()
            if module.pending():
                raise ValueError(f"experts {module.pending()}: w1 or w3 never arrived")
