"""Compressor window pooling: per-channel softmax over a window's slots, weighted sum, RMSNorm.

The caller gathers, for each closing window, the raw projections of its slots (CSA: 4 ``Ca`` slots of the
previous window then 4 ``Cb`` slots of this one; HCA: the window's 128 slots). Empty slots carry a -inf
gate so they get zero weight. RoPE at the window start is applied by the caller.
"""

from __future__ import annotations

import torch

from deepinfer.ops.ref.norm import rms_norm


def pool_windows(
    kv: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float, dtype: torch.dtype
) -> torch.Tensor:
    """kv [W, S, C] (any float dtype), gate [W, S, C] fp32 incl. position bias -> entries [W, C] in dtype."""
    weights = gate.float().softmax(dim=1).to(dtype)
    pooled = (kv.to(dtype) * weights).sum(dim=1)
    return rms_norm(pooled, norm_weight, eps)
