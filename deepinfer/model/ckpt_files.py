"""Where each tensor of a checkpoint lives: its safetensors file, on-disk name, shape and dtype, from the headers.

Nothing here reads tensor data up front: the names come from ``model.safetensors.index.json`` (or the files),
shapes and dtypes from each file's header. ``Files.read`` then reads one tensor, or only a region of it
(``safe_open(...).get_slice``: a rank reads the rows or experts it owns), and ``Files.release`` unmaps a
shard once it has been streamed, so the pages of only one shard at a time stay mapped.

Hugging Face merged experts (``experts.gate_up_proj [E, 2I, ...]``, ``down_proj [E, H, ...]`` and their
``_scale_inv``) are split here into per-expert native names whose ``region`` picks expert e's rows of the
merged tensor, so an expert is read on its own, never the whole merged tensor.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from deepinfer.config.model import ModelConfig
from deepinfer.model.names import MERGED_EXPERTS, to_native

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Extras that real or HF-written checkpoints may carry and that are safe to skip (listed in ``ignored``).
_HARMLESS = (re.compile(r"(^|\.)inv_freq$"),)  # RoPE tables some writers persist; the model recomputes them
_MERGED_SCALE = re.compile(r"^(layers\.\d+|mtp\.\d+)\.ffn\.experts\.(gate_up_proj|down_proj)\.scale$")
_LAYER = re.compile(r"^layers\.(\d+)\.")
_MAX_LISTED = 8
# safetensors header dtype names -> torch dtypes (an unknown one stays a string and fails every dtype check).
_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu,
           "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
           "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "BOOL": torch.bool}

Index = tuple[int | slice, ...]  # a basic index into one tensor: ints drop a dimension, slices keep it


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the tensor."""


def listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")


@dataclass(frozen=True)
class TensorRef:
    """One native tensor on disk: ``region`` of the on-disk tensor ``disk_name`` in ``file`` (the whole
    tensor when empty); ``shape`` and ``dtype`` are the native tensor's, from the header."""

    file: str  # path relative to the model directory
    disk_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype | str
    region: Index = ()

    def where(self, native: str) -> str:
        alias = "" if self.disk_name == native else f" ({self.disk_name})"
        return f"{native}{alias} in {self.file}"

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * (self.dtype.itemsize if isinstance(self.dtype, torch.dtype) else 1)

    def index(self, sub: Index = ()) -> Index:
        """The on-disk index of ``sub`` (an index into the native tensor) composed with ``region``."""
        out: list[int | slice] = []
        rest = list(sub)
        for r in self.region:
            if isinstance(r, int):
                out.append(r)
                continue
            s = rest.pop(0) if rest else slice(None)
            lo, hi, _ = s.indices(r.stop - r.start)
            out.append(slice(r.start + lo, r.start + hi))
        return (*out, *rest)


def _size(shape: tuple[int, ...], index: Index) -> tuple[int, ...]:
    dims = list(shape)
    out = []
    for i, s in enumerate(index):
        if isinstance(s, slice):
            lo, hi, _ = s.indices(dims[i])
            out.append(max(0, hi - lo))
    return (*out, *dims[len(index):])


class Files:
    """The safetensors files of one checkpoint, opened on demand; header errors name the file."""

    def __init__(self, model_dir: Path) -> None:
        self.dir = model_dir
        self._handles: dict[str, Any] = {}

    def _open(self, rel: str) -> Any:
        if rel not in self._handles:
            path = self.dir / rel
            if not path.is_file():
                raise CheckpointError(f"{path}: safetensors file not found")
            try:
                self._handles[rel] = safe_open(str(path), framework="pt", device="cpu")
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{path}: cannot read the safetensors header (truncated or corrupt?): {e}") from e
        return self._handles[rel]

    def keys(self, rel: str) -> list[str]:
        """Tensor names of one file in the order of their data (sequential reads), when safetensors says."""
        handle = self._open(rel)
        return list(getattr(handle, "offset_keys", handle.keys)())

    def header(self, rel: str, name: str) -> tuple[tuple[int, ...], torch.dtype | str]:
        view = self._open(rel).get_slice(name)
        dtype = view.get_dtype()
        return tuple(view.get_shape()), _DTYPES.get(dtype, dtype)

    def read(self, ref: TensorRef, sub: Index = ()) -> torch.Tensor:
        """The tensor ``ref`` (or its part ``sub``), read from the file; only those bytes are touched."""
        index = ref.index(sub)
        try:
            view = self._open(ref.file).get_slice(ref.disk_name)
            t = view[index] if index else view[:]
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{ref.disk_name} in {ref.file}: cannot read tensor data (truncated or "
                                  f"corrupt?): {e}") from e
        return t.reshape(_size(ref.shape, sub))  # a region's int entries drop their dimension

    def release(self, keep: str | None = None) -> None:
        """Unmap every file but ``keep`` (their pages stop counting toward this process's memory)."""
        for rel in [r for r in self._handles if r != keep]:
            del self._handles[rel]


