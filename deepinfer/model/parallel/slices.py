"""One rank's slice of a weight: the only place tensors are cut for parallelism.

Each sharded module type declares which of its weights are split, along which dim and in which unit
(``ShardSpec``); ``take`` applies a spec to a full tensor and ``take_quantized`` to its on-disk FP8/FP4
form, so the same spec can serve a streaming loader that reads only the rank's slice. A quantized slice
must start and end on its scale blocks; when it does not (tiny test shapes), the quantized form is dropped
and the module keeps the dequantized slice (the reference path), which ``slice_quantized`` reports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model.quant import QuantizedWeight


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """Cut ``dim`` into ``parts`` equal pieces and keep piece ``index``."""

    dim: int
    parts: int
    index: int

    def bounds(self, size: int) -> tuple[int, int]:
        if size % self.parts:
            raise ValueError(f"cannot split {size} into {self.parts} equal parts")
        n = size // self.parts
        return self.index * n, n


def _own(t: torch.Tensor) -> torch.Tensor:
    """A copy with storage of its own: a row slice is already contiguous, and ``.contiguous()`` would return a
    view that keeps the whole tensor's storage alive on every rank."""
    return t.clone(memory_format=torch.contiguous_format)


def take(full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
    start, n = spec.bounds(full.shape[spec.dim])
    return _own(full.narrow(spec.dim, start, n))


def take_quantized(qw: QuantizedWeight, spec: ShardSpec) -> QuantizedWeight | None:
    """The slice of an on-disk weight (codes and scales), or None when it does not fall on scale blocks."""
    rows = qw.data.shape[0]
    cols = qw.data.shape[1] * (2 if qw.format == "fp4" else 1)  # fp4: two codes per byte
    start, n = spec.bounds(rows if spec.dim == 0 else cols)
    block = qw.block[spec.dim]
    if start % block or n % block:
        return None
    if spec.dim == 0:
        data = qw.data.narrow(0, start, n)
    else:
        per_byte = 2 if qw.format == "fp4" else 1
        data = qw.data.narrow(1, start // per_byte, n // per_byte)
    scale = qw.scale.narrow(spec.dim, start // block, n // block)
    return QuantizedWeight(qw.format, _own(data), _own(scale), qw.block)
