"""The engine on V4.1's device build (``model/v41/device.py``: fused FP4 experts, ``FP8Dense32``, ``FP8Table``) on
the CPU with the reference op table, so that the build and the step's host-laid facts (``StepIndex.host``) are
checked without a GPU: greedy tokens equal the plain model built the same way (float32, batched, chunked,
preempted). ``tests/gpu/test_v41_device.py`` runs the same on CUDA with the Triton kernels."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.model.v41.device import FP8Dense32
from deepinfer.model.v41.moe import MoE
from deepinfer.testing.staggered import drain
from tests.e2e.test_v41_engine import GREEDY, MAX_TOKENS, _prompts
from tests.e2e.v41_tiny import write_tiny_v41
from tests.gpu.test_v41_device import _engine, _plain


def test_device_build_engine_equals_its_plain_model(tmp_path, monkeypatch, one_thread) -> None:
    path = write_tiny_v41(tmp_path, seed=3)
    plain = _plain(path, "cpu", torch.float32)
    assert isinstance(plain.layers[2].attn.wq_a, FP8Dense32) and isinstance(plain.layers[2].ffn, MoE)
    assert plain.layers[2].ffn.routed is not None and len(plain.layers[2].ffn.experts) == 0
    prompts = _prompts(5)  # 12 prompts of 1..200 tokens, in 4 history blocks of 128 positions
    engine = _engine(path, "cpu", monkeypatch, max_num_batched_tokens=29, num_cache_blocks=4)
    assert isinstance(engine.model.model.layers[2].attn.wq_a, FP8Dense32)
    rng = random.Random(2)
    arrivals: dict[int, list] = {}
    for i in rng.sample(range(len(prompts)), len(prompts)):
        arrivals.setdefault(rng.randrange(4), []).append((f"r{i}", prompts[i]))
    got = drain(engine, arrivals, GREEDY, check_integrity=True)
    assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    for i, ids in enumerate(prompts):
        assert got[f"r{i}"] == plain.greedy(torch.tensor(ids), MAX_TOKENS), f"prompt {i} ({len(ids)} tokens)"


def test_device_build_lays_out_every_expert_in_the_tables_layout(tmp_path) -> None:
    """With the Triton table's FP4 layout (tile-major, placed codes: plain torch, so checkable on the CPU), every
    fused expert module of the build holds that layout of its stored codes: experts are laid out in batches as
    they load, and the last batch must not stay in the checkpoint's layout."""
    import dataclasses

    from deepinfer.config.v41 import V41Config
    from deepinfer.model.v41.device import load_v41_on_device
    from deepinfer.ops import fp4_layout
    from deepinfer.ops.table import REF
    from deepinfer.model.v41.loader import load_tokenizer

    path = write_tiny_v41(tmp_path, seed=3)
    cfg, tok = V41Config.from_model_dir(path), load_tokenizer(path)
    tiled_ops = dataclasses.replace(REF, name="ref-tiled", fp4_expert_layout=fp4_layout.expert_layout)
    stored = load_v41_on_device(path, cfg, torch.float32, "cpu", REF, tokenizer=tok)
    tiled = load_v41_on_device(path, cfg, torch.float32, "cpu", tiled_ops, tokenizer=tok)
    checked = 0
    for a, b in zip(stored.layers, tiled.layers):
        if not isinstance(a.ffn, MoE) or a.ffn.routed is None:
            continue
        for codes, scales in (("w13", "s13"), ("w2", "s2")):
            want = fp4_layout.expert_layout(*a.ffn.routed._stored(codes))
            for name, t in zip((codes, scales), want):
                got = getattr(b.ffn.routed, name)
                assert torch.equal(got, t.reshape(got.shape)), f"{name} not in the table's layout"
        checked += 1
    assert checked


