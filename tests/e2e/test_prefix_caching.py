"""Prefix caching end to end: a hit changes how much is computed, never what comes out.

A tiny random V4 checkpoint (fp32, SWA + CSA (m=4) + HCA (m=128) layers, 128-token window) on the CPU with
128-token blocks. Every test compares a cache-on engine with a cache-off engine fed the same requests.

Bitwise: with one request at a time and a step budget of one block, a request that hits at boundary P
computes positions >= P in exactly the chunks a cache-off prefill uses, and the rows before P were written
by the same chunks of an earlier request, so tokens *and* logprobs are equal bit for bit. Where a hit
covers rows that were computed by decode steps (multi-turn chats) or a batch is composed differently, the
CPU GEMMs round rows differently with the row count (up to ~1e-6 here), so there tokens are compared
exactly and logprobs to 1e-4, as the async-scheduling tests do; ``DEEPINFER_BATCH_INVARIANT`` is what
makes those bitwise too.
"""

from __future__ import annotations

import random

import pytest

from deepinfer import LLMEngine, SamplingParams
from deepinfer.assets import demo_model_dir
from tests.oracle.hf import build_hf, tiny_native_config

pytest.importorskip("transformers")

BS = 128
VOCAB = 512
NATIVE = tiny_native_config(vocab_size=VOCAB)  # layers: SWA, CSA (m=4), HCA (m=128)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v4")
    build_hf(NATIVE, seed=7).save_pretrained(path)
    return str(path)


def _engine(path: str | None, invariant: bool = False, **kw) -> LLMEngine:
    """``invariant``: the batch-invariant op table, so that rows are the same bits whichever chunk computes
    them (a bounded replay starts its chunk a few positions before the cache-off run's)."""
    args = dict(model=path, tokenizer=str(demo_model_dir()), device="cpu", dtype="float32", block_size=BS,
                max_num_seqs=8, max_num_batched_tokens=BS, max_model_len=1536, load_progress=False)
    args.update(kw)
    with pytest.MonkeyPatch.context() as mp:  # the mode is read once, when the engine's config is built
        mp.setenv("DEEPINFER_BATCH_INVARIANT", "1" if invariant else "0")
        engine = LLMEngine.from_engine_args(**args)
    assert engine.config.batch_invariant is invariant
    return engine


def _run(engine: LLMEngine, requests, params, arrive_after: int = 0) -> dict:
    """Outputs by request id. ``arrive_after``: the first request runs alone for that many steps before the
    others arrive (so that they can hit what it computed)."""
    done, step = {}, 0
    pending = list(requests)
    rid, prompt = pending.pop(0)
    engine.add_request(rid, prompt, params)
    while engine.has_unfinished_requests() or pending:
        if pending and step >= arrive_after:
            for rid, prompt in pending:
                engine.add_request(rid, prompt, params)
            pending = []
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.cache.check_integrity()
        step += 1
    return done


def _one_by_one(engine: LLMEngine, requests, params) -> dict:
    out = {}
    for rid, prompt in requests:
        out.update(_run(engine, [(rid, prompt)], params))
    return out


def _tokens(out) -> list[tuple[int, ...]]:
    return [c.token_ids for c in out.outputs]


def _logprob_values(out) -> list[list[tuple[int, float]]]:
    return [[sorted((t, lp.logprob) for t, lp in pos.items()) for pos in c.logprobs] for c in out.outputs]


def _assert_same(a, b, exact: bool) -> None:
    assert _tokens(a) == _tokens(b), a.request_id
    la, lb = _logprob_values(a), _logprob_values(b)
    if exact:
        assert la == lb, a.request_id
    else:
        for sa, sb in zip(la, lb):
            for pa, pb in zip(sa, sb):
                assert [t for t, _ in pa] == [t for t, _ in pb]
                assert max(abs(x - y) for (_, x), (_, y) in zip(pa, pb)) < 1e-4, a.request_id


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)


