"""Lightning-indexer scoring and top-k selection (the DeepSelect role).

score(t, s) = sum_h w[t, h] * relu(q[t, h] · k[s]) / sqrt(d), in fp32, over the entries a query may see.
Tie-break (documented contract shared with the GPU kernel): higher score first; on equal scores the
lower entry index wins. This makes the selected set independent of how many entries exist beyond the
query's causal limit, of the batch, and of the chunking of the prompt.
"""

from __future__ import annotations

import torch


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """q [L, Hi, Di], weights [L, Hi] (fp32, already scaled), keys [E, Di] -> scores [L, E] fp32."""
    scores = torch.matmul(q.float(), keys.float().t())  # [L, Hi, E]
    scores = torch.relu(scores) * softmax_scale
    return (scores * weights.float().unsqueeze(-1)).sum(dim=1)


def topk_with_tiebreak(scores: torch.Tensor, limits: torch.Tensor, k: int) -> torch.Tensor:
    """Pick up to k entries per row among indices < limits[row]; -1 pads rows with fewer visible entries.

    scores [L, E], limits [L] -> [L, min(k, E)] int64 indices, best first.
    """
    num_entries = scores.shape[-1]
    k = min(k, num_entries)
    if k == 0:
        return torch.empty(scores.shape[0], 0, dtype=torch.long, device=scores.device)
    entry = torch.arange(num_entries, device=scores.device)
    masked = scores.masked_fill(entry.unsqueeze(0) >= limits.unsqueeze(1), float("-inf"))
    # A stable descending sort keeps equal scores in ascending index order: lower index wins ties.
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.where(order >= limits.unsqueeze(1), torch.full_like(order, -1), order)
