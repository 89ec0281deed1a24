"""Incremental detokenizer: UTF-8 safe streaming and stop strings, on a tiny in-memory byte-level BPE."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from deepinfer.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer

SENTENCES = [
    "Hello world. The café is open.",
    "日本 is Japan; 日本語 means Japanese.",
    "I am happy 🙂 today! Ça va?",
    "Stop here. Stop there. The end.",
] * 3
TEXTS = ["café 日本 🙂 Stop", "Hello 日本語🙂 wörld", "🙂🙂é日本", "plain ascii text only."]


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte -> printable char table used by the ByteLevel pre-tokenizer.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<eos>", "<bos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    t.train_from_iterator(SENTENCES, trainer)
    return t


def byte_ids(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character is split across tokens."""
    table = _bytes_to_unicode()
    return [tok.token_to_id(table[b]) for b in text.encode("utf-8")]


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> tuple[list[DetokenizerUpdate], DetokenizerUpdate]:
    updates = []
    for i in range(0, len(ids), chunk):
        updates.append(detok.step(ids[i : i + chunk]))
        if updates[-1].stopped:
            break
    return updates, detok.finish()


def joined(updates: list[DetokenizerUpdate], final: DetokenizerUpdate) -> str:
    return "".join(u.text_delta for u in updates) + final.text_delta


# --------------------------------------------------------------------------------------- decoding
def test_fixture_really_splits_characters(tok: Tokenizer) -> None:
    ids = tok.encode("🙂").ids
    assert len(ids) > 1 and any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("split", ["bpe", "bytes"])
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_equals_full_decode_without_replacement_chars(tok: Tokenizer, text: str, split: str, chunk: int) -> None:
    ids = tok.encode(text).ids if split == "bpe" else byte_ids(tok, text)
    detok = IncrementalDetokenizer(tok, tok.encode("Hello ").ids, True, ())
    updates, final = stream(detok, ids, chunk)
    assert all("\ufffd" not in u.text_delta for u in updates)
    assert joined(updates, final) == tok.decode(ids) == text
    assert detok.output_text == text and detok.num_output_tokens == len(ids)
    assert not final.stopped and final.stop_reason is None


def test_split_character_is_streamed_once_whole(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], True, ())
    deltas = [detok.step([i]).text_delta for i in byte_ids(tok, "a🙂")]
    assert deltas == ["a", "", "", "", "🙂"]


def test_special_tokens(tok: Tokenizer) -> None:
    eos = tok.token_to_id("<eos>")
    ids = [*tok.encode("Hi 日本").ids, eos]
    skip = IncrementalDetokenizer(tok, [], True, ())
    assert joined(*stream(skip, ids)) == "Hi 日本"
    keep = IncrementalDetokenizer(tok, [], False, ())
    assert joined(*stream(keep, ids)) == "Hi 日本<eos>" == tok.decode(ids, skip_special_tokens=False)


def _reference(full: str, stops: tuple[str, ...]) -> str:
    ends = [(full.find(s) + len(s), full.find(s)) for s in stops if s in full]
    return full[: min(ends)[1]] if ends else full


def test_random_token_soup_matches_full_decode(tok: Tokenizer) -> None:
    # Invalid UTF-8 (lone continuation bytes, truncated characters) as a random model would produce, prompts
    # that end inside a character, random step sizes and stop strings (also U+FFFD itself).
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        stops = tuple({rng.choice(["a", "é", "St", "\ufffd", "日本", "xyz"]) for _ in range(rng.randrange(0, 3))})
        skip = rng.random() < 0.5
        detok = IncrementalDetokenizer(tok, prompt, skip, stops)
        updates, final = stream(detok, ids, rng.randrange(1, 4))
        assert joined(updates, final) == _reference(tok.decode(ids, skip_special_tokens=skip), stops)


def test_step_token_equals_step_without_stop_strings(tok: Tokenizer) -> None:
    # The engine's per-token path (no update object) against step((token,)): the same deltas, the same text,
    # the same flush at finish, for random soups with split characters and special tokens.
    rng = random.Random(1)
    vocab = tok.get_vocab_size()
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        skip = rng.random() < 0.5
        a, b = IncrementalDetokenizer(tok, prompt, skip), IncrementalDetokenizer(tok, prompt, skip)
        assert not a.has_stops
        for t in ids:
            assert a.step_token(t) == b.step((t,)).text_delta
            assert a.output_text == b.output_text and a.num_output_tokens == b.num_output_tokens
        assert a.finish() == b.finish()
    with pytest.raises(RuntimeError):
        IncrementalDetokenizer(tok, [], True, ("a",)).step_token(5)
    with pytest.raises(RuntimeError):
        a.step_token(5)  # after finish()


