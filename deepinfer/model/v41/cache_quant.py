"""Quantize-dequantize of V4.1's caches (spec §2.4-§2.6): the reference keeps these roundings in the forward.

* window KV: FP8 e4m3 per 32 channels, scale a power of two >= amax / 448 (UE8M0);
* indexer queries and keys: MXFP4 (e2m1 per 32 channels, power-of-two scale >= amax / 6);
* compressed KV: NVFP4 (e2m1 per 16 channels, e4m3 scale = amax / 6 rounded to e4m3, no global scale).

The e2m1 rounding is nearest with ties to the even code. Power-of-two scales are taken from the fp32 bit
pattern (exponent + 1 when any mantissa bit is set), never through a logarithm, so they are exact.

``qdq`` keeps the rounding in the activation dtype (the plain model, unpacked cache rows); ``quantize`` gives
the same rounding as packed bytes (``kv/spec.py`` PackedFormat: codes then scales, uint8) and ``dequantize``
reads them back. The contract: ``dequantize(quantize(x, f), f, C, x.dtype) == qdq(x, f)`` bit for bit, so the
engine's packed cache changes no logit: ``quantize`` computes ``qdq``'s codes and scales with its operations,
``dequantize`` turns bytes back into those fp32 values (256-entry tables built by the same conversions) and
takes ``qdq``'s product. Plain torch ops, so both run on any device.
"""

from __future__ import annotations

import functools
from typing import Literal

import torch
import torch.nn.functional as F

from deepinfer.kv.spec import E2M1_E4M3_16, E2M1_UE8M0_32, FP8_UE8M0_32, PackedFormat

