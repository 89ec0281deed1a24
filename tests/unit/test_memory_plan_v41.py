"""The DeepSeek-V4.1 memory plan (``deepinfer info``): weight bytes against a built model and a written
checkpoint, cache bytes against the engine's allocated storage, the fit check, layouts the engine does not run
for V4.1, the V4.1-Flash shapes, and the CLI's error for a model directory without config.json."""

from __future__ import annotations

import dataclasses

import json

import pytest
import torch
from safetensors import safe_open

from deepinfer.assets import shapes_dir
from deepinfer.cli import main
from deepinfer.config.engine import EngineArgs, EngineConfig
from deepinfer.config.v41 import V41Config
from deepinfer.engine.memory_plan import GIB, Deployment
from deepinfer.engine.memory_plan_v41 import (V41Weights, bytes_per_token, cache_layout, plan_v41, smallest_device_gib,
                                              v41_parameter_specs)
from deepinfer.engine.sizing import build_cache
from deepinfer.kv.spec import POOLS
from deepinfer.model.v41.model import DeepseekV41
from deepinfer.testing.v41_checkpoint import write_v41_checkpoint
from tests.oracle.v41 import checkpoint_config, tiny_text_config, tiny_tokenizer

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
         "expert_dtype": "fp4"}
H200 = 140 * GIB


@pytest.fixture(scope="module")
def tiny() -> dict:
    """A tiny V4.1 config with every layer kind, Engram and three DSpark stages, quantized as released."""
    text = tiny_text_config(tiny_tokenizer(512), quantization_config=QUANT)
    return checkpoint_config(text)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, tiny) -> str:
    path = tmp_path_factory.mktemp("v41plan")
    (path / "config.json").write_text(json.dumps(tiny))
    return str(path)


def _module_bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def test_dequantized_weights_equal_the_built_models_parameters_and_buffers(tiny) -> None:
    """What the CPU reference path holds: a real (not meta) tiny model's parameters and buffers, the target's
    and the drafter's apart."""
    cfg = V41Config.from_dict(tiny)
    model = DeepseekV41(cfg, torch.bfloat16, shapes_only=True, dspark=True)
    specs = v41_parameter_specs(cfg)
    drafter = V41Weights.of(cfg, specs, drafter=True)
    assert drafter.dequantized == _module_bytes(model.mtp) > 0
    assert V41Weights.of(cfg, specs, drafter=False).dequantized == _module_bytes(model) - _module_bytes(model.mtp)


def test_native_weights_equal_the_checkpoints_tensor_bytes(tiny, tmp_path) -> None:
    """The checkpoint's formats: a tiny checkpoint written in the released formats (FP8 32x32 blocks, FP4
    experts, FP8 Engram tables, UE8M0 byte scales; float32 for the rest, as the float32 model holds it) stores
    exactly the planned bytes, target and drafter."""
    cfg = V41Config.from_dict(tiny)
    assert cfg.dtype == "float32" and cfg.quant is not None
    specs = v41_parameter_specs(cfg, torch.float32)
    g = torch.Generator().manual_seed(0)
    weights = {name: 0.1 * torch.randn(shape, generator=g) for name, (shape, _) in specs.items()}
    write_v41_checkpoint(tmp_path, tiny, weights)
    on_disk = {"target": 0, "drafter": 0}
    quantized = 0
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            on_disk["drafter" if name.startswith("mtp.") else "target"] += t.numel() * t.element_size()
            quantized += t.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8, torch.float8_e8m0fnu)
    assert quantized > 0  # the formats above were written, not floats
    target, drafter = V41Weights.of(cfg, specs, drafter=False), V41Weights.of(cfg, specs, drafter=True)
    assert (target.total, drafter.total) == (on_disk["target"], on_disk["drafter"])
    assert target.total < target.dequantized


@pytest.mark.parametrize("dspark", [False, True])
def test_cache_bytes_per_token_equal_the_engines_storage(tiny_dir, dspark) -> None:
    """Per pool: the bytes the engine's storage allocates for its V4.1 layout (built by ``build_cache``, with
    the drafter's context rows under ``speculative_config`` dspark) over the positions its blocks hold."""
    spec = {"method": "dspark", "num_speculative_tokens": 5} if dspark else None
    config = EngineConfig.create(EngineArgs(model=tiny_dir, device="cpu", dtype="bfloat16", block_size=128,
                                            num_cache_blocks=3, speculative_config=spec))
    _, storage, _ = build_cache(config)
    cfg = V41Config.from_model_dir(tiny_dir)
    planned = bytes_per_token(cache_layout(cfg, Deployment(block_size=128), dspark))
    for pool in POOLS:
        allocated = sum(t.numel() * t.element_size() for (key, name), t in storage.tensors.items()
                        if storage.layout.layer(key).tensor(name).pool == pool)
        assert planned[pool] == allocated / ((storage.num_blocks[pool] + 1) * 128), pool
    assert all(planned[p] > 0 for p in POOLS)


