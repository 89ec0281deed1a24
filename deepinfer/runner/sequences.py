"""SequenceCache: position-addressed per-sequence state for direct model use (tests, tools, eval).

Each sequence owns a block table per pool, grown on demand from a free list, and a length n. Rolling back
("truncate to n") only sets the length: rows at positions >= n are simply overwritten by later writes.
The engine's cache manager supersedes this for serving (admission, preemption, prefix sharing); this class
is the smallest correct owner of paged state and is what the model-level tests drive.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from deepinfer.kv.spec import POOLS, CacheLayout
from deepinfer.kv.storage import KVStorage
from deepinfer.model.batch import ForwardBatch, SeqRun


class SequenceCache:
    def __init__(self, layout: CacheLayout, num_blocks: int | Mapping[str, int], dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        counts = {p: num_blocks for p in POOLS} if isinstance(num_blocks, int) else dict(num_blocks)
        self.layout = layout
        self.storage = KVStorage(layout, counts, dtype, device)
        self._free = {p: list(range(counts[p] - 1, -1, -1)) for p in POOLS}
        self._tables: dict[int, dict[str, list[int]]] = {}
        # Each sequence's tables as tuples and the blocks they cover, until they grow: ``plan`` hands the
        # same tuple objects to every step in between (no per-step copy; a graph's ``StepBuffer`` then
        # sees unchanged tables at a pointer comparison), and skips ``_ensure`` while they cover the step.
        self._frozen: dict[int, tuple[dict[str, tuple[int, ...]], int]] = {}
        self._lengths: dict[int, int] = {}
        self._next_id = 0

    def new_sequence(self) -> int:
        sid = self._next_id
        self._next_id += 1
        self._tables[sid] = {p: [] for p in POOLS}
        self._lengths[sid] = 0
        return sid

    def length(self, sid: int) -> int:
        return self._lengths[sid]

    def truncate(self, sid: int, n: int) -> None:
        """Roll the sequence back to its first n tokens: O(1), nothing is copied or cleared."""
        if not 0 <= n <= self._lengths[sid]:
            raise ValueError(f"n: must be in [0, {self._lengths[sid]}], got {n}")
        self._lengths[sid] = n

    def free(self, sid: int) -> None:
        for pool, table in self._tables.pop(sid).items():
            self._free[pool].extend(b for b in reversed(table) if b >= 0)
        self._frozen.pop(sid, None)
        del self._lengths[sid]

    def _ensure(self, sid: int, end_pos: int) -> None:
        need = -(-end_pos // self.layout.block_size)
        for pool, table in self._tables[sid].items():
            if len(table) < need:
                self._frozen.pop(sid, None)  # the tuples ``plan`` handed out no longer match
            while len(table) < need:
                if not self._free[pool]:
                    raise RuntimeError(f"SequenceCache: pool {pool!r} is out of blocks")
                table.append(self._free[pool].pop())

    def plan(self, new_tokens: Mapping[int, Sequence[int]]) -> tuple[torch.Tensor, ForwardBatch]:
        """Build the flat token array and ForwardBatch appending ``new_tokens[sid]`` to each sequence."""
        runs, ids, offset = [], [], 0
        frozen, bs = self._frozen, self.layout.block_size
        for sid, toks in new_tokens.items():
            start, n = self._lengths[sid], len(toks)
            hit = frozen.get(sid)
            if hit is None or hit[1] * bs < start + n:
                self._ensure(sid, start + n)
                tables = self._tables[sid]
                hit = frozen[sid] = ({p: tuple(t) for p, t in tables.items()}, min(map(len, tables.values())))
            runs.append(SeqRun(offset, n, start, dict(hit[0])))
            ids += map(int, toks)
            offset += n
        return torch.tensor(ids, dtype=torch.long), ForwardBatch(tuple(runs))

    def commit(self, new_tokens: Mapping[int, Sequence[int]]) -> None:
        for sid, toks in new_tokens.items():
            self._lengths[sid] += len(toks)
