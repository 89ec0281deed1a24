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


def test_host_tier_on_gpu_saves_the_device_rows_and_hits_equal_cache_off(monkeypatch) -> None:
    """A device cache of a few blocks under a host tier: a second prompt evicts the first one's blocks, whose
    saves run asynchronously (gather on the compute stream, copy on the copy stream, objects stored by the
    write-back thread); the first prompt again is then a tier hit. Bounded replay is switched off, so the
    tier also keeps state blocks and a hit restores its boundary exactly: the same chunks as a cache-off
    prefill, hence the same bits. Every saved object must equal the rows the device held at eviction."""
    from deepinfer.kv import block_budget, manager
    from deepinfer.kv.offload import CopyStream
    from deepinfer.kv.tiers import pack

    for module in (block_budget, manager):
        monkeypatch.setattr(module, "replay_length", lambda layout: 0)
    kw = dict(device="cuda", block_size=BS, max_num_seqs=1, max_num_batched_tokens=BS, max_model_len=1024,
              load_progress=False)
    on = LLMEngine.from_engine_args(**kw, num_cache_blocks=4, kv_host_cache_gb=1.0)
    off = LLMEngine.from_engine_args(**kw, enable_prefix_caching=False)
    assert isinstance(on.tiers._copier, CopyStream) and on.tiers.pools == ("history", "window", "state")
    rows = {}
    save = on.tiers.save

    def save_and_record(blocks):  # the device rows of every block handed to the tier, before the step runs
        for pool, block, h in blocks:
            rows[(pool, h)] = pack(on.storage, pool, block)
        save(blocks)

    on.tiers.save = save_and_record
    rng = random.Random(3)
    a, b = [rng.randrange(10, 1000) for _ in range(700)], [rng.randrange(10, 1000) for _ in range(700)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    first = _one(on, "a", a, params)
    _one(on, "b", b, params)  # evicts a's blocks: down to host memory
    again = _one(on, "a2", a, params)
    plain = _one(off, "a", a, params)
    assert again.num_cached_tokens == (len(a) - 1) // BS * BS and on.scheduler.prefix_tier_hits > 0
    for out in (first, again):
        assert out.outputs[0].token_ids == plain.outputs[0].token_ids
        assert out.outputs[0].logprobs == plain.outputs[0].logprobs
    on.tiers.flush()
    assert rows and on.tiers.saved > 0 and on.tiers.loaded > 0 and on.tiers.save_copy_seconds > 0
    for (pool, h), want in rows.items():
        got = on.tiers.fetch(pool, h)
        assert got is not None and bytes(got) == want, pool
    on.close()
