"""One rank's slice of an already loaded weight, cut with the loader's ``Shard`` (``model/shard.py``).

The loader reads a ``Shard`` of a tensor straight from disk (what a rank of the engine does);
``shard_model`` (``model/parallel/shard.py``, the oracle of that load) cuts the same ``Shard`` out of a model
that was loaded whole, with the same index arithmetic
(``plain_index`` / ``quantized_index``), so both ways give a rank the same bytes. A quantized slice must
start and end on its scale blocks; when it does not (tiny test shapes), ``take_quantized`` returns None and
the module keeps the dequantized slice (the reference path).
"""

from __future__ import annotations

import torch

from deepinfer.model.quant import QuantizedWeight
from deepinfer.model.shard import Shard, plain_index, quantized_index


def _own(t: torch.Tensor) -> torch.Tensor:
    """A copy with storage of its own: a row slice is already contiguous, and ``.contiguous()`` would return a
    view that keeps the whole tensor's storage alive on every rank."""
    return t.clone(memory_format=torch.contiguous_format)


def take(full: torch.Tensor, shard: Shard, what: str = "weight") -> torch.Tensor:
    return _own(full[plain_index(tuple(full.shape), shard, what)])


def take_quantized(qw: QuantizedWeight, shard: Shard, what: str = "weight") -> QuantizedWeight | None:
    """The slice of a stored weight (codes and scales), or None when it does not fall on scale blocks."""
    shape = (qw.data.shape[0], qw.data.shape[1] * (2 if qw.format == "fp4" else 1))  # fp4: two codes a byte
    try:
        codes, scales = quantized_index(qw.format, shape, qw.block, shard, what)
    except ValueError:
        return None
    return QuantizedWeight(qw.format, _own(qw.data[codes]), _own(qw.scale[scales]), qw.block)
