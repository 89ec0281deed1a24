"""The EPLB placement (``model/parallel/placement.py``): pure functions on synthetic loads, and the EPLB
settings (``config/eplb.py``) as users spell them."""

from __future__ import annotations

import random

import pytest

from deepinfer.config.engine import EngineArgs, EngineConfig
from deepinfer.config.eplb import EplbConfig
from deepinfer.model.parallel.placement import (ExpertPlacement, balanced_placement, balancedness, keep_in_place,
                                                rank_loads, rebalanced, static_placement, transfer_plan)


def _zipf(n: int, seed: int, s: float = 1.2) -> list[float]:
    """Skewed loads: expert popularity ~ 1/rank^s in a shuffled order, in whole tokens."""
    rng = random.Random(seed)
    loads = [round(10000 / (i + 1) ** s) for i in range(n)]
    rng.shuffle(loads)
    return loads


def _check_valid(p: ExpertPlacement, n_experts: int, ranks: int, redundant: int) -> None:
    assert len(p.slots) == n_experts + redundant
    assert p.slots_per_rank * ranks == len(p.slots)  # equal slots per rank
    assert all(len(r) >= 1 for r in p.replicas) and len(p.replicas) == n_experts
    assert sorted(s for r in p.replicas for s in r) == list(range(len(p.slots)))


@pytest.mark.parametrize("n_experts,ranks,redundant", [(8, 2, 2), (16, 4, 4), (64, 8, 16), (256, 16, 32), (8, 2, 0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balanced_placement_is_flatter_than_static(n_experts, ranks, redundant, seed) -> None:
    loads = _zipf(n_experts, seed)
    p = balanced_placement(loads, ranks, redundant)
    _check_valid(p, n_experts, ranks, redundant)
    before = balancedness(rank_loads(loads, static_placement(n_experts, ranks, redundant)))
    plain = balancedness(rank_loads(loads, static_placement(n_experts, ranks)))
    after = balancedness(rank_loads(loads, p))
    assert after > before and after > plain, (before, plain, after)
    assert after >= 0.8  # the greedy gets close to even on these loads
    # The estimate is exact bookkeeping: the ranks' loads add up to the total.
    assert sum(rank_loads(loads, p)) == pytest.approx(sum(loads))
    assert balanced_placement(loads, ranks, redundant) == p  # deterministic


def test_hot_expert_is_replicated_across_ranks() -> None:
    loads = [1000, 10, 10, 10, 10, 10, 10, 10]
    p = balanced_placement(loads, 2, 2)
    hot = p.replicas[0]
    assert len(hot) == 2 and hot[0] // p.slots_per_rank != hot[1] // p.slots_per_rank
    assert balancedness(rank_loads(loads, p)) > 0.9
    # Static: expert 0's rank takes everything heavy.
    assert balancedness(rank_loads(loads, static_placement(8, 2, 2))) < 0.6


def test_static_placement_holds_the_loaded_ranges() -> None:
    p = static_placement(8, 2, 2)
    assert p.rank_slots(0) == (0, 1, 2, 3, 0) and p.rank_slots(1) == (4, 5, 6, 7, 4)
    assert static_placement(8, 2).slots == tuple(range(8))
    with pytest.raises(ValueError, match="divide"):
        static_placement(8, 2, 1)


def test_keep_in_place_and_transfer_plan() -> None:
    old = static_placement(8, 2, 2)
    new = keep_in_place(old, balanced_placement([1000, 900, 10, 10, 10, 10, 10, 10], 2, 2))
    for r in range(2):  # the same experts per rank as asked, reordered
        assert sorted(new.rank_slots(r)) == sorted(balanced_placement([1000, 900, 10, 10, 10, 10, 10, 10], 2, 2)
                                                   .rank_slots(r))
    plan = transfer_plan(old, new)
    moved = {(t.dst_rank, t.dst_slot) for t in plan}
    for slot, (a, b) in enumerate(zip(old.slots, new.slots)):
        assert ((slot // 5, slot % 5) in moved) == (a != b)
    for t in plan:  # every source holds the destination's new expert; a local copy is used where there is one
        e = new.slots[t.dst_rank * 5 + t.dst_slot]
        assert old.slots[t.src_rank * 5 + t.src_slot] == e
        if e in old.rank_slots(t.dst_rank):
            assert t.src_rank == t.dst_rank
    assert transfer_plan(new, new) == ()
    assert rebalanced([0] * 8, old, 2) is old  # nothing measured: nothing moves


def test_placement_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="every logical expert"):
        ExpertPlacement((0, 0, 1, 1), 2, 3)
    with pytest.raises(ValueError, match="split evenly"):
        ExpertPlacement((0, 1, 2), 2, 3)
    with pytest.raises(ValueError, match="divide"):
        balanced_placement([1.0] * 8, 3, 0)


def test_eplb_config_fields_and_errors() -> None:
    assert EplbConfig() == EplbConfig(0, 1000, 3000, False)  # vLLM's defaults
    got = EplbConfig.parse('{"num_redundant_experts": 2, "window_size": 8, "step_interval": 4, '
                           '"log_balancedness": true}')
    assert got == EplbConfig(2, 8, 4, True)
    for bad, field in [({"num_redundant_experts": -1}, "num_redundant_experts"), ({"window_size": 0}, "window_size"),
                       ({"step_interval": 1.5}, "step_interval"), ({"log_balancedness": 1}, "log_balancedness"),
                       ({"use_async": True}, "use_async"), ("{bad", "eplb_config"), ([1], "eplb_config")]:
        with pytest.raises(ValueError, match=field):
            EplbConfig.parse(bad)


def test_engine_args_validate_eplb() -> None:
    base = dict(device="cpu", data_parallel_size=2, enable_expert_parallel=True)
    cfg = EngineConfig.create(EngineArgs(**base, enable_eplb=True, eplb_config={"num_redundant_experts": 2}))
    assert cfg.eplb == EplbConfig(num_redundant_experts=2)
    assert EngineConfig.create(EngineArgs(**base)).eplb is None
    with pytest.raises(ValueError, match="num_redundant_experts.*multiples of 2"):
        EngineConfig.create(EngineArgs(**base, enable_eplb=True, eplb_config={"num_redundant_experts": 1}))
    with pytest.raises(ValueError, match="enable_eplb: needs enable_expert_parallel"):
        EngineConfig.create(EngineArgs(device="cpu", data_parallel_size=2, enable_eplb=True))
    with pytest.raises(ValueError, match="eplb_config: set without enable_eplb"):
        EngineConfig.create(EngineArgs(**base, eplb_config={"num_redundant_experts": 2}))
    with pytest.raises(ValueError, match="enable_eplb: must be true or false"):
        EngineConfig.create(EngineArgs(**base, enable_eplb="yes"))


def test_cli_flags_reach_engine_args() -> None:
    from deepinfer.cli import _engine_args, build_parser

    a = build_parser().parse_args(["generate", "--data-parallel-size", "2", "--enable-expert-parallel", "--enable-eplb",
                                   "--eplb-config", '{"num_redundant_experts": 2, "step_interval": 10}'])
    args = _engine_args(a)
    assert args.enable_eplb is True
    assert EngineConfig.create(EngineArgs(**{**{f: getattr(args, f) for f in EngineArgs.field_names()},
                                             "device": "cpu"})).eplb == EplbConfig(2, 1000, 10, False)
    assert _engine_args(build_parser().parse_args(["generate"])).enable_eplb is False
