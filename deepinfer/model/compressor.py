"""KV compressors (CSA: ratio 4 with overlapping windows; HCA: ratio 128) and the lightning indexer.

Position-addressed: every token's raw projections (kv and gate, position bias already added) go into the
``state`` pool at its absolute position; when a window closes, its entry is pooled from those rows and
written to the ``history`` pool at the window's index. Because entries are recomputed from per-position
rows, any chunking of the prompt, a rollback, or a preemption produces exactly the same entries.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.model.linear import Linear
from deepinfer.model.norm import RMSNorm
from deepinfer.ops.table import REF, OpTable


class Compressor(nn.Module):
    """Checkpoint names: ``attn.compressor.{wkv,wgate,ape,norm}`` (and ``attn.indexer.compressor.*``)."""

    def __init__(self, hidden: int, width: int, ratio: int, overlap: bool, eps: float, dtype: torch.dtype):
        super().__init__()
        self.width, self.ratio, self.overlap = width, ratio, overlap
        coff = 2 if overlap else 1
        self.series = coff * width  # kv (and gate) columns per position
        self.wkv = Linear(hidden, self.series, bias=False, dtype=dtype)
        self.wgate = Linear(hidden, self.series, bias=False, dtype=dtype)
        self.ape = nn.Parameter(torch.zeros(ratio, self.series, dtype=torch.float32))
        self.norm = RMSNorm(width, eps)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer. Checkpoint names: ``attn.indexer.{wq_b,weights_proj,compressor}``."""

    ops: OpTable = REF  # replaced by model/device.py for accelerated runs

    def __init__(self, hidden: int, q_lora_rank: int, n_heads: int, head_dim: int, ratio: int, topk: int,
                 eps: float, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.wq_b = Linear(q_lora_rank, n_heads * head_dim, bias=False, dtype=dtype)
        self.weights_proj = Linear(hidden, n_heads, bias=False, dtype=dtype)
        self.compressor = Compressor(hidden, head_dim, ratio, overlap=True, eps=eps, dtype=dtype)
