"""DeepSeek-V4.1's attention core over per-query key lists on V4's sparse-attention kernel: the twin of
``ops/ref/key_lists.py``.

The two are one computation: a shared K = V head gathered through row lists (window rows, then the chosen
compressed entries; -1 = none), a per-head sink in the denominator only. The kernel (``sparse_attention.py``)
reads each listed row once for all heads with an online softmax; the reference gathers every query's keys
and runs ~15 launches per chunk of 256 queries. Numerics: in float32 the kernel's IEEE dots (the reference's
fp32 up to the order of sums); in bfloat16 its q.k products on the MMA (exact products, fp32 sums, as the
reference's) and its probabilities rounded to bf16 before P.V, which the fp32 reference does not do.
"""

from __future__ import annotations

import torch

from deepinfer.ops.triton.sparse_attention import sparse_attention_indexed
from deepinfer.ops.tuning import H200, KernelTuning


def attend_lists(q: torch.Tensor, sink: torch.Tensor, window: torch.Tensor, window_ids: torch.Tensor,
                 entries: torch.Tensor | None = None, entry_ids: torch.Tensor | None = None, *,
                 tuning: KernelTuning = H200) -> torch.Tensor:
    """q [L, heads, D]; window [Rw, D] with window_ids [L, W] (-1 = none), optionally entries [Re, D] with
    entry_ids [L, K] -> [L, heads, D] in q.dtype (``ops/ref/key_lists.attend_lists``)."""
    scale = q.shape[-1] ** -0.5
    window = window.to(q.dtype)
    if entries is not None and entries.shape[0] > 0 and entry_ids.shape[1] > 0:
        return sparse_attention_indexed(q, window, window_ids, sink, scale, entries.to(q.dtype), entry_ids,
                                        tuning=tuning)
    return sparse_attention_indexed(q, window, window_ids, sink, scale, tuning=tuning)
