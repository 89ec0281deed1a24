"""The memory plan (``deepinfer info``): exact weight bytes, parallel shares, fit verdicts, the CLI."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from deepinfer.assets import demo_model_dir, shapes_dir
from deepinfer.config.model import ModelConfig
from deepinfer.engine.memory_plan import GIB, Deployment, describe, plan, weights_per_device
from deepinfer.model.summary import parameter_specs

H200 = 140 * GIB


def _device_tensor_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct storage the prepared model holds (stacked projections are views), less the
    RoPE tables (recomputed from the config, never weights)."""
    seen: dict[int, int] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if not name.startswith("ropes."):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def test_weight_bytes_equal_what_the_device_transform_holds() -> None:
    """Oracle: the demo model loaded and transformed for the device path (FP8Linear with fp32 block scales,
    stacked FP4 experts with byte scales) holds exactly the planned bytes."""
    from deepinfer.model.loader import load_model
    from deepinfer.ops.table import REF

    model = load_model(demo_model_dir(), dtype=torch.bfloat16, progress=False, ops=REF)  # quantized-first
    planned, experts = weights_per_device(model.cfg, Deployment())
    assert planned == _device_tensor_bytes(model)
    assert experts == sum(_device_tensor_bytes(m.ffn.routed) for m in [*model.layers, *model.mtp])


def test_expert_parallel_spreads_whole_experts_and_tensor_parallel_splits_heads() -> None:
    """The shares follow the engine's sharding (model/parallel/): checked against a sharded model below."""
    cfg = ModelConfig.from_model_dir(demo_model_dir())  # 8 experts
    specs = parameter_specs(cfg)
    one, experts = weights_per_device(cfg, Deployment(), specs)
    dense = one - experts
    for world in (2, 4, 8):  # 8 / world whole experts per device
        got, e = weights_per_device(cfg, Deployment(data_parallel_size=world, enable_expert_parallel=True), specs)
        assert e == experts // world and got == dense + e
    tp2, e2 = weights_per_device(cfg, Deployment(tensor_parallel_size=2), specs)
    assert e2 == experts // 2  # every expert's intermediate split in two
    assert dense // 2 < tp2 - e2 < dense  # heads and the shared expert split; latent, vocab, norms, indexer not
    with pytest.raises(ValueError, match="enable_expert_parallel"):  # 8 experts over 3 devices
        weights_per_device(cfg, Deployment(data_parallel_size=3, enable_expert_parallel=True), specs)


def _held_bytes(env, configs: list) -> list[int]:
    """On one rank: the bytes its shard of the demo model holds on the device path, loaded as the engine loads
    a rank (only its slices, quantized-first), per config."""
    from deepinfer.distributed.world import init_world
    from deepinfer.model.loader import load_model
    from deepinfer.model.parallel.shard import sharding_hook
    from deepinfer.ops.table import REF

    out = []
    for config in configs:
        pctx = init_world(config, "cpu", env, timeout_s=60)
        model = load_model(demo_model_dir(), dtype=torch.bfloat16, progress=False, ops=REF,
                           shard_model=sharding_hook(pctx))
        out.append(_device_tensor_bytes(model))
    return out


def test_parallel_shares_equal_what_sharded_ranks_hold() -> None:
    """Oracle: two real ranks shard the demo model (model/parallel/) and hold exactly the planned bytes.
    (TP without EP is left out here: the demo's 128-wide shared expert split in two falls off its FP8 scale
    blocks, so those ranks keep it dequantized, which V4's shapes never need.)"""
    from deepinfer.distributed.config import ParallelConfig
    from deepinfer.testing.world import run_world

    configs = [ParallelConfig(1, 2, True), ParallelConfig(2, 1, True)]
    held = run_world(_held_bytes, 2, (configs,), timeout_s=150)
    cfg = ModelConfig.from_model_dir(demo_model_dir())
    for i, c in enumerate(configs):
        d = Deployment(c.tensor_parallel_size, c.data_parallel_size, c.enable_expert_parallel)
        assert held[0][i] == held[1][i] == weights_per_device(cfg, d)[0], c


