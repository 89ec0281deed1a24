"""Checkpoint loader: safetensors (sharded or single file, native or Hugging Face names) -> DeepseekV4.

Every tensor is checked against the meta-device model (names, shapes, allowed dtypes, scale companions)
before it is used; any problem raises ``CheckpointError`` naming the file and the tensor. Nothing is ever
filled in with random or zero weights: a tensor is either loaded from disk or the load fails.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from tqdm import tqdm

from deepinfer.config.model import ModelConfig
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.names import MERGED_EXPERTS, split_merged_experts, to_native
from deepinfer.model.quant import (
    FP4_GROUP,
    QuantizedWeight,
    dequant_fp4,
    dequant_fp8_block,
    fp4_scale_shape,
    fp8_scale_shape,
    scale_name,
    storage_format,
)
from deepinfer.model.rope import RopeTables

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Extras that real or HF-written checkpoints may carry and that are safe to skip (listed in ``ignored``).
_HARMLESS = (re.compile(r"(^|\.)inv_freq$"),)  # RoPE tables some writers persist; the model recomputes them
_MERGED_SCALE = re.compile(r"^(layers\.\d+|mtp\.\d+)\.ffn\.experts\.(gate_up_proj|down_proj)\.scale$")
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8, torch.float32)
_MAX_LISTED = 8


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the tensor."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    tensors: dict[str, torch.Tensor]  # native name -> tensor in the model parameter's dtype (int64 tid2eid)
    quantized: dict[str, QuantizedWeight]  # every weight that was FP8/FP4 on disk, as stored
    ignored: tuple[str, ...] = ()  # harmless extra tensors that were skipped (on-disk names)
    has_mtp: bool = True  # False when strict_mtp=False and the checkpoint carries no mtp.* tensors
    files: tuple[str, ...] = ()  # safetensors files read, relative to the model directory


@dataclass(frozen=True)
class _Source:
    """Where one native tensor comes from: its file, its on-disk name and how to read it."""

    file: str  # path relative to the model directory
    disk_name: str
    read: Callable[[], torch.Tensor]

    def where(self, native: str) -> str:
        alias = "" if self.disk_name == native else f" ({self.disk_name})"
        return f"{native}{alias} in {self.file}"


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


class _Files:
    """Open safetensors handles of one checkpoint; header errors are re-raised naming the file."""

    def __init__(self, model_dir: Path) -> None:
        self.dir = model_dir
        self.handles: dict[str, Any] = {}

    def keys(self, rel: str) -> list[str]:
        return list(self._open(rel).keys())

    def _open(self, rel: str) -> Any:
        if rel not in self.handles:
            path = self.dir / rel
            if not path.is_file():
                raise CheckpointError(f"{path}: safetensors file not found")
            try:
                self.handles[rel] = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{path}: cannot read the safetensors header (truncated or corrupt?): {e}") from e
        return self.handles[rel]

    def reader(self, rel: str, name: str) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            try:
                return self._open(rel).get_tensor(name)
            except (SafetensorError, OSError, ValueError, RuntimeError) as e:
                raise CheckpointError(f"{name} in {rel}: cannot read tensor data (truncated or corrupt?): {e}") from e

        return read


def _discover(model_dir: Path, files: _Files) -> dict[str, tuple[str, str]]:
    """On-disk tensor name -> (file, name), from the index when there is one, else from the files."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise TypeError("weight_map must map tensor names to file names")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index (needs a 'weight_map'): {e}") from e
        by_file: dict[str, list[str]] = {}
        for name, rel in weight_map.items():
            by_file.setdefault(rel, []).append(name)
        for rel, names in by_file.items():
            if not (model_dir / rel).is_file():
                raise CheckpointError(f"{index}: shard {rel} (holding {_listing(names)}) is missing from {model_dir}")
        for rel, names in by_file.items():
            present = set(files.keys(rel))
            absent = [n for n in names if n not in present]
            if absent:
                raise CheckpointError(f"{rel}: tensors listed for it in {INDEX_FILE} are absent: {_listing(absent)}")
        return {name: (rel, name) for name, rel in weight_map.items()}
    if (model_dir / SINGLE_FILE).is_file():
        rels = [SINGLE_FILE]
    else:
        rels = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not rels:
            raise CheckpointError(f"{model_dir}: no {INDEX_FILE}, {SINGLE_FILE} or *.safetensors files")
    out: dict[str, tuple[str, str]] = {}
    for rel in rels:
        for name in files.keys(rel):
            if name in out:
                raise CheckpointError(f"{name}: present in both {out[name][0]} and {rel}")
            out[name] = (rel, name)
    return out


