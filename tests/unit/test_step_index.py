"""The batched (index-list) step path against the per-sequence reference path, on the CPU in fp32.

Both paths compute the same math with different op orders (batched gathers vs per-sequence tensors), so
logits agree to fp32 rounding (observed ~1e-7 relative; bound 1e-5). Steps mix sequences, chunked prefill
across CSA and HCA window ends, and decode; padding to fixed shapes (what CUDA graphs replay) must not
change any real row or any cache row a sequence owns.
"""

from __future__ import annotations

import copy

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.kv.spec import WINDOW, build_layout
from deepinfer.model.batch import ForwardBatch, SeqRun
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.fused import use_batched_path
from deepinfer.model.step_index import build_step_index
from deepinfer.runner.sequences import SequenceCache
from tests.oracle.hf import tiny_native_config
from tests.unit.test_sequence_state import _model

NATIVE = tiny_native_config(num_hidden_layers=4, compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=1,
                            index_topk=4)


def _pair() -> tuple[DeepseekV4, DeepseekV4]:
    ref = _model()
    batched = copy.deepcopy(ref)
    use_batched_path(batched)
    return ref, batched


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model: DeepseekV4, schedule, pad: dict | None = None) -> list[torch.Tensor]:
    cache = SequenceCache(build_layout(model.cfg, 128), 16, torch.float32)
    sids = [cache.new_sequence() for _ in range(3)]
    outs = []
    for step in schedule:
        new = {sids[i]: toks for i, toks in step.items()}
        ids, batch = cache.plan(new)
        if pad is None:
            streams = model(ids, batch, cache.storage)
        else:
            n = batch.num_tokens + pad["tokens"]
            index = build_step_index(batch, cache.storage, model.cfg.sliding_window, num_tokens=n,
                                     num_seqs=len(batch.runs) + pad["seqs"], max_len=pad["max_len"])
            ids = torch.cat([ids, torch.zeros(pad["tokens"], dtype=torch.long)])
            streams = model(ids, None, cache.storage, index)[: batch.num_tokens]
        outs.append(model.logits(streams))
        cache.commit(new)
    return outs


# Three sequences: staggered prompts in chunks that straddle CSA (m=4) and HCA (m=128) window ends, then
# joint decode steps past position 128 and 256 (HCA windows 0 and 1 close during decode for one of them).
SCHEDULE = [
    {0: _tokens(50, 1)},
    {0: _tokens(81, 2), 1: _tokens(7, 3)},
    {1: _tokens(120, 4), 2: _tokens(3, 5)},
    *[{0: [t], 1: [u], 2: [v]} for t, u, v in zip(_tokens(130, 6), _tokens(130, 7), _tokens(130, 8))],
]


def test_batched_path_matches_reference() -> None:
    ref, batched = _pair()
    for a, b in zip(_run(ref, SCHEDULE), _run(batched, SCHEDULE)):
        assert torch.isfinite(b).all()
        assert (a - b).norm() <= 1e-5 * a.norm(), (a - b).abs().max()


def test_padding_to_fixed_shapes_changes_nothing() -> None:
    _, batched = _pair()
    plain = _run(batched, SCHEDULE[:6])
    padded = _run(batched, SCHEDULE[:6], pad={"tokens": 5, "seqs": 2, "max_len": 900})
    for a, b in zip(plain, padded):
        assert (a - b).norm() <= 1e-6 * a.norm()


def test_released_window_block_is_an_error_not_garbage() -> None:
    cfg = ModelConfig.from_dict(NATIVE)
    cache = SequenceCache(build_layout(cfg, 128), 4, torch.float32)
    tables = {p: (0, 1) for p in ("history", "window", "state")}
    tables[WINDOW] = (-1, 1)  # block 0 released, but position 200's window reaches back to 73
    batch = ForwardBatch((SeqRun(0, 1, 200, tables),))
    with pytest.raises(IndexError, match="window"):
        build_step_index(batch, cache.storage, cfg.sliding_window)


def test_graph_buckets_cover_every_batch_up_to_max_num_seqs() -> None:
    from deepinfer.runner.cuda_graphs import default_sizes

    for max_seqs in (1, 7, 64, 100, 256, 512):
        sizes = default_sizes(max_seqs)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_seqs
        # Padding waste stays bounded: the bucket for b is at most ~2x b for small b, +64 beyond 256.
        for b in range(1, max_seqs + 1):
            bucket = next(s for s in sizes if s >= b)
            assert bucket <= max(2 * b, b + 64)
