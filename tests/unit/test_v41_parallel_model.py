"""DeepSeek-V4.1 with data- and tensor-parallel attention and expert- or tensor-parallel MoE in real gloo worlds
computes what one process computes (``model/v41/parallel.py``).

Every rank loads the tiny random V4.1 (``tests/e2e/v41_tiny.py``: window-only layers, ratio-2 and ratio-1 KV
sources, reusing and re-indexing layers, candidate blocks, Engram, mHC, MoE of 8 experts) and keeps its share
(``shard_v41``; the engine's sliced load, which reads only that share, must hold the same bytes); each DP rank
runs a scripted series of chunks of its own sequences, one sequence per step (prefill chunks, decodes, and steps
where a rank has no tokens and runs ``empty_step`` to join the expert exchanges). The parent runs the same
chunks on the unsharded model, sequence by sequence.

Exactness: data parallelism alone runs the one-device code on each rank: bit-equal. With expert parallelism an
expert's GEMM sees the rows of every rank's tokens routed to it (one process: one sequence's), and the combine
reproduces ``MoE.forward``'s order (fp32, ascending experts). In bfloat16 this CPU's GEMMs give a row the same
result whatever else is in the batch: bit-equal. In float32 they may change a row's last bits with the row
count, so float32 compares within 1e-4 in the logits (random weights of scale 0.15 over 10 layers: ~5e-6
observed) and with identical greedy argmax; tensor parallelism sums partial outputs in another order: the same
bound.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from deepinfer.distributed.config import ParallelConfig
from deepinfer.distributed.world import WorldEnv, close_world, init_world
from deepinfer.model.v41.loader import load_v41_model
from deepinfer.model.v41.parallel import (V41EPMoE, V41TPAttention, V41TPMoE, empty_step, needs_empty_steps,
                                          shard_v41)
from deepinfer.testing.world import run_world
from tests.e2e.v41_tiny import write_tiny_v41

DP2 = ParallelConfig(data_parallel_size=2)
DP2_EP = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)
DP4_EP = ParallelConfig(data_parallel_size=4, enable_expert_parallel=True)
TP2 = ParallelConfig(tensor_parallel_size=2)
TP2_EP = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True)
TP2_DP2_EP = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)


def _script(ranks: int) -> list[list[tuple[int, list[int]] | None]]:
    """steps -> per DP rank: (sequence, its next tokens) or None (no tokens on that rank)."""
    g = torch.Generator().manual_seed(11)
    p = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (45, 30, 23, 37)]
    two = [
        [(0, p[0][:20]), (1, p[1][:25])],
        [(0, p[0][20:]), None],  # rank 1 idle
        [None, (1, p[1][25:])],  # rank 0 idle
        [(2, p[2]), (1, [9])],  # a new sequence beside a decode
        [(0, [5]), (1, [11])],
        [(2, [7]), (1, [13])],
    ]
    if ranks == 2:
        return two
    return [s + [(3, p[3][:17]) if i == 0 else (3, p[3][17:]) if i == 1 else None, None] for i, s in enumerate(two)]


def _run(model, steps: list[tuple[int, list[int]] | None]) -> list[torch.Tensor | None]:
    caches: dict[int, object] = {}
    out = []
    for step in steps:
        if step is None:
            if needs_empty_steps(model):
                empty_step(model)
            out.append(None)
            continue
        seq, tokens = step
        cache = caches.setdefault(seq, model.new_cache())
        out.append(model(torch.tensor(tokens), cache))
    return out


def _rank(env: WorldEnv, model_dir: str, jobs: list[tuple[ParallelConfig, torch.dtype]]
          ) -> list[list[torch.Tensor | None]]:
    results = []
    for config, dtype in jobs:
        pctx = init_world(config, "cpu", env, timeout_s=60)
        model, _ = load_v41_model(model_dir, dtype)
        shard_v41(model, pctx)
        # The engine's sliced load (only this rank's tensors read) holds the same bytes as the whole model cut.
        sliced, _ = load_v41_model(model_dir, dtype, keep=functools.partial(shard_v41, pctx=pctx))
        want, got = model.state_dict(), sliced.state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want), config
        if config.enable_expert_parallel:
            assert all(isinstance(b.ffn, V41EPMoE) and len(b.ffn.experts) == 8 // config.world_size
                       for b in model.layers)
        if config.tensor_parallel_size > 1:
            assert all(isinstance(b.attn, V41TPAttention) and b.attn.heads == 2 for b in model.layers)
            assert config.enable_expert_parallel or all(isinstance(b.ffn, V41TPMoE) for b in model.layers)
        results.append(_run(model, [s[pctx.dp_rank] for s in _script(_columns(config))]))
    # Every rank done before any tears its groups down (a gloo group whose peer has exited can abort at exit).
    torch.distributed.barrier()
    close_world()
    return results


@functools.cache
def _reference(model_dir: str, ranks: int, dtype: torch.dtype) -> list[list[torch.Tensor | None]]:
    """Per DP rank, per step: the one-process model's logits of that rank's chunk, with torch on one thread as
    each rank runs (float32 GEMMs sum in another order on more threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, _ = load_v41_model(model_dir, dtype)
        script = _script(ranks)
        flat = _run(model, [s for step in script for s in step])
    finally:
        torch.set_num_threads(threads)
    return [[flat[i * ranks + r] for i in range(len(script))] for r in range(ranks)]


@pytest.fixture(scope="module")
def v41_dir(tmp_path_factory) -> str:
    return str(write_tiny_v41(Path(tmp_path_factory.mktemp("v41par")), seed=5))


def _columns(config: ParallelConfig) -> int:
    """Which script a world runs: one DP group runs the two-rank script's first column."""
    return max(2, config.data_parallel_size)


def _check(model_dir: str, jobs: list[tuple[ParallelConfig, torch.dtype]], results: list) -> None:
    for c, (config, dtype) in enumerate(jobs):
        for rank, per_job in enumerate(results):
            dp_rank = rank // config.tensor_parallel_size
            got, want = per_job[c], _reference(model_dir, _columns(config), dtype)[dp_rank]
            for i, (g, w) in enumerate(zip(got, want)):
                where = f"{config} {dtype} rank {rank} step {i}"
                if w is None:
                    assert g is None, where
                elif config.tensor_parallel_size == 1 and (not config.enable_expert_parallel
                                                           or dtype == torch.bfloat16):
                    assert torch.equal(g, w), f"{where}: max diff {(g - w).abs().max().item()}"
                else:
                    assert torch.equal(g.argmax(-1), w.argmax(-1)), f"{where}: greedy tokens differ"
                    assert (g - w).abs().max().item() <= 1e-4, f"{where}: {(g - w).abs().max().item()}"


def test_two_ranks_data_parallel_with_and_without_expert_parallel(v41_dir: str) -> None:
    """DP2 (bit-equal), DP2+EP in float32 (within 1e-4) and in bfloat16 (bit-equal)."""
    jobs = [(DP2, torch.float32), (DP2_EP, torch.float32), (DP2_EP, torch.bfloat16)]
    _check(v41_dir, jobs, run_world(_rank, 2, (v41_dir, jobs), timeout_s=120))


def test_two_ranks_tensor_parallel(v41_dir: str) -> None:
    """TP2 (heads and expert widths split) and TP2 with the experts spread over both ranks (float32, within
    1e-4: the all-reduce sums the heads' partial outputs in another order)."""
    jobs = [(TP2, torch.float32), (TP2_EP, torch.float32)]
    _check(v41_dir, jobs, run_world(_rank, 2, (v41_dir, jobs), timeout_s=120))


def test_four_ranks_expert_parallel(v41_dir: str) -> None:
    """DP4 + EP (two experts a rank; two of the four DP ranks have no tokens in every step, bfloat16: bit-equal)
    and TP2 x DP2 + EP (float32, within 1e-4)."""
    jobs = [(DP4_EP, torch.bfloat16), (TP2_DP2_EP, torch.float32)]
    _check(v41_dir, jobs, run_world(_rank, 4, (v41_dir, jobs), timeout_s=120))