def test_concatenating_decoder_path_equals_window_decoding() -> None:
    # The demo tokenizer decodes by concatenation (byte-level): the detokenizer then decodes each token alone.
    # Against the same tokenizer with that path off: the same deltas, step for step, and the same flush, for
    # soups rich in split characters (single ids that decode to U+FFFD), special ids, skipped or not.
    from deepinfer.tokenizer import Tokenizer as EngineTokenizer

    fast, slow = EngineTokenizer(), EngineTokenizer()
    slow.decodes_by_concatenation = False
    assert fast.decodes_by_concatenation
    vocab = fast.vocab_size
    partial = [i for i in range(vocab) if "\ufffd" in fast.decode([i])]
    assert len(partial) > 50
    rng = random.Random(2)
    for _ in range(300):
        pick = lambda: rng.choice([rng.randrange(vocab), rng.choice(partial), rng.randrange(17)])  # noqa: E731
        ids = [pick() for _ in range(rng.randrange(1, 30))]
        prompt = [pick() for _ in range(rng.randrange(0, 8))]
        skip, stops = rng.random() < 0.5, rng.choice([(), (), ("e",), ("\ufffd",)])
        a, b = IncrementalDetokenizer(fast, prompt, skip, stops), IncrementalDetokenizer(slow, prompt, skip, stops)
        c = IncrementalDetokenizer(fast, prompt, skip) if not stops else None  # the engine's per-token path
        for t in ids:
            update = b.step((t,))
            assert a.step((t,)) == update
            if c is not None:
                assert c.step_token(t) == update.text_delta
        final = b.finish()
        assert a.finish() == final
        if c is not None:
            assert c.finish() == final
        # The property itself, on runs without U+FFFD.
        x, y = ids[: len(ids) // 2], ids[len(ids) // 2 :]
        tx, ty = fast.decode(x, skip_special_tokens=skip), fast.decode(y, skip_special_tokens=skip)
        if "\ufffd" not in tx + ty:
            assert fast.backend.decode(x + y, skip_special_tokens=skip) == tx + ty


def test_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    smile = byte_ids(tok, "🙂")
    detok = IncrementalDetokenizer(tok, [*tok.encode("x").ids, *smile[:2]], True, ())
    assert joined(*stream(detok, smile[2:] + tok.encode("ok").ids)) == "\ufffd\ufffdok"


# ------------------------------------------------------------------------------------ stop strings
def test_stop_string_across_tokens_is_cut_and_held_back(tok: Tokenizer) -> None:
    text = "Hello world. Stop here."
    detok = IncrementalDetokenizer(tok, [], True, ("Stop",))
    updates, final = stream(detok, byte_ids(tok, text))
    streamed = [u.text_delta for u in updates]
    assert "".join(streamed) + final.text_delta == "Hello world. "
    assert updates[-1].stopped and updates[-1].stop_reason == "Stop"
    assert final.stopped and final.stop_reason == "Stop" and final.text_delta == ""
    assert streamed[-4:] == ["", "", "", ""]  # "S", "t", "o" held back, "p" completes the stop
    assert all("S" not in d for d in streamed)


def test_held_back_prefix_released_when_it_diverges(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], True, ("Stop",))
    deltas = [detok.step([i]).text_delta for i in byte_ids(tok, "a Sto")]
    assert "".join(deltas) == "a "
    assert detok.step(byte_ids(tok, "x")).text_delta == "Stox"


def test_held_back_prefix_released_at_finish(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], True, ("Stop", "日本語"))
    ids = tok.encode("go St").ids
    assert detok.step(ids).text_delta == "go "
    final = detok.finish()
    assert final == DetokenizerUpdate("St", False, None, 0)
    detok2 = IncrementalDetokenizer(tok, [], True, ("日本語",))
    assert detok2.step(byte_ids(tok, "x日本")).text_delta == "x"
    assert detok2.finish().text_delta == "日本"


def test_multibyte_stop_string_split_inside_characters(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], True, ("日本",))
    updates, final = stream(detok, byte_ids(tok, "I like 日本 food"))
    assert joined(updates, final) == "I like "
    assert final.stop_reason == "日本"


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], True, ("Stop",), include_stop_str_in_output=True)
    updates, final = stream(detok, tok.encode("Hello world. Stop here.").ids)
    assert joined(updates, final) == "Hello world. Stop"


def test_earliest_ending_stop_wins_regardless_of_list_order(tok: Tokenizer) -> None:
    ids = tok.encode("one two three").ids  # all arrive in one step
    for stop in (("three", "two"), ("two", "three")):
        detok = IncrementalDetokenizer(tok, [], True, stop)
        update = detok.step(ids)
        assert update.stopped and update.stop_reason == "two" and update.text_delta == "one "
    # Same end: the longer (earlier starting) one wins.
    detok = IncrementalDetokenizer(tok, [], True, ("o", "two"))
    assert detok.step(tok.encode("a two").ids).text_delta == "a "
    assert detok.stop_reason == "two"


def test_tokens_after_the_stop_in_one_step_are_not_consumed(tok: Tokenizer) -> None:
    ids = byte_ids(tok, "ab|cd")
    detok = IncrementalDetokenizer(tok, [], True, ("|",))
    update = detok.step(ids)
    assert (update.text_delta, update.stopped, update.tokens_consumed) == ("ab", True, 3)
    again = detok.step(byte_ids(tok, "more"))
    assert again == DetokenizerUpdate("", True, "|", 0)


def test_min_tokens_delays_stop_matching(tok: Tokenizer) -> None:
    ids = byte_ids(tok, "x.y.z")
    early = IncrementalDetokenizer(tok, [], True, (".",))
    assert joined(*stream(early, ids)) == "x"
    late = IncrementalDetokenizer(tok, [], True, (".",), min_tokens=2)
    assert joined(*stream(late, ids)) == "x.y"  # the first "." ends within the first 2 tokens
    spanning = IncrementalDetokenizer(tok, [], True, ("x.y",), min_tokens=2)
    assert joined(*stream(spanning, ids)) == ""  # ends at token 3 > min_tokens, so it counts


def test_misuse(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [], True, ("",))
    detok = IncrementalDetokenizer(tok, [], True, ())
    detok.finish()
    with pytest.raises(RuntimeError):
        detok.step([1])
    with pytest.raises(RuntimeError):
        detok.finish()
