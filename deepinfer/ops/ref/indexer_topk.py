"""Lightning-indexer top-k over paged index keys (the DeepSelect role), by index lists.

``ops/ref/indexer.py`` scores one sequence's key matrix; here every query names its sequence's entries
0..E-1 by row id into the flat index-key storage, so a batch mixes sequences. The result is exactly
``topk_with_tiebreak(indexer_scores(...), limits, topk)`` per query: higher score first, equal scores ->
lower entry number, entries j >= limits[l] never selected (-1 pads).

Rows given as -1 below the limit (absent keys; a caller bug in the model) score -inf, so they rank after
every present entry and before nothing; no row is read for them.
"""

from __future__ import annotations

import torch

from deepinfer.ops.ref.indexer import topk_with_tiebreak


def indexer_scores_indexed(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_rows: torch.Tensor,
                           softmax_scale: float) -> torch.Tensor:
    """q [L, Hi, Di], weights [L, Hi], keys [R, Di], key_rows [L, E] -> fp32 scores [L, E] (-inf: absent)."""
    rows = key_rows.long()
    gathered = keys[rows.clamp(min=0)].float()  # [L, E, Di]
    # indexer_scores' op sequence, batched over queries: relu(q·k) * scale, weighted, summed over heads.
    scores = torch.matmul(q.float(), gathered.transpose(1, 2))  # [L, Hi, E]
    scores = torch.relu(scores) * softmax_scale
    scores = (scores * weights.float().unsqueeze(-1)).sum(dim=1)
    return scores.masked_fill(rows < 0, float("-inf"))


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, key_rows: torch.Tensor,
                 limits: torch.Tensor, topk: int, softmax_scale: float,
                 query_rows: torch.Tensor | None = None, as_rows: bool = False,
                 weight_scale: float = 1.0) -> torch.Tensor:
    """-> [L, min(topk, E)] int64 entry numbers (not row ids), best first, -1 where fewer are visible.

    The head weights used are ``weights.float() * weight_scale`` (fp32; the model's 1/sqrt(Hi) factor).

    ``query_rows`` [L] (optional): query l reads row ``query_rows[l]`` of ``key_rows`` (then [B, E], one
    row per sequence), so the queries of one sequence share its entry list instead of each carrying a copy.
    ``as_rows``: return each pick's row id ``key_rows[., pick]`` instead of its entry number (-1 stays -1),
    as int32 like every row list: what the sparse attention reads (entries and index keys share rows).
    """
    return indexer_topk_with(indexer_scores_indexed, q, weights, keys, key_rows, limits, topk, softmax_scale,
                             query_rows, as_rows, weight_scale)


def indexer_topk_with(score, q, weights, keys, key_rows, limits, topk: int, softmax_scale: float,
                      query_rows=None, as_rows: bool = False, weight_scale: float = 1.0) -> torch.Tensor:
    """``indexer_topk`` with the scoring function ``score`` (same signature as ``indexer_scores_indexed``)
    passed in: the batch-invariant table scores in fixed chunks and shares everything else."""
    if query_rows is not None:
        key_rows = key_rows[query_rows.long()]
    scores = score(q, weights.float() * weight_scale, keys, key_rows, softmax_scale)
    picks = topk_with_tiebreak(scores, limits.to(scores.device).long(), topk)
    if not as_rows:
        return picks
    rows = key_rows.long().gather(1, picks.clamp(min=0))
    return torch.where(picks >= 0, rows, -1).to(torch.int32)
