"""``DEEPINFER_BATCH_INVARIANT=1`` for DeepSeek-V4.1 on CUDA: the device build (``model/v41/device.py``) with the
batch-invariant Triton table, every token of a step run alone (``model/v41/invariant.py``): a request's tokens
and logprobs are the same bits alone and in any batch, whatever the schedule.

A tiny random V4.1 with its DSpark drafter (``tests/e2e/v41_tiny.py``), float32 with the cache unquantized and
bfloat16 with the released cache formats (packed rows). Reference: every request alone, no prefix cache.
Compared bit for bit (token ids and every returned logprob; half greedy, half seeded top-p) against all
requests at once in shuffled orders (4 sequences per step with a budget that chunks prefills and a cache small
enough to preempt; 8 with a large budget), prefix-cache hits at a block boundary, and DSpark speculative
decoding (k = 3, fixed verify length). With the mode off, batching must change some bits (bfloat16), so that
the file can fail. ``tests/e2e/test_v41_batch_invariant_device.py`` is the CPU analogue.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLMEngine
from tests.e2e.test_batch_invariant import _alone, _drain
from tests.e2e.test_v41_batch_invariant import VOCAB, _params, _requests
from tests.e2e.v41_tiny import write_tiny_v41

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Each token runs as a step of its own in the mode (prefill at decode speed, ~800 eager launches a layer): the
# CPU analogue's three prompts (the longest crosses a block), with a cache of 2 blocks preempting.
LENGTHS = [1, 20, 131]
TEETH_LENGTHS = [1, 9, 23, 40, 131, 200, 257]  # the mode off runs batched: more rows to differ in


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_v41(tmp_path_factory.mktemp("v41_bi_cuda"), seed=21, dspark=True)


def _engine(path, dtype: str, invariant: bool = True, **kw) -> LLMEngine:
    args = dict(model=str(path), device="cuda", dtype=dtype, kv_cache_dtype="float32" if dtype == "float32" else
                "auto", block_size=128, max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=512,
                num_cache_blocks=24, enforce_eager=True, load_progress=False)
    args.update(kw)
    with pytest.MonkeyPatch.context() as mp:  # the mode is read once, when the engine's config is built
        mp.setenv("DEEPINFER_BATCH_INVARIANT", "1" if invariant else "0")
        mp.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
        engine = LLMEngine.from_engine_args(**args)
    assert engine.config.batch_invariant is invariant and engine.model.batch_invariant is invariant
    # The device build's kernels are the batch-invariant table's.
    assert engine.model.model.layers[2].attn.wq_a.ops.batch_invariant is invariant
    return engine


def _prompts(seed: int = 3, lengths: list[int] = LENGTHS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def dtype(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(tiny_dir, dtype) -> dict:
    return _alone(_engine(tiny_dir, dtype, enable_prefix_caching=False), _requests(_prompts()))


@pytest.mark.parametrize("max_num_seqs,budget,blocks,seed", [(4, 37, 2, 0), (8, 2048, 24, 1)])
def test_batches_in_any_order_chunked_preempted_equal_alone(tiny_dir, dtype, reference, max_num_seqs, budget,
                                                            blocks, seed) -> None:
    order = list(range(len(LENGTHS)))
    random.Random(seed).shuffle(order)
    engine = _engine(tiny_dir, dtype, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     num_cache_blocks=blocks, enable_prefix_caching=False)
    assert _drain(engine, _requests(_prompts(), order)) == reference
    if blocks == 2:
        assert engine.scheduler.num_preemptions > 0, "the workload must exercise preemption"


def test_prefix_cache_hits_equal_recompute(tiny_dir, dtype) -> None:
    rng = random.Random(9)
    bases = [p for p in _prompts() if len(p) >= 129]
    extended = [b + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 40))] for b in bases]
    ref = _alone(_engine(tiny_dir, dtype, enable_prefix_caching=False), _requests(extended))
    engine = _engine(tiny_dir, dtype, max_num_batched_tokens=64)
    _drain(engine, [(f"base{i}", p, _params(i)) for i, p in enumerate(bases)])
    hits = engine.scheduler.prefix_hits
    assert _drain(engine, _requests(extended)) == ref
    assert engine.scheduler.prefix_hits - hits >= 128 * len(extended), "every extended prompt must hit"


def test_dspark_fixed_verify_length_equals_alone(tiny_dir, dtype, reference) -> None:
    engine = _engine(tiny_dir, dtype, max_num_batched_tokens=64,
                     speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    assert _drain(engine, _requests(_prompts(), list(range(len(LENGTHS)))[::-1])) == reference
    assert engine.spec_stats.num_draft_tokens > 0


def test_default_mode_differs_somewhere(tiny_dir) -> None:
    """Teeth: without the mode, batching and chunking the same requests changes some bits."""
    prompts = _prompts(lengths=TEETH_LENGTHS)
    alone = _alone(_engine(tiny_dir, "bfloat16", invariant=False, enable_prefix_caching=False), _requests(prompts))
    batched = _drain(_engine(tiny_dir, "bfloat16", invariant=False, enable_prefix_caching=False,
                             max_num_batched_tokens=23), _requests(prompts))
    assert alone.keys() == batched.keys() and alone != batched
