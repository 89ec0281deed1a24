"""Config parsing: native and HF spellings, derived layer kinds, and errors that name the field."""

from __future__ import annotations

import json

import pytest

from deepinfer import env
from deepinfer.config import CSA, HCA, SWA, ModelConfig

YARN = {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 65536}
FLASH = {"model_type": "deepseek_v4", "compress_ratios": [0, 0] + [4, 128] * 20 + [4] + [0], "num_hash_layers": 3,
         "rope_scaling": YARN, "expert_dtype": "fp4",
         "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                 "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}}
PRO = {**FLASH, "num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128, "q_lora_rank": 1536,
       "o_groups": 16, "n_routed_experts": 384, "moe_intermediate_size": 3072, "routed_scaling_factor": 2.5,
       "index_topk": 1024, "compress_ratios": [128, 128] + [4, 128] * 29 + [4] + [0]}


def test_flash_native_config() -> None:
    c = ModelConfig.from_dict(FLASH)
    assert c.layer_types[:4] == (SWA, SWA, CSA, HCA)
    assert c.layer_types.count(CSA) == 21 and c.layer_types.count(HCA) == 20
    assert c.num_hash_layers == 3 and c.qk_rope_head_dim == 64
    assert c.compress_rope.yarn_factor == 16 and c.compress_rope.attention_factor == 1.0
    assert c.main_rope.yarn_factor is None and c.main_rope.theta == 10000
    assert c.quant is not None and c.quant.expert_dtype == "fp4"


def test_pro_native_config_has_hca_first_and_csa_on_layer_two() -> None:
    c = ModelConfig.from_dict(PRO)
    assert c.layer_types[:3] == (HCA, HCA, CSA)
    assert c.routed_scaling_factor == 2.5 and c.index_topk == 1024


def test_hf_folded_config_round_trips_through_transformers() -> None:
    pytest.importorskip("transformers")
    from transformers import DeepseekV4Config

    hf = DeepseekV4Config(**{k: v for k, v in FLASH.items() if k != "quantization_config"}).to_dict()
    hf.pop("compress_ratios", None)
    c = ModelConfig.from_dict(hf)
    ref = ModelConfig.from_dict(FLASH)
    assert c.layer_types == ref.layer_types and c.mlp_layer_types == ref.mlp_layer_types
    assert c.compress_rope == ref.compress_rope and c.main_rope == ref.main_rope


def test_native_dict_round_trip() -> None:
    c = ModelConfig.from_dict(PRO)
    again = ModelConfig.from_dict(json.loads(json.dumps(c.to_native_dict())))
    assert again.replace(raw={}) == c.replace(raw={})


@pytest.mark.parametrize("patch, field", [
    ({"model_type": "llama"}, "model_type"),
    ({"model_type": "deepseek_v41"}, "model_type"),
    ({"compress_ratios": [0, 3] + [0] * 42}, "compress_ratios"),
    ({"compress_ratios": [0, 0]}, "compress_ratios"),
    ({"compress_ratios": None}, "compress_ratios"),
    ({"layer_types": ["sliding_attention"] * 43}, "layer_types"),
    ({"scoring_func": "relu"}, "scoring_func"),
    ({"o_groups": 7}, "o_groups"),
    ({"hidden_size": "big"}, "hidden_size"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ({"rope_scaling": {"type": "linear", "factor": 2}}, "rope_scaling"),
    ({"expert_dtype": "int4"}, "expert_dtype"),
    ({"num_experts_per_tok": 300}, "num_experts_per_tok"),
])
def test_bad_fields_name_the_field(patch: dict, field: str) -> None:
    d = {**FLASH, **patch}
    with pytest.raises(ValueError, match=rf"^{field}"):
        ModelConfig.from_dict(d)


def test_missing_config_file_names_the_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_model_dir(tmp_path)


def test_accelerator_switch(monkeypatch) -> None:
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "cpu")
    assert env.accelerator() == "cpu"
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    with pytest.raises(ValueError, match="supported values: cpu, cuda"):
        env.accelerator()
    monkeypatch.delenv("DEEPINFER_ACCELERATOR")
    assert env.accelerator() in ("cpu", "cuda")


def test_boolean_switches(monkeypatch) -> None:
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    assert env.batch_invariant() is True
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "maybe")
    with pytest.raises(ValueError, match="DEEPINFER_ENABLE_MTP_VARLEN"):
        env.enable_mtp_varlen()


def test_truncated_layer_count_ignores_the_rest_of_compress_ratios() -> None:
    c = ModelConfig.from_dict({**FLASH, "num_hidden_layers": 4, "num_nextn_predict_layers": 0})
    assert c.layer_types == (SWA, SWA, CSA, HCA)
    with pytest.raises(ValueError, match="^compress_ratios: MTP slots"):
        ModelConfig.from_dict({**FLASH, "num_hidden_layers": 4, "num_nextn_predict_layers": 1})


def test_async_scheduling_default_follows_the_device_and_what_is_supported() -> None:
    from deepinfer.config.engine import EngineArgs, EngineConfig, auto_async_scheduling
    from deepinfer.config.speculative import SpeculativeConfig
    from deepinfer.distributed.config import ParallelConfig

    one, dp2, cp2 = ParallelConfig(), ParallelConfig(1, 2, True), ParallelConfig(1, 2, True, 2)
    mtp = SpeculativeConfig("mtp", 2)
    assert auto_async_scheduling("cuda", None, one, tiers=False)
    assert auto_async_scheduling("cuda", None, one, tiers=True)
    assert auto_async_scheduling("cuda", None, dp2, tiers=False)
    assert not auto_async_scheduling("cuda", None, dp2, tiers=True)  # tiers on several ranks: refused with async
    assert not auto_async_scheduling("cuda", None, cp2, tiers=False)  # context parallelism: refused with async
    assert auto_async_scheduling("cuda", mtp, one, tiers=False)  # measured faster with speculation too
    assert not auto_async_scheduling("cuda", mtp, dp2, tiers=False)  # speculation on several devices: refused
    assert not auto_async_scheduling("cuda", None, one, tiers=False, v41=True)  # V4.1: GPU-checked in sync only
    assert not auto_async_scheduling("cpu", None, one, tiers=False)  # one thread: nothing to overlap
    # Unset resolves on the CPU to the synchronous loop; an explicit choice is kept (and checked).
    assert EngineConfig.create(EngineArgs(device="cpu")).async_scheduling is False
    assert EngineConfig.create(EngineArgs(device="cpu", async_scheduling=True)).async_scheduling is True
    with pytest.raises(ValueError, match="^async_scheduling: must be true or false"):
        EngineConfig.create(EngineArgs(device="cpu", async_scheduling="yes"))
