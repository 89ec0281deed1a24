"""Speculative decoding's CUDA graphs (verify steps that keep their streams, the MTP passes) compute what the
eager verify path computes: the same tokens, drafts and logprobs, bit for bit, at full buckets."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLMEngine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ["def fib(n):", "import os\n", "class Stack:", "# sort a list\n", "for i in range(", "def main():\n",
           "x = [", "while True:"]


def _engine(k: int, eager: bool) -> LLMEngine:
    return LLMEngine.from_engine_args(device="cuda", block_size=256, max_num_seqs=8, max_model_len=1024,
                                      cache_memory_gb=2.0, load_progress=False, enforce_eager=eager,
                                      speculative_config={"method": "mtp", "num_speculative_tokens": k})


def _run(engine: LLMEngine, prompts: list[str], params: SamplingParams) -> dict:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0]
    return out


@pytest.mark.parametrize("k", [1, 3])
def test_verify_and_mtp_graphs_equal_eager(k: int) -> None:
    graphs, eager = _engine(k, eager=False), _engine(k, eager=True)
    assert graphs.runner.drafter.graphs is not None
    for n in (1, 4, 8):  # full buckets: the graphs run the same row counts as the eager path
        for params in (SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2),
                       SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True)):
            a, b = _run(graphs, PROMPTS[:n], params), _run(eager, PROMPTS[:n], params)
            for rid in a:
                assert a[rid].token_ids == b[rid].token_ids, (k, n, rid)
                assert a[rid].logprobs == b[rid].logprobs, (k, n, rid)
    assert graphs.spec_stats.num_accepted_tokens == eager.spec_stats.num_accepted_tokens > 0
