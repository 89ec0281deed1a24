"""ParallelConfig and the world environment: bad values fail with the field and the allowed values."""

from __future__ import annotations

import pytest

from deepinfer.config import ModelConfig
from deepinfer.distributed.config import ParallelConfig
from deepinfer.distributed.world import WorldEnv
from deepinfer.testing.make_checkpoint import PRESETS

TINY = ModelConfig.from_dict(PRESETS["tiny"])  # 4 heads, o_groups 2, 8 experts, moe_intermediate_size 16


def test_sizes_and_validation() -> None:
    c = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True).validate(TINY)
    assert (c.world_size, c.expert_parallel_size) == (4, 4)
    assert ParallelConfig(tensor_parallel_size=2, data_parallel_size=2).expert_parallel_size == 1
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 4 does not divide .*o_groups \(2\).*allowed: 1, 2"):
        ParallelConfig(tensor_parallel_size=4).validate(TINY)
    with pytest.raises(ValueError, match=r"enable_expert_parallel: 8 routed experts .* 3 ranks.*allowed world sizes: 1, 2, 4, 8"):
        ParallelConfig(data_parallel_size=3, enable_expert_parallel=True).validate(TINY)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        ParallelConfig(tensor_parallel_size=2).validate(TINY.replace(moe_intermediate_size=15))
    for field, value in (("tensor_parallel_size", 0), ("data_parallel_size", "2"), ("tensor_parallel_size", True)):
        with pytest.raises(ValueError, match=f"{field}: must be a positive integer"):
            ParallelConfig(**{field: value})
    with pytest.raises(ValueError, match="enable_expert_parallel: must be true or false"):
        ParallelConfig(enable_expert_parallel=1)


def test_world_env() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    w = WorldEnv.from_env(env)
    assert (w.rank, w.world_size, w.local_rank, w.master_addr, w.master_port) == (1, 2, 1, "10.0.0.1", 29500)
    assert WorldEnv.from_env(w.as_environ()) == w
    with pytest.raises(ValueError, match="MASTER_PORT: not set"):
        WorldEnv.from_env({k: v for k, v in env.items() if k != "MASTER_PORT"})
    with pytest.raises(ValueError, match="RANK: must be in"):
        WorldEnv.from_env({**env, "RANK": "2"})
    with pytest.raises(ValueError, match="WORLD_SIZE: expected a non-negative integer"):
        WorldEnv.from_env({**env, "WORLD_SIZE": "two"})