def test_hit_at_every_block_boundary_is_bitwise_equal(model_dir) -> None:
    base = _ids(random.Random(0), 1100)
    lengths = [127, 128, 129, 256, 257, 640, 1100]
    requests = [(f"L{n}", {"prompt_token_ids": base[:n]}) for n in lengths]
    on = _engine(model_dir)
    _run(on, [("base", {"prompt_token_ids": base})], GREEDY)
    hits = _one_by_one(on, requests, GREEDY)
    plain = _one_by_one(_engine(model_dir, enable_prefix_caching=False), requests, GREEDY)
    for n in lengths:
        # The longest boundary that leaves a token to compute.
        assert hits[f"L{n}"].num_cached_tokens == (n - 1) // BS * BS
        assert plain[f"L{n}"].num_cached_tokens == 0
        _assert_same(hits[f"L{n}"], plain[f"L{n}"], exact=True)
    assert on.scheduler.prefix_hits == sum((n - 1) // BS * BS for n in lengths)


def test_bounded_replay_rebuilds_the_state_tail(model_dir) -> None:
    """Without the boundary's cached compressor state a hit recomputes the 4 positions before the boundary
    (the CSA overlap) from the retained window KV, emitting no entry, and the output is unchanged."""
    base = _ids(random.Random(10), 700)
    on = _engine(model_dir)
    _run(on, [("base", {"prompt_token_ids": base})], GREEDY)
    assert on.cache.pools["state"].reset_cache() > 0  # keep history and window blocks, drop every state block
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    hit = _run(on, [("hit", {"prompt_token_ids": base[:600]})], params)["hit"]
    plain = _run(_engine(model_dir, enable_prefix_caching=False), [("p", {"prompt_token_ids": base[:600]})],
                 params)["p"]
    assert hit.num_cached_tokens == 512 - 4 and on.scheduler.prefix_replayed == 4
    _assert_same(hit, plain, exact=False)


def test_multi_turn_chat_reuses_earlier_turns(model_dir) -> None:
    rng = random.Random(1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2)
    on, off = _engine(model_dir), _engine(model_dir, enable_prefix_caching=False)
    history_on = _ids(rng, 150)
    history_off = list(history_on)
    computed = 0  # positions the previous turn computed (its last token was never fed back)
    for turn in range(3):
        a = _run(on, [(f"t{turn}", {"prompt_token_ids": history_on})], params)[f"t{turn}"]
        b = _run(off, [(f"t{turn}", {"prompt_token_ids": history_off})], params)[f"t{turn}"]
        _assert_same(a, b, exact=False)
        # Every full block of the previous turn is reused, the generated part included.
        assert a.num_cached_tokens == computed // BS * BS
        computed = len(history_on) + len(a.outputs[0].token_ids) - 1
        user = _ids(rng, 90)
        history_on = history_on + list(a.outputs[0].token_ids) + user
        history_off = history_off + list(b.outputs[0].token_ids) + user


def test_shared_system_prompt_batch_and_salts(model_dir) -> None:
    rng = random.Random(2)
    system = _ids(rng, 300)
    requests = [(f"r{i}", {"prompt_token_ids": system + _ids(rng, 20 + 30 * i)}) for i in range(5)]
    salted = [("s", {"prompt_token_ids": system + _ids(rng, 10), "cache_salt": "tenant-b"})]
    on, off = _engine(model_dir), _engine(model_dir, enable_prefix_caching=False)
    # The first request computes the shared blocks alone for three steps, then the others arrive together.
    hits = _run(on, requests, GREEDY, arrive_after=3)
    plain = _run(off, requests, GREEDY, arrive_after=3)
    for rid, _ in requests:
        _assert_same(hits[rid], plain[rid], exact=False)
    assert [hits[f"r{i}"].num_cached_tokens for i in range(5)] == [0, 256, 256, 256, 256]
    # Another tenant never sees those blocks; its own second request does.
    assert _run(on, salted, GREEDY)["s"].num_cached_tokens == 0
    again = _run(on, [("s2", {**salted[0][1]})], GREEDY)["s2"]
    assert again.num_cached_tokens == 256
    _assert_same(again, _run(off, salted, GREEDY)["s"], exact=False)
    with pytest.raises(ValueError, match="cache_salt"):
        on.add_request("bad", {"prompt_token_ids": system, "cache_salt": 3}, GREEDY)


def test_preemption_and_n_samples_share_prompts_exactly(model_dir) -> None:
    """A history pool of 5 blocks for 2 requests x 2 samples of ~380 tokens: sequences are preempted and
    re-admitted through the cache; seeded sampling with n=2 and prefix sharing must not change a token."""
    rng = random.Random(3)
    shared = _ids(rng, 260)
    requests = [(f"r{i}", {"prompt_token_ids": shared + _ids(rng, 110 + 10 * i)}) for i in range(2)]
    # Decoding crosses position 384: running sequences need blocks the full pool does not have.
    params = SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=16, ignore_eos=True, logprobs=1)
    on = _engine(model_dir, num_cache_blocks=5, max_num_batched_tokens=256)
    off = _engine(model_dir, num_cache_blocks=5, max_num_batched_tokens=256, enable_prefix_caching=False)
    hits = _run(on, requests, params, arrive_after=2)
    plain = _run(off, requests, params, arrive_after=2)
    for rid, _ in requests:
        _assert_same(hits[rid], plain[rid], exact=False)
    assert on.scheduler.num_preemptions > 0 and on.scheduler.prefix_hits > 0


