"""CacheManager: admission across pools, tail release, rollback, freeing, integrity, sizing; random ops."""

from __future__ import annotations

import random

import pytest

from deepinfer.config import ModelConfig
from deepinfer.kv.block_pool import OutOfBlocks
from deepinfer.kv.block_budget import blocks_for_budget, cdiv, tail_blocks_per_seq
from deepinfer.kv.manager import CacheManager
from deepinfer.kv.spec import HISTORY, POOLS, STATE, WINDOW, CacheLayout, build_layout
from tests.oracle.hf import tiny_native_config

BS = 128


def tiny_config(**overrides) -> dict:
    return tiny_native_config(**overrides)


def layout(**overrides) -> CacheLayout:
    return build_layout(ModelConfig.from_dict(tiny_config(**overrides)), BS)


def csa_only() -> CacheLayout:
    """Window tail 127, state tail 7: the two tail pools release at different points."""
    lay = layout(compress_ratios=[0, 4, 4, 0])
    assert (lay.tail(WINDOW), lay.tail(STATE)) == (127, 7)
    return lay


def manager(lay: CacheLayout | None = None, n: int | dict = 16, slack: int = 0, replay: bool = True) -> CacheManager:
    counts = {p: n for p in POOLS} if isinstance(n, int) else n
    return CacheManager(lay or layout(), counts, spec_slack=slack, bounded_replay=replay)


def frees(m: CacheManager) -> dict[str, int]:
    return {p: m.num_free_blocks(p) for p in POOLS}


def step(m: CacheManager, rid, k: int) -> None:
    m.allocate(rid, k)
    m.commit(rid, m.length(rid) + k)
    m.check_integrity()


def test_allocate_new_request_and_commit():
    m = manager()
    assert m.can_allocate("a", 300)
    m.allocate("a", 300)  # 3 blocks of 128 in every pool
    m.check_integrity()
    assert "a" in m and m.length("a") == 0 and m.capacity("a") == 384
    tables = m.block_tables("a")
    assert tables == {p: (0, 1, 2) for p in POOLS}
    assert all(isinstance(t, tuple) for t in tables.values())
    assert frees(m) == {p: 13 for p in POOLS}
    assert m.usage() == {p: 3 / 16 for p in POOLS}
    m.commit("a", 300)  # tail 127: keep [173, 300) -> block 0 released in window and state
    m.check_integrity()
    tables = m.block_tables("a")
    assert tables[HISTORY] == (0, 1, 2)
    assert tables[WINDOW] == tables[STATE] == (-1, 1, 2)
    assert frees(m) == {HISTORY: 13, WINDOW: 14, STATE: 14}


def test_allocate_is_idempotent_for_an_uncommitted_range():
    m = manager()
    m.allocate("a", 100)
    m.allocate("a", 100)
    m.allocate("a", 50)  # still inside block 0
    assert m.block_tables("a")[HISTORY] == (0,)
    m.allocate("a", 129)
    assert m.block_tables("a")[HISTORY] == (0, 1)
    m.allocate("b", 0)  # registers a request that holds nothing yet
    assert "b" in m and m.block_tables("b") == {p: () for p in POOLS}
    m.check_integrity()


@pytest.mark.parametrize("short", POOLS)
def test_admission_fails_when_any_one_pool_is_short(short):
    counts = {p: 8 for p in POOLS}
    counts[short] = 3
    m = manager(n=counts)
    m.allocate("a", 2 * BS)
    m.check_integrity()
    before = (frees(m), m.block_tables("a"))
    assert not m.can_allocate("b", 2 * BS)
    assert not m.can_allocate("a", 4 * BS)  # existing request growing past the short pool
    assert m.can_allocate("b", BS)
    with pytest.raises(OutOfBlocks) as exc:
        m.allocate("b", 2 * BS)
    assert exc.value.pool == short and (exc.value.requested, exc.value.available) == (2, 1)
    with pytest.raises(OutOfBlocks):
        m.allocate("a", 4 * BS)
    assert "b" not in m and m.num_requests == 1  # a failed new request is not registered
    assert (frees(m), m.block_tables("a")) == before
    m.check_integrity()


