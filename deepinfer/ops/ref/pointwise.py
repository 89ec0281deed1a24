"""The op table's ``pointwise`` entry: how an element-wise transcendental function (SiLU, sigmoid, softplus,
cos/sin, exp) of a batch-sized tensor is applied. The reference and the GPU call it directly; the
batch-invariant table runs it over whole vector blocks (``ops/ref/row_tiles.whole_lanes``), since a CPU
kernel's scalar tail rounds differently from its vector body.

  pointwise(fn, x) -> fn(x)
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def direct(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return fn(x)
