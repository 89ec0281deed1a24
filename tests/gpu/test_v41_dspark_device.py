"""DSpark speculative decoding of DeepSeek-V4.1 on CUDA: the device build (``model/v41/device.py``: the drafter's
projections as FP8Dense32, its experts fused, its mHC coefficients the table's kernel) with every proposer's
block drafted at once from device values (``runner/dspark.py``, ``model/v41/dspark_lists.py``), eager, float32.

  * greedy tokens equal the plain device-built model's greedy tokens (batched, prefill chunked, preempted, a
    prefix hit; k = 5 with the confidence-aware verify length), and every fresh draft is what that model
    proposes from exactly the accepted tokens; planted drafts make every acceptance length occur
    (``tests/e2e/test_v41_dspark_engine.DraftCheck``);
  * seeded sampled tokens (k = 3, fixed verify length) equal the engine's without speculation;
  * drafting reads nothing back from the device (``DSparkDrafter.propose`` under sync-debug mode "error").

``tests/e2e/test_v41_dspark_device.py`` runs the first two on the CPU (the reference op table).
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.config.v41 import V41Config
from deepinfer.model.v41.device import FP8Dense32, load_v41_on_device
from deepinfer.model.v41.loader import load_tokenizer
from deepinfer.ops.table import select
from deepinfer.runner.dspark import DSparkDrafter
from deepinfer.testing.staggered import drain
from tests.e2e.test_v41_dspark_engine import GREEDY, MAX_TOKENS, DraftCheck, _phases, _prompts, _run
from tests.e2e.v41_tiny import write_tiny_v41


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("CUDA's (tests/e2e/test_v41_dspark_device.py runs the CPU analogue)")
    path = write_tiny_v41(tmp_path_factory.mktemp("v41_dspark_cuda"), seed=11, dspark=True)
    plain = load_v41_on_device(path, V41Config.from_model_dir(path), torch.float32, "cuda", select("cuda"),
                               tokenizer=load_tokenizer(path), cache_qdq=False, dspark=True)
    assert isinstance(plain.mtp[0].main_proj, FP8Dense32) and plain.mtp[0].ffn.routed is not None
    return path, plain


def _engine(path, k: int = 0, **kw) -> LLMEngine:
    args = dict(model=str(path), device="cuda", dtype="float32", kv_cache_dtype="float32", block_size=128,
                max_num_seqs=8, max_num_batched_tokens=48, max_model_len=512, num_cache_blocks=16,
                enforce_eager=True, load_progress=False)
    if k:
        args["speculative_config"] = {"method": "dspark", "num_speculative_tokens": k}
    args.update(kw)
    return LLMEngine.from_engine_args(**args)


def test_greedy_identical_and_drafts_are_the_plain_models(tiny, monkeypatch) -> None:
    path, plain = tiny
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    prompts = _prompts(5)
    reference = {f"r{i}": plain.greedy(torch.tensor(p, device="cuda"), MAX_TOKENS) for i, p in enumerate(prompts)}
    rng = random.Random(51)
    engine = _engine(path, 5, max_num_batched_tokens=rng.choice([13, 29, 41]), num_cache_blocks=2)
    assert engine.model.key_lists and engine.config.speculative.varlen
    check = DraftCheck(engine, plain, 5, True, reference, plant=0.5, seed=5, device="cuda")
    assert _run(engine, _phases(prompts, rng), GREEDY, check) == reference
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_hits > 0
    assert check.checked >= 20 and check.full >= 10
    st = engine.spec_stats
    assert 0 < st.num_accepted_tokens < st.num_draft_tokens and st.accepted_per_pos[4] > 0


def test_seeded_sampling_identical_to_no_speculation(tiny, monkeypatch) -> None:
    path, plain = tiny
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "0")
    params = SamplingParams(temperature=0.8, top_k=50, max_tokens=MAX_TOKENS, ignore_eos=True, seed=123)
    phases = _phases(_prompts(8), random.Random(4))
    plain_run = _run(_engine(path, max_num_batched_tokens=29, num_cache_blocks=2), phases, params)
    engine = _engine(path, 3, max_num_batched_tokens=29, num_cache_blocks=2)
    check = DraftCheck(engine, plain, 3, False, plain_run, plant=0.5, seed=2, device="cuda")
    assert _run(engine, phases, params, check) == plain_run
    assert engine.scheduler.num_preemptions > 0 and check.checked >= 10
    assert 0 < engine.spec_stats.num_accepted_tokens


def test_drafting_has_no_host_sync(tiny, monkeypatch) -> None:
    path, _ = tiny
    propose = DSparkDrafter.propose
    calls = []

    def strict(self, *args, **kw):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = propose(self, *args, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        calls.append(out is not None)
        return out

    monkeypatch.setattr(DSparkDrafter, "propose", strict)
    engine = _engine(path, 5, max_num_batched_tokens=29, num_cache_blocks=4)
    params = SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=7)
    got = drain(engine, {0: [(f"r{i}", p) for i, p in enumerate(_prompts(5)[:5])]}, params)
    assert len(got) == 5 and sum(calls) >= 5
