"""Checkpoint loading: the tool's native FP8/FP4 checkpoints, HF-written checkpoints, and bad checkpoints."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from deepinfer.config import ModelConfig
from deepinfer.hf_bridge import hf_state_to_native
from deepinfer.kv.spec import build_layout
from deepinfer.model.loader import CheckpointError, load_model, read_checkpoint
from deepinfer.model.quant import storage_format
from deepinfer.runner.sequences import SequenceCache
from deepinfer.testing.make_checkpoint import write_random_checkpoint
from tests.oracle.hf import build_hf, tiny_native_config

# Non-square 16x24 blocks: most weights get several blocks and partial edge blocks (hidden 32 = 24 + 8).
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 24],
         "scale_fmt": "ue8m0"}
SINGLE = "model.safetensors"


def quant_config(expert_dtype: str = "fp4", **overrides) -> dict:
    return tiny_native_config(quantization_config=QUANT, expert_dtype=expert_dtype, torch_dtype="bfloat16",
                              **overrides)


@pytest.fixture(scope="module")
def native_ckpt(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("native")
    return out, write_random_checkpoint(out, quant_config(), seed=3)


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite(path: Path, edit) -> None:
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path))


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert got[name].dtype == (torch.int64 if name.endswith("tid2eid") else torch.float32), name
        assert torch.equal(got[name], t), name


def run_forward(model, tokens: list[int]) -> torch.Tensor:
    layout = build_layout(model.cfg, block_size=128)
    cache = SequenceCache(layout, 4, model.dtype)
    sid = cache.new_sequence()
    ids, batch = cache.plan({sid: tokens})
    streams = model(ids, batch, cache.storage)
    cache.commit({sid: tokens})
    logits = model.logits(streams)
    assert logits.shape == (len(tokens), model.cfg.vocab_size)
    assert bool(torch.isfinite(logits).all())
    return streams


# ---- good checkpoints ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("expert_dtype", ["fp4", "fp8", "bf16"])
def test_native_single_file_loads_exact(tmp_path, expert_dtype):
    native = quant_config(expert_dtype)
    want = write_random_checkpoint(tmp_path, native, seed=1)
    assert (tmp_path / SINGLE).is_file() and not (tmp_path / "model.safetensors.index.json").exists()
    cfg = ModelConfig.from_dict(native)
    ck = read_checkpoint(tmp_path, cfg, torch.float32)
    assert_same(ck.tensors, want)
    quantized = {n for n in want if storage_format(n, cfg) in ("fp8", "fp4")}
    assert set(ck.quantized) == quantized and ck.has_mtp and ck.ignored == ()
    fmts = {q.format for q in ck.quantized.values()}
    assert fmts == ({"fp8", "fp4"} if expert_dtype == "fp4" else {"fp8"})
    for name, q in ck.quantized.items():
        assert torch.equal(q.dequantize(), want[name]), name
        assert q.scale.dtype == torch.float8_e8m0fnu
        assert q.data.dtype == (torch.float8_e4m3fn if q.format == "fp8" else torch.int8)
        assert q.block == ((16, 24) if q.format == "fp8" else (1, 32))


def test_native_sharded_loads_exact(tmp_path, native_ckpt):
    want = write_random_checkpoint(tmp_path, quant_config(), seed=3, shard_max_bytes=20_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 3 and not (tmp_path / SINGLE).exists()
    assert all(torch.equal(want[k], v) for k, v in native_ckpt[1].items())  # same seed, same weights
    ck = read_checkpoint(tmp_path, ModelConfig.from_dict(quant_config()), torch.float32)
    assert_same(ck.tensors, want)
    assert set(ck.files) == shards


def test_hf_names_from_tool_load_same_weights(tmp_path, native_ckpt):
    want = write_random_checkpoint(tmp_path, quant_config(), seed=3, names="hf")
    disk = set(load_file(str(tmp_path / SINGLE)))
    assert "model.layers.0.attn.norm.weight" in disk and "model.layers.0.attn.wq_a.weight_scale_inv" in disk
    assert "head.weight" in disk and "model.embed_tokens.weight" in disk
    ck = read_checkpoint(tmp_path, ModelConfig.from_dict(quant_config()), torch.float32)
    assert_same(ck.tensors, want)
    assert_same(ck.tensors, native_ckpt[1])


def test_load_model_runs_forward(native_ckpt):
    path, want = native_ckpt
    for dtype in (torch.float32, torch.bfloat16):
        model = load_model(path, dtype=dtype, progress=False, keep_quantized=True)  # the stored form too
        state = model.state_dict()
        for name, t in want.items():
            assert torch.equal(state[name], t.to(state[name].dtype)), name
        assert state["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
        assert state["layers.0.attn.wq_a.weight"].dtype == dtype and state["norm.weight"].dtype == torch.float32
        assert all(not p.requires_grad for p in model.parameters())
        assert len(model.quantized) > 0 and model.cfg.num_nextn_predict_layers == 1
        tokens = list(range(3, 40))
        streams = run_forward(model, tokens)
        if dtype == torch.float32:  # the MTP block is loaded too and drafts finite logits
            layout = build_layout(model.cfg, block_size=128)
            cache = SequenceCache(layout, 4, dtype)
            sid = cache.new_sequence()
            ids, batch = cache.plan({sid: tokens})
            nxt = torch.tensor(tokens[1:] + [5])
            mtp = model.mtp_forward(streams, nxt, batch, cache.storage)
            assert bool(torch.isfinite(model.mtp_logits(mtp)).all())


def test_progress_bar_can_be_disabled(native_ckpt, capsys):
    load_model(native_ckpt[0], dtype=torch.float32, progress=False)
    assert "Loading weights" not in capsys.readouterr().err
    load_model(native_ckpt[0], dtype=torch.float32, progress=True)
    assert "Loading weights" in capsys.readouterr().err


def test_hf_save_pretrained_loads_hf_weights(tmp_path):
    native = tiny_native_config()
    hf = build_hf(native, seed=0)
    hf.save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"missing .*mtp\.0\."):  # HF drops the MTP block
        load_model(tmp_path, dtype=torch.float32, progress=False)
    model = load_model(tmp_path, dtype=torch.float32, strict_mtp=False, progress=False)
    assert model.cfg.num_nextn_predict_layers == 0 and len(model.mtp) == 0 and model.quantized == {}
    want = hf_state_to_native(hf.state_dict())
    state = model.state_dict()
    assert state.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(state[name], t), name
    run_forward(model, list(range(1, 30)))


def test_hf_module_names_with_merged_experts(tmp_path):
    native = tiny_native_config(num_nextn_predict_layers=0, compress_ratios=[0, 4, 128])
    hf = build_hf(native, seed=1)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mlp.experts.gate_up_proj" in state and "model.layers.0.self_attn.q_a_proj.weight" in state
    save_file(state, str(tmp_path / SINGLE))
    (tmp_path / "config.json").write_text(json.dumps(native))
    model = load_model(tmp_path, dtype=torch.float32, progress=False)
    ours = model.state_dict()
    for name, t in hf_state_to_native(hf.state_dict()).items():
        assert torch.equal(ours[name], t), name


def test_merged_quantized_experts_with_scale_inv(tmp_path, native_ckpt):
    """HF FP8Experts layout: gate_up_proj [E, 2I, H/2] int8 + gate_up_proj_scale_inv [E, 2I, H/32] e8m0."""
    path = copy_ckpt(native_ckpt[0], tmp_path / "ck")
    cfg = ModelConfig.from_dict(quant_config())

    def merge(t: dict[str, torch.Tensor]) -> None:
        for layer in [f"layers.{i}" for i in range(cfg.num_hidden_layers)] + ["mtp.0"]:
            hf = ("model." if layer.startswith("layers") else "") + layer + ".mlp.experts."
            for kind, suffix in (("weight", ""), ("scale", "_scale_inv")):
                per = [[t.pop(f"{layer}.ffn.experts.{e}.{w}.{kind}") for e in range(cfg.n_routed_experts)]
                       for w in ("w1", "w3", "w2")]
                t[hf + "gate_up_proj" + suffix] = torch.stack([torch.cat([a, b]) for a, b in zip(per[0], per[1])])
                t[hf + "down_proj" + suffix] = torch.stack(per[2])

    rewrite(path / SINGLE, merge)
    ck = read_checkpoint(path, cfg, torch.float32)
    assert_same(ck.tensors, native_ckpt[1])
    assert ck.quantized["layers.1.ffn.experts.3.w3.weight"].format == "fp4"


def test_harmless_extras_are_ignored_and_listed(tmp_path, native_ckpt):
    path = copy_ckpt(native_ckpt[0], tmp_path / "ck")
    rewrite(path / SINGLE, lambda t: t.update({"model.rotary_emb.inv_freq": torch.ones(4)}))
    ck = read_checkpoint(path, ModelConfig.from_dict(quant_config()), torch.float32)
    assert ck.ignored == ("model.rotary_emb.inv_freq",)
    # A config without MTP layers skips the checkpoint's mtp.* tensors.
    ck = read_checkpoint(path, ModelConfig.from_dict(quant_config(num_nextn_predict_layers=0)), torch.float32)
    assert any(n.startswith("mtp.0.") for n in ck.ignored) and not any(n.startswith("mtp.") for n in ck.tensors)


def test_strict_mtp(tmp_path, native_ckpt):
    path = copy_ckpt(native_ckpt[0], tmp_path / "ck")
    rewrite(path / SINGLE, lambda t: [t.pop(k) for k in [k for k in t if k.startswith("mtp.")]])
    with pytest.raises(CheckpointError, match=r"missing \d+ tensor\(s\): mtp\.0\."):
        load_model(path, dtype=torch.float32, progress=False)
    model = load_model(path, dtype=torch.float32, strict_mtp=False, progress=False)
    assert len(model.mtp) == 0
    # A partial MTP block is an error even with strict_mtp=False.
    rewrite(path / SINGLE, lambda t: t.update({"mtp.0.enorm.weight": torch.ones(32, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=r"missing \d+ tensor\(s\): mtp\.0\.hc_attn_fn"):
        load_model(path, dtype=torch.float32, strict_mtp=False, progress=False)


# ---- bad checkpoints -----------------------------------------------------------------------------------------
@pytest.fixture()
def sharded(tmp_path) -> Path:
    write_random_checkpoint(tmp_path / "ck", quant_config(), seed=4, shard_max_bytes=20_000)
    return tmp_path / "ck"


def shard_of(path: Path, name: str) -> str:
    return json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][name]


def load(path: Path):
    return load_model(path, dtype=torch.float32, progress=False)


def test_missing_shard(sharded):
    rel = shard_of(sharded, "layers.1.attn.wq_b.weight")
    (sharded / rel).unlink()
    with pytest.raises(CheckpointError, match=f"shard {re.escape(rel)} .*missing"):
        load(sharded)


def test_tensor_listed_in_index_but_absent_from_shard(sharded):
    rel = shard_of(sharded, "layers.1.attn.wq_b.weight")
    rewrite(sharded / rel, lambda t: t.pop("layers.1.attn.wq_b.weight"))
    with pytest.raises(CheckpointError, match=f"{re.escape(rel)}: .*absent: layers.1.attn.wq_b.weight"):
        load(sharded)


def test_missing_tensor(tmp_path, native_ckpt):
    path = copy_ckpt(native_ckpt[0], tmp_path / "ck")
    rewrite(path / SINGLE, lambda t: t.pop("layers.2.attn.compressor.ape"))
    with pytest.raises(CheckpointError, match=r"safetensors.*missing 1 tensor\(s\): layers.2.attn.compressor.ape"):
        load(path)


def test_unexpected_tensor(tmp_path, native_ckpt):
    path = copy_ckpt(native_ckpt[0], tmp_path / "ck")
    rewrite(path / SINGLE, lambda t: t.update({"layers.0.attn.bogus.weight": torch.ones(2)}))
    with pytest.raises(CheckpointError, match="unexpected.*layers.0.attn.bogus.weight in model.safetensors"):
        load(path)
    # A scale next to a tensor the config does not quantize is unexpected too.
    scale = {"layers.1.attn.compressor.wkv.scale": torch.full((4, 2), 127, dtype=torch.uint8)}
    rewrite(path / SINGLE, lambda t: (t.pop("layers.0.attn.bogus.weight"), t.update(scale)))
    with pytest.raises(CheckpointError, match="does not quantize.*compressor.wkv.scale"):
        load(path)


def test_wrong_shape(sharded):
    name = "layers.0.ffn.gate.weight"
    rel = shard_of(sharded, name)
    rewrite(sharded / rel, lambda t: t.update({name: torch.zeros(8, 31, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError, match=re.escape(f"{name} in {rel}: expected (8, 32), got (8, 31)")):
        load(sharded)


def test_wrong_shape_fp8_weight_and_scale(tmp_path, native_ckpt):
    path = copy_ckpt(native_ckpt[0], tmp_path / "ck")
    rewrite(path / SINGLE, lambda t: t.update({"layers.0.attn.wq_a.weight": t["layers.0.attn.wq_b.weight"].clone()}))
    with pytest.raises(CheckpointError, match=re.escape("layers.0.attn.wq_a.weight in model.safetensors: "
                                                        "expected (16, 32), got (128, 16)")):
        load(path)
    path = copy_ckpt(native_ckpt[0], tmp_path / "ck2")
    rewrite(path / SINGLE, lambda t: t.update({"layers.0.attn.wq_a.scale": t["layers.0.attn.wq_a.scale"][:, :1]}))
    with pytest.raises(CheckpointError, match=re.escape("layers.0.attn.wq_a.scale in model.safetensors: scale shape "
                                                        "for (16, 32) weight expected (1, 2), got (1, 1)")):
        load(path)


def test_fp8_weight_without_scale(tmp_path, native_ckpt):
    path = copy_ckpt(native_ckpt[0], tmp_path / "ck")
    rewrite(path / SINGLE, lambda t: t.pop("layers.1.ffn.shared_experts.w2.scale"))
    with pytest.raises(CheckpointError, match="layers.1.ffn.shared_experts.w2.weight in model.safetensors: "
                                              "FP8 weight without its scale"):
        load(path)


def test_dtype_not_allowed(tmp_path, native_ckpt):
    path = copy_ckpt(native_ckpt[0], tmp_path / "ck")
    rewrite(path / SINGLE, lambda t: t.update({"layers.0.ffn.gate.tid2eid": t["layers.0.ffn.gate.tid2eid"].float()}))
    with pytest.raises(CheckpointError, match="layers.0.ffn.gate.tid2eid in model.safetensors: dtype torch.float32"):
        load(path)
    path = copy_ckpt(native_ckpt[0], tmp_path / "ck2")
    rewrite(path / SINGLE, lambda t: t.update({"layers.0.attn.wkv.weight": torch.zeros(32, 32, dtype=torch.bfloat16)}))
    with pytest.raises(CheckpointError, match="layers.0.attn.wkv.weight in model.safetensors: dtype torch.bfloat16 "
                                              "not allowed.*FP8"):
        load(path)
    path = copy_ckpt(native_ckpt[0], tmp_path / "ck3")
    rewrite(path / SINGLE, lambda t: t.update({"norm.weight": t["norm.weight"].to(torch.float8_e4m3fn)}))
    with pytest.raises(CheckpointError, match="norm.weight in model.safetensors: dtype torch.float8_e4m3fn"):
        load(path)


def test_nan_scale_and_out_of_range_hash_ids(tmp_path, native_ckpt):
    path = copy_ckpt(native_ckpt[0], tmp_path / "ck")
    bad = torch.full((32, 1), 255, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    rewrite(path / SINGLE, lambda t: t.update({"layers.2.ffn.experts.5.w2.scale": bad}))
    with pytest.raises(CheckpointError, match="layers.2.ffn.experts.5.w2.scale in model.safetensors: .*255"):
        load(path)
    path = copy_ckpt(native_ckpt[0], tmp_path / "ck2")
    rewrite(path / SINGLE, lambda t: t["layers.0.ffn.gate.tid2eid"].__setitem__((0, 0), 8))
    with pytest.raises(CheckpointError, match=r"layers.0.ffn.gate.tid2eid in model.safetensors: expert ids"):
        load(path)


def test_truncated_shard(sharded):
    rel = shard_of(sharded, "layers.2.attn.wo_b.weight")
    data = (sharded / rel).read_bytes()
    (sharded / rel).write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match=f"{re.escape(rel)}: cannot read the safetensors header"):
        load(sharded)


def test_corrupt_header(tmp_path, native_ckpt):
    path = copy_ckpt(native_ckpt[0], tmp_path / "ck")
    data = bytearray((path / SINGLE).read_bytes())
    data[8:16] = b"{garbage"
    (path / SINGLE).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read the safetensors header"):
        load(path)
    (path / SINGLE).write_bytes(b"\x01\x00")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load(path)


def test_unknown_model_type(tmp_path, native_ckpt):
    path = copy_ckpt(native_ckpt[0], tmp_path / "ck")
    config = json.loads((path / "config.json").read_text())
    config["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"config.json: model_type: 'llama' is not supported"):
        load(path)


def test_no_weights_at_all(tmp_path, native_ckpt):
    path = tmp_path / "ck"
    path.mkdir()
    shutil.copy(native_ckpt[0] / "config.json", path / "config.json")
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json"):
        load(path)
