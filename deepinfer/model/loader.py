"""Checkpoint loader: safetensors (sharded or single file, native or Hugging Face names) -> DeepseekV4.

Quantized-first: the model is built empty in its final form (``model/weight_loaders.py``: with an op
table, the device transform's FP8/FP4 modules in their kernel layout; without, the reference model), then
the safetensors files are streamed one shard at a time, tensor by tensor in file order, each tensor going
straight into its final buffer through its weight loader. Only the part a rank owns is read
(``model/shard.py``). FP8/FP4 tensors stay as stored on the accelerated path; the reference path
dequantizes each one as it arrives. Host memory holds one shard's mapped pages and one tensor at a time
(and, for a CUDA model, two pinned staging buffers: ``model/host_staging.py``, so that a tensor's transfer
overlaps the reading of the next). The FP4 experts are laid out a batch at a time as they arrive
(``FusedFP4Experts.load``).

Every tensor is checked against the meta-device model (names, shapes, allowed dtypes, scale companions)
from the headers before any data is read, and its values (NaN/Inf, scale bytes, expert ids) as it is read
(``model/ckpt_plan.py``); any problem raises ``CheckpointError`` naming the file and the tensor. Nothing
is ever filled in with random or zero weights: a tensor is either loaded from disk or the load fails, unless
``load_format="dummy"`` asks for random weights (``model/dummy.py``) and no checkpoint is read at all.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from deepinfer.config.engine import LOAD_FORMATS
from deepinfer.config.model import ModelConfig
from deepinfer.model.ckpt_files import INDEX_FILE, SINGLE_FILE, CheckpointError, Files, find_sources, listing
from deepinfer.model.ckpt_plan import FLOATS, TensorPlan, plan_checkpoint
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.host_staging import HostStaging
from deepinfer.model.quant import QuantizedWeight, dequant_fp4, dequant_fp8_block
from deepinfer.model.shard import SKIP, Shard
from deepinfer.model.weight_loaders import StoredWeight, WeightLoader, build_model, finish_load, weight_loaders
from deepinfer.ops.table import OpTable

__all__ = ["CheckpointError", "LoadedCheckpoint", "read_checkpoint", "load_model", "LOAD_FORMATS", "INDEX_FILE",
           "SINGLE_FILE"]


@dataclass(frozen=True)
class LoadedCheckpoint:
    tensors: dict[str, torch.Tensor]  # native name -> tensor in the model parameter's dtype (int64 tid2eid)
    quantized: dict[str, QuantizedWeight]  # every weight that was FP8/FP4 on disk, as stored
    ignored: tuple[str, ...] = ()  # harmless extra tensors that were skipped (on-disk names)
    has_mtp: bool = True  # False when strict_mtp=False and the checkpoint carries no mtp.* tensors
    files: tuple[str, ...] = ()  # safetensors files read, relative to the model directory


@dataclass(frozen=True)
class _Checkpoint:
    """A checkpoint whose headers have been checked against the model: what to read, nothing read yet."""

    files: Files
    plans: dict[str, TensorPlan]  # native name -> plan, in the model's order
    order: dict[str, int]  # native name -> position of its data in the checkpoint (file order, then offset)
    ignored: tuple[str, ...]
    has_mtp: bool

    @property
    def file_names(self) -> tuple[str, ...]:
        refs = [r for p in self.plans.values() for r in (p.src, p.scale) if r is not None]
        return tuple(sorted({r.file for r in refs}))

    @property
    def stored(self) -> dict[str, StoredWeight]:
        return {n: StoredWeight(p.fmt, p.block, p.scale.dtype)  # type: ignore[arg-type, union-attr]
                for n, p in self.plans.items() if p.quantized}


def _layers_on_disk(model_dir: Path) -> int | None:
    try:
        n = json.loads((model_dir / "config.json").read_text()).get("num_hidden_layers")
    except (OSError, ValueError, AttributeError):
        return None
    return n if isinstance(n, int) else None


def _open_checkpoint(model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, strict_mtp: bool,
                     truncate: bool = False) -> _Checkpoint:
    if dtype not in FLOATS:
        raise ValueError(f"dtype: expected torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    files = Files(model_dir)
    sources, ignored = find_sources(model_dir, files, cfg, _layers_on_disk(model_dir) if truncate else None)
    files.release()  # the headers are read; the data is mapped again one shard at a time
    has_mtp = cfg.num_nextn_predict_layers > 0
    if has_mtp and not strict_mtp and not any(n.startswith("mtp.") for n in sources):
        has_mtp = False
    plans = plan_checkpoint(sources, cfg if has_mtp else cfg.replace(num_nextn_predict_layers=0), dtype, model_dir)
    file_rank: dict[str, int] = {}
    for ref in sources.values():
        file_rank.setdefault(ref.file, len(file_rank))
    position = {name: i for i, name in enumerate(sources)}
    order = {n: file_rank[p.src.file] * len(position) + position[n] for n, p in plans.items()}
    return _Checkpoint(files, plans, order, tuple(ignored), has_mtp)


def _stream(ck: _Checkpoint, loaders: dict[str, WeightLoader], progress: bool,
            staging: HostStaging | None = None) -> None:
    """Each tensor a loader wants, read in file order (one shard mapped at a time), checked, and handed to
    it; with ``staging`` (a CUDA model), first sent to the device through its pinned buffers."""
    jobs = [(ck.plans[n], loader, loader.selection) for n, loader in loaders.items()]
    jobs = [j for j in jobs if j[2] is not SKIP]
    jobs.sort(key=lambda j: ck.order[j[0].name])
    total = sum(plan.nbytes(sel if isinstance(sel, Shard) else None) for plan, _, sel in jobs)
    with tqdm(total=total, desc="Loading weights", unit="B", unit_scale=True, disable=not progress) as bar:
        for plan, loader, sel in jobs:
            shard = sel if isinstance(sel, Shard) else None
            ck.files.release(keep=plan.src.file)  # the previous shard, before this one's pages come in
            data, scale = plan.read(ck.files, shard)
            if staging is not None:
                data, scale = staging.upload(data), None if scale is None else staging.upload(scale)
            try:
                loader.load(data, scale)
            except ValueError as e:
                raise CheckpointError(f"{plan.src.where(plan.name)}: {e}") from e
            del data, scale
            ck.files.release(keep=plan.src.file)  # a scale read from another shard: unmapped at once
            bar.update(plan.nbytes(shard))
    ck.files.release()


@dataclass
class _Collect:
    """read_checkpoint's loader: the dequantized tensor in the model dtype, and the stored form."""

    plan: TensorPlan
    tensors: dict[str, torch.Tensor]
    quantized: dict[str, QuantizedWeight]
    selection: None = None

    def load(self, data: torch.Tensor, scale: torch.Tensor | None) -> None:
        p = self.plan
        if scale is not None:
            w = dequant_fp8_block(data, scale, p.block) if p.fmt == "fp8" else dequant_fp4(data, scale)
            self.quantized[p.name] = QuantizedWeight(p.fmt, data, scale, p.block)  # type: ignore[arg-type]
            data = w
        self.tensors[p.name] = data.to(p.target)


