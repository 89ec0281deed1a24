"""Prefix-hit planning: which cached blocks a new request can start on, and what it must recompute. Pure Python.

A request's full blocks are named by a hash chain (``kv/prefix_hash.py``); the block pools index the cached
ones. ``HitPlanner.match`` turns a chain into the longest usable ``PrefixHit``: per pool, the table the
request starts with, using markers for the entries that are not yet blocks of the device pools (``FROM_TIER``:
found in a lower tier, loaded at admission; ``COPY``: a private copy of a cached block a replay rewrites;
``FRESH``: a new block a replay fills; ``RELEASED``: a window/state block the request never reads).
``CacheManager.admit`` (``kv/manager.py``) then turns the markers into blocks; planning changes nothing.

Three ways to take a hit at a block boundary P (architecture note §3.5; spec §3.2):

  * **retained tails**: the history blocks [0, P) and the window/state blocks covering the tail behind P
    are all cached: those are exactly the rows the next position reads, so continuing from P computes
    what continuing a full prefill would. Boundaries are tried from the longest history chain down, since
    the chain may reach further than any retained tail.
  * **bounded replay** (V4 layouts with CSA layers): the window blocks behind P are cached but the state
    blocks are not; the request starts ``replay`` positions before P (the compressor state of [P - R, P) is
    all the next position reads, R the largest CSA ratio) and recomputes them. The replay rewrites the rows
    of the window blocks holding replayed positions, so those are private (COPY, or a tier block left
    unnamed).
  * **encoder-side replay** (DeepSeek-V4.1, ``CacheLayout.prefix_replay`` = W): only the history blocks
    [0, H) are needed; the request starts at H - W and recomputes the window and state rows of [H - W, H)
    into FRESH blocks. Boundaries H <= W are not adopted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from deepinfer.kv.block_budget import TAIL_POOLS
from deepinfer.kv.block_pool import BlockPool
from deepinfer.kv.spec import HISTORY, POOLS, STATE, WINDOW

RELEASED = -1  # table entry of a released window/state block (what SeqRun.block_tables expects)
FROM_TIER = -2  # prefix-hit table entry: a block a lower cache tier holds, loaded into a new block at admission
COPY = -3  # prefix-hit table entry (bounded replay): a private copy of a cached block, which the replay rewrites
FRESH = -4  # prefix-hit table entry (bounded replay): a new block the replay fills


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached blocks that let a request start at ``num_tokens`` (a block boundary): per pool, the table it
    starts with (history: every block before the boundary; window/state: -1 up to the tail, then blocks).
    ``FROM_TIER`` entries are blocks found in a lower tier (host memory, disk): ``loads`` names them
    (pool, table index, hash); ``admit`` gives each a new block, which the caller fills before the step, and
    names it by its hash, unless a replay rewrites its rows (then the block is the request's own)."""

    num_tokens: int
    tables: dict[str, tuple[int, ...]]
    loads: tuple[tuple[str, int, bytes], ...] = ()
    # Bounded replay: the request starts ``replay`` positions before the boundary and recomputes them (their
    # compressor state was not retained); ``copies`` (pool, table index, cached block) are the COPY entries.
    replay: int = 0
    copies: tuple[tuple[str, int, int], ...] = ()

    @property
    def start(self) -> int:
        """The request's length after admission: the first position it computes."""
        return self.num_tokens - self.replay

    def rewrites(self, pool: str, index: int, block_size: int) -> bool:
        """Whether the replay rewrites rows of block ``index`` of a tail pool (one holding a replayed position)."""
        return bool(self.replay) and pool in TAIL_POOLS and index >= self.start // block_size


# A lower tier's membership test: whether it holds a block (pool, hash) that the device pools do not.
InTier = Callable[[str, bytes], bool]


