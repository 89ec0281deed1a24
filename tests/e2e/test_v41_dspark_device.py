"""DSpark speculative decoding on V4.1's device build (``model/v41/device.py``), on the CPU with the reference op
table: the drafter built like the blocks (FP8Dense32 projections, fused FP4 experts, the table's mHC
coefficients) and every proposer's block drafted at once from device values (``runner/dspark.py``'s
``_propose_lists``, ``model/v41/dspark_lists.py``), the path CUDA takes.

  * greedy tokens equal the plain device-built model's greedy tokens, batched, prefill chunked, preempted,
    after a prefix hit, k = 5 with the confidence-aware verify length; seeded sampled tokens (k = 3, fixed
    verify length) equal the engine's without speculation;
  * every fresh draft is what the plain device-built model proposes (``DeepseekV41.propose``, one block from a
    cache of exactly the accepted tokens), verify length included; planted drafts make every acceptance
    length and rollback depth occur (``test_v41_dspark_engine.DraftCheck``).

``tests/gpu/test_v41_dspark_device.py`` runs the same on CUDA with the Triton kernels.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.config.v41 import V41Config
from deepinfer.model.v41 import paged
from deepinfer.model.v41.device import FP8Dense32, load_v41_on_device
from deepinfer.model.v41.loader import load_tokenizer
from deepinfer.ops.table import REF
from tests.e2e.test_v41_dspark_engine import GREEDY, MAX_TOKENS, DraftCheck, _phases, _prompts, _run
from tests.e2e.v41_tiny import write_tiny_v41

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    # Eight of the ten layers keep every kind (the re-indexing layer 7 included); fewer Sinkhorn iterations, two
    # stages (the first owns main_proj, the last the heads): the reference kernels of the device build are slow.
    path = write_tiny_v41(tmp_path_factory.mktemp("v41_dspark_dev"), seed=11, dspark=True, num_hidden_layers=8,
                          dspark_target_layer_ids=[5, 6, 7], hc_sinkhorn_iters=4, num_nextn_predict_layers=2)
    plain = load_v41_on_device(path, V41Config.from_model_dir(path), torch.float32, "cpu", REF,
                               tokenizer=load_tokenizer(path), cache_qdq=False, dspark=True)
    assert isinstance(plain.mtp[0].attn.wq_a, FP8Dense32) and isinstance(plain.mtp[0].main_proj, FP8Dense32)
    assert plain.mtp[0].ffn.routed is not None and len(plain.mtp[0].ffn.experts) == 0
    return path, plain


def _engine(path, monkeypatch, k: int = 0, **kw) -> LLMEngine:
    build = paged.load_paged_v41  # the CPU engine given the device build (the engine passes ops on cuda)
    monkeypatch.setattr(paged, "load_paged_v41", lambda *a, **k: build(*a, **{**k, "ops": REF}))
    args = dict(model=str(path), device="cpu", dtype="float32", kv_cache_dtype="float32", block_size=128,
                max_num_seqs=8, max_num_batched_tokens=48, max_model_len=512, num_cache_blocks=16,
                enforce_eager=True, load_progress=False)
    if k:
        args["speculative_config"] = {"method": "dspark", "num_speculative_tokens": k}
    args.update(kw)
    engine = LLMEngine.from_engine_args(**args)
    assert engine.model.key_lists
    assert not k or isinstance(engine.model.model.mtp[0].attn.wq_a, FP8Dense32)
    return engine


# The fixed verify length runs in the seeded test (k = 3).
@pytest.mark.parametrize("k,varlen", [(5, True)], ids=["5-varlen"])
def test_greedy_identical_and_drafts_are_the_plain_models(tiny, k, varlen, monkeypatch) -> None:
    path, plain = tiny
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1" if varlen else "0")
    prompts = _prompts(5)
    reference = {f"r{i}": plain.greedy(torch.tensor(p), MAX_TOKENS) for i, p in enumerate(prompts)}
    rng = random.Random(10 * k + varlen)
    engine = _engine(path, monkeypatch, k, max_num_batched_tokens=rng.choice([13, 29, 41]), num_cache_blocks=2)
    assert engine.config.speculative.varlen is varlen
    check = DraftCheck(engine, plain, k, varlen, reference, plant=0.5, seed=k)
    got = _run(engine, _phases(prompts, rng), GREEDY, check)
    assert got == reference
    assert engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert engine.scheduler.prefix_hits > 0, "the test must exercise a prefix hit"
    assert check.checked >= 20 and check.full >= 10
    st = engine.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens and st.accepted_per_pos[k - 1] > 0


def test_seeded_sampling_identical_to_no_speculation(tiny, monkeypatch) -> None:
    path, plain = tiny
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
    prompts = _prompts(8)
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=MAX_TOKENS, ignore_eos=True, seed=123)
    phases = _phases(prompts, random.Random(4))
    plain_run = _run(_engine(path, monkeypatch, max_num_batched_tokens=29, num_cache_blocks=2), phases, params)
    engine = _engine(path, monkeypatch, 3, max_num_batched_tokens=29, num_cache_blocks=2)
    check = DraftCheck(engine, plain, 3, False, plain_run, plant=0.5, seed=2)
    assert _run(engine, phases, params, check) == plain_run
    assert engine.scheduler.num_preemptions > 0 and check.checked >= 10
    st = engine.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens and st.accepted_per_pos[2] > 0