def test_evicted_prefix_is_recomputed_exactly(model_dir) -> None:
    rng = random.Random(6)
    a, b = _ids(rng, 600), _ids(rng, 600)
    on = _engine(model_dir, num_cache_blocks=6)
    off = _engine(model_dir, num_cache_blocks=6, enable_prefix_caching=False)
    first = _run(on, [("a", {"prompt_token_ids": a})], GREEDY)["a"]
    _run(on, [("b", {"prompt_token_ids": b})], GREEDY)  # needs 5 of the 6 blocks: evicts most of a's
    again = _run(on, [("a2", {"prompt_token_ids": a})], GREEDY)["a2"]
    assert on.cache.pools["history"].num_evictions > 0
    assert again.num_cached_tokens < 512
    plain = _run(off, [("a", {"prompt_token_ids": a})], GREEDY)["a"]
    _assert_same(first, plain, exact=True)
    _assert_same(again, plain, exact=False)


def test_prompt_logprobs_requests_compute_everything(model_dir) -> None:
    base = _ids(random.Random(4), 300)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    on, off = _engine(model_dir), _engine(model_dir, enable_prefix_caching=False)
    _run(on, [("warm", {"prompt_token_ids": base})], GREEDY)
    a = _run(on, [("p", {"prompt_token_ids": base})], params)["p"]
    b = _run(off, [("p", {"prompt_token_ids": base})], params)["p"]
    assert a.num_cached_tokens == 0 and len(a.prompt_logprobs) == len(base)
    assert a.prompt_logprobs[1:] == b.prompt_logprobs[1:]


