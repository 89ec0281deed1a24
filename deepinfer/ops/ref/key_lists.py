"""DeepSeek-V4.1's attention core over per-query key lists (the paged step's ``key_lists`` build): the twin of
``ops/triton/key_lists.py``. One shared K = V head, a per-head sink in the softmax's denominator only, fp32
inside; the plain model's ``Attention._attend`` over a mask, given as row lists instead.
"""

from __future__ import annotations

import torch


def attend_lists(q: torch.Tensor, sink: torch.Tensor, window: torch.Tensor, window_ids: torch.Tensor,
                 entries: torch.Tensor | None = None, entry_ids: torch.Tensor | None = None,
                 chunk: int = 256) -> torch.Tensor:
    """``Attention._attend`` for many sequences at once, each query's keys given as lists of rows: q [L, heads,
    D]; window [Rw, D] with window_ids [L, W] (rows of ``window``, -1 = none), optionally entries [Re, D] with
    entry_ids [L, K]. Softmax over each query's listed keys plus the sink logit (denominator only), K = V, fp32
    inside, the keys in list order (window rows by position, then entries by id: the per-sequence order less
    the keys a query does not see). Queries go ``chunk`` at a time (a chunk's keys are gathered: [chunk, W + K,
    D])."""
    outs = []
    scale = q.shape[-1] ** -0.5
    with_entries = entries is not None and entries.shape[0] > 0 and entry_ids.shape[1] > 0
    for a in range(0, q.shape[0], chunk):
        ids = window_ids[a:a + chunk]
        keys, valid = window[ids.clamp(min=0)], ids >= 0
        if with_entries:
            e = entry_ids[a:a + chunk]
            keys, valid = torch.cat((keys, entries[e.clamp(min=0)]), dim=1), torch.cat((valid, e >= 0), dim=1)
        keys = keys.float()
        logits = torch.einsum("lhd,lkd->lhk", q[a:a + chunk].float(), keys) * scale
        logits = logits.masked_fill(~valid.unsqueeze(1), -torch.inf)
        sinks = sink.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
        probs = torch.cat((logits, sinks), dim=-1).softmax(dim=-1)[..., :-1]
        outs.append(torch.einsum("lhk,lkd->lhd", probs, keys))
    return torch.cat(outs).to(q.dtype)
