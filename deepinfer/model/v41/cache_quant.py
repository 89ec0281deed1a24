"""Quantize-dequantize of V4.1's caches (spec §2.4-§2.6): the reference keeps these roundings in the forward.

* window KV: FP8 e4m3 per 32 channels, scale a power of two >= amax / 448 (UE8M0);
* indexer queries and keys: MXFP4 (e2m1 per 32 channels, power-of-two scale >= amax / 6);
* compressed KV: NVFP4 (e2m1 per 16 channels, e4m3 scale = amax / 6 rounded to e4m3, no global scale).

The e2m1 rounding is nearest with ties to the even code. Power-of-two scales are taken from the fp32 bit
pattern (exponent + 1 when any mantissa bit is set), never through a logarithm, so they are exact.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

CacheFormat = Literal["fp8", "mxfp4", "nvfp4"]
BLOCK = {"fp8": 32, "mxfp4": 32, "nvfp4": 16}
_E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def pow2_ceil(value: torch.Tensor) -> torch.Tensor:
    """Positive normal fp32 values -> the smallest power of two >= value, from the bits."""
    bits = value.float().contiguous().view(torch.int32)
    exponent = (bits >> 23) & 255
    exponent = exponent + ((bits & ((1 << 23) - 1)) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Values in [-6, 6] -> nearest e2m1 value; a value on a midpoint goes to the even code."""
    magnitude = x.abs().contiguous()
    midpoints = magnitude.new_tensor(_E2M1_MIDPOINTS)
    levels = magnitude.new_tensor(_E2M1_LEVELS)
    code = torch.bucketize(magnitude, midpoints)  # a midpoint itself falls to the lower code
    on_midpoint = magnitude == midpoints[code.clamp_max(len(_E2M1_MIDPOINTS) - 1)]
    code = code + (on_midpoint & (code % 2 == 1)).to(code.dtype)  # odd lower code: the even one is above
    return torch.copysign(levels[code], x)


def qdq(values: torch.Tensor, fmt: CacheFormat) -> torch.Tensor:
    """[..., C] -> the same values after one quantize-dequantize round trip, in values' dtype. A partial last
    group (tiny test configs) is zero-padded, which does not change its amax."""
    block = BLOCK[fmt]
    channels = values.shape[-1]
    groups = F.pad(values.float(), (0, -channels % block)).unflatten(-1, (-1, block))
    amax = groups.abs().amax(-1, keepdim=True)
    if fmt == "fp8":
        scale = pow2_ceil(amax.clamp_min(1e-4) * (1 / 448))
        rounded = (groups / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    else:
        if fmt == "nvfp4":
            scale = (amax.clamp_min(6 * 2**-9) / 6).to(torch.float8_e4m3fn).float()
        else:
            scale = pow2_ceil(amax.clamp_min(6 * 2**-126) * (1 / 6))
        rounded = _round_e2m1((groups / scale).clamp(-6, 6))
    return (rounded * scale).flatten(-2)[..., :channels].to(values.dtype)
