"""Sharded models in real multi-process gloo worlds compute what the single-process model computes.

Each rank loads only its share of the checkpoint, as the engine does (``sharding_hook``: its sharded module
types built on the meta device and filled with its slices, quantized-first) and runs a scripted series of steps on
its own sequences (DP ranks own different ones; a TP group shares its DP rank's); the parent runs the same
steps with one model over all sequences (the DP ranks' batches concatenated in rank order). Steps include
chunked prefill, decode, and a DP rank with no tokens (it runs an empty step and joins the collectives).

Exactness: expert parallelism alone is bit-exact here in bfloat16 (the dispatch/combine reproduces the
single-process ``ExpertLoop`` order; this CPU's bf16 GEMMs give a row the same result whatever else is in
the batch). In float32 the CPU GEMMs change a row's last bits with the batch (``DEEPINFER_BATCH_INVARIANT``
in the README), and tensor parallelism sums partial outputs in another order, so those compare with a
tight tolerance and identical greedy argmax.
"""

from __future__ import annotations

import functools

import pytest
import torch

from deepinfer.assets import demo_model_dir
from deepinfer.distributed.config import ParallelConfig
from deepinfer.distributed.world import WorldEnv, init_world
from deepinfer.kv.spec import build_layout
from deepinfer.model.device import prepare_for_device
from deepinfer.model.loader import load_model
from deepinfer.model.parallel.shard import empty_step, needs_empty_steps, sharding_hook
from deepinfer.ops.table import REF
from deepinfer.runner.sequences import SequenceCache
from deepinfer.testing.make_checkpoint import PRESETS, write_random_checkpoint
from deepinfer.testing.world import run_world

TP2 = ParallelConfig(tensor_parallel_size=2)
DP2_EP = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)
TP2_DP2_EP = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)
DP2_TP2 = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2)


def _script(vocab: int) -> list[list[dict[int, list[int]]]]:
    """steps -> per DP rank (two) -> {sequence: new tokens}: chunked prefills, an idle rank, decodes."""
    g = torch.Generator().manual_seed(7)
    p = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (150, 40, 70, 20)]
    tok = [[5], [9], [11], [13]]
    return [
        [{0: p[0][:100], 1: p[1][:30]}, {2: p[2][:60]}],
        [{0: p[0][100:], 1: p[1][30:]}, {}],  # DP rank 1 has no tokens
        [{}, {2: p[2][60:], 3: p[3]}],  # DP rank 0 has no tokens
        [{0: tok[0], 1: tok[1]}, {2: tok[2], 3: tok[3]}],
    ]


def _run(model, steps: list[dict[int, list[int]]]) -> list[torch.Tensor | None]:
    """One rank's (or the reference's) logits per step; None where it had no tokens."""
    cache = SequenceCache(build_layout(model.cfg, 128), 8, model.dtype)
    sids: dict[int, int] = {}
    out = []
    for step in steps:
        if not step:
            if needs_empty_steps(model):
                empty_step(model)
            out.append(None)
            continue
        for s in step:
            if s not in sids:
                sids[s] = cache.new_sequence()
        new = {sids[s]: t for s, t in step.items()}
        ids, batch = cache.plan(new)
        out.append(model.logits(model(ids, batch, cache.storage)))
        cache.commit(new)
    return out


def _rank(env: WorldEnv, jobs: list[tuple[str, torch.dtype, bool, ParallelConfig]]):
    """Every job (model directory, dtype, device transform?, parallel config) in this one world."""
    results = []
    for model_dir, dtype, device_path, config in jobs:
        pctx = init_world(config, "cpu", env, timeout_s=60)
        model = load_model(model_dir, dtype=dtype, progress=False, ops=REF if device_path else None,
                           shard_model=sharding_hook(pctx))
        script = _script(model.cfg.vocab_size)
        dp = pctx.dp_rank if config.data_parallel_size > 1 else None
        steps = [s[dp] if dp is not None else {**s[0], **s[1]} for s in script]
        results.append(_run(model, steps))
    return results


@functools.cache  # the same model and path serve several parallel configs, in both worlds
def _reference(model_dir: str, dtype: torch.dtype, device_path: bool) -> list[list[torch.Tensor]]:
    """Per step, per DP rank (of two): the single-process model's logits of that rank's rows."""
    model = load_model(model_dir, dtype=dtype, progress=False, keep_quantized=True)
    if device_path:
        prepare_for_device(model, REF)
    script = _script(model.cfg.vocab_size)
    logits = _run(model, [{**s[0], **s[1]} for s in script])
    out = []
    for step, full in zip(script, logits):
        n0 = sum(len(t) for t in step[0].values())
        out.append([full[:n0], full[n0:]])
    return out


def _check(got: list, ref: list, config: ParallelConfig, exact: bool, rank: int) -> None:
    dp = rank // config.tensor_parallel_size if config.data_parallel_size > 1 else None
    for i, (g, r) in enumerate(zip(got, ref)):
        want = torch.cat(r) if dp is None else r[dp]
        if len(want) == 0:
            assert g is None, f"step {i}: rank {rank} had no tokens but returned logits"
            continue
        where = f"{config} rank {rank} step {i}"
        if exact:
            assert torch.equal(g, want), f"{where}: max diff {(g.float() - want.float()).abs().max().item()}"
        else:
            assert torch.equal(g.argmax(-1), want.argmax(-1)), f"{where}: greedy tokens differ"
            tol = 2e-2 if g.dtype == torch.bfloat16 else 1e-4
            assert (g.float() - want.float()).abs().max().item() <= tol, where


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny")
    write_random_checkpoint(out, PRESETS["tiny"], seed=3)
    return str(out)


def _world(world_size: int, jobs: list[tuple[str, torch.dtype, bool, ParallelConfig, bool]]) -> None:
    """Run ``jobs`` (..., exact?) in one world of ``world_size`` ranks and check every rank's logits."""
    results = run_world(_rank, world_size, ([j[:4] for j in jobs],), timeout_s=150)
    for i, (model_dir, dtype, device_path, config, exact) in enumerate(jobs):
        ref = _reference(model_dir, dtype, device_path)
        for rank, per_job in enumerate(results):
            _check(per_job[i], ref, config, exact, rank)


def test_two_ranks(tiny_dir: str) -> None:
    """TP2 and DP2+EP on the tiny model (reference ops) and on the demo model (device path: FP8 linears and
    fused FP4 experts of the slices); DP2+EP in bfloat16 is bit-exact (idle steps included)."""
    demo = str(demo_model_dir())
    _world(2, [(tiny_dir, torch.float32, False, TP2, False), (tiny_dir, torch.float32, False, DP2_EP, False),
               (tiny_dir, torch.bfloat16, False, DP2_EP, True),
               (demo, torch.float32, True, TP2, False), (demo, torch.float32, True, DP2_EP, False)])


def test_four_ranks(tiny_dir: str) -> None:
    """TP2 x DP2 with expert parallelism over all four ranks (tiny and demo), and without (tiny)."""
    demo = str(demo_model_dir())
    _world(4, [(tiny_dir, torch.float32, False, TP2_DP2_EP, False), (tiny_dir, torch.float32, False, DP2_TP2, False),
               (demo, torch.float32, False, TP2_DP2_EP, False)])
