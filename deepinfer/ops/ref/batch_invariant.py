"""The batch-invariant reference ops (``DEEPINFER_BATCH_INVARIANT=1`` on the CPU): each result row is a
function of that row's inputs alone, not of the batch it runs in, the rows next to it, or how many keys
the longest sequence of the step has.

The plain reference ops are correct but not batch-invariant on a CPU: a BLAS blocks, packs and threads by
the whole problem, and a reduction's vectorised order depends on the row length. The rules used here, each
asserted where it is applied:

  1. GEMMs run in tiles of ``ROW_TILE`` rows, the last one zero-padded (``ops/ref/row_tiles.py``): every
     dense / side / router / mHC / expert / LM-head product.
  2. Reductions over a query's keys (attention) or over a sequence's compressed entries (indexer) run in
     chunks of ``KEY_CHUNK`` columns, one fixed-shape product per chunk, and the chunks are summed in
     ascending order. The number of columns grows with the step's longest sequence (``StepIndex.span``) and
     with the indexer's pick width; with fixed chunks, columns past a query's last key only add exact
     zeros at the end, so the step's shape no longer reaches a row's bits.
  3. Sums over a short fixed axis (mHC streams, compressor window slots, indexer heads) run as explicit
     element-wise adds in index order, never as a library reduction whose order may follow the shapes.
  4. A one-row reduction stays within ``MAX_ROW_REDUCTION`` elements: above torch's parallel grain a
     single row is split across threads (two passes) while the same row in a batch is reduced in one.
  5. Element-wise transcendental functions (SiLU, sigmoid, softplus, exp, cos/sin) of batch-sized tensors run
     on whole vector blocks (``row_tiles.whole_lanes``): torch computes a buffer's last partial block with
     scalar code that rounds differently, so an element's bits followed where the batch ended.
  6. Selections are ordered: indexer and router top-k break ties by the lower index (stable sorts, as in
     the plain reference), the MoE combine adds a token's experts in a fixed order, and log-softmax is
     one row per program (row-local already; tested).

Everything else of ``REF`` (RoPE, the attention block's row-local norms, the row lists, cache writes) is
exact element-wise arithmetic or row-local and is used as it is. Results equal ``REF`` within rounding, not
bit for bit (different summation orders); the tests compare them with tolerances and compare this table with
itself bitwise across batches.
"""

from __future__ import annotations

from functools import partial

import torch

from deepinfer.ops.ref import compress_emit as ref_emit
from deepinfer.ops.ref import mhc as ref_mhc
from deepinfer.ops.ref import moe as ref_route
from deepinfer.ops.ref import moe_experts as ref_moe
from deepinfer.ops.ref import norm as ref_norm
from deepinfer.ops.ref import swiglu as ref_swiglu
from deepinfer.ops.ref.fp8_linear import dequant_weight
from deepinfer.ops.ref.indexer_topk import indexer_topk_with
from deepinfer.ops.ref.row_tiles import ROW_TILE, tiled_grouped, tiled_linear, tiled_matmul, whole_lanes
from deepinfer.ops.ref.sparse_attention import gather_keys

__all__ = ["ROW_TILE", "KEY_CHUNK", "MAX_ROW_REDUCTION", "linear", "dense", "dense_grouped", "pointwise", "swiglu",
           "moe_route", "fp8_linear", "fp8_linear_grouped", "moe_experts_fp4", "sparse_attention_indexed",
           "indexer_topk", "attention",
           "indexer_select", "hc_pre", "hc_post", "hc_head", "rms_norm", "compress_emit"]

KEY_CHUNK = 64  # columns per attention / indexer reduction chunk (rule 2)
MAX_ROW_REDUCTION = 32768  # torch's intra-op grain (at::internal::GRAIN_SIZE): rule 4's bound

linear = tiled_linear
dense = tiled_linear
dense_grouped = tiled_grouped
pointwise = whole_lanes
swiglu = partial(ref_swiglu.swiglu, pointwise=whole_lanes)
moe_route = partial(ref_route.route, pointwise=whole_lanes)


def _exp(x: torch.Tensor) -> torch.Tensor:
    return whole_lanes(torch.exp, x)


