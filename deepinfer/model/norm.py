"""Weighted RMSNorm module; its weight is kept in fp32 (checkpoints store bf16, upcast exactly).

The math is ``ops.rms_norm``: ``REF`` holds ``ops/ref/norm.rms_norm`` itself (so the reference path keeps its
exact bits); ``model/device.py`` replaces ``ops`` on every module that has it, these included.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.ops.table import REF, OpTable


class RMSNorm(nn.Module):
    ops: OpTable = REF  # replaced by model/device.py for accelerated runs

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)
