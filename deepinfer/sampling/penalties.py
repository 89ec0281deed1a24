"""Logit penalties and forced masks, applied before temperature (steps 1-2 of the sampler).

Every operation here is element-wise given per-row inputs, and a row whose penalty is neutral keeps its
logits bit for bit (``x / 1.0 == x``, ``x - 0.0 == x``; ``where`` leaves unmasked entries untouched). That
is what lets a request with penalties share a batch with one without, and each get what it would get alone.
"""

from __future__ import annotations

import torch

from deepinfer.sampling.tensors import Penalties


def apply_repetition_penalty(logits: torch.Tensor, penalty: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """vLLM / HF (CTRL paper) repetition penalty on tokens seen in prompt + output.

    A seen token's logit is divided by the penalty when positive and multiplied when negative, so a
    penalty > 1 always makes it less likely.
    """
    p = penalty[:, None]
    penalized = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalized, logits)


def apply_count_penalties(logits: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
                          counts: torch.Tensor) -> torch.Tensor:
    """OpenAI presence / frequency penalties from the output-token counts.

    ``logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)``. Prompt tokens do not
    count (OpenAI semantics; vLLM agrees).
    """
    return logits - (frequency[:, None] * counts + presence[:, None] * (counts > 0).to(logits.dtype))


def apply_penalties_and_masks(logits: torch.Tensor, penalties: Penalties,
                              masked: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """Steps 1-2 of the sampler: repetition, presence/frequency, then the min_tokens mask (-inf)."""
    if penalties.repetition is not None:
        logits = apply_repetition_penalty(logits, penalties.repetition, penalties.seen)
    if penalties.counts is not None:
        logits = apply_count_penalties(logits, penalties.frequency, penalties.presence, penalties.counts)
    if masked is not None:
        logits = logits.clone()  # never write into the caller's logits
        logits[masked] = float("-inf")
    return logits