def _split_merged(native: str, src_rel: str, disk: str, read: Callable[[], torch.Tensor], n_experts: int,
                  is_scale: bool) -> dict[str, _Source]:
    """HF merged experts ([E, 2I, ...] gate_up / [E, H, ...] down, and their ``_scale_inv``) -> per expert."""
    weight_native = native.removesuffix(".scale") if is_scale else native
    cache: dict[str, torch.Tensor] = {}

    def part(key: str) -> Callable[[], torch.Tensor]:
        def get() -> torch.Tensor:
            if not cache:
                merged = read()
                if merged.dim() < 2 or merged.shape[0] != n_experts:
                    raise CheckpointError(f"{disk} in {src_rel}: expected a merged expert tensor with "
                                          f"{n_experts} experts in dim 0, got shape {tuple(merged.shape)}")
                if merged.shape[1] % 2 and weight_native.endswith("gate_up_proj"):
                    raise CheckpointError(f"{disk} in {src_rel}: gate_up rows {merged.shape[1]} are odd; cannot "
                                          "split into w1 (gate) and w3 (up)")
                for k, t in split_merged_experts(weight_native, merged).items():
                    cache[scale_name(k) if is_scale else k] = t
            return cache[key]

        return get

    prefix, kind = MERGED_EXPERTS.match(weight_native).groups()  # type: ignore[union-attr]
    parts = ("w1", "w3") if kind == "gate_up_proj" else ("w2",)
    out = {}
    for e in range(n_experts):
        for w in parts:
            key = f"{prefix}.ffn.experts.{e}.{w}." + ("scale" if is_scale else "weight")
            out[key] = _Source(src_rel, disk, part(key))
    return out


def _sources(model_dir: Path, files: _Files, cfg: ModelConfig) -> tuple[dict[str, _Source], list[str]]:
    """Native name -> source, merged experts split, harmless extras set aside."""
    sources: dict[str, _Source] = {}
    ignored: list[str] = []
    for disk, (rel, name) in _discover(model_dir, files).items():
        native = to_native(disk)
        if any(p.search(native) for p in _HARMLESS) or (native.startswith("mtp.") and not cfg.num_nextn_predict_layers):
            ignored.append(disk)
            continue
        is_scale = bool(_MERGED_SCALE.match(native))
        if is_scale or MERGED_EXPERTS.match(native):
            new = _split_merged(native, rel, disk, files.reader(rel, name), cfg.n_routed_experts, is_scale)
        else:
            new = {native: _Source(rel, disk, files.reader(rel, name))}
        for key, src in new.items():
            if key in sources:
                raise CheckpointError(f"{key}: given twice, as {sources[key].disk_name} in {sources[key].file} "
                                      f"and as {src.disk_name} in {src.file}")
            sources[key] = src
    return sources, ignored


def _expected(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    with torch.device("meta"):
        model = DeepseekV4(cfg, dtype)
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


def _check_names(expected: dict, sources: dict[str, _Source], cfg: ModelConfig, model_dir: Path) -> None:
    missing = [n for n in expected if n not in sources]
    if missing:
        files = sorted({s.file for s in sources.values()})
        raise CheckpointError(f"{model_dir} ({', '.join(files) or 'no tensors'}): missing {len(missing)} "
                              f"tensor(s): {_listing(missing)}")
    quantized = {scale_name(n) for n in expected if storage_format(n, cfg) in ("fp8", "fp4")}
    unexpected = [n for n in sources if n not in expected and n not in quantized]
    if unexpected:
        hint = ""
        if any(n.endswith(".scale") for n in unexpected):
            hint = " (a .scale for a tensor the config does not quantize: check quantization_config / expert_dtype)"
        raise CheckpointError("unexpected tensor(s)" + hint + ": " +
                              _listing([sources[n].where(n) for n in unexpected]))


def _shape_error(where: str, want: tuple[int, ...], got: tuple[int, ...], what: str = "") -> CheckpointError:
    return CheckpointError(f"{where}: {what}expected {want}, got {got}")


def _load_quantized(name: str, fmt: str, src: _Source, scale_src: _Source | None, shape: tuple[int, ...],
                    cfg: ModelConfig) -> tuple[torch.Tensor, QuantizedWeight]:
    where = src.where(name)
    data = src.read()
    if fmt == "fp8" and data.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{where}: dtype {data.dtype} not allowed; this config stores it as FP8 "
                              "(float8_e4m3fn + .scale)")
    if fmt == "fp4" and data.dtype not in (torch.int8, torch.uint8):
        raise CheckpointError(f"{where}: dtype {data.dtype} not allowed; this config stores it as packed FP4 "
                              "(int8, two e2m1 per byte, + .scale)")
    if scale_src is None:
        raise CheckpointError(f"{where}: {fmt.upper()} weight without its scale tensor {scale_name(name)}")
    if fmt == "fp8":
        block = cfg.quant.weight_block_size  # type: ignore[union-attr]
        want_data, want_scale = shape, fp8_scale_shape(shape, block)
    else:
        block = (1, FP4_GROUP)
        if shape[1] % 2:
            raise CheckpointError(f"{where}: FP4 needs an even input dimension, the model has {shape}")
        want_data, want_scale = (shape[0], shape[1] // 2), fp4_scale_shape(shape)
    if tuple(data.shape) != want_data:
        raise _shape_error(where, want_data, tuple(data.shape), "packed shape " if fmt == "fp4" else "")
    scale = scale_src.read()
    swhere = scale_src.where(scale_name(name))
    if scale.dtype not in _SCALE_DTYPES:
        raise CheckpointError(f"{swhere}: scale dtype {scale.dtype} not allowed (float8_e8m0fnu, uint8 or float32)")
    if tuple(scale.shape) != want_scale:
        raise _shape_error(swhere, want_scale, tuple(scale.shape), f"scale shape for {shape} weight ")
    try:
        w = dequant_fp8_block(data, scale, block) if fmt == "fp8" else dequant_fp4(data, scale)
    except ValueError as e:
        raise CheckpointError(f"{swhere}: {e}") from e
    return w, QuantizedWeight(fmt, data, scale, block)  # type: ignore[arg-type]


def _load_plain(name: str, fmt: str, src: _Source, shape: tuple[int, ...], cfg: ModelConfig) -> torch.Tensor:
    where = src.where(name)
    t = src.read()
    if fmt == "int64":
        if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise CheckpointError(f"{where}: dtype {t.dtype} not allowed; expected an integer tensor (int64)")
    elif t.dtype not in _FLOATS:
        raise CheckpointError(f"{where}: dtype {t.dtype} not allowed; expected one of bf16/fp16/fp32 "
                              f"(this config stores it as {fmt})")
    if tuple(t.shape) != shape:
        raise _shape_error(where, shape, tuple(t.shape))
    if fmt == "int64":
        t = t.to(torch.int64)
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= cfg.n_routed_experts):
            raise CheckpointError(f"{where}: expert ids must lie in [0, {cfg.n_routed_experts}), "
                                  f"got [{int(t.min())}, {int(t.max())}]")
    return t