def test_v4_flash_needs_two_h200s_and_v4_pro_needs_more_than_eight() -> None:
    flash = ModelConfig.from_model_dir(shapes_dir("v4-flash"))
    specs = parameter_specs(flash)
    one = plan(flash, Deployment(), H200, specs=specs)
    assert not one.fits and "exceed" in one.reason and one.weight_bytes > 140 * GIB  # ~149 GiB in device formats
    two = plan(flash, Deployment(data_parallel_size=2, enable_expert_parallel=True), H200, specs=specs)
    assert two.fits and two.cache_tokens > 1_000_000
    out = describe(flash, Deployment(), H200, specs)
    assert out["suggestion"].startswith("--tensor-parallel-size 1 --data-parallel-size 2 --enable-expert-parallel")


def test_a_too_small_cache_is_named() -> None:
    cfg = ModelConfig.from_model_dir(demo_model_dir())
    tiny_device = int(2.1 * GIB)  # weights and activations fit; the 2 GiB reserve leaves almost nothing
    p = plan(cfg, Deployment(max_num_seqs=256, max_model_len=65536), tiny_device)
    assert not p.fits and p.cache_tokens == 0


@pytest.mark.parametrize("field, value", [("tensor_parallel_size", 0), ("data_parallel_size", -1),
                                          ("gpu_memory_utilization", 1.5), ("max_model_len", 0),
                                          ("context_parallel_size", 3), ("context_parallel_min_tokens", 0)])