def _discover(model_dir: Path, files: Files) -> dict[str, str]:
    """On-disk tensor name -> file, from the index when there is one, else from the files."""
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
                raise CheckpointError(f"{index}: shard {rel} (holding {listing(names)}) is missing from {model_dir}")
        out: dict[str, str] = {}
        for rel, names in by_file.items():
            present = files.keys(rel)
            absent = [n for n in names if n not in set(present)]
            if absent:
                raise CheckpointError(f"{rel}: tensors listed for it in {INDEX_FILE} are absent: {listing(absent)}")
            listed = set(names)
            out.update({n: rel for n in present if n in listed})  # in the file's data order
        return out
    if (model_dir / SINGLE_FILE).is_file():
        rels = [SINGLE_FILE]
    else:
        rels = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not rels:
            raise CheckpointError(f"{model_dir}: no {INDEX_FILE}, {SINGLE_FILE} or *.safetensors files")
    out = {}
    for rel in rels:
        for name in files.keys(rel):
            if name in out:
                raise CheckpointError(f"{name}: present in both {out[name]} and {rel}")
            out[name] = rel
    return out


def _split_merged(native: str, rel: str, disk: str, shape: tuple[int, ...], dtype: torch.dtype | str,
                  n_experts: int, is_scale: bool) -> dict[str, TensorRef]:
    """HF merged experts ([E, 2I, ...] gate_up / [E, H, ...] down, and their ``_scale_inv``) -> per expert
    native names, each a region of the merged tensor."""
    weight_native = native.removesuffix(".scale") if is_scale else native
    if len(shape) < 2 or shape[0] != n_experts:
        raise CheckpointError(f"{disk} in {rel}: expected a merged expert tensor with {n_experts} experts in "
                              f"dim 0, got shape {shape}")
    prefix, kind = MERGED_EXPERTS.match(weight_native).groups()  # type: ignore[union-attr]
    if kind == "gate_up_proj" and shape[1] % 2:
        raise CheckpointError(f"{disk} in {rel}: gate_up rows {shape[1]} are odd; cannot split into w1 (gate) "
                              "and w3 (up)")
    rows = shape[1] // 2 if kind == "gate_up_proj" else shape[1]
    parts = (("w1", 0), ("w3", rows)) if kind == "gate_up_proj" else (("w2", 0),)
    out = {}
    for e in range(n_experts):
        for w, start in parts:
            key = f"{prefix}.ffn.experts.{e}.{w}." + ("scale" if is_scale else "weight")
            out[key] = TensorRef(rel, disk, (rows, *shape[2:]), dtype, (e, slice(start, start + rows)))
    return out


def find_sources(model_dir: Path, files: Files, cfg: ModelConfig, layers_on_disk: int | None = None
                 ) -> tuple[dict[str, TensorRef], list[str]]:
    """Native name -> where it is, merged experts split, harmless extras set aside (returned as ignored).

    ``layers_on_disk``: when the config was truncated (``hf_overrides``) below the checkpoint's layer
    count, the tensors of the layers past ``cfg.num_hidden_layers`` are skipped (listed as ignored)."""
    sources: dict[str, TensorRef] = {}
    ignored: list[str] = []
    truncated = layers_on_disk is not None and layers_on_disk > cfg.num_hidden_layers
    for disk, rel in _discover(model_dir, files).items():
        native = to_native(disk)
        layer = _LAYER.match(native)
        if (any(p.search(native) for p in _HARMLESS) or (native.startswith("mtp.") and not cfg.num_nextn_predict_layers)
                or (truncated and layer is not None and int(layer.group(1)) >= cfg.num_hidden_layers)):
            ignored.append(disk)
            continue
        shape, dtype = files.header(rel, disk)
        is_scale = bool(_MERGED_SCALE.match(native))
        if is_scale or MERGED_EXPERTS.match(native):
            new = _split_merged(native, rel, disk, shape, dtype, cfg.n_routed_experts, is_scale)
        else:
            new = {native: TensorRef(rel, disk, shape, dtype)}
        for key, src in new.items():
            if key in sources:
                raise CheckpointError(f"{key}: given twice, as {sources[key].disk_name} in {sources[key].file} "
                                      f"and as {src.disk_name} in {src.file}")
            sources[key] = src
    return sources, ignored
