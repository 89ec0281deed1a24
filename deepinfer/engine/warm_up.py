"""Start-up warm-up: the Triton kernel variants serving needs are compiled before the first request.

Triton compiles a kernel once per set of constexpr values (and integer-argument class); the launchers pick
tiles, K splits, paths and chunk sizes from the step's token count, so a server that starts cold compiles a
new variant (0.1-1 s each) at the first step of each new size class while requests wait: 16 compiles, 7 s
of the first 13 s of served traffic after the usual 64-request warm-up on the H200
(``bench/results/serve_demo.md``). Integer arguments that vary from step to step are kept out of the
specialization in the kernels themselves (``do_not_specialize``: one binary for every value), so what is
left depends on the token count's bucket, and one prompt per rung of a ladder that grows by at most 2x
between rungs (1, 2, 3, 4, 6, 8, 12, ...) meets every bucket of the tuning tables (whose bounds are powers
of two or further apart than 2x). Each rung's prompt is run alone, so its prefill is a step of exactly that
many tokens, and draws two tokens (one decode step after it, greedy and seeded sampling alternating). One
prompt longer than the step budget adds a chunk that attends to an earlier chunk.

On several data-parallel ranks (``executor/engine.py``) each rung sends one prompt to every DP rank at once (the
engine gives each new request to the least loaded rank), so every rank compiles its variants, and the
expert-parallel MoE sees the rung's count from each rank.

Nothing of it stays: the prompts' cache blocks are dropped from the prefix cache (every DP rank's), the
counters the server reports are reset, and the draws are keyed by the warm-up's own request ids (no shared
random state).
"""

from __future__ import annotations

import logging
import random
import time

from deepinfer.engine.spec_stats import SpecDecodeStats
from deepinfer.sampling.params import SamplingParams

log = logging.getLogger("deepinfer.engine")

_ID = "deepinfer-warm-up"  # request ids and cache salt of the warm-up's prompts


def ladder(limit: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... up to ``limit`` (and ``limit`` itself): consecutive rungs at most 2x apart."""
    rungs, t = set(), 1
    while t <= limit:
        rungs.add(t)
        if t + t // 2 <= limit:
            rungs.add(t + t // 2)
        t *= 2
    rungs.add(limit)
    return sorted(r for r in rungs if r >= 1)


def prompt_lengths(max_num_batched_tokens: int, max_model_len: int, max_cached_tokens: int) -> list[int]:
    """The warm-up's prompt lengths: the ladder up to one step's budget, then one prompt of 1.5 steps (a second
    chunk with context), each leaving room for its two tokens in the sequence and in the cache."""
    cap = min(max_model_len, max_cached_tokens) - 2
    if cap < 1:  # no prompt fits with two tokens to draw: nothing to warm up with
        return []
    lengths = ladder(min(max_num_batched_tokens, cap))
    longer = min(max_num_batched_tokens + max_num_batched_tokens // 2, cap)
    return lengths + ([longer] if longer > lengths[-1] else [])


def warm_up(engine) -> None:
    """Run the warm-up prompts through ``engine`` (an ``LLMEngine`` with nothing queued), one rung at a time:
    one prompt alone, or one per DP rank of a ``ParallelLLMEngine``."""
    assert not engine.requests, "warm-up: the engine must be idle"
    started = time.perf_counter()
    sc = engine.config.scheduler
    vocab = engine.config.model.vocab_size
    rng = random.Random(0)
    lengths = prompt_lengths(sc.max_num_batched_tokens, sc.max_model_len, engine.intake.max_cached_tokens)
    for i, n in enumerate(lengths):
        params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0 if i % 2 == 0 else 0.8, seq_seed=i)
        for d in range(engine.config.parallel.data_parallel_size):
            prompt = {"prompt_token_ids": [rng.randrange(vocab) for _ in range(n)], "cache_salt": _ID}
            engine.add_request(f"{_ID}-{i}-{d}", prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
    engine.step()  # async scheduling: nothing left in flight
    _forget(engine)
    log.info("warm-up: %d prompts of 1..%d tokens in %.1f s", len(lengths), max(lengths, default=0),
             time.perf_counter() - started)


def _forget(engine) -> None:
    """Leave no trace of the warm-up: its cached blocks and the counters the server reports."""
    for sched in getattr(engine, "schedulers", (engine.scheduler,)):  # every DP rank's on several ranks
        sched.cache.reset_prefix_cache()
        if getattr(sched, "prefix", None) is not None:
            sched.prefix_queries = sched.prefix_hits = 0
        for pool in sched.cache.pools.values():
            pool.num_evictions = 0
    engine.spec_stats = SpecDecodeStats(engine.spec_stats.num_speculative_tokens)
