"""V4.1's encoder-side replay of prefix hits (spec §3.2): the cache manager's hit and the plain model's reference.

  * the layout of ``v41_prefix_replay="v41"``: the token ids Engram reads live in the history pool, a boundary
    needs no window or state block (nothing of the tail pools is retained for hits);
  * the manager: a hit at H keeps the history blocks only, starts at H - W with fresh window/state blocks from
    the one holding H - W, names no window/state block (they are never read by a hit), adopts no H <= W, and
    refuses to roll a replayed request back below H - W;
  * the plain model's ``take_prefix_hit`` (what the engine is checked against in
    ``tests/e2e/test_v41_prefix_replay_engine.py``): the cached entries and index keys stay bitwise as first
    computed, the entries past H are appended, any chunking of the replay gives the same logits (the window
    bound holds for every replay step), layer 0's window rows are recomputed bitwise (its input is the
    embedding) while the replay changes the outputs (the truncated window reaches the later layers).

Measured on the seed-1 tiny random checkpoints (last row's logits, replayed hit vs cold run, max |logit| ~4.5):
W = 16, H = 256: 4 tokens past H 2.95 (KL 0.27, argmax flips), 44 past 0.40 (KL 6e-3); W = 128, H = 256: 1.17 and
1.24 (KL 0.04-0.05); H = 512, 8 past: 1.84 (KL 0.13). Far more than the decoder replay moves them: the replay's
first rows see a window of one position in every layer. (Random weights: the released model's error is not
measured here.)
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from deepinfer.config.v41 import V41Config
from deepinfer.kv.block_budget import retained_tail_blocks, tail_blocks_per_boundary
from deepinfer.kv.manager import FRESH, RELEASED, CacheManager
from deepinfer.kv.prefix_hash import BlockHasher, CacheNamespace
from deepinfer.kv.spec import HISTORY, POOLS, STATE, WINDOW
from deepinfer.kv.spec_v41 import ENGRAM_KEY, build_v41_layout
from deepinfer.model.v41.loader import load_v41_model
from tests.e2e.v41_tiny import write_tiny_v41

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
BS = 128


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    path = write_tiny_v41(tmp_path_factory.mktemp("prefix_replay"), seed=1)  # window 16
    model, _ = load_v41_model(path, torch.float32, cache_qdq=False)
    return V41Config.from_model_dir(path), model


def test_layout_keeps_the_token_history(tiny) -> None:
    cfg, _ = tiny
    exact, replay = build_v41_layout(cfg, BS), build_v41_layout(cfg, BS, prefix_replay="v41")
    assert exact.prefix_replay == 0 and exact.layer(ENGRAM_KEY).tensor("token_ids").pool == WINDOW
    assert replay.prefix_replay == cfg.sliding_window == 16
    assert replay.layer(ENGRAM_KEY).tensor("token_ids").pool == HISTORY
    assert [s.tensors for s in replay.layers if s.key != ENGRAM_KEY] == \
        [s.tensors for s in exact.layers if s.key != ENGRAM_KEY]
    assert tail_blocks_per_boundary(exact, WINDOW) == 1
    assert all(tail_blocks_per_boundary(replay, p) == 0 for p in (WINDOW, STATE))
    assert retained_tail_blocks(replay, 1 << 30, 4) == {WINDOW: 0, STATE: 0}
    with pytest.raises(ValueError, match=r"^v41_prefix_replay: 'on' is not a prefix replay mode; allowed: exact, v41"):
        build_v41_layout(cfg, BS, prefix_replay="on")


def _hashes(n_blocks: int, seed: int = 0) -> tuple[bytes, ...]:
    rng = random.Random(seed)
    tokens = [rng.randrange(4096) for _ in range(n_blocks * BS)]
    return BlockHasher(CacheNamespace(b"m", BS, "float32", "cpu")).chain(tokens)


def test_manager_takes_hits_from_the_history(tiny) -> None:
    cfg, _ = tiny
    layout = build_v41_layout(cfg, BS, prefix_replay="v41")
    cache = CacheManager(layout, {p: 8 for p in POOLS})
    hashes = _hashes(2)
    cache.allocate("a", 300)
    cache.commit("a", 300, hashes)
    cache.free("a")
    cached = {p: n for p, n in cache.num_cached_blocks().items()}
    assert cached == {HISTORY: 2, WINDOW: 0, STATE: 0}  # window/state blocks went back free
    hit = cache.match_prefix(hashes, 299)
    w = cfg.sliding_window
    assert (hit.num_tokens, hit.replay, hit.start) == (256, w, 256 - w)
    assert hit.tables[WINDOW] == hit.tables[STATE] == (RELEASED, FRESH)  # H - W = 240 lies in block 1
    assert len(hit.tables[HISTORY]) == 2 and not hit.copies and not hit.loads
    cache.admit("b", hit, 300 - hit.start)
    cache.check_integrity()
    assert cache.length("b") == 240 and cache.block_tables("b")[WINDOW][0] == RELEASED
    with pytest.raises(ValueError, match=r"truncate\('b', 200\): the request's window rows start at 240"):
        cache.truncate("b", 200)
    cache.commit("b", 300, _hashes(2))
    cache.truncate("b", 280)  # a rollback past the replay is fine
    cache.check_integrity()
    # Hits no longer than the window are not adopted (here a window of a whole block).
    wide = CacheManager(dataclasses.replace(layout, prefix_replay=BS), {p: 8 for p in POOLS})
    wide.allocate("a", 300)
    wide.commit("a", 300, hashes)
    assert wide.match_prefix(hashes[:1], 200) is None
    assert wide.match_prefix(hashes, 299).start == 256 - BS


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    rng = random.Random(seed)
    return torch.tensor([rng.randrange(3, 4096) for _ in range(n)])


def _replayed(model, ids: torch.Tensor, boundary: int, chunks: list[int]):
    """The last row's logits of ``ids`` continued after a hit at ``boundary`` (its replay fed in ``chunks``), and
    the cache before (a cold prefill of [0, boundary)) and after."""
    cache = model.new_cache()
    model(ids[:boundary], cache)
    cold = [(lc.entries, lc.index_keys, lc.window) for lc in cache.layers]
    model.take_prefix_hit(cache, boundary)
    lo = boundary - model.cfg.sliding_window
    for n in chunks + [ids.numel() - lo - sum(chunks)]:
        logits = model(ids[lo : lo + n], cache)
        lo += n
    return logits[-1], cold, cache


def test_plain_replay_keeps_the_global_kv_and_bounds_the_window(tiny) -> None:
    cfg, model = tiny
    ids, h, w = _ids(200), 128, cfg.sliding_window
    logits, cold, cache = _replayed(model, ids, h, [])
    for layer, (lc, (entries, keys, window)) in enumerate(zip(cache.layers, cold)):
        ratio = cfg.role(layer).ratio
        if entries is not None:  # a KV source: the cached rows bitwise, the rest appended
            assert lc.entries.shape[0] == 200 // ratio and torch.equal(lc.entries[: h // ratio], entries)
            assert torch.equal(lc.index_keys[: h // ratio], keys)
        if layer == 0:  # the embedding in, so the replayed window rows equal the cold ones
            assert torch.equal(lc.window[h - w : h], window[h - w : h])
    assert not torch.equal(cache.layers[2].window[h - w : h], cold[2][2][h - w : h])
    # The window bound holds for every step of a replay fed in pieces (within rounding: other GEMM shapes).
    for chunks in ([1, 5], [3, 13, 2], [16]):
        assert (_replayed(model, ids, h, chunks)[0] - logits).abs().max() < 1e-5, chunks
    # And the replay is not the cold continuation: the truncated window reaches the later layers.
    assert (model(ids)[-1] - logits).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"^boundary: a replay of 16 positions needs a cached boundary in \(16, 200\]"):
        model.take_prefix_hit(cache, 16)
