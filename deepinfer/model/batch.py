"""ForwardBatch: the explicit metadata one model step needs (no hidden global forward context).

A step advances several sequences, each by a contiguous run of new tokens (a prefill chunk, one decode
token, or a verify run). Tokens of all sequences are flattened into one [T] array, sequence by sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class SeqRun:
    """One sequence's new tokens in this step."""

    start: int  # offset of its first token in the flat token array
    length: int  # number of new tokens
    first_pos: int  # absolute position of its first new token (tokens already in the cache)
    block_tables: dict[str, tuple[int, ...]]  # pool name -> block ids covering positions 0.. (-1: released)

    @property
    def end_pos(self) -> int:
        return self.first_pos + self.length


@dataclass(frozen=True, slots=True)
class ForwardBatch:
    runs: tuple[SeqRun, ...]

    @property
    def num_tokens(self) -> int:
        return sum(r.length for r in self.runs)

    def positions(self, device: torch.device | str = "cpu") -> torch.Tensor:
        parts = [torch.arange(r.first_pos, r.end_pos, dtype=torch.long) for r in self.runs]
        return (torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)).to(device)

    def check(self) -> None:
        offset = 0
        for i, r in enumerate(self.runs):
            if r.start != offset or r.length <= 0 or r.first_pos < 0:
                raise ValueError(f"runs[{i}]: expected start={offset}, length > 0, first_pos >= 0; got {r}")
            offset += r.length
