"""Stacked projections (model/fused.py) on the demo model with the reference op table: each stack computes
exactly its parts side by side, the parts become views of the stack (no second copy), and stacking twice
changes nothing."""

from __future__ import annotations

import torch

from deepinfer.assets import demo_model_dir
from deepinfer.model.attention import Attention
from deepinfer.model.fused import StackedLinear, fuse_projections
from deepinfer.model.loader import load_model
from deepinfer.ops.table import REF


def _weight(module) -> torch.Tensor:
    return module.weight if hasattr(module, "weight") else module.weight_fp8


def _stacks(model) -> list[tuple[StackedLinear, list]]:
    out = []
    for m in model.modules():
        if isinstance(m, Attention):
            ix = getattr(m, "indexer", None)
            out.append((m.x_proj, [m.wq_a, m.wkv]))
            out.append((m.q_proj, [m.wq_b] + ([ix.wq_b] if ix is not None else [])))
            if hasattr(m, "side_proj"):
                parts = [m.compressor.wkv, m.compressor.wgate]
                if ix is not None:
                    parts += [ix.compressor.wkv, ix.compressor.wgate, ix.weights_proj]
                out.append((m.side_proj, parts))
    out += [(layer.ffn.shared_w13, [layer.ffn.shared_experts.w1, layer.ffn.shared_experts.w3])
            for layer in model.layers]
    return out


def test_stacks_equal_their_parts_and_share_storage() -> None:
    model = load_model(demo_model_dir(), dtype=torch.float32, progress=False, ops=REF)
    stacks = _stacks(model)
    assert any(hasattr(m, "side_proj") for m in model.modules() if isinstance(m, Attention))
    x = torch.randn(5, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    for stack, parts in stacks:
        q = torch.randn(5, _weight(parts[0]).shape[1], generator=torch.Generator().manual_seed(2))
        inp = x if q.shape[1] == x.shape[1] else q
        want = torch.cat([p(inp) for p in parts], dim=-1)
        assert torch.allclose(stack(inp), want, rtol=1e-6, atol=1e-6)
        if stack.parts is None and len(parts) > 1:  # one weight: the parts are views into it
            base = _weight(stack.inner).untyped_storage().data_ptr()
            assert all(_weight(p).untyped_storage().data_ptr() == base for p in parts)
        starts = [stack.cols[n] for n in stack.cols]
        assert starts == sorted(starts) and starts[0] == 0
    before = [id(s) for s, _ in stacks]
    fuse_projections(model)  # idempotent: existing stacks are kept
    assert [id(s) for s, _ in _stacks(model)] == before
