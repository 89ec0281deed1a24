"""MoE routing: score functions, bias-corrected top-k (bias affects selection only) and hash routing."""

from __future__ import annotations

import torch

from deepinfer.ops.ref.pointwise import direct


def score(logits: torch.Tensor, scoring_func: str, pointwise=direct) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return pointwise(torch.nn.functional.softplus, logits).sqrt()
    if scoring_func == "sigmoid":
        return pointwise(torch.sigmoid, logits)
    if scoring_func == "softmax":
        return torch.softmax(logits.float(), dim=-1).to(logits.dtype)
    raise ValueError(f"scoring_func: {scoring_func!r} is not one of sqrtsoftplus, sigmoid, softmax")


def topk_with_tiebreak(values: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k indices per row; equal values resolve to the lower expert index (stable descending sort)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def route(
    logits: torch.Tensor,
    scoring_func: str,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    bias: torch.Tensor | None = None,
    hash_indices: torch.Tensor | None = None,
    *,
    pointwise=direct,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k], expert indices [T, k]).

    ``hash_indices`` (from ``tid2eid[token_id]``) replaces the learned selection on hash layers.
    ``pointwise``: how the score function is applied (``ops/ref/pointwise.py``).
    """
    scores = score(logits, scoring_func, pointwise)
    if hash_indices is not None:
        indices = hash_indices.long()
    else:
        selection = scores if bias is None else scores + bias
        indices = topk_with_tiebreak(selection, top_k)
    weights = scores.gather(1, indices)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, indices
