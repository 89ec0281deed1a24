"""Reference ops: documented tie rules, RoPE tables against HF's YaRN, sink attention against a dense formula."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer.config.model import RopeConfig
from deepinfer.ops.ref.attention import sparse_attention
from deepinfer.ops.ref.indexer import topk_with_tiebreak
from deepinfer.ops.ref.moe import route
from deepinfer.ops.ref.rope import apply_rope, cos_sin, inv_freq


def test_indexer_ties_prefer_lower_index_and_ignore_invisible_entries() -> None:
    scores = torch.tensor([[0.0, 1.0, 0.0, 0.0, 5.0, 0.0]])
    picks = topk_with_tiebreak(scores, torch.tensor([4]), 3)  # entries 4 and 5 are not visible yet
    assert picks.tolist() == [[1, 0, 2]]
    # The same query with more (invisible) entries appended selects the same set.
    longer = torch.cat([scores, torch.full((1, 10), 9.0)], dim=1)
    assert topk_with_tiebreak(longer, torch.tensor([4]), 3).tolist() == [[1, 0, 2]]


def test_indexer_pads_with_minus_one_when_few_entries_are_visible() -> None:
    picks = topk_with_tiebreak(torch.zeros(2, 5), torch.tensor([1, 3]), 4)
    assert picks.tolist() == [[0, -1, -1, -1], [0, 1, 2, -1]]


def test_router_bias_selects_but_does_not_weight() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0])
    w, idx = route(logits, "sigmoid", 2, True, 2.0, bias=bias)
    assert sorted(idx[0].tolist()) == [0, 3]
    s = torch.sigmoid(logits[0])
    expect = torch.stack([s[idx[0, 0]], s[idx[0, 1]]]) / (s[0] + s[3]) * 2.0
    assert torch.allclose(w[0], expect)


def test_router_without_normalisation_and_softmax_scoring() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    w, idx = route(logits, "softmax", 2, False, 1.5)
    p = torch.softmax(logits[0], -1)
    assert idx[0].tolist() == [2, 1]
    assert torch.allclose(w[0], torch.stack([p[2], p[1]]) * 1.5)


def test_router_equal_scores_pick_lower_expert() -> None:
    w, idx = route(torch.zeros(1, 6), "sqrtsoftplus", 3, True, 1.0)
    assert idx[0].tolist() == [0, 1, 2]


def test_yarn_table_matches_transformers() -> None:
    pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config(head_dim=512, qk_rope_head_dim=64, rope_scaling={
        "type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 65536})
    hf, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, None, layer_type="compress")
    ours = inv_freq(RopeConfig(160000.0, 64, 16.0, 32.0, 1.0, 65536))
    assert factor == 1.0
    assert torch.equal(ours, hf)


def test_rope_pairs_are_interleaved_on_trailing_dims_and_invert() -> None:
    rope = RopeConfig(theta=10000.0, rope_dim=4)
    x = torch.arange(12, dtype=torch.float32).view(1, 12)
    cos, sin = cos_sin(torch.tensor([3]), inv_freq(rope), 1.0, torch.float32)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[:, :8], x[:, :8])  # leading "nope" channels untouched
    a = 3.0  # first pair (8, 9) rotates by 3 * theta^0
    assert torch.allclose(y[0, 8:10], torch.tensor([8 * math.cos(a) - 9 * math.sin(a), 8 * math.sin(a) + 9 * math.cos(a)]))
    assert torch.allclose(apply_rope(y, cos, sin, inverse=True), x, atol=1e-5)


def test_sparse_attention_matches_dense_softmax_with_sink() -> None:
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 2, 8, generator=g), torch.randn(5, 8, generator=g)
    visible = torch.tensor([[1, 1, 0, 0, 1], [1, 1, 1, 0, 0], [0, 0, 0, 1, 1]], dtype=torch.bool)
    sinks = torch.tensor([0.3, -1.0])
    out = sparse_attention(q, k, visible, sinks, 0.5)
    for t in range(3):
        for h in range(2):
            keys = k[visible[t]]
            logits = keys @ q[t, h] * 0.5
            p = torch.softmax(torch.cat([logits, sinks[h : h + 1]]), 0)[:-1]
            assert torch.allclose(out[t, h], p @ keys, atol=1e-6)
