"""DeepSeek-V4.1's ratio-r compressor pooling over the state pool (``model/v41/paged.py``, the steps' KV sources);
twin of ``ops/triton/compress_pool_v41.py``.

  pool(state [S, 2D] fp32, rows [E, r] int64, dtype) -> [E, D] in dtype

Each state row holds a position's fp32 value projection (channels [0, D)) and gate scores ([D, 2D)); entry e pools
its group's r rows ``rows[e]``: per channel, the values weighted by the softmax of the scores over the r rows, all
in fp32, one rounding to ``dtype`` at the end. Exactly ``Compressor.forward``'s ops (``model/v41/attention.py``)
on the gathered rows.
"""

from __future__ import annotations

import torch


def pool(state: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    values, scores = state[rows].split(state.shape[1] // 2, dim=-1)
    return (values * scores.softmax(dim=1)).sum(dim=1).to(dtype)
