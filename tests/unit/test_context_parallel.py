"""Context parallelism's parts (``model/parallel/context.py``): the zigzag split and merge, its causal balance,
the config's checks, and the share path's attention over local pools against the batched path in one
process (a CP group of one: the collectives are identities, everything else is what a CP rank runs). The
multi-process worlds: tests/e2e/test_context_parallel_engine.py."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from deepinfer.assets import demo_model_dir
from deepinfer.distributed.config import ParallelConfig
from deepinfer.kv.spec import build_layout
from deepinfer.model.loader import load_model
from deepinfer.model.parallel.context import (ContextShare, contiguous_split, forward_with_share, zigzag_merge,
                                              zigzag_pieces, zigzag_split)
from deepinfer.model.parallel.context_history import GrowingRows, HistoryReplica, HistoryReplicas
from deepinfer.sched.plan import SeqWork, StepPlan
from deepinfer.model.step_index import build_step_index
from deepinfer.runner.sequences import SequenceCache


def _cases():
    rng = random.Random(3)
    return [(rng.randrange(0, 3000), cp) for cp in range(1, 9) for _ in range(12)] + [(0, 3), (5, 4), (16, 8)]


@pytest.mark.parametrize("length,cp", _cases())
def test_zigzag_split_is_a_balanced_partition(length: int, cp: int) -> None:
    splits = zigzag_split(length, cp)
    assert len(splits) == cp
    together = np.concatenate(splits)
    assert sorted(together.tolist()) == list(range(length))  # every offset exactly once
    for s in splits:
        assert np.all(np.diff(s) > 0)  # ascending within a rank
    sizes = [len(s) for s in splits]
    assert max(sizes) - min(sizes) <= 1
    pieces = zigzag_pieces(length, cp)
    assert [b - a for a, b in pieces] == sorted((b - a for a, b in pieces), reverse=True)
    for r, s in enumerate(splits):  # rank r: pieces r and 2cp-1-r
        a, b = pieces[r], pieces[2 * cp - 1 - r]
        assert s.tolist() == list(range(*a)) + list(range(*b))


@pytest.mark.parametrize("length,cp", _cases())
def test_zigzag_merge_inverts_the_gather(length: int, cp: int) -> None:
    g = torch.Generator().manual_seed(length * 10 + cp)
    chunk = torch.randn(length, 3, generator=g)
    splits = zigzag_split(length, cp)
    gathered = torch.cat([chunk[torch.from_numpy(s)] for s in splits])  # all_gather_rows' rank order
    assert torch.equal(zigzag_merge(gathered, splits), chunk)
    with pytest.raises(ValueError, match="zigzag_merge"):
        zigzag_merge(gathered[:-1] if length else torch.zeros(1, 3), splits)


@pytest.mark.parametrize("cp", [2, 3, 4, 8])
def test_zigzag_balances_causal_work(cp: int) -> None:
    """Per-rank causal work (keys seen by its queries: first_pos + offset + 1) of a chunk: the zigzag
    spread is at most two queries' work (ranks' token counts differ by one at most), the contiguous split's
    grows with the chunk squared."""
    length = 4096
    for first in (0, 8192):
        def work(splits):
            return [int((first + s + 1).sum()) for s in splits]
        zz, cont = work(zigzag_split(length, cp)), work(contiguous_split(length, cp))
        assert max(zz) - min(zz) <= 2 * (first + length)
        assert max(cont) - min(cont) >= (length // cp) ** 2 * (cp - 1) - length


def test_context_parallel_config_errors() -> None:
    with pytest.raises(ValueError, match=r"context_parallel_size: 3 does not divide data_parallel_size \(4\).*"
                                         r"allowed: 1, 2, 4"):
        ParallelConfig(data_parallel_size=4, context_parallel_size=3)
    with pytest.raises(ValueError, match="context_parallel_size: must be a positive integer"):
        ParallelConfig(context_parallel_size=0)
    with pytest.raises(ValueError, match="context_parallel_min_tokens: must be a positive integer"):
        ParallelConfig(data_parallel_size=2, context_parallel_size=2, context_parallel_min_tokens=-5)
    c = ParallelConfig(data_parallel_size=4, context_parallel_size=4, context_parallel_min_tokens=3)
    assert c.world_size == 4 and c.cp_min_chunk == 8  # one token per zigzag piece at least


def test_engine_args_reach_the_parallel_config() -> None:
    from deepinfer.config.engine import EngineArgs, EngineConfig

    cfg = EngineConfig.create(EngineArgs(model=str(demo_model_dir()), device="cpu", data_parallel_size=2,
                                         context_parallel_size=2, context_parallel_min_tokens=64))
    assert (cfg.parallel.context_parallel_size, cfg.parallel.context_parallel_min_tokens) == (2, 64)
    with pytest.raises(ValueError, match="context_parallel_size: 2 does not divide data_parallel_size"):
        EngineConfig.create(EngineArgs(model=str(demo_model_dir()), device="cpu", context_parallel_size=2))
    # A threshold no chunk can reach (the step budget caps a chunk): refused, not a CP group that never splits.
    with pytest.raises(ValueError, match=r"context_parallel_min_tokens: 4096 exceeds max_num_batched_tokens \(2048\)"):
        EngineConfig.create(EngineArgs(model=str(demo_model_dir()), device="cpu", data_parallel_size=2,
                                       context_parallel_size=2, context_parallel_min_tokens=4096,
                                       max_num_batched_tokens=2048))


def test_share_path_equals_the_batched_path() -> None:
    """A prompt prefilled in chunks by the share path (beside another sequence's tokens, which take the batched
    path in the same layers) gives the streams and the cache rows of the plain batched steps: window rows
    before the chunk, entries closed by earlier chunks, CSA overlaps across chunk boundaries."""
    model = load_model(str(demo_model_dir()), dtype=torch.float32, progress=False)
    layout = build_layout(model.cfg, 128)
    rng = random.Random(4)
    long_ids = [rng.randrange(3, 4096) for _ in range(260)]
    other_ids = [rng.randrange(3, 4096) for _ in range(40)]
    chunks = [(0, 90), (90, 200), (200, 260)]  # the 2nd and 3rd read window rows and entries of earlier chunks
    plain, split = SequenceCache(layout, 8, torch.float32), SequenceCache(layout, 8, torch.float32)
    for cache in (plain, split):
        assert (cache.new_sequence(), cache.new_sequence()) == (0, 1)
    window = model.cfg.sliding_window
    replica = HistoryReplica(0, "s0")  # the owner's: positions only; its sends are split as the helpers expect
    for step, (a, b) in enumerate(chunks):
        chunk = long_ids[a:b]
        mine = {1: other_ids[step * 10 : step * 10 + 10]}
        ids, batch = plain.plan({**mine, 0: chunk})
        want = model(ids, batch, plain.storage)
        plain.commit({**mine, 0: chunk})

        own_ids, own_batch = split.plan(mine)
        chunk_ids, chunk_batch = split.plan({0: chunk})
        share = ContextShare(None, 0, 1, 0, True, "s0", a, tuple(chunk), replica)
        own_streams, chunk_streams = forward_with_share(
            model, split.storage, share, own_ids, build_step_index(own_batch, split.storage, window),
            build_step_index(chunk_batch, split.storage, window))
        assert replica.pos == b and replica.nbytes == 0
        split.commit({**mine, 0: chunk})
        got = torch.cat([own_streams, chunk_streams])
        assert (got - want).abs().max().item() < 1e-5, f"chunk {step}"
        assert torch.equal(model.logits(got).argmax(-1), model.logits(want).argmax(-1))
    for key, t in plain.storage.tensors.items():
        assert (split.storage.tensors[key] - t).abs().max().item() < 1e-5, key


def test_growing_rows_keep_a_zero_row_past_the_last() -> None:
    rows, like = GrowingRows(), torch.ones(5, 3)
    assert torch.equal(rows.padded(like), torch.zeros(1, 3))
    want = []
    for n in (2, 0, 5, 1, 9):
        block = torch.arange(n * 3, dtype=torch.float32).view(n, 3) + len(want)
        rows.append(block)
        want += block.tolist()
        got = rows.padded(like)
        assert got[:-1].tolist() == want and torch.equal(got[-1], torch.zeros(3)) and rows.count == len(want)
    assert rows.nbytes <= 1.25 * (len(want) + 1) * 3 * 4  # geometric growth: amortized O(1) copies per row


def _plan(**work) -> StepPlan:
    return StepPlan(work=tuple(SeqWork(seq_id, 0, (1,) * 8, num_samples=s) for seq_id, s in work.items()))


def test_history_replicas_rules() -> None:
    """One replica per owner; a chunk past its end is a catch-up, one before it starts over; dropped when its
    sequence leaves the owner's batch or draws, and replaced by another sequence of the same owner."""
    h = HistoryReplicas()
    a = h.track(0, "a", 0)
    a.pos = 96
    a.window["layers.0"] = torch.ones(127, 4)
    assert h.track(0, "a", 96) is a and h.chunks_from_replica == 1 and h.catch_ups == 0
    assert h.track(0, "a", 150) is a and h.catch_ups == 1 and a.pos == 96  # the chunk sends 96..149
    b = h.track(1, "b", 0)
    assert len(h) == 2 and h.held("b") is b and h.nbytes == 127 * 4 * 4
    assert h.track(0, "a", 10) is a and a.pos == 0 and not a.window  # recomputed positions: start over
    h.finish_step([_plan(a=0), _plan(b=0)])
    assert len(h) == 2
    h.retire([StepPlan(left=("b",)), StepPlan(left=("a",))])  # "a" left rank 1's batch: not rank 0's "a"
    assert len(h) == 2
    h.retire([StepPlan(), StepPlan(left=("b",))])
    assert h.held("b") is None and h.dropped_on_leave == 1
    h.finish_step([_plan(a=1), StepPlan()])  # "a" drew: its prefill is over
    assert len(h) == 0 and h.nbytes == 0
    c = h.track(0, "c", 0)
    assert h.track(0, "d", 0) is not c and h.held("c") is None  # another sequence of the same owner


