"""The indexer's top-k of every sequence at once (``select_lists``, the device build's) equals
``Indexer.select`` run on each sequence alone (the plain model's and the CPU engine's), in float32: the same
chosen entries per query and the same candidate mask, for tiny random configs (``tests/oracle/v41.py``'s
schedule: a ratio-2 source, the ratio-1 candidate source and a re-indexing layer after it) and steps of
several sequences of different lengths: one with no entries, sequences past the candidate blocks' reach (the
restriction bites), chunked steps of many query rows, decode rows; queries in several parts, gathered per
query or (runs of many rows) scored against their sequence's keys at once."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from deepinfer.config.v41 import V41Config
from deepinfer.model.v41.attention import Indexer
from deepinfer.model.v41.cache import LayerCache
from deepinfer.model.v41.context import SharedKV, StepContext
from deepinfer.model.v41.rope import angles
from deepinfer.model.v41.select_lists import EntryLists, select_lists
from tests.oracle.v41 import checkpoint_config, tiny_text_config

# (index_topk, candidate_topk_blocks, candidate_block_size, index_n_heads): the tiny schedule's defaults, a
# top-k wider than most sequences, one candidate block of 4. At least 8 index heads: a score is exactly 0 when
# every head's dot product is negative (1 in 16 with 4 heads), and blocks tied at 0 at the cut are a tie the
# two top-k calls may break differently (``select_lists``: ties are the implementation's).
CONFIGS = [(8, 3, 8, 16), (40, 2, 8, 8), (5, 1, 4, 8)]
SOURCE_R2, CANDIDATES, REINDEX = 2, 5, 7  # the schedule's ratio-2 source, candidate source, re-indexing layer


def _config(topk: int, blocks: int, block: int, heads: int) -> V41Config:
    text = tiny_text_config(index_topk=topk, candidate_topk_blocks=blocks, candidate_block_size=block,
                            index_n_heads=heads, engram_compressed_vocab_size=50)
    return V41Config.from_dict(checkpoint_config(text))


def _indexer(cfg: V41Config, layer: int, g: torch.Generator) -> Indexer:
    ix = Indexer(cfg, layer, torch.float32)
    with torch.no_grad():
        for p in ix.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return ix


def _runs(rng: random.Random, ratio: int) -> list[tuple[int, int]]:
    """(first, end) per sequence: decode rows, chunks of many rows, one with no entries (ratio 2), ends past
    the candidate blocks' reach."""
    runs = [(e - 1, e) for e in rng.sample(range(2, 70), 3)]  # decode rows
    runs += [(a, a + rng.randrange(2, 12)) for a in rng.sample(range(0, 60), 3)]  # prefill chunks
    runs.append((0, 1))  # a first token: no entry at ratio 2
    rng.shuffle(runs)
    return runs


