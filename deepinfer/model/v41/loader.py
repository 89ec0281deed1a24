"""Load a DeepSeek-V4.1 checkpoint directory (config.json + safetensors + tokenizer.json) into ``DeepseekV41``.

The headers are checked against the model before any data is read: missing and unexpected tensors, scale
companions (a quantized weight without its scale, a scale for a tensor the config does not quantize),
dtypes, shapes of weights and scales. Then each tensor's data: NaN/Inf (also after dequantization: a finite
code times a huge scale), UE8M0 bytes that encode NaN. Every error is a ``CheckpointError`` naming the file
and the tensor. Tensors of parts the text model does not build (vision tower, and DSpark ``mtp.*`` unless the
drafter is asked for) are skipped and listed. This is the plain-PyTorch path: FP8 / FP4 weights are
dequantized as they are read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.config.engine import LOAD_FORMATS
from deepinfer.config.v41 import V41Config
from deepinfer.model.ckpt_files import CheckpointError, Files, TensorRef, _discover, listing
from deepinfer.model.ckpt_plan import _finite
from deepinfer.model.quant import dequant_fp4, dequant_fp8_block, fp8_scale_shape, scale_to_float
from deepinfer.model.v41.model import DeepseekV41
from deepinfer.model.v41.names import NOT_BUILT, NOT_BUILT_WITH_DSPARK, scale_name, storage_format, to_native

FLOATS = (torch.bfloat16, torch.float16, torch.float32)
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.uint8, torch.float32)
TOKENIZER_FILE = "tokenizer.json"


@dataclass(frozen=True)
class _Plan:
    name: str
    fmt: str
    shape: tuple[int, ...]
    src: TensorRef
    scale: TensorRef | None = None
    block: tuple[int, int] | None = None


def _sources(model_dir: Path, files: Files, dspark: bool) -> tuple[dict[str, TensorRef], list[str]]:
    sources: dict[str, TensorRef] = {}
    ignored: list[str] = []
    not_built = NOT_BUILT_WITH_DSPARK if dspark else NOT_BUILT
    for disk, rel in _discover(model_dir, files).items():
        native = to_native(disk)
        if not_built.match(native):
            ignored.append(disk)
            continue
        if native in sources:
            raise CheckpointError(f"{native}: given twice, as {sources[native].disk_name} in {sources[native].file} "
                                  f"and as {disk} in {rel}")
        shape, dtype = files.header(rel, disk)
        sources[native] = TensorRef(rel, disk, shape, dtype)
    return sources, ignored


def _plan_one(name: str, shape: tuple[int, ...], sources: dict[str, TensorRef], cfg: V41Config) -> _Plan:
    src = sources[name]
    where = src.where(name)
    fmt, block = storage_format(name, cfg)
    if fmt == "float":
        if src.dtype not in FLOATS:
            raise CheckpointError(f"{where}: dtype {src.dtype} not allowed; expected bf16, fp16 or fp32")
        if src.shape != shape:
            raise CheckpointError(f"{where}: expected shape {shape}, got {src.shape}")
        return _Plan(name, fmt, shape, src)
    scale = sources.get(scale_name(name))
    if scale is None:
        raise CheckpointError(f"{where}: {fmt.upper()} weight without its scale tensor {scale_name(name)}")
    if fmt == "fp8":
        want_dtype, want, want_scale = (torch.float8_e4m3fn,), shape, fp8_scale_shape(shape, block)
    else:
        want_dtype, want, want_scale = (torch.int8, torch.uint8), (shape[0], shape[1] // 2), fp8_scale_shape(shape,
                                                                                                               block)
    if src.dtype not in want_dtype:
        raise CheckpointError(f"{where}: dtype {src.dtype} not allowed; this config stores it as {fmt.upper()} "
                              f"({' or '.join(str(d) for d in want_dtype)} + .scale)")
    if src.shape != want:
        raise CheckpointError(f"{where}: expected {'packed ' if fmt == 'fp4' else ''}shape {want}, got {src.shape}")
    swhere = scale.where(scale_name(name))
    if scale.dtype not in _SCALE_DTYPES:
        raise CheckpointError(f"{swhere}: scale dtype {scale.dtype} not allowed (float8_e8m0fnu, uint8 or float32)")
    if scale.shape != want_scale:
        raise CheckpointError(f"{swhere}: expected scale shape {want_scale} for a {shape} weight, got {scale.shape}")
    return _Plan(name, fmt, shape, src, scale, block)


def plan_v41_checkpoint(model_dir: Path, files: Files, model: DeepseekV41) -> tuple[dict[str, _Plan], list[str]]:
    """Native name -> what to read, for every model tensor, from the headers alone."""
    sources, ignored = _sources(model_dir, files, model.mtp is not None)
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    missing = [n for n in expected if n not in sources]
    if missing:
        raise CheckpointError(f"{model_dir}: missing {len(missing)} tensor(s): {listing(missing)}")
    scales = {scale_name(n) for n in expected if storage_format(n, model.cfg)[0] != "float"}
    unexpected = [sources[n].where(n) for n in sources if n not in expected and n not in scales]
    if unexpected:
        hint = " (a .scale for a tensor this config does not quantize: check quantization_config)" if any(
            n.endswith(".scale") for n in sources if n not in expected and n not in scales) else ""
        raise CheckpointError(f"unexpected tensor(s){hint}: {listing(unexpected)}")
    return {n: _plan_one(n, shape, sources, model.cfg) for n, shape in expected.items()}, ignored


def _read(plan: _Plan, files: Files) -> torch.Tensor:
    """The tensor's fp32 value, every data check done."""
    where = plan.src.where(plan.name)
    data = files.read(plan.src)
    if plan.fmt == "float":
        if not bool(torch.isfinite(data).all()):
            raise CheckpointError(f"{where}: contains NaN or infinite values")
        return data.float()
    scale = files.read(plan.scale)
    try:
        multipliers = scale_to_float(scale)
    except ValueError as e:
        raise CheckpointError(f"{plan.scale.where(scale_name(plan.name))}: {e}") from e
    if not _finite(plan.fmt, data, multipliers, plan.block):
        raise CheckpointError(f"{where}: contains NaN or infinite values")
    return dequantize(plan.fmt, data, scale, plan.block)