@pytest.mark.parametrize("mode", ["async", "speculative"])
def test_demo_model_modes_with_prefix_hits(mode) -> None:
    """The bundled demo model (it has a trained MTP layer): async scheduling and MTP speculation over
    prefix hits give the tokens of the cache-off run."""
    rng = random.Random(5)
    prefix = [rng.randrange(10, 1000) for _ in range(140)]
    requests = [(f"r{i}", {"prompt_token_ids": prefix + [rng.randrange(10, 1000) for _ in range(15 * i + 3)]})
                for i in range(3)]
    kw = {"async_scheduling": True} if mode == "async" else {
        "speculative_config": {"method": "mtp", "num_speculative_tokens": 2}}
    common = dict(device="cpu", block_size=BS, max_num_seqs=4, max_num_batched_tokens=BS, max_model_len=256,
                  load_progress=False, cache_memory_gb=0.05, **kw)
    on = LLMEngine.from_engine_args(**common)
    off = LLMEngine.from_engine_args(**common, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    hits = _run(on, requests, params, arrive_after=2)
    plain = _run(off, requests, params, arrive_after=2)
    for rid, _ in requests:
        assert _tokens(hits[rid]) == _tokens(plain[rid]), rid
    assert [hits[f"r{i}"].num_cached_tokens for i in range(3)] == [0, 128, 128]


# ---- cache tiers: host memory and a disk directory below the device pools ---------------------------------
def test_host_tier_brings_evicted_blocks_back(model_dir) -> None:
    rng = random.Random(8)
    a, b = _ids(rng, 600), _ids(rng, 600)
    on = _engine(model_dir, num_cache_blocks=6, kv_host_cache_gb=0.05)
    _run(on, [("a", {"prompt_token_ids": a})], GREEDY)
    _run(on, [("b", {"prompt_token_ids": b})], GREEDY)  # evicts a's blocks from the device: down to host memory
    assert on.cache.pools["history"].num_evictions > 0 and on.tiers.saved > 0
    again = _run(on, [("a2", {"prompt_token_ids": a})], GREEDY)["a2"]
    assert again.num_cached_tokens == 512 and on.scheduler.prefix_tier_hits > 0 and on.tiers.loaded > 0
    plain = _run(_engine(model_dir, enable_prefix_caching=False), [("a", {"prompt_token_ids": a})], GREEDY)["a"]
    _assert_same(again, plain, exact=True)  # the same chunks as the first run: bit for bit
    on.close()


def test_disk_tier_survives_a_restart_and_rejects_damaged_objects(model_dir, tmp_path) -> None:
    rng = random.Random(9)
    prompts = {f"p{i}": _ids(rng, 300 + 130 * i) for i in range(3)}
    tiers = dict(kv_cache_dir=str(tmp_path / "kv"), kv_disk_cache_gb=0.05)
    # The disk holds no state blocks (the model's CSA layers allow bounded replay): every hit after the restart
    # is a replay, whose chunks start 4 positions early; batch-invariant ops keep the rows the same bits.
    first = _engine(model_dir, invariant=True, **tiers)
    for rid, ids in prompts.items():
        _run(first, [(rid, {"prompt_token_ids": ids})], GREEDY)
    first.close()  # writes every cached block down to the disk
    files = sorted((tmp_path / "kv").rglob("*.kvb"))
    assert files
    # Damage three objects: a flipped payload byte, a truncated file, a foreign header.
    victims = [f for f in files if f.stat().st_size > 4096][:3]
    data = bytearray(victims[0].read_bytes())
    data[-100] ^= 0xFF
    victims[0].write_bytes(bytes(data))
    victims[1].write_bytes(victims[1].read_bytes()[:-7])
    victims[2].write_bytes(b"not a block" + victims[2].read_bytes()[11:])

    second = _engine(model_dir, True, kv_host_cache_gb=0.05, **tiers)  # with host memory: prefetched from disk
    plain = _engine(model_dir, True, enable_prefix_caching=False)
    for rid, ids in prompts.items():
        got = _run(second, [(rid, {"prompt_token_ids": ids})], GREEDY)[rid]
        want = _run(plain, [(rid, {"prompt_token_ids": ids})], GREEDY)[rid]
        _assert_same(got, want, exact=True)  # a damaged object is recomputed, never used
    second.tiers.store.flush()
    assert second.tiers.store.stats().prefetched > 0
    stats = second.tiers.store.stats().tier("disk")
    assert stats.checksum_failures >= 1
    assert second.scheduler.prefix_tier_hits > 0 and second.scheduler.prefix_replayed > 0
    assert all(not v.exists() or v.read_bytes() != b"" for v in victims)
    second.close()
    # Another configuration (block size) never reads these objects.
    other = _engine(model_dir, block_size=256, max_num_batched_tokens=256, **tiers)
    out = _run(other, [("p2", {"prompt_token_ids": prompts["p2"]})], GREEDY)["p2"]
    assert out.num_cached_tokens == 0
    other.close()


def test_tier_hits_replay_instead_of_storing_state_blocks() -> None:
    """The demo model (CSA m=4: replays of 4 positions) with a device cache of a few blocks and a host tier,
    four conversations taking turns: each turn's prefix was evicted from the device by the others' turns and
    comes back from host memory as history and window blocks, and the boundary's compressor state is rebuilt
    by a bounded replay (the tier never holds a state block), the replayed window block being a private load.
    Batch-invariant ops on both engines: tokens and logprobs equal the cache-off run's bit for bit."""
    rng = random.Random(12)
    kw = dict(invariant=True, max_num_seqs=1, max_model_len=1024)
    on = _engine(None, num_cache_blocks=6, kv_host_cache_gb=0.05, **kw)
    off = _engine(None, enable_prefix_caching=False, **kw)
    assert on.cache.replay == 4 and on.tiers.pools == ("history", "window")
    stored, asked = [], []
    put, exists = on.tiers.store.put, on.tiers.store.exists
    on.tiers.store.put = lambda key, kind, *rest: (stored.append(kind), put(key, kind, *rest))[1]
    on.tiers.store.exists = lambda key: (asked.append(key[:1]), exists(key))[1]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    chats = {c: _ids(rng, 300) for c in "abcd"}
    computed = dict.fromkeys(chats, 0)  # positions the conversation's previous turn computed
    for turn in range(3):
        for c in chats:
            rid = f"{c}{turn}"
            got = _run(on, [(rid, {"prompt_token_ids": chats[c]})], params)[rid]
            _assert_same(got, _run(off, [(rid, {"prompt_token_ids": chats[c]})], params)[rid], exact=True)
            # The previous turn's last full block, less the replayed positions.
            assert got.num_cached_tokens == (computed[c] // BS * BS - 4 if turn else 0), rid
            computed[c] = len(chats[c]) + len(got.outputs[0].token_ids) - 1
            chats[c] = chats[c] + list(got.outputs[0].token_ids) + _ids(rng, 100)
    assert on.cache.pools["history"].num_evictions > 0 and on.cache.pools["window"].num_evictions > 0
    assert on.scheduler.prefix_tier_hits > 0 and on.tiers.loaded > 0
    assert on.scheduler.prefix_replayed == 4 * 8  # every later turn of every conversation replayed
    assert set(stored) == {"history", "window"} and set(asked) == {b"h", b"w"}  # never a state block
    on.close()


LOCKSTEP = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, logprobs=3)


def _lockstep_turns(engine: LLMEngine, chats: dict[str, list[int]], turns: int, user: int, rng) -> list[dict]:
    """Every conversation's next turn submitted at once, the next turn once all have answered (the multi-turn
    trace of ``bench/prefix_cache.py``). Per turn: conversation -> (output, positions its previous turn computed)."""
    computed = dict.fromkeys(chats, 0)
    rows = []
    for turn in range(turns):
        for c, ids in chats.items():
            engine.add_request(f"{c}{turn}", {"prompt_token_ids": ids}, LOCKSTEP)
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
            engine.cache.check_integrity()
        rows.append({c: (done[f"{c}{turn}"], computed[c]) for c in chats})
        for c in chats:
            out = done[f"{c}{turn}"].outputs[0].token_ids
            computed[c] = len(chats[c]) + len(out) - 1
            chats[c] = chats[c] + list(out) + _ids(rng, user)
    return rows


def test_lockstep_turns_find_blocks_evicted_by_the_same_plan_in_the_tier() -> None:
    """Three conversations taking turns in lockstep, two at a time, outgrow a device pool of 10 history blocks
    by the third turn; a host tier holds what the device evicts. LRU then evicts exactly the blocks of the next
    conversation in line, here while admitting it in the same plan: the tier receives those blocks only with
    the plan's saves, so the lookup must wait a step for them rather than recompute from the first one on.
    Every turn hits its previous turn's whole computed prefix (256 * t positions, less the 4 a bounded replay
    may recompute), and outputs equal the cache-off run's bit for bit (batch-invariant ops)."""
    kw = dict(invariant=True, max_num_seqs=2, max_num_batched_tokens=4 * BS, max_model_len=1024)
    on = _engine(None, num_cache_blocks=10, kv_host_cache_gb=0.05, **kw)
    off = _engine(None, enable_prefix_caching=False, **kw)
    assert on.facts.num_blocks["history"] == 10 and on.cache.replay == 4
    first = {c: _ids(random.Random(20 + i), 2 * BS - 1) for i, c in enumerate("abc")}  # 256 computed per turn
    got = _lockstep_turns(on, {c: list(ids) for c, ids in first.items()}, 3, 2 * BS - 2, random.Random(21))
    want = _lockstep_turns(off, {c: list(ids) for c, ids in first.items()}, 3, 2 * BS - 2, random.Random(21))
    for turn, (rows, plain) in enumerate(zip(got, want)):
        for c, (out, computed) in rows.items():
            assert computed == 2 * BS * turn
            _assert_same(out, plain[c][0], exact=True)
            assert out.num_cached_tokens >= computed - on.cache.replay, (turn, c, out.num_cached_tokens)
    assert on.cache.pools["history"].num_evictions > 0 and on.scheduler.prefix_tier_hits > 0
    on.close()