def read_checkpoint(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, *,
                    strict_mtp: bool = True, progress: bool = False) -> LoadedCheckpoint:
    """Read, validate and dequantize every tensor of the checkpoint in ``model_dir`` into host memory (for
    tests and tools; models load with ``load_model``, which never holds the whole checkpoint).

    ``tensors`` hold exactly the model's state_dict names, in each parameter's dtype (``dtype`` for
    model-dtype parameters, fp32 for norms / mHC / ape / sinks / router bias, int64 for tid2eid). With
    ``strict_mtp=False`` a checkpoint without any ``mtp.*`` tensors loads with ``has_mtp=False``.
    """
    ck = _open_checkpoint(Path(model_dir), cfg, dtype, strict_mtp)
    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    _stream(ck, {n: _Collect(p, tensors, quantized) for n, p in ck.plans.items()}, progress)
    return LoadedCheckpoint({n: tensors[n] for n in ck.plans}, {n: quantized[n] for n in ck.plans if n in quantized},
                            ck.ignored, ck.has_mtp, ck.file_names)


def _config(model_dir: Path) -> ModelConfig:
    try:
        return ModelConfig.from_model_dir(model_dir)
    except (ValueError, TypeError) as e:
        path = model_dir / "config.json"
        raise CheckpointError(str(e) if str(path) in str(e) else f"{path}: {e}") from e


def load_model(model_dir: str | Path | None, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
               strict_mtp: bool = True, progress: bool = True, *, ops: OpTable | None = None,
               cfg: ModelConfig | None = None, load_format: str = "auto", seed: int = 0,
               keep_quantized: bool = False, overlap: bool | None = None,
               shard_model: Callable[[DeepseekV4], None] | None = None) -> DeepseekV4:
    """Build a DeepseekV4 from ``model_dir`` (config.json + safetensors).

    ``ops``: the op table of the accelerated path; the model is then built directly in the device
    transform's form (``FP8Linear``, ``FusedFP4Experts`` in ``ops``' layout, stacked projections) and the
    FP8/FP4 tensors go into it as stored. Without ``ops``: the reference model, FP8/FP4 dequantized as read;
    ``keep_quantized`` keeps the stored form in ``model.quantized`` too (what ``prepare_for_device`` takes).
    ``cfg``: the model config to build (default: ``model_dir``'s config.json); one with fewer layers than
    the checkpoint (``hf_overrides``) loads the first layers and skips the rest.
    ``load_format="dummy"``: random weights in the native formats from the config alone, on the device,
    seeded by ``seed`` (``model/dummy.py``); no safetensors are read (``model_dir`` may lack them).
    ``shard_model``: the sharding hook (``build_model``): a rank's modules read only the parts they own."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: {load_format!r} is not supported; allowed: {', '.join(LOAD_FORMATS)}")
    given = cfg is not None
    if cfg is None:
        if model_dir is None:
            raise ValueError("model_dir: needed when no cfg is given")
        cfg = _config(Path(model_dir))
    if load_format == "dummy":
        from deepinfer.model.dummy import load_dummy

        return load_dummy(cfg, dtype, device, ops=ops, seed=seed, keep_quantized=keep_quantized, overlap=overlap,
                          progress=progress, shard_model=shard_model)
    model_dir = Path(model_dir)  # type: ignore[arg-type]
    ck = _open_checkpoint(model_dir, cfg, dtype, strict_mtp, truncate=given)
    if not ck.has_mtp:
        cfg = cfg.replace(num_nextn_predict_layers=0)
    try:
        model = build_model(cfg, dtype, device, ck.stored, ops, overlap, shard_model)
    except ValueError as e:
        raise CheckpointError(f"{model_dir}: {e}") from e
    loaders = weight_loaders(model, ck.plans, ck.stored, keep_quantized)
    staging = HostStaging.for_device(next(model.buffers()).device)
    try:
        _stream(ck, loaders, progress, staging)
    finally:
        if staging is not None:
            staging.close()
    try:
        finish_load(model)
    except ValueError as e:
        raise CheckpointError(f"{model_dir}: {e}") from e
    return model
