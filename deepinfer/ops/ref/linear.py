"""Dense bf16 linear (the compressor/indexer side projections and the MoE router), reference twin of
``ops/triton/linear.py``: ``x [M, K] @ weight [N, K].T`` in x's dtype, as ``torch.nn.functional.linear``."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)
