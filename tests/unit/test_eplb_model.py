"""Expert-parallel load balancing in a real 2-process gloo world (DP2 + EP, 2 redundant slots): a model whose
experts are re-placed mid-script computes what the single-process model computes, and the measured per-rank
load gets flatter.

The checkpoint's routed layers favour experts 0 and 1 (``skew_router``), both loaded on rank 0, so the
first rebalance (from the loads the ranks measured) must replicate them onto rank 1: weights cross ranks.
Exactness: in bfloat16 on the reference path (this CPU's bf16 GEMMs give a row the same result whatever
else is in the batch) the logits are bit-identical to the single-process model's, before and after the
re-placement; the fused FP4 layout (demo model, device path with the reference ops) is checked byte for
byte in its moved slots and with the tolerance the parallel tests use for float32.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from deepinfer.assets import demo_model_dir
from deepinfer.config.eplb import EplbConfig
from deepinfer.distributed.config import ParallelConfig
from deepinfer.distributed.world import WorldEnv, init_world
from deepinfer.kv.spec import build_layout
from deepinfer.model.device import prepare_for_device
from deepinfer.model.loader import load_model
from deepinfer.model.parallel.eplb import ExpertBalancer, slot_tensors
from deepinfer.model.parallel.placement import (layers_balancedness, rebalanced, slot_rank_loads, static_placement,
                                                transfer_plan)
from deepinfer.model.parallel.shard import empty_step, sharding_hook
from deepinfer.ops.table import REF
from deepinfer.runner.sequences import SequenceCache
from deepinfer.testing.make_checkpoint import PRESETS, write_random_checkpoint
from deepinfer.testing.skewed_router import skew_router
from deepinfer.testing.world import run_world
from tests.unit.test_parallel_model import _check, _reference, _script

DP2_EP = ParallelConfig(data_parallel_size=2, enable_expert_parallel=True)
REDUNDANT = 2
REBALANCE_AFTER = (0, 2)  # steps after which the experts are re-placed


def _rebalance(balancer: ExpertBalancer) -> list[list[int]]:
    """What the engine's driver does, with the loads summed by a collective: returns the slot loads measured
    under the placement being replaced."""
    window, slots = (torch.tensor(t) for t in balancer.report())
    dist.all_reduce(window)
    dist.all_reduce(slots)
    balancer.apply(tuple(rebalanced(w, old, REDUNDANT) for w, old in zip(window.tolist(), balancer.placements)))
    return slots.tolist()


def _rank(env: WorldEnv, jobs: list[tuple[str, torch.dtype, bool]]) -> list[dict]:
    results = []
    for model_dir, dtype, device_path in jobs:
        pctx = init_world(DP2_EP, "cpu", env, timeout_s=60)
        model = load_model(model_dir, dtype=dtype, progress=False, ops=REF if device_path else None,
                           shard_model=sharding_hook(pctx))
        balancer = ExpertBalancer(model, EplbConfig(num_redundant_experts=REDUNDANT, window_size=8))
        cache = SequenceCache(build_layout(model.cfg, 128), 8, model.dtype)
        sids: dict[int, int] = {}
        logits, measured, placements = [], [], []
        for i, script_step in enumerate(_script(model.cfg.vocab_size)):
            step = script_step[pctx.dp_rank]
            balancer.advance()
            if not step:
                empty_step(model)
                logits.append(None)
            else:
                for s in step:
                    sids.setdefault(s, cache.new_sequence())
                new = {sids[s]: t for s, t in step.items()}
                ids, batch = cache.plan(new)
                logits.append(model.logits(model(ids, batch, cache.storage)))
                cache.commit(new)
            if i in REBALANCE_AFTER:
                measured.append(_rebalance(balancer))
                placements.append(balancer.placements)
        slots = [{k: torch.stack(v).clone() for k, v in slot_tensors(moe).items()} for moe in balancer.layers]
        results.append(dict(logits=logits, measured=measured, placements=placements, slots=slots))
    return results


@pytest.fixture(scope="module")
def skewed_dir(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny_skewed")
    write_random_checkpoint(out, PRESETS["tiny"], seed=3)
    skew_router(out, experts=(0, 1), boost=4.0)
    return str(out)


def _expert_bytes(model, layer: int, expert: int, fused: bool) -> dict[str, torch.Tensor]:
    moe = model.layers[layer].ffn
    if fused:
        return {k: getattr(moe.routed, k)[expert] for k in ("w13", "s13", "w2", "s2")}
    return {w: getattr(moe.experts[expert], w).weight for w in ("w1", "w3", "w2")}


def test_rebalanced_world_equals_single_process(skewed_dir: str) -> None:
    jobs = [(skewed_dir, torch.bfloat16, False), (str(demo_model_dir()), torch.float32, True)]
    results = run_world(_rank, 2, (jobs,), timeout_s=150)
    for j, (model_dir, dtype, device_path) in enumerate(jobs):
        ref_model = load_model(model_dir, dtype=dtype, progress=False, keep_quantized=True)
        if device_path:
            prepare_for_device(ref_model, REF)
        ranks = [r[j] for r in results]
        # Every rank applied the same placements; the first one moved weights across ranks.
        assert ranks[0]["placements"] == ranks[1]["placements"]
        first = ranks[0]["placements"][0]
        n = ref_model.cfg.n_routed_experts
        assert any(t.src_rank != t.dst_rank for p in first for t in transfer_plan(static_placement(n, 2, REDUNDANT), p))
        # Each slot holds a byte copy of its logical expert, in the rank's own form.
        final = ranks[0]["placements"][-1]
        for layer, placement in enumerate(final):
            for rank, got in enumerate(ranks):
                for local, e in enumerate(placement.rank_slots(rank)):
                    for name, want in _expert_bytes(ref_model, layer, e, device_path).items():
                        assert torch.equal(got["slots"][layer][name][local].view(torch.uint8),
                                           want.contiguous().view(torch.uint8)), (layer, rank, local, name)
        ref = _reference(model_dir, dtype, device_path)
        for rank, got in enumerate(ranks):
            _check(got["logits"], ref, DP2_EP, exact=not device_path, rank=rank)
        if j == 0:  # the skewed router: the measured per-rank load is flatter after the rebalance
            before, after = ranks[0]["measured"]
            per_rank = lambda slots: [slot_rank_loads(s, 2) for s in slots[1:]]  # the bias-routed layers
            assert layers_balancedness(per_rank(before)) < 0.75 < layers_balancedness(per_rank(after))
