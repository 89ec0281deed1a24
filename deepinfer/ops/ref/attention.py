"""Sparse attention with a per-head sink over one shared K=V head (the FlashMLA role).

Each query row attends to an explicit set of keys (its window keys plus selected/visible compressed
entries) given as a boolean visibility matrix. The per-head sink logit joins the softmax denominator only.
Numerics follow the reference: q·k and the scale in the activation dtype, softmax in fp32, probabilities
cast back to the activation dtype for the P·V product.
"""

from __future__ import annotations

import torch


def sparse_attention(
    q: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [L, H, D], keys [N, D] (also the values), visible [L, N] bool, sinks [H] -> out [L, H, D]."""
    qh = q.transpose(0, 1)  # [H, L, D]
    logits = torch.matmul(qh, keys.t()) * scale  # [H, L, N], activation dtype
    logits = logits.float().masked_fill(~visible.unsqueeze(0), float("-inf"))
    sink = sinks.float().view(-1, 1, 1).expand(-1, logits.shape[1], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys).transpose(0, 1)  # [L, H, D]
