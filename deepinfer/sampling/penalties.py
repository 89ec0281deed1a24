"""Logit penalties and forced masks, applied before temperature (steps 1-2 of the sampler).

Every operation here is element-wise given per-row inputs, and a row whose penalty is neutral keeps its
logits bit for bit (``x - 0.0 == x``; ``where`` leaves unmasked entries untouched). That is what lets a
request with penalties share a batch with one without, and each get what it would get alone.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from deepinfer.sampling.metadata import SamplingRow


def _pairs(rows: Sequence[SamplingRow], attr: str) -> tuple[list[int], list[int]]:
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for b, row in enumerate(rows):
        ids = getattr(row, attr)
        row_idx.extend([b] * len(ids))
        tok_idx.extend(ids)
    return row_idx, tok_idx


def _check_ids(tok_idx: list[int], vocab_size: int, what: str) -> None:
    if tok_idx and not 0 <= min(tok_idx) <= max(tok_idx) < vocab_size:
        raise ValueError(f"{what} contains a token id outside [0, {vocab_size}): {min(tok_idx)}..{max(tok_idx)}")


def apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """vLLM / HF (CTRL paper) repetition penalty on tokens seen in prompt + output.

    A seen token's logit is divided by the penalty when positive and multiplied when negative, so a
    penalty > 1 always makes it less likely. Returns a new tensor (or ``logits`` itself when no row has it).
    """
    if not any(r.has_repetition_penalty for r in rows):
        return logits
    row_idx, tok_idx = _pairs(rows, "seen_token_ids")
    _check_ids(tok_idx, logits.shape[1], "seen_token_ids")
    seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    if row_idx:
        seen[torch.tensor(row_idx, device=logits.device), torch.tensor(tok_idx, device=logits.device)] = True
    penalty = torch.tensor([r.repetition_penalty for r in rows], dtype=logits.dtype, device=logits.device)[:, None]
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


def apply_count_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """OpenAI presence / frequency penalties from the output-token counts.

    ``logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)``. Prompt tokens do not
    count (OpenAI semantics; vLLM agrees).
    """
    if not any(r.has_count_penalty for r in rows):
        return logits
    row_idx: list[int] = []
    tok_idx: list[int] = []
    cnt: list[float] = []
    for b, row in enumerate(rows):
        for tok, c in row.output_token_counts:
            row_idx.append(b)
            tok_idx.append(tok)
            cnt.append(float(c))
    _check_ids(tok_idx, logits.shape[1], "output_token_counts")
    counts = torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
    if row_idx:
        counts[torch.tensor(row_idx, device=logits.device), torch.tensor(tok_idx, device=logits.device)] = torch.tensor(
            cnt, dtype=logits.dtype, device=logits.device
        )
    freq = torch.tensor([r.frequency_penalty for r in rows], dtype=logits.dtype, device=logits.device)[:, None]
    pres = torch.tensor([r.presence_penalty for r in rows], dtype=logits.dtype, device=logits.device)[:, None]
    return logits - (freq * counts + pres * (counts > 0).to(logits.dtype))


def apply_forced_masks(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Set ``masked_token_ids`` (EOS + stop ids during ``min_tokens``) to -inf."""
    row_idx, tok_idx = _pairs(rows, "masked_token_ids")
    if not row_idx:
        return logits
    _check_ids(tok_idx, logits.shape[1], "masked_token_ids")
    out = logits.clone()
    out[torch.tensor(row_idx, device=logits.device), torch.tensor(tok_idx, device=logits.device)] = float("-inf")
    return out


def apply_penalties_and_masks(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Steps 1-2 of the sampler: repetition, presence/frequency, then the min_tokens mask."""
    logits = apply_repetition_penalty(logits, rows)
    logits = apply_count_penalties(logits, rows)
    return apply_forced_masks(logits, rows)
