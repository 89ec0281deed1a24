"""BlockPool: integer block ids of one cache pool, a free list and reference counts. Pure Python.

The pool knows nothing about tensors: a block id is an index into the pool's storage tensors, which live
elsewhere (``deepinfer.kv.storage``). Keeping this module free of torch lets the allocator, and everything
built on it, be tested on CPU in milliseconds (design guide §4 principle 5).

Free-list order is FIFO: a fresh pool hands out ids 0, 1, 2, ... (lowest first); a freed block goes to the
*back* of the queue, so it is handed out again only after every block freed before it. Two reasons:
  * it is the order a prefix cache wants later: blocks freed long ago are evicted first (LRU), and a
    caller that frees a sequence's blocks tail-first makes the least reusable blocks go first;
  * a stale id kept by a buggy caller is not immediately recycled, so use-after-free shows up in
    integrity checks rather than as silently shared rows.

Reference counts leave room for prefix sharing: ``allocate`` returns blocks with ref 1, ``incref`` adds a
sharer, ``decref``/``free`` drop one, and a block goes back to the free list when its count reaches 0.
Each block has an optional content-hash slot for the future prefix index; it is cleared when the block
is freed because nothing is cached yet (``num_cached`` is 0: a cached block would be ref 0, hashed and
kept off the free list until evicted).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class OutOfBlocks(RuntimeError):
    """Raised when an allocation cannot be served in full; nothing was allocated."""

    def __init__(self, pool: str, requested: int, available: int) -> None:
        super().__init__(f"pool {pool!r}: requested {requested} blocks, only {available} free")
        self.pool = pool
        self.requested = requested
        self.available = available


class BlockPool:
    def __init__(self, num_blocks: int, name: str = "blocks") -> None:
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks: must be an int >= 0, got {num_blocks!r}")
        self.name = name
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref: list[int] = [0] * num_blocks  # 0 <=> on the free list (while nothing is cached)
        self._hash: list[int | None] = [None] * num_blocks

    # ---------------------------------------------------------------------------------------- counters
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks with ref 0 kept for prefix reuse (always 0 until the prefix index exists)."""
        return 0

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free) - self.num_cached

    def ref_count(self, block: int) -> int:
        self._check_id(block)
        return self._ref[block]

    def ref_counts(self) -> list[int]:
        """A copy of every block's ref count, indexed by id (for cross-checks by the owner of tables)."""
        return list(self._ref)

    # ------------------------------------------------------------------------------------- alloc/free
    def allocate(self, k: int) -> list[int]:
        """Take ``k`` blocks off the front of the free list, each with ref 1. All or nothing."""
        if k < 0:
            raise ValueError(f"k: must be >= 0, got {k}")
        if k > len(self._free):
            raise OutOfBlocks(self.name, k, len(self._free))
        ids = [self._free.popleft() for _ in range(k)]
        for b in ids:
            self._ref[b] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        """Add one sharer to each id (repeats count). Only blocks in use can be shared."""
        ids = list(ids)
        for b in ids:  # validate everything first so a bad id leaves the pool unchanged
            self._check_id(b)
            if self._ref[b] == 0:
                raise ValueError(f"pool {self.name!r}: incref of free block {b}")
        for b in ids:
            self._ref[b] += 1

    def decref(self, ids: Iterable[int]) -> list[int]:
        """Drop one reference per id (repeats count); return the ids that went back to the free list.

        Blocks reaching 0 are appended to the free list in the order given, so a caller that wants a
        sequence's tail evicted first passes its blocks tail-first.
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
                self._hash[b] = None  # nothing is cached yet: a free block carries no content
                self._free.append(b)
                released.append(b)
        return released

    def free(self, ids: Iterable[int]) -> list[int]:
        """Release the caller's reference to each block (same as ``decref``)."""
        return self.decref(ids)

    # ------------------------------------------------------------------------------------ content hash
    def set_hash(self, block: int, content_hash: int | None) -> None:
        self._check_id(block)
        if self._ref[block] == 0:
            raise ValueError(f"pool {self.name!r}: cannot hash free block {block}")
        self._hash[block] = content_hash

    def block_hash(self, block: int) -> int | None:
        self._check_id(block)
        return self._hash[block]

    # --------------------------------------------------------------------------------------- checking
    def check_integrity(self) -> None:
        """free + cached + used == total; the free list holds exactly the ref-0 blocks, once each."""
        name, n = self.name, self.num_blocks
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            dups = sorted(b for b, c in Counter(self._free).items() if c > 1)
            raise AssertionError(f"pool {name!r}: duplicate ids on the free list: {dups[:10]}")
        bad = [b for b in free_set if not 0 <= b < n]
        if bad:
            raise AssertionError(f"pool {name!r}: out-of-range ids on the free list: {sorted(bad)[:10]}")
        neg = [b for b, r in enumerate(self._ref) if r < 0]
        if neg:
            raise AssertionError(f"pool {name!r}: negative ref counts for blocks {neg[:10]}")
        used = [b for b, r in enumerate(self._ref) if r > 0]
        both = sorted(free_set.intersection(used))
        if both:
            raise AssertionError(f"pool {name!r}: blocks both free and used: {both[:10]}")
        lost = [b for b, r in enumerate(self._ref) if r == 0 and b not in free_set]
        if lost:  # with no cached state, a ref-0 block off the free list is leaked
            raise AssertionError(f"pool {name!r}: ref-0 blocks missing from the free list: {lost[:10]}")
        if len(self._free) + self.num_cached + len(used) != n:
            raise AssertionError(
                f"pool {name!r}: free {len(self._free)} + cached {self.num_cached} + used {len(used)} != {n}"
            )
        hashed_free = [b for b in free_set if self._hash[b] is not None]
        if hashed_free:
            raise AssertionError(f"pool {name!r}: free blocks carry content hashes: {sorted(hashed_free)[:10]}")

    def _check_id(self, block: int) -> None:
        if not isinstance(block, int) or not 0 <= block < self.num_blocks:
            raise ValueError(f"pool {self.name!r}: block id {block!r} out of range [0, {self.num_blocks})")

    def __repr__(self) -> str:
        return f"BlockPool({self.name!r}, total={self.num_blocks}, free={self.num_free}, used={self.num_used})"
