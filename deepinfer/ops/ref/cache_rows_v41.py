"""DeepSeek-V4.1's packed cache rows (the released formats of ``model/v41/cache_quant.py``): a step's rows
written into and read from a packed storage tensor. The twin of ``ops/triton/cache_rows_v41.py``.

    store_packed(table [R, B] uint8, where [N], values [N, C], fmt)   table[where] = quantize(values, fmt)
    load_packed(table, where [N], fmt, channels, dtype) -> [N, C]     dequantize(table[where], fmt, ...)
    qdq(values, fmt) -> values                                         the rounding kept in the forward
"""

from __future__ import annotations

import torch

from deepinfer.model.v41 import cache_quant
from deepinfer.model.v41.cache_quant import CacheFormat, dequantize, quantize


def store_packed(table: torch.Tensor, where: torch.Tensor, values: torch.Tensor, fmt: CacheFormat) -> None:
    table[where] = quantize(values, fmt)


def load_packed(table: torch.Tensor, where: torch.Tensor, fmt: CacheFormat, channels: int, dtype: torch.dtype
                ) -> torch.Tensor:
    return dequantize(table[where], fmt, channels, dtype)


def qdq(values: torch.Tensor, fmt: CacheFormat) -> torch.Tensor:
    return cache_quant.qdq(values, fmt)
