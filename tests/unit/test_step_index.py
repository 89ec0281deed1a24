"""The batched (index-list) step path against the per-sequence oracle (tests/oracle/per_sequence.py), in fp32.

Both paths compute the same math with different op orders (batched gathers vs per-sequence tensors), so
logits agree to fp32 rounding (observed ~1e-7 relative; bound 1e-5). Steps mix sequences, chunked prefill
across CSA and HCA window ends, and decode; padding to fixed shapes (what CUDA graphs replay) must not
change any real row or any cache row a sequence owns. The host index itself (one flat buffer, vectorized
checks, a graph bucket's StepBuffer that rewrites only changed table rows) must equal a plain per-run
build field by field, and raise the same error for a bad batch.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from deepinfer.config import ModelConfig
from deepinfer.kv.spec import HISTORY, STATE, WINDOW, build_layout
from deepinfer.model.batch import ForwardBatch, SeqRun
from deepinfer.model.deepseek_v4 import DeepseekV4
from deepinfer.model.fused import fuse_projections
from deepinfer.model.step_index import StepBuffer, build_step_index
from deepinfer.runner.sequences import SequenceCache
from tests.oracle.hf import tiny_native_config
from tests.oracle.per_sequence import per_sequence
from tests.unit.test_sequence_state import _model

NATIVE = tiny_native_config(num_hidden_layers=4, compress_ratios=[0, 4, 128, 4, 0], num_hash_layers=1,
                            index_topk=4)


def _pair() -> tuple[DeepseekV4, DeepseekV4]:
    """The model as built (projections side by side) and a copy with its projections stacked (one GEMM)."""
    plain = _model()
    stacked = copy.deepcopy(plain)
    fuse_projections(stacked)
    return plain, stacked


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


def test_batched_path_matches_the_per_sequence_oracle() -> None:
    model, stacked = _pair()
    with per_sequence():
        want = _run(model, SCHEDULE)
    for got in (_run(model, SCHEDULE), _run(stacked, SCHEDULE)):
        for a, b in zip(want, got):
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


# ------------------------------------------------------------------------- host index vs the plain build
def _reference_index(batch: ForwardBatch, storage, window: int, num_tokens=None, num_seqs=None,
                     max_len=None) -> dict:
    """The host index as plain per-run code builds it (fresh arrays per field): what build_step_index and
    StepBuffer must reproduce bit for bit, including which error a bad batch raises."""
    layout, runs = storage.layout, batch.runs
    bs, state_tail = layout.block_size, layout.tail(STATE)
    t_real, b_real = batch.num_tokens, len(runs)
    t_all, b_all = num_tokens or t_real, num_seqs or b_real
    if t_all < t_real or b_all < b_real:
        raise ValueError(f"num_tokens/num_seqs: {t_all}/{b_all} is less than the batch's {t_real}/{b_real}")
    if t_all > t_real and b_all == b_real:
        raise ValueError("num_seqs: padding tokens need a padding sequence (num_seqs > the batch's sequences)")
    for i, r in enumerate(runs):
        for pool, back, what in ((WINDOW, window - 1, "window keys"), (STATE, state_tail, "compressor state")):
            if pool == STATE and not state_tail:
                continue
            table = r.block_tables[pool]
            lo, hi = max(0, r.first_pos - back) // bs, (r.end_pos - 1) // bs
            if hi >= len(table) or min(table[lo : hi + 1]) < 0:
                raise IndexError(f"runs[{i}] {what}: a needed block of pool {pool!r} is missing or was released")
    end_pos = [r.end_pos for r in runs] + [0] * (b_all - b_real)
    span = max_len or max(max(end_pos, default=0), 1)
    if max(end_pos, default=0) > span:
        raise ValueError(f"max_len: {span} is shorter than a sequence of the batch ({max(end_pos)})")
    width = -(-span // bs)
    out = {"token_seq": [i for i, r in enumerate(runs) for _ in range(r.length)] + [b_all - 1] * (t_all - t_real),
           "positions": [p for r in runs for p in range(r.first_pos, r.end_pos)] + [0] * (t_all - t_real),
           "seq_end": end_pos}
    for pool, name in ((WINDOW, "window_table"), (STATE, "state_table"), (HISTORY, "history_table")):
        rows = [list(r.block_tables[pool][:width]) for r in runs] + [[]] * (b_all - b_real)
        out[name] = [row + [-1] * (width - len(row)) for row in rows]
    return {**{k: torch.tensor(v, dtype=torch.int64).reshape(-1, width) if k.endswith("table")
               else torch.tensor(v, dtype=torch.int64) for k, v in out.items()}, "span": span}


def _outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (ValueError, IndexError) as e:
        return type(e), str(e)


def _assert_same(ref: dict, tensors: dict[str, torch.Tensor]) -> None:
    for name, want in ref.items():
        if name != "span":
            got = tensors[name]
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want), name


def _random_tables(rng: random.Random, end_pos: int, bs: int) -> dict:
    """Tables covering ``end_pos`` (sometimes a block short or long, sometimes with released blocks or as
    lists instead of tuples): valid batches and each kind of bad one."""
    nb = -(-end_pos // bs) + rng.choice([0] * 12 + [1, -1])
    tables = {}
    for pool in (WINDOW, STATE, HISTORY):
        t = [rng.randrange(60) for _ in range(max(nb, 0))]
        if pool != HISTORY and len(t) > 2 and rng.random() < 0.2:
            k = rng.randint(1, len(t) - 1)
            t[:k] = [-1] * k
        tables[pool] = tuple(t) if rng.random() < 0.9 else t
    return tables


def _storage() -> tuple:
    cfg = ModelConfig.from_dict(NATIVE)
    return SequenceCache(build_layout(cfg, 128), 4, torch.float32, "meta").storage, cfg.sliding_window


def test_flat_index_matches_the_plain_build_on_random_batches() -> None:
    storage, window = _storage()
    rng = random.Random(0)
    outcomes = {"ok": 0, "err": 0}
    for _ in range(600):
        runs, offset = [], 0
        for _ in range(rng.choice([0, 1, 2, 3, 9, 12])):  # both sides of the small-batch paths
            length = rng.choice([1, 1, 1, 2, 7, 130])
            first = rng.randrange(1200)
            runs.append(SeqRun(offset, length, first, _random_tables(rng, first + length, 128)))
            offset += length
        batch = ForwardBatch(tuple(runs))
        shapes = {}
        if rng.random() < 0.6:  # graph-style padding, sometimes with tables cut to a short max_len
            shapes = {"num_tokens": offset + rng.randrange(-1, 3), "num_seqs": len(runs) + rng.randrange(3),
                      "max_len": rng.choice([None, 1024, 2048])}
        want = _outcome(_reference_index, batch, storage, window, **shapes)
        got = _outcome(build_step_index, batch, storage, window, **shapes)
        if isinstance(want, tuple):
            assert got == want
            outcomes["err"] += 1
            continue
        outcomes["ok"] += 1
        assert got.span == want["span"]
        # One buffer, each tensor as aligned (512 bytes) as a separate allocation would be.
        assert len({getattr(got, n).untyped_storage().data_ptr() for n in want if n != "span"}) == 1
        assert all(getattr(got, n).storage_offset() % 64 == 0 for n in want if n != "span")
        assert got.to("cpu") is got  # already there: nothing to copy or re-view
        for index in (got, got.to("cpu")):
            _assert_same(want, {n: getattr(index, n) for n in want if n != "span"})
        moved = got.to("meta")  # one copy of the shared buffer, re-viewed: same shapes and strides
        for name in want:
            if name != "span":
                assert getattr(moved, name).shape == getattr(got, name).shape
                assert getattr(moved, name).stride() == getattr(got, name).stride()
    assert min(outcomes.values()) > 100, outcomes


def test_step_buffer_rewrites_exactly_what_changed() -> None:
    """A StepBuffer reused step after step (sequences come and go, tables grow, get released, are lists
    changed in place, or are bad) holds what a fresh build of each step holds."""
    storage, window = _storage()
    rng = random.Random(1)
    outcomes = {"ok": 0, "err": 0}
    for tokens, seqs, max_len in ((4, 4, 2048), (12, 12, 1024), (20, 16, 2048)):
        buffer = StepBuffer(tokens, seqs, max_len, 128)
        pool = [{"pos": rng.randrange(1500), "tables": None} for _ in range(24)]
        for _ in range(150):
            for s in pool:
                tables = s["tables"]
                if tables is None or min(map(len, tables.values())) * 128 <= s["pos"] or rng.random() < 0.03:
                    s["tables"] = _random_tables(rng, s["pos"] + 1, 128)
                elif isinstance(tables[WINDOW], list) and tables[WINDOW] and rng.random() < 0.5:
                    tables[WINDOW][-1] = rng.randrange(60)  # in place: the buffer must notice
            picked = rng.sample(pool, rng.randint(0, seqs - 1)) if rng.random() < 0.9 else pool[:seqs]
            runs = []
            for i, s in enumerate(picked):
                runs.append(SeqRun(i, 1, s["pos"], dict(s["tables"])))
                s["pos"] += rng.random() < 0.3
            batch = ForwardBatch(tuple(runs))
            want = _outcome(_reference_index, batch, storage, window, tokens, seqs, max_len)
            got = _outcome(buffer.write, batch, storage, window)
            if isinstance(want, tuple):
                assert got == want
                outcomes["err"] += 1
                continue
            outcomes["ok"] += 1
            _assert_same(want, buffer.layout.tensors(buffer.tensor))
    assert min(outcomes.values()) > 20, outcomes


def test_sequence_cache_hands_out_the_same_tables_until_they_grow() -> None:
    cfg = ModelConfig.from_dict(NATIVE)
    cache = SequenceCache(build_layout(cfg, 128), 8, torch.float32, "meta")
    sid = cache.new_sequence()
    _, first = cache.plan({sid: [5] * 127})
    cache.commit({sid: [5] * 127})
    _, second = cache.plan({sid: [5]})  # position 127: still block 0
    a, b = first.runs[0].block_tables, second.runs[0].block_tables
    assert a is not b and all(a[p] is b[p] for p in a)
    cache.commit({sid: [5]})
    _, third = cache.plan({sid: [5, 5]})  # positions 128, 129: a new block
    assert all(len(t) == 2 for t in third.runs[0].block_tables.values())
    assert {p: list(t) for p, t in third.runs[0].block_tables.items()} == cache._tables[sid]
