"""Cache sizing of a DeepSeek-V4.1 engine from ``gpu_memory_utilization`` (``engine/sizing.py``,
``engine/profile_v41.py``), on the CPU: the profiled step is the largest one the scheduler could plan (the most
sequences, each at ``max_model_len``, carrying the step budget), it runs through the device build reading every
sequence at full length, and the cache gets what the utilization leaves after what is resident and the peak.
``tests/gpu/test_v41_device.py`` starts a CUDA engine sized that way."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepinfer.config.engine import EngineArgs, EngineConfig
from deepinfer.engine import sizing
from deepinfer.engine.profile_v41 import largest_v41_step
from deepinfer.kv.spec import POOLS
from deepinfer.kv.storage import KVStorage
from deepinfer.model.v41 import paged
from deepinfer.ops.table import REF
from tests.e2e.v41_tiny import write_tiny_v41

GIB = 1 << 30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_v41(tmp_path_factory.mktemp("v41_sizing"), seed=4, dspark=True)


def _config(path, **kw) -> EngineConfig:
    args = dict(model=str(path), device="cpu", dtype="float32", kv_cache_dtype="float32", block_size=128,
                max_num_seqs=8, max_num_batched_tokens=48, max_model_len=512, enforce_eager=True,
                load_progress=False)
    return EngineConfig.create(EngineArgs(**{**args, **kw}))


def _step(config: EngineConfig):
    storage = KVStorage(sizing.cache_layout(config), {p: 1 for p in POOLS}, config.dtype, "cpu")
    return largest_v41_step(config, storage)


@pytest.mark.parametrize("kw,lens,draws", [
    ({}, (41,) + (1,) * 7, 8),  # a prefill chunk at the end of the longest prompt, seven decodes
    ({"speculative_config": {"method": "dspark", "num_speculative_tokens": 3}}, (41,) + (1,) * 7, 32),
    ({"max_num_seqs": 64, "max_num_batched_tokens": 16}, (1,) * 16, 16),  # the budget bounds the sequences
    ({"max_num_seqs": 1, "max_num_batched_tokens": 2048}, (512,), 1),  # a chunk is at most max_model_len
], ids=["prefill+decodes", "dspark", "budget-bound", "length-bound"])
def test_largest_step_is_the_most_sequences_at_the_longest_length(tiny, kw, lens, draws) -> None:
    step = _step(_config(tiny, **kw))
    host = step.index.host
    assert host.lens == lens and host.ends == (512,) * len(lens) and step.draw_rows == draws
    assert step.input_ids.numel() == sum(lens) == step.index.positions.numel()
    want = [p for n in lens for p in range(512 - n, 512)]
    assert step.index.positions.tolist() == want
    assert step.index.token_seq.tolist() == [s for s, n in enumerate(lens) for _ in range(n)]
    assert step.index.seq_end.tolist() == [512] * len(lens)
    assert bool((step.index.window_table == 0).all() and (step.index.history_table == 0).all())


def test_largest_batch_invariant_step_is_one_token(tiny, monkeypatch) -> None:
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    step = _step(_config(tiny))
    assert step.index.host.lens == (1,) and step.index.positions.tolist() == [511] and step.draw_rows == 1


def test_profile_runs_the_largest_step_through_the_device_build(tiny, monkeypatch) -> None:
    """The profile's forward (what CUDA measures) on the device build: every KV source gathers the entries of
    every sequence up to max_model_len."""
    config = _config(tiny, speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    model = paged.load_paged_v41(tiny, config.model, config.dtype, False, dspark=True, device="cpu", ops=REF)
    seen = []
    entries = paged.PagedV41._entries

    def recorded(key, ratio, step, ops):
        out = entries(key, ratio, step, ops)
        seen.append((ratio, out[2]))
        return out

    monkeypatch.setattr(paged.PagedV41, "_entries", staticmethod(recorded))
    logits = []
    monkeypatch.setattr(paged.PagedV41, "logits", lambda self, h: logits.append(h.shape[0]))
    monkeypatch.setattr(sizing, "peak_bytes", lambda run: (run(), 123)[1])  # CUDA's reading, here the run only
    assert sizing.profile_activation_bytes(model, config, sizing.cache_layout(config)) == 123
    sources = [i for i in range(config.model.num_hidden_layers) if config.model.role(i).kv_source]
    assert len(seen) == len(sources) and all(counts == [512 // ratio] * 8 for ratio, counts in seen)
    assert logits == [32]


def test_cuda_budget_is_what_the_utilization_leaves(tiny, monkeypatch) -> None:
    """No num_cache_blocks / cache_memory_gb on CUDA: the pools fill 0.9 x total less what is resident and the
    profiled peak, and no more."""
    config = dataclasses.replace(_config(tiny), device="cuda")
    layout = sizing.cache_layout(config)
    model = object()
    monkeypatch.setattr(sizing, "profile_activation_bytes", lambda m, c, l: 3 * GIB if m is model else 1 / 0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (60 * GIB, 80 * GIB))
    budget = int(80 * GIB * 0.9) - 20 * GIB - 3 * GIB
    blocks = sizing.pool_blocks(config, layout, model)
    used = sum(blocks[p] * layout.bytes_per_block(p, 4) for p in POOLS)
    assert blocks["history"] > 0 and budget * 0.95 < used <= budget
    monkeypatch.setattr(sizing, "profile_activation_bytes", lambda m, c, l: 53 * GIB)
    with pytest.raises(ValueError, match="^gpu_memory_utilization: 0.9 leaves no memory for the cache"):
        sizing.pool_blocks(config, layout, model)
