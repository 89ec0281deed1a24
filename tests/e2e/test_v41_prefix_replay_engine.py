"""``v41_prefix_replay`` in the engine: prefix hits taken by the encoder-side replay (spec §3.2, §8.3 item 3).

The tiny random V4.1 of ``v41_tiny.py`` (window W = 16) in float32, cache quantization off, blocks of 128. A
request computes a prompt; a second one sharing its first block is then served, hitting at H = 128:

  * ``v41``: the second request starts at H - W = 112 and its tokens and logprobs equal the plain model's
    ``take_prefix_hit`` reference on the same chunks (a cold prefill of [0, H), then [H - W, ...) with the
    window bounded at H - W and no entry re-emitted), within 1e-5; they differ from the cold run's (the
    replay is not bit-identical, by design); the cached history pages (compressed entries, index keys, token
    ids) are byte-identical before and after the replay. The replay runs in chunks of 10 (its window bound
    holds across steps). With DSpark speculation the greedy tokens are the same (its context rows come from
    the replayed window); a boundary whose history block went to the host tier is replayed the same way;
  * ``exact`` (the default): the hit starts at H and equals no prefix caching bitwise;
  * ``v41_decoder_replay="v41"`` with prefix caching: narrowed prefills (whose decoder window rows before the
    kept tail are never written) then a replayed hit equal the plain model run the same way;
  * the refusals: an unknown mode, the decoder replay with exact prefix hits, the replay for DeepSeek-V4.

Every window/state row is NaN when the engine starts, so a step reading a row nothing wrote shows up in the
logits.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLMEngine, SamplingParams
from deepinfer.config.engine import EngineArgs, EngineConfig
from deepinfer.kv.spec import HISTORY
from deepinfer.model.v41 import paged
from deepinfer.model.v41.loader import load_v41_model
from deepinfer.testing.staggered import assert_same
from tests.e2e.v41_tiny import greedy_from, write_tiny_v41

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
MAX_TOKENS = 6
VOCAB = 4096  # the demo tokenizer's
H = 128  # the hit's boundary: the first block
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, one_thread):
    path = write_tiny_v41(tmp_path_factory.mktemp("prefix_replay"), seed=1)
    plain, _ = load_v41_model(path, torch.float32, cache_qdq=False)
    return path, plain


def _prompts() -> tuple[list[int], list[int]]:
    rng = random.Random(21)
    first = [rng.randrange(3, VOCAB) for _ in range(150)]
    return first, first[:140] + [rng.randrange(3, VOCAB) for _ in range(40)]


def _engine(path, **kw) -> LLMEngine:
    args = dict(model=str(path), device="cpu", dtype="float32", kv_cache_dtype="float32", block_size=128,
                max_num_seqs=4, max_num_batched_tokens=10, max_model_len=512, num_cache_blocks=8,
                load_progress=False, v41_prefix_replay="v41")
    args.update(kw)
    engine = LLMEngine.from_engine_args(**args)
    for (key, name), rows in engine.storage.tensors.items():
        if engine.storage.layout.layer(key).tensor(name).pool != HISTORY:
            rows.fill_(torch.nan)
    return engine


def _in_turn(engine: LLMEngine, prompts: list[list[int]], params=PARAMS, after_first=None) -> list:
    """Serve the prompts one after another; per prompt (tokens, logprobs, num_cached_tokens). ``after_first``:
    called once the first has finished."""
    out = []
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    c = o.outputs[0]
                    lps = [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] if c.logprobs else []
                    out.append((list(c.token_ids), lps, o.num_cached_tokens))
            engine.cache.check_integrity()
        if i == 0 and after_first is not None:
            after_first()
    return out


def _reference(plain, ids: list[int], chunk: int, replay: str = "off") -> tuple[list[int], list[float]]:
    """The plain model on the engine's schedule: a cold prefill of [0, H) in chunks of ``chunk``, the hit, the
    rest from H - W in chunks of ``chunk``, then greedy decoding; ``replay``: the decoder replay mode."""
    t, cache = torch.tensor(ids), plain.new_cache()
    for lo in range(0, H, chunk):
        plain(t[lo : min(lo + chunk, H)], cache, replay)
    plain.take_prefix_hit(cache, H)
    for lo in range(H - plain.cfg.sliding_window, len(ids), chunk):
        logits = plain(t[lo : lo + chunk], cache, replay)
    return greedy_from(plain, logits, cache, MAX_TOKENS)


def _history(engine: LLMEngine) -> dict[tuple[str, str, int], torch.Tensor]:
    """The rows of every cached history block, per (layer, tensor, block)."""
    layout, out = engine.storage.layout, {}
    for pool, block, _ in engine.cache.cached_blocks():
        if pool == HISTORY:
            for (key, name), rows in engine.storage.tensors.items():
                t = layout.layer(key).tensor(name)
                if t.pool == HISTORY:
                    n = layout.rows_per_block(t)
                    out[(key, name, block)] = rows[block * n : (block + 1) * n].clone()
    return out


def test_hit_equals_the_plain_replay_and_keeps_the_global_kv(tiny) -> None:
    path, plain = tiny
    first, second = _prompts()
    engine, before = _engine(path), {}
    got = _in_turn(engine, [first, second], after_first=lambda: before.update(_history(engine)))
    after = _history(engine)
    assert {k[1] for k in before} == {"entries", "index_keys", "token_ids"} and len({k[2] for k in before}) == 1
    assert all(torch.equal(after[k], v) for k, v in before.items()), "the replay rewrote cached history rows"
    w = plain.cfg.sliding_window
    assert got[0][2] == 0 and got[1][2] == H - w and engine.scheduler.prefix_replayed == w
    assert_same({"b": got[1][:2]}, {"b": _reference(plain, second, 10)}, 1e-5)
    assert got[1][0] != plain.greedy(torch.tensor(second), MAX_TOKENS), "the replay should change these tokens"

    # DSpark drafts after the replay: lossless, so the same greedy tokens.
    spec_path = write_tiny_v41(path.parent / "dspark", seed=1, dspark=True)
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    spec = _engine(spec_path, max_num_batched_tokens=64, speculative_config={"method": "dspark",
                                                                             "num_speculative_tokens": 3})
    plain_spec = _engine(spec_path, max_num_batched_tokens=64)
    want = _in_turn(plain_spec, [first, second], greedy)
    assert _in_turn(spec, [first, second], greedy) == want and want[1][2] == H - w


def test_hit_from_the_host_tier(tiny) -> None:
    """A boundary whose history block left the device (two blocks, taken by another prompt in between) comes
    back from the host tier and is replayed the same way: only history blocks are needed."""
    path, plain = tiny
    first, second = _prompts()
    rng = random.Random(22)
    other = [rng.randrange(3, VOCAB) for _ in range(250)]
    engine = _engine(path, num_cache_blocks=2, kv_host_cache_gb=0.01)
    got = _in_turn(engine, [first, other, second])
    assert got[2][2] == H - plain.cfg.sliding_window and engine.scheduler.prefix_tier_hits == H
    assert_same({"b": got[2][:2]}, {"b": _reference(plain, second, 10)}, 1e-5)


def test_exact_hit_equals_no_hit_bitwise(tiny) -> None:
    path, _ = tiny
    first, second = _prompts()
    # Chunks of 64 from 0 and from H: the steps past H run the same shapes, hence the same roundings.
    hit = _in_turn(_engine(path, v41_prefix_replay="exact", max_num_batched_tokens=64), [first, second])
    assert hit[1][2] == H
    cold = _in_turn(_engine(path, v41_prefix_replay="exact", max_num_batched_tokens=64, enable_prefix_caching=False),
                    [first, second])
    assert [r[:2] for r in hit] == [r[:2] for r in cold]


def test_decoder_replay_with_prefix_hits(tiny, monkeypatch) -> None:
    path, plain = tiny
    narrowed: list[int] = []
    original = paged._Step.narrowed
    monkeypatch.setattr(paged._Step, "narrowed", lambda self, kept: narrowed.append(1) or original(self, kept))
    first, second = _prompts()
    got = _in_turn(_engine(path, v41_decoder_replay="v41", max_num_batched_tokens=64), [first, second])
    assert narrowed and got[1][2] == H - plain.cfg.sliding_window
    assert_same({"a": got[0][:2], "b": got[1][:2]},
                {"a": _plain_chunked(plain, first, 64), "b": _reference(plain, second, 64, "v41")}, 1e-5)


def _plain_chunked(plain, ids: list[int], chunk: int) -> tuple[list[int], list[float]]:
    """The plain model's greedy tokens and logprobs after a prefill narrowed chunk by chunk (no hit)."""
    t, cache = torch.tensor(ids), plain.new_cache()
    for lo in range(0, len(ids), chunk):
        logits = plain(t[lo : lo + chunk], cache, "v41")
    return greedy_from(plain, logits, cache, MAX_TOKENS)


