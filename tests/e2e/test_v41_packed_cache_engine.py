"""Packed cache storage of DeepSeek-V4.1 (``kv_cache_dtype="auto"``) changes no bit of what the engine returns.

The engine under ``auto`` keeps the window KV, DSpark context rows, compressed entries and index keys packed in
the released FP8 / NVFP4 / MXFP4 formats (uint8 rows, ``kv/spec_v41.py``). Compared live with the same engine
whose layout keeps those rows unpacked in the activation dtype, rounded by the model itself (the storage
before packing: ``build_v41_layout(packed=False)`` patched into the engine's cache sizing): the tokens and
every returned logprob must be the same bits, greedy and seeded sampling, with requests arriving over several
steps, prefill chunked by a small step budget, a device cache small enough to preempt and to push cached
prefix blocks to the host tier, prefix hits (from the device and from the host tier; exact, and with the
encoder-side replay of ``v41_prefix_replay="v41"``) and DSpark speculation (k = 3) whose drafts are partly
replaced by the continuation of the plain model so that some are accepted and others rolled back.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.engine import sizing
from deepinfer.kv.spec_v41 import build_v41_layout
from deepinfer.model.v41.loader import load_v41_model
from deepinfer.testing.staggered import drain
from tests.e2e.v41_tiny import write_tiny_v41

VOCAB = 4096  # the demo tokenizer's
MAX_TOKENS = 10
K = 3

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _prompts() -> list[list[int]]:
    """Several lengths; the last three share a 150-token prefix (hits at the 128 boundary)."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (1, 30, 120, 150)]
    return prompts + [prompts[-1][:150] + [rng.randrange(3, VOCAB) for _ in range(n)] for n in (9, 20)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    path = write_tiny_v41(tmp_path_factory.mktemp("v41_packed"), seed=4, dspark=True)
    plain, _ = load_v41_model(path, torch.float32, cache_qdq=True)
    # The drafts planted during the runs: each prompt's greedy continuation by the plain model.
    return path, {i: plain.greedy(torch.tensor(p), MAX_TOKENS + K) for i, p in enumerate(_prompts())}


def _engine(path, packed: bool, prefix_replay: str) -> LLMEngine:
    args = dict(model=str(path), device="cpu", dtype="float32", kv_cache_dtype="auto", block_size=128,
                max_num_seqs=8, max_num_batched_tokens=29, max_model_len=512, num_cache_blocks=2,
                kv_host_cache_gb=0.01, load_progress=False, v41_prefix_replay=prefix_replay,
                speculative_config={"method": "dspark", "num_speculative_tokens": K})
    with pytest.MonkeyPatch.context() as mp:
        if not packed:  # the rows in the activation dtype, rounded by the model: the storage before packing
            mp.setattr(sizing, "build_v41_layout", lambda *a, **kw: build_v41_layout(*a, **{**kw, "packed": False}))
        engine = LLMEngine.from_engine_args(**args)
    assert engine.storage.packed is packed
    return engine


def _plant(engine: LLMEngine, continuations: dict[int, list[int]], seed: int) -> None:
    """After every step, some decoding sequences' drafts become their prompt's planted continuation (with an
    error at a random draft, or none): every acceptance length and rollback depth then occurs."""
    rng = random.Random(seed)
    step = engine.step

    def planted():
        outs = step()
        for seq in engine.scheduler.running:
            if seq.drafts and rng.random() < 0.6:
                ref = continuations[int(seq.request.request_id[1:])]
                drafts = list(ref[seq.num_output:seq.num_output + len(seq.drafts)])
                if drafts and rng.random() < 0.5:
                    bad = rng.randrange(len(drafts))
                    drafts[bad] = (drafts[bad] + 1) % VOCAB
                seq.drafts = tuple(drafts)
        return outs

    engine.step = planted


def _run(path, continuations, packed: bool, prefix_replay: str) -> tuple[dict, LLMEngine]:
    engine = _engine(path, packed, prefix_replay)
    _plant(engine, continuations, seed=1)
    prompts = _prompts()
    out: dict = {}
    # The first four together (they outgrow the two history blocks: preemption), then the sharers one at a
    # time after another prompt took the device blocks (their hits come back from the host tier).
    arrivals = {0: [(f"r{i}", prompts[i]) for i in (3, 0, 2, 1)]}
    out.update(drain(engine, arrivals, _params(0), logprobs=True, check_integrity=True))
    for i in (4, 5):
        out.update(drain(engine, {0: [(f"r{i}", prompts[i])]}, _params(i), logprobs=True, check_integrity=True))
    return out, engine


def _params(i: int) -> SamplingParams:
    """Greedy, or (the fifth prompt) seeded sampling."""
    if i == 4:
        return SamplingParams(temperature=0.8, top_k=50, seed=7, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)


@pytest.mark.parametrize("prefix_replay", ["exact", "v41"])  # hits keep the window tails / recompute them
def test_packed_storage_equals_unpacked_bitwise(tiny, prefix_replay) -> None:
    path, continuations = tiny
    want, unpacked = _run(path, continuations, False, prefix_replay)
    got, packed = _run(path, continuations, True, prefix_replay)
    assert sorted(got) == sorted(want) and len(want) == len(_prompts())
    for rid, (tokens, logprobs) in want.items():  # float equality of every logprob: the same bits (none is NaN)
        assert got[rid] == (tokens, logprobs), rid
    for engine in (unpacked, packed):  # what the run had to exercise
        sched, st = engine.scheduler, engine.spec_stats
        assert sched.num_preemptions > 0 and sched.prefix_hits > 0 and sched.prefix_tier_hits > 0
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens
        assert engine.cache.num_requests == 0
    # The packed engine's rounded rows are uint8 rows of the formats' widths (528 B per 512 channels and so on).
    assert {t.dtype for (_, name), t in packed.storage.tensors.items() if name != "compressor_state"
            and name != "token_ids"} == {torch.uint8}
