"""A rank's sharded, quantized-first load (the engine's: ``load_model(..., shard_model=sharding_hook(pctx))``)
holds exactly what loading the whole model and cutting it (``shard_model``, then ``prepare_for_device``)
holds, bit for bit in every buffer, and reads only the rank's part of the checkpoint.

The load runs no collective, so each rank's load runs here in one process with that rank's
``ParallelContext`` (the multi-process worlds of ``test_parallel_model.py`` and the engine tests run the
same load and check the logits)."""

from __future__ import annotations

import copy
import dataclasses
import re
from collections import Counter

import pytest
import torch

from deepinfer.assets import demo_model_dir
from deepinfer.config import ModelConfig
from deepinfer.distributed.config import ParallelConfig
from deepinfer.distributed.world import ParallelContext
from deepinfer.model import ckpt_files
from deepinfer.model.device import FusedFP4Experts, prepare_for_device
from deepinfer.model.loader import load_model
from deepinfer.model.parallel.moe import EPMoE
from deepinfer.model.parallel.shard import shard_model, sharding_hook
from deepinfer.ops import fp4_layout
from deepinfer.ops.table import REF
from deepinfer.testing.make_checkpoint import PRESETS, write_dummy_checkpoint, write_random_checkpoint

TP2 = ParallelConfig(tensor_parallel_size=2)
DP2_EP = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)
TP2_EP = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True)
CONFIGS = {"tp2": TP2, "dp2-ep": DP2_EP, "tp2-ep": TP2_EP}
# flash-like shapes (every slice on its scale blocks), two layers + MTP, 16 experts.
FLASH2 = {**copy.deepcopy(PRESETS["flash-like"]), "num_hidden_layers": 2, "compress_ratios": [4, 0, 0]}
_EXPERT = re.compile(r"^(layers|mtp)\.(\d+)\.ffn\.experts\.(\d+)\.")
# REF with the Triton table's FP4 expert layout (tile-major, placed codes; plain torch): the CPU twin of
# tests/gpu/test_parallel_loading_gpu.py's layouts.
TILED = dataclasses.replace(REF, name="ref-tiled", fp4_expert_layout=fp4_layout.expert_layout)