CacheFormat = Literal["fp8", "mxfp4", "nvfp4"]
BLOCK = {"fp8": 32, "mxfp4": 32, "nvfp4": 16}
PACKED: dict[str, PackedFormat] = {"fp8": FP8_UE8M0_32, "mxfp4": E2M1_UE8M0_32, "nvfp4": E2M1_E4M3_16}
ROUNDING_OF = {f.name: fmt for fmt, f in PACKED.items()}  # a cache tensor's packed dtype -> its rounding
_E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def pow2_ceil(value: torch.Tensor) -> torch.Tensor:
    """Positive normal fp32 values -> the smallest power of two >= value, from the bits."""
    bits = value.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 255
    exponent = exponent + ((bits & ((1 << 23) - 1)) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


@functools.cache
def _e2m1_grid(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(midpoints, levels) of the e2m1 magnitudes, computed on ``device`` once: a copy of host values is a
    host sync on a GPU (every cache write and read of a step would pay one, the first inside the step)."""
    code = torch.arange(8, device=device, dtype=torch.float32)
    # 0, 0.5 (subnormal), then 2^(e - 1) * (1 + m / 2) for exponent e = code // 2, mantissa bit m = code % 2.
    levels = torch.where(code < 2, code * 0.5, torch.exp2(torch.floor(code / 2) - 1) * (1 + (code % 2) * 0.5))
    return ((levels[:-1] + levels[1:]) / 2).to(dtype), levels.to(dtype)


def _e2m1_code(x: torch.Tensor) -> torch.Tensor:
    """Values in [-6, 6] -> the magnitude code (0..7) of the nearest e2m1 value; a value on a midpoint goes to
    the even code."""
    magnitude = x.abs().contiguous()
    midpoints = _e2m1_grid(magnitude.device, magnitude.dtype)[0]
    code = torch.bucketize(magnitude, midpoints)  # a midpoint itself falls to the lower code
    on_midpoint = magnitude == midpoints[code.clamp_max(len(_E2M1_MIDPOINTS) - 1)]
    return code + (on_midpoint & (code % 2 == 1)).to(code.dtype)  # odd lower code: the even one is above


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Values in [-6, 6] -> nearest e2m1 value, with x's sign (zero included)."""
    return torch.copysign(_e2m1_grid(x.device, x.dtype)[1][_e2m1_code(x)], x)


def _scaled_groups(values: torch.Tensor, fmt: CacheFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., C] -> (the groups divided by their scale and clamped to the format's range [..., G, block] fp32,
    the fp32 scales [..., G, 1], the scales as stored [..., G, 1]: e4m3 for nvfp4, else the power-of-two fp32
    value). A partial last group (tiny test configs) is zero-padded, which does not change its amax. One place
    for ``qdq`` and ``quantize``, so the packed rows and the rounded ones can never disagree."""
    block = BLOCK[fmt]
    groups = F.pad(values.float(), (0, -values.shape[-1] % block)).unflatten(-1, (-1, block))
    amax = groups.abs().amax(-1, keepdim=True)
    if fmt == "fp8":
        scale = stored = pow2_ceil(amax.clamp_min(1e-4) * (1 / 448))
        limit = 448.0
    elif fmt == "nvfp4":
        stored = (amax.clamp_min(6 * 2**-9) / 6).to(torch.float8_e4m3fn)
        scale, limit = stored.float(), 6.0
    else:
        scale = stored = pow2_ceil(amax.clamp_min(6 * 2**-126) * (1 / 6))
        limit = 6.0
    return (groups / scale).clamp(-limit, limit), scale, stored


def qdq(values: torch.Tensor, fmt: CacheFormat) -> torch.Tensor:
    """[..., C] -> the same values after one quantize-dequantize round trip, in values' dtype."""
    normalized, scale, _ = _scaled_groups(values, fmt)
    rounded = normalized.to(torch.float8_e4m3fn).float() if fmt == "fp8" else _round_e2m1(normalized)
    return (rounded * scale).flatten(-2)[..., :values.shape[-1]].to(values.dtype)


def _exponent_byte(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales -> their UE8M0 byte (the biased exponent)."""
    return ((scale.contiguous().view(torch.int32) >> 23) & 255).to(torch.uint8)


# Reading a row is one gather per table instead of a chain of bit operations on every byte (the CPU step reads
# every row it attends each step). Built once per device, from the same bits as the writer's.
@functools.cache
def _byte_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[256] fp32 value of each byte as e4m3 and as a UE8M0 scale; [256, 2] fp32 e2m1 values of each byte's
    (low, high) nibbles."""
    byte = torch.arange(256, dtype=torch.int32, device=device)
    e4m3 = byte.to(torch.uint8).view(torch.float8_e4m3fn).float()
    nibble = torch.stack((byte & 15, byte >> 4), dim=-1)
    level = _e2m1_grid(device, torch.float32)[1][nibble & 7]
    return e4m3, (byte << 23).view(torch.float32), torch.where(nibble >= 8, -level, level)  # -0.0 for code 8


def quantize(values: torch.Tensor, fmt: CacheFormat) -> torch.Tensor:
    """[..., C] -> the packed rows [..., PACKED[fmt].row_bytes(C)] uint8: every channel's code (e4m3 bits, or
    sign | e2m1 magnitude nibbles two per byte, the even channel low), then every group's scale byte (UE8M0
    exponent, or e4m3 bits for nvfp4). Codes and scales are ``qdq``'s, computed the same way."""
    channels = values.shape[-1]
    normalized, _, stored = _scaled_groups(values, fmt)
    if fmt == "fp8":
        codes = normalized.to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2)[..., :channels]
        scales = _exponent_byte(stored)
    else:
        scales = stored.view(torch.uint8) if fmt == "nvfp4" else _exponent_byte(stored)
        nibbles = (_e2m1_code(normalized) | (torch.signbit(normalized).long() << 3)).to(torch.uint8)
        nibbles = F.pad(nibbles.flatten(-2)[..., :channels], (0, channels % 2))  # an odd width's last byte
        codes = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    return torch.cat((codes, scales.flatten(-2)), dim=-1)


def dequantize(rows: torch.Tensor, fmt: CacheFormat, channels: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows [..., PACKED[fmt].row_bytes(channels)] uint8 (``quantize``'s) -> values [..., channels] in
    ``dtype``: ``qdq``'s product of the rounded value and its scale, in fp32, then cast."""
    block, packed = BLOCK[fmt], PACKED[fmt]
    if rows.dtype != torch.uint8 or rows.shape[-1] != packed.row_bytes(channels):
        raise ValueError(f"rows: packed {packed.name} rows of {channels} channels are uint8 [..., "
                         f"{packed.row_bytes(channels)}], got {rows.dtype} [..., {rows.shape[-1]}]")
    n_codes = packed.code_bytes(channels)
    codes, scales = rows[..., :n_codes], rows[..., n_codes:]
    e4m3, ue8m0, e2m1_pairs = _byte_tables(rows.device)
    if fmt == "fp8":
        rounded = e4m3[codes.long()]
    else:
        rounded = e2m1_pairs[codes.long()].flatten(-2)[..., :channels]
    scale = (e4m3 if fmt == "nvfp4" else ue8m0)[scales.long()]
    if channels % block:  # a partial last group (tiny test configs): qdq's zero padding
        rounded = F.pad(rounded, (0, -channels % block))
    return (rounded.unflatten(-1, (-1, block)) * scale.unsqueeze(-1)).flatten(-2)[..., :channels].to(dtype)
