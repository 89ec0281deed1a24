"""Cache tiers over a world of ranks (gloo, CPU, the demo model): each rank saves and loads its own blocks (its
shard of them with TP) in its own store (``executor/rank_tiers.py``), the engine's schedulers probe and fetch
through the ranks (``executor/remote_tiers.py``).

Conversations take turns on a device cache of a few blocks, so each turn's prefix was evicted by the others'
turns and comes back from the tiers (history and window blocks; the boundary's compressor state rebuilt by a
bounded replay). Every turn draws the tokens of a single-process engine without prefix caching (logprobs to
1e-4: the ranks' batches round the CPU GEMMs' rows differently, see test_parallel_engine.py). A rank that
skipped its saves would have no tier hits to report; one that skipped its loads would compute on stale rows.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.assets import demo_model_dir
from deepinfer.engine.llm_engine import LLMEngine
from deepinfer.executor.engine import ParallelLLMEngine
from deepinfer.sampling import SamplingParams
from deepinfer.server.engine_stats import publish, snapshot
from deepinfer.server.metrics import ServerMetrics

BS = 128
ARGS = dict(model=str(demo_model_dir()), device="cpu", dtype="float32", block_size=BS, max_num_seqs=1,
            max_num_batched_tokens=BS, max_model_len=1024, load_progress=False)
TIERED = dict(num_cache_blocks=6, kv_host_cache_gb=0.05)
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each rank of a 2-process world on this machine (tiny GEMMs: threads only contend)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def plain():
    """The single-process, cache-off engine; ``want(rid, ids)``: its output for a prompt run alone."""
    engine = LLMEngine.from_engine_args(**ARGS, enable_prefix_caching=False)
    return lambda rid, ids: _run(engine, [(rid, ids)])[rid]


def _run(engine, requests) -> dict:
    """Submit ``requests`` (request id, prompt ids) together, in order (a DP engine routes each as it comes)."""
    for rid, ids in requests:
        engine.add_request(rid, {"prompt_token_ids": ids}, PARAMS)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _assert_same(got, want) -> None:
    a, b = got.outputs[0], want.outputs[0]
    assert a.token_ids == b.token_ids, got.request_id
    diff = max(abs(x[t].logprob - y[t].logprob) for t, x, y in zip(a.token_ids, a.logprobs, b.logprobs))
    assert diff < 1e-4, got.request_id


def _turns(engine, plain, chats: dict, turns: range, rng: random.Random, pairs) -> dict:
    """Run ``turns`` of the conversations, ``pairs`` of them submitted together (one per DP rank when both are
    idle); each turn extends its conversation by its output and 100 new tokens. The outputs by request id."""
    outs = {}
    for turn in turns:
        for pair in pairs:
            got = _run(engine, [(f"{c}{turn}", chats[c]) for c in pair])
            for c in pair:
                rid = f"{c}{turn}"
                _assert_same(got[rid], plain(rid, chats[c]))
                chats[c] = chats[c] + list(got[rid].outputs[0].token_ids) + [rng.randrange(3, 4096) for _ in range(100)]
            outs.update(got)
    return outs


def test_data_parallel_tiers_hit_on_every_rank_and_survive_a_restart(plain, tmp_path) -> None:
    """DP2 + EP, a host tier over a disk directory: two conversations per DP rank take turns; each rank saves
    and hits in its own tiers. Closed and restarted, the engine finds every rank's blocks in ``<dir>/rank<r>``."""
    rng = random.Random(21)
    chats = {c: [rng.randrange(3, 4096) for _ in range(450)] for c in "abcd"}
    pairs = ("ab", "cd")  # a, c on DP rank 0 and b, d on DP rank 1 (the idle rank first, then by prefix hits)
    disk = dict(kv_cache_dir=str(tmp_path / "kv"), kv_disk_cache_gb=0.05)
    engine = LLMEngine.from_engine_args(**ARGS, **TIERED, **disk, data_parallel_size=2, enable_expert_parallel=True)
    try:
        assert isinstance(engine, ParallelLLMEngine)
        outs = _turns(engine, plain, chats, range(2), rng, pairs)
        for rid, out in outs.items():  # every later turn hit, on the rank that holds its conversation
            assert (out.num_cached_tokens > 0) == (not rid.endswith("0")), rid
        for sched in engine.schedulers:
            assert sched.cache.pools["history"].num_evictions > 0 and sched.cache.pools["window"].num_evictions > 0
            assert sched.prefix_tier_hits > 0
            sched.cache.check_integrity()
        stats = engine.tier_stats()
        assert [s.rank for s in stats] == [0, 1] and all(s.pools == ("history", "window") for s in stats)
        for s in stats:  # each rank saved evicted blocks and loaded hits from its own store
            assert s.saved > 0 and s.loaded > 0 and s.stats.tier("host").hits > 0, s
        assert engine.tiers.saved == stats[0].saved  # rank 0's own link, in the engine's process
    finally:
        engine.close()
    for r in range(2):
        assert list((tmp_path / "kv" / f"rank{r}").rglob("*.kvb")), f"rank {r} wrote nothing to its disk tier"

    again = LLMEngine.from_engine_args(**ARGS, **disk, num_cache_blocks=6, data_parallel_size=2,
                                       enable_expert_parallel=True)
    try:
        outs = _turns(again, plain, chats, range(2, 3), rng, pairs)
        assert all(out.num_cached_tokens > 0 for out in outs.values())  # from the disk: the device starts empty
        assert all(sched.prefix_tier_hits > 0 for sched in again.schedulers)
        assert all(s.loaded > 0 and s.stats.tier("disk").hits > 0 for s in again.tier_stats())
    finally:
        again.close()


