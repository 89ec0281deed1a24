"""CacheManager: per-request block tables over the three pools of the hybrid paged cache. Pure Python.

Every pool is paged by the same logical block of ``block_size`` positions, so a request's three tables
always have the same length (block i of every pool covers positions [i*bs, (i+1)*bs)). What differs is
how long a block must live (architecture note §3.4):

  * ``history`` blocks cover [0, n) for as long as the request lives;
  * ``window`` and ``state`` blocks are read only for the last ``tail(pool)`` positions behind the write
    head. Blocks entirely before [n - tail - spec_slack, n) are released at ``commit`` and their table
    entries become -1. ``spec_slack`` keeps enough extra positions that rolling back up to that many
    tokens (rejected drafts) still finds its window/state rows resident.

A request's life: ``allocate(r, k)`` reserves blocks for [n, n+k) in every pool (all or nothing, so a
request never holds a partial step), the model writes rows, ``commit(r, n')`` records the new length and
releases tail blocks, ``truncate(r, n')`` rolls back (position-addressed state makes that "set n" plus
returning the blocks past n), ``free(r)`` drops everything. Requests are identified by any hashable id.

Prefix caching (``kv/prefix_hash.py`` names each full block by a hash chain over the tokens before its end):
``cache_blocks`` names a request's computed blocks in every pool, so that when they are released (a tail
block passed by, a request freed) they stay *cached* in their pool instead of free. ``match_prefix`` plans
the longest usable hit (``kv/prefix_hits.py``: retained window/state tails, V4's bounded replay, or
DeepSeek-V4.1's encoder-side replay, which needs the history blocks only and reads no window/state row below
its start, ``_Request.floor``). ``admit`` registers a request on such a hit: it shares the blocks (their rows
are never written again: the request writes positions >= its start only, in blocks of its own), gives each
marker entry of the hit a block of its own, and starts at ``hit.start``.

The manager is torch-free on purpose: it deals in block ids; storage tensors are sized from
``num_blocks`` elsewhere, and ``kv/block_budget.py`` computes those sizes from a byte budget.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

from deepinfer.kv.block_budget import TAIL_POOLS, cdiv, replay_length
from deepinfer.kv.block_pool import BlockPool, OutOfBlocks
from deepinfer.kv.prefix_hits import COPY, FRESH, FROM_TIER, RELEASED, HitPlanner, InTier, PrefixHit
from deepinfer.kv.spec import HISTORY, POOLS, CacheLayout

# Re-exported: callers name the table markers and the hit type where they meet the manager.
__all__ = ["Admission", "CacheManager", "COPY", "FRESH", "FROM_TIER", "PrefixHit", "RELEASED"]


@dataclass(slots=True)
class _Request:
    length: int = 0  # n: positions whose state is in the cache
    tables: dict[str, list[int]] = field(default_factory=lambda: {p: [] for p in POOLS})
    # Per tail pool, the index of the first block not yet released; entries before it are all -1.
    # Releases only ever happen at the front and truncation only at the back, so -1s form a prefix.
    first_live: dict[str, int] = field(default_factory=lambda: {p: 0 for p in TAIL_POOLS})
    num_hashed: int = 0  # leading blocks named by ``cache_blocks``
    # ``commit`` releases no tail block while the length is below this (a decode step's usual case: the
    # per-pool release check is skipped); 0: not known, check. Reset wherever ``first_live`` moves back.
    release_from: int = 0
    floor: int = 0  # no window/state row below this position is read (an encoder-side replay's start)


@dataclass(frozen=True, slots=True)
class Admission:
    """Work a prefix hit leaves for the owner of the storage, before the request's next step: ``fills``
    (pool, new block, hash) to load from a lower tier, ``copies`` (pool, source block, new block) to copy."""

    fills: tuple[tuple[str, int, bytes], ...] = ()
    copies: tuple[tuple[str, int, int], ...] = ()


class CacheManager:
    def __init__(self, layout: CacheLayout, num_blocks: Mapping[str, int], spec_slack: int = 0,
                 bounded_replay: bool = True) -> None:
        missing = [p for p in POOLS if p not in num_blocks]
        if missing:
            raise ValueError(f"num_blocks: missing pools {missing}")
        if spec_slack < 0:
            raise ValueError(f"spec_slack: must be >= 0, got {spec_slack}")
        self.layout = layout
        self.block_size = layout.block_size
        self.spec_slack = spec_slack
        self.pools = {p: BlockPool(num_blocks[p], p) for p in POOLS}
        self._tail = {p: layout.tail(p) for p in TAIL_POOLS}
        # Tail pools that hold rows at all: a layout without compressed layers has an empty state pool,
        # whose (zero-byte) blocks are still tracked for uniform tables but never limit a rollback.
        self._holds_rows = {p: any(t.pool == p for s in layout.layers for t in s.tensors) for p in TAIL_POOLS}
        # Bounded replay (architecture note §3.5): at a block boundary P (a multiple of every ratio) the next
        # position reads compressor state of [P - R, P) only, R the largest CSA ratio (the overlapping window;
        # an HCA window starts afresh at P). Without cached state blocks a hit recomputes those R positions
        # from the retained window KV, emitting no entry (they are cached), instead of giving up the boundary.
        self.replay = replay_length(layout) if bounded_replay else 0
        # V4.1's encoder-side replay: a hit recomputes the last ``window_replay`` positions before its boundary
        # from the history blocks alone (``kv/prefix_hits.py``).
        self.window_replay = layout.prefix_replay
        self.replay = self.window_replay or self.replay
        self._hits = HitPlanner(self.block_size, self.pools, self._tail, self._holds_rows, self.replay,
                                self.window_replay)
        self._reqs: dict[Hashable, _Request] = {}
        # (req, pool, start, ids, length) per table change, for a consumer that mirrors the tables (the
        # scheduler turns them into a plan's table edits); None: not recorded.
        self._edits: list[tuple] | None = None

    # ------------------------------------------------------------------------------------------- edits
    def track_edits(self) -> None:
        """Record every table change from now on (``drain_edits`` hands them out)."""
        if self._edits is None:
            self._edits = []

    def drain_edits(self) -> list[tuple]:
        """Table changes since the last drain, oldest first: (req_id, pool, start, block ids, table length).
        A freed request's edits are dropped (its table is gone as a whole)."""
        edits, self._edits = self._edits or [], ([] if self._edits is not None else None)
        return edits

    def _edited(self, req_id: Hashable, pool: str, start: int, table: list[int], end: int | None = None) -> None:
        """Record that ``table[start:end]`` changed (and the table's length)."""
        if self._edits is not None:
            self._edits.append((req_id, pool, start, tuple(table[start:end]), len(table)))

    # ------------------------------------------------------------------------------------------ queries
    def blocks_for_count(self, n: int) -> int:
        """Blocks needed to cover ``n`` positions."""
        return cdiv(n, self.block_size)

    def __contains__(self, req_id: Hashable) -> bool:
        return req_id in self._reqs

    @property
    def num_requests(self) -> int:
        return len(self._reqs)

    def length(self, req_id: Hashable) -> int:
        return self._get(req_id).length

    def capacity(self, req_id: Hashable) -> int:
        """Positions the request's blocks cover (>= its length; more after an uncommitted allocate)."""
        return len(self._get(req_id).tables[HISTORY]) * self.block_size

    def block_tables(self, req_id: Hashable) -> dict[str, tuple[int, ...]]:
        """Pool -> block ids (a snapshot; the engine's runner mirrors the tables through ``drain_edits``)."""
        return {p: tuple(t) for p, t in self._get(req_id).tables.items()}

    def num_free_blocks(self, pool: str) -> int:
        """Blocks an allocation in ``pool`` can take (free ones and cached ones it may evict)."""
        return self.pools[pool].num_available

    def usage(self) -> dict[str, float]:
        return {p: (bp.num_used / bp.num_blocks if bp.num_blocks else 0.0) for p, bp in self.pools.items()}

    def blocks_needed(self, req_id: Hashable, num_new_tokens: int) -> dict[str, int]:
        """New blocks per pool that ``allocate(req_id, num_new_tokens)`` would take (unknown id: n = 0).

        The same in every pool today (tables share one length and block indices >= n // bs are always
        resident); per pool so that prefix hits, which will share history blocks only, fit the same API.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens: must be >= 0, got {num_new_tokens}")
        r = self._reqs.get(req_id)
        n, have = (r.length, len(r.tables[HISTORY])) if r else (0, 0)
        need = max(0, self.blocks_for_count(n + num_new_tokens) - have)
        return {p: need for p in POOLS}

    def covers(self, req_id: Hashable, num_new_tokens: int) -> bool:
        """The request's blocks already cover its next ``num_new_tokens`` positions: ``allocate`` takes nothing
        (the common decode step: checked before building ``blocks_needed``'s per-pool dict)."""
        r = self._reqs.get(req_id)
        return r is not None and 0 <= num_new_tokens and r.length + num_new_tokens <= len(r.tables[HISTORY]) * self.block_size

    def can_allocate(self, req_id: Hashable, num_new_tokens: int) -> bool:
        if self.covers(req_id, num_new_tokens):
            return True
        need = self.blocks_needed(req_id, num_new_tokens)
        return all(need[p] <= self.pools[p].num_available for p in POOLS)

    # -------------------------------------------------------------------------------------- mutations
    def allocate(self, req_id: Hashable, num_new_tokens: int) -> None:
        """Make blocks for positions [n, n + num_new_tokens) resident in every pool.

        Admission checks every pool before taking anything, so on OutOfBlocks no pool and no table has
        changed (and an unknown request is not registered). Idempotent for the same range: blocks
        allocated earlier but not yet committed are reused.
        """
        if self.covers(req_id, num_new_tokens):
            return
        need = self.blocks_needed(req_id, num_new_tokens)
        for p in POOLS:
            if need[p] > self.pools[p].num_available:
                raise OutOfBlocks(p, need[p], self.pools[p].num_available)
        r = self._reqs.get(req_id)
        if r is None:
            r = self._reqs[req_id] = _Request()
        for p in POOLS:
            if need[p]:
                start = len(r.tables[p])
                r.tables[p].extend(self.pools[p].allocate(need[p]))
                self._edited(req_id, p, start, r.tables[p])

    # ------------------------------------------------------------------------------------ prefix cache
    def match_prefix(self, hashes: tuple[bytes, ...], max_tokens: int, in_tier: InTier | None = None) -> PrefixHit | None:
        """The longest usable hit for a request whose full blocks hash to ``hashes``, ending at most at
        ``max_tokens`` (callers leave at least one token to compute); None when nothing is usable. Planning
        only (``kv/prefix_hits.py``); ``admit`` takes the hit. ``in_tier(pool, hash)``: whether a lower tier
        holds a block the device pools do not."""
        return self._hits.match(hashes, max_tokens, in_tier)

    def _admission_need(self, hit: PrefixHit, num_new_tokens: int) -> dict[str, int]:
        """Per pool: blocks ``admit`` takes out of the available ones (new blocks, blocks to load from a
        tier, copies and fresh blocks of a replay, and cached hit blocks, which leave the eviction order)."""
        total = self.blocks_for_count(hit.start + num_new_tokens)
        need = {}
        for p in POOLS:
            table = hit.tables[p]
            revived = sum(1 for b in table if b >= 0 and self.pools[p].is_cached(b))
            taken = sum(1 for b in table if b in (FROM_TIER, COPY, FRESH))
            need[p] = revived + taken + max(0, total - len(table))
        return need

    def can_admit(self, hit: PrefixHit, num_new_tokens: int) -> bool:
        need = self._admission_need(hit, num_new_tokens)
        return all(need[p] <= self.pools[p].num_available for p in POOLS)

    def admit(self, req_id: Hashable, hit: PrefixHit, num_new_tokens: int) -> Admission:
        """Register a new request on a prefix hit: share the hit's blocks, start at length ``hit.start``, and
        allocate blocks for its next ``num_new_tokens`` positions. All or nothing (OutOfBlocks). Returns what
        the caller must do to the new blocks before the request's next step reads them."""
        if req_id in self._reqs:
            raise ValueError(f"request {req_id!r} is already registered; a hit applies to a new request only")
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens: must be >= 0, got {num_new_tokens}")
        need = self._admission_need(hit, num_new_tokens)
        for p in POOLS:
            if need[p] > self.pools[p].num_available:
                raise OutOfBlocks(p, need[p], self.pools[p].num_available)
        # A replay's copies and fresh blocks are its own (never named: the blocks before the boundary are).
        r = self._reqs[req_id] = _Request(length=hit.start, num_hashed=hit.num_tokens // self.block_size,
                                          floor=hit.start if self.window_replay else 0)
        filled: list[tuple[str, int, bytes]] = []
        copies: list[tuple[str, int, int]] = []
        for p in POOLS:
            table = list(hit.tables[p])
            self.pools[p].touch([b for b in table if b >= 0])
            loads = [x for x in hit.loads if x[0] == p]
            for (_, i, h), b in zip(loads, self.pools[p].allocate(len(loads))):
                table[i] = b
                if not hit.rewrites(p, i, self.block_size):  # else private: the index never names rows a replay rewrites
                    self.pools[p].set_hash(b, h)
                filled.append((p, b, h))
            own = [i for i, b in enumerate(table) if b in (COPY, FRESH)]
            source = {i: src for pool, i, src in hit.copies if pool == p}
            for i, b in zip(own, self.pools[p].allocate(len(own))):
                if table[i] == COPY:
                    copies.append((p, source[i], b))
                table[i] = b
            if p in TAIL_POOLS:
                r.first_live[p] = sum(1 for b in table if b == RELEASED)
            r.tables[p] = table
            self._edited(req_id, p, 0, table)
        self.allocate(req_id, num_new_tokens)
        return Admission(tuple(filled), tuple(copies))

    def cache_blocks(self, req_id: Hashable, hashes: tuple[bytes, ...]) -> None:
        """Name the request's leading blocks by ``hashes`` (block i holds the rows of the prefix that
        ``hashes[i]`` names) in every pool where the block is still resident, so that they stay cached once
        released. Only blocks whose rows are computed: ``len(hashes) * block_size <= length``."""
        r = self._get(req_id)
        if len(hashes) * self.block_size > r.length:
            raise ValueError(f"hashes: {len(hashes)} blocks name more than the {r.length} computed positions "
                             f"of request {req_id!r}")
        # With the encoder-side replay no hit reads a cached window/state row: those blocks go back free.
        pools = (HISTORY,) if self.window_replay else POOLS
        for i in range(r.num_hashed, len(hashes)):
            for p in pools:
                b = r.tables[p][i]
                if b != RELEASED:
                    self.pools[p].set_hash(b, hashes[i])
        r.num_hashed = max(r.num_hashed, len(hashes))

    def record_evictions(self) -> None:
        """Keep every evicted cached block (pool, block id, hash) for ``drain_evictions`` (a lower tier takes
        a copy before the block's rows are overwritten)."""
        for bp in self.pools.values():
            bp.record_evictions()

    def drain_evictions(self) -> list[tuple[str, int, bytes]]:
        return [(p, b, h) for p, bp in self.pools.items() for h, b in bp.drain_evictions()]

    def cached_blocks(self) -> list[tuple[str, int, bytes]]:
        """(pool, block id, hash) of every cached (unused) block, least recently used first per pool."""
        return [(p, b, bp.block_hash(b)) for p, bp in self.pools.items() for b in bp.cached_ids()]

    def num_cached_blocks(self) -> dict[str, int]:
        return {p: bp.num_cached for p, bp in self.pools.items()}

    def reset_prefix_cache(self) -> int:
        """Forget every cached (unused) block; return how many were dropped across the pools."""
        return sum(bp.reset_cache() for bp in self.pools.values())

    def commit(self, req_id: Hashable, num_computed: int, hashes: tuple[bytes, ...] = ()) -> None:
        """Set the request's cached length to ``num_computed`` after a step; release stale tail blocks.

        Length only moves forward here (rollback is ``truncate``) and cannot pass the allocated blocks.
        ``hashes`` (prefix caching) name the leading full blocks first (``cache_blocks``), so that the tail
        blocks this commit releases stay cached rather than free.
        """
        r = self._get(req_id)
        cap = len(r.tables[HISTORY]) * self.block_size
        if not r.length <= num_computed <= cap:
            raise ValueError(
                f"num_computed: must be in [{r.length}, {cap}] for request {req_id!r} "
                f"(current length, allocated capacity; roll back with truncate), got {num_computed}"
            )
        r.length = num_computed
        if len(hashes) > r.num_hashed:
            self.cache_blocks(req_id, hashes)
        if num_computed < r.release_from:
            return
        bs = self.block_size
        for p in TAIL_POOLS:
            # Block i is entirely before the keep range iff (i+1)*bs <= start, i.e. i < start // bs.
            start = max(0, num_computed - self._tail[p] - self.spec_slack)
            keep_from = start // bs
            lo = r.first_live[p]
            if keep_from > lo:
                table = r.tables[p]
                stale = table[lo:keep_from]
                table[lo:keep_from] = [RELEASED] * len(stale)
                self.pools[p].free(stale)  # oldest first: they become the first evicted later
                r.first_live[p] = keep_from
                self._edited(req_id, p, lo, table, keep_from)
        # The next release: block first_live[p] leaves once start >= (first_live[p] + 1) * bs.
        r.release_from = min(((r.first_live[p] + 1) * bs + self._tail[p] + self.spec_slack for p in TAIL_POOLS),
                             default=0)

    def truncate(self, req_id: Hashable, n: int) -> None:
        """Roll the request back to its first ``n`` positions, returning every block past them.

        Position-addressed state makes this O(blocks returned): rows at positions >= n are simply
        overwritten later. Raises ValueError (changing nothing) if the window/state rows that position
        n needs were already released, i.e. the rollback is deeper than ``spec_slack`` allowed for;
        such a request must be freed and recomputed instead.
        """
        r = self._get(req_id)
        if not 0 <= n <= r.length:
            raise ValueError(f"n: must be in [0, {r.length}] for request {req_id!r}, got {n}")
        if 0 < n < r.floor:
            raise ValueError(f"truncate({req_id!r}, {n}): the request's window rows start at {r.floor} (an "
                             "encoder-side replay); free and recompute")
        if n > 0:
            for p in (p for p in TAIL_POOLS if self._holds_rows[p]):
                need_from = max(0, n - self._tail[p], r.floor) // self.block_size
                if need_from < r.first_live[p]:
                    raise ValueError(
                        f"truncate({req_id!r}, {n}): {p} rows from position {need_from * self.block_size} "
                        f"were released (length {r.length}, spec_slack {self.spec_slack}); free and recompute"
                    )
        if n % self.block_size and n // self.block_size < r.num_hashed:
            raise ValueError(f"truncate({req_id!r}, {n}): block {n // self.block_size} holds a cached prefix and "
                             "cannot be rewritten in place; free and recompute")
        keep = self.blocks_for_count(n)
        for p in POOLS:
            table = r.tables[p]
            dropped = [b for b in reversed(table[keep:]) if b != RELEASED]  # tail first
            del table[keep:]
            self.pools[p].free(dropped)
            self._edited(req_id, p, keep, table)
        for p in TAIL_POOLS:  # a no-op unless n == 0 or the pool holds no rows: -1s stay a prefix
            r.first_live[p] = min(r.first_live[p], keep)
        r.release_from = 0
        r.length = n
        r.num_hashed = min(r.num_hashed, n // self.block_size)

    def free(self, req_id: Hashable) -> None:
        """Release all of the request's blocks now (finish, abort, preemption) and forget it."""
        r = self._reqs.pop(req_id, None)
        if r is None:
            raise KeyError(f"unknown request {req_id!r}")
        if self._edits:
            self._edits = [e for e in self._edits if e[0] != req_id]
        for p in POOLS:
            # Tail first: the prefix cache's LRU then evicts the least reusable (deepest) blocks first.
            self.pools[p].free([b for b in reversed(r.tables[p]) if b != RELEASED])

    # ---------------------------------------------------------------------------------------- checking
    def check_integrity(self) -> None:
        """Every pool is consistent, and each block's ref count equals the number of tables holding it."""
        for bp in self.pools.values():
            bp.check_integrity()
        refs = {p: [0] * bp.num_blocks for p, bp in self.pools.items()}
        for rid, r in self._reqs.items():
            self._check_request(rid, r)
            for p in POOLS:
                counts = refs[p]
                for b in r.tables[p]:
                    if b != RELEASED:
                        if not 0 <= b < len(counts):
                            raise AssertionError(f"request {rid!r}: {p} block id {b} out of range")
                        counts[b] += 1
        for p, bp in self.pools.items():
            actual = bp.ref_counts()
            if actual != refs[p]:
                b = next(i for i, (x, y) in enumerate(zip(actual, refs[p])) if x != y)
                raise AssertionError(f"pool {p!r}: block {b} has ref {actual[b]} but {refs[p][b]} table references")

    def _check_request(self, rid: Hashable, r: _Request) -> None:
        lengths = {p: len(t) for p, t in r.tables.items()}
        if len(set(lengths.values())) != 1:
            raise AssertionError(f"request {rid!r}: tables differ in length {lengths}")
        nblocks = lengths[HISTORY]
        if nblocks < self.blocks_for_count(r.length):
            raise AssertionError(f"request {rid!r}: length {r.length} but only {nblocks} blocks")
        if RELEASED in r.tables[HISTORY]:
            raise AssertionError(f"request {rid!r}: released entry in the history table")
        for p in TAIL_POOLS:
            lo, table = r.first_live[p], r.tables[p]
            if any(b != RELEASED for b in table[:lo]) or RELEASED in table[lo:]:
                raise AssertionError(f"request {rid!r}: {p} table {table} is not -1s up to index {lo} then ids")
            if lo > len(table):
                raise AssertionError(f"request {rid!r}: {p} released {lo} blocks of a {len(table)}-block table")
            # Rows the next token reads (n - tail .. n) must be resident.
            limit = max(0, r.length - self._tail[p], r.floor) // self.block_size
            if self._holds_rows[p] and lo > limit:
                raise AssertionError(f"request {rid!r}: {p} released up to block {lo}, needed from {limit}")

    def _get(self, req_id: Hashable) -> _Request:
        r = self._reqs.get(req_id)
        if r is None:
            raise KeyError(f"unknown request {req_id!r}")
        return r