def _step(cfg: V41Config, runs: list[tuple[int, int]], ratio: int, g: torch.Generator):
    """A step's queries (x, qr, rope angles) and each sequence's random index keys, concatenated in run order."""
    t = sum(e - a for a, e in runs)
    x, qr = torch.randn(t, cfg.hidden_size, generator=g), torch.randn(t, cfg.q_lora_rank, generator=g)
    pos = torch.cat([torch.arange(a, e) for a, e in runs])
    keys = [torch.randn(e // ratio, cfg.index_head_dim, generator=g) for _, e in runs]
    return x, qr, pos, angles(cfg.compress_rope, pos), keys


def _per_sequence(indexers: list[Indexer], runs, ratio, x, qr, pos, ang, keys, cache_qdq):
    """``Indexer.select`` on each sequence alone, the layers in order: per layer, per run (top-k, candidates)."""
    out = [[] for _ in indexers]
    lo = 0
    for (a, e), k in zip(runs, keys):
        rows = slice(lo, lo + e - a)
        lo += e - a
        shared = SharedKV(LayerCache(entries=k, index_keys=k), ratio)
        ctx = StepContext(pos[rows], a, {}, None, cache_qdq)
        for i, ix in enumerate(indexers):
            ix.select(x[rows], qr[rows], ang[rows], ctx, shared)
            out[i].append((shared.topk, shared.candidates))
    return out


def _batched(indexers: list[Indexer], runs, ratio, x, qr, pos, ang, keys, cache_qdq, budget, shared_from):
    lists = EntryLists.of([a for a, _ in runs], [e for _, e in runs], ratio, x.device)
    out, candidates = [], None
    for ix in indexers:
        rows, candidates = select_lists(ix, x, qr, ang, cache_qdq, torch.cat(keys), lists, candidates, budget,
                                        shared_from)
        out.append((rows, candidates))
    return out


def _assert_same(runs, ratio: int, keys, topk: int, want, got) -> int:
    """Per query: the same chosen entries (as rows of the concatenated keys, ascending, -1 after them, at most
    its sequence's ``min(topk, width)``) and the same candidate mask (none past its sequence's entries).
    -> how many queries' candidate masks left a visible entry out."""
    rows, candidates = got
    assert rows.shape[1] == min(topk, max(k.shape[0] for k in keys))
    restricted, lo, base = 0, 0, 0
    for (a, e), k, (picked, cand) in zip(runs, keys, want):
        width = k.shape[0]
        assert picked.shape == (e - a, min(topk, width))
        for i in range(e - a):
            mine = rows[lo + i]
            chosen = mine[mine >= 0]
            assert torch.equal(chosen, chosen.sort().values) and bool((mine[len(chosen):] == -1).all())
            assert torch.equal(chosen - base, picked[i][picked[i] >= 0].sort().values), (a, e, i)
        if cand is not None:
            assert torch.equal(candidates[lo:lo + e - a, :width], cand), (a, e)
            assert not candidates[lo:lo + e - a, width:].any()
            visible = torch.arange(width) < (torch.arange(a, e) + 1).unsqueeze(-1) // ratio
            restricted += int((visible & ~cand).any(dim=-1).sum())
        lo, base = lo + e - a, base + width
    return restricted


@pytest.mark.parametrize("setting", CONFIGS)
@pytest.mark.parametrize("cache_qdq", [False, True])
def test_batched_selection_equals_the_per_sequence_selection(setting, cache_qdq) -> None:
    cfg = _config(*setting)
    g = torch.Generator().manual_seed(sum(setting) + cache_qdq)
    rng = random.Random(sum(setting))
    restricted = 0
    for ratio, layers in ((2, [SOURCE_R2]), (1, [CANDIDATES, REINDEX])):
        indexers = [_indexer(cfg, layer, g) for layer in layers]
        for trial in range(3):
            runs = _runs(rng, ratio)
            step = _step(cfg, runs, ratio, g)
            want = _per_sequence(indexers, runs, ratio, *step, cache_qdq)
            # Every query in one part, then a few per part; every row gathered, then runs of 4 rows or more
            # against their own keys (a prefill chunk's way), in parts too.
            for budget, shared_from in itertools.product((1 << 26, 3 * 70 * max(cfg.index_head_dim,
                                                                                cfg.index_n_heads)), (64, 4)):
                got = _batched(indexers, runs, ratio, *step, cache_qdq, budget, shared_from)
                for w, gt in zip(want, got):
                    restricted += _assert_same(runs, ratio, step[-1], cfg.index_topk, w, gt)
    assert restricted > 0, "the candidate blocks must leave visible entries out somewhere"


def test_steps_without_entries() -> None:
    """Every sequence a first token at ratio 2: no entries, no choice, an empty candidate mask."""
    cfg = _config(*CONFIGS[0])
    g = torch.Generator().manual_seed(0)
    runs = [(0, 1), (0, 1)]
    x, qr, pos, ang, keys = _step(cfg, runs, 2, g)
    lists = EntryLists.of([0, 0], [1, 1], 2, x.device)
    rows, candidates = select_lists(_indexer(cfg, SOURCE_R2, g), x, qr, ang, False, torch.cat(keys), lists)
    assert lists.width == 0 and rows.shape == (2, 0) and candidates is None
    rows, candidates = select_lists(_indexer(cfg, CANDIDATES, g), x, qr, ang, False, torch.cat(keys), lists)
    assert rows.shape == (2, 0) and candidates.shape == (2, 0)


def test_parts_cover_every_row_once_in_order() -> None:
    """Runs of ``shared_from`` rows or more (with entries) go against their own keys, the rest gathered; every
    part within the budget."""
    runs = [(0, 1), (10, 30), (40, 41), (50, 53), (5, 6), (0, 12)]
    lists = EntryLists.of([a for a, _ in runs], [e for _, e in runs], 2, torch.device("cpu"))
    assert lists.width == 26 and lists.counts.tolist() == [0, 15, 20, 26, 3, 6]
    parts = lists.parts(budget=60, shared_from=3)  # 60 // 26 = 2 gathered rows a part
    assert [(p.start, p.stop) for p, _ in parts] == [(0, 1), (1, 5), (5, 9), (9, 13), (13, 17), (17, 21),
                                                     (21, 22), (22, 24), (24, 25), (25, 26), (26, 36), (36, 38)]
    assert [run for _, run in parts] == [None] + [(0, 15)] * 5 + [None, (35, 26), (35, 26), None, (64, 6), (64, 6)]
    parts = lists.parts(budget=60, shared_from=21)
    assert [(p.start, p.stop, run) for p, run in parts] == [(a, min(a + 2, 38), None) for a in range(0, 38, 2)]
