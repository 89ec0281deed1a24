"""KV compressors (CSA: ratio 4 with overlapping windows; HCA: ratio 128) and the lightning indexer.

Position-addressed: every token's raw projections (kv and gate, position bias already added) go into the
``state`` pool at its absolute position; when a window closes, its entry is pooled from those rows and
written to the ``history`` pool at the window's index. Because entries are recomputed from per-position
rows, any chunking of the prompt, a rollback, or a preemption produces exactly the same entries.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.kv.spec import HISTORY, STATE
from deepinfer.kv.storage import rows_for
from deepinfer.model.batch import SeqRun
from deepinfer.model.context import StepContext
from deepinfer.model.linear import Linear
from deepinfer.model.norm import RMSNorm
from deepinfer.ops.ref.compressor import pool_windows
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

    def write_state(self, x: torch.Tensor, ctx: StepContext, layer_key: str, name: str) -> None:
        """Store each new token's kv and biased gate (fp32) at its absolute position."""
        kv = self.wkv(x).float()
        gate = self.wgate(x).float() + self.ape[ctx.positions % self.ratio]
        rows = torch.cat([kv, gate], dim=-1)
        spec = ctx.layout.layer(layer_key).tensor(name)
        state = ctx.storage.get(layer_key, name)
        for run in ctx.batch.runs:
            pos = ctx.positions[ctx.slice(run)]
            state[rows_for(run.block_tables[STATE], pos, ctx.layout, spec)] = rows[ctx.slice(run)]

    def emit(self, run: SeqRun, ctx: StepContext, layer_key: str, state_name: str, entry_name: str, rope) -> None:
        """Pool every window that closes inside this run and write its entry (rotated at the window start)."""
        m = self.ratio
        windows = torch.arange(run.first_pos // m, run.end_pos // m, dtype=torch.long, device=ctx.positions.device)
        if windows.numel() == 0:
            return
        kv, gate = self._gather_slots(run, ctx, layer_key, state_name, windows)
        entries = pool_windows(kv, gate, self.norm.weight, self.norm.eps, self.wkv.weight.dtype)
        entries = rope(entries, windows * m)
        spec = ctx.layout.layer(layer_key).tensor(entry_name)
        store = ctx.storage.get(layer_key, entry_name)
        store[rows_for(run.block_tables[HISTORY], windows, ctx.layout, spec)] = entries

    def _gather_slots(self, run: SeqRun, ctx: StepContext, layer_key: str, name: str, windows: torch.Tensor):
        m, w, s = self.ratio, self.width, self.series
        spec = ctx.layout.layer(layer_key).tensor(name)
        state = ctx.storage.get(layer_key, name)
        table = run.block_tables[STATE]
        own = windows[:, None] * m + torch.arange(m, device=windows.device)  # [W, m] positions of each window
        cur = state[rows_for(table, own.flatten(), ctx.layout, spec)].view(len(windows), m, 2 * s)
        if not self.overlap:
            return cur[..., :w], cur[..., s : s + w]
        # CSA: slots 0..m-1 are the previous window's Ca half, slots m..2m-1 this window's Cb half.
        prev_pos = (own - m).clamp(min=0)
        prev = state[rows_for(table, prev_pos.flatten(), ctx.layout, spec)].view(len(windows), m, 2 * s)
        first = (windows == 0).view(-1, 1, 1)
        prev_kv = prev[..., :w].masked_fill(first, 0.0)
        prev_gate = prev[..., s : s + w].masked_fill(first, float("-inf"))
        kv = torch.cat([prev_kv, cur[..., w:s]], dim=1)
        gate = torch.cat([prev_gate, cur[..., s + w :]], dim=1)
        return kv, gate

    def read_entries(self, run: SeqRun, ctx: StepContext, layer_key: str, entry_name: str) -> torch.Tensor:
        """All entries closed by the end of this run: [run.end_pos // m, width]."""
        count = run.end_pos // self.ratio
        spec = ctx.layout.layer(layer_key).tensor(entry_name)
        store = ctx.storage.get(layer_key, entry_name)
        idx = torch.arange(count, dtype=torch.long, device=ctx.positions.device)
        return store[rows_for(run.block_tables[HISTORY], idx, ctx.layout, spec)]


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

    def select(self, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
               rope) -> torch.Tensor:
        """Top-k entry indices per query ([L, k], -1 where fewer entries are visible)."""
        q = self.wq_b(q_res).view(len(x), self.n_heads, self.head_dim)
        q = rope(q, positions)
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        limits = (positions + 1) // self.compressor.ratio
        return self.ops.indexer_select(q, weights, keys, limits.to(q.device), self.topk, self.head_dim**-0.5)
