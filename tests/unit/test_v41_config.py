"""V4.1 config.json parsing (nested and flattened), its validation, and the loader's checkpoint checks."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.config.model import ModelConfig
from deepinfer.config.v41 import V41Config
from deepinfer.model.ckpt_files import CheckpointError
from deepinfer.model.v41.loader import load_v41_model
from deepinfer.model.v41.model import DeepseekV41
from deepinfer.testing.v41_checkpoint import write_v41_checkpoint
from tests.oracle.v41 import checkpoint_config, tiny_text_config, tiny_tokenizer

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
         "expert_dtype": "fp4"}


def _text(**kw) -> dict:
    return tiny_text_config(tiny_tokenizer(512), **kw)


def test_flash_defaults_and_roles():
    cfg = V41Config.from_dict({"model_type": "deepseek_v41", "text_config": {}, "vision_config": {}})
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.rms_norm_eps, cfg.index_topk) == (5120, 40, 1e-20, 512)
    assert cfg.compress_rope.yarn_factor == 16 and cfg.main_rope.yarn_factor is None
    assert cfg.role(20).candidate_source and cfg.role(24).uses_candidates and not cfg.role(24).kv_source
    assert cfg.role(14).engram and cfg.role(14).kv_source and cfg.role(21).ratio == 1
    assert not cfg.role(3).index_source and cfg.vision_enabled and cfg.image_token_id == 129264


def test_nested_and_flattened_forms_agree():
    text = _text()
    nested = V41Config.from_dict(checkpoint_config(text, nested=True))
    flat = V41Config.from_dict(checkpoint_config(text, nested=False))
    assert nested == flat and nested.num_hidden_layers == 10 and nested.kv_source_layer_ids == (2, 4, 5)


@pytest.mark.parametrize("change, field", [
    (dict(compress_ratios=[0, 0, 4, 2, 2, 1, 1, 1, 1, 1]), "text_config.compress_ratios"),
    (dict(kv_source_layer_ids=[1, 4, 5], index_source_layer_ids=[1, 4, 5, 7, 9]), "text_config.index_source_layer_ids"),
    (dict(kv_source_layer_ids=[4, 5], index_source_layer_ids=[4, 5, 7, 9]), "text_config.kv_source_layer_ids"),
    (dict(index_source_layer_ids=[2, 5, 7, 9]), "text_config.index_source_layer_ids"),
    (dict(candidate_source_layer_id=7), "text_config.candidate_source_layer_id"),
    (dict(kv_source_layer_ids=[2, 4, 5, 7]), "text_config.kv_source_layer_ids"),
    (dict(engram_num_embeddings=[300]), "text_config.engram_num_embeddings"),
    (dict(kv_source_layer_ids=[4, 2, 5]), "text_config.kv_source_layer_ids"),
    (dict(num_key_value_heads=2), "text_config.num_key_value_heads"),
    (dict(scoring_func="softmax"), "text_config.scoring_func"),
    (dict(hidden_size=0), "text_config.hidden_size"),
    (dict(o_groups=3), "text_config.o_groups"),
    (dict(tie_word_embeddings=True), "text_config.tie_word_embeddings"),
])
def test_bad_schedules_name_the_field(change, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        V41Config.from_dict(checkpoint_config({**_text(), **change}))


def test_truncated_config_keeps_the_full_schedule():
    cfg = V41Config.from_dict({"model_type": "deepseek_v41", "text_config": {"num_hidden_layers": 4}})
    assert cfg.kv_source_layer_ids == (2, 8, 14, 20) and cfg.active_engram_layers == (1,)


def test_vision_config_parsed_and_image_input_refused():
    d = checkpoint_config(_text())
    d["vision_config"] = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    cfg = V41Config.from_dict(d)
    assert cfg.vision_enabled and cfg.vision.hidden_size == 64
    d["vision_config"]["num_attention_heads"] = 5
    with pytest.raises(ValueError, match="^vision_config.hidden_size"):
        V41Config.from_dict(d)
    model = DeepseekV41(cfg.__class__.from_dict({**checkpoint_config(_text(vocab_size=600, engram_layer_ids=[],
                                                                            engram_num_embeddings=[])),
                                                 "image_token_id": 520}), torch.float32)
    with pytest.raises(ValueError, match="^input_ids: contains image_token_id 520"):
        model(torch.tensor([5, 520, 6]))


def test_v4_parser_points_at_the_v41_model():
    with pytest.raises(ValueError, match="^model_type: 'deepseek_v41'"):
        ModelConfig.from_dict({"model_type": "deepseek_v41"})


@pytest.fixture(scope="module")
def small():
    tok = tiny_tokenizer(512)
    text = tiny_text_config(tok, num_hidden_layers=3, engram_layer_ids=[1], engram_num_embeddings=[300])
    conf = checkpoint_config(text)
    conf["text_config"]["quantization_config"] = QUANT
    model = DeepseekV41(V41Config.from_dict(conf), torch.float32, tokenizer=tok)
    g = torch.Generator().manual_seed(0)
    weights = {k: torch.randn(v.shape, generator=g) * 0.1 for k, v in model.state_dict().items()}
    return conf, weights, tok


def test_loader_round_trip_and_quantized_formats(small, tmp_path):
    conf, weights, tok = small
    want = write_v41_checkpoint(tmp_path, conf, weights, tok, extra={"mtp.0.norm.weight": torch.ones(4)})
    model, ignored = load_v41_model(tmp_path, torch.float32)
    assert ignored == ("mtp.0.norm.weight",)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items())
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_tensor("layers.0.attn.wq_a.weight").dtype == torch.float8_e4m3fn
        assert tuple(f.get_tensor("layers.0.attn.wq_a.scale").shape) == (1, 2)  # [32, 64] in 32x32 blocks
        assert f.get_tensor("layers.0.ffn.experts.0.w1.weight").dtype == torch.int8
        assert tuple(f.get_tensor("layers.1.engram.embed.scale").shape) == (300, 1)  # per row, per 32 columns
    logits = model(torch.tensor([3, 4, 5, 6, 7]))
    assert logits.shape == (5, 512) and bool(torch.isfinite(logits).all())


def _broken(tmp_path, conf, weights, tok, edit):
    write_v41_checkpoint(tmp_path, conf, weights, tok)
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("layers.0.attn.wq_b.weight"), "missing 1 tensor"),
    (lambda t: t.pop("layers.0.attn.wq_b.scale"), "without its scale tensor layers.0.attn.wq_b.scale"),
    (lambda t: t.update({"layers.0.attn_norm.scale": torch.ones(1)}), "unexpected tensor"),
    (lambda t: t.update({"layers.0.attn.wkv.weight": torch.zeros(32, 64)}), "dtype torch.float32 not allowed"),
    (lambda t: t.update({"layers.0.attn.wo_a.scale": t["layers.0.attn.wo_a.scale"][:, :1]}), "scale shape"),
    (lambda t: t.update({"norm.weight": torch.full((64,), float("nan"))}), "NaN or infinite"),
    (lambda t: t.update({"layers.0.attn.wkv.scale": torch.full_like(t["layers.0.attn.wkv.scale"], 255,
                                                                    dtype=torch.uint8).view(torch.float8_e8m0fnu)}),
     "byte 255"),
])
def test_loader_rejects_bad_checkpoints(small, tmp_path, edit, message):
    conf, weights, tok = small
    _broken(tmp_path, conf, weights, tok, edit)
    with pytest.raises(CheckpointError, match=message):
        load_v41_model(tmp_path, torch.float32)


def test_loader_needs_the_tokenizer(small, tmp_path):
    conf, weights, _ = small
    write_v41_checkpoint(tmp_path, conf, weights)
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_v41_model(tmp_path, torch.float32)


def test_config_json_error_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "text_config": {"head_dim": -1}}))
    with pytest.raises(CheckpointError, match="config.json: text_config.head_dim"):
        load_v41_model(tmp_path, torch.float32)
