"""Prefix hits on the GPU path (Triton kernels, CUDA graphs): bitwise equal to cache-off runs where the
computation is the same.

One request at a time with a step budget of one block: a request that hits at boundary P computes positions
>= P in the same chunks (the same kernel shapes) a cache-off prefill uses, and the rows before P were written
by the same chunks of the earlier request, so tokens and logprobs must be equal bit for bit. A mismatch here
is a bug in what a hit restores, never rounding.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

BS = 256


def _engine(caching: bool) -> LLMEngine:
    return LLMEngine.from_engine_args(device="cuda", block_size=BS, max_num_seqs=4, max_num_batched_tokens=BS,
                                      max_model_len=2048, cache_memory_gb=2.0, load_progress=False,
                                      enable_prefix_caching=caching)


def _one(engine: LLMEngine, rid: str, ids: list[int], params: SamplingParams):
    engine.add_request(rid, {"prompt_token_ids": ids}, params)
    out = None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o if o.finished else out
    engine.cache.check_integrity()
    return out


def test_prefix_hits_on_gpu_are_bitwise_equal_to_cache_off() -> None:
    base = [random.Random(0).randrange(10, 1000) for _ in range(1300)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    on, off = _engine(True), _engine(False)
    _one(on, "base", base, params)
    for n in (255, 256, 257, 700, 1300):
        hit = _one(on, f"on{n}", base[:n], params)
        plain = _one(off, f"off{n}", base[:n], params)
        assert hit.num_cached_tokens == (n - 1) // BS * BS
        assert hit.outputs[0].token_ids == plain.outputs[0].token_ids, n
        assert hit.outputs[0].logprobs == plain.outputs[0].logprobs, n
