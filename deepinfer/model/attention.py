"""DeepSeek-V4 attention: shared-KV MQA over a 128-token window plus compressed entries, with a sink.

One skeleton serves the three layer kinds:
  * SWA: window keys only ("main" RoPE table);
  * CSA: window keys + the indexer's top-k compressed entries ("compress" table everywhere in the layer);
  * HCA: window keys + every visible compressed entry.
A query at position t sees window keys (t-128, t] and entry j iff j < (t+1) // m.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.config.model import CSA, HCA, SWA, ModelConfig
from deepinfer.kv.spec import WINDOW
from deepinfer.kv.storage import rows_for
from deepinfer.model.attention_indexed import attention_indexed
from deepinfer.model.batch import SeqRun
from deepinfer.model.branches import INLINE, Branches
from deepinfer.model.compressor import Compressor, Indexer
from deepinfer.model.context import StepContext
from deepinfer.model.linear import Linear
from deepinfer.model.norm import RMSNorm
from deepinfer.model.rope import RopeTables
from deepinfer.ops.ref.norm import unweighted_rms_norm
from deepinfer.ops.ref.rope import apply_rope
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
        # The batched path's stacked projections (model/fused.py): x -> wq_a|wkv, q latent -> wq_b (|indexer
        # wq_b), x -> every bf16 compressor/indexer projection.
        self.x_proj: nn.Module | None = None
        self.q_proj: nn.Module | None = None
        self.side_proj: nn.Module | None = None
        if kind == CSA:
            self.indexer = Indexer(h, cfg.q_lora_rank, cfg.index_n_heads, cfg.index_head_dim, ratio,
                                   cfg.index_topk, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, ctx: StepContext, layer_key: str, ropes: RopeTables) -> torch.Tensor:
        if ctx.index is not None:
            return attention_indexed(self, x, ctx, layer_key)
        cos, sin = ctx.rope[self.table]
        q_res = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_res).view(len(x), self.n_heads, self.head_dim)
        q = apply_rope(unweighted_rms_norm(q, self.eps), cos, sin)
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        self._write_window(kv, ctx, layer_key)

        def rope_at(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return ropes.rotate(self.table, t, positions)

        if self.kind != SWA:
            self.compressor.write_state(x, ctx, layer_key, "compressor_state")
            if self.kind == CSA:
                self.indexer.compressor.write_state(x, ctx, layer_key, "indexer_state")
            for run in ctx.batch.runs:
                self.compressor.emit(run, ctx, layer_key, "compressor_state", "entries", rope_at)
                if self.kind == CSA:
                    self.indexer.compressor.emit(run, ctx, layer_key, "indexer_state", "index_keys", rope_at)

        out = torch.empty_like(q)
        for run in ctx.batch.runs:
            sl = ctx.slice(run)
            out[sl] = self._attend_run(run, q[sl], x[sl], q_res[sl], ctx, layer_key, rope_at)
        out = apply_rope(out, cos, sin, inverse=True)
        return self._project_out(out)

    def _write_window(self, kv: torch.Tensor, ctx: StepContext, layer_key: str) -> None:
        spec = ctx.layout.layer(layer_key).tensor("window_kv")
        store = ctx.storage.get(layer_key, "window_kv")
        for run in ctx.batch.runs:
            pos = ctx.positions[ctx.slice(run)]
            store[rows_for(run.block_tables[WINDOW], pos, ctx.layout, spec)] = kv[ctx.slice(run)]

    def _attend_run(self, run: SeqRun, q, x, q_res, ctx: StepContext, layer_key: str, rope_at) -> torch.Tensor:
        dev = q.device
        qpos = torch.arange(run.first_pos, run.end_pos, dtype=torch.long, device=dev)
        kpos = torch.arange(max(0, run.first_pos - self.window + 1), run.end_pos, dtype=torch.long, device=dev)
        spec = ctx.layout.layer(layer_key).tensor("window_kv")
        keys = ctx.storage.get(layer_key, "window_kv")[rows_for(run.block_tables[WINDOW], kpos, ctx.layout, spec)]
        visible = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - self.window)
        if self.kind != SWA:
            entries = self.compressor.read_entries(run, ctx, layer_key, "entries")
            entry_visible = self._entry_visibility(run, qpos, x, q_res, ctx, layer_key, len(entries), rope_at)
            keys = torch.cat([keys, entries], dim=0)
            visible = torch.cat([visible, entry_visible], dim=1)
        return self.ops.attention(q, keys, visible, self.attn_sink, self.head_dim**-0.5)

    def _entry_visibility(self, run, qpos, x, q_res, ctx, layer_key, count, rope_at) -> torch.Tensor:
        causal = torch.arange(count, device=qpos.device)[None, :] < ((qpos + 1) // self.ratio)[:, None]
        if self.kind == HCA or count == 0:
            return causal
        index_keys = self.indexer.compressor.read_entries(run, ctx, layer_key, "index_keys")
        picks = self.indexer.select(x, q_res, qpos, index_keys, rope_at)
        chosen = torch.zeros(len(qpos), count + 1, dtype=torch.bool, device=qpos.device)
        chosen.scatter_(1, torch.where(picks >= 0, picks, count), True)
        return chosen[:, :count] & causal

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Grouped low-rank output: heads in G groups, each projected by its own block of wo_a, then wo_b."""
        t = len(out)
        grouped = out.reshape(t, self.groups, -1).transpose(0, 1)  # [G, T, nh*D/G]
        y = self.wo_a.grouped(grouped).transpose(0, 1).reshape(t, -1)
        return self.wo_b(y)
