"""On the GPU: a rank's sharded quantized-first load into the Triton layouts (TP slices of the FP8 linears and
of the tile-major FP4 experts, expert-parallel ranges) holds exactly what loading the whole model on the GPU
and cutting it holds, bit for bit (the CPU twin with the reference layouts: tests/unit/test_parallel_loading.py).
No collective runs, so one GPU serves every rank in turn."""

from __future__ import annotations

import copy

import pytest
import torch

from deepinfer.assets import demo_model_dir
from deepinfer.distributed.world import ParallelContext
from deepinfer.model.device import prepare_for_device
from deepinfer.model.loader import load_model
from deepinfer.model.parallel.shard import shard_model, sharding_hook
from deepinfer.testing.make_checkpoint import write_dummy_checkpoint
from tests.unit.test_parallel_loading import CONFIGS, FLASH2, assert_same_model


@pytest.fixture(scope="module")
def flash_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("flash2_gpu")
    write_dummy_checkpoint(out, FLASH2, seed=2, shard_max_bytes=6_000_000)
    return str(out)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("which", ["demo", "flash"])
def test_sharded_triton_load_equals_load_whole_then_cut(device, flash_dir, which, config) -> None:
    if device != "cuda":
        pytest.skip("needs CUDA")
    from deepinfer.ops.table import triton_ops

    ops = triton_ops()
    model_dir = str(demo_model_dir()) if which == "demo" else flash_dir
    full = load_model(model_dir, dtype=torch.bfloat16, device="cuda", progress=False, keep_quantized=True)
    for rank in range(config.world_size):
        pctx = ParallelContext(config, rank, torch.device("cuda"))
        got = load_model(model_dir, dtype=torch.bfloat16, device="cuda", progress=False, ops=ops,
                         shard_model=sharding_hook(pctx))
        want = prepare_for_device(shard_model(copy.deepcopy(full), pctx), ops)
        assert_same_model(got, want)
