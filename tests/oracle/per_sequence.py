"""The per-sequence attention path: the oracle the batched step path is checked against.

The model runs one path (``model/attention_indexed.py``: row lists built once per step, the same kernels
for every sequence). This module is the plainer way to compute the same math, sequence by sequence with
small tensors and ``rows_for`` lookups, as the model did before the batched path existed. Tests swap it in
with ``per_sequence()`` and compare (``tests/unit/test_step_index.py``, ``tests/gpu/test_compress_emit.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch

from deepinfer.config.model import CSA, HCA, SWA
from deepinfer.kv.spec import HISTORY, STATE, WINDOW
from deepinfer.kv.storage import rows_for
from deepinfer.model.attention import Attention
from deepinfer.model.batch import SeqRun
from deepinfer.model.context import StepContext
from deepinfer.ops.ref.compressor import pool_windows
from deepinfer.ops.ref.norm import unweighted_rms_norm
from deepinfer.ops.ref.rope import apply_rope


@contextmanager
def per_sequence() -> Iterator[None]:
    """Inside: every Attention runs the per-sequence path (the model must be called with a ForwardBatch)."""
    with mock.patch.object(Attention, "forward", attention):
        yield


def attention(attn: Attention, x: torch.Tensor, ctx: StepContext, layer_key: str, ropes) -> torch.Tensor:
    """``Attention.forward``, one sequence at a time (``ctx.batch`` names the runs)."""
    cos, sin = ctx.rope[attn.table]
    q_res = attn.q_norm(attn.wq_a(x))
    q = attn.wq_b(q_res).view(len(x), attn.n_heads, attn.head_dim)
    q = apply_rope(unweighted_rms_norm(q, attn.eps), cos, sin)
    kv = apply_rope(attn.kv_norm(attn.wkv(x)), cos, sin)
    _write_window(attn, kv, ctx, layer_key)

    def rope_at(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return ropes.rotate(attn.table, t, positions)

    if attn.kind != SWA:
        write_state(attn.compressor, x, ctx, layer_key, "compressor_state")
        if attn.kind == CSA:
            write_state(attn.indexer.compressor, x, ctx, layer_key, "indexer_state")
        for run in ctx.batch.runs:
            emit(attn.compressor, run, ctx, layer_key, "compressor_state", "entries", rope_at)
            if attn.kind == CSA:
                emit(attn.indexer.compressor, run, ctx, layer_key, "indexer_state", "index_keys", rope_at)

    out = torch.empty_like(q)
    for run in ctx.batch.runs:
        sl = ctx.slice(run)
        out[sl] = _attend_run(attn, run, q[sl], x[sl], q_res[sl], ctx, layer_key, rope_at)
    out = apply_rope(out, cos, sin, inverse=True)
    return _project_out(attn, out)

def _write_window(attn: Attention, kv: torch.Tensor, ctx: StepContext, layer_key: str) -> None:
    spec = ctx.layout.layer(layer_key).tensor("window_kv")
    store = ctx.storage.get(layer_key, "window_kv")
    for run in ctx.batch.runs:
        pos = ctx.positions[ctx.slice(run)]
        store[rows_for(run.block_tables[WINDOW], pos, ctx.layout, spec)] = kv[ctx.slice(run)]

def _attend_run(attn: Attention, run: SeqRun, q, x, q_res, ctx: StepContext, layer_key: str, rope_at) -> torch.Tensor:
    dev = q.device
    qpos = torch.arange(run.first_pos, run.end_pos, dtype=torch.long, device=dev)
    kpos = torch.arange(max(0, run.first_pos - attn.window + 1), run.end_pos, dtype=torch.long, device=dev)
    spec = ctx.layout.layer(layer_key).tensor("window_kv")
    keys = ctx.storage.get(layer_key, "window_kv")[rows_for(run.block_tables[WINDOW], kpos, ctx.layout, spec)]
    visible = (kpos[None, :] <= qpos[:, None]) & (kpos[None, :] > qpos[:, None] - attn.window)
    if attn.kind != SWA:
        entries = read_entries(attn.compressor, run, ctx, layer_key, "entries")
        entry_visible = _entry_visibility(attn, run, qpos, x, q_res, ctx, layer_key, len(entries), rope_at)
        keys = torch.cat([keys, entries], dim=0)
        visible = torch.cat([visible, entry_visible], dim=1)
    return attn.ops.attention(q, keys, visible, attn.attn_sink, attn.head_dim**-0.5)

def _entry_visibility(attn: Attention, run, qpos, x, q_res, ctx, layer_key, count, rope_at) -> torch.Tensor:
    causal = torch.arange(count, device=qpos.device)[None, :] < ((qpos + 1) // attn.ratio)[:, None]
    if attn.kind == HCA or count == 0:
        return causal
    index_keys = read_entries(attn.indexer.compressor, run, ctx, layer_key, "index_keys")
    picks = select(attn.indexer, x, q_res, qpos, index_keys, rope_at)
    chosen = torch.zeros(len(qpos), count + 1, dtype=torch.bool, device=qpos.device)
    chosen.scatter_(1, torch.where(picks >= 0, picks, count), True)
    return chosen[:, :count] & causal


def _project_out(attn: Attention, out: torch.Tensor) -> torch.Tensor:
    """Grouped low-rank output: heads in G groups, each projected by its own block of wo_a, then wo_b."""
    t = len(out)
    grouped = out.reshape(t, attn.groups, -1).transpose(0, 1)  # [G, T, nh*D/G]
    y = attn.wo_a.grouped(grouped).transpose(0, 1).reshape(t, -1)
    return attn.wo_b(y)


# ---- compressor and indexer, per sequence -------------------------------------------------------
def write_state(comp, x: torch.Tensor, ctx: StepContext, layer_key: str, name: str) -> None:
    """Store each new token's kv and biased gate (fp32) at its absolute position."""
    kv = comp.wkv(x).float()
    gate = comp.wgate(x).float() + comp.ape[ctx.positions % comp.ratio]
    rows = torch.cat([kv, gate], dim=-1)
    spec = ctx.layout.layer(layer_key).tensor(name)
    state = ctx.storage.get(layer_key, name)
    for run in ctx.batch.runs:
        pos = ctx.positions[ctx.slice(run)]
        state[rows_for(run.block_tables[STATE], pos, ctx.layout, spec)] = rows[ctx.slice(run)]

