"""Several nodes: LaunchConfig's checks name the field, each node starts its own contiguous share of the
world's ranks, the CLI's node flags reach the engine config, devices are counted per node, and torchrun's
environment and deepinfer's node flags are not mixed."""

from __future__ import annotations

import pytest
import torch

from deepinfer.cli import _engine_args, build_parser
from deepinfer.config.engine import EngineArgs, EngineConfig
from deepinfer.distributed.config import DEFAULT_MASTER_PORT, LaunchConfig, ParallelConfig
from deepinfer.distributed.world import WorldEnv, launched_by_torchrun
from deepinfer.executor.launch import node_worlds

DP2_TP2_EP = dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_launcher(monkeypatch) -> None:
    for name in TORCHRUN_VARS:  # the tests' own process may run under a launcher
        monkeypatch.delenv(name, raising=False)


def test_launch_config_errors_name_the_field() -> None:
    for kwargs, match in [(dict(nnodes=0), "nnodes: must be a positive integer"),
                          (dict(nnodes=True), "nnodes: must be a positive integer"),
                          (dict(node_rank=-1), "node_rank: must be an integer >= 0"),
                          (dict(nnodes=2, node_rank=2, master_addr="h"), r"node_rank: must be in \[0, nnodes=2\)"),
                          (dict(master_addr=""), "master_addr: must be a host name"),
                          (dict(master_port=0), r"master_port: must be a TCP port in \[1, 65535\]"),
                          (dict(master_port="29500"), "master_port: must be a TCP port"),
                          (dict(nnodes=2), "master_addr: required with nnodes > 1")]:
        with pytest.raises(ValueError, match=match):
            LaunchConfig(**kwargs)
    with pytest.raises(ValueError, match=r"nnodes: 4 ranks .* 3 nodes; allowed: 1, 2, 4"):
        LaunchConfig(nnodes=3, master_addr="h").validate(ParallelConfig(2, 2, True))


def test_each_node_starts_its_contiguous_share_of_the_ranks() -> None:
    parallel = ParallelConfig(tensor_parallel_size=8, data_parallel_size=2)  # TP8 x DP2 on two 8-GPU nodes
    launch = LaunchConfig(nnodes=2, node_rank=1, master_addr="10.0.0.1").validate(parallel)
    assert launch.node_ranks(parallel) == range(8, 16)  # one whole TP group per node

    cfg = EngineConfig.create(EngineArgs(device="cpu", **DP2_TP2_EP, nnodes=2, node_rank=1, master_addr="10.0.0.1"))
    envs = node_worlds(cfg)
    assert [(e.rank, e.local_rank, e.world_size, e.local_world_size) for e in envs] == [(2, 0, 4, 2), (3, 1, 4, 2)]
    assert {(e.master_addr, e.master_port) for e in envs} == {("10.0.0.1", DEFAULT_MASTER_PORT)}
    assert all(e.ranks_on_node == 2 for e in envs)

    one = node_worlds(EngineConfig.create(EngineArgs(device="cpu", **DP2_TP2_EP)))  # one node: loopback, free port
    assert [(e.rank, e.local_rank, e.local_world_size) for e in one] == [(0, 0, 4), (1, 1, 4), (2, 2, 4), (3, 3, 4)]
    assert len({(e.master_addr, e.master_port) for e in one}) == 1 and one[0].master_addr == "127.0.0.1"


def test_node_flags_reach_the_engine_config() -> None:
    a = build_parser().parse_args(["serve", "-dp", "2", "-tp", "2", "--enable-expert-parallel", "--nnodes", "2",
                                   "--node-rank", "1", "--master-addr", "head", "--master-port", "12345"])
    args = _engine_args(a)
    fields = {f: getattr(args, f) for f in EngineArgs.field_names()}
    cfg = EngineConfig.create(EngineArgs(**{**fields, "device": "cpu"}))
    assert cfg.launch == LaunchConfig(2, 1, "head", 12345)
    assert EngineConfig.create(EngineArgs(device="cpu")).launch == LaunchConfig()
    with pytest.raises(ValueError, match="nnodes: 1 ranks .* 2 nodes"):
        EngineConfig.create(EngineArgs(device="cpu", nnodes=2, master_addr="head"))
    with pytest.raises(ValueError, match="master_addr: required"):
        EngineConfig.create(EngineArgs(device="cpu", **DP2_TP2_EP, nnodes=2))


def test_devices_are_counted_per_node(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    base = dict(device="cuda", data_parallel_size=4, enable_expert_parallel=True)
    with pytest.raises(ValueError, match="4 devices wanted, 2 visible"):
        EngineConfig.create(EngineArgs(**base))
    assert EngineConfig.create(EngineArgs(**base, nnodes=2, master_addr="head")).launch.nnodes == 2
    with pytest.raises(ValueError, match="4 devices wanted on each of 2 nodes, 2 visible"):
        EngineConfig.create(EngineArgs(**{**base, "data_parallel_size": 8}, nnodes=2, master_addr="head"))
    # Under torchrun the launcher decides how many ranks a node runs (each checks its LOCAL_RANK on joining).
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launched_by_torchrun()
    assert EngineConfig.create(EngineArgs(**base)).parallel.world_size == 4


def test_torchrun_and_node_flags_do_not_mix(monkeypatch) -> None:
    from deepinfer.executor.engine import launch_engine

    cfg = EngineConfig.create(EngineArgs(device="cpu", **DP2_TP2_EP, nnodes=2, master_addr="head"))
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "4"), ("MASTER_ADDR", "head"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="nnodes: the launcher already describes the world"):
        launch_engine(cfg)


def test_world_env_local_world_size() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "LOCAL_WORLD_SIZE": "8", "MASTER_ADDR": "h",
           "MASTER_PORT": "29500"}
    w = WorldEnv.from_env(env)
    assert (w.local_world_size, w.ranks_on_node) == (8, 8)
    assert WorldEnv.from_env(w.as_environ()) == w
    assert WorldEnv.from_env({k: v for k, v in env.items() if k != "LOCAL_WORLD_SIZE"}).ranks_on_node == 16
    for bad in ("0", "eight"):
        with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE: expected a positive integer"):
            WorldEnv.from_env({**env, "LOCAL_WORLD_SIZE": bad})
