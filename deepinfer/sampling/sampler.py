"""The batched sampler: float32 logits [B, V] + one ``SamplingRow`` per row -> one token per row.

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


@dataclass(frozen=True, slots=True, eq=False)
class SamplerOutput:
    """Result of one sampler call. ``eq=False``: tensors do not compare as booleans."""

    token_ids: torch.Tensor  # [B] int64, on the logits' device
    logprobs: tuple[TokenLogprobs | None, ...]  # per row; None where the row asked for no logprobs

    def tolist(self) -> list[int]:
        return [int(t) for t in self.token_ids.tolist()]


def _row_tensor(rows: Sequence[SamplingRow], attr: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor([getattr(r, attr) for r in rows], dtype=dtype, device=device)


def _truncation_masks(scaled: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Bool [b, V]: which tokens top-k then top-p keep (``scaled`` = temperature-scaled logits)."""
    n, vocab = scaled.shape
    device = scaled.device
    # Stable descending sort: equal logits stay in id order, so the cut is deterministic.
    sorted_vals, sorted_ids = torch.sort(scaled, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=device)[None, :]
    k = torch.tensor([r.top_k if r.top_k > 0 else vocab for r in rows], device=device)[:, None]
    keep_sorted = rank < k
    if any(r.top_p < 1.0 for r in rows):
        # Renormalise over the top-k survivors, then keep rank r iff the mass strictly before it is < p.
        masked = sorted_vals.to(torch.float64).masked_fill(~keep_sorted, float("-inf"))
        probs = torch.softmax(masked, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float64, device=device)[:, None]
        # top_p == 1 keeps everything explicitly: rounding in the cumsum could otherwise drop the tail.
        keep_sorted &= (mass_before < top_p) | (top_p >= 1.0) | (rank == 0)
    keep = torch.zeros_like(keep_sorted)
    return keep.scatter(1, sorted_ids, keep_sorted)


def _min_p_mask(scaled: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Bool [b, V]: p >= min_p * p_max, i.e. exp(l - l_max) >= min_p (in float64)."""
    min_p = torch.tensor([r.min_p for r in rows], dtype=torch.float64, device=scaled.device)[:, None]
    scaled64 = scaled.to(torch.float64)
    ratio = torch.exp(scaled64 - scaled64.max(dim=-1, keepdim=True).values)
    return ratio >= min_p


def process_random_rows(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Steps 4-7 for non-greedy rows: temperature-scaled logits with dropped tokens set to -inf.

    ``logits`` must already have penalties and masks applied. The result is the exact input of the Gumbel
    draw (and what a coupled speculative verifier must reproduce).
    """
    if any(r.is_greedy for r in rows):
        raise ValueError("process_random_rows got a greedy row; greedy rows take the argmax instead")
    if not rows:
        return logits
    temperature = _row_tensor(rows, "temperature", logits.dtype, logits.device)[:, None]
    scaled = logits / temperature
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if any(r.top_k > 0 or r.top_p < 1.0 for r in rows):
        keep = _truncation_masks(scaled, rows)
    if any(r.min_p > 0.0 for r in rows):
        keep &= _min_p_mask(scaled.masked_fill(~keep, float("-inf")), rows)
    return scaled.masked_fill(~keep, float("-inf"))


def process_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Steps 1-7 for every row (greedy rows: steps 1-2 only). For tests, debugging and verification."""
    penalized = apply_penalties_and_masks(logits, rows)
    random_idx = [b for b, r in enumerate(rows) if not r.is_greedy]
    if not random_idx:
        return penalized
    out = penalized.clone()
    idx = torch.tensor(random_idx, device=logits.device)
    out[idx] = process_random_rows(penalized[idx], [rows[b] for b in random_idx])
    return out


class Sampler:
    """Stateless batched sampler. ``Sampler()(logits, rows)`` -> :class:`SamplerOutput`.

    Holds no RNG state: all randomness comes from each row's (seed, position, salt).
    """

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        return self.forward(logits, rows)

    def forward(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [B, V] with B == len(rows) == {len(rows)}, got {tuple(logits.shape)}")
        if logits.dtype != torch.float32:
            raise ValueError(f"logits must be float32, got {logits.dtype}")
        device = logits.device
        penalized = apply_penalties_and_masks(logits, rows)
        # Greedy: argmax returns the first maximum, i.e. the lowest token id on ties (documented by torch).
        tokens = torch.argmax(penalized, dim=-1)
        random_idx = [b for b, r in enumerate(rows) if not r.is_greedy]
        if random_idx:
            # Only the sampled rows are processed (index_select, not masking): a row's numbers never depend
            # on how many greedy rows share the step.
            sub_rows = [rows[b] for b in random_idx]
            idx = torch.tensor(random_idx, device=device)
            scores = process_random_rows(penalized[idx], sub_rows)
            seeds = _row_tensor(sub_rows, "seed", torch.int64, device)
            positions = _row_tensor(sub_rows, "position", torch.int64, device)
            salts = _row_tensor(sub_rows, "salt", torch.int64, device)
            tokens = tokens.index_copy(0, idx, gumbel_argmax(scores, seeds, positions, salts))
        return SamplerOutput(token_ids=tokens, logprobs=self._logprobs(logits, tokens, rows))

    @staticmethod
    def _logprobs(
        logits: torch.Tensor, tokens: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> tuple[TokenLogprobs | None, ...]:
        want = [b for b, r in enumerate(rows) if r.num_logprobs is not None]
        out: list[TokenLogprobs | None] = [None] * len(rows)
        if want:
            idx = torch.tensor(want, device=logits.device)
            nums = [rows[b].num_logprobs or 0 for b in want]
            for b, lp in zip(want, token_logprobs(logits[idx], tokens[idx], nums)):
                out[b] = lp
        return tuple(out)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
    """Functional form of :class:`Sampler`."""
    return Sampler()(logits, rows)


__all__ = ["Sampler", "SamplerOutput", "process_logits", "process_random_rows", "sample"]
