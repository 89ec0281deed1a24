"""Quantized-first loading (``load_model(..., ops=...)``): the model is built empty in the device transform's
form and filled tensor by tensor. It must hold exactly what load-then-transform (``prepare_for_device`` on a
model loaded with its quantized weights kept) holds, give the same logits bits, and never hold a dequantized
copy of an FP8/FP4 weight. The reference path (no op table) keeps no quantized copy."""

from __future__ import annotations

import copy

import pytest
import torch

from deepinfer.assets import demo_model_dir
from deepinfer.config import ModelConfig
from deepinfer.kv.spec import build_layout
from deepinfer.model.device import FP8Linear, FusedFP4Experts, prepare_for_device
from deepinfer.model.loader import load_model, read_checkpoint
from deepinfer.model.quant import storage_format
from deepinfer.ops.table import REF
from deepinfer.runner.sequences import SequenceCache
from deepinfer.testing.make_checkpoint import PRESETS, write_random_checkpoint


def _tensors(model) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def assert_same_model(got, want) -> None:
    a, b = _tensors(got), _tensors(want)
    assert a.keys() == b.keys()
    for name, t in b.items():
        assert a[name].dtype == t.dtype and a[name].shape == t.shape, name
        assert torch.equal(a[name], t), name


def logits(model, ids: list[int]) -> torch.Tensor:
    cache = SequenceCache(build_layout(model.cfg, 128), 4, model.dtype)
    sid, out = cache.new_sequence(), []
    for chunk in (ids[:70], ids[70:140], ids[140:]):
        t, batch = cache.plan({sid: chunk})
        out.append(model.logits(model(t, batch, cache.storage)))
        cache.commit({sid: chunk})
    return torch.cat(out)


def load_then_transform(path, dtype=torch.float32):
    return prepare_for_device(load_model(path, dtype=dtype, progress=False, keep_quantized=True), REF)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny preset's shape (every layer kind, hash + routed MoE, MTP, partial 128-blocks) native and sharded, and
    the same weights under HF names (merged experts, ``_scale_inv``) in one file."""
    config = {**copy.deepcopy(PRESETS["tiny"]), "moe_intermediate_size": 32}  # the FP4 kernels' 32-groups
    native = tmp_path_factory.mktemp("native")
    write_random_checkpoint(native, config, seed=5, shard_max_bytes=30_000)
    hf = tmp_path_factory.mktemp("hf")
    write_random_checkpoint(hf, config, seed=5, names="hf")
    return native, hf


def test_demo_model_bit_identical_to_load_then_transform() -> None:
    ids = torch.randint(3, 4096, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    want = load_then_transform(demo_model_dir())
    got = load_model(demo_model_dir(), dtype=torch.float32, progress=False, ops=REF)
    assert_same_model(got, want)
    assert torch.equal(logits(got, ids), logits(want, ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiny_checkpoints_bit_identical_to_load_then_transform(tiny, dtype) -> None:
    native, hf = tiny
    ids = torch.randint(3, 97, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    want = load_then_transform(native, dtype)
    ref = logits(want, ids)
    for path in (native, hf):  # sharded native files; HF names with merged experts read expert by expert
        got = load_model(path, dtype=dtype, progress=False, ops=REF)
        assert_same_model(got, want)
        assert torch.equal(logits(got, ids), ref)


def test_no_dequantized_copy_after_a_quantized_first_load(tiny) -> None:
    """Every byte the transformed model holds is accounted for: FP8 codes as e4m3, FP4 codes and UE8M0
    expert scales as bytes, the FP8 block scales as fp32 multipliers, every other tensor once in its dtype.
    A dequantized copy of any FP8/FP4 weight would add float bytes."""
    native, _ = tiny
    cfg = ModelConfig.from_model_dir(native)
    model = load_model(native, dtype=torch.float32, progress=False, ops=REF)
    ck = read_checkpoint(native, cfg, torch.float32)
    names = set(model.state_dict())
    assert not names & set(ck.quantized)  # no tensor under a quantized weight's name
    assert all(len(layer.ffn.experts) == 0 for layer in [*model.layers, *model.mtp])
    by_dtype: dict[torch.dtype, int] = {}
    seen = set()
    for t in _tensors(model).values():
        s = t.untyped_storage()
        if s.data_ptr() in seen or t.device.type == "meta":
            continue
        seen.add(s.data_ptr())
        by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + s.nbytes()
    rope = sum(b.untyped_storage().nbytes() for b in model.ropes.buffers())
    fp8 = [q for n, q in ck.quantized.items() if q.format == "fp8"]
    fp4 = [q for n, q in ck.quantized.items() if q.format == "fp4"]
    plain = [t for n, t in ck.tensors.items() if n not in ck.quantized]
    assert by_dtype.pop(torch.float8_e4m3fn) == sum(q.data.numel() for q in fp8)
    assert by_dtype.pop(torch.int8) == sum(q.data.numel() for q in fp4)
    assert by_dtype.pop(torch.uint8) == sum(q.scale.numel() for q in fp4)
    assert by_dtype.pop(torch.int64) == sum(t.numel() * 8 for t in plain if t.dtype == torch.int64)
    floats = sum(t.numel() * 4 for t in plain if t.dtype == torch.float32) + sum(q.scale.numel() * 4 for q in fp8)
    assert by_dtype.pop(torch.float32) == floats + rope
    assert by_dtype == {}
    kinds = {type(m) for m in model.modules()}
    assert FP8Linear in kinds and FusedFP4Experts in kinds


def test_reference_path_keeps_no_quantized_copy(tiny) -> None:
    native, _ = tiny
    model = load_model(native, dtype=torch.float32, progress=False)
    assert model.quantized == {}
    assert {t.dtype for t in _tensors(model).values()} <= {torch.float32, torch.int64}
    kept = load_model(native, dtype=torch.float32, progress=False, keep_quantized=True)
    cfg = kept.cfg
    assert set(kept.quantized) == {n for n in kept.state_dict()
                                   if n.endswith(".weight") and storage_format(n, cfg) in ("fp8", "fp4")}
    assert_same_model(model, kept)


def test_prepare_for_device_refuses_a_model_without_quantized_weights(tiny) -> None:
    model = load_model(tiny[0], dtype=torch.float32, progress=False)
    with pytest.raises(ValueError, match="holds no quantized weights.*keep_quantized=True"):
        prepare_for_device(model, REF)


def test_config_with_fewer_layers_loads_the_first_layers(tiny) -> None:
    """A config truncated below the checkpoint (``hf_overrides``) loads layers 0..N-1 and skips the rest;
    the checkpoint's own config still insists on every tensor being expected."""
    native, _ = tiny
    full = load_model(native, dtype=torch.float32, progress=False)
    cfg = ModelConfig.from_model_dir(native).replace(num_hidden_layers=2, layer_types=full.cfg.layer_types[:2],
                                                     layer_compress_ratios=full.cfg.layer_compress_ratios[:2],
                                                     mlp_layer_types=full.cfg.mlp_layer_types[:2])
    cut = load_model(native, dtype=torch.float32, progress=False, cfg=cfg, ops=REF)
    assert len(cut.layers) == 2 and len(cut.mtp) == 1
    want = load_then_transform(native)
    for name, t in _tensors(cut).items():
        if not name.startswith("layers.") or int(name.split(".")[1]) < 2:
            assert torch.equal(t, _tensors(want)[name]), name
