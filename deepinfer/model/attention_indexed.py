"""Attention over a whole step: one set of kernels per layer for every sequence of the step.

The cache is read and written through the step's row lists (``model/step_index.py``), so a layer costs a
fixed number of launches whatever the batch, nothing syncs with the host, and a decode step can be captured
as a CUDA graph. The model's only attention path (``Attention.forward``): the reference ops on the CPU,
the Triton kernels on the GPU; tests compare it with the per-sequence oracle (``tests/oracle/per_sequence.py``).
"""

from __future__ import annotations

import torch

from deepinfer.config.model import CSA, HCA, SWA
from deepinfer.model.context import StepContext
from deepinfer.model.step_index import CompressIndex


def attention_indexed(attn, x: torch.Tensor, ctx: StepContext, layer_key: str) -> torch.Tensor:
    idx, ops, storage = ctx.index, attn.ops, ctx.storage
    cos, sin = ctx.rope[attn.table]
    if attn.kind != SWA:
        key = (attn.ratio, attn.kind == CSA)
        ci = idx.compress[key]
        emit_cos, emit_sin = ctx.emit_rope[key]
        # The compressors read only x: their chain runs beside the query/window chain below
        # (model/branches.py; inline on the CPU), joined before the indexer and the attention read it.
        with attn.branches.side():
            # One GEMM for every bf16 projection of x (compressor kv|gate, indexer compressor kv|gate,
            # indexer head weights): model/fused.py.
            side, cols = attn.side_proj(x), attn.side_proj.cols
            _compress(attn.compressor, side, cols["kv"], ctx, layer_key, "compressor_state", "entries", ci,
                      emit_cos, emit_sin, ops)
            if attn.kind == CSA:
                _compress(attn.indexer.compressor, side, cols["ix_kv"], ctx, layer_key, "indexer_state",
                          "index_keys", ci, emit_cos, emit_sin, ops)
    # Stacked projections (model/fused.py): x -> [q latent | kv], q latent -> [q heads | indexer q heads].
    xq = attn.x_proj(x)
    # The q latent's RMSNorm, and the kv row's norm + RoPE straight into the window cache: one launch on the
    # GPU (ops/ref/rope_norm.py); likewise the heads' norm + RoPE with the indexer heads' RoPE below.
    window = storage.get(layer_key, "window_kv")
    q_res = ops.latent_norms(xq, attn.x_proj.cols["kv"], attn.q_norm.weight, attn.q_norm.eps, attn.kv_norm.weight,
                             attn.kv_norm.eps, cos, sin, window=window, rows=idx.window_rows)
    q_all = attn.q_proj(q_res)
    q = q_all[:, : attn.n_heads * attn.head_dim].view(len(x), attn.n_heads, attn.head_dim)
    if attn.kind == CSA:  # may write q and q_ix in place
        ix = attn.indexer
        q_ix = q_all[:, attn.q_proj.cols["ix_q"] :].view(len(x), ix.n_heads, ix.head_dim)
        q, q_ix = ops.heads_norm_rope(q, cos, sin, attn.eps, q_ix)
    else:
        q = ops.norm_rope_heads(q, cos, sin, attn.eps)

    extra_kv = extra_idx = None
    if attn.kind != SWA:
        attn.branches.join()
        extra_kv = storage.get(layer_key, "entries")
        if attn.kind == HCA:  # every visible entry, entry j in column j (fixed split boundaries)
            extra_idx = ci.visible_rows
        else:
            weights = side[:, cols["ix_w"] : cols["ix_w"] + ix.n_heads]
            # Entries and index keys share the history pool's row numbering: the picks come back as rows.
            extra_idx = _indexer_rows(ix, weights, q_ix, ctx, layer_key, ci)
    out = ops.sparse_attention_indexed(q, window, idx.window_keys, attn.attn_sink, attn.head_dim**-0.5,
                                       extra_kv, extra_idx)
    out = ops.rope(out, cos, sin, inverse=True)  # rope channels only, in place on the GPU
    # Grouped low-rank output on the flat [T, H*D] layout: one launch for all groups, no transposes.
    return attn.wo_b(attn.wo_a.grouped_flat(out.reshape(len(x), -1), attn.groups))


def _compress(comp, side: torch.Tensor, col: int, ctx: StepContext, layer_key: str, state_name: str,
              entry_name: str, ci: CompressIndex, cos: torch.Tensor, sin: torch.Tensor, ops) -> None:
    """Write every token's raw kv/gate rows, then pool each window a token closes into its entry."""
    state = ctx.storage.get(layer_key, state_name)
    ops.compress_state(side, col, state, ctx.index.state_rows, comp.ape, ctx.positions)
    ops.compress_emit(state, ci.slot_rows, ci.entry_rows, ctx.storage.get(layer_key, entry_name),
                      comp.norm.weight, comp.norm.eps, cos, sin, comp.overlap)


def _indexer_rows(ix, weights: torch.Tensor, q: torch.Tensor, ctx: StepContext, layer_key: str,
                  ci: CompressIndex) -> torch.Tensor:
    """History rows of each query's top-k entries ([T, k], -1 where fewer are visible); see ``Indexer.select``.
    ``q``: the indexer's query heads (ix.wq_b of the query latent, RoPE applied), [T, Hi, Di]."""
    keys = ctx.storage.get(layer_key, "index_keys")
    # The head weights' fp32 upcast and 1/sqrt(Hi) happen inside the op (Indexer.select's weights).
    return ix.ops.indexer_topk(q, weights, keys, ci.seq_rows, ci.limits, ix.topk, ix.head_dim**-0.5,
                               ctx.index.token_seq, as_rows=True, weight_scale=ix.n_heads**-0.5)
