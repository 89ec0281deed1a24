"""Bias-free Linear and Embedding without random initialisation.

Inference weights always come from a checkpoint, so these allocate with ``torch.empty`` and skip
``reset_parameters`` (which on the meta device pulls in torch's decomposition tables: seconds at start-up).
The product itself is the op table's ``dense`` / ``dense_grouped`` (``ops/ref/linear.py``): ``F.linear`` and
``torch.bmm`` in the reference and Triton tables, fixed row tiles in the batch-invariant one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.ops.table import REF, OpTable


class Linear(nn.Module):
    ops: OpTable = REF  # replaced on every module by model/device.py (use_op_table) for other tables

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None):
        super().__init__()
        assert not bias, "DeepSeek-V4 linears have no bias"
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.dense(x, self.weight)

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """Block-diagonal use: x [G, T, in] -> [G, T, out/G], group g through weight rows [g*r, (g+1)*r)."""
        return self.ops.dense_grouped(x, self.weight)

    def grouped_flat(self, x: torch.Tensor, groups: int) -> torch.Tensor:
        """``grouped`` on the flat layout: x [T, G*in] -> [T, G*r] (group g reads columns [g*in, (g+1)*in))."""
        return flat_grouped(self.grouped, x, groups)


def flat_grouped(grouped, x: torch.Tensor, groups: int) -> torch.Tensor:
    """Run a [G, T, in] -> [G, T, r] grouped projection on the flat [T, G*in] layout, returning [T, G*r]."""
    t = x.shape[0]
    return grouped(x.reshape(t, groups, -1).transpose(0, 1)).transpose(0, 1).reshape(t, -1)


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