def test_tail_pools_release_blocks_as_the_sequence_grows():
    lay = csa_only()  # window tail 127, state tail 7
    m = manager(lay, n=32)
    step(m, "a", 100)
    assert m.block_tables("a")[WINDOW] == (0,) and m.block_tables("a")[STATE] == (0,)
    step(m, "a", 36)  # n = 136: state keeps [129, 136) -> block 0 released; window keeps [9, 136)
    assert m.block_tables("a")[STATE] == (-1, 1)
    assert m.block_tables("a")[WINDOW] == (0, 1)
    step(m, "a", 119)  # n = 255: window keeps [128, 255) -> block 0 released
    assert m.block_tables("a")[WINDOW] == (-1, 1)
    for _ in range(5 * BS):  # decode: never more than 2 live window blocks, 2 live state blocks
        step(m, "a", 1)
        for p in (WINDOW, STATE):
            live = [b for b in m.block_tables("a")[p] if b >= 0]
            assert len(live) <= 2
    n = m.length("a")
    assert m.block_tables("a")[HISTORY] == tuple(range(cdiv(n, BS)))  # history never releases
    assert frees(m)[HISTORY] == 32 - cdiv(n, BS)


def test_a_request_rolled_back_to_zero_releases_as_a_new_one():
    """commit skips the release check until the next block can leave (``release_from``); a truncation that
    moves the released prefix back must not leave the old threshold behind."""
    m = manager(csa_only(), n=32)
    step(m, "a", 300)  # blocks 0 and 1 of the state pool released
    m.truncate("a", 0)
    for k in (100, 36, 1):  # the first test's growth: the state pool's block 0 leaves at n = 136
        step(m, "a", k)
        step(m, "b", k)
        assert m.block_tables("a")[STATE].count(-1) == m.block_tables("b")[STATE].count(-1), k
    assert m.block_tables("a")[STATE][0] == -1


def test_spec_slack_keeps_rollback_rows_resident():
    lay = csa_only()
    strict, slack = manager(lay, slack=0), manager(lay, slack=4)
    for m in (strict, slack):
        step(m, "a", 2 * BS + 3)
        m.allocate("a", 5)  # verify step: last token + 4 drafts
        m.commit("a", 2 * BS + 8)  # n = 264: state keeps from 264 - 7 (- 4)
    assert strict.block_tables("a")[STATE] == (-1, -1, 2)  # from 257: block 1 released
    assert slack.block_tables("a")[STATE] == (-1, 1, 2)  # from 253: block 1 kept
    slack.truncate("a", 2 * BS + 4)  # 4 drafts rejected: needs state rows from 253, still there
    slack.check_integrity()
    assert slack.length("a") == 2 * BS + 4
    with pytest.raises(ValueError, match="released"):
        strict.truncate("a", 2 * BS + 4)  # needs state from 253: released, so refuse (nothing changes)
    strict.check_integrity()
    assert strict.length("a") == 2 * BS + 8 and strict.block_tables("a")[STATE] == (-1, -1, 2)


def test_truncate_then_regrow():
    m = manager(layout(), n=16, slack=2 * BS)
    step(m, "a", 5 * BS + 10)  # 6 blocks; window/state keep [650 - 127 - 256, 650) = blocks 2..5
    assert m.block_tables("a")[WINDOW] == (-1, -1, 2, 3, 4, 5)
    m.allocate("a", 300)  # uncommitted blocks 6, 7 too
    assert frees(m) == {HISTORY: 8, WINDOW: 10, STATE: 10}
    m.truncate("a", 4 * BS + 3)  # keep 5 blocks: blocks of positions >= 640 go back
    m.check_integrity()
    assert m.length("a") == 4 * BS + 3
    assert m.block_tables("a")[HISTORY] == (0, 1, 2, 3, 4)
    assert m.block_tables("a")[WINDOW] == (-1, -1, 2, 3, 4)
    assert frees(m) == {HISTORY: 11, WINDOW: 13, STATE: 13}
    step(m, "a", 400)  # regrow: freed ids come back after the never-used ones (FIFO)
    assert m.length("a") == 4 * BS + 403
    assert m.block_tables("a")[HISTORY][:5] == (0, 1, 2, 3, 4)
    assert m.block_tables("a")[HISTORY][5:] == (8, 9, 10)
    m.truncate("a", 0)  # all the way back is always allowed
    m.check_integrity()
    assert m.block_tables("a") == {p: () for p in POOLS} and frees(m) == {p: 16 for p in POOLS}
    step(m, "a", 1)
    assert m.length("a") == 1


