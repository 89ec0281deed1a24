"""Speculative decoding's CUDA graphs (verify steps that keep their streams, the MTP passes with the head and
the draft pick inside) compute what the eager verify path computes: the same tokens, drafts and logprobs,
bit for bit, at full buckets -- per engine step with greedy and seeded sampled rows in one batch (also with
async scheduling, whose verify steps move the graphs' static positions on the device), and per chained MTP
pass replayed directly against the eager function it captures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.model.step_index import SlotTables, build_slot_index
from deepinfer.runner.mtp_steps import chain_step

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = ["def fib(n):", "import os\n", "class Stack:", "# sort a list\n", "for i in range(", "def main():\n",
           "x = [", "while True:"]


def _engine(k: int, eager: bool, async_scheduling: bool = False) -> LLMEngine:
    return LLMEngine.from_engine_args(device="cuda", block_size=256, max_num_seqs=8, max_model_len=1024,
                                      cache_memory_gb=2.0, load_progress=False, enforce_eager=eager,
                                      async_scheduling=async_scheduling,
                                      speculative_config={"method": "mtp", "num_speculative_tokens": k})


def _run(engine: LLMEngine, prompts: list[str], params, drafts: list | None = None) -> dict:
    """Final outputs by request id (``params``: one for all, or one per prompt); ``drafts``: gets each step's
    drafts of every running sequence."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params[i] if isinstance(params, list) else params)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0]
        if drafts is not None:
            drafts.append({s.seq_id: tuple(s.drafts) for s in engine.scheduler.running})
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


@pytest.mark.parametrize("k", [2, 3])
def test_drafts_of_mixed_batches_equal_eager(k: int) -> None:
    """Greedy and sampled rows in one step: the sampled variant of the MTP graphs picks the drafts of both
    kinds, step by step as the eager pick does."""
    graphs, eager = _engine(k, eager=False), _engine(k, eager=True)
    for n in (2, 4, 8):
        params = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True) if i % 2 else
                  SamplingParams(temperature=0.9, seed=11 + i, max_tokens=32, ignore_eos=True) for i in range(n)]
        da, db = [], []
        a, b = _run(graphs, PROMPTS[:n], params, da), _run(eager, PROMPTS[:n], params, db)
        assert da == db, (k, n)
        assert any(any(d) for step in da for d in step.values())
        for rid in a:
            assert a[rid].token_ids == b[rid].token_ids, (k, n, rid)


@pytest.mark.parametrize("k", [1, 3])
def test_async_verify_graphs_equal_eager(k: int) -> None:
    """Async scheduling: verify steps planned on the drafts of the step in flight replay the verify and MTP
    graphs with their static positions moved on the device (``runner/step_shift.py``): the eager async
    engine's tokens, logprobs and drafts bit for bit. (Against the synchronous loop the GPU's tokens are
    equal where its kernels are batch-invariant: near max_tokens async steps verify fewer drafts.)"""
    graphs, eager = _engine(k, eager=False, async_scheduling=True), _engine(k, eager=True, async_scheduling=True)
    submit, overlapped = graphs.runner.submit, []

    def counted(plan, *args, **kwargs):  # full verify steps on placeholder drafts: the graphs' case
        overlapped.extend(w for w in plan.work if w.num_placeholders == k + 1)
        return submit(plan, *args, **kwargs)

    graphs.runner.submit = counted
    for n in (1, 4, 8):
        params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2) if i % 2 else
                  SamplingParams(temperature=0.8, seed=5 + i, max_tokens=40, ignore_eos=True) for i in range(n)]
        da, db = [], []
        a, b = _run(graphs, PROMPTS[:n], params, da), _run(eager, PROMPTS[:n], params, db)
        assert da == db, (k, n)
        for rid in a:
            assert a[rid].token_ids == b[rid].token_ids, (k, n, rid)
            assert a[rid].logprobs == b[rid].logprobs, (k, n, rid)
    assert overlapped
    assert graphs.spec_stats.num_accepted_tokens == eager.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("sampled", [False, True])
def test_chain_graph_equals_chain_step(sampled: bool) -> None:
    """One chained pass replayed from its graph (index built at full acceptance, shifted on the device, head
    and pick inside) against ``chain_step`` run eagerly on the same inputs, at every full chain bucket."""
    engine = _engine(3, eager=False)
    _run(engine, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=8))  # every block is free again after
    g, model, storage = engine.runner.drafter.graphs, engine.model, engine.storage
    bs, window = storage.layout.block_size, model.cfg.sliding_window
    gen = torch.Generator().manual_seed(2)
    for m in g.chain_sizes:
        tables = SlotTables(m, 1024 // bs)
        for slot in range(m):
            for arr in tables.arrays.values():
                arr[slot, :2] = [2 * slot, 2 * slot + 1]  # two blocks of their own (positions < 2 * bs)
        slots = np.arange(m, dtype=np.int64)
        full = torch.randint(3, 2 * bs, (m,), generator=gen).numpy().astype(np.int64)
        shift = -torch.randint(0, 3, (m,), generator=gen).cuda()
        streams = engine.runner.graphs.bucket(1).streams
        x = torch.randn((m, *streams.shape[1:]), generator=gen).to(device="cuda", dtype=streams.dtype)
        ids = torch.randint(3, model.cfg.vocab_size, (m,), generator=gen).cuda()
        temp = (torch.rand(m, generator=gen, dtype=torch.float64) * 1.5 * (torch.arange(m) % 2) if sampled
                else torch.zeros(m, dtype=torch.float64)).cuda()
        seeds = torch.randint(0, 1 << 40, (m,), generator=gen).cuda()
        xg, dg = g.run_chain(x, ids, slots, full, tables, shift, temp, seeds, sampled)
        xg, dg = xg.clone(), dg.clone()
        index = build_slot_index(slots, full, np.ones(m, dtype=np.int64), tables, storage, window,
                                 pin_memory=True).to("cuda")
        xe, de = chain_step(model, storage, x, ids, index, shift, temp, seeds, sampled)
        assert torch.equal(xg, xe), m
        assert torch.equal(dg, de), m
