"""V4.1's rows in the engine's cache storage: written and read through the tensor's declared format.

A tensor of the layout (``kv/spec_v41.py``) keeps plain values (the activation dtype, or float32) or packed
bytes of a released format (``packed``: FP8 window KV and DSpark context, NVFP4 entries, MXFP4 index keys).
The model hands ``store_rows`` what the reference caches before its rounding when the tensor is packed
(``quantize`` rounds it, exactly as ``qdq`` would), the rows it rounded itself otherwise; ``load_rows``
gives back values in the activation dtype either way, so the attention code never sees bytes.
"""

from __future__ import annotations

import torch

from deepinfer.kv.storage import KVStorage
from deepinfer.model.v41.cache_quant import ROUNDING_OF
from deepinfer.ops.table import REF, OpTable


def store_rows(storage: KVStorage, key: str, name: str, where: torch.Tensor, values: torch.Tensor,
               ops: OpTable = REF) -> None:
    """Write ``values`` [N, C] into rows ``where`` [N] of tensor ``name`` of layer ``key`` (packed rows by
    ``ops.v41_store_packed``: one kernel on CUDA)."""
    spec = storage.spec(key, name)
    rows = storage.get(key, name)
    if spec.packed is None:
        rows[where] = values
    else:
        ops.v41_store_packed(rows, where, values, ROUNDING_OF[spec.dtype])


def load_rows(storage: KVStorage, key: str, name: str, where: torch.Tensor, ops: OpTable = REF) -> torch.Tensor:
    """Rows ``where`` of tensor ``name`` of layer ``key`` as values [N, C] (the activation dtype when packed,
    read by ``ops.v41_load_packed``)."""
    spec = storage.spec(key, name)
    rows = storage.get(key, name)
    if spec.packed is None:
        return rows[where]
    return ops.v41_load_packed(rows, where, ROUNDING_OF[spec.dtype], spec.width, storage.model_dtype)
