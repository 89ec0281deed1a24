"""SamplingTensors: the sampler's per-row inputs as tensors, whoever built them.

Two producers share one sampler core (``sampler.py``): ``from_rows`` turns ``SamplingRow`` objects into
tensors (the reference form, used by tests and direct callers), and the runner's persistent batch state
(``runner/input_batch.py``) gathers them from per-slot device tensors without walking any token history.
Both must give the same tensors for the same rows, bit for bit, which is what makes the engine's tokens
equal the reference sampler's.

Host-side facts (which rows are greedy, whether any row uses top-k/top-p/min-p or a penalty) travel as
plain Python values so the sampler can skip whole stages without reading anything back from the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from deepinfer.sampling.metadata import SamplingRow


@dataclass(frozen=True, slots=True, eq=False)
class Penalties:
    """Penalty inputs of the rows (all [b, ...] on the logits' device); None where no row uses one."""

    repetition: torch.Tensor | None = None  # [b] float32 penalty (1.0: none)
    seen: torch.Tensor | None = None  # [b, V] bool: token in prompt or output (repetition penalty)
    frequency: torch.Tensor | None = None  # [b] float32
    presence: torch.Tensor | None = None  # [b] float32
    counts: torch.Tensor | None = None  # [b, V] float32: output-token counts (presence / frequency)


@dataclass(frozen=True, slots=True, eq=False)
class SamplingTensors:
    temperature: torch.Tensor  # [b] float32 (the logits' dtype)
    top_k: torch.Tensor  # [b] int64, 0: off
    top_p: torch.Tensor  # [b] float64
    min_p: torch.Tensor  # [b] float64
    seeds: torch.Tensor  # [b] int64
    positions: torch.Tensor  # [b] int64: absolute position of the token being drawn
    salts: torch.Tensor  # [b] int64
    random_rows: tuple[int, ...]  # rows that draw (the others are greedy: argmax)
    random_idx: torch.Tensor  # [len(random_rows)] int64 on the device: the same rows
    use_truncation: bool  # some drawing row has top_k > 0 or top_p < 1
    use_top_p: bool  # some drawing row has top_p < 1
    use_min_p: bool  # some drawing row has min_p > 0
    penalties: Penalties  # all None: no row has a penalty
    masked: tuple[torch.Tensor, torch.Tensor] | None  # (row idx, token idx) forced to -inf (min_tokens)
    num_logprobs: tuple[int | None, ...]  # per row; None: no logprobs

    @property
    def num_rows(self) -> int:
        return len(self.num_logprobs)

    def drawing(self) -> "SamplingTensors":
        """The drawing-stage inputs of the drawing rows, in order; penalties and masks are not carried."""
        idx, rows = self.random_idx, self.random_rows
        return SamplingTensors(
            temperature=self.temperature[idx], top_k=self.top_k[idx], top_p=self.top_p[idx], min_p=self.min_p[idx],
            seeds=self.seeds[idx], positions=self.positions[idx], salts=self.salts[idx],
            random_rows=tuple(range(len(rows))), random_idx=torch.arange(len(rows), device=idx.device),
            use_truncation=self.use_truncation, use_top_p=self.use_top_p,
            use_min_p=self.use_min_p, penalties=Penalties(), masked=None,
            num_logprobs=tuple(self.num_logprobs[r] for r in rows))


def from_rows(rows: Sequence[SamplingRow], vocab_size: int, dtype: torch.dtype, device: torch.device | str) -> SamplingTensors:
    """The tensors of ``rows`` (the reference producer)."""

    def col(attr: str, dt: torch.dtype) -> torch.Tensor:
        return torch.tensor([getattr(r, attr) for r in rows], dtype=dt, device=device)

    drawing = [r for r in rows if not r.is_greedy]
    random_rows = tuple(b for b, r in enumerate(rows) if not r.is_greedy)
    return SamplingTensors(
        temperature=col("temperature", dtype), top_k=col("top_k", torch.int64), top_p=col("top_p", torch.float64),
        min_p=col("min_p", torch.float64), seeds=col("seed", torch.int64), positions=col("position", torch.int64),
        salts=col("salt", torch.int64),
        random_rows=random_rows, random_idx=torch.tensor(random_rows, dtype=torch.long, device=device),
        use_truncation=any(r.top_k > 0 or r.top_p < 1.0 for r in drawing),
        use_top_p=any(r.top_p < 1.0 for r in drawing),
        use_min_p=any(r.min_p > 0.0 for r in drawing),
        penalties=_row_penalties(rows, vocab_size, dtype, device),
        masked=_pairs(rows, "masked_token_ids", vocab_size, device),
        num_logprobs=tuple(r.num_logprobs for r in rows),
    )


def _check_ids(tok_idx: list[int], vocab_size: int, what: str) -> None:
    if tok_idx and not 0 <= min(tok_idx) <= max(tok_idx) < vocab_size:
        raise ValueError(f"{what} contains a token id outside [0, {vocab_size}): {min(tok_idx)}..{max(tok_idx)}")


def _pairs(rows: Sequence[SamplingRow], attr: str, vocab_size: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
    row_idx: list[int] = []
    tok_idx: list[int] = []
    for b, row in enumerate(rows):
        ids = getattr(row, attr)
        row_idx.extend([b] * len(ids))
        tok_idx.extend(ids)
    if not row_idx:
        return None
    _check_ids(tok_idx, vocab_size, attr)
    return torch.tensor(row_idx, device=device), torch.tensor(tok_idx, device=device)


def _row_penalties(rows: Sequence[SamplingRow], vocab_size: int, dtype: torch.dtype, device) -> Penalties:
    shape = (len(rows), vocab_size)
    rep = seen = freq = pres = counts = None
    if any(r.has_repetition_penalty for r in rows):
        seen = torch.zeros(shape, dtype=torch.bool, device=device)
        pairs = _pairs(rows, "seen_token_ids", vocab_size, device)
        if pairs is not None:
            seen[pairs] = True
        rep = torch.tensor([r.repetition_penalty for r in rows], dtype=dtype, device=device)
    if any(r.has_count_penalty for r in rows):
        row_idx = [b for b, r in enumerate(rows) for _ in r.output_token_counts]
        tok_idx = [t for r in rows for t, _ in r.output_token_counts]
        _check_ids(tok_idx, vocab_size, "output_token_counts")
        counts = torch.zeros(shape, dtype=dtype, device=device)
        if row_idx:
            values = [float(c) for r in rows for _, c in r.output_token_counts]
            counts[torch.tensor(row_idx, device=device), torch.tensor(tok_idx, device=device)] = torch.tensor(
                values, dtype=dtype, device=device)
        freq = torch.tensor([r.frequency_penalty for r in rows], dtype=dtype, device=device)
        pres = torch.tensor([r.presence_penalty for r in rows], dtype=dtype, device=device)
    return Penalties(repetition=rep, seen=seen, frequency=freq, presence=pres, counts=counts)
