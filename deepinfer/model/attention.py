"""DeepSeek-V4 attention: shared-KV MQA over a 128-token window plus compressed entries, with a sink.

One skeleton serves the three layer kinds:
  * SWA: window keys only ("main" RoPE table);
  * CSA: window keys + the indexer's top-k compressed entries ("compress" table everywhere in the layer);
  * HCA: window keys + every visible compressed entry.
A query at position t sees window keys (t-128, t] and entry j iff j < (t+1) // m. The computation is
``model/attention_indexed.py`` (one path for every step); this module holds the parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.config.model import CSA, HCA, SWA, ModelConfig
from deepinfer.model.attention_indexed import attention_indexed
from deepinfer.model.branches import INLINE, Branches
from deepinfer.model.compressor import Compressor, Indexer
from deepinfer.model.context import StepContext
from deepinfer.model.fused import StackedLinear, projection_sets
from deepinfer.model.linear import Linear
from deepinfer.model.norm import RMSNorm
from deepinfer.model.rope import RopeTables
from deepinfer.ops.table import REF, OpTable


class Attention(nn.Module):
    """Checkpoint names under ``layers.N.attn.``: wq_a, q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink,
    compressor.*, indexer.*."""

    ops: OpTable = REF  # replaced by model/device.py for accelerated runs
    branches: Branches = INLINE  # two streams on the GPU path (model/device.py, model/branches.py)

    def __init__(self, cfg: ModelConfig, kind: str, ratio: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.kind, self.ratio = kind, ratio
        self.n_heads, self.head_dim, self.groups = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        self.window = cfg.sliding_window
        self.eps = cfg.rms_norm_eps
        self.table = "main" if kind == SWA else "compress"
        h, d = cfg.hidden_size, cfg.head_dim
        self.wq_a = Linear(h, cfg.q_lora_rank, bias=False, dtype=dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * d, bias=False, dtype=dtype)
        self.wkv = Linear(h, d, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = Linear(self.n_heads * d // self.groups, self.groups * cfg.o_lora_rank, bias=False, dtype=dtype)
        self.wo_b = Linear(self.groups * cfg.o_lora_rank, h, bias=False, dtype=dtype)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        if kind in (CSA, HCA):
            self.compressor = Compressor(h, d, ratio, overlap=kind == CSA, eps=cfg.rms_norm_eps, dtype=dtype)
        if kind == CSA:
            self.indexer = Indexer(h, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, ratio,
                                   cfg.index_topk, cfg.rms_norm_eps, dtype)
        # Projections that read one input, as one output each (model/fused.py): x -> wq_a|wkv, the q latent
        # -> wq_b (|indexer wq_b), x -> every bf16 compressor/indexer projection. Side by side here; the
        # device transform stacks their weights into one GEMM each.
        for attr, parts in projection_sets(self).items():
            setattr(self, attr, StackedLinear.side_by_side(parts))

    def forward(self, x: torch.Tensor, ctx: StepContext, layer_key: str, ropes: RopeTables) -> torch.Tensor:
        if ctx.cp is not None:  # a context-parallel step (model/parallel/context.py)
            return ctx.cp.attention(self, x, layer_key)
        return attention_indexed(self, x, ctx, layer_key)
