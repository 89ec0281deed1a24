"""DeepSeek-V4.1's indexer choice over a step's key lists in Triton; twin of ``ops/ref/index_select_v41.py``
(same signature; ``parts``, the reference's walk over the rows, is not needed: no key is copied).

Scoring: one program per (block of BLOCK_E slots, query). Query t's slot j is row base[t] + j of the index
keys, read in place for j < visible[t] (and, for a re-indexing layer, inside the candidate mask). All heads'
q . k as one [heads, d] x [d, BLOCK_E] MMA with fp32 accumulation, then the reference's roundings to the
activation dtype: the dot products (its einsum's output), ReLU, times the head weight (rounded), the sum over
heads (fp32 accumulation, rounded once). The dot products' K-order and the head sum's order are the kernel's,
so a score may differ from the reference's in its last bit; what the top-k keeps differs only where that
moves a score across the cut (``model/v41/select_lists.py``: such near-ties are the implementation's).

Each score is written as V4's int64 sort key (``ops/triton/indexer_topk.py``): sortable32(score) << 32 |
(E - 1 - slot), so keys are distinct and ties go to the lower slot; a slot that does not compete is -inf.
``torch.topk`` keeps the best min(topk, E) keys, and the picks kernel turns them into rows of the keys:
the finite ones' slots sorted ascending, base[t] added, -1 after them (the reference's form). The candidate
source's blocks are chosen from the scores decoded back from the keys with the reference's own code
(``candidate_blocks``: a handful of ops on one layer of the step).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.ops.ref.index_select_v41 import candidate_blocks
from deepinfer.ops.triton.indexer_topk import head_dots, query_block, scores_from_keys, sort_key
from deepinfer.ops.triton.rounding import round_to

# Triton's interpreter multiplies bf16 operands as raw uint16 bits: upcast (exactly) to fp32 dots there.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# sortable32(-inf): a key whose high half is at most this is a slot that did not compete.
_NEG_INF_KEY: tl.constexpr = tl.constexpr(-2139095041)
_NONE: tl.constexpr = tl.constexpr(1 << 62)  # sorts after every slot


@triton.jit(do_not_specialize=["E", "stride_ql", "stride_wl", "stride_cl", "stride_ol"])
def _score_kernel(q_ptr, w_ptr, k_ptr, base_ptr, vis_ptr, cand_ptr, key_ptr, E, H, D, stride_ql, stride_qh,
                  stride_wl, stride_k, stride_cl, stride_ol, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr,
                  BLOCK_D: tl.constexpr, HAS_CAND: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    lq, eb, offs_e, in_range = query_block(E, BLOCK_E)
    visible = tl.load(vis_ptr + lq)
    score = tl.full((BLOCK_E,), float("-inf"), dtype=tl.float32)
    if eb * BLOCK_E < visible:
        allowed = in_range & (offs_e < visible)
        if HAS_CAND:
            allowed = allowed & (tl.load(cand_ptr + lq * stride_cl + offs_e, mask=allowed, other=0) != 0)
        rows = tl.load(base_ptr + lq) + offs_e.to(tl.int64)
        s, offs_h, h_mask = head_dots(q_ptr, k_ptr, lq, rows, allowed, H, D, stride_ql, stride_qh, stride_k,
                                      BLOCK_H, BLOCK_D, IEEE)  # [BLOCK_H, BLOCK_E], fp32 accumulation
        dtype = q_ptr.dtype.element_ty
        s = tl.maximum(round_to(s, dtype, INTERPRET), 0.0)
        w = tl.load(w_ptr + lq * stride_wl + offs_h, mask=h_mask, other=0.0).to(tl.float32)
        # Padded heads have q = 0 and w = 0: they add +0.0 to every score.
        weighted = round_to(s * w[:, None], dtype, INTERPRET)
        score = tl.where(allowed, round_to(tl.sum(weighted, axis=0), dtype, INTERPRET), float("-inf"))
    tl.store(key_ptr + lq * stride_ol + offs_e, sort_key(score, offs_e, E), mask=in_range)


@triton.jit(do_not_specialize=["e", "stride_b", "stride_o"])
def _rows_kernel(best_ptr, base_ptr, out_ptr, e, k, stride_b, stride_o, BLOCK: tl.constexpr):
    """The top k sort keys (any order) -> the finite ones' slots ascending as rows (base + slot), -1 after."""
    lq = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < k
    best = tl.load(best_ptr + lq * stride_b + offs, mask=ok, other=-9223372036854775808)
    finite = ok & ((best >> 32) > _NEG_INF_KEY)
    slot = tl.where(finite, (e - 1) - (best & 0xFFFFFFFF), _NONE)
    slot = tl.sort(slot)
    row = tl.where(slot < _NONE, tl.load(base_ptr + lq) + slot, -1)
    tl.store(out_ptr + lq * stride_o + offs, row, mask=ok)


