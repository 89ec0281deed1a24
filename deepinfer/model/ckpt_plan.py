"""Every check of a checkpoint, in two passes: the headers before any data is read, then each tensor's values.

``plan_checkpoint`` matches the checkpoint's names against the model's (missing, unexpected, scale
companions) and each tensor's dtype and shape (and its scale's) from the headers alone, so a bad checkpoint
fails in seconds, before gigabytes are read. ``TensorPlan.read`` then reads one tensor (or the part a rank
owns) and checks what only the data can tell: NaN/Inf, UE8M0 bytes that encode NaN, values a scale would
overflow, hash-routing expert ids out of range. Every error is a ``CheckpointError`` naming the file and
the tensor (and the on-disk name when it differs).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.config.model import ModelConfig
from deepinfer.model.ckpt_files import CheckpointError, Files, TensorRef, listing
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.quant import (
    E2M1_VALUES,
    FP4_GROUP,
    Format,
    dequant_fp4,
    dequant_fp8_block,
    fp4_scale_shape,
    fp8_scale_shape,
    scale_name,
    scale_to_float,
    storage_format,
)
from deepinfer.model.shard import Shard, plain_index, quantized_index

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8, torch.float32)


def expected_tensors(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The model's state_dict names -> (shape, dtype), from a model built on the meta device."""
    with torch.device("meta"):
        model = DeepseekV4(cfg, dtype)
    return {name: (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}


@dataclass(frozen=True)
class TensorPlan:
    """One model tensor as the checkpoint stores it, checked against the model from the headers."""

    name: str  # native name
    fmt: Format  # storage_format: fp8 / fp4 (codes + scale) or a plain dtype
    shape: tuple[int, ...]  # the model's (logical, unpacked) shape
    target: torch.dtype  # the model parameter's dtype (the dequantized reference model's)
    src: TensorRef
    scale: TensorRef | None = None
    block: tuple[int, int] | None = None  # weight elements per scale: (bn, bk) for fp8, (1, 32) for fp4
    id_limit: int = 0  # int64 hash tables (tid2eid): ids must lie in [0, id_limit), the routed expert count

    @property
    def quantized(self) -> bool:
        return self.fmt in ("fp8", "fp4")

    def nbytes(self, shard: Shard | None = None) -> int:
        n = self.src.nbytes + (self.scale.nbytes if self.scale is not None else 0)
        return n // shard.count if shard is not None else n

    def read(self, files: Files, shard: Shard | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(data, scale) of the tensor or of ``shard`` of it, as stored (scale None for plain tensors), with
        every data check done."""
        where = self.src.where(self.name)
        if not self.quantized:
            t = files.read(self.src, plain_index(self.shape, shard, where))
            if self.fmt == "int64":
                t = t.to(torch.int64)
                if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.id_limit):
                    raise CheckpointError(f"{where}: expert ids must lie in [0, {self.id_limit}), "
                                          f"got [{int(t.min())}, {int(t.max())}]")
            elif not all_finite(t):
                raise CheckpointError(f"{where}: contains NaN or infinite values")
            return t, None
        assert self.scale is not None and self.block is not None
        data_index, scale_index = quantized_index(self.fmt, self.shape, self.block, shard, where)
        data = files.read(self.src, data_index)
        scale = files.read(self.scale, scale_index)
        swhere = self.scale.where(scale_name(self.name))
        try:
            multipliers = scale_to_float(scale)
        except ValueError as e:
            raise CheckpointError(f"{swhere}: {e}") from e
        if not _finite(self.fmt, data, multipliers, self.block):
            raise CheckpointError(f"{where}: contains NaN or infinite values")
        return data, scale


def all_finite(t: torch.Tensor) -> bool:
    """Whether a float tensor holds no NaN or infinity: its smallest and largest values are finite (both
    propagate a NaN; an infinity is one of them). One reduction pass, no temporaries: ``isfinite(t).all()``
    writes a bool per element and was most of a checkpoint's host time (embedding and head: gigabytes)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))


def _finite(fmt: str, data: torch.Tensor, multipliers: torch.Tensor, block: tuple[int, int]) -> bool:
    """Whether every dequantized value is finite, without dequantizing: e4m3fn has NaN codes (S.1111.111)
    and no infinities, e2m1 neither; a finite code times a finite scale can still overflow fp32, which only
    the largest code and scale can tell (then, rarely, the exact dequantization decides)."""
    if data.numel() == 0:
        return True
    top_scale = multipliers.max().cpu()
    if fmt == "fp4" and bool(torch.isfinite(E2M1_VALUES[-1] * top_scale)):
        return True  # even the largest e2m1 code (6) times the largest scale: no need to read the codes
    bits = data.view(torch.uint8)
    if fmt == "fp8":
        magnitude = bits & 0x7F
        top = int(magnitude.max())
        if top == 0x7F:
            return False
        largest = torch.tensor([top], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    else:
        top = max(int((bits & 7).max()), int(((bits >> 4) & 7).max()))
        largest = torch.tensor([E2M1_VALUES[top]])
    if bool(torch.isfinite(largest * top_scale).all()):
        return True
    values = dequant_fp8_block(data, multipliers, block) if fmt == "fp8" else dequant_fp4(data, multipliers)
    return bool(torch.isfinite(values).all())


def _shape_error(where: str, want: tuple[int, ...], got: tuple[int, ...], what: str = "") -> CheckpointError:
    return CheckpointError(f"{where}: {what}expected {want}, got {got}")


def _check_names(expected: dict, sources: dict[str, TensorRef], cfg: ModelConfig, model_dir: Path) -> None:
    missing = [n for n in expected if n not in sources]
    if missing:
        files = sorted({s.file for s in sources.values()})
        raise CheckpointError(f"{model_dir} ({', '.join(files) or 'no tensors'}): missing {len(missing)} "
                              f"tensor(s): {listing(missing)}")
    quantized = {scale_name(n) for n in expected if storage_format(n, cfg) in ("fp8", "fp4")}
    unexpected = [n for n in sources if n not in expected and n not in quantized]
    if unexpected:
        hint = ""
        if any(n.endswith(".scale") for n in unexpected):
            hint = " (a .scale for a tensor the config does not quantize: check quantization_config / expert_dtype)"
        raise CheckpointError("unexpected tensor(s)" + hint + ": " +
                              listing([sources[n].where(n) for n in unexpected]))


def _plan_quantized(name: str, fmt: str, src: TensorRef, scale: TensorRef | None, shape: tuple[int, ...],
                    target: torch.dtype, cfg: ModelConfig) -> TensorPlan:
    where = src.where(name)
    if fmt == "fp8" and src.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"{where}: dtype {src.dtype} not allowed; this config stores it as FP8 "
                              "(float8_e4m3fn + .scale)")
    if fmt == "fp4" and src.dtype not in (torch.int8, torch.uint8):
        raise CheckpointError(f"{where}: dtype {src.dtype} not allowed; this config stores it as packed FP4 "
                              "(int8, two e2m1 per byte, + .scale)")
    if scale is None:
        raise CheckpointError(f"{where}: {fmt.upper()} weight without its scale tensor {scale_name(name)}")
    if fmt == "fp8":
        block = cfg.quant.weight_block_size  # type: ignore[union-attr]
        want_data, want_scale = shape, fp8_scale_shape(shape, block)
    else:
        block = (1, FP4_GROUP)
        if shape[1] % 2:
            raise CheckpointError(f"{where}: FP4 needs an even input dimension, the model has {shape}")
        want_data, want_scale = (shape[0], shape[1] // 2), fp4_scale_shape(shape)
    if src.shape != want_data:
        raise _shape_error(where, want_data, src.shape, "packed shape " if fmt == "fp4" else "")
    swhere = scale.where(scale_name(name))
    if scale.dtype not in _SCALE_DTYPES:
        raise CheckpointError(f"{swhere}: scale dtype {scale.dtype} not allowed (float8_e8m0fnu, uint8 or float32)")
    if scale.shape != want_scale:
        raise _shape_error(swhere, want_scale, scale.shape, f"scale shape for {shape} weight ")
    return TensorPlan(name, fmt, shape, target, src, scale, block)  # type: ignore[arg-type]


def _plan_plain(name: str, fmt: str, src: TensorRef, shape: tuple[int, ...], target: torch.dtype,
                cfg: ModelConfig) -> TensorPlan:
    where = src.where(name)
    dtype = src.dtype
    if fmt == "int64":
        if not isinstance(dtype, torch.dtype) or dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
            raise CheckpointError(f"{where}: dtype {dtype} not allowed; expected an integer tensor (int64)")
    elif dtype not in FLOATS:
        raise CheckpointError(f"{where}: dtype {dtype} not allowed; expected one of bf16/fp16/fp32 "
                              f"(this config stores it as {fmt})")
    if src.shape != shape:
        raise _shape_error(where, shape, src.shape)
    return TensorPlan(name, fmt, shape, target, src, id_limit=cfg.n_routed_experts)  # type: ignore[arg-type]


def plan_checkpoint(sources: dict[str, TensorRef], cfg: ModelConfig, dtype: torch.dtype, model_dir: Path
                    ) -> dict[str, TensorPlan]:
    """Native name -> plan for every tensor of the model ``cfg`` describes (in the model's order)."""
    expected = expected_tensors(cfg, dtype)
    _check_names(expected, sources, cfg, model_dir)
    plans = {}
    for name, (shape, target) in expected.items():
        fmt = storage_format(name, cfg)
        if fmt in ("fp8", "fp4"):
            plans[name] = _plan_quantized(name, fmt, sources[name], sources.get(scale_name(name)), shape, target, cfg)
        else:
            plans[name] = _plan_plain(name, fmt, sources[name], shape, target, cfg)
    return plans
