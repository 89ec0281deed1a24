"""A simple per-sequence cache for the plain-PyTorch V4.1 model: every per-position value is stored by
absolute position (window KV for every position, ratio-2 compressor rows, compressed entries and index keys
by entry index), so a step over positions [S, S + Q) writes rows [S, S + Q) and rolling back is truncating.

Nothing else crosses steps: the top-k selection and candidate blocks are recomputed for every query, the
mHC ``pre`` is per token, and Engram's lookback reads the token history kept here.

With the DSpark drafter, ``draft`` holds one window per stage: the context KV of every target position whose
taps the drafter has seen (spec §5.2), by position too, so a rollback truncates it with the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _put(rows: torch.Tensor | None, start: int, new: torch.Tensor) -> torch.Tensor:
    """rows[:start] followed by new (position-addressed write; anything past start is dropped)."""
    if rows is None or start == 0:
        return new
    if rows.shape[0] < start:
        raise ValueError(f"cache: writing at {start} but only {rows.shape[0]} rows are stored")
    return torch.cat((rows[:start], new))


@dataclass
class LayerCache:
    window: torch.Tensor | None = None  # [L, D] rope'd (and FP8-rounded) window KV of every position
    gate_kv: torch.Tensor | None = None  # ratio-2 sources: fp32 [L, D] compressor value rows ...
    gate_score: torch.Tensor | None = None  # ... and fp32 [L, D] gate rows; entry j pools rows 2j, 2j+1
    entries: torch.Tensor | None = None  # sources: [E, D] rope'd (NVFP4-rounded) compressed KV
    index_keys: torch.Tensor | None = None  # sources: [E, index_head_dim] rope'd (MXFP4-rounded) keys

    def truncate(self, length: int, ratio: int) -> None:
        for name in ("window", "gate_kv", "gate_score"):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, t[:length])
        for name in ("entries", "index_keys"):
            t = getattr(self, name)
            if t is not None and ratio:
                setattr(self, name, t[:length // ratio])


@dataclass
class V41Cache:
    num_layers: int
    num_draft_layers: int = 0  # DSpark stages (their context KV in ``draft``)
    tokens: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    layers: list[LayerCache] = field(default_factory=list)
    draft: list[LayerCache] = field(default_factory=list)
    # An encoder-side replay (``take_prefix_hit``): steps starting before ``replay_end`` read no window row below
    # ``replay_start`` and emit no compressed entry closing before ``replay_end`` (0, 0: none).
    replay_start: int = 0
    replay_end: int = 0

    def __post_init__(self) -> None:
        if not self.layers:
            self.layers = [LayerCache() for _ in range(self.num_layers)]
        if not self.draft:
            self.draft = [LayerCache() for _ in range(self.num_draft_layers)]

    @property
    def length(self) -> int:
        return int(self.tokens.numel())

    def append_tokens(self, ids: torch.Tensor) -> int:
        """Record the step's token ids; returns the step's first position."""
        start = self.length
        self.tokens = torch.cat((self.tokens.to(ids.device), ids.long()))
        return start

    def skip_window_rows(self, layers: range, start: int, end: int, like: torch.Tensor) -> None:
        """Positions [start, end) that a narrowed prefill (``replay.py``) does not compute in the window of
        ``layers`` and the DSpark context: zero rows shaped like ``like`` [D], which no later query reads
        (every one is at least a window past them)."""
        for lc in [self.layers[i] for i in layers] + self.draft:
            lc.window = _put(lc.window, start, like.new_zeros(end - start, like.shape[-1]))

    def take_prefix_hit(self, boundary: int, replay: int, ratios: tuple[int, ...]) -> None:
        """Continue from a prefix hit at ``boundary`` the way the engine's encoder-side replay does (spec §3.2):
        keep what the hit keeps, the history (token ids, compressed entries and index keys of [0, boundary)),
        and rewind the rest to ``boundary - replay``, so that the next steps recompute the window rows and the
        ratio-2 pair inputs of [boundary - replay, boundary), reading no window row below it and emitting no
        entry closing before ``boundary``. The window rows before it (which the hit does not have) are zeros:
        nothing reads them."""
        start = boundary - replay
        if not (0 < start and boundary <= self.length):
            raise ValueError(f"boundary: a replay of {replay} positions needs a cached boundary in ({replay}, "
                             f"{self.length}], got {boundary}")
        if any(r and start % r for r in ratios):
            raise ValueError(f"boundary: {boundary} - {replay} is not a multiple of the compression ratios {ratios}")
        self.tokens = self.tokens[:start]
        for layer, ratio in zip(self.layers, ratios):
            layer.truncate(start, 0)  # window and pair inputs (entries: kept to the boundary below)
            if ratio and layer.entries is not None:
                kept = boundary // ratio
                layer.entries, layer.index_keys = layer.entries[:kept], layer.index_keys[:kept]
        for layer in self.layers + self.draft:
            layer.truncate(start, 0)
            if layer.window is not None:
                layer.window = torch.zeros_like(layer.window)
        self.replay_start, self.replay_end = start, boundary

    def truncate(self, length: int, ratios: tuple[int, ...]) -> None:
        """Roll back to the first ``length`` positions (e.g. rejected drafts)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"length: {length} is outside [0, {self.length}]")
        self.tokens = self.tokens[:length]
        for layer, ratio in zip(self.layers, ratios):
            layer.truncate(length, ratio)
        for layer in self.draft:
            layer.truncate(length, 0)


write_rows = _put