def test_device_build_runs_the_mhc_coefficients_in_its_table(tmp_path) -> None:
    """Every block (and DSpark stage) of a device build computes its mHC coefficients with the build's op table
    (one kernel on CUDA), and the plain model keeps the reference."""
    import dataclasses

    from deepinfer.config.v41 import V41Config
    from deepinfer.model.v41.device import load_v41_on_device
    from deepinfer.model.v41.dspark import DSparkStage
    from deepinfer.model.v41.loader import load_tokenizer, load_v41_model
    from deepinfer.model.v41.model import Block
    from deepinfer.ops.table import REF

    calls = []

    def counted(*args):
        calls.append(args[0].shape[0])
        return REF.v41_mix_finish(*args)

    path = write_tiny_v41(tmp_path, seed=3, dspark=True)
    cfg, tok = V41Config.from_model_dir(path), load_tokenizer(path)
    ops = dataclasses.replace(REF, name="ref-counted", v41_mix_finish=counted)
    built = load_v41_on_device(path, cfg, torch.float32, "cpu", ops, tokenizer=tok, dspark=True)
    sites = [m for m in built.modules() if isinstance(m, (Block, DSparkStage))]
    assert sites and all(m.ops is ops for m in sites)
    plain, _ = load_v41_model(path, torch.float32, cache_qdq=False, dspark=True)
    assert all(m.ops is REF for m in plain.modules() if isinstance(m, (Block, DSparkStage)))
    built.forward(torch.tensor([5, 6, 7]))
    assert len(calls) == 2 * cfg.num_hidden_layers  # two sites per layer, 3 tokens each
    assert set(calls) == {3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_device_build_holds_the_engram_tables_as_codes(tmp_path, dtype) -> None:
    """The FP8 Engram tables of a device build are their stored codes and scale bytes (``FP8Table``), hashed and
    gathered through the build's op table; with the same projection each Engram layer gives the plain model's
    output bit for bit (the gathered rows are its dequantized table rows), from a checkpoint and from dummy
    weights (drawn on the CPU here, so the same values as the plain dummy model's)."""
    import dataclasses

    from deepinfer.config.v41 import V41Config
    from deepinfer.model.v41.device import dummy_v41_on_device, load_v41_on_device
    from deepinfer.model.v41.dummy import load_dummy_v41
    from deepinfer.model.v41.engram_table import FP8Table
    from deepinfer.model.v41.loader import load_tokenizer, load_v41_model
    from deepinfer.ops.table import REF

    calls = {"hash": 0, "gather": 0}

    def counted(key, fn):
        def run(*args):
            calls[key] += 1
            return fn(*args)
        return run

    path = write_tiny_v41(tmp_path, seed=3)
    cfg, tok = V41Config.from_model_dir(path), load_tokenizer(path)
    assert cfg.active_engram_layers
    ops = dataclasses.replace(REF, name="ref-counted", v41_engram_hash=counted("hash", REF.v41_engram_hash),
                              v41_engram_gather=counted("gather", REF.v41_engram_gather))
    pairs = [(load_v41_on_device(path, cfg, dtype, "cpu", ops, tokenizer=tok), load_v41_model(path, dtype)[0]),
             (dummy_v41_on_device(cfg, dtype, "cpu", ops, tokenizer=tok, seed=5),
              load_dummy_v41(cfg, dtype, tokenizer=tok, seed=5))]
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, tok.get_vocab_size(), (40,), generator=g)
    for built, plain in pairs:
        assert not any(n.endswith("engram.embed.weight") for n in built.state_dict())
        rows = plain.hasher(ids, 0)
        assert torch.equal(built.hasher(ids, 0), rows) and calls["hash"] == 1
        calls["hash"] = 0
        for layer in cfg.active_engram_layers:
            mine, theirs = built.layers[layer].engram, plain.layers[layer].engram
            assert isinstance(mine.embed, FP8Table) and mine.embed.weight_fp8.dtype == torch.float8_e4m3fn
            every = torch.arange(mine.rows).unsqueeze(-1)
            assert torch.equal(mine.embed.gather(every, dtype), theirs.embed.weight)
            mine.wkv = theirs.wkv  # the same projection: only how the table is held differs
            streams = torch.randn(len(ids), cfg.hc_mult, cfg.hidden_size, generator=g).to(dtype)
            r = rows[:, mine.table_index]
            before = calls["gather"]
            assert torch.equal(mine(streams, r), theirs(streams, r))
            assert calls["gather"] == before + 1


def test_float16_device_build_keeps_the_dequantized_engram_tables(tmp_path) -> None:
    """No gather kernel takes float16 activations' tables: they stay the plain loader's (as the dense FP8 do)."""
    from deepinfer.config.v41 import V41Config
    from deepinfer.model.v41.device import fp8_table_names
    from deepinfer.model.v41.model import DeepseekV41

    cfg = V41Config.from_model_dir(write_tiny_v41(tmp_path, seed=3))
    with torch.device("meta"):
        model = DeepseekV41(cfg, torch.float16, shapes_only=True)
    assert fp8_table_names(model, torch.float16) == []
    assert fp8_table_names(model, torch.bfloat16) == [f"layers.{i}.engram.embed" for i in cfg.active_engram_layers]
