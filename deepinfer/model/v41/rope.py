"""V4.1 rotary embedding tables (spec §2.4 step 2): the angles of each position. The rotation itself (adjacent
pairs of the *last* rope dims, a complex multiply in fp32) is the op table's ``v41_rope``
(``ops/ref/rope_v41.py``, one kernel on CUDA).

Two tables: "main" (plain, theta 1e4) for window-only layers; "compress" (theta 1.6e5 with YaRN frequency
scaling, no mscale) for every rope of a layer with ratio > 0.
"""

from __future__ import annotations

import functools
import math

import torch

from deepinfer.config.model import RopeConfig


@functools.lru_cache(maxsize=64)
def frequencies(rope: RopeConfig, device: torch.device | None = None) -> torch.Tensor:
    """[rope_dim / 2] fp32 angular frequencies; YaRN blends freq / factor into the low-frequency dims. Cached
    per (table, device): a step asks for them a few times (~15 launches each with YaRN); read-only."""
    dim = rope.rope_dim
    freqs = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if rope.yarn_factor is None:
        return freqs
    length, theta = rope.original_max_position_embeddings, rope.theta
    low = max(math.floor(dim * math.log(length / (rope.beta_fast * 2 * math.pi)) / (2 * math.log(theta))), 0)
    high = min(math.ceil(dim * math.log(length / (rope.beta_slow * 2 * math.pi)) / (2 * math.log(theta))), dim - 1)
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return freqs / rope.yarn_factor * ramp + freqs * (1 - ramp)


def angles(rope: RopeConfig, positions: torch.Tensor) -> torch.Tensor:
    """positions [T] -> fp32 angles [T, rope_dim / 2]."""
    return positions.float().unsqueeze(-1) * frequencies(rope, positions.device)
