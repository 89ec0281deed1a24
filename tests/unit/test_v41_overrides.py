"""``hf_overrides`` on a DeepSeek-V4.1 config (``config/v41_overrides.apply_v41_overrides``): where each key lands in the
nested config.json, fewer layers keeping the schedules whole, and overrides that leave the KV-source / reuse /
Engram schedules inconsistent refused with the field named."""

from __future__ import annotations

import json

import pytest

from deepinfer.assets import shapes_dir
from deepinfer.config.engine import EngineArgs, EngineConfig
from deepinfer.config.v41 import V41Config
from deepinfer.config.v41_overrides import apply_v41_overrides
from tests.oracle.v41 import checkpoint_config, tiny_text_config, tiny_tokenizer

FLASH = shapes_dir("v41-flash")


@pytest.fixture(scope="module")
def tiny() -> dict:
    return checkpoint_config(tiny_text_config(tiny_tokenizer(512)))


def test_text_fields_land_in_text_config(tiny) -> None:
    out = apply_v41_overrides(tiny, {"num_hidden_layers": 4, "n_routed_experts": 4, "image_token_id": 7,
                                     "vision_config": {"num_hidden_layers": 2}})
    assert out["text_config"]["num_hidden_layers"] == 4 and out["text_config"]["n_routed_experts"] == 4
    assert "num_hidden_layers" not in {k for k in out if k != "text_config"} - set(tiny)
    assert out["image_token_id"] == 7 and out["vision_config"] == {"num_hidden_layers": 2}
    assert tiny["text_config"]["num_hidden_layers"] == 10, "the input is not changed"
    # A text_config object merges; a field the parser only defaults (not in the file) goes to text_config too.
    merged = apply_v41_overrides(tiny, {"text_config": {"index_topk": 4}, "hc_sinkhorn_iters": 3})
    assert merged["text_config"]["index_topk"] == 4 and merged["text_config"]["hc_sinkhorn_iters"] == 3
    assert merged["text_config"]["hidden_size"] == tiny["text_config"]["hidden_size"]
    cfg = V41Config.from_dict(merged)
    assert cfg.index_topk == 4 and cfg.hc_sinkhorn_iters == 3


def test_flattened_config_takes_the_same_keys() -> None:
    flat = checkpoint_config(tiny_text_config(tiny_tokenizer(512)), nested=False)
    out = apply_v41_overrides(flat, {"num_hidden_layers": 3, "text_config": {"index_topk": 4}})
    assert "text_config" not in out and out["num_hidden_layers"] == 3 and out["index_topk"] == 4
    assert V41Config.from_dict(out).num_hidden_layers == 3


def test_fewer_layers_keep_the_schedules_whole() -> None:
    full = V41Config.from_model_dir(FLASH)
    cfg = V41Config.from_model_dir(FLASH, {"num_hidden_layers": 4})
    assert cfg.num_hidden_layers == 4
    assert (cfg.compress_ratios, cfg.kv_source_layer_ids, cfg.engram_layer_ids) == \
        (full.compress_ratios, full.kv_source_layer_ids, full.engram_layer_ids)
    assert [cfg.role(i) for i in range(4)] == [full.role(i) for i in range(4)]
    assert cfg.active_engram_layers == (1,)
    assert cfg.raw["text_config"]["num_hidden_layers"] == 4  # the prefix cache's fingerprint sees the overrides


@pytest.mark.parametrize("overrides, field", [
    # Layer 3 (ratio 2) would reuse a source that no longer exists.
    ({"kv_source_layer_ids": [4, 5], "index_source_layer_ids": [4, 5, 7, 9]}, "text_config.kv_source_layer_ids"),
    # Two Engram layers left with one table size.
    ({"engram_layer_ids": [1, 4, 6]}, "text_config.engram_num_embeddings"),
    # A window-only layer made an index source.
    ({"index_source_layer_ids": [0, 2, 4, 5, 7, 9]}, "text_config.index_source_layer_ids"),
    # More layers than the schedule describes.
    ({"num_hidden_layers": 20}, "text_config.compress_ratios"),
    # The candidate source must be a KV source.
    ({"candidate_source_layer_id": 3}, "text_config.candidate_source_layer_id"),
])
def test_inconsistent_schedules_are_refused(tmp_path, tiny, overrides, field) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny))
    with pytest.raises(ValueError, match=rf"^hf_overrides: {field}: "):
        V41Config.from_model_dir(tmp_path, overrides)


@pytest.mark.parametrize("overrides, field", [
    ({"no_such_field": 1}, "hf_overrides"),
    ({"model_type": "deepseek_v4"}, "hf_overrides.model_type"),
    ({"text_config": 3}, "hf_overrides.text_config"),
    (["num_hidden_layers"], "hf_overrides"),
])
def test_bad_overrides_name_the_field(tiny, overrides, field) -> None:
    with pytest.raises(ValueError, match=rf"^{field}: "):
        apply_v41_overrides(tiny, overrides)


def test_engine_config_applies_them() -> None:
    cfg = EngineConfig.create(EngineArgs(model=str(FLASH), device="cpu", load_format="dummy",
                                         hf_overrides={"num_hidden_layers": 2, "n_routed_experts": 16}))
    assert isinstance(cfg.model, V41Config) and cfg.load_format == "dummy"
    assert (cfg.model.num_hidden_layers, cfg.model.n_routed_experts) == (2, 16)
    with pytest.raises(ValueError, match=r"^hf_overrides: text_config\.num_experts_per_tok: "):
        EngineConfig.create(EngineArgs(model=str(FLASH), device="cpu", hf_overrides={"n_routed_experts": 4}))
