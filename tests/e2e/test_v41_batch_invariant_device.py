"""``DEEPINFER_BATCH_INVARIANT=1`` on V4.1's device build (``model/v41/device.py``: FP8Dense32, fused FP4 experts,
the table's mHC coefficients, the key-list attention), on the CPU with the batch-invariant reference table: a
request's tokens and logprobs are the same bits alone and in any batch.

Reference: every request alone, no prefix cache. Compared bit for bit (token ids and every returned logprob,
half greedy, half seeded top-p) against all requests at once in a shuffled order, 4 sequences per step, a step
budget that cuts prefills into chunks, a cache small enough to preempt; and against DSpark speculative
decoding (k = 3, fixed verify length, its blocks drafted at once as on CUDA). The runner hands the step its
host facts, so each token's are derived on the host (``invariant.token_steps``), as on CUDA.
``tests/gpu/test_v41_batch_invariant_device.py`` runs the same on CUDA with the Triton kernels.
"""

from __future__ import annotations

import random

import pytest

from deepinfer import LLMEngine
from deepinfer.model.v41 import paged
from deepinfer.model.v41.fp8_dense import FP8Dense32
from deepinfer.ops.table import select
from tests.e2e.test_batch_invariant import _alone, _drain
from tests.e2e.test_v41_batch_invariant import VOCAB, _requests
from tests.e2e.v41_tiny import write_tiny_v41

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _prompts() -> list[list[int]]:
    """Fewer than test_v41_batch_invariant's (the device build's reference kernels are slower); the longest
    crosses a block."""
    rng = random.Random(3)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 20, 131)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # test_v41_batch_invariant's model: eight layers keep every kind; fewer Sinkhorn iterations.
    return write_tiny_v41(tmp_path_factory.mktemp("v41_bi_dev"), seed=21, dspark=True, num_hidden_layers=8,
                          dspark_target_layer_ids=[5, 6, 7], hc_sinkhorn_iters=4)


def _engine(path, **kw) -> LLMEngine:
    args = dict(model=str(path), device="cpu", dtype="float32", block_size=128, max_num_seqs=8,
                max_num_batched_tokens=2048, max_model_len=512, num_cache_blocks=24, enforce_eager=True,
                load_progress=False)
    args.update(kw)
    ops = select("cpu", batch_invariant=True)
    build = paged.load_paged_v41  # the CPU engine given the device build (the engine passes ops on cuda)
    with pytest.MonkeyPatch.context() as mp:  # the mode is read once, when the engine's config is built
        mp.setattr(paged, "load_paged_v41", lambda *a, **k: build(*a, **{**k, "ops": ops}))
        mp.setenv("DEEPINFER_BATCH_INVARIANT", "1")
        mp.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
        engine = LLMEngine.from_engine_args(**args)
    assert engine.config.batch_invariant and engine.model.batch_invariant and engine.model.key_lists
    assert engine.model.model.layers[2].attn.wq_a.ops.batch_invariant
    assert isinstance(engine.model.model.layers[2].attn.wq_a, FP8Dense32)
    return engine


@pytest.fixture(scope="module")
def reference(tiny_dir) -> dict:
    return _alone(_engine(tiny_dir, enable_prefix_caching=False), _requests(_prompts()))


def test_batched_chunked_preempted_equal_alone(tiny_dir, reference) -> None:
    order = list(range(len(_prompts())))
    random.Random(0).shuffle(order)
    engine = _engine(tiny_dir, max_num_seqs=4, max_num_batched_tokens=37, num_cache_blocks=2,
                     enable_prefix_caching=False)
    assert _drain(engine, _requests(_prompts(), order)) == reference
    assert engine.scheduler.num_preemptions > 0, "the workload must exercise preemption"


def test_dspark_fixed_verify_length_equals_alone(tiny_dir, reference) -> None:
    engine = _engine(tiny_dir, max_num_batched_tokens=64,
                     speculative_config={"method": "dspark", "num_speculative_tokens": 3})
    assert _drain(engine, _requests(_prompts(), list(range(len(_prompts())))[::-1])) == reference
    assert engine.spec_stats.num_draft_tokens > 0