def test_tensor_parallel_tiers_hit_with_every_shard_or_not_at_all(plain, tmp_path) -> None:
    """TP2, a host tier over a disk directory: each TP rank saves and loads its shard of every block under the
    block's key, and the hits draw the single-process engine's tokens. Restarted with half of TP rank 1's
    objects damaged, a hit on a block that rank cannot load shrinks before the model runs (all or nothing across
    the group: rank 0's intact shard is not used alone), and the tokens are still the cache-off engine's."""
    rng = random.Random(22)
    chats = {c: [rng.randrange(3, 4096) for _ in range(450)] for c in "ab"}
    disk = dict(kv_cache_dir=str(tmp_path / "kv"), kv_disk_cache_gb=0.05)
    engine = LLMEngine.from_engine_args(**ARGS, **TIERED, **disk, tensor_parallel_size=2)
    try:
        outs = _turns(engine, plain, chats, range(2), rng, ("a", "b"))
        assert all(out.num_cached_tokens > 0 for rid, out in outs.items() if not rid.endswith("0"))
        assert engine.scheduler.cache.pools["history"].num_evictions > 0 and engine.scheduler.prefix_tier_hits > 0
        stats = engine.tier_stats()
        assert len(stats) == 2 and all(s.saved > 0 and s.loaded > 0 for s in stats)
        assert stats[0].saved == stats[1].saved and stats[0].loaded == stats[1].loaded  # every shard, each time
    finally:
        engine.close()
    files = sorted((tmp_path / "kv" / "rank1").rglob("*.kvb"))
    assert files and list((tmp_path / "kv" / "rank0").rglob("*.kvb"))
    for f in files[::2]:  # a flipped payload byte: the object fails its checksum when rank 1 fetches it
        data = bytearray(f.read_bytes())
        data[-100] ^= 0xFF
        f.write_bytes(bytes(data))

    again = LLMEngine.from_engine_args(**ARGS, **disk, num_cache_blocks=6, tensor_parallel_size=2)
    try:
        _turns(again, plain, chats, range(2, 3), rng, ("a", "b"))
        stats = again.tier_stats()
        assert stats[1].stats.tier("disk").checksum_failures > 0 and stats[0].stats.tier("disk").checksum_failures == 0
        assert again.remote_tiers[0].fetches > 2  # a fetch failed on rank 1, and the hit was looked up again
        assert stats[0].loaded == stats[1].loaded > 0
    finally:
        again.close()


def _tier_samples(metrics: ServerMetrics) -> dict[tuple[str, str, str], float]:
    """The ``deepinfer:kv_tier_*`` samples of /metrics' text: (field, tier, rank) -> value."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in fam.samples:
            if s.name.startswith("deepinfer:kv_tier_") and not s.name.endswith("_created"):
                field = s.name.removeprefix("deepinfer:kv_tier_").removesuffix("_total")
                out[(field, s.labels["tier"], s.labels["rank"])] = s.value
    return out


def test_metrics_show_every_ranks_tiers() -> None:
    """/metrics over a world of ranks (DP2 + EP, a host tier): after two turns of four conversations, the
    ``deepinfer:kv_tier_*`` series of both ranks are there, each equal to what that rank's own store counted.
    The counters come with each step's results (``StepDone.tiers``), not by an order of their own; a host tier
    alone works on the step's thread, so the last step's report is the store's count now. Rank 1's
    conversations are longer, so the ranks' counts differ (one rank's reported twice would show)."""
    rng = random.Random(23)
    chats = {c: [rng.randrange(3, 4096) for _ in range(450 if c in "ac" else 520)] for c in "abcd"}
    engine = LLMEngine.from_engine_args(**ARGS, **TIERED, data_parallel_size=2, enable_expert_parallel=True)
    try:
        for turn in range(2):
            for pair in ("ab", "cd"):  # a, c on DP rank 0 and b, d on DP rank 1 (as in the test above)
                got = _run(engine, [(f"{c}{turn}", chats[c]) for c in pair])
                for c in pair:
                    chats[c] += list(got[f"{c}{turn}"].outputs[0].token_ids) + [rng.randrange(3, 4096) for _ in range(100)]
        metrics = ServerMetrics("demo")
        publish(metrics, snapshot(engine))
        samples = _tier_samples(metrics)
        stats = {s.rank: s.stats.tier("host") for s in engine.tier_stats()}
    finally:
        engine.close()
    assert {rank for _, _, rank in samples} == {"0", "1"} and {tier for _, tier, _ in samples} == {"host"}
    fields = ("queried", "hits", "hit_tokens", "stored", "evictions", "checksum_failures", "used_bytes")
    for rank, host in stats.items():
        assert host.hits > 0 and host.stored > 0, (rank, host)
        assert {f: samples[(f, "host", str(rank))] for f in fields} == {f: getattr(host, f) for f in fields}, rank
    assert stats[0] != stats[1]
