"""Lightning-indexer scoring + deterministic top-k, in Triton; twin of ``ops/ref/indexer_topk.py``.

Scoring: one program per (block of BLOCK_E entries, query). It gathers the entries' index-key rows once,
computes all Hi heads' q·k as one [Hi, Di] x [Di, BLOCK_E] MMA with fp32 accumulation, then
relu(.) * softmax_scale * w_h summed over heads, in fp32, in the reference's op order. Blocks wholly at or
past the query's limit read nothing. Each score is written as an int64 *sort key*, not as a float:

    key = sortable32(score) << 32 | (E - 1 - entry)

where sortable32 maps fp32 bits to an int32 with the same order (negative floats: flip the 31 low bits;
-0.0 is first made +0.0, because the reference's sort treats them as equal). Masked entries carry -inf.
Keys are all distinct, and a larger key means (higher score) or (equal score and lower entry number) --
exactly the reference's tie rule. ``torch.topk`` over distinct keys has one right answer, so the result is
the same on every backend, for every batch, and for any E beyond the limit (the extra entries are -inf
with larger entry numbers, so they rank last).

Short-context shortcut (limits[l] <= topk): the *set* is then all visible entries, but this op returns
them best first like the reference, which needs the scores, so every row is scored.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton's interpreter multiplies bf16 operands as raw uint16 bits: upcast (exactly) to fp32 dots there.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit(do_not_specialize=["E", "stride_rl", "stride_ol"])
def _index_score_kernel(
    q_ptr, w_ptr, k_ptr, rows_ptr, qrow_ptr, lim_ptr, key_ptr,
    E, Hi, Di, softmax_scale, weight_scale,
    stride_ql, stride_qh, stride_wl, stride_k, stride_rl, stride_ol,
    BLOCK_HI: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
    SHARED_ROWS: tl.constexpr,
):
    lq, eb, offs_e, in_range = query_block(E, BLOCK_E)
    limit = tl.load(lim_ptr + lq)
    score = tl.full((BLOCK_E,), float("-inf"), dtype=tl.float32)
    if eb * BLOCK_E < limit:
        visible = in_range & (offs_e < limit)
        rrow = lq
        if SHARED_ROWS:  # the queries of one sequence share its entry list
            rrow = tl.load(qrow_ptr + lq).to(tl.int64)
        rows = tl.load(rows_ptr + rrow * stride_rl + offs_e, mask=visible, other=-1)
        present = rows >= 0
        s, offs_h, h_mask = head_dots(q_ptr, k_ptr, lq, rows.to(tl.int64), present, Hi, Di, stride_ql, stride_qh,
                                      stride_k, BLOCK_HI, BLOCK_D, IEEE)
        # The head weights as the reference forms them: fp32, times weight_scale (one fp32 multiply).
        w = tl.load(w_ptr + lq * stride_wl + offs_h, mask=h_mask, other=0.0).to(tl.float32) * weight_scale
        # Padded heads have q = 0 and w = 0: they add +0.0 to every score.
        s = tl.maximum(s, 0.0) * softmax_scale * w[:, None]
        score = tl.where(present, tl.sum(s, axis=0), float("-inf"))
    tl.store(key_ptr + lq * stride_ol + offs_e, sort_key(score, offs_e, E), mask=in_range)


@triton.jit
def query_block(E, BLOCK_E: tl.constexpr):
    """This program's query and block of BLOCK_E entries: one flat grid axis (no 65535 limit on the number of
    queries), a query's entry blocks adjacent -> (query, block, entry offsets, which are < E)."""
    n_eb = tl.cdiv(E, BLOCK_E)
    eb = tl.program_id(0) % n_eb
    lq = (tl.program_id(0) // n_eb).to(tl.int64)
    offs_e = eb * BLOCK_E + tl.arange(0, BLOCK_E)
    return lq, eb, offs_e, offs_e < E


@triton.jit
def head_dots(q_ptr, k_ptr, lq, rows, present, H, D, stride_ql, stride_qh, stride_k, BLOCK_H: tl.constexpr,
              BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    """Query lq's H heads [H, D] against the key rows ``rows`` (int64; read where ``present``) -> fp32 dots
    [BLOCK_H, BLOCK_E] (one MMA, fp32 accumulation), the head offsets and their mask."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    h_mask = offs_h < H
    d_mask = offs_d < D
    q = tl.load(q_ptr + lq * stride_ql + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    k = tl.load(k_ptr + rows[:, None] * stride_k + offs_d[None, :], mask=present[:, None] & d_mask[None, :],
                other=0.0)
    if IEEE:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s, offs_h, h_mask


@triton.jit
def sort_key(score, slot, E):
    """fp32 scores of slots ``slot`` -> int64 sort keys (module docstring): -0.0 made +0.0 first (equal
    scores: the lower slot ranks first)."""
    score = tl.where(score == 0.0, 0.0, score)
    bits = score.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (ordered.to(tl.int64) << 32) | (E - 1 - slot).to(tl.int64)


def config(dtype: torch.dtype, hi: int, di: int) -> dict[str, int]:
    """Tiles by (dtype, Hi, Di) only. Flash (64 heads x 128): q tile 16 KB, key tile [64, 128] bf16 16 KB."""
    if dtype == torch.float32:
        return {"BLOCK_E": 32, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_E": 64, "num_warps": 4, "num_stages": 2}


def _query_rows(query_rows: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The kernels read int32 or int64 row numbers as they come (the step's token_seq is int64): no copy."""
    if query_rows.dtype in (torch.int32, torch.int64) and query_rows.device == device and query_rows.stride(0) == 1:
        return query_rows
    return query_rows.to(device=device, dtype=torch.int32).contiguous()


def indexer_sort_keys(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_rows: torch.Tensor,
                      limits: torch.Tensor, softmax_scale: float,
                      query_rows: torch.Tensor | None = None, weight_scale: float = 1.0) -> torch.Tensor:
    """Scores of every entry as int64 sort keys [L, E] (see module docstring)."""
    L, hi, di = q.shape
    e = key_rows.shape[1]
    shared = query_rows is not None
    assert weights.shape == (L, hi) and keys.shape[1] == di and limits.shape == (L,)
    assert (query_rows.shape == (L,)) if shared else key_rows.shape[0] == L
    assert keys.dtype == q.dtype, (q.dtype, keys.dtype)
    q = q if q.stride(2) == 1 else q.contiguous()
    keys = keys if keys.stride(1) == 1 else keys.contiguous()
    # Any float dtype, read where it lies (a column slice of the side projection's output): the kernel does
    # the reference's fp32 upcast and weight_scale multiply (two fewer launches per call).
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    rows = key_rows.to(torch.int32).contiguous()
    lims = limits.to(device=q.device, dtype=torch.int32).contiguous()
    qrows = _query_rows(query_rows, q.device) if shared else lims
    out = torch.empty((L, e), dtype=torch.int64, device=q.device)
    if L == 0 or e == 0:
        return out
    cfg = config(q.dtype, hi, di)
    block_e = cfg["BLOCK_E"]
    grid = (triton.cdiv(e, block_e) * L,)
    _index_score_kernel[grid](
        q, weights, keys, rows, qrows, lims, out, e, hi, di, float(softmax_scale), float(weight_scale),
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), rows.stride(0), out.stride(0),
        BLOCK_HI=max(16, triton.next_power_of_2(hi)), BLOCK_E=block_e, BLOCK_D=max(16, triton.next_power_of_2(di)),
        IEEE=q.dtype == torch.float32 or _INTERPRET, SHARED_ROWS=shared, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out


def scores_from_keys(sort_keys: torch.Tensor) -> torch.Tensor:
    """Decode the fp32 scores back from sort keys (for tests and debugging)."""
    ordered = (sort_keys >> 32).to(torch.int32)
    bits = torch.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered)
    return bits.view(torch.float32)


@triton.jit(do_not_specialize=["e", "stride_b", "stride_r", "stride_o"])
def _picks_kernel(best_ptr, lim_ptr, rows_ptr, qrows_ptr, out_ptr, e, k, stride_b, stride_r, stride_o,
                  AS_ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Sort keys of the top k (any order) -> entry numbers (or their row ids) best first, -1 past the query's
    limit. Keys are unique per entry, so the in-register sort gives exactly a sorted top-k's order."""
    lq = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < k
    best = tl.load(best_ptr + lq * stride_b + offs, mask=ok, other=-9223372036854775808)  # pads sort last
    best = tl.sort(best, descending=True)
    entry = (e - 1) - (best & 0xFFFFFFFF)
    valid = entry < tl.load(lim_ptr + lq)
    if AS_ROWS:
        r = tl.load(qrows_ptr + lq)
        row = tl.load(rows_ptr + r * stride_r + entry, mask=ok & valid, other=-1)
        entry = tl.where(valid, row, -1)
    else:
        entry = tl.where(valid, entry, -1)
    tl.store(out_ptr + lq * stride_o + offs, entry, mask=ok)


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_rows: torch.Tensor,
                 limits: torch.Tensor, topk: int, softmax_scale: float,
                 query_rows: torch.Tensor | None = None, as_rows: bool = False,
                 weight_scale: float = 1.0) -> torch.Tensor:
    """q [L, Hi, Di], weights [L, Hi] (used as fp32 * weight_scale), keys [R, Di], key_rows [L, E] int32
    (-1 absent), limits [L]
    -> [L, min(topk, E)] int64 entry numbers, best first, -1 where fewer than that are visible.
    With ``query_rows`` [L], key_rows is [B, E] and query l reads its row query_rows[l]. ``as_rows``: each
    pick's row id (int32) instead of its entry number (see the reference)."""
    L, e = q.shape[0], key_rows.shape[1]
    k = min(topk, e)
    if k <= 0 or L == 0:
        return torch.empty((L, max(k, 0)), dtype=torch.long, device=q.device)
    sort_keys = indexer_sort_keys(q, weights, keys, key_rows, limits, softmax_scale, query_rows, weight_scale)
    # Unsorted: torch's sort of the k winners costs more than the selection (two radix-sort launches); the
    # picks kernel orders them best first instead.
    best = torch.topk(sort_keys, k, dim=1, largest=True, sorted=False).values
    rows = key_rows.to(torch.int32).contiguous()
    lims = limits.to(device=q.device, dtype=torch.int32).contiguous()
    if query_rows is not None:
        qrows = _query_rows(query_rows, q.device)
    else:  # key_rows holds one row per query (only read with as_rows)
        qrows = torch.arange(L, device=q.device, dtype=torch.int32) if as_rows else lims
    out = torch.empty((L, k), dtype=torch.int32 if as_rows else torch.long, device=q.device)
    _picks_kernel[(L,)](best, lims, rows, qrows, out, e, k, best.stride(0), rows.stride(0), out.stride(0),
                        AS_ROWS=as_rows, BLOCK=triton.next_power_of_2(k), num_warps=4)
    return out