def test_rowless_state_pool_never_blocks_a_rollback():
    lay = layout(compress_ratios=[0, 0, 0, 0], sliding_window=64)  # window tail 63, no state tensors
    m = manager(lay)
    step(m, "a", 300)  # window keeps from 237 (block 1); the empty state pool keeps nothing before 300
    assert m.block_tables("a")[WINDOW] == (-1, 1, 2) and m.block_tables("a")[STATE] == (-1, -1, 2)
    m.truncate("a", 250)  # window rows from 187 are resident; state has no rows to miss
    m.check_integrity()
    assert m.block_tables("a")[STATE] == (-1, -1)
    step(m, "a", 100)
    assert m.block_tables("a")[STATE] == (-1, -1, 3)  # FIFO: the block freed by truncate waits
    with pytest.raises(ValueError, match="window"):
        m.truncate("a", 100)  # needs window rows from 37: released
    m.check_integrity()


def test_commit_and_truncate_validate_their_range():
    m = manager()
    m.allocate("a", 10)
    with pytest.raises(ValueError, match="num_computed"):
        m.commit("a", BS + 1)  # beyond the allocated block
    m.commit("a", 10)
    with pytest.raises(ValueError, match="truncate"):
        m.commit("a", 5)  # rollback goes through truncate
    with pytest.raises(ValueError, match="n: must be"):
        m.truncate("a", 11)
    with pytest.raises(ValueError):
        m.allocate("a", -1)
    for bad in (lambda: m.commit("x", 0), lambda: m.truncate("x", 0), lambda: m.free("x"),
                lambda: m.block_tables("x")):
        with pytest.raises(KeyError):
            bad()
    with pytest.raises(ValueError, match="missing pools"):
        CacheManager(layout(), {HISTORY: 4})
    m.check_integrity()


def test_free_returns_everything():
    m = manager(n=32)
    step(m, "a", 700)
    step(m, "b", 50)
    m.allocate("b", 500)
    step(m, ("c", 1), 3)  # any hashable id
    m.free("a")
    m.check_integrity()
    m.free("b")
    m.free(("c", 1))
    m.check_integrity()
    assert m.num_requests == 0
    assert frees(m) == {p: 32 for p in POOLS} and m.usage() == {p: 0.0 for p in POOLS}


def test_integrity_catches_table_corruption():
    m = manager()
    step(m, "a", 300)
    step(m, "b", 200)
    m._reqs["b"].tables[HISTORY][0] = m._reqs["a"].tables[HISTORY][0]  # shared without incref
    with pytest.raises(AssertionError, match="table references"):
        m.check_integrity()
    m = manager()
    step(m, "a", 300)
    m._reqs["a"].tables[WINDOW].append(7)  # tables of different lengths
    with pytest.raises(AssertionError, match="differ in length"):
        m.check_integrity()