def read_checkpoint(model_dir: str | Path, cfg: ModelConfig, dtype: torch.dtype = torch.bfloat16, *,
                    strict_mtp: bool = True, progress: bool = False) -> LoadedCheckpoint:
    """Read, validate and dequantize every tensor of the checkpoint in ``model_dir``.

    ``tensors`` hold exactly the model's state_dict names, in each parameter's dtype (``dtype`` for
    model-dtype parameters, fp32 for norms / mHC / ape / sinks / router bias, int64 for tid2eid). With
    ``strict_mtp=False`` a checkpoint without any ``mtp.*`` tensors loads with ``has_mtp=False``.
    """
    if dtype not in _FLOATS:
        raise ValueError(f"dtype: expected torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    model_dir = Path(model_dir)
    files = _Files(model_dir)
    sources, ignored = _sources(model_dir, files, cfg)
    has_mtp = cfg.num_nextn_predict_layers > 0
    if has_mtp and not strict_mtp and not any(n.startswith("mtp.") for n in sources):
        has_mtp = False
    expected = _expected(cfg if has_mtp else cfg.replace(num_nextn_predict_layers=0), dtype)
    _check_names(expected, sources, cfg, model_dir)

    tensors: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    for name, (shape, target) in tqdm(expected.items(), desc="Loading weights", unit="tensor", disable=not progress):
        src, fmt = sources[name], storage_format(name, cfg)
        if fmt in ("fp8", "fp4"):
            t, quantized[name] = _load_quantized(name, fmt, src, sources.get(scale_name(name)), shape, cfg)
        else:
            t = _load_plain(name, fmt, src, shape, cfg)
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(f"{src.where(name)}: contains NaN or infinite values")
        tensors[name] = t.to(target)
    return LoadedCheckpoint(tensors, quantized, tuple(ignored), has_mtp,
                            tuple(sorted({s.file for s in sources.values()})))


def _config(model_dir: Path) -> ModelConfig:
    try:
        return ModelConfig.from_model_dir(model_dir)
    except (ValueError, TypeError) as e:
        path = model_dir / "config.json"
        raise CheckpointError(str(e) if str(path) in str(e) else f"{path}: {e}") from e


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
               strict_mtp: bool = True, progress: bool = True) -> DeepseekV4:
    """Build a DeepseekV4 from ``model_dir`` (config.json + safetensors). The model is built on the meta
    device and its parameters are replaced by the loaded tensors, so no weight is ever allocated twice or
    left at an initial value. ``model.quantized`` holds the on-disk FP8/FP4 weights for the GPU path."""
    model_dir = Path(model_dir)
    cfg = _config(model_dir)
    ck = read_checkpoint(model_dir, cfg, dtype, strict_mtp=strict_mtp, progress=progress)
    if not ck.has_mtp:
        cfg = cfg.replace(num_nextn_predict_layers=0)
    with torch.device("meta"):
        model = DeepseekV4(cfg, dtype)
    for name, t in ck.tensors.items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        if attr in module._parameters:
            module._parameters[attr] = nn.Parameter(t.to(device), requires_grad=False)
        else:
            module._buffers[attr] = t.to(device)
    model.ropes = RopeTables(cfg).to(device)  # non-persistent buffers: recomputed, never read from disk
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise CheckpointError(f"{model_dir}: no weights were loaded for {_listing(left)}")
    model.quantized = {k: QuantizedWeight(q.format, q.data.to(device), q.scale.to(device), q.block)
                       for k, q in ck.quantized.items()}
    return model.eval()
