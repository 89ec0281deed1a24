"""The op table: which implementation of each hot op the model calls, chosen once at start-up.

``REF`` is the plain-PyTorch specification (the CPU path; it never imports Triton). ``triton_ops()`` returns
the Triton kernels, imported lazily so that only a CUDA process loads Triton. Entries share signatures:

  attention(q [L,H,D], keys [N,D], visible [L,N] bool, sinks [H], scale) -> [L,H,D]
  indexer_select(q [L,Hi,Di], weights [L,Hi] fp32, keys [E,Di], limits [L], topk, scale) -> [L,k] int64
  fp8_linear(x [M,K], weight e4m3 [N,K], scale fp32 [N/128,K/128]) -> [M,N]
  fp8_linear_grouped(x [M,G*K], weight [G*r,K], scale, G) -> [M,G*r] (block-diagonal, one launch)
  fp8_linear_b32(x [M,K], weight e4m3 [N,K], scale fp32 [N/32,K/32], pow2_scales) -> [M,N] (V4.1's dense)
  moe_experts_fp4(x, topk_ids, topk_weights, w13, s13, w2, s2, limit, out=None, add=None) -> [T,H]
  linear(x [M,K], weight [N,K]) -> [M,N]   (bf16 side projections and the MoE router)
  dense(x [...,K], weight [N,K]) -> [...,N]   (every other ``model/linear.Linear``: LM head, MTP projections,
      the CPU's dequantized weights; F.linear in REF and the Triton table)
  dense_grouped(x [G,T,in], weight [G*r,in]) -> [G,T,r]   (``Linear.grouped``, block-diagonal)
  pointwise(fn, x) -> fn(x)   (how the model applies SiLU / cos / sin outside the entries above)

The index-list entries serve the batched step path (``model/attention_indexed.py``), which reads the paged
cache through per-step row lists instead of gathered per-sequence tensors:

  sparse_attention_indexed(q, kv, indices, sinks, scale, kv_extra, indices_extra) -> [L,H,D]
  indexer_topk(q, weights, keys, key_rows, limits, topk, scale, query_rows, as_rows, weight_scale) -> [L,k] int64
  compress_state(proj, col, state, rows, ape, positions) -> None (writes state rows)
  compress_emit(state, slot_rows, entry_rows, out, norm_weight, eps, cos, sin, overlap) -> None (writes out)

and the mHC sites of every block: hc_pre / hc_post / hc_head (``ops/ref/mhc.py`` signatures).

RMSNorm and RoPE of the attention block (``ops/ref/rope_norm.py``; norm_rope_heads and rope may write in place):

  rms_norm(x [...,C], weight [C], eps) -> [...,C]   (every RMSNorm module)
  norm_rope_heads(q [T,H,D], cos [T,R/2], sin [T,R/2], eps) -> [T,H,D]
  norm_rope(x [T,D], weight [D], eps, cos, sin, *, out=None, rows=None) -> [T,D] (rows: out[rows[t]] = row t)
  rope(x [T,...,D], cos, sin, inverse=False) -> [T,...,D]
  latent_norms(xq [T,C+D], C, q_weight, q_eps, kv_weight, kv_eps, cos, sin, *, window, rows) -> [T,C]
  heads_norm_rope(q [T,H,D], cos, sin, eps, q_ix [T,Hi,Di]) -> (q, q_ix)   (pairs of the above, one launch)

MoE routing after the gate GEMM (``ops/ref/moe.py``; weights in the logits dtype):

  moe_route(logits [T,E], scoring_func, top_k, norm_topk_prob, routed_scaling_factor, bias, hash_indices)
      -> (weights [T,k], indices [T,k] int64)
  swiglu(gate_up [T,2I], limit) -> [T,I]   (the shared expert's clamped activation)

A step's cache row lists from its index tensors, once per step (``ops/ref/step_rows.py``):

  step_rows(token_seq, positions, window_table, state_table, history_table, seq_end, span, block_size,
            window, kinds, spare_window, spare_state) -> (window_rows, state_rows, window_keys, [KindRows])

``REF_BATCH_INVARIANT`` (``DEEPINFER_BATCH_INVARIANT=1`` on the CPU, ``ops/ref/batch_invariant.py``) is REF
with every entry whose result row could depend on the batch replaced by a twin that computes each row the
same way whatever the batch and the step's shape (fixed GEMM row tiles, fixed key/entry chunks, ordered sums).
On CUDA the same switch builds ``triton_ops`` with ``KernelTuning.invariant()`` (K segments fixed by the
weight's shape, one kernel per op for every M, attention split at fixed columns and folded in order).

Structured outputs' grammar masks, in place before the draw (``ops/ref/token_mask.py``):

  token_mask(logits [B,V], words [R,ceil(V/32)] int32, rows [R]) -> None (-inf where row rows[r]'s bit is clear)

Weight layout, applied once when the model is prepared (not per call):

  fp8_k_order: "checkpoint" or "kernel" (a field): how FP8 dense weights' K columns are stored, which every FP8
      entry of the table reads (``ops/fp8_layout.arrange``; "kernel" in the batch-invariant Triton table: each
      128-column block in the swap-AB kernel's register order, so that kernel sums K in natural order)
  fp4_expert_layout(codes int8 [E,N,K/2], scales [E,N,K/32]) -> (codes, scales) in the layout
      moe_experts_fp4 reads (the same tensors for ``REF``; for Triton, tile-major with each 32-bit word's
      bits pre-placed for decoding, int32 words: ``ops/triton/fp4_codes.expert_layout``)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from deepinfer.ops.ref import batch_invariant as ref_bi
from deepinfer.ops.ref import cache_rows_v41 as ref_cache_rows
from deepinfer.ops.ref import compress_emit as ref_emit
from deepinfer.ops.ref import compress_pool_v41 as ref_pool_v41
from deepinfer.ops.ref import compress_state as ref_state
from deepinfer.ops.ref import engram_v41 as ref_engram
from deepinfer.ops.ref import fp8_linear as ref_fp8
from deepinfer.ops.ref import index_select_v41 as ref_index_v41
from deepinfer.ops.ref import indexer_topk as ref_index
from deepinfer.ops.ref import key_lists as ref_key_lists
from deepinfer.ops.ref import linear as ref_linear
from deepinfer.ops.ref import mhc as ref_mhc
from deepinfer.ops.ref import mhc_v41 as ref_mhc_v41
from deepinfer.ops.ref import moe as ref_route
from deepinfer.ops.ref import moe_experts as ref_moe
from deepinfer.ops.ref import pointwise as ref_pointwise
from deepinfer.ops.ref import rope_norm as ref_rn
from deepinfer.ops.ref import rope_v41 as ref_rope_v41
from deepinfer.ops.ref import sparse_attention as ref_attn
from deepinfer.ops.ref import step_rows as ref_rows
from deepinfer.ops.ref import swiglu as ref_swiglu
from deepinfer.ops.ref import token_mask as ref_mask
from deepinfer.ops.ref.attention import sparse_attention
from deepinfer.ops.ref.indexer import indexer_scores, topk_with_tiebreak
from deepinfer.ops.tuning import KernelTuning


@dataclass(frozen=True, slots=True)
class OpTable:
    name: str
    attention: Callable
    indexer_select: Callable
    fp8_linear: Callable
    fp8_linear_grouped: Callable
    moe_experts_fp4: Callable
    sparse_attention_indexed: Callable
    indexer_topk: Callable
    compress_emit: Callable
    compress_state: Callable
    hc_pre: Callable
    hc_post: Callable
    hc_head: Callable
    rms_norm: Callable
    norm_rope_heads: Callable
    norm_rope: Callable
    rope: Callable
    latent_norms: Callable
    heads_norm_rope: Callable
    moe_route: Callable
    swiglu: Callable
    fp4_expert_layout: Callable
    step_rows: Callable
    linear: Callable
    # The kernels' per-device choices (tiles, splits; ops/tuning.py) bound into the entries above; None for REF.
    tuning: KernelTuning | None = None
    dense: Callable = ref_linear.dense
    dense_grouped: Callable = ref_linear.dense_grouped
    pointwise: Callable = ref_pointwise.direct
    token_mask: Callable = ref_mask.token_mask
    # FP8 linear with 32x32-block scales (DeepSeek-V4.1's dense weights): x, weight, scale, pow2_scales -> y.
    fp8_linear_b32: Callable = partial(ref_fp8.fp8_linear, block=(32, 32))
    # ... block-diagonal (V4.1's wo_a): x [G, M, K], weight [G*r, K], scale, pow2_scales -> [G, M, r].
    fp8_linear_b32_grouped: Callable = ref_fp8.fp8_linear_b32_grouped
    # DeepSeek-V4.1's mHC coefficients from a site's logits: logits [T,(2+N)N] fp32, N, iters, eps -> (pre, post,
    # comb) fp32 (ops/ref/mhc_v41.py).
    v41_mix_finish: Callable = ref_mhc_v41.mix_finish
    # ... and the logits before it: streams [T,N,H], fn, base, scale, norm_eps -> [T,(2+N)N] fp32.
    v41_mix_logits: Callable = ref_mhc_v41.mix_logits
    # ... a site's collapse (streams [T,N,H], pre [T,N] -> [T,H]) and expansion (out, streams, post, comb ->
    # [T,N,H]), fp32 inside.
    v41_collapse: Callable = ref_mhc_v41.collapse
    v41_expand: Callable = ref_mhc_v41.expand
    # DeepSeek-V4.1's RoPE from fp32 angles: values [T, (heads,) C], ang [T, R/2], inverse -> a new tensor
    # (ops/ref/rope_v41.py).
    v41_rope: Callable = ref_rope_v41.apply_rope
    # DeepSeek-V4.1's attention core over key lists: q, sink, window, window_ids[, entries, entry_ids] -> out
    # (ops/ref/key_lists.py).
    v41_attend_lists: Callable = ref_key_lists.attend_lists
    # DeepSeek-V4.1's packed cache rows: store (table, where, values, fmt), load (table, where, fmt, channels,
    # dtype) -> values (ops/ref/cache_rows_v41.py).
    v41_store_packed: Callable = ref_cache_rows.store_packed
    # DeepSeek-V4.1's expert activation: gate, up, limit -> silu(clamped gate) * clamped up, fp32 inside.
    v41_swiglu: Callable = ref_swiglu.swiglu_v41
    # DeepSeek-V4.1's cache roundings kept in the forward: values, fmt (fp8 / mxfp4 / nvfp4) -> the rounded values.
    v41_qdq: Callable = ref_cache_rows.qdq
    v41_load_packed: Callable = ref_cache_rows.load_packed
    # DeepSeek-V4.1's ratio-r compressor pooling: state [S, 2D] fp32, rows [E, r], dtype -> [E, D] (the values
    # of each entry's r state rows weighted by the softmax of their scores, fp32 inside; ops/ref/compress_pool_v41.py).
    v41_compress_pool: Callable = ref_pool_v41.pool
    # DeepSeek-V4.1's indexer choice over a step's key lists: q, w, keys, base, visible, width, topk, parts (-> the
    # reference's walk over the rows), candidates, publish -> (rows [T, k], candidate mask)
    # (ops/ref/index_select_v41.py).
    v41_index_select: Callable = ref_index_v41.select_entries
    # DeepSeek-V4.1's Engram lookup (ops/ref/engram_v41.py): the n-gram hash, lookback, token_map, pad_id,
    # multipliers, primes, offsets, heads -> table rows [Q, layers, hash heads] int64; and the gather of those
    # rows from the table's FP8 codes, codes, scales (UE8M0 bytes), rows [..., K], dtype -> [..., K*C].
    v41_engram_hash: Callable = ref_engram.hash_rows
    v41_engram_gather: Callable = ref_engram.gather_rows
    # Every entry computes a row the same way whatever the batch and the step's shape (README: modes).
    batch_invariant: bool = False
    # How the FP8 entries read dense weights' K columns (``ops/fp8_layout.py``): the model stores them so.
    fp8_k_order: str = "checkpoint"


def _checkpoint_layout(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return codes, scales


def _ref_indexer_select(q, weights, keys, limits, topk, scale):
    return topk_with_tiebreak(indexer_scores(q, weights, keys, scale), limits, topk)


REF = OpTable("ref", sparse_attention, _ref_indexer_select, ref_fp8.fp8_linear, ref_fp8.fp8_linear_grouped,
              ref_moe.moe_experts_fp4,
              ref_attn.sparse_attention_indexed, ref_index.indexer_topk, ref_emit.compress_emit,
              ref_state.compress_state, ref_mhc.hc_pre, ref_mhc.hc_post, ref_mhc.hc_head,
              rms_norm=ref_rn.rms_norm, norm_rope_heads=ref_rn.norm_rope_heads, norm_rope=ref_rn.norm_rope,
              rope=ref_rn.rope, latent_norms=ref_rn.latent_norms, heads_norm_rope=ref_rn.heads_norm_rope,
              moe_route=ref_route.route, swiglu=ref_swiglu.swiglu,
              fp4_expert_layout=_checkpoint_layout, step_rows=ref_rows.step_rows,
              linear=ref_linear.linear)


# Entries not replaced are exact element-wise arithmetic or row-local (RoPE, the attention-block norms, the
# row lists, cache writes): REF's own.
REF_BATCH_INVARIANT = dataclasses.replace(
    REF, name="ref-batch-invariant", attention=ref_bi.attention, indexer_select=ref_bi.indexer_select,
    fp8_linear=ref_bi.fp8_linear, fp8_linear_grouped=ref_bi.fp8_linear_grouped,
    moe_experts_fp4=ref_bi.moe_experts_fp4, sparse_attention_indexed=ref_bi.sparse_attention_indexed,
    indexer_topk=ref_bi.indexer_topk, compress_emit=ref_bi.compress_emit, hc_pre=ref_bi.hc_pre,
    hc_post=ref_bi.hc_post, hc_head=ref_bi.hc_head, rms_norm=ref_bi.rms_norm, linear=ref_bi.linear,
    dense=ref_bi.dense, dense_grouped=ref_bi.dense_grouped, pointwise=ref_bi.pointwise,
    moe_route=ref_bi.moe_route, swiglu=ref_bi.swiglu, batch_invariant=True)


def triton_ops(tuning: KernelTuning | None = None) -> OpTable:
    """The Triton table with ``tuning`` bound into its kernels (default: the measured choices with this
    process's current CUDA device's SM count)."""
    from deepinfer.ops.triton import cache_rows_v41 as tri_cache_rows
    from deepinfer.ops.triton import compress_emit as tri_emit
    from deepinfer.ops.triton import compress_pool_v41 as tri_pool_v41
    from deepinfer.ops.triton import compress_state as tri_state
    from deepinfer.ops.triton import engram_v41 as tri_engram
    from deepinfer.ops.triton import fp4_codes as tri_fp4
    from deepinfer.ops.triton import fp8_linear as tri_fp8
    from deepinfer.ops.triton import fp8_linear_b32 as tri_fp8_b32
    from deepinfer.ops.triton import index_select_v41 as tri_index_v41
    from deepinfer.ops.triton import indexer_topk as tri_index
    from deepinfer.ops.triton import key_lists as tri_lists
    from deepinfer.ops.triton import linear as tri_linear
    from deepinfer.ops.triton import mhc as tri_mhc
    from deepinfer.ops.triton import mhc_v41 as tri_mhc_v41
    from deepinfer.ops.triton import moe_experts as tri_moe
    from deepinfer.ops.triton import moe_route as tri_route
    from deepinfer.ops.triton import rope_norm as tri_rn
    from deepinfer.ops.triton import rope_v41 as tri_rope_v41
    from deepinfer.ops.triton import sparse_attention as tri_attn
    from deepinfer.ops.triton import step_rows as tri_rows
    from deepinfer.ops.triton import swiglu as tri_swiglu
    from deepinfer.ops.triton import token_mask as tri_mask

    tuning = tuning or KernelTuning.for_device()

    def attention(q, keys, visible, sinks, scale):
        # The kernel reads keys through index lists (-1 = not visible); here the keys are already gathered.
        n = keys.shape[0]
        cols = torch.arange(n, device=keys.device, dtype=torch.int32).expand(len(q), n)
        indices = torch.where(visible, cols, torch.full_like(cols, -1))
        return tri_attn.sparse_attention_indexed(q, keys.to(q.dtype), indices, sinks.float(), scale, tuning=tuning)

    def indexer_select(q, weights, keys, limits, topk, scale):
        e = keys.shape[0]
        rows = torch.arange(e, device=keys.device, dtype=torch.int32).expand(len(q), e).contiguous()
        return tri_index.indexer_topk(q, weights.float(), keys, rows, limits, topk, scale)

    table = OpTable("triton", attention, indexer_select, partial(tri_fp8.fp8_linear, tuning=tuning),
                   partial(tri_fp8.fp8_linear_grouped, tuning=tuning), tri_moe.moe_experts_fp4,
                   partial(tri_attn.sparse_attention_indexed, tuning=tuning), tri_index.indexer_topk,
                   tri_emit.compress_emit, tri_state.compress_state, partial(tri_mhc.hc_pre, tuning=tuning),
                   tri_mhc.hc_post, tri_mhc.hc_head,
                   rms_norm=tri_rn.rms_norm, norm_rope_heads=tri_rn.norm_rope_heads, norm_rope=tri_rn.norm_rope,
                   rope=tri_rn.rope, latent_norms=tri_rn.latent_norms, heads_norm_rope=tri_rn.heads_norm_rope,
                   moe_route=tri_route.moe_route, swiglu=tri_swiglu.swiglu,
                   fp4_expert_layout=tri_fp4.expert_layout, step_rows=tri_rows.step_rows,
                   linear=partial(tri_linear.linear, tuning=tuning), tuning=tuning, token_mask=tri_mask.token_mask,
                   fp8_linear_b32=tri_fp8_b32.fp8_linear_b32,
                   fp8_linear_b32_grouped=tri_fp8_b32.fp8_linear_b32_grouped, v41_mix_finish=tri_mhc_v41.mix_finish,
                   v41_collapse=tri_mhc_v41.collapse, v41_expand=tri_mhc_v41.expand,
                   v41_mix_logits=tri_mhc_v41.mix_logits,
                   v41_store_packed=tri_cache_rows.store_packed, v41_load_packed=tri_cache_rows.load_packed,
                   v41_swiglu=tri_swiglu.swiglu_v41, v41_qdq=tri_cache_rows.qdq,
                   v41_engram_hash=tri_engram.hash_rows, v41_engram_gather=tri_engram.gather_rows,
                   v41_rope=tri_rope_v41.apply_rope, v41_attend_lists=partial(tri_lists.attend_lists, tuning=tuning),
                   v41_compress_pool=tri_pool_v41.pool, v41_index_select=tri_index_v41.select_entries,
                   fp8_k_order=tuning.fp8_k_order)
    if not tuning.batch_invariant:
        return table
    # Batch-invariant (``tuning.invariant()``): the tuning already fixes the FP8 GEMMs' K segments and
    # attention's split; the bf16 GEMMs (router, side projections, LM head, MTP projections) move from
    # cuBLAS and the decode-only kernel to the one kernel for every M. Every other entry computes a row the
    # same way whatever the batch by construction (one program per row / window / expert-tile column, fixed
    # block sizes, no split derived from the token count; tests/gpu/test_batch_invariant_kernels.py).
    return dataclasses.replace(
        table, name="triton-batch-invariant", linear=partial(tri_linear.linear_invariant, tuning=tuning),
        dense=partial(tri_linear.dense_invariant, tuning=tuning),
        dense_grouped=partial(tri_linear.dense_grouped_invariant, tuning=tuning), batch_invariant=True)


def select(device: str, batch_invariant: bool = False) -> OpTable:
    """The op table of ``device``, chosen once at start-up. ``batch_invariant`` (``DEEPINFER_BATCH_INVARIANT``):
    the batch-invariant table of that device (CPU: ``REF_BATCH_INVARIANT``; CUDA: the Triton kernels with
    ``KernelTuning.invariant()``)."""
    if device == "cuda":
        tuning = KernelTuning.for_device()
        return triton_ops(tuning.invariant() if batch_invariant else tuning)
    return REF_BATCH_INVARIANT if batch_invariant else REF