def test_refusals(tiny) -> None:
    path, _ = tiny
    base = dict(model=str(path), device="cpu", dtype="float32")
    with pytest.raises(ValueError, match=r"^v41_prefix_replay: 'on' is not a prefix replay mode; allowed: exact, v41"):
        EngineConfig.create(EngineArgs(**base, v41_prefix_replay="on"))
    with pytest.raises(ValueError, match=r"^v41_decoder_replay: 'exact' .*set v41_prefix_replay='v41'"):
        EngineConfig.create(EngineArgs(**base, v41_decoder_replay="exact"))  # prefix caching is on by default
    with pytest.raises(ValueError, match=r"^v41_prefix_replay: 'v41' applies to DeepSeek-V4.1 .*allowed .*: exact"):
        EngineConfig.create(EngineArgs(device="cpu", v41_prefix_replay="v41"))  # the bundled V4 demo model
    config = EngineConfig.create(EngineArgs(**base, v41_decoder_replay="v41", v41_prefix_replay="v41"))
    assert (config.v41_decoder_replay, config.v41_prefix_replay, config.cache.enable_prefix_caching) == \
        ("v41", "v41", True)

    from deepinfer.cli import _engine_args, build_parser

    parser = build_parser()
    assert _engine_args(parser.parse_args(["generate", "x"])).v41_prefix_replay == "exact"
    assert _engine_args(parser.parse_args(["generate", "x", "--v41-prefix-replay", "v41"])).v41_prefix_replay == "v41"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "x", "--v41-prefix-replay", "on"])
