"""BlockPool: integer block ids of one cache pool, reference counts, and the prefix cache's index. Pure Python.

The pool knows nothing about tensors: a block id is an index into the pool's storage tensors, which live
elsewhere (``deepinfer.kv.storage``). Keeping this module free of torch lets the allocator, and everything
built on it, be tested on CPU in milliseconds (design guide §4 principle 5).

Every block is in exactly one of three states:
  * **used** — ref count >= 1: some request's table holds it;
  * **cached** — ref 0 but it carries a content hash (the hash chain of ``kv/prefix_hash.py``): its rows are
    still valid for that prefix, so a later request with the same prefix can take it back (``touch``);
  * **free** — ref 0 and no content.

``allocate`` takes free blocks first, and only then evicts cached ones, least recently released first (LRU):
a block that held something is worth more than one that holds nothing. Free blocks are handed out FIFO
(a fresh pool gives 0, 1, 2, ...; a freed block goes to the back), so a stale id kept by a buggy caller is
not immediately recycled and use-after-free shows up in integrity checks rather than as shared rows.

A caller that releases a request's blocks tail-first makes the least reusable blocks (deepest in the
chain) the first to be evicted, and a prefix hit then stops at the first missing block, never in a hole.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable


class OutOfBlocks(RuntimeError):
    """Raised when an allocation cannot be served in full; nothing was allocated."""

    def __init__(self, pool: str, requested: int, available: int) -> None:
        super().__init__(f"pool {pool!r}: requested {requested} blocks, only {available} available")
        self.pool = pool
        self.requested = requested
        self.available = available


class BlockPool:
    def __init__(self, num_blocks: int, name: str = "blocks") -> None:
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks: must be an int >= 0, got {num_blocks!r}")
        self.name = name
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))  # ref 0, no content: FIFO
        self._cached: OrderedDict[int, None] = OrderedDict()  # ref 0, hashed: LRU order, oldest first
        self._ref: list[int] = [0] * num_blocks
        self._hash: list[bytes | None] = [None] * num_blocks
        self._index: dict[bytes, int] = {}  # content hash -> the block holding it (used or cached)
        self.num_evictions = 0  # cached blocks handed out again (lifetime counter, for metrics)
        # (hash, block) of each eviction since the last drain, when a lower tier wants a copy first.
        self._evicted: list[tuple[bytes, int]] | None = None

    # ---------------------------------------------------------------------------------------- counters
    @property
    def num_free(self) -> int:
        """Blocks holding nothing."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Ref-0 blocks kept for prefix reuse (evicted on demand)."""
        return len(self._cached)

    @property
    def num_available(self) -> int:
        """Blocks an allocation may take: free ones, then cached ones by eviction."""
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_available

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref[block]

    def ref_counts(self) -> list[int]:
        """A copy of every block's ref count, indexed by id (for cross-checks by the owner of tables)."""
        return list(self._ref)

    # ------------------------------------------------------------------------------------- alloc/free
    def allocate(self, k: int) -> list[int]:
        """Take ``k`` blocks, each with ref 1: free ones first, then the least recently cached (their
        content is forgotten). All or nothing."""
        if k < 0:
            raise ValueError(f"k: must be >= 0, got {k}")
        if k > self.num_available:
            raise OutOfBlocks(self.name, k, self.num_available)
        ids = [self._free.popleft() for _ in range(min(k, len(self._free)))]
        while len(ids) < k:
            b, _ = self._cached.popitem(last=False)
            h = self._hash[b]
            del self._index[h]
            self._hash[b] = None
            self.num_evictions += 1
            if self._evicted is not None:
                self._evicted.append((h, b))
            ids.append(b)
        for b in ids:
            self._ref[b] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """Add one sharer to each id (repeats count). Only blocks in use can be shared (``touch`` takes
        cached ones back)."""
        ids = list(ids)
        for b in ids:  # validate everything first so a bad id leaves the pool unchanged
            self._check_id(b)
            if self._ref[b] == 0:
                raise ValueError(f"pool {self.name!r}: incref of free block {b}")
        for b in ids:
            self._ref[b] += 1

    def touch(self, ids: Iterable[int]) -> None:
        """Take a reference on blocks found through ``lookup``: used ones gain a sharer, cached ones leave
        the eviction order. Free blocks hold nothing and cannot be touched."""
        ids = list(ids)
        for b in ids:
            self._check_id(b)
            if self._ref[b] == 0 and b not in self._cached:
                raise ValueError(f"pool {self.name!r}: touch of free block {b} (it holds no content)")
        for b in ids:
            if self._ref[b] == 0:
                del self._cached[b]
            self._ref[b] += 1

    def decref(self, ids: Iterable[int]) -> list[int]:
        """Drop one reference per id (repeats count); return the ids whose count reached 0.

        A block reaching 0 becomes cached if it carries a hash (most recently used end) and free otherwise,
        in the order given: a caller that wants a request's tail evicted first passes its blocks tail-first.
        """
        ids = list(ids)
        drops = Counter(ids)
        for b, c in drops.items():  # validate first: a double free must not half-apply
            self._check_id(b)
            if self._ref[b] < c:
                raise ValueError(f"pool {self.name!r}: block {b} has ref {self._ref[b]}, cannot drop {c}")
        released = []
        for b in ids:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    self._free.append(b)
                else:
                    self._cached[b] = None
                released.append(b)
        return released

    def free(self, ids: Iterable[int]) -> list[int]:
        """Release the caller's reference to each block (same as ``decref``)."""
        return self.decref(ids)

    # ------------------------------------------------------------------------------------ content hash
    def set_hash(self, block: int, content_hash: bytes) -> bool:
        """Name a used block's content for prefix reuse. False (nothing changes) when another block already
        holds that content (two requests computed the same prefix at once: one copy is enough) or this block
        is already named."""
        self._check_id(block)
        if self._ref[block] == 0:
            raise ValueError(f"pool {self.name!r}: cannot hash free block {block}")
        if not isinstance(content_hash, bytes) or not content_hash:
            raise ValueError(f"content_hash: must be non-empty bytes, got {content_hash!r}")
        if self._hash[block] is not None or content_hash in self._index:
            return False
        self._hash[block] = content_hash
        self._index[content_hash] = block
        return True

    def block_hash(self, block: int) -> bytes | None:
        self._check_id(block)
        return self._hash[block]

    def lookup(self, content_hash: bytes) -> int | None:
        """The block holding ``content_hash`` (used or cached), or None."""
        return self._index.get(content_hash)

    def is_cached(self, block: int) -> bool:
        """Ref 0 and kept for reuse (taking it back lowers ``num_available``)."""
        return block in self._cached

    def cached_ids(self) -> list[int]:
        """The cached blocks, least recently released first."""
        return list(self._cached)

    def record_evictions(self) -> None:
        """Keep (hash, block) of every eviction from now on, for ``drain_evictions``."""
        if self._evicted is None:
            self._evicted = []

    def drain_evictions(self) -> list[tuple[bytes, int]]:
        out, self._evicted = self._evicted or [], ([] if self._evicted is not None else None)
        return out

    def reset_cache(self) -> int:
        """Forget every cached block's content (they become free); return how many. Used blocks keep theirs."""
        dropped = list(self._cached)
        for b in dropped:
            del self._index[self._hash[b]]
            self._hash[b] = None
            self._free.append(b)
        self._cached.clear()
        return len(dropped)

    # --------------------------------------------------------------------------------------- checking
    def check_integrity(self) -> None:
        """free + cached + used == total; the free list holds exactly the ref-0 blocks without content, the
        cached set exactly the ref-0 blocks with it; the index and the blocks' hashes agree."""
        name, n = self.name, self.num_blocks
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            dups = sorted(b for b, c in Counter(self._free).items() if c > 1)
            raise AssertionError(f"pool {name!r}: duplicate ids on the free list: {dups[:10]}")
        bad = [b for b in free_set | set(self._cached) if not 0 <= b < n]
        if bad:
            raise AssertionError(f"pool {name!r}: out-of-range ids on the free list: {sorted(bad)[:10]}")
        neg = [b for b, r in enumerate(self._ref) if r < 0]
        if neg:
            raise AssertionError(f"pool {name!r}: negative ref counts for blocks {neg[:10]}")
        used = [b for b, r in enumerate(self._ref) if r > 0]
        both = sorted((free_set | set(self._cached)).intersection(used))
        if both:
            raise AssertionError(f"pool {name!r}: blocks both free and used: {both[:10]}")
        cached_and_free = sorted(free_set.intersection(self._cached))
        if cached_and_free:
            raise AssertionError(f"pool {name!r}: blocks both free and cached: {cached_and_free[:10]}")
        lost = [b for b, r in enumerate(self._ref) if r == 0 and b not in free_set and b not in self._cached]
        if lost:
            raise AssertionError(f"pool {name!r}: ref-0 blocks missing from the free list: {lost[:10]}")
        if len(self._free) + len(self._cached) + len(used) != n:
            raise AssertionError(
                f"pool {name!r}: free {len(self._free)} + cached {len(self._cached)} + used {len(used)} != {n}")
        hashed_free = [b for b in free_set if self._hash[b] is not None]
        if hashed_free:
            raise AssertionError(f"pool {name!r}: free blocks carry content hashes: {sorted(hashed_free)[:10]}")
        unhashed_cached = [b for b in self._cached if self._hash[b] is None]
        if unhashed_cached:
            raise AssertionError(f"pool {name!r}: cached blocks without a content hash: {unhashed_cached[:10]}")
        named = {h: b for b, h in enumerate(self._hash) if h is not None}
        if named != self._index:
            raise AssertionError(f"pool {name!r}: the content index disagrees with the blocks' hashes")

    def _check_id(self, block: int) -> None:
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"pool {self.name!r}: block id {block!r} out of range [0, {self.num_blocks})")

    def __repr__(self) -> str:
        return (f"BlockPool({self.name!r}, total={self.num_blocks}, free={self.num_free}, "
                f"cached={self.num_cached}, used={self.num_used})")