def test_plan_cache_tokens_are_what_the_engine_allocates_for_the_budget_left(tiny_dir) -> None:
    """The cache budget the plan leaves, given to the engine (prefix caching off: no retained tails), gives the
    engine exactly the planned history; the smallest device is the edge of fitting."""
    cfg = V41Config.from_model_dir(tiny_dir)
    specs = v41_parameter_specs(cfg)
    d = Deployment(max_num_seqs=8, max_model_len=4096, max_num_batched_tokens=512, block_size=128)
    need = smallest_device_gib(cfg, d, specs)
    assert need is not None and plan_v41(cfg, d, need * GIB, specs).fits
    assert not plan_v41(cfg, d, (need - 1) * GIB, specs).fits
    big = plan_v41(cfg, d, H200, specs)
    assert big.fits and big.cache_tokens > 0
    # A device leaving ~64 MiB for the cache (the engine below allocates it for real).
    device = int((big.weight_bytes + big.activation_bytes + big.reserved_bytes + (64 << 20)) / 0.9) + 1
    p = plan_v41(cfg, d, device, specs)
    assert p.fits and 0 < p.cache_bytes < 65 << 20 and 0 < p.cache_tokens < big.cache_tokens
    budget_gib = (p.cache_bytes // 128 * 128) / GIB  # exactly representable: the engine multiplies back
    config = EngineConfig.create(EngineArgs(
        model=tiny_dir, device="cpu", dtype="bfloat16", block_size=128, max_num_seqs=8, max_model_len=4096,
        max_num_batched_tokens=512, cache_memory_gb=budget_gib, enable_prefix_caching=False))
    _, storage, _ = build_cache(config)
    assert storage.num_blocks["history"] * 128 == p.cache_tokens


@pytest.mark.parametrize("flags, field", [(["-dp", "2", "-cp", "2"], "context_parallel_size"),
                                          (["-tp", "2", "-dp", "2", "--enable-expert-parallel", "-cp", "2"],
                                           "context_parallel_size"),
                                          (["-dp", "2", "--enable-expert-parallel", "--ranks-share-device"],
                                           "ranks_share_device")])
def test_layouts_the_engine_does_not_run_for_v41_are_not_planned(tiny_dir, capsys, flags, field) -> None:
    assert main(["info", "--model", tiny_dir, "--block-size", "128", *flags]) == 1
    captured = capsys.readouterr()
    plan = json.loads(captured.out)["memory_plan"]
    assert plan["supported"] is False and not plan["fits"] and "per_device_gib" not in plan
    assert plan["reason"].startswith(f"{field}: DeepSeek-V4.1")
    assert "allowed: 1" in plan["reason"] or "allowed: one rank" in plan["reason"]
    assert plan["suggestion"] == "--tensor-parallel-size 1 --data-parallel-size 1 (1 device)"
    assert captured.err.startswith(f"error: not supported: {field}") and captured.err.count("\n") == 1


def test_data_and_expert_parallel_plan_of_the_tiny_model(tiny_dir, capsys) -> None:
    """DP2 + EP: a device holds half of the routed experts and every other weight; DP2 alone all of them; TP2
    half of the experts' widths and of the heads' tensors; the drafter is not planned on several ranks (the
    engine refuses it there)."""
    base = ["info", "--model", tiny_dir, "--block-size", "128", "--device-memory-gib", "140"]
    plans = []
    for flags in ([], ["-dp", "2"], ["-dp", "2", "--enable-expert-parallel"]):
        assert main([*base, *flags]) == 0
        plans.append(json.loads(capsys.readouterr().out)["memory_plan"])
    one, dp, ep = plans
    assert dp["supported"] and ep["supported"] and dp["devices"] == ep["devices"] == 2
    assert dp["per_device_gib"] == one["per_device_gib"]
    specs = v41_parameter_specs(V41Config.from_model_dir(tiny_dir))
    d = Deployment(block_size=128)
    p1 = plan_v41(V41Config.from_model_dir(tiny_dir), d, H200, specs)
    p2 = plan_v41(V41Config.from_model_dir(tiny_dir), dataclasses.replace(d, data_parallel_size=2,
                                                                         enable_expert_parallel=True), H200, specs)
    assert p2.expert_bytes * 2 == p1.expert_bytes and p1.weight_bytes - p2.weight_bytes == p2.expert_bytes
    tp = plan_v41(V41Config.from_model_dir(tiny_dir), dataclasses.replace(d, tensor_parallel_size=2), H200, specs)
    assert tp.expert_bytes * 2 == p1.expert_bytes and tp.weight_bytes < p1.weight_bytes - tp.expert_bytes
    assert ep["dspark"]["available"] is False and ep["dspark"]["reason"].startswith("speculative_config: ")
    assert "device cpu only" in ep["note"]


def test_one_device_plan_of_the_tiny_model(tiny_dir, capsys) -> None:
    """Expert parallelism over one device holds every expert: the same plan as without it."""
    assert main(["info", "--model", tiny_dir, "--block-size", "128", "--device-memory-gib", "140"]) == 0
    plain = json.loads(capsys.readouterr().out)["memory_plan"]
    assert main(["info", "--model", tiny_dir, "--block-size", "128", "--device-memory-gib", "140",
                 "--enable-expert-parallel"]) == 0
    ep = json.loads(capsys.readouterr().out)["memory_plan"]
    assert plain["fits"] and plain["supported"] and plain["cache_tokens_per_dp_rank"] > 0
    assert plain["per_device_gib"] == ep["per_device_gib"]
    assert plain["dspark"]["with_drafter"]["fits"] and set(plain["dspark"]["cache_bytes_per_token"]) == {"window"}


def test_v41_flash_shapes(capsys) -> None:
    """The shapes directory plans the published V4.1-Flash: routed experts and Engram tables in their formats
    (spec §1.2 / §7.1), the packed cache of ``kv_cache_dtype="auto"``: 890 B of history per token (spec §4.2;
    3200 B as bf16 rows), 40 window rows of 528 B (FP8 + 16 UE8M0 scales) and a 4 B Engram token id, the
    drafter's 3 context rows of 528 B; it does not fit one H200, and the smallest device that holds it is named."""
    flash = shapes_dir("v41-flash")
    cfg = V41Config.from_model_dir(flash)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.quant.weight_block_size) == (
        5120, 40, 384, (32, 32))
    assert main(["info", "--model", str(flash), "--device-memory-gib", "140"]) == 1
    captured = capsys.readouterr()
    info = json.loads(captured.out)
    plan = info["memory_plan"]
    experts = 40 * 384 * 3 * 2304 * 5120  # w1, w3 [2304, 5120] and w2 [5120, 2304] per expert
    engram = (384006168 + 384016682) * 256
    gib = plan["per_device_gib"]
    assert gib["of_which_routed_experts"] == round((experts // 2 + experts // 32) / GIB, 2)  # FP4 + UE8M0 / 32
    assert gib["of_which_engram_tables"] == round((engram + engram // 32) / GIB, 2)  # FP8 + UE8M0 / 32
    assert info["parameters"]["engram_tables"] == engram
    nvfp4, mxfp4, fp8 = 256 + 32, 64 + 4, 512 + 16  # spec §4.1's records of 512 / 128 / 512 channels
    assert plan["cache_bytes_per_token"]["history"] == 3 * (nvfp4 + mxfp4) / 2 + (nvfp4 + mxfp4) == 890
    assert plan["cache_bytes_per_token"]["window"] == 40 * fp8 + 4
    assert info["cache_auto"] == {"history_bytes_per_token": 890, "window_bytes_per_token": 40 * fp8 + 4,
                                  "state_bytes_per_token": 3 * 2 * 512 * 4}
    assert info["cache_bf16"]["history_bytes_per_token"] == 3200  # kv_cache_dtype="bfloat16": unpacked rows
    assert info["cache_bf16"]["window_bytes_per_token"] == 40 * 512 * 2 + 4
    assert plan["cache_positions_kept_per_sequence"]["window"] == 128
    assert plan["dspark"]["cache_bytes_per_token"] == {"window": 3 * fp8}
    assert not plan["fits"] and "exceed" in plan["reason"] and "device of at least" in plan["suggestion"]
    assert captured.err.startswith("error: does not fit") and captured.err.count("\n") == 1
    need = int(plan["suggestion"].split("--device-memory-gib ")[1].split(")")[0])
    assert gib["weights"] < need < 2 * gib["weights"]


@pytest.mark.parametrize("command", [["info"], ["generate", "x"], ["serve"], ["chat"]])
def test_a_model_directory_without_config_json_is_one_clear_error(tmp_path, capsys, command) -> None:
    for model in (tmp_path, tmp_path / "absent"):
        assert main([*command, "--model", str(model)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --model: {model / 'config.json'} not found") and err.count("\n") == 1
        assert "Traceback" not in err


def test_a_v4_directory_keeps_the_v4_plan(capsys) -> None:
    """A V4 directory (the demo model) still gets V4's plan: no ``supported`` key, no drafter rows."""
    assert main(["info", "--device-memory-gib", "140"]) == 0
    plan = json.loads(capsys.readouterr().out)["memory_plan"]
    assert "supported" not in plan and "dspark" not in plan and plan["fits"]
