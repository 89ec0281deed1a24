"""Ranks sharing one CUDA device (``ranks_share_device``): the option's checks name the field, the cache of a
rank takes its share of the device, and the collectives staged through host memory give the plain gloo
collectives' results (a 2-process CPU world with the staging decision forced on: the host copies, the
collective on them and the copy back all run, the copies being host to host here; the GPU world is
tests/gpu/test_shared_device_world.py)."""

from __future__ import annotations

import pytest
import torch

from deepinfer.cli import _engine_args, build_parser
from deepinfer.config.engine import EngineArgs, EngineConfig
from deepinfer.distributed import collectives
from deepinfer.distributed.config import LaunchConfig, ParallelConfig
from deepinfer.distributed.world import WorldEnv, init_world
from deepinfer.engine.sizing import device_cache_budget
from deepinfer.testing.world import run_world

DP2_EP = dict(data_parallel_size=2, enable_expert_parallel=True)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
GIB = 1 << 30


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch) -> None:
    for name in TORCHRUN_VARS:  # the tests' own process may run under a launcher
        monkeypatch.delenv(name, raising=False)


def test_option_checks_name_the_field(monkeypatch) -> None:
    with pytest.raises(ValueError, match="ranks_share_device: must be true or false"):
        LaunchConfig(ranks_share_device="yes")
    with pytest.raises(ValueError, match="ranks_share_device: .* one-node world, got nnodes=2; allowed: nnodes=1"):
        LaunchConfig(nnodes=2, master_addr="head", ranks_share_device=True)
    with pytest.raises(ValueError, match=r"ranks_share_device: needs several ranks"):
        LaunchConfig(ranks_share_device=True).validate(ParallelConfig())
    with pytest.raises(ValueError, match="ranks_share_device: .* device='cpu'.*allowed: device='cuda'"):
        EngineConfig.create(EngineArgs(device="cpu", **DP2_EP, ranks_share_device=True))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="2 devices wanted, 1 visible"):  # the default: one rank per device
        EngineConfig.create(EngineArgs(device="cuda", **DP2_EP))
    for parallel in (DP2_EP, dict(tensor_parallel_size=2), dict(**DP2_EP, context_parallel_size=2)):
        cfg = EngineConfig.create(EngineArgs(device="cuda", **parallel, ranks_share_device=True))
        assert cfg.launch.ranks_share_device and cfg.launch.ranks_sharing_device(cfg.parallel) == 2
    assert EngineConfig.create(EngineArgs(device="cuda")).launch.ranks_sharing_device(ParallelConfig()) == 1
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="ranks_share_device: .* under torchrun"):
        EngineConfig.create(EngineArgs(device="cuda", **DP2_EP, ranks_share_device=True))


def test_cli_flag_reaches_the_engine_config(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    a = build_parser().parse_args(["serve", "-dp", "2", "--enable-expert-parallel", "--ranks-share-device"])
    args = _engine_args(a)
    assert args.ranks_share_device
    fields = {f: getattr(args, f) for f in EngineArgs.field_names()}
    assert EngineConfig.create(EngineArgs(**{**fields, "device": "cuda"})).launch == LaunchConfig(
        ranks_share_device=True)
    assert not _engine_args(build_parser().parse_args(["serve"])).ranks_share_device


def test_joining_checks_the_device_and_the_node() -> None:
    env = WorldEnv(0, 2, 0, "127.0.0.1", 1, local_world_size=2)
    with pytest.raises(ValueError, match="ranks_share_device: .* got device='cpu'"):
        init_world(ParallelConfig(**DP2_EP), "cpu", env, share_device=True)
    split = WorldEnv(0, 2, 0, "127.0.0.1", 1, local_world_size=1)  # one rank on each of two nodes
    with pytest.raises(ValueError, match="ranks_share_device: needs the whole world on one node.* 1 of 2 ranks"):
        init_world(ParallelConfig(**DP2_EP), "cuda", split, share_device=True)


def test_each_rank_sizes_its_cache_from_its_share_of_the_device() -> None:
    alone = device_cache_budget(100 * GIB, 10 * GIB, 0.9, 2 * GIB)
    assert alone == 78 * GIB
    assert device_cache_budget(100 * GIB, 3 * GIB, 0.9, 2 * GIB, ranks=2) == 45 * GIB - 5 * GIB
    assert device_cache_budget(100 * GIB, 3 * GIB, 0.9, 2 * GIB, ranks=4) == int(22.5 * GIB) - 5 * GIB
    with pytest.raises(ValueError, match="gpu_memory_utilization: 0.1 .* 1/8 of it.*cache_memory_gb / num_cache_blocks"):
        device_cache_budget(100 * GIB, 1 * GIB, 0.1, 1 * GIB, ranks=8)
    with pytest.raises(ValueError, match="gpu_memory_utilization: 0.1 leaves no memory for the cache \\("):
        device_cache_budget(100 * GIB, 10 * GIB, 0.1, 1 * GIB)


def _collectives(env: WorldEnv, staged: bool) -> list[torch.Tensor]:
    """Every collective of ``collectives.py`` on this rank's inputs, staged through host copies or not."""
    if staged:  # this spawned process only: the decision a CUDA tensor on a gloo group takes
        collectives._stages = lambda group, device: True
    init_world(ParallelConfig(**DP2_EP), "cpu", env, timeout_s=60)
    group = torch.distributed.group.WORLD
    r = env.rank
    g = torch.Generator().manual_seed(10 + r)
    x32 = torch.randn(5, 6, generator=g)
    x16 = torch.randn(5, 6, generator=g).to(torch.bfloat16)
    out = [collectives.all_reduce(x32.clone(), group), collectives.all_reduce(x16.clone(), group),
           collectives.all_reduce(x16.clone(), group, ordered=True)]
    send = [2, 1] if r == 0 else [0, 3]  # rank 1 sends none to rank 0: an empty share
    recv = collectives.exchange_counts(send, group, torch.device("cpu"))
    out.append(torch.tensor(recv))
    rows16 = torch.randn(sum(send), 4, generator=g).to(torch.bfloat16)
    ids = torch.arange(sum(send)) + 100 * r
    out += [collectives.all_to_all_rows(rows16, send, recv, group), collectives.all_to_all_rows(ids, send, recv, group)]
    sizes = [3, 0]  # rank 1 holds no rows
    out.append(collectives.all_gather_rows(x16[: sizes[r]], sizes, group))
    target = x32.clone() if r == 0 else torch.zeros(5, 6)
    got = collectives.broadcast_rows(target, 0, group)
    out += [got, target]  # the returned tensor and the one passed in: received in place
    empty = collectives.broadcast_rows(torch.zeros(0, 6), 0, group)  # zero rows still join
    out.append(empty)
    torch.distributed.destroy_process_group()
    return out


def test_staged_collectives_equal_the_plain_ones() -> None:
    plain = run_world(_collectives, 2, args=(False,), timeout_s=60)
    staged = run_world(_collectives, 2, args=(True,), timeout_s=60)
    for rank, (want, got) in enumerate(zip(plain, staged)):
        assert len(want) == len(got)
        for i, (a, b) in enumerate(zip(want, got)):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (rank, i)
    # The plain world computed what each collective promises (the comparison above is not of two wrong runs).
    assert plain[1][3].tolist() == [1, 3] and plain[0][3].tolist() == [2, 0]
    assert torch.equal(plain[0][8], plain[1][8]) and torch.equal(plain[1][9], plain[0][9])