def test_tail_blocks_per_seq_bounds_a_running_sequence():
    rng = random.Random(7)
    lay = csa_only()
    slack = 3
    bound = {p: tail_blocks_per_seq(lay, p, slack) for p in (WINDOW, STATE)}
    assert bound == {WINDOW: cdiv(127 + 3 + BS, BS) + 1, STATE: cdiv(7 + 3 + BS, BS) + 1}
    m = manager(lay, n=256, slack=slack)
    for _ in range(2000):  # decode / verify steps of up to one block, with rejected drafts
        if "a" in m and m.length("a") > 200 * BS:
            m.free("a")  # start over: history is not under test
        n, k = m.length("a") if "a" in m else 0, rng.randint(1, BS)
        m.allocate("a", k)
        accepted = rng.randint(max(1, k - slack), k)
        m.commit("a", n + accepted)
        held = {p: sum(b >= 0 for b in m.block_tables("a")[p]) for p in bound}
        assert all(held[p] <= bound[p] for p in bound), (held, bound)
    m.check_integrity()


def test_blocks_for_budget_split():
    lay = layout()  # history 3136 B, window 32768 B, state 131072 B per block at 2-byte dtype
    per = {p: lay.bytes_per_block(p, 2) for p in POOLS}
    seqs, max_len, batched = 4, 1000, 512
    tail_need = seqs * (cdiv(127 + BS, BS) + 1) + cdiv(batched, BS)  # 4 * 3 + 4
    tail_bytes = tail_need * (per[WINDOW] + per[STATE])
    mem = tail_bytes + 100 * per[HISTORY] + 5
    counts = blocks_for_budget(lay, mem, 2, seqs, max_len, max_num_batched_tokens=batched)
    assert counts == {HISTORY: 100, WINDOW: tail_need, STATE: tail_need}
    assert sum(counts[p] * per[p] for p in POOLS) <= mem
    # Unchunked default reserves a whole max_model_len prompt's blocks; slack widens the tail.
    big = blocks_for_budget(lay, 10**9, 2, seqs, max_len, spec_slack=200)
    assert big[WINDOW] == seqs * (cdiv(127 + 200 + BS, BS) + 1) + cdiv(max_len, BS)
    with pytest.raises(ValueError, match="short"):
        blocks_for_budget(lay, tail_bytes + 7 * per[HISTORY], 2, seqs, max_len, max_num_batched_tokens=batched)
    with pytest.raises(ValueError, match="max_num_seqs"):
        blocks_for_budget(lay, mem, 2, 0, max_len)


def test_blocks_for_budget_zero_byte_pools_never_limit():
    lay = layout(compress_ratios=[0, 0, 0, 0], sliding_window=64)  # no history or state tensors
    counts = blocks_for_budget(lay, 10**6, 2, 3, 1000, max_num_batched_tokens=256)
    assert counts[HISTORY] == counts[STATE] == 3 * cdiv(1000, BS)
    assert counts[WINDOW] == 3 * (cdiv(63 + BS, BS) + 1) + 2


def test_budget_tail_pools_suffice_for_any_schedule():
    """Random chunked-prefill + verify schedules within the budget's assumptions never run the tail dry."""
    rng = random.Random(11)
    lay, seqs, max_len, batched, slack = csa_only(), 6, 3000, 700, 2
    counts = blocks_for_budget(lay, 10**9, 2, seqs, max_len, spec_slack=slack, max_num_batched_tokens=batched)
    counts[HISTORY] = seqs * cdiv(max_len, BS)  # history is not under test here
    m = CacheManager(lay, counts, spec_slack=slack)
    prompt = {i: rng.randint(1, 2000) for i in range(seqs)}
    peak = 0.0
    for _ in range(400):
        budget, plan = batched, {}
        for rid in rng.sample(range(seqs), seqs):  # one engine step: at most `batched` new tokens
            n = m.length(rid) if rid in m else 0
            prefill = n < prompt[rid]
            k = min(prompt[rid] - n, rng.randint(1, 600)) if prefill else slack + 1  # chunk or verify run
            k = min(k, budget)
            if k <= 0:
                continue
            if n + k > max_len:  # finished: its slot goes to a new request
                m.free(rid)
                prompt[rid] = rng.randint(1, 2000)
                continue
            m.allocate(rid, k)  # must never raise OutOfBlocks
            budget -= k
            plan[rid] = (k, prefill)
        peak = max(peak, m.usage()[WINDOW], m.usage()[STATE])
        for rid, (k, prefill) in plan.items():
            m.commit(rid, m.length(rid) + (k if prefill else rng.randint(1, k)))  # drafts may be rejected
        m.check_integrity()
    assert peak > 0.6  # the schedule came near the budget, so passing means something


