"""``load_format="dummy"``: random weights in the checkpoint's native formats, from a config alone.

Each tensor is generated on the target device as the released checkpoints store it (FP8 e4m3 codes with
UE8M0 block scales, packed FP4 e2m1 codes with per-32 UE8M0 scales, bf16/fp32 for the rest, a hash table
of distinct expert ids per token) and goes through the same weight loaders as a checkpoint tensor
(``model/weight_loaders.py``): the model, its layout and its kernels are exactly those of a real load,
only the values differ, so benchmarks of the full V4-Flash / V4-Pro shapes need no download.

Values are a function of (seed, tensor name) only: every tensor has its own generator, so a rank that
loads a shard or a subset of experts gets the same values as a single-device load would hold there.
Magnitudes follow ``deepinfer.testing.make_checkpoint``: matrices ~ N(0, clamp(1/sqrt(fan_in), 0.02, 0.1))
(as FP8: codes ~ N(0, 64) with one power-of-two scale; as FP4: uniform random codes, RMS ~2.9, one
power-of-two scale), norms ~ 1, mHC scales ~ 1, biases and sinks small, so a forward stays finite.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable

import torch
from tqdm import tqdm

from deepinfer.config.model import ModelConfig
from deepinfer.model.ckpt_plan import expected_tensors
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.quant import FP4_GROUP, fp4_scale_shape, fp8_scale_shape, storage_format
from deepinfer.model.shard import SKIP, Shard, plain_index, quantized_index
from deepinfer.model.weight_loaders import StoredWeight, build_model, finish_load, weight_loaders
from deepinfer.ops.table import OpTable

_STORE_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_FP8_CODE_STD = 64.0  # codes ~ N(0, 64): well inside e4m3's range (448), using most of its precision
_FP4_CODE_RMS = math.sqrt(sum(v * v for v in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)) / 8)  # uniform codes


def dummy_stored(cfg: ModelConfig) -> dict[str, StoredWeight]:
    """The FP8/FP4 weights of ``cfg`` and how the native format stores them (UE8M0 scales)."""
    block = cfg.quant.weight_block_size if cfg.quant is not None else (128, 128)
    out = {}
    for name in expected_tensors(cfg, torch.float32):
        fmt = storage_format(name, cfg)
        if fmt in ("fp8", "fp4"):
            out[name] = StoredWeight(fmt, block if fmt == "fp8" else (1, FP4_GROUP), torch.float8_e8m0fnu)
    return out


def tensor_generator(name: str, seed: int, device: torch.device) -> torch.Generator:
    """The generator of one tensor: a function of (seed, name) only (also V4.1's, ``model/v41/dummy.py``)."""
    # A hash of (seed, name), mixed into the low 32 bits too: the CPU generator seeds from those alone.
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def _std(fan_in: int) -> float:
    return min(0.1, max(0.02, 1.0 / math.sqrt(fan_in)))


def _ue8m0(shape: tuple[int, ...], exponent: int, device: torch.device) -> torch.Tensor:
    return torch.full(shape, exponent + 127, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu)


def quantized_codes(g: torch.Generator, fmt: str, shape: tuple[int, ...], block: tuple[int, int],
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, UE8M0 scales) of a ``shape`` weight stored as ``fmt`` ("fp8" in ``block`` tiles, "fp4" packed
    two codes a byte with one scale per 32), drawn from ``g``; one power-of-two scale puts the dequantized
    values at ``_std(fan_in)``. Shared with V4.1's dummy loader (``model/v41/dummy.py``)."""
    if fmt == "fp8":
        codes = (torch.randn(shape, generator=g, device=device) * _FP8_CODE_STD).clamp(-448, 448).to(
            torch.float8_e4m3fn)
        exponent = round(math.log2(_std(shape[1]) / _FP8_CODE_STD))
        return codes, _ue8m0(fp8_scale_shape(shape, block), exponent, device)
    if fmt == "fp4":
        codes = torch.randint(-128, 128, (shape[0], shape[1] // 2), generator=g, device=device, dtype=torch.int8)
        exponent = round(math.log2(_std(shape[1]) / _FP4_CODE_RMS))
        return codes, _ue8m0(fp4_scale_shape(shape), exponent, device)
    raise ValueError(f"fmt: {fmt!r} is not a quantized storage format; allowed: fp8, fp4")


def plain_value(name: str, shape: tuple[int, ...], g: torch.Generator, device: torch.device) -> torch.Tensor:
    """An unquantized tensor's fp32 value, its magnitude chosen by its role (read from the name)."""

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(size, generator=g, device=device)

    if name.endswith("_scale") and "hc_" in name:
        return 1.0 + 0.2 * randn(*shape)
    if re.search(r"(attn_sink|\.ape|_base)$", name):
        return 0.5 * randn(*shape)
    if name.endswith("gate.bias"):
        return 0.1 * randn(*shape)
    if len(shape) == 1:  # norm weights
        return 1.0 + 0.1 * randn(*shape)
    return _std(shape[-1]) * randn(*shape)


def dummy_tensor(name: str, shape: tuple[int, ...], cfg: ModelConfig, seed: int, device: torch.device | str
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(data, scale) of one tensor as the checkpoint would store it (scale None for plain tensors)."""
    device = torch.device(device)
    g = tensor_generator(name, seed, device)
    fmt = storage_format(name, cfg)
    if fmt == "int64":  # distinct experts per token, as a real hash table has
        ids = torch.rand(shape[0], cfg.n_routed_experts, generator=g, device=device).argsort(dim=1)
        return ids[:, : shape[1]].contiguous(), None
    if fmt in ("fp8", "fp4"):
        return quantized_codes(g, fmt, shape, cfg.quant.weight_block_size, device)  # type: ignore[union-attr]
    return plain_value(name, shape, g, device).to(_STORE_DTYPE[fmt]), None


def load_dummy(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device, *, ops: OpTable | None = None,
               seed: int = 0, keep_quantized: bool = False, overlap: bool | None = None,
               progress: bool = False, shard_model: Callable[[DeepseekV4], None] | None = None) -> DeepseekV4:
    """A model of ``cfg`` with dummy weights, built and filled as ``load_model`` builds and fills it."""
    stored = dummy_stored(cfg)
    expected = expected_tensors(cfg, dtype)
    model = build_model(cfg, dtype, device, stored, ops, overlap, shard_model)
    device = next(model.buffers()).device
    loaders = weight_loaders(model, expected, stored, keep_quantized)
    for name, loader in tqdm(loaders.items(), desc="Dummy weights", unit="tensor", disable=not progress):
        selection = loader.selection
        if selection is SKIP:
            continue
        shape = expected[name][0]
        data, scale = dummy_tensor(name, shape, cfg, seed, device)
        if isinstance(selection, Shard):
            st = stored.get(name)
            if st is None:
                data = data[plain_index(shape, selection, name)]
            else:
                data_index, scale_index = quantized_index(st.fmt, shape, st.block, selection, name)
                data, scale = data[data_index], scale[scale_index]  # type: ignore[index]
        loader.load(data, scale)
    finish_load(model)
    return model
