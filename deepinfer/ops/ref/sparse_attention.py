"""Index-list sparse attention with a per-head sink over one shared K=V head (FlashMLA's sparse role).

Where ``ops/ref/attention.py`` takes one key set shared by all queries plus a visibility mask, this twin
takes what a paged cache hands a kernel: per query, a list of row ids into flat cache tensors.

Two sources: the window K=V rows and the compressed entries live in different storage tensors
(``window_kv`` and ``entries``), so a query's key list is ``kv[indices[l]]`` followed by
``kv_extra[indices_extra[l]]``. Row id -1 marks padding / an invalid slot and contributes nothing.
The Triton twin splits long lists (HCA at long context) at fixed multiples of its split size along the
*last* source's columns; callers that want the split boundaries anchored at absolute entry numbers put
entry j in column j of ``indices_extra`` (the window in ``indices``).

Numerics are those of ``sparse_attention``: q·k and the scale in the activation dtype, fp32 softmax with the
sink in the denominator only, probabilities cast to the activation dtype for P·V.
"""

from __future__ import annotations

import torch


def gather_keys(kv: torch.Tensor, indices: torch.Tensor, kv_extra: torch.Tensor | None = None,
                indices_extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-query key rows [L, N(+N2), D] and their validity [L, N(+N2)] bool (invalid rows read row 0)."""
    if (kv_extra is None) != (indices_extra is None):
        raise ValueError("kv_extra and indices_extra go together")
    idx = indices.long()
    keys, valid = kv[idx.clamp(min=0)], idx >= 0
    if kv_extra is not None:
        idx2 = indices_extra.long()
        keys = torch.cat([keys, kv_extra[idx2.clamp(min=0)]], dim=1)
        valid = torch.cat([valid, idx2 >= 0], dim=1)
    return keys, valid


def sparse_attention_indexed(
    q: torch.Tensor,
    kv: torch.Tensor,
    indices: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    kv_extra: torch.Tensor | None = None,
    indices_extra: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [L, H, D], kv [R, D], indices [L, N] int (-1 invalid), sinks [H] fp32 -> out [L, H, D] in q.dtype.

    Optional second source: kv_extra [R2, D] with indices_extra [L, N2]. A query with no valid key
    returns zeros (all probability mass on the sink). ``out`` (optional) receives the result.
    """
    keys, valid = gather_keys(kv, indices, kv_extra, indices_extra)  # [L, N, D], [L, N]
    keys = keys.to(q.dtype)
    # Same op sequence as sparse_attention, batched over queries: [L, H, D] @ [L, D, N] -> [L, H, N].
    logits = torch.matmul(q, keys.transpose(1, 2)) * scale
    logits = logits.float().masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink = sinks.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(keys.dtype)
    result = torch.matmul(probs, keys)  # [L, H, D]
    return result if out is None else out.copy_(result)
