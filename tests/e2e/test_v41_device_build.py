"""The engine on V4.1's device build (``model/v41/device.py``: fused FP4 experts, ``FP8Dense32``) on the CPU with
the reference op table, so that the build and the step's host-laid facts (``StepIndex.host``) are checked
without a GPU: greedy tokens equal the plain model built the same way (float32, batched, chunked, preempted).
``tests/gpu/test_v41_device.py`` runs the same on CUDA with the Triton kernels."""

from __future__ import annotations

import random

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
