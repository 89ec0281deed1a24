"""Dense linears of the reference path, twins of ``ops/triton/linear.py`` where one exists.

``linear``: the bf16 side projections and the MoE router, ``x [M, K] @ weight [N, K].T`` in x's dtype, as
``torch.nn.functional.linear``. ``dense`` / ``dense_grouped``: every other ``model/linear.Linear`` (the LM
head, the MTP projections, the CPU's dequantized FP8 linears and experts), plain and block-diagonal. The
batch-invariant table replaces all three with fixed-row-tile GEMMs (``ops/ref/row_tiles.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)


def dense(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> [..., N]."""
    return F.linear(x, weight)


def dense_grouped(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Block-diagonal: x [G, T, in] -> [G, T, r], group g through weight rows [g*r, (g+1)*r)."""
    g = x.shape[0]
    w = weight.view(g, -1, x.shape[-1]).transpose(1, 2)  # [G, in, r]
    return torch.bmm(x, w)