def _pctx(config: ParallelConfig, rank: int) -> ParallelContext:
    return ParallelContext(config, rank, torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny")
    write_random_checkpoint(out, PRESETS["tiny"], seed=3)
    return str(out)


@pytest.fixture(scope="module")
def whole(tiny_dir):
    """model name -> (directory, dtype, the model loaded whole with its stored forms kept): loaded once,
    copied per rank before cutting."""
    demo = str(demo_model_dir())
    return {"demo": (demo, torch.bfloat16, load_model(demo, dtype=torch.bfloat16, progress=False, keep_quantized=True)),
            "tiny": (tiny_dir, torch.float32, load_model(tiny_dir, dtype=torch.float32, progress=False,
                                                         keep_quantized=True))}


def _tensors(model) -> dict[str, torch.Tensor]:
    return {n: t for n, t in [*model.named_parameters(), *model.named_buffers()] if not n.startswith("ropes.")}


# The state a forward reads besides the tensors (``owned`` / ``shards`` of fused experts are the loader's).
_ATTRS = ("n_heads", "groups", "first_expert", "num_local", "pow2_scales", "raw_scales", "limit", "cols")


def assert_same_model(got, want) -> None:
    """Same module tree (types, the sharded counts), same tensors (names, dtypes, shapes, bytes)."""
    kinds = [(n, type(m).__name__) for n, m in got.named_modules()]
    assert kinds == [(n, type(m).__name__) for n, m in want.named_modules()]
    for (name, a), b in zip(got.named_modules(), want.modules()):
        for attr in _ATTRS:
            if attr in a.__dict__ or attr in b.__dict__:
                assert getattr(a, attr, None) == getattr(b, attr, None), f"{name}.{attr}"
    mine, ref = _tensors(got), _tensors(want)
    assert mine.keys() == ref.keys()
    for name, t in mine.items():
        r = ref[name]
        assert (t.dtype, t.shape) == (r.dtype, r.shape), name
        assert torch.equal(t.contiguous().view(torch.uint8), r.contiguous().view(torch.uint8)), name


def _cut(whole_model, pctx: ParallelContext, ops):
    model = shard_model(copy.deepcopy(whole_model), pctx)
    return prepare_for_device(model, ops) if ops is not None else model


@pytest.mark.parametrize("ops", [REF, TILED, None], ids=["device-path", "device-path-triton-layout", "reference-path"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("which", ["demo", "tiny"])
def test_sharded_load_equals_load_whole_then_cut(whole, which, config, ops) -> None:
    model_dir, dtype, full = whole[which]
    for rank in range(config.world_size):
        pctx = _pctx(config, rank)
        got = load_model(model_dir, dtype=dtype, progress=False, ops=ops, shard_model=sharding_hook(pctx))
        assert got.parallel is pctx
        assert_same_model(got, _cut(full, pctx, ops))


def test_expert_parallel_fused_experts_hold_only_their_own() -> None:
    """Under EP on the device path each rank's fused FP4 experts hold its range only (dispatched by local id)."""
    pctx = _pctx(DP2_EP, 1)
    model = load_model(demo_model_dir(), dtype=torch.bfloat16, progress=False, ops=REF,
                       shard_model=sharding_hook(pctx))
    for layer in [*model.layers, *model.mtp]:
        assert isinstance(layer.ffn, EPMoE) and (layer.ffn.first_expert, layer.ffn.num_local) == (4, 4)
        assert isinstance(layer.ffn.routed, FusedFP4Experts) and layer.ffn.routed.owned == range(4, 8)
        assert layer.ffn.routed.w13.shape[0] == 4


def test_dummy_weights_shard_as_a_checkpoint_does() -> None:
    """load_format="dummy" goes through the same loaders: a rank's dummy model is the whole dummy model cut."""
    cfg = ModelConfig.from_model_dir(demo_model_dir())
    full = load_model(None, dtype=torch.bfloat16, cfg=cfg, load_format="dummy", seed=4, progress=False,
                      keep_quantized=True)
    for rank in range(2):
        pctx = _pctx(TP2_EP, rank)
        got = load_model(None, dtype=torch.bfloat16, cfg=cfg, load_format="dummy", seed=4, progress=False, ops=REF,
                         shard_model=sharding_hook(pctx))
        assert_same_model(got, _cut(full, pctx, REF))


@pytest.fixture(scope="module")
def flash_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("flash2")
    write_dummy_checkpoint(out, FLASH2, seed=2, shard_max_bytes=6_000_000)
    return str(out)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_sharded_load_in_the_triton_layout_equals_load_whole_then_cut(flash_dir, config) -> None:
    """flash-like shapes (w13 and w2 tile-major, TP slices on their scale groups, expert ranges): the CPU twin
    of the GPU test, the experts laid out in batches as they arrive against the whole stack at once."""
    full = load_model(flash_dir, dtype=torch.bfloat16, progress=False, keep_quantized=True)
    for rank in range(config.world_size):
        pctx = _pctx(config, rank)
        got = load_model(flash_dir, dtype=torch.bfloat16, progress=False, ops=TILED, shard_model=sharding_hook(pctx))
        assert_same_model(got, _cut(full, pctx, TILED))


def _bytes_read(model_dir: str, monkeypatch, shard=None) -> dict[str, int]:
    """On-disk tensor name -> bytes this load read of it (each tensor read at most once)."""
    reads: list[tuple[str, int]] = []
    read = ckpt_files.Files.read

    def counting(self, ref, sub=()):
        t = read(self, ref, sub)
        reads.append((ref.disk_name, t.numel() * t.element_size()))
        return t

    monkeypatch.setattr(ckpt_files.Files, "read", counting)
    load_model(model_dir, dtype=torch.bfloat16, progress=False, ops=REF, shard_model=shard)
    monkeypatch.undo()
    assert max(Counter(n for n, _ in reads).values()) == 1, "a tensor was read twice"
    return dict(reads)


def _expert(name: str) -> int | None:
    m = _EXPERT.match(name)
    return int(m.group(3)) if m else None


def test_expert_parallel_ranks_read_only_their_experts(flash_dir, monkeypatch) -> None:
    """DP2+EP: each rank reads half of the expert bytes, only its own experts' tensors, and every other
    tensor whole (replicated)."""
    whole = _bytes_read(flash_dir, monkeypatch)
    expert_bytes = sum(b for n, b in whole.items() if _expert(n) is not None)
    assert expert_bytes > 0.25 * sum(whole.values())  # 2 layers + MTP of 16 experts beside the vocabulary
    for rank in range(2):
        got = _bytes_read(flash_dir, monkeypatch, sharding_hook(_pctx(DP2_EP, rank)))
        experts = {_expert(n) for n in got} - {None}
        assert experts == set(range(8 * rank, 8 * rank + 8))  # never another rank's experts
        assert sum(b for n, b in got.items() if _expert(n) is not None) == expert_bytes // 2
        assert {n: b for n, b in got.items() if _expert(n) is None} == {
            n: b for n, b in whole.items() if _expert(n) is None}


def test_tensor_parallel_ranks_read_only_their_slices(flash_dir, monkeypatch) -> None:
    """TP2: the split tensors (query heads, output projections, sinks, every expert's intermediate slice and
    their scales) are read by half on each rank, the rest whole; together the ranks read each split
    tensor's bytes exactly once."""
    whole = _bytes_read(flash_dir, monkeypatch)
    split = re.compile(r"\.attn\.(wq_b|wo_a|wo_b)\.(weight|scale)$|\.attn_sink$"
                       r"|\.(experts\.\d+|shared_experts)\.w[123]\.")
    ranks = [_bytes_read(flash_dir, monkeypatch, sharding_hook(_pctx(TP2, r))) for r in range(2)]
    for got in ranks:
        assert got.keys() == whole.keys()
        for name, b in got.items():
            assert b == (whole[name] // 2 if split.search(name) else whole[name]), name
    halved = sum(b for n, b in whole.items() if split.search(n))
    assert halved > 0.25 * sum(whole.values())
    assert sum(ranks[0].values()) + sum(ranks[1].values()) == 2 * sum(whole.values()) - halved
