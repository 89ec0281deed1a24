"""The device transformation (FP8Linear, stacked FP4 experts, op-table dispatch) with the reference op table
on the CPU computes the same function as the dequantized reference model."""

from __future__ import annotations

import torch

from deepinfer.assets import demo_model_dir
from deepinfer.kv.spec import build_layout
from deepinfer.model.device import FP8Linear, FusedFP4Experts
from deepinfer.model.loader import load_model
from deepinfer.ops.table import REF
from deepinfer.runner.sequences import SequenceCache


def _logits(model, ids: list[int]) -> torch.Tensor:
    cache = SequenceCache(build_layout(model.cfg, 128), 4, torch.float32)
    sid, out = cache.new_sequence(), []
    for chunk in (ids[:70], ids[70:140], ids[140:]):
        t, batch = cache.plan({sid: chunk})
        out.append(model.logits(model(t, batch, cache.storage)))
        cache.commit({sid: chunk})
    return torch.cat(out)


def test_transformed_model_matches_reference_on_cpu() -> None:
    ids = torch.randint(3, 4096, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = _logits(load_model(demo_model_dir(), dtype=torch.float32, progress=False), ids)
    model = load_model(demo_model_dir(), dtype=torch.float32, progress=False, ops=REF)  # quantized-first
    kinds = {type(m) for m in model.modules()}
    assert FP8Linear in kinds and FusedFP4Experts in kinds
    assert all(len(layer.ffn.experts) == 0 for layer in model.layers)  # dequantized copies released
    got = _logits(model, ids)
    assert (got - ref).abs().max().item() <= 1e-4
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
