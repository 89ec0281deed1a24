"""The sharding hook of the loader: a rank's modules declare what they own (``param_shards``, ``owned_experts``)
and the loader reads only that from disk (``get_slice``), into the same bytes the full model holds there."""

from __future__ import annotations

import copy

import pytest
import torch

from deepinfer.model import ckpt_files
from deepinfer.model.device import FP8Linear, FusedFP4Experts
from deepinfer.model.linear import Embedding, Linear
from deepinfer.model.loader import load_model
from deepinfer.model.shard import Shard, plain_index, quantized_index
from deepinfer.ops.table import REF
from deepinfer.testing.make_checkpoint import PRESETS, write_dummy_checkpoint

# flash-like shapes (128-row multiples everywhere), two layers: CSA + SWA, 16 experts.
CONFIG = {**copy.deepcopy(PRESETS["flash-like"]), "num_hidden_layers": 2, "compress_ratios": [4, 0, 0]}
EXPERTS = 16


def _split_linear(linear: Linear, shard: Shard) -> Linear:
    out, inp = linear.out_features, linear.in_features
    out, inp = (out // shard.count, inp) if shard.dim == 0 else (out, inp // shard.count)
    new = Linear(inp, out, dtype=linear.weight.dtype)
    new.param_shards = {"weight": shard}
    return new


def sharder(rank: int, count: int = 2):
    """Rank ``rank`` of a ``count``-way split: column-parallel wq_b (heads), row-parallel wo_b, a vocab-split
    embedding and LM head, split attention sinks, and expert parallelism."""

    def shard(model) -> None:
        rows, cols = Shard(0, rank, count), Shard(1, rank, count)
        for layer in model.layers:
            attn = layer.attn
            attn.wq_b, attn.wo_b = _split_linear(attn.wq_b, rows), _split_linear(attn.wo_b, cols)
            attn.attn_sink = torch.nn.Parameter(torch.empty(attn.attn_sink.shape[0] // count, device="meta"))
            attn.param_shards = {"attn_sink": rows}
            per = EXPERTS // count
            layer.ffn.owned_experts = range(rank * per, (rank + 1) * per)
        model.head = _split_linear(model.head, rows)
        embed = Embedding(model.embed.weight.shape[0] // count, model.embed.weight.shape[1], model.embed.weight.dtype)
        embed.param_shards = {"weight": rows}
        model.embed = embed

    return shard


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("flash2")
    write_dummy_checkpoint(path, CONFIG, seed=2, shard_max_bytes=6_000_000)
    return path


@pytest.fixture(scope="module")
def full(ckpt):
    return load_model(ckpt, dtype=torch.bfloat16, progress=False, ops=REF)


def _rows(t: torch.Tensor, shard: Shard) -> torch.Tensor:
    n = t.shape[shard.dim] // shard.count
    return t.narrow(shard.dim, shard.index * n, n)


def assert_rank_holds_its_slices(model, full, rank: int) -> None:
    rows, cols = Shard(0, rank, 2), Shard(1, rank, 2)
    for got, want in zip(model.layers, full.layers):
        a, b = got.attn, want.attn
        assert isinstance(a.wq_b, FP8Linear) and isinstance(a.wo_b, FP8Linear)
        assert torch.equal(a.wq_b.weight_fp8.view(torch.uint8), _rows(b.wq_b.weight_fp8, rows).view(torch.uint8))
        assert torch.equal(a.wq_b.weight_scale, _rows(b.wq_b.weight_scale, rows))
        assert torch.equal(a.wo_b.weight_fp8.view(torch.uint8), _rows(b.wo_b.weight_fp8, cols).view(torch.uint8))
        assert torch.equal(a.wo_b.weight_scale, _rows(b.wo_b.weight_scale, cols))
        assert torch.equal(a.attn_sink, _rows(b.attn_sink, rows))
        e, f = got.ffn.routed, want.ffn.routed
        assert isinstance(e, FusedFP4Experts) and e.owned == range(8 * rank, 8 * rank + 8)
        for name in ("w13", "s13", "w2", "s2"):
            assert torch.equal(getattr(e, name), getattr(f, name)[e.owned.start : e.owned.stop]), name
        assert torch.equal(got.attn.wq_a.weight_fp8.view(torch.uint8), b.wq_a.weight_fp8.view(torch.uint8))
    assert torch.equal(model.head.weight, _rows(full.head.weight, rows))
    assert torch.equal(model.embed.weight, _rows(full.embed.weight, rows))


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_reads_only_its_slices(ckpt, full, rank, monkeypatch) -> None:
    reads: list[tuple[str, tuple]] = []
    read = ckpt_files.Files.read

    def spy(self, ref, sub=()):
        reads.append((ref.disk_name, ref.index(sub)))
        return read(self, ref, sub)

    monkeypatch.setattr(ckpt_files.Files, "read", spy)
    model = load_model(ckpt, dtype=torch.bfloat16, progress=False, ops=REF, shard_model=sharder(rank))
    assert_rank_holds_its_slices(model, full, rank)
    index = dict(reads)
    assert index["layers.0.attn.wq_b.weight"] == (slice(2048 * rank, 2048 * (rank + 1)),)
    assert index["layers.0.attn.wq_b.scale"] == (slice(16 * rank, 16 * (rank + 1)),)
    assert index["layers.1.attn.wo_b.weight"] == (slice(None), slice(512 * rank, 512 * (rank + 1)))
    assert index["layers.1.attn.wo_b.scale"] == (slice(None), slice(4 * rank, 4 * (rank + 1)))
    assert index["layers.0.attn.wq_a.weight"] == ()  # unsharded: whole
    experts = {int(n.split(".")[4]) for n, _ in reads if ".ffn.experts." in n and n.startswith("layers.")}
    assert experts == set(range(8 * rank, 8 * rank + 8))  # the other rank's experts are never read


def test_reference_path_dequantizes_only_the_slice(ckpt) -> None:
    whole = load_model(ckpt, dtype=torch.float32, progress=False)
    part = load_model(ckpt, dtype=torch.float32, progress=False, shard_model=sharder(1))
    rows, cols = Shard(0, 1, 2), Shard(1, 1, 2)
    for got, want in zip(part.layers, whole.layers):
        assert torch.equal(got.attn.wq_b.weight, _rows(want.attn.wq_b.weight, rows))
        assert torch.equal(got.attn.wo_b.weight, _rows(want.attn.wo_b.weight, cols))
        assert got.attn.q_proj._refs[0] is got.attn.wq_b  # the side-by-side stack runs the shard


def test_dummy_weights_are_the_same_whatever_the_sharding() -> None:
    from deepinfer.config import ModelConfig

    cfg = ModelConfig.from_dict(CONFIG)
    whole = load_model(None, dtype=torch.bfloat16, cfg=cfg, load_format="dummy", seed=5, ops=REF, progress=False)
    for rank in (0, 1):
        part = load_model(None, dtype=torch.bfloat16, cfg=cfg, load_format="dummy", seed=5, ops=REF, progress=False,
                          shard_model=sharder(rank))
        assert_rank_holds_its_slices(part, whole, rank)


def test_shard_indexes_and_errors() -> None:
    assert plain_index((10, 6), None, "x") == ()
    assert plain_index((10, 6), Shard(1, 2, 3), "x") == (slice(None), slice(4, 6))
    assert quantized_index("fp4", (256, 512), (1, 32), Shard(1, 1, 2), "e") == (
        (slice(None), slice(128, 256)), (slice(None), slice(8, 16)))
    assert quantized_index("fp4", (256, 512), (1, 32), Shard(0, 1, 4), "e") == ((slice(64, 128),), (slice(64, 128),))
    assert quantized_index("fp8", (4096, 512), (128, 128), Shard(0, 3, 4), "w") == (
        (slice(3072, 4096),), (slice(24, 32),))
    with pytest.raises(ValueError, match="w: dimension 0 of size 4096 does not split into 3 equal shards"):
        quantized_index("fp8", (4096, 512), (128, 128), Shard(0, 1, 3), "w")
    with pytest.raises(ValueError, match="w: shard .* splits dimension 0 at 64..128, not on its 128-wide scale blocks"):
        quantized_index("fp8", (4096, 512), (128, 128), Shard(0, 1, 64), "w")
    with pytest.raises(ValueError, match="Shard: need"):
        Shard(0, 2, 2)
