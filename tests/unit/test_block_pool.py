"""BlockPool: FIFO free list, all-or-nothing allocation, ref counts, hash slot, integrity checks."""

from __future__ import annotations

import random

import pytest

from deepinfer.kv.block_pool import BlockPool, OutOfBlocks


def state(pool: BlockPool) -> tuple:
    return list(pool._free), list(pool._ref), list(pool._hash)


def test_fresh_pool_hands_out_lowest_ids_first():
    pool = BlockPool(8, "history")
    assert (pool.num_free, pool.num_used, pool.num_cached) == (8, 0, 0)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(0) == []
    assert pool.allocate(2) == [3, 4]
    assert (pool.num_free, pool.num_used) == (3, 5)
    assert all(pool.ref_count(b) == 1 for b in range(5))
    pool.check_integrity()


def test_free_is_fifo_freed_blocks_are_reused_last():
    pool = BlockPool(5, "window")
    ids = pool.allocate(3)  # 0, 1, 2; free list is 3, 4
    assert pool.free([ids[2], ids[0]]) == [2, 0]
    pool.check_integrity()
    assert pool.allocate(4) == [3, 4, 2, 0]  # old free blocks first, then in the order freed
    assert pool.num_free == 0
    pool.check_integrity()


def test_out_of_blocks_never_allocates_partially():
    pool = BlockPool(4, "state")
    pool.allocate(3)
    before = state(pool)
    with pytest.raises(OutOfBlocks) as exc:
        pool.allocate(2)
    assert (exc.value.pool, exc.value.requested, exc.value.available) == ("state", 2, 1)
    assert "state" in str(exc.value)
    assert state(pool) == before
    pool.check_integrity()
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_refcount_sharing_returns_block_at_zero():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.incref([b, b])
    assert pool.ref_count(b) == 3
    assert pool.decref([b]) == []
    assert pool.free([b]) == []
    assert pool.num_used == 1 and pool.ref_count(b) == 1
    pool.check_integrity()
    assert pool.decref([b]) == [b]
    assert pool.num_free == 4 and pool.ref_count(b) == 0
    pool.check_integrity()


def test_bad_release_or_share_changes_nothing():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    before = state(pool)
    with pytest.raises(ValueError, match="cannot drop 2"):
        pool.free([a, b, b])  # b would be dropped twice: validated before anything is applied
    with pytest.raises(ValueError, match="ref 0"):
        pool.free([3])  # never allocated
    with pytest.raises(ValueError, match="out of range"):
        pool.free([4])
    with pytest.raises(ValueError, match="incref of free block"):
        pool.incref([a, 2])
    assert state(pool) == before
    pool.check_integrity()


def test_hashed_block_is_cached_on_release_and_taken_back_by_touch():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.block_hash(a) is None
    assert pool.set_hash(a, b"A") and pool.block_hash(a) == b"A"
    assert not pool.set_hash(b, b"A")  # the content is already held by a: one copy is enough
    assert not pool.set_hash(a, b"other")  # a block is named once
    assert pool.free([a, b]) == [a, b]
    assert (pool.num_free, pool.num_cached, pool.num_used, pool.num_available) == (2, 1, 0, 3)
    assert pool.lookup(b"A") == a and pool.lookup(b"B") is None
    pool.check_integrity()
    pool.touch([a])  # a prefix hit takes it back with its content
    assert pool.ref_count(a) == 1 and pool.num_cached == 0 and pool.block_hash(a) == b"A"
    pool.touch([a])  # a second sharer
    assert pool.ref_count(a) == 2
    with pytest.raises(ValueError, match="touch of free block"):
        pool.touch([b])
    with pytest.raises(ValueError, match="free block"):
        pool.set_hash(b, b"B")
    with pytest.raises(ValueError, match="non-empty bytes"):
        pool.set_hash(a, 0xABC)
    pool.check_integrity()


def test_allocation_takes_free_blocks_before_evicting_lru_cached_ones():
    pool = BlockPool(4)
    ids = pool.allocate(4)
    for i, b in enumerate(ids):
        pool.set_hash(b, bytes([i + 1]))
    pool.record_evictions()
    pool.free([ids[2], ids[0], ids[1]])  # cached in this order: 2 is the least recently released
    pool.free([ids[3]])
    assert pool.num_cached == 4 and pool.num_free == 0
    assert pool.allocate(2) == [ids[2], ids[0]]
    assert pool.drain_evictions() == [(b"\x03", ids[2]), (b"\x01", ids[0])]
    assert pool.num_evictions == 2 and pool.lookup(b"\x03") is None and pool.block_hash(ids[2]) is None
    pool.free([ids[2]])  # no content any more: free, and taken before the cached ones
    assert pool.allocate(1) == [ids[2]]
    with pytest.raises(OutOfBlocks):
        pool.allocate(3)
    assert pool.num_cached == 2  # the failed allocation evicted nothing
    assert pool.reset_cache() == 2 and pool.num_free == 2 and pool.lookup(b"\x02") is None
    pool.check_integrity()


def test_empty_pool():
    pool = BlockPool(0, "state")
    assert pool.allocate(0) == []
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)
    pool.check_integrity()
    with pytest.raises(ValueError):
        BlockPool(-1)


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda p: p._free.append(p._free[0]), "duplicate ids"),
        (lambda p: p._free.append(0), "both free and used"),
        (lambda p: p._free.remove(5), "missing from the free list"),
        (lambda p: p._ref.__setitem__(0, -1), "negative ref"),
        (lambda p: p._free.append(99), "out-of-range"),
        (lambda p: p._hash.__setitem__(5, b"x"), "content hashes"),
        (lambda p: p._cached.__setitem__(p._free.popleft(), None), "without a content hash"),
        (lambda p: p._index.__setitem__(b"y", 1), "index disagrees"),
    ],
)
def test_integrity_catches_corruption(corrupt, message):
    pool = BlockPool(8, "history")
    pool.allocate(3)
    pool.check_integrity()
    corrupt(pool)
    with pytest.raises(AssertionError, match=message):
        pool.check_integrity()


def test_random_ops_match_shadow_refcounts():
    rng = random.Random(1234)
    pool = BlockPool(32, "history")
    refs: dict[int, int] = {}  # shadow: used block -> ref count
    for _ in range(3000):
        op = rng.random()
        if op < 0.4:
            k = rng.randint(0, 6)
            if k > 32 - len(refs):
                with pytest.raises(OutOfBlocks):
                    pool.allocate(k)
            else:
                ids = pool.allocate(k)
                assert not set(ids) & set(refs) and len(set(ids)) == k
                refs.update((b, 1) for b in ids)
        elif op < 0.55 and refs:
            ids = rng.sample(sorted(refs), min(len(refs), rng.randint(1, 3)))
            pool.incref(ids)
            for b in ids:
                refs[b] += 1
        elif refs:
            ids = rng.sample(sorted(refs), min(len(refs), rng.randint(1, 4)))
            released = pool.decref(ids)
            for b in ids:
                refs[b] -= 1
            assert released == [b for b in ids if refs[b] == 0]
            refs = {b: r for b, r in refs.items() if r}
        pool.check_integrity()
        assert pool.num_used == len(refs) and pool.num_free == 32 - len(refs)
        assert all(pool.ref_count(b) == r for b, r in refs.items())
