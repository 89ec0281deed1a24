"""What every layer of one V4.1 step reads: positions, RoPE angles, the cache, the cross-layer CSA2 state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.model.v41.cache import LayerCache, V41Cache


@dataclass(frozen=True, slots=True)
class StepContext:
    positions: torch.Tensor  # [Q] absolute positions of the step's tokens, start .. start + Q - 1
    start: int
    angles: dict[str, torch.Tensor]  # "main" / "compress" -> fp32 [Q, rope_dim / 2]
    cache: V41Cache
    cache_qdq: bool  # round window KV / indexer q,k / compressed KV as the reference caches do
    window_from: int = 0  # no query reads window KV below this position (the replays' kv_start)
    # The encoder-side replay of a prefix hit (spec §3.2): compressed entries closing before this position are
    # cached already and stay as first computed (the step recomputes their positions' window rows only).
    emit_from: int = 0

    @property
    def end(self) -> int:
        return self.start + int(self.positions.numel())


@dataclass
class SharedKV:
    """CSA2 state handed from layer to layer within one step (spec §1.4): the compressed entries and index
    keys of the latest KV source, and the latest index source's top-k (entry ids per query, -1 = none) and
    the candidate mask published by the candidate source."""

    source: LayerCache | None = None
    ratio: int = 0
    topk: torch.Tensor | None = None  # [Q, k] long
    candidates: torch.Tensor | None = None  # [Q, E] bool

    def narrowed(self, kept: int) -> "SharedKV":
        """The state of the step's last ``kept`` queries (the decoder replay's rows)."""
        return SharedKV(self.source, self.ratio, None if self.topk is None else self.topk[-kept:],
                        None if self.candidates is None else self.candidates[-kept:])


@dataclass
class SharedLists:
    """``SharedKV`` of every sequence of a step at once (the engine's ``key_lists``): the latest KV source's
    entries and index keys of the step's sequences, concatenated in run order, its ratio, the latest index
    source's top-k as rows of them per query (-1 = none) and the candidate mask the candidate source published
    (per query, over the widest sequence's entries: ``select_lists``)."""

    entries: torch.Tensor | None = None  # [Re, D]
    index_keys: torch.Tensor | None = None  # [Re, d]
    ratio: int = 0
    rows: torch.Tensor | None = None  # [T, K] long
    candidates: torch.Tensor | None = None  # [T, E] bool

    def narrowed(self, sel: torch.Tensor) -> "SharedLists":
        """The state of the step's query rows ``sel`` (the decoder replay's rows)."""
        return SharedLists(self.entries, self.index_keys, self.ratio, None if self.rows is None else self.rows[sel],
                           None if self.candidates is None else self.candidates[sel])
