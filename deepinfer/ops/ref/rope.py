"""Interleaved RoPE on the trailing ``rope_dim`` channels, with plain and YaRN (no mscale) frequency tables.

Pairs are (0,1), (2,3), ... of the last ``rope_dim`` channels (GPT-J style), not NeoX half rotation.
Angles are computed in fp32; cos/sin are cast to the activation dtype before the (fp32) rotation, whose
result is cast back once — the same steps as the reference, so bf16 runs round identically.
"""

from __future__ import annotations

import math

import torch

from deepinfer.config.model import RopeConfig
from deepinfer.ops.ref.pointwise import direct


def inv_freq(rope: RopeConfig) -> torch.Tensor:
    """[rope_dim // 2] inverse frequencies (fp32)."""
    dim = rope.rope_dim
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    if rope.yarn_factor is None:
        return extrapolation
    interpolation = 1.0 / (rope.yarn_factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    # YaRN correction range, truncated to whole dimensions.
    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    return interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight


def cos_sin(positions: torch.Tensor, freqs: torch.Tensor, attention_factor: float, dtype: torch.dtype,
            pointwise=direct):
    """cos/sin of shape [..., rope_dim // 2] for integer ``positions`` [...], cast to ``dtype``.
    ``pointwise``: the op table's way of applying cos and sin (``ops/ref/pointwise.py``)."""
    angles = positions.to(torch.float32)[..., None] * freqs.to(device=positions.device, dtype=torch.float32)
    cos, sin = pointwise(torch.cos, angles), pointwise(torch.sin, angles)
    return (cos * attention_factor).to(dtype), (sin * attention_factor).to(dtype)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` channels of x [T, ..., D] by the angles of cos/sin [T, R/2].

    ``inverse=True`` applies the conjugate rotation (used to de-rotate the attention output, whose value
    vectors carried the key's rotation).
    """
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    cos = cos.repeat_interleave(2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)
    if inverse:
        sin = -sin
    rope_dim = cos.shape[-1]
    nope, rot = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated = (rot.float() * cos + _rotate_pairs(rot).float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)
