"""The scheduler on its own, against a fake cache that counts blocks: admission, the token budget,
decode-first order, chunking, preemption order, aborts, and the plans it emits (self-contained data:
joins, departures, table edits, work with placeholders for tokens still on the device)."""

from __future__ import annotations

from deepinfer.config.engine import SchedulerConfig
from deepinfer.engine.sequence import RequestState, Sequence, Status
from deepinfer.sampling import SamplingParams
from deepinfer.sched.scheduler import Scheduler

BS = 4  # tokens per block


class FakeCache:
    """Blocks of BS tokens from one pool of ``total``; tables are lists of block ids."""

    def __init__(self, total: int) -> None:
        self.free_ids = list(range(total))
        self.tables: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}
        self.edits: list[tuple] = []

    def track_edits(self) -> None:
        pass

    def drain_edits(self) -> list[tuple]:
        edits, self.edits = self.edits, []
        return edits

    def __contains__(self, rid: str) -> bool:
        return rid in self.tables

    def _need(self, rid: str, n: int) -> int:
        have = len(self.tables.get(rid, ()))
        return max(0, -(-(self.lengths.get(rid, 0) + n) // BS) - have)

    def covers(self, rid: str, n: int) -> bool:
        return rid in self.tables and self._need(rid, n) == 0

    def can_allocate(self, rid: str, n: int) -> bool:
        return self._need(rid, n) <= len(self.free_ids)

    def allocate(self, rid: str, n: int) -> None:
        need = self._need(rid, n)
        assert need <= len(self.free_ids)
        table = self.tables.setdefault(rid, [])
        self.lengths.setdefault(rid, 0)
        start = len(table)
        table += [self.free_ids.pop(0) for _ in range(need)]
        if need:
            self.edits.append((rid, "history", start, tuple(table[start:]), len(table)))

    def commit(self, rid: str, n: int, hashes: tuple = ()) -> None:
        assert self.lengths[rid] <= n <= len(self.tables[rid]) * BS
        self.lengths[rid] = n

    def free(self, rid: str) -> None:
        self.free_ids += self.tables.pop(rid)
        del self.lengths[rid]
        self.edits = [e for e in self.edits if e[0] != rid]


_arrival = iter(range(10**6))


def seq(rid: str, prompt_len: int, max_tokens: int = 100, **params) -> Sequence:
    p = SamplingParams(max_tokens=max_tokens, **params)
    req = RequestState(rid, None, tuple(range(prompt_len)), p)
    s = Sequence(f"{rid}#0", 0, req, list(range(100, 100 + prompt_len)), prompt_len, 7, next(_arrival), None,
                 max_tokens)
    req.seqs.append(s)
    return s


def make(blocks: int = 100, budget: int = 16, max_seqs: int = 8) -> tuple[Scheduler, FakeCache]:
    cache = FakeCache(blocks)
    return Scheduler(SchedulerConfig(max_seqs, budget, 1000), cache, (1,)), cache


def run_step(s: Scheduler, drawn: dict[str, int] | None = None):
    """Schedule, commit, and append a token to every sequence that drew one (the synchronous loop)."""
    sched = s.schedule()
    s.commit(sched)
    for q, w in zip(sched.seqs, sched.plan.work):
        if w.num_samples:
            q.num_pending -= 1
            q.token_ids.append((drawn or {}).get(q.seq_id, 5))
    return sched


def test_fcfs_admission_budget_split_and_chunking() -> None:
    s, _ = make(budget=16)
    a, b, c = seq("a", 10), seq("b", 20), seq("c", 3)
    for q in (a, b, c):
        s.add(q)
    first = run_step(s)
    # a whole (10), then b's first chunk (6); c waits although it would fit (no overtaking a partial b).
    assert [(w.seq_id, w.first_pos, w.num_tokens, w.num_samples) for w in first.plan.work] == \
        [("a#0", 0, 10, 1), ("b#0", 0, 6, 0)]
    assert [j.seq_id for j in first.plan.joined] == ["a#0", "b#0"]
    assert first.plan.work[0].token_ids == tuple(range(100, 110))
    second = run_step(s)
    # Decodes first (a), then b's next chunk; c is admitted with what is left.
    assert [(w.seq_id, w.num_tokens) for w in second.plan.work] == [("a#0", 1), ("b#0", 14), ("c#0", 1)]
    assert second.plan.work[0].token_ids == (5,)  # a's drawn token, known to the host
    assert c.status is Status.RUNNING and c.num_computed == 1


def test_max_num_seqs_caps_the_running_set() -> None:
    s, _ = make(max_seqs=2, budget=100)
    qs = [seq(f"r{i}", 2) for i in range(3)]
    for q in qs:
        s.add(q)
    plan = run_step(s).plan
    assert [w.seq_id for w in plan.work] == ["r0#0", "r1#0"] and qs[2].status is Status.WAITING


def test_preemption_takes_the_latest_arrival_and_requeues_it_in_order() -> None:
    s, cache = make(blocks=4, budget=100)
    old, new = seq("old", 8), seq("new", 8)  # 2 blocks each: the cache is full after admission
    s.add(old)
    s.add(new)
    run_step(s)
    assert cache.free_ids == []
    sched = run_step(s)  # both decode: old needs its third block, so new is preempted
    assert sched.preempted == (new,) and s.num_preemptions == 1
    assert new.status is Status.WAITING and new.num_computed == 0 and list(s.waiting) == [new]
    assert [w.seq_id for w in sched.plan.work] == ["old#0"]
    assert sched.plan.left == ("new#0",)  # the runner frees its slot before running this plan
    assert new.token_ids[-1] == 5 and len(new.token_ids) == 9  # it keeps what it generated


def test_abort_frees_and_reports_the_departure() -> None:
    s, cache = make()
    a, b = seq("a", 5), seq("b", 5)
    s.add(a)
    s.add(b)
    run_step(s)
    s.remove(a)
    plan = s.schedule().plan
    assert plan.left == ("a#0",) and "a#0" not in cache
    assert [w.seq_id for w in plan.work] == ["b#0"]
    waiting = seq("w", 3)
    s.add(waiting)
    s.remove(waiting)  # never admitted: nothing to tell the runner
    assert s.schedule().plan.left == ()


def test_table_edits_travel_with_the_plan() -> None:
    s, cache = make(budget=100)
    a = seq("a", 6)
    s.add(a)
    plan = run_step(s).plan
    assert [(e.seq_id, e.start, e.block_ids, e.length) for e in plan.table_edits] == \
        [("a#0", 0, tuple(cache.tables["a#0"]), 2)]
    run_step(s)  # position 6 -> 7: no new block
    plan = run_step(s).plan  # position 7 -> 8: still block 1
    assert plan.table_edits == ()
    plan = run_step(s).plan  # position 8: a third block
    assert [(e.start, e.length) for e in plan.table_edits] == [(2, 3)]


def test_async_placeholders_and_limits() -> None:
    s, _ = make(budget=100)
    a = seq("a", 4, max_tokens=3)
    s.add(a)
    first = s.schedule()
    s.commit(first)  # a's first token is drawn on the device; the host has not seen it
    assert a.num_pending == 1
    second = s.schedule()
    w = second.plan.work[0]
    assert (w.first_pos, w.token_ids, w.num_placeholders, w.num_samples) == (4, (), 1, 1)
    s.commit(second)
    assert a.num_pending == 2
    a.token_ids.append(9)  # step 1's token arrives
    a.num_pending -= 1
    third = s.schedule()
    s.commit(third)
    assert a.num_pending == 2  # outputs 1 known + 2 in flight = max_tokens: nothing more is planned
    assert s.schedule().plan.work == ()


def test_prompt_logprob_jobs_cover_each_position_once() -> None:
    s, _ = make(budget=5)
    a = seq("a", 12, prompt_logprobs=1)
    s.add(a)
    jobs = []
    while a.num_computed < 12:
        sched = run_step(s)
        w = sched.plan.work[0]
        if w.prompt_logprobs is not None:
            jobs.append((w.first_pos, w.prompt_logprobs.offset, w.prompt_logprobs.first_target,
                         w.prompt_logprobs.targets))
    targets = [t for *_, ts in jobs for t in ts]
    assert targets == list(range(101, 112))  # every prompt token but the first, once, in order
    assert [j[2] for j in jobs] == [1, 6, 11]
