"""The batched sampler: float32 logits [B, V] + per-row inputs (``SamplingTensors``: from ``SamplingRow``
objects, or gathered by the runner from its per-slot state) -> one token per row.

Processing order (each step sees the output of the previous one):
  1. penalties       repetition (prompt + output tokens), then presence / frequency (output counts)
  2. min_tokens      EOS and stop_token_ids -> -inf while fewer than min_tokens tokens were generated
  3. greedy rows     argmax of the result; ties -> the lowest token id. Seeds and top-k/p are ignored.
  4. temperature     logits / T
  5. top-k           keep exactly k tokens: the first k in (logit desc, token id asc) order
  6. top-p           keep the minimal prefix of that order whose probability mass is >= p (probabilities of
                     the top-k-renormalised distribution, in float64); always at least the best token
  7. min-p           keep tokens with p >= min_p * p_max (scale-free, so renormalisation does not matter)
  8. sample          seeded Gumbel-max over the vocabulary ids (``rng.gumbel_argmax``)

Ties at the top-k / top-p boundary: the sort is stable over ids, so among equal logits the lower ids are
kept and the cut is exactly k (top-k) or exactly the minimal prefix (top-p) -- never "all tied tokens"
as in vLLM's threshold-based top-k. This makes the kept set a function of the row alone.

Batch invariance: every step is row-wise (element-wise ops, per-row sorts and reductions over a full row
of fixed length V), rows are selected by index rather than padded, and the noise of a row is a hash of its
own (seed, position, vocab id, salt). Logprobs come from the raw logits (see ``logprobs.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.sampling.logprobs import TokenLogprobs, token_logprobs
from deepinfer.sampling.metadata import SamplingRow
from deepinfer.sampling.penalties import apply_penalties_and_masks
from deepinfer.sampling.rng import gumbel_argmax
from deepinfer.sampling.tensors import SamplingTensors, from_rows


@dataclass(frozen=True, slots=True, eq=False)
class SamplerOutput:
    """Result of one sampler call. ``eq=False``: tensors do not compare as booleans."""

    token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: tuple[TokenLogprobs | None, ...]  # per row; None where the row asked for no logprobs

    def tolist(self) -> list[int]:
        return [int(t) for t in self.token_ids.tolist()]


def _truncation_masks(scaled: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Bool [b, V]: which tokens top-k then top-p keep (``scaled`` = temperature-scaled logits)."""
    vocab = scaled.shape[1]
    device = scaled.device
    # Stable descending sort: equal logits stay in id order, so the cut is deterministic.
    sorted_vals, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=device)[None, :]
    k = torch.where(t.top_k > 0, t.top_k, vocab)[:, None]
    keep_sorted = rank < k
    if t.use_top_p:
        # Renormalise over the top-k survivors, then keep rank r iff the mass strictly before it is < p.
        masked = sorted_vals.to(torch.float64).masked_fill(~keep_sorted, float("-inf"))
        probs = torch.softmax(masked, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        top_p = t.top_p[:, None]
        # top_p == 1 keeps everything explicitly: rounding in the cumsum could otherwise drop the tail.
        keep_sorted &= (mass_before < top_p) | (top_p >= 1.0) | (rank == 0)
    keep = torch.zeros_like(keep_sorted)
    return keep.scatter(1, sorted_ids, keep_sorted)


def _min_p_mask(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Bool [b, V]: p >= min_p * p_max, i.e. exp(l - l_max) >= min_p (in float64)."""
    scaled64 = scaled.to(torch.float64)
    ratio = torch.exp(scaled64 - scaled64.max(dim=-1, keepdim=True).values)
    return ratio >= min_p[:, None]


def process_random(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Steps 4-7 for drawing rows (``t`` holds exactly those rows): temperature-scaled logits with dropped
    tokens set to -inf. ``logits`` must already have penalties and masks applied. The result is the exact
    input of the Gumbel draw (and what a coupled speculative verifier must reproduce)."""
    if not t.num_rows:
        return logits
    scaled = logits / t.temperature[:, None]
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if t.use_truncation:
        keep = _truncation_masks(scaled, t)
    if t.use_min_p:
        keep &= _min_p_mask(scaled.masked_fill(~keep, float("-inf")), t.min_p)
    return scaled.masked_fill(~keep, float("-inf"))


def draw(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Steps 1-8: one token per row, [B] int64 on the logits' device (no host sync)."""
    if logits.dim() != 2 or logits.shape[0] != t.num_rows:
        raise ValueError(f"logits must be [B, V] with B == {t.num_rows} rows, got {tuple(logits.shape)}")
    if logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32, got {logits.dtype}")
    penalized = apply_penalties_and_masks(logits, t.penalties, t.masked)
    if t.num_rows and len(t.random_rows) == t.num_rows:
        # Every row draws (random_rows is then 0..B-1): selecting them is the identity and no greedy token
        # survives, so the greedy argmax, the row gathers and the final index_copy are skipped (a dozen
        # launches per step); ``process_random`` reads only ``t``'s drawing inputs and writes none of them.
        return _draw_gumbel(process_random(penalized, t), t.seeds, t.positions, t.salts)
    # Greedy: argmax returns the first maximum, i.e. the lowest token id on ties (documented by torch).
    tokens = argmax_tokens(penalized)
    if t.random_rows:
        # Only the drawing rows are processed (index_select, not masking): a row's numbers never depend on
        # how many greedy rows share the step.
        sub, idx = t.drawing(), t.random_idx
        scores = process_random(penalized[idx], sub)
        tokens = tokens.index_copy(0, idx, _draw_gumbel(scores, sub.seeds, sub.positions, sub.salts))
    return tokens


def argmax_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` of [B, V]; on a GPU, up to ``argmax.MAX_ROWS`` rows, in two launches over
    many programs (``ops/triton/argmax.py``: torch's one block per row takes ~27 µs for a 129K vocabulary).
    The same ids either way, so the choice by row count changes no token."""
    if logits.is_cuda:
        from deepinfer.ops.triton import argmax

        if logits.shape[0] <= argmax.MAX_ROWS and logits.dtype in argmax.DTYPES:
            return argmax.argmax_rows(logits)
    return torch.argmax(logits, dim=-1)


def _draw_gumbel(scores: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, salts: torch.Tensor) -> torch.Tensor:
    """``rng.gumbel_argmax``; on a GPU its fused kernel (the same tokens, two launches instead of a chain of
    [B, V] int64 tensor ops per step)."""
    if scores.is_cuda:
        from deepinfer.ops.triton.gumbel_argmax import gumbel_argmax as fused

        return fused(scores, seeds, positions, salts)
    return gumbel_argmax(scores, seeds, positions, salts)


def process_random_rows(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """``process_random`` for ``SamplingRow`` inputs (no greedy rows)."""
    if any(r.is_greedy for r in rows):
        raise ValueError("process_random_rows got a greedy row; greedy rows take the argmax instead")
    return process_random(logits, from_rows(rows, logits.shape[1], logits.dtype, logits.device))


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Steps 1-7 for every row (greedy rows: steps 1-2 only). For tests, debugging and verification."""
    t = from_rows(rows, logits.shape[1], logits.dtype, logits.device)
    penalized = apply_penalties_and_masks(logits, t.penalties, t.masked)
    if not t.random_rows:
        return penalized
    out = penalized.clone()
    out[t.random_idx] = process_random(penalized[t.random_idx], t.drawing())
    return out


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, nums: Sequence[int | None]) -> tuple[TokenLogprobs | None, ...]:
    """Per row: the raw-logit logprobs of ``tokens`` (None where ``nums`` is None)."""
    want = [b for b, n in enumerate(nums) if n is not None]
    out: list[TokenLogprobs | None] = [None] * len(nums)
    if want:
        idx = torch.tensor(want, device=logits.device)
        for b, lp in zip(want, token_logprobs(logits[idx], tokens[idx], [nums[b] or 0 for b in want])):
            out[b] = lp
    return tuple(out)


class Sampler:
    """Stateless batched sampler. ``Sampler()(logits, rows)`` -> :class:`SamplerOutput`.

    Holds no RNG state: all randomness comes from each row's (seed, position, salt).
    """

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        return self.forward(logits, rows)

    def forward(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [B, V] with B == len(rows) == {len(rows)}, got {tuple(logits.shape)}")
        t = from_rows(rows, logits.shape[1], logits.dtype, logits.device)
        tokens = draw(logits, t)
        return SamplerOutput(token_ids=tokens, logprobs=logprobs_of(logits, tokens, t.num_logprobs))


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
    """Functional form of :class:`Sampler`."""
    return Sampler()(logits, rows)


__all__ = ["Sampler", "SamplerOutput", "draw", "logprobs_of", "process_logits", "process_random", "process_random_rows",
           "sample"]
