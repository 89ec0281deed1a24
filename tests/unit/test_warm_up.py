"""The start-up warm-up (engine/warm_up.py): its prompt ladder meets every token-count bucket, and it leaves no
trace -- the same tokens afterwards, no cached blocks, counters at zero. (Whether it compiles every variant
is measured on the GPU: tests/gpu/test_warm_up.py.)"""

from __future__ import annotations

import pytest

from deepinfer.engine.warm_up import ladder, prompt_lengths
from deepinfer.llm import LLM
from deepinfer.ops.tuning import KernelTuning
from deepinfer.sampling.params import SamplingParams


@pytest.mark.parametrize("limit", [1, 2, 7, 100, 2048, 8192])
def test_ladder_rungs_are_at_most_twice_apart_from_1_to_the_limit(limit: int) -> None:
    rungs = ladder(limit)
    assert rungs[0] == 1 and rungs[-1] == limit and rungs == sorted(set(rungs))
    assert all(b <= 2 * a for a, b in zip(rungs, rungs[1:]))


def _fp8_intervals(t: KernelTuning) -> set[tuple[int, int]]:
    """(lower, upper] token counts over which the FP8 launchers' choices stay the same: the M buckets of the
    MMA and swap-AB tiles, the weight-as-A threshold, and within each bucket the count of M tiles (the split-K
    count follows the program count)."""
    bounds = sorted({b for b, _ in t.fp8_tiles if b} | {b for b, _ in t.fp8_decode_tiles}
                    | {t.fp8_decode_max_m, t.fp8_wa_min_m - 1})
    out, lo = set(), 0
    for hi in bounds:
        bm = t.fp8_tile(hi)[1][0]
        for k in range(lo // bm, -(-hi // bm)):  # M tiles lo//bm+1 .. cdiv(hi, bm)
            out.add((max(lo, k * bm), min(hi, (k + 1) * bm)))
        lo = hi
    return out


def test_every_bucket_of_the_tuning_tables_has_a_rung() -> None:
    """Each (lower, upper] token-count interval the FP8 launchers choose by holds a warm-up prompt length (the
    MoE table's bounds, in pairs per expert, are 2.7x or more apart: any 2x ladder meets them)."""
    rungs = ladder(8192)
    intervals = _fp8_intervals(KernelTuning())
    assert (64, 128) in intervals and (192, 256) in intervals
    for lo, hi in intervals:
        assert any(lo < r <= hi for r in rungs), (lo, hi)


def test_prompt_lengths_fit_the_model_and_cache() -> None:
    assert prompt_lengths(2048, 8192, 10**6)[-1] == 3072  # a second chunk
    assert max(prompt_lengths(2048, 1000, 10**6)) == 998
    assert max(prompt_lengths(2048, 8192, 500)) == 498
    assert prompt_lengths(2048, 2, 10**6) == []  # no room for a prompt and two tokens


def _tokens(llm: LLM) -> list[list[int]]:
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 5 for j in range(20 + 90 * i)]} for i in range(5)]
    out = llm.generate(prompts, [SamplingParams(max_tokens=10, temperature=t, seq_seed=11)
                                 for t in (0.0, 0.8, 0.0, 0.8, 1.0)], use_tqdm=False)
    return [o.outputs[0].token_ids for o in out]


def test_the_warm_up_leaves_no_trace() -> None:
    kw = dict(device="cpu", load_progress=False, max_num_batched_tokens=512, block_size=256, max_model_len=2048)
    warmed = LLM(None, warm_up=True, **kw)
    engine = warmed.engine
    # Its prompts (up to 768 tokens, 256-token blocks) were cached, then dropped; counters read zero.
    assert sum(engine.cache.num_cached_blocks().values()) == 0
    assert engine.scheduler.prefix_queries == engine.scheduler.prefix_hits == 0
    assert not engine.requests and engine._inflight is None
    assert _tokens(warmed) == _tokens(LLM(None, warm_up=False, **kw))


def test_warm_up_defaults_to_the_device() -> None:
    from deepinfer.config.engine import EngineArgs, EngineConfig

    assert EngineConfig.create(EngineArgs(device="cpu")).warm_up is False
    assert EngineConfig.create(EngineArgs(device="cpu", warm_up=True)).warm_up is True
    with pytest.raises(ValueError, match="warm_up: must be true or false"):
        EngineConfig.create(EngineArgs(device="cpu", warm_up="yes"))
