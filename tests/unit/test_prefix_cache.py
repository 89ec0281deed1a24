"""CacheManager's prefix cache: naming blocks, hits that need the boundary's tails, sharing, eviction order."""

from __future__ import annotations

import random

import pytest

from deepinfer.kv.block_pool import OutOfBlocks
from deepinfer.kv.block_budget import retained_tail_blocks, tail_blocks_per_boundary
from deepinfer.kv.manager import FROM_TIER, RELEASED
from deepinfer.kv.spec import HISTORY, POOLS, STATE, WINDOW
from tests.unit.test_cache_manager import BS, csa_only, layout, manager


def chain(tag: str, n: int) -> tuple[bytes, ...]:
    """Stand-in hashes: block i of prefix ``tag`` (distinct tags = distinct token streams)."""
    return tuple(f"{tag}:{i}".encode() for i in range(n))


def run(m, rid, n: int, hashes: tuple[bytes, ...]) -> None:
    """Compute ``n`` positions of a new request in one step, naming its full blocks."""
    m.allocate(rid, n)
    m.commit(rid, n, hashes[: n // BS])
    m.check_integrity()


def test_released_blocks_stay_cached_and_a_hit_shares_them() -> None:
    m = manager(n=16)
    h = chain("a", 4)
    run(m, "a", 4 * BS + 10, h)  # 4 full blocks named; the window/state blocks of blocks 0..2 released
    assert m.num_cached_blocks() == {HISTORY: 0, WINDOW: 3, STATE: 3}
    m.free("a")
    assert m.num_cached_blocks() == {HISTORY: 4, WINDOW: 4, STATE: 4}  # the partial block 4 is free
    hit = m.match_prefix(h, max_tokens=4 * BS)
    assert hit.num_tokens == 4 * BS
    assert hit.tables[WINDOW][:3] == (RELEASED,) * 3 and hit.tables[WINDOW][3] != RELEASED
    m.admit("b", hit, 5)
    m.check_integrity()
    assert m.length("b") == 4 * BS and m.capacity("b") == 5 * BS
    assert m.block_tables("b")[HISTORY][:4] == hit.tables[HISTORY]
    # A second request shares the same blocks (ref 2).
    m.admit("c", m.match_prefix(h, 4 * BS), 1)
    assert all(m.pools[HISTORY].ref_count(b) == 2 for b in hit.tables[HISTORY])
    m.check_integrity()


def test_max_tokens_and_missing_tail_choose_an_earlier_boundary() -> None:
    m = manager(n=16)
    h = chain("a", 3)
    run(m, "a", 3 * BS + 1, h)
    m.free("a")
    assert m.match_prefix(h, 3 * BS - 1).num_tokens == 2 * BS  # leave a token to compute
    assert m.match_prefix(h[:1], 10 * BS).num_tokens == BS
    assert m.match_prefix(chain("other", 3), 10 * BS) is None
    # Evict the window block that boundary 3*BS needs: the hit falls back to 2*BS.
    w3 = m.pools[WINDOW].lookup(h[2])
    m.pools[WINDOW]._cached.move_to_end(w3, last=False)
    m.pools[WINDOW].allocate(m.pools[WINDOW].num_free + 1)
    assert m.pools[WINDOW].lookup(h[2]) is None
    assert m.match_prefix(h, 10 * BS).num_tokens == 2 * BS


def test_state_tail_shorter_than_window_tail() -> None:
    """CSA-only layout (window tail 127, state tail 7): an exact hit needs the block before the boundary in
    both pools; kept boundaries retain window blocks only (a bounded replay of 4 positions rebuilds the state,
    from the window behind it: 131 positions, two 128-blocks)."""
    lay = csa_only()
    assert (tail_blocks_per_boundary(lay, WINDOW), tail_blocks_per_boundary(lay, STATE)) == (2, 0)
    m = manager(lay, n=8)
    h = chain("a", 2)
    run(m, "a", 2 * BS + 3, h)
    m.free("a")
    hit = m.match_prefix(h, 10 * BS)
    assert hit.num_tokens == 2 * BS and hit.tables[STATE][0] == RELEASED


def test_admission_counts_revived_blocks_all_or_nothing() -> None:
    m = manager(n={HISTORY: 4, WINDOW: 4, STATE: 4})
    h = chain("a", 2)
    run(m, "a", 2 * BS + 1, h)
    m.free("a")
    hit = m.match_prefix(h, 10 * BS)  # takes back 2 history + 1 window + 1 state cached blocks
    assert m.can_admit(hit, 2 * BS) and not m.can_admit(hit, 2 * BS + 1)
    before = (m.num_cached_blocks(), {p: m.num_free_blocks(p) for p in POOLS})
    with pytest.raises(OutOfBlocks):
        m.admit("b", hit, 2 * BS + 1)
    assert (m.num_cached_blocks(), {p: m.num_free_blocks(p) for p in POOLS}) == before and "b" not in m
    m.admit("b", hit, 2 * BS)
    m.check_integrity()


def test_rows_of_a_named_block_are_never_rewritten() -> None:
    m = manager(n=8, slack=2 * BS)  # window/state rows stay resident: only the naming limits the rollback
    run(m, "a", 2 * BS + 5, chain("a", 2))
    m.truncate("a", 2 * BS)  # dropping positions past the named blocks is fine
    with pytest.raises(ValueError, match="cached prefix"):
        m.truncate("a", 2 * BS - 3)  # would rewrite rows inside named block 1
    m.truncate("a", BS)  # whole blocks past BS are dropped: they stay cached for others
    assert m.pools[HISTORY].num_cached == 1
    m.check_integrity()


def test_duplicate_content_keeps_one_copy() -> None:
    m = manager(n=8)
    h = chain("a", 1)
    run(m, "a", BS + 1, h)
    run(m, "b", BS + 1, h)  # computed the same prefix at the same time: b's block stays unnamed
    m.free("a")
    m.free("b")
    assert m.pools[HISTORY].num_cached == 1 and m.match_prefix(h, 10 * BS).num_tokens == BS
    assert m.reset_prefix_cache() == 3 and m.match_prefix(h, 10 * BS) is None
    m.check_integrity()


def test_retained_tail_budget() -> None:
    lay = layout()
    per = sum(tail_blocks_per_boundary(lay, p) * lay.bytes_per_block(p, 4) for p in (WINDOW, STATE))
    assert per == 2 * lay.bytes_per_block(WINDOW, 4)  # window blocks behind a 4-position replay at 128-blocks
    assert retained_tail_blocks(lay, 10 * per + per - 1, 4) == {WINDOW: 20, STATE: 0}


def test_evicted_state_tail_gives_a_bounded_replay() -> None:
    """Boundary 3*BS keeps its window blocks but not its state block: the hit starts 4 positions early with a
    private copy of the window block it rewrites and new state blocks; the shared blocks are untouched."""
    m = manager(n=16)
    h = chain("a", 3)
    run(m, "a", 3 * BS + 1, h)
    m.free("a")
    s2 = m.pools[STATE].lookup(h[2])
    m.pools[STATE]._cached.move_to_end(s2, last=False)
    m.pools[STATE].free(m.pools[STATE].allocate(m.pools[STATE].num_free + 1))  # evicts boundary 3*BS's state
    hit = m.match_prefix(h, 10 * BS)
    assert (hit.num_tokens, hit.replay, hit.start) == (3 * BS, 4, 3 * BS - 4)
    w2 = m.pools[WINDOW].lookup(h[2])
    assert hit.copies == ((WINDOW, 2, w2),)
    admission = m.admit("b", hit, 10)
    tables = m.block_tables("b")
    (pool, src, dst), = admission.copies
    assert (pool, src) == (WINDOW, w2) and tables[WINDOW][2] == dst != w2
    assert tables[WINDOW][1] == m.pools[WINDOW].lookup(h[1])  # the window behind the replay is shared
    assert RELEASED not in tables[STATE][2:] and m.pools[STATE].block_hash(tables[STATE][2]) is None
    assert m.length("b") == 3 * BS - 4
    m.commit("b", 3 * BS + 6, h)  # its own copy and state block stay unnamed: the cached ones keep the names
    assert m.pools[WINDOW].block_hash(dst) is None and m.pools[WINDOW].lookup(h[2]) == w2
    m.check_integrity()
    no_replay = manager(n=16, replay=False)
    run(no_replay, "a", 3 * BS + 1, h)
    no_replay.free("a")
    s2 = no_replay.pools[STATE].lookup(h[2])
    no_replay.pools[STATE]._cached.move_to_end(s2, last=False)
    no_replay.pools[STATE].allocate(no_replay.pools[STATE].num_free + 1)
    assert no_replay.match_prefix(h, 10 * BS).num_tokens == 2 * BS


def test_replay_loads_tier_window_blocks_privately() -> None:
    """Boundary 3*BS whose window and state blocks left the device, a lower tier holding the window blocks but
    no state (as with replay): the hit replays 4 positions; the window block behind them is loaded and named
    (shared from then on), the one holding replayed positions is loaded into a private block that no index
    entry ever points at. Admission stays all or nothing."""
    m = manager(n=16)
    h = chain("a", 3)
    run(m, "a", 3 * BS + 1, h)
    m.free("a")
    assert m.pools[WINDOW].reset_cache() == 3 and m.pools[STATE].reset_cache() == 3  # evicted (to the tier)
    tier = {(WINDOW, h[1]), (WINDOW, h[2])}
    in_tier = lambda pool, content: (pool, content) in tier  # noqa: E731
    assert m.match_prefix(h, 10 * BS) is None
    hit = m.match_prefix(h, 10 * BS, in_tier)
    assert (hit.num_tokens, hit.replay, hit.start, hit.copies) == (3 * BS, 4, 3 * BS - 4, ())
    assert hit.tables[WINDOW] == (RELEASED, FROM_TIER, FROM_TIER)
    assert hit.loads == ((WINDOW, 1, h[1]), (WINDOW, 2, h[2]))
    # All or nothing: 2 loaded window blocks + 1 new one for positions past the boundary.
    held = m.pools[WINDOW].allocate(m.pools[WINDOW].num_available - 2)
    before = (m.num_cached_blocks(), {p: m.num_free_blocks(p) for p in POOLS})
    assert not m.can_admit(hit, 10)
    with pytest.raises(OutOfBlocks):
        m.admit("b", hit, 10)
    assert (m.num_cached_blocks(), {p: m.num_free_blocks(p) for p in POOLS}) == before and "b" not in m
    m.pools[WINDOW].free(held)
    assert m.can_admit(hit, 10)
    admission = m.admit("b", hit, 10)
    tables = m.block_tables("b")
    w1, w2 = tables[WINDOW][1:3]
    assert admission.fills == ((WINDOW, w1, h[1]), (WINDOW, w2, h[2])) and admission.copies == ()
    assert m.pools[WINDOW].lookup(h[1]) == w1 and m.pools[WINDOW].block_hash(w2) is None
    assert m.pools[WINDOW].lookup(h[2]) is None and m.length("b") == 3 * BS - 4
    m.check_integrity()
    m.commit("b", 3 * BS + 6, h)  # commits name blocks from the boundary on: the private block stays unnamed
    assert m.pools[WINDOW].block_hash(w2) is None
    # A second hit (b's commit released w1, now cached): w1 is revived from the device, the replayed block
    # loaded again from the tier into another private block.
    hit2 = m.match_prefix(h, 10 * BS, in_tier)
    assert hit2.tables[WINDOW] == (RELEASED, w1, FROM_TIER) and hit2.loads == ((WINDOW, 2, h[2]),)
    m.admit("c", hit2, 1)
    assert m.block_tables("c")[WINDOW][1] == w1 and m.block_tables("c")[WINDOW][2] not in (w2, RELEASED)
    m.check_integrity()
    m.free("b")
    m.free("c")
    assert m.pools[WINDOW].lookup(h[1]) == w1 and m.pools[WINDOW].lookup(h[2]) is None
    m.check_integrity()


def test_random_hits_and_releases_keep_integrity() -> None:
    """Random requests over a few shared prefixes: every hit's blocks hold that prefix, integrity holds."""
    rng = random.Random(7)
    m = manager(n={HISTORY: 12, WINDOW: 10, STATE: 10})
    live: dict[int, tuple[str, int]] = {}
    for rid in range(400):
        if live and (rng.random() < 0.5 or len(live) > 3):
            victim = rng.choice(sorted(live))
            m.free(victim)
            del live[victim]
        tag = rng.choice("abc")
        n = rng.randint(1, 4 * BS)
        h = chain(tag, n // BS)
        hit = m.match_prefix(h, n - 1)
        if hit is not None:
            assert all(m.pools[HISTORY].block_hash(b) == h[i] for i, b in enumerate(hit.tables[HISTORY]))
            if not m.can_admit(hit, n - hit.num_tokens):
                continue
            m.admit(rid, hit, n - hit.num_tokens)
        elif m.can_allocate(rid, n):
            m.allocate(rid, n)
        else:
            continue
        m.commit(rid, n, h)
        live[rid] = (tag, n)
        m.check_integrity()
