"""The router's pieces without HTTP: the prompt-block index, each policy's rule, the replicas' health state,
the config's errors."""

from __future__ import annotations

import pytest

from deepinfer.config.router import RouterConfig
from deepinfer.router.policies import CacheAware, ConsistentHash, PowerOfTwo, RequestKey, RoundRobin
from deepinfer.router.prefix_index import PrefixIndex, block_chain
from deepinfer.router.workers import Workers

URLS = ("http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3")


def _key(ids: list[int], block: int = 4, salt: str | None = None) -> RequestKey:
    return RequestKey(tuple(block_chain(ids, block, salt)), None, len(ids))


def test_block_chain_covers_whole_prefixes_and_salts() -> None:
    a, b = block_chain(list(range(10)), 4), block_chain([0, 1, 2, 3, 9, 9, 9, 9], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]  # full blocks only; a block's hash covers its prefix
    assert block_chain([5, 1, 2, 3, 4, 5, 6, 7], 4)[1] != a[1]  # same second block, other first block
    assert block_chain(list(range(8)), 4, salt="t1")[0] != a[0]  # salts never share
    assert block_chain([1, 2, 3], 4) == []


def test_prefix_index_matches_leading_blocks_and_forgets_tails_first() -> None:
    idx = PrefixIndex(max_blocks=4)
    chain = block_chain(list(range(12)), 4)  # 3 blocks
    idx.insert(chain)
    assert idx.match(chain) == 3 and idx.match(block_chain(list(range(8)) + [99] * 4, 4)) == 2
    other = block_chain([7] * 8, 4)  # 2 blocks: 5 > 4, the oldest goes, which is the first chain's tail
    idx.insert(other)
    assert len(idx) == 4 and idx.match(chain) == 2 and idx.match(other) == 2
    idx.drop()
    assert idx.match(chain) == 0


def test_cache_aware_follows_the_prefix_unless_loads_are_imbalanced() -> None:
    cfg = RouterConfig(URLS, block_size=4, cache_threshold=0.5, balance_abs_threshold=2, balance_rel_threshold=1.5)
    workers = Workers(URLS, 100).all
    policy = CacheAware(cfg)
    first = _key(list(range(16)))
    c = policy.choose(workers, first)
    assert c.reason == "least_load" and c.worker is workers[0]
    policy.routed(c, first)
    # New prefixes spread: equal loads, the replica remembering the fewest blocks.
    other = _key([50] * 16)
    c2 = policy.choose(workers, other)
    assert c2.reason == "least_load" and c2.worker is workers[1]
    policy.routed(c2, other)
    # A longer prompt of the same conversation: 4 of its 6 blocks are on replica 0 (>= 0.5).
    turn2 = _key(list(range(16)) + [70] * 8)
    c3 = policy.choose(workers, turn2)
    assert (c3.reason, c3.worker, c3.matched_blocks) == ("cache", workers[0], 4)
    # Below the threshold: 4 of 10 blocks.
    assert policy.choose(workers, _key(list(range(16)) + [70] * 24)).reason == "least_load"
    # Imbalanced (3 more in flight than the idlest and more than 1.5x): the idlest, whatever it holds.
    workers[0].outstanding, workers[1].outstanding, workers[2].outstanding = 5, 2, 2
    c4 = policy.choose(workers, turn2)
    assert c4.reason == "balance" and c4.worker is workers[2]  # idlest; of equal loads, the emptiest index
    workers[0].outstanding = 4  # 2 beyond: not imbalanced
    assert policy.choose(workers, turn2).reason == "cache"


def test_consistent_hash_keeps_sessions_and_moves_only_a_leaving_replicas() -> None:
    workers = Workers(URLS, 10).all
    policy = ConsistentHash()
    sessions = [f"user-{i}" for i in range(60)]
    placed = {s: policy.choose(workers, RequestKey(session=s)).worker for s in sessions}
    assert len(set(placed.values())) == 3
    assert all(policy.choose(workers, RequestKey(session=s)).worker is placed[s] for s in sessions)
    left = [w for w in workers if w is not workers[1]]
    for s in sessions:
        w = policy.choose(left, RequestKey(session=s)).worker
        assert w is placed[s] or placed[s] is workers[1]
    assert policy.choose(workers, RequestKey()).reason == "least_load"


def test_power_of_two_takes_the_idler_and_round_robin_cycles() -> None:
    workers = Workers(URLS, 10).all
    workers[0].outstanding, workers[1].outstanding, workers[2].outstanding = 9, 0, 5
    p2c = PowerOfTwo(seed=3)
    picks = [p2c.choose(workers, RequestKey()).worker for _ in range(30)]
    assert workers[0] not in picks and {workers[1], workers[2]} == set(picks)  # never the busiest of any pair
    rr = RoundRobin()
    assert [rr.choose(workers, RequestKey()).worker for _ in range(4)] == [*workers, workers[0]]


def test_failures_take_a_replica_out_until_its_health_check_passes() -> None:
    ws = Workers(URLS, 10)
    w = ws.all[0]
    w.index.insert(block_chain(list(range(8)), 4))
    w.failed(max_failures=2)
    assert w.healthy
    w.succeeded()
    w.failed(2)
    assert w.healthy  # consecutive failures only
    w.failed(2)
    assert not w.healthy and len(w.index) == 0 and ws.healthy() == ws.all[1:]
    w.checked(True)
    assert w.healthy and w.failures == 0
    ws.all[1].checked(False)
    assert ws.healthy() == [w, ws.all[2]]


@pytest.mark.parametrize("kw, field", [({"worker_urls": ()}, "worker_urls"), ({"worker_urls": ("localhost:8000",)},
                                       "worker_urls"), ({"worker_urls": URLS[:1] * 2}, "worker_urls"),
                                       ({"policy": "random"}, "policy"), ({"cache_threshold": 1.5}, "cache_threshold"),
                                       ({"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
                                       ({"block_size": 0}, "block_size"), ({"max_failures": 0}, "max_failures"),
                                       ({"health_check_interval_secs": 0}, "health_check_interval_secs")])
def test_bad_router_settings_name_the_field(kw, field) -> None:
    with pytest.raises(ValueError, match=f"^{field}: "):
        RouterConfig(**{"worker_urls": URLS, **kw})


def test_cli_reports_a_bad_url(capsys) -> None:
    from deepinfer.cli import main

    assert main(["router", "--worker-urls", "localhost:8000"]) == 2
    assert "worker_urls: 'localhost:8000' is not an http(s)://host:port URL" in capsys.readouterr().err
