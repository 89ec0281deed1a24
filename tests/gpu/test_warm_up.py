"""On the GPU: after the engine's start-up warm-up (engine/warm_up.py), a served-like mix of requests compiles no
Triton kernel; without the warm-up the same mix does (so the count can fail).

Each engine runs in a fresh process: kernels compiled by earlier tests stay in memory and would hide what the
warm-up misses."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _serve_mix(warm_up: bool, async_scheduling: bool) -> list[list[str]]:
    """Run the mix in this process; return the (kernel, key) of every compile after the engine started."""
    import triton.runtime.jit as jit

    from deepinfer.llm import LLM
    from deepinfer.sampling.params import SamplingParams

    llm = LLM(None, max_num_seqs=64, max_num_batched_tokens=2048, cache_memory_gb=4, load_progress=False,
              warm_up=warm_up, async_scheduling=async_scheduling)
    engine, compiled, original = llm.engine, [], jit.JITFunction._do_compile

    def counting(self, key, *args, **kwargs):
        compiled.append([getattr(self, "__name__", "?"), str(key)[:400]])
        return original(self, key, *args, **kwargs)

    jit.JITFunction._do_compile = counting
    rng = random.Random(0)
    vocab = engine.config.model.vocab_size
    total, added, finished, live = 160, 0, 0, 0
    while finished < total:
        # Arrivals between steps, at most 48 live: prefill, chunked (up to 1.5 budgets) and mixed steps of all sizes.
        while added < total and live < 48 and rng.random() < 0.4:
            n = rng.choice([rng.randrange(1, 64), rng.randrange(64, 1024), rng.randrange(1024, 3072)])
            params = SamplingParams(max_tokens=rng.randrange(1, 40), ignore_eos=True,
                                    temperature=rng.choice([0.0, 0.8]), top_p=rng.choice([1.0, 0.9]),
                                    seq_seed=rng.randrange(1 << 30))
            engine.add_request(f"r{added}", {"prompt_token_ids": [rng.randrange(vocab) for _ in range(n)]}, params)
            added, live = added + 1, live + 1
        for out in engine.step():
            if out.finished:
                finished, live = finished + 1, live - 1
    jit.JITFunction._do_compile = original
    return compiled


def _in_fresh_process(warm_up: bool, async_scheduling: bool) -> list[list[str]]:
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from tests.gpu.test_warm_up import _serve_mix; "
            f"print('COMPILED ' + json.dumps(_serve_mix({warm_up}, {async_scheduling})))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("COMPILED "))
    return json.loads(line[len("COMPILED "):])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_warmed_up_engine_compiles_nothing_while_serving(device, async_scheduling) -> None:
    if device != "cuda":
        pytest.skip("counts Triton compiles on CUDA")
    compiled = _in_fresh_process(True, async_scheduling)
    assert not compiled, f"{len(compiled)} compiles after the warm-up: " + "; ".join(
        f"{name} {key}" for name, key in compiled[:6])


def test_the_mix_compiles_without_the_warm_up(device) -> None:
    """The mix meets variants a cold engine (decode graphs captured, nothing else) has not compiled."""
    if device != "cuda":
        pytest.skip("counts Triton compiles on CUDA")
    assert len(_in_fresh_process(False, False)) > 0