@pytest.mark.parametrize(
    "total, tight",
    [({HISTORY: 20, WINDOW: 60, STATE: 60}, HISTORY),
     ({HISTORY: 90, WINDOW: 12, STATE: 60}, WINDOW),
     ({HISTORY: 90, WINDOW: 60, STATE: 9}, STATE)],
)
def test_randomized_ops_against_shadow_model(total, tight):
    rng = random.Random(2024)
    lay = csa_only()
    slack = 3
    m = CacheManager(lay, total, spec_slack=slack)
    tail = {p: lay.tail(p) for p in (WINDOW, STATE)}
    shadow: dict[int, dict] = {}  # rid -> {"n": length, "nb": blocks per table, "lo": {pool: released}}
    short_pools: set[str] = set()
    counts = {"alloc": 0, "oob": 0, "commit": 0, "trunc": 0, "bad_trunc": 0, "free": 0}

    def expected_free(p: str) -> int:
        return total[p] - sum(s["nb"] - (s["lo"][p] if p != HISTORY else 0) for s in shadow.values())

    for _ in range(2500):
        rid = rng.randrange(8)
        s = shadow.get(rid)
        op = rng.random()
        if op < 0.4 or s is None:
            k = rng.choice([0, 1, 2, 4, rng.randint(1, 300)])
            n, nb = (s["n"], s["nb"]) if s else (0, 0)
            need = max(0, cdiv(n + k, BS) - nb)
            ok = all(need <= expected_free(p) for p in POOLS)
            assert m.can_allocate(rid, k) == ok
            if ok:
                m.allocate(rid, k)
                shadow.setdefault(rid, {"n": 0, "nb": 0, "lo": {WINDOW: 0, STATE: 0}})["nb"] = nb + need
                counts["alloc"] += 1
            else:
                with pytest.raises(OutOfBlocks) as exc:
                    m.allocate(rid, k)
                assert need > expected_free(exc.value.pool)
                short_pools.add(exc.value.pool)
                counts["oob"] += 1
        elif op < 0.75:
            new_n = rng.randint(s["n"], s["nb"] * BS)
            m.commit(rid, new_n)
            s["n"] = new_n
            for p in (WINDOW, STATE):
                s["lo"][p] = max(s["lo"][p], max(0, new_n - tail[p] - slack) // BS)
            counts["commit"] += 1
        elif op < 0.95:
            new_n = rng.randint(max(0, s["n"] - slack - 3), s["n"]) if rng.random() < 0.5 else rng.randint(0, s["n"])
            legal = new_n == 0 or all(max(0, new_n - tail[p]) // BS >= s["lo"][p] for p in (WINDOW, STATE))
            if legal:
                m.truncate(rid, new_n)
                s["n"], s["nb"] = new_n, cdiv(new_n, BS)
                if new_n == 0:
                    s["lo"] = {WINDOW: 0, STATE: 0}
                counts["trunc"] += 1
            else:
                with pytest.raises(ValueError):
                    m.truncate(rid, new_n)
                counts["bad_trunc"] += 1
        else:
            m.free(rid)
            del shadow[rid]
            counts["free"] += 1
        m.check_integrity()
        assert {p: m.num_free_blocks(p) for p in POOLS} == {p: expected_free(p) for p in POOLS}
        for r, s in shadow.items():
            tables = m.block_tables(r)
            assert m.length(r) == s["n"] and len(tables[HISTORY]) == s["nb"]
            assert all(tables[p].count(-1) == s["lo"][p] for p in (WINDOW, STATE))
    assert all(c > 20 for c in counts.values()), counts  # every path, including failures, was exercised
    assert tight in short_pools  # admission failed on the scarce pool