def test_cp_plan_counts_the_history_per_chunk_and_the_replica() -> None:
    """``deepinfer info``'s CP plan (``engine/cp_plan.py``) on the demo model's shapes (head 64, index keys 32,
    CSA every 4 positions, HCA every 16): a chunk from the replica receives the entries and index keys it closes;
    a catch-up at most the 127 window rows and every entry; the replica holds every layer's history."""
    from deepinfer.config.model import ModelConfig
    from deepinfer.engine.memory_plan import Deployment, activation_bytes_estimate
    from deepinfer.engine.cp_plan import plan_context_parallel

    cfg = ModelConfig.from_model_dir(demo_model_dir())
    d = Deployment(data_parallel_size=4, context_parallel_size=4, max_num_batched_tokens=1024, max_model_len=16384,
                   context_parallel_min_tokens=512)
    cp = plan_context_parallel(cfg, d.parallel, 1024, 16384)
    assert cp.history_bytes == 1024 // 4 * (64 + 32) * 2
    assert cp.catch_up_bytes == (127 * 64 + (16384 // 4 + 1) * (64 + 32)) * 2
    window = 127 * 64 * 6
    assert cp.replica_bytes == (window + 2 * (16384 // 4 + 1) * 96 + 2 * (16384 // 16 + 1) * 64) * 2
    assert cp.as_dict()["history_replica_mib"]["sequences_per_rank"] == 3
    longer = plan_context_parallel(cfg, d.parallel, 1024, 32768)
    assert longer.history_bytes == cp.history_bytes and longer.replica_bytes > cp.replica_bytes  # per chunk: flat
    grown = activation_bytes_estimate(cfg, dataclasses.replace(d, max_model_len=32768), longer)
    assert grown - activation_bytes_estimate(cfg, d, cp) == (
        3 * longer.replica_bytes * 5 // 4 - 3 * cp.replica_bytes * 5 // 4 + longer.catch_up_bytes - cp.catch_up_bytes)