def test_bad_deployment_names_the_field(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        dataclasses.replace(Deployment(), **{field: value})


def test_cli_prints_the_plan_and_fails_when_it_cannot_fit(capsys) -> None:
    from deepinfer.cli import main

    assert main(["info", "--device-memory-gib", "140"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["memory_plan"]["fits"] and out["parameters"]["total"] > 0
    assert main(["info", "--device-memory-gib", "2.05"]) == 1
    captured = capsys.readouterr()
    assert "does not fit" in captured.err and "--gpu-memory-utilization" not in captured.err
    assert json.loads(captured.out)["memory_plan"]["fits"] is False


def test_context_parallel_plan_per_device() -> None:
    """CP borrows the DP ranks: the same weights and no cache of its own per device; each rank's share of the
    longest chunk is the largest piece of the engine's zigzag split, and the rows it receives per layer are
    the chunk's K=V row plus every compressor projection the checkpoint has (the widest layer's)."""
    from deepinfer.model.parallel.context import zigzag_split

    cfg = ModelConfig.from_model_dir(demo_model_dir())
    specs = parameter_specs(cfg)
    dp2 = Deployment(data_parallel_size=4, enable_expert_parallel=True, max_num_batched_tokens=1000)
    cp2 = dataclasses.replace(dp2, context_parallel_size=4, context_parallel_min_tokens=512)
    without, with_cp = plan(cfg, dp2, H200, specs=specs), plan(cfg, cp2, H200, specs=specs)
    assert without.context_parallel is None
    cp = with_cp.context_parallel
    assert with_cp.weight_bytes == without.weight_bytes and with_cp.activation_bytes > without.activation_bytes
    assert (cp.groups, cp.min_chunk_tokens, cp.max_chunk_tokens) == (1, 512, 1000)
    assert cp.share_tokens == max(len(s) for s in zigzag_split(1000, 4)) == 250
    side = ("compressor.wkv", "compressor.wgate", "indexer.compressor.wkv", "indexer.compressor.wgate",
            "indexer.weights_proj")
    widths = [cfg.head_dim + sum(specs[f"layers.{i}.attn.{n}.weight"][0][0] for n in side
                                 if f"layers.{i}.attn.{n}.weight" in specs) for i in range(cfg.num_hidden_layers)]
    assert cp.gathered_bytes == 1000 * max(widths) * 2
    out = with_cp.as_dict()
    assert out["context_parallel"]["share_tokens_per_rank"] == 250
    assert out["cache_tokens_per_dp_rank"] == with_cp.cache_tokens > 0  # one DP rank's budget, not pooled


def test_context_parallel_suggestion_keeps_the_cp_group() -> None:
    """V4-Flash on two H200s without expert parallelism does not fit; the suggested layout keeps CP 2 (a DP size
    it divides) and adds expert parallelism."""
    flash = ModelConfig.from_model_dir(shapes_dir("v4-flash"))
    out = describe(flash, Deployment(data_parallel_size=2, context_parallel_size=2), H200)
    assert not out["fits"] and out["context_parallel"]["context_parallel_size"] == 2
    assert out["suggestion"] == ("--tensor-parallel-size 1 --data-parallel-size 2 --enable-expert-parallel "
                                 "--context-parallel-size 2 (2 devices)")


@pytest.mark.parametrize("flags, field", [
    (["-dp", "4", "-cp", "3"], "context_parallel_size: 3 does not divide data_parallel_size"),
    (["-dp", "2", "-cp", "2", "--context-parallel-min-tokens", "4096"], "context_parallel_min_tokens: 4096 exceeds"),
    (["-dp", "2", "-cp", "2", "--max-num-batched-tokens", "3"], "max_num_batched_tokens: 3 is below"),
])
def test_cli_refuses_context_parallel_sizes_that_cannot_work(capsys, flags, field) -> None:
    from deepinfer.cli import main

    assert main(["info", "--device-memory-gib", "140", *flags]) == 2
    assert field in capsys.readouterr().err


def test_cli_prints_the_context_parallel_plan(capsys) -> None:
    """``info`` takes serve's CP flags (``-cp``, ``--context-parallel-min-tokens``) and prints what each rank of
    the group holds and receives."""
    from deepinfer.cli import main

    assert main(["info", "--device-memory-gib", "140", "-dp", "2", "--enable-expert-parallel", "-cp", "2",
                 "--context-parallel-min-tokens", "256", "--max-num-batched-tokens", "1024"]) == 0
    cp = json.loads(capsys.readouterr().out)["memory_plan"]["context_parallel"]
    assert (cp["context_parallel_size"], cp["min_chunk_tokens"], cp["share_tokens_per_rank"]) == (2, 256, 512)


def test_ranks_sharing_one_device_each_plan_a_share_of_it(capsys) -> None:
    """``ranks_share_device``: the world's ranks on one device, each with 1/world of ``gpu_memory_utilization``
    (as ``engine/sizing.py`` sizes them) and its own reserve; the same weights per rank as on devices of their
    own. V4-Flash on one H200 does not fit that way, and more devices are not the suggestion."""
    from deepinfer.cli import main
    from deepinfer.engine.memory_plan import SHARED_DEVICE_HINT

    cfg = ModelConfig.from_model_dir(demo_model_dir())
    spread = Deployment(data_parallel_size=2, enable_expert_parallel=True)
    shared = dataclasses.replace(spread, ranks_share_device=True)
    a, b = plan(cfg, spread, H200), plan(cfg, shared, H200)
    assert a.weight_bytes == b.weight_bytes and a.activation_bytes == b.activation_bytes
    assert a.cache_bytes - b.cache_bytes == int(H200 * 0.9) - int(H200 * 0.9 / 2)
    assert b.fits and 0 < b.cache_tokens < a.cache_tokens
    assert b.as_dict()["devices"] == 1 and b.as_dict()["per_rank_gib"]["usable"] == 63.0
    flash = ModelConfig.from_model_dir(shapes_dir("v4-flash"))
    out = describe(flash, dataclasses.replace(shared, data_parallel_size=4), H200)
    assert not out["fits"] and "per rank (4 ranks share the device)" in out["reason"]
    assert out["suggestion"] == SHARED_DEVICE_HINT
    assert main(["info", "--device-memory-gib", "140", "-dp", "2", "--enable-expert-parallel",
                 "--ranks-share-device"]) == 0
    plan_out = json.loads(capsys.readouterr().out)["memory_plan"]
    assert plan_out["ranks_share_device"] and plan_out["per_rank_gib"]["usable"] == 63.0
