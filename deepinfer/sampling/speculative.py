"""Speculative decoding's two sampling decisions as pure device functions of whole-batch tensors.

* ``pick_drafts``: the MTP layer's draft token per row -- the argmax for greedy rows; for sampled rows the
  argmax of the temperature-scaled logits plus the target's own Gumbel noise at the drafted position (the
  MTP layer's guess at the target's seeded draw; ``runner/speculative.py`` says why that cannot bias the
  output).
* ``accept_drafts``: coupled verification (determinism.md §2.8) over a [sequences, draws] matrix: a
  sequence keeps its draws up to and including the first one that differs from the draft it verifies. For
  greedy rows the draws are the target's argmax, for sampled rows its seeded (seq_seed, position) draws,
  so both cases are the same comparison: "longest prefix of drafts equal to the target's tokens, plus the
  target's next token".

Both are row-wise, take no host values but shapes and a flag, never read the device, and contain no
Python loop over rows, so the same call runs eagerly (CPU tests check exactness there) and inside a
captured CUDA graph (``runner/mtp_graphs.py``).
"""

from __future__ import annotations

import torch

from deepinfer.sampling.params import GREEDY_TEMPERATURE_EPS
from deepinfer.sampling.rng import SALT_TARGET, gumbel_noise
from deepinfer.sampling.sampler import argmax_tokens

FREE = -2  # target of a draw before a sequence's first draft-verifying one: always kept
NO_DRAFT = -1  # target of the draw after the last draft (the target's own token) and of padding


def pick_drafts(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor,
                sampled: bool) -> torch.Tensor:
    """[n] int64 draft tokens from ``logits`` [n, V]. Per row: ``temperature`` (float64; below
    ``GREEDY_TEMPERATURE_EPS``: greedy), ``seeds`` and ``positions`` (int64: the drafted token's position,
    the key of the target's noise there). ``sampled``: some row may be sampled (host knowledge); False skips
    the noise (a [n, V] hash, the bulk of the work) and every row takes its argmax."""
    tokens = argmax_tokens(logits)
    if not sampled:
        return tokens
    hot = temperature >= GREEDY_TEMPERATURE_EPS
    # Greedy rows divide by 1 (their scores are discarded; this keeps them finite).
    scores = logits.to(torch.float64) / torch.where(hot, temperature, 1.0)[:, None]
    scores = scores + gumbel_noise(seeds, positions, logits.shape[1], SALT_TARGET)
    return torch.where(hot, torch.argmax(scores, dim=-1), tokens)


def accept_drafts(draws: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Coupled acceptance of a batch. ``draws`` [S, W] int64: each sequence's draws in order (left-aligned;
    padding anything); ``targets`` [S, W]: the draft each draw must equal for the following draw to count,
    ``FREE`` for draws before the first draft-verifying one, ``NO_DRAFT`` for the draw after the last draft
    and for padding. Returns (emitted [S, W]: the kept draws, -1 after them; kept [S]: their count, at
    least 1). Draws are >= 0, so a ``NO_DRAFT`` column always ends the run."""
    match = (draws == targets) | (targets == FREE)
    run = torch.cumprod(match.to(torch.int64), dim=1).sum(dim=1)  # leading matches
    cols = torch.arange(draws.shape[1], device=draws.device)
    emitted = torch.where(cols[None, :] <= run[:, None], draws, -1)
    return emitted, run + 1
