"""The engine runs DeepSeek-V4.1 over 2-process gloo worlds (``model/v41/parallel.py``: DP2 with expert
parallelism, DP2 alone, TP2) and draws the single-process engine's greedy tokens, with chunked prefill (a 29-token
step budget per DP group), preemption (2 history blocks per DP group) and requests arriving over several steps.

The tiny random V4.1 of ``v41_tiny.py`` in float32 with cache quantization off. Data parallelism alone is the
one-device arithmetic on each rank, batched differently. With expert parallelism the expert GEMMs see other rows
than on one process (every DP rank's tokens routed to an expert), which this CPU's float32 GEMMs may round
differently in the last bits, and tensor parallelism sums partial outputs in another order: the tokens must be
identical and the logprobs within 1e-4 (~6e-6 observed).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from deepinfer.sampling import SamplingParams
from deepinfer.testing.staggered import Scored, arrivals_by_step, assert_same, drain, run_world, single_thread_reference
from tests.e2e.v41_tiny import write_tiny_v41

MAX_TOKENS = 6
VOCAB = 4096  # the demo tokenizer's
# A prompt of 123+ tokens crosses into a second block while decoding; with another request beside it, its DP
# rank's 2 history blocks overflow, so both DP ranks preempt.
LENGTHS = (124, 125, 126, 123, 9, 70, 40, 17)
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> dict:
    path = write_tiny_v41(Path(tmp_path_factory.mktemp("v41dp")), seed=3)
    return dict(model=str(path), device="cpu", dtype="float32", kv_cache_dtype="float32", block_size=128,
                max_num_seqs=8, max_num_batched_tokens=29, max_model_len=256, num_cache_blocks=2,
                load_progress=False)


def _drain(engine) -> Scored:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    return drain(engine, arrivals_by_step(prompts, {0: range(0, 4), 3: range(4, 8)}), params, logprobs=True)


@pytest.fixture(scope="module")
def single(args) -> Scored:
    return single_thread_reference(args, _drain)


@pytest.mark.parametrize("parallel", [dict(data_parallel_size=2, enable_expert_parallel=True),
                                      dict(data_parallel_size=2), dict(tensor_parallel_size=2)],
                         ids=["dp2-ep", "dp2", "tp2"])
def test_v41_parallel_engine_equals_single_process(args, single, parallel, monkeypatch) -> None:
    """DP2 with the experts spread over both ranks, DP2 alone (each rank the whole model, no collective in the
    forward), and TP2 (heads and expert widths split, one DP group)."""
    want = single
    got, engine = run_world({**args, **parallel}, _drain, monkeypatch)
    preemptions = [s.num_preemptions for s in engine.schedulers]
    assert all(p > 0 for p in preemptions), f"preemption on every DP rank wanted, got {preemptions}"
    assert len(want) == len(LENGTHS)
    assert_same(got, want, TOLERANCE)