@dataclass(frozen=True, slots=True)
class HitPlanner:
    """Plans hits over the device pools of one cache manager (which owns the pools and the layout numbers)."""

    block_size: int
    pools: Mapping[str, BlockPool]
    tail: Mapping[str, int]  # per tail pool: positions behind the write head that the next position reads
    holds_rows: Mapping[str, bool]  # per tail pool: whether any layer keeps rows there
    replay: int  # positions a hit recomputes before its boundary when tails are not retained (0: none)
    window_replay: int  # V4.1's encoder-side replay W (0: the layout takes hits on retained tails)

    def match(self, hashes: tuple[bytes, ...], max_tokens: int, in_tier: InTier | None = None) -> PrefixHit | None:
        """The longest usable hit for a request whose full blocks hash to ``hashes``, ending at most at
        ``max_tokens`` (callers leave at least one token to compute). None when nothing is usable.
        ``in_tier(pool, hash)``: whether a lower tier holds a block the device pools do not."""
        def find(pool: str, h: bytes) -> int | None:
            b = self.pools[pool].lookup(h)
            return FROM_TIER if b is None and in_tier is not None and in_tier(pool, h) else b

        blocks: list[int] = []
        for h in hashes[: max(0, max_tokens) // self.block_size]:
            b = find(HISTORY, h)
            if b is None:
                break
            blocks.append(b)
        if self.window_replay:
            return self._window_replay_hit(hashes, tuple(blocks))
        # The history chain may reach further than any retained tail: try boundaries from the longest down.
        bs = self.block_size
        for nb in range(len(blocks), 0, -1):
            boundary = nb * bs
            tables: dict[str, tuple[int, ...]] = {HISTORY: tuple(blocks[:nb])}
            for p in TAIL_POOLS:
                first = self._first_tail_block(p, boundary)
                found = [find(p, hashes[i]) for i in range(first, nb)]
                if None in found:
                    break
                tables[p] = (RELEASED,) * first + tuple(found)
            else:
                loads = tuple((p, i, hashes[i]) for p in POOLS for i, b in enumerate(tables[p]) if b == FROM_TIER)
                return PrefixHit(boundary, tables, loads)
            hit = self._replay_hit(hashes, boundary, tables[HISTORY], find) if self.replay else None
            if hit is not None:
                return hit
        return None

    def _first_tail_block(self, pool: str, boundary: int) -> int:
        """Index of the first block of ``pool`` that continuing from ``boundary`` reads."""
        if not self.holds_rows[pool]:
            return boundary // self.block_size
        return max(0, boundary - self.tail[pool]) // self.block_size

    def _replay_hit(self, hashes: tuple[bytes, ...], boundary: int, history: tuple[int, ...],
                    find: Callable[[str, bytes], int | None]) -> PrefixHit | None:
        """A hit at ``boundary`` that recomputes its last ``replay`` positions: the window blocks behind them
        must be cached, on the device or in a lower tier; the state blocks it needs are new. The replay rewrites
        the rows of the window blocks holding replayed positions, so the request gets them privately: a device
        block is copied (COPY), a tier block is loaded into a new block that ``admit`` leaves unnamed."""
        bs, start, nb = self.block_size, boundary - self.replay, boundary // self.block_size
        lo = max(0, start - self.tail[WINDOW]) // bs
        window = [find(WINDOW, hashes[i]) for i in range(lo, nb)]
        if None in window:
            return None
        copies = []
        for i in range(start // bs, nb):  # blocks holding replayed positions: copy device-resident ones
            b = window[i - lo]
            if b >= 0:
                copies.append((WINDOW, i, b))
                window[i - lo] = COPY
        state_lo = max(0, start - self.tail[STATE]) // bs
        tables = {HISTORY: history, WINDOW: (RELEASED,) * lo + tuple(window),
                  STATE: (RELEASED,) * state_lo + (FRESH,) * (nb - state_lo)}
        loads = tuple((p, i, hashes[i]) for p in POOLS for i, b in enumerate(tables[p]) if b == FROM_TIER)
        return PrefixHit(boundary, tables, loads, self.replay, tuple(copies))

    def _window_replay_hit(self, hashes: tuple[bytes, ...], history: tuple[int, ...]) -> PrefixHit | None:
        """V4.1's encoder-side replay (spec §3.2): a hit at the end H of the cached history chain that starts at
        H - W and recomputes the window and state rows of [H - W, H) into fresh blocks (the rows before H - W
        are never read); None when H <= W ("hits no longer than the window are not adopted")."""
        boundary, w, bs = len(history) * self.block_size, self.window_replay, self.block_size
        if boundary <= w:
            return None
        nb, lo = len(history), (boundary - w) // bs
        tail = (RELEASED,) * lo + (FRESH,) * (nb - lo)
        tables = {HISTORY: history, WINDOW: tail, STATE: tail}
        loads = tuple((HISTORY, i, hashes[i]) for i, b in enumerate(history) if b == FROM_TIER)
        return PrefixHit(boundary, tables, loads, w)