def dequantize(fmt: str, data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A stored FP8 / FP4 weight (codes + UE8M0 scales) -> its fp32 value (the plain path keeps no codes)."""
    return dequant_fp8_block(data, scale, block) if fmt == "fp8" else dequant_fp4(data, scale)


def load_tokenizer(model_dir: Path):
    from tokenizers import Tokenizer

    path = model_dir / TOKENIZER_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: not found; V4.1's Engram hashes normalised token ids, so the tokenizer "
                              "is part of the model")
    return Tokenizer.from_file(str(path))


def load_v41_model(model_dir: str | Path, dtype: torch.dtype = torch.bfloat16, *, cfg: V41Config | None = None,
                   tokenizer=None, cache_qdq: bool = True, dspark: bool = False, load_format: str = "auto",
                   seed: int = 0, keep: Callable[[DeepseekV41], object] | None = None
                   ) -> tuple[DeepseekV41, tuple[str, ...]]:
    """Build the model from ``model_dir``; returns it and the on-disk names that were skipped. ``dspark``:
    build and load the DSpark drafter too (its ``mtp.*`` tensors are then required, not skipped).
    ``load_format="dummy"``: random weights in the native formats from the config alone, seeded by ``seed``
    (``model/v41/dummy.py``); no safetensors are read (``model_dir`` may lack them, and its tokenizer too when
    ``tokenizer`` is given). ``keep``: cuts the built model to a rank's share before any tensor is read
    (``model/v41/parallel.shard_v41``); only the tensors it holds are read, each cut alike (``held_slice``); every
    header is checked all the same. Dummy weights are drawn whole and then cut."""
    if dtype not in FLOATS:
        raise ValueError(f"dtype: expected torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: {load_format!r} is not supported; allowed: {', '.join(LOAD_FORMATS)}")
    model_dir = Path(model_dir)
    if cfg is None:
        try:
            cfg = V41Config.from_model_dir(model_dir)
        except ValueError as e:
            raise CheckpointError(f"{model_dir / 'config.json'}: {e}") from e
    if tokenizer is None and cfg.active_engram_layers:
        tokenizer = load_tokenizer(model_dir)
    if load_format == "dummy":
        from deepinfer.model.v41.dummy import load_dummy_v41

        model = load_dummy_v41(cfg, dtype, tokenizer=tokenizer, cache_qdq=cache_qdq, dspark=dspark, seed=seed)
        if keep is not None:
            keep(model)
        return model, ()
    with torch.device("meta"):
        meta = DeepseekV41(cfg, dtype, shapes_only=True, dspark=dspark)
    files = Files(model_dir)
    plans, ignored = plan_v41_checkpoint(model_dir, files, meta)
    model = DeepseekV41(cfg, dtype, tokenizer=tokenizer, cache_qdq=cache_qdq, dspark=dspark)
    if keep is not None:
        keep(model)  # before anything is read: the tensors it drops are never filled
    own = model.state_dict()
    with torch.no_grad():
        for name, plan in plans.items():
            if keep is None:
                own[name].copy_(_read(plan, files).to(own[name].dtype))
                continue
            from deepinfer.model.parallel.slices import take
            from deepinfer.model.v41.parallel import held_slice

            held = held_slice(model, name)
            if held is None:  # another rank's expert
                continue
            local, spec = held
            value = _read(plan, files)
            own[local].copy_((value if spec is None else take(value, spec, name)).to(own[local].dtype))
    files.release()
    return model, tuple(ignored)