def _ordered_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` as element-wise adds in index order (rule 3)."""
    parts = x.unbind(dim)
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


def _check_row_reduction(n: int, what: str) -> None:
    assert n <= MAX_ROW_REDUCTION, (
        f"{what}: a {n}-element row reduction is split across threads when it runs alone; the batch-invariant "
        f"ops keep single-row reductions within {MAX_ROW_REDUCTION} elements")


def _chunked(t: torch.Tensor, fill) -> torch.Tensor:
    """Pad dim 1 of t [L, N, ...] with ``fill`` to whole KEY_CHUNKs and split it: [L, N / C, C, ...]."""
    n = t.shape[1]
    pad = -n % KEY_CHUNK
    if pad:
        t = torch.cat([t, t.new_full((t.shape[0], pad, *t.shape[2:]), fill)], dim=1)
    out = t.view(t.shape[0], -1, KEY_CHUNK, *t.shape[2:])
    assert out.shape[2] == KEY_CHUNK, f"reduction chunks must hold {KEY_CHUNK} columns, got {tuple(out.shape)}"
    return out


# ---- GEMMs (rule 1) -------------------------------------------------------------------------------------

def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] = (128, 128), pow2_scales: bool = False) -> torch.Tensor:
    """``ops/ref/fp8_linear.fp8_linear`` in fixed row tiles."""
    w = dequant_weight(weight, scale, block)
    return tiled_matmul(x.float(), w.t()).to(x.dtype)


def fp8_linear_grouped(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int,
                       pow2_scales: bool = False) -> torch.Tensor:
    """``ops/ref/fp8_linear.fp8_linear_grouped`` with each group in fixed row tiles."""
    w = dequant_weight(weight, scale)
    xg = x.float().view(x.shape[0], groups, -1).transpose(0, 1)  # [G, M, K]
    return tiled_grouped(xg, w).transpose(0, 1).reshape(x.shape[0], -1).to(x.dtype)


def moe_experts_fp4(x, topk_ids, topk_weights, w13, s13, w2, s2, limit, *, out=None, add=None, before_add=None):
    """``ops/ref/moe_experts.moe_experts_fp4`` with every expert's rows in fixed row tiles: a token's result no
    longer depends on how many other tokens its experts received (the combine is in slot order there)."""
    return ref_moe.moe_experts_fp4(x, topk_ids, topk_weights, w13, s13, w2, s2, limit, out=out, add=add,
                                   before_add=before_add, matmul=tiled_matmul, pointwise=whole_lanes)


# ---- attention and indexer (rule 2) ---------------------------------------------------------------------

def sparse_attention_indexed(q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor,
                             scale: float, kv_extra: torch.Tensor | None = None,
                             indices_extra: torch.Tensor | None = None, *,
                             out: torch.Tensor | None = None) -> torch.Tensor:
    """``ops/ref/sparse_attention.sparse_attention_indexed`` with the key reductions in fixed chunks.

    The softmax max is order-free; the denominator starts from the sink and adds each chunk's sum in chunk
    order; P·V is one [H, C] x [C, D] product per chunk (probabilities rounded to the activation dtype as in
    the reference), accumulated over chunks in order in fp32 and rounded once."""
    keys, valid = gather_keys(kv, indices, kv_extra, indices_extra)  # [L, N, D], [L, N]
    keys = keys.to(q.dtype)
    kc, vc = _chunked(keys, 0), _chunked(valid, False)  # [L, nc, C, D], [L, nc, C]
    logits = torch.matmul(q.unsqueeze(1), kc.transpose(-1, -2)) * scale  # [L, nc, H, C], activation dtype
    logits = logits.float().masked_fill(~vc.unsqueeze(2), float("-inf"))
    sink = sinks.float().view(1, -1)  # [1, H]
    top = torch.maximum(logits.amax(dim=-1).amax(dim=1), sink)  # [L, H]
    e = _exp(logits - top[:, None, :, None])
    den = _exp(sink - top)
    for c in range(e.shape[1]):
        den = den + e[:, c].sum(dim=-1)
    probs = (e / den[:, None, :, None]).to(keys.dtype)
    parts = torch.matmul(probs.float(), kc.float())  # [L, nc, H, D]
    result = _ordered_sum(parts, 1).to(q.dtype)
    return result if out is None else out.copy_(result)


def _indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, rows: torch.Tensor,
                    softmax_scale: float) -> torch.Tensor:
    """``ops/ref/indexer_topk.indexer_scores_indexed`` in fixed entry chunks, heads summed in order."""
    e = rows.shape[1]
    rc = _chunked(rows.long(), -1)  # [L, nc, C]
    gathered = keys[rc.clamp(min=0)].float()  # [L, nc, C, Di]
    s = torch.matmul(q.float().unsqueeze(1), gathered.transpose(-1, -2))  # [L, nc, Hi, C]
    s = torch.relu(s) * softmax_scale
    s = _ordered_sum(s * weights.float()[:, None, :, None], 2)  # [L, nc, C]
    s = s.reshape(len(q), -1)[:, :e]
    return s.masked_fill(rows < 0, float("-inf"))


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_rows: torch.Tensor,
                 limits: torch.Tensor, topk: int, softmax_scale: float,
                 query_rows: torch.Tensor | None = None, as_rows: bool = False,
                 weight_scale: float = 1.0) -> torch.Tensor:
    """``ops/ref/indexer_topk.indexer_topk`` (same contract) over the chunked scores."""
    return indexer_topk_with(_indexer_scores, q, weights, keys, key_rows, limits, topk, softmax_scale,
                             query_rows, as_rows, weight_scale)


def attention(q, keys, visible, sinks, scale):
    """The table's ``attention`` entry (one key set shared by the queries) through the chunked kernel."""
    n = keys.shape[0]
    cols = torch.arange(n, device=keys.device, dtype=torch.int32).expand(len(q), n)
    indices = torch.where(visible, cols, torch.full_like(cols, -1))
    return sparse_attention_indexed(q, keys.to(q.dtype), indices, sinks.float(), scale)


def indexer_select(q, weights, keys, limits, topk, scale):
    """The table's ``indexer_select`` entry (one sequence's keys) through the chunked scores."""
    e = keys.shape[0]
    rows = torch.arange(e, device=keys.device, dtype=torch.int64).expand(len(q), e)
    return indexer_topk(q, weights, keys, rows, limits, topk, scale)


# ---- mHC, norms, compressor (rules 1, 3, 4) -------------------------------------------------------------

def _unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    _check_row_reduction(x.shape[-1], "mHC RMSNorm")
    return ref_norm.unweighted_rms_norm(x, eps)


def hc_pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps):
    return ref_mhc.hc_pre(streams, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps, linear=tiled_linear,
                          axis_sum=_ordered_sum, norm=_unweighted_rms_norm, pointwise=whole_lanes)


def hc_head(streams, fn, base, scale, hc_eps, norm_eps):
    return ref_mhc.hc_head(streams, fn, base, scale, hc_eps, norm_eps, linear=tiled_linear,
                           axis_sum=_ordered_sum, norm=_unweighted_rms_norm, pointwise=whole_lanes)


def hc_post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``ops/ref/mhc.hc_post`` with the stream mix as ordered adds: new_k = post_k * out + sum_j comb[j, k] * s_j."""
    dtype = streams.dtype
    c = comb.to(dtype)
    mixed = _ordered_sum(c.unsqueeze(-1) * streams.unsqueeze(2), 1)  # sum over j of comb[:, j, k] * s_j
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    _check_row_reduction(x.shape[-1], "RMSNorm")
    return ref_norm.rms_norm(x, weight, eps)


def pool_windows(kv: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                 dtype: torch.dtype) -> torch.Tensor:
    """``ops/ref/compressor.pool_windows`` with the softmax denominator and the pooled sum over the window's
    slots as ordered adds."""
    g = gate.float()
    e = _exp(g - g.amax(dim=1, keepdim=True))
    weights = (e / _ordered_sum(e, 1).unsqueeze(1)).to(dtype)
    pooled = _ordered_sum(kv.to(dtype) * weights, 1)
    return rms_norm(pooled, norm_weight, eps)


compress_emit = partial(ref_emit.compress_emit, pool=pool_windows)
