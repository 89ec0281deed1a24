"""Grammar token masks applied to a step's logits, in place; twin of ``ops/triton/token_mask.py``.

  token_mask(logits [B, V] float, words [R, W] int32, rows [R] int) -> None

Row ``rows[r]`` of ``logits`` gets -inf at every token t < V whose bit (bit t % 32 of word t // 32, the
llguidance layout) is clear in ``words[r]``; W >= ceil(V/32), bits at or past V are ignored. Rows not listed
are untouched (unconstrained draws cost nothing), allowed logits keep their bits; ``rows`` are distinct.
"""

from __future__ import annotations

import torch


def token_mask(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> None:
    v = logits.shape[1]
    assert words.dtype == torch.int32 and words.dim() == 2 and words.shape[1] * 32 >= v, (words.dtype, words.shape, v)
    assert rows.shape == (len(words),), (rows.shape, words.shape)
    if not len(words):
        return
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # arithmetic shift of a negative word still leaves bit k at 0
    allowed = bits.reshape(len(words), -1)[:, :v].bool()
    idx = rows.long()
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