def _tiles(dtype: torch.dtype) -> dict[str, int]:
    if dtype == torch.float32:
        return {"BLOCK_E": 32, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_E": 64, "num_warps": 4, "num_stages": 2}


def sort_keys(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, base: torch.Tensor, visible: torch.Tensor,
              width: int, candidates: torch.Tensor | None = None) -> torch.Tensor:
    """Every slot's score as an int64 sort key [T, width] (module docstring; ``scores_from_keys`` decodes it)."""
    t, heads, dim = q.shape
    assert w.shape == (t, heads) and keys.shape[1] == dim and keys.dtype == q.dtype, (q.shape, w.shape, keys.shape)
    assert base.shape == (t,) and visible.shape == (t,)
    q = q if q.stride(2) == 1 else q.contiguous()
    w = w if w.stride(1) == 1 else w.contiguous()
    keys = keys if keys.stride(1) == 1 else keys.contiguous()
    base, visible = base.long().contiguous(), visible.long().contiguous()
    has_cand = candidates is not None
    cand = visible  # any tensor: not read without candidates
    if has_cand:
        assert candidates.shape == (t, width), (tuple(candidates.shape), (t, width))
        cand = (candidates if candidates.stride(1) == 1 else candidates.contiguous()).view(torch.uint8)
    out = torch.empty((t, width), dtype=torch.int64, device=q.device)
    if t and width:
        tiles = _tiles(q.dtype)
        _score_kernel[(triton.cdiv(width, tiles["BLOCK_E"]) * t,)](
            q, w, keys, base, visible, cand, out, width, heads, dim, q.stride(0), q.stride(1), w.stride(0),
            keys.stride(0), cand.stride(0) if has_cand else 0, out.stride(0),
            BLOCK_H=max(16, triton.next_power_of_2(heads)), BLOCK_E=tiles["BLOCK_E"],
            BLOCK_D=max(16, triton.next_power_of_2(dim)), HAS_CAND=has_cand,
            IEEE=q.dtype == torch.float32 or _INTERPRET, INTERPRET=_INTERPRET, num_warps=tiles["num_warps"],
            num_stages=tiles["num_stages"])
    return out


def select_entries(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, base: torch.Tensor, visible: torch.Tensor,
                   width: int, topk: int, parts=None, candidates: torch.Tensor | None = None,
                   publish: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    del parts  # the reference's walk over the rows
    t, k = q.shape[0], min(topk, width)
    scored = sort_keys(q, w, keys, base, visible, width, candidates)
    base = base.long().contiguous()
    published = None
    if publish is not None:
        seen = visible.long().unsqueeze(-1)
        allowed = torch.arange(width, device=q.device) < seen
        published = candidate_blocks(scores_from_keys(scored), seen, *publish) & allowed
    rows = torch.empty((t, k), dtype=torch.long, device=q.device)
    if t and k:
        # Unsorted: the rows kernel orders the winners itself (torch's sort of them costs more than the choice).
        best = torch.topk(scored, k, dim=1, sorted=False).values
        _rows_kernel[(t,)](best, base, rows, width, k, best.stride(0), rows.stride(0),
                           BLOCK=triton.next_power_of_2(k), num_warps=4)
    return rows, published if publish is not None else candidates