def emit(comp, run: SeqRun, ctx: StepContext, layer_key: str, state_name: str, entry_name: str, rope) -> None:
    """Pool every window that closes inside this run and write its entry (rotated at the window start)."""
    m = comp.ratio
    windows = torch.arange(run.first_pos // m, run.end_pos // m, dtype=torch.long, device=ctx.positions.device)
    if windows.numel() == 0:
        return
    kv, gate = _gather_slots(comp, run, ctx, layer_key, state_name, windows)
    entries = pool_windows(kv, gate, comp.norm.weight, comp.norm.eps, comp.wkv.weight.dtype)
    entries = rope(entries, windows * m)
    spec = ctx.layout.layer(layer_key).tensor(entry_name)
    store = ctx.storage.get(layer_key, entry_name)
    store[rows_for(run.block_tables[HISTORY], windows, ctx.layout, spec)] = entries

def _gather_slots(comp, run: SeqRun, ctx: StepContext, layer_key: str, name: str, windows: torch.Tensor):
    m, w, s = comp.ratio, comp.width, comp.series
    spec = ctx.layout.layer(layer_key).tensor(name)
    state = ctx.storage.get(layer_key, name)
    table = run.block_tables[STATE]
    own = windows[:, None] * m + torch.arange(m, device=windows.device)  # [W, m] positions of each window
    cur = state[rows_for(table, own.flatten(), ctx.layout, spec)].view(len(windows), m, 2 * s)
    if not comp.overlap:
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

def read_entries(comp, run: SeqRun, ctx: StepContext, layer_key: str, entry_name: str) -> torch.Tensor:
    """All entries closed by the end of this run: [run.end_pos // m, width]."""
    count = run.end_pos // comp.ratio
    spec = ctx.layout.layer(layer_key).tensor(entry_name)
    store = ctx.storage.get(layer_key, entry_name)
    idx = torch.arange(count, dtype=torch.long, device=ctx.positions.device)
    return store[rows_for(run.block_tables[HISTORY], idx, ctx.layout, spec)]


def select(ix, x: torch.Tensor, q_res: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor,
           rope) -> torch.Tensor:
    """Top-k entry indices per query ([L, k], -1 where fewer entries are visible)."""
    q = ix.wq_b(q_res).view(len(x), ix.n_heads, ix.head_dim)
    q = rope(q, positions)
    weights = ix.weights_proj(x).float() * ix.n_heads**-0.5
    limits = (positions + 1) // ix.compressor.ratio
    return ix.ops.indexer_select(q, weights, keys, limits.to(q.device), ix.topk, ix.head_dim**-0.5)
