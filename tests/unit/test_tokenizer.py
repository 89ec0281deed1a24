"""Tests for the committed demo tokenizer and the stdlib corpus split (no training here)."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
import tokenizers

from deepinfer import corpus
from deepinfer.tokenizer import (
    BOS_TOKEN,
    DEMO_TOKENIZER_DIR,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    Tokenizer,
    load_tokenizer,
)

EXPECTED_SPECIALS = [
    "<\uff5cbegin\u2581of\u2581sentence\uff5c>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "<\uff5c\u2581pad\u2581\uff5c>",
    "<\uff5cUser\uff5c>",
    "<\uff5cAssistant\uff5c>",
    "<think>",
    "</think>",
    "<\uff5clatest_reminder\uff5c>",
    "\uff5cDSML\uff5c",
    "<\uff5caction\uff5c>",
    "<\uff5cquery\uff5c>",
    "<\uff5cauthority\uff5c>",
    "<\uff5cdomain\uff5c>",
    "<\uff5ctitle\uff5c>",
    "<\uff5cread_url\uff5c>",
    "<tool_result>",
    "</tool_result>",
]

MIXED_TEXTS = [
    "",
    " ",
    "\n",
    "def f(x: int) -> int:\n    if x > 0:\n\t\treturn x * 12345678\n    return -1  # comment\r\n",
    "class Foo(Bar):\n    '''Docstring with 'quotes' and \"double\" ones.'''\n\n    x = [1, 2.5e-3, 0xFF]\n",
    "The quick brown fox jumps over the lazy dog. It's 3:45pm; we'll see.",
    "   leading and trailing spaces   ",
    "Grüße, naïve café — “quotes” … ñ ß Æ ø",
    "中文字符和日本語のテキスト，한국어 텍스트",
    "emoji 😀👍🏽👨‍👩‍👧‍👦 🇩🇪 and symbols ∑∫√∞ ≠ ≤",
    "control \x00\x01\x07\x1b[31m\x7f chars",
    "mixed\ttabs\t\tand\n\n\nnewlines\r\n\r\n",
    "<think>reasoning here</think>The answer is 42.",
    "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜>hello<｜end▁of▁sentence｜>",
    "call ｜DSML｜ tool<tool_result>{\"ok\": true}</tool_result> done",
    "<thinking> is not <think", "<|begin_of_sentence|> ascii bars are not special",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(DEMO_TOKENIZER_DIR)


# --- the committed artifacts ----------------------------------------------------------------------


def test_committed_files_exist_and_are_small():
    tj = DEMO_TOKENIZER_DIR / "tokenizer.json"
    cfg = DEMO_TOKENIZER_DIR / "tokenizer_config.json"
    assert tj.is_file() and cfg.is_file()
    assert tj.stat().st_size < 1_000_000


def test_load_tokenizer_returns_backend():
    backend = load_tokenizer(DEMO_TOKENIZER_DIR)
    assert isinstance(backend, tokenizers.Tokenizer)
    assert backend.get_vocab_size(with_added_tokens=True) == 4096
    # the file path itself is accepted too
    assert load_tokenizer(DEMO_TOKENIZER_DIR / "tokenizer.json").get_vocab_size() == 4096


def test_vocab_size_is_4096(tok):
    assert tok.vocab_size == 4096
    assert len(tok) == 4096
    ids = {tok.token_to_id(t) for t in tok.backend.get_vocab(with_added_tokens=True)}
    assert ids == set(range(4096))


def test_model_is_byte_level_bpe(tok):
    spec = json.loads(tok.backend.to_str())
    assert spec["model"]["type"] == "BPE"
    assert spec["normalizer"] is None
    assert spec["decoder"]["type"] == "ByteLevel"
    pre = spec["pre_tokenizer"]
    assert pre["type"] == "Sequence"
    byte_level = [p for p in pre["pretokenizers"] if p["type"] == "ByteLevel"]
    assert byte_level and byte_level[0]["add_prefix_space"] is False
    vocab = tok.backend.get_vocab(with_added_tokens=False)
    assert all(ch in vocab for ch in tokenizers.pre_tokenizers.ByteLevel.alphabet())


def test_special_token_ids_exact(tok):
    assert list(SPECIAL_TOKENS) == EXPECTED_SPECIALS
    for i, t in enumerate(EXPECTED_SPECIALS):
        assert tok.token_to_id(t) == i, t
        assert tok.id_to_token(i) == t
        assert tok.is_special(i)
    assert tok.special_ids == frozenset(range(len(EXPECTED_SPECIALS)))
    assert not tok.is_special(len(EXPECTED_SPECIALS))
    assert not tok.is_special(4095)
    added = tok.backend.get_added_tokens_decoder()
    assert sorted(added) == list(range(len(EXPECTED_SPECIALS)))
    assert all(a.special and not a.normalized for a in added.values())


def test_bos_eos_pad(tok):
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 1, 2)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
    assert tok.encode("hi", add_special_tokens=True) == [0] + tok.encode("hi")
    assert tok.encode("hi")[0] != 0


@pytest.mark.parametrize("text", MIXED_TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) and 0 <= i < 4096 for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_round_trip_all_bytes_and_random_unicode(tok):
    every_byte_char = "".join(chr(i) for i in range(256))
    assert tok.decode(tok.encode(every_byte_char), skip_special_tokens=False) == every_byte_char
    rng = random.Random(1234)
    pools = [
        (0x20, 0x7E), (0x00, 0x1F), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF),
        (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0x1F300, 0x1FAFF), (0xE000, 0xF8FF), (0x10000, 0x10FFFF),
    ]
    for _ in range(200):
        chars = []
        for _ in range(rng.randint(1, 60)):
            lo, hi = rng.choice(pools)
            c = rng.randint(lo, hi)
            if 0xD800 <= c <= 0xDFFF:  # lone surrogates are not valid text
                c = 0x20
            chars.append(chr(c))
        s = "".join(chars)
        assert tok.decode(tok.encode(s), skip_special_tokens=False) == s


def test_special_tokens_in_text_are_single_ids(tok):
    for i, t in enumerate(EXPECTED_SPECIALS):
        for text in (t, f"before{t}after", f"x {t} y", f"\n{t}\n"):
            ids = tok.encode(text)
            assert ids.count(i) == 1, (t, text, ids)
    ids = tok.encode("a<think>b</think>c｜DSML｜d<tool_result>e</tool_result>f")
    for t in ("<think>", "</think>", "｜DSML｜", "<tool_result>", "</tool_result>"):
        assert EXPECTED_SPECIALS.index(t) in ids
    # near misses are not special
    assert not any(tok.is_special(i) for i in tok.encode("<thinking> <think </ think> |DSML| <|User|>"))


def test_decode_skips_special_tokens(tok):
    text = "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜><think>hmm</think>World<｜end▁of▁sentence｜>"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=True) == "HellohmmWorld"
    assert tok.decode(ids) == "HellohmmWorld"  # skipping is the default
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode([0, 1, 2]) == ""


def test_single_id_decodes_match_the_backend(tok):
    # Single ids are served from a cache after their first decode: the same text as the backend gives, per
    # skip_special_tokens value, on the first and on later calls (special ids decode differently per value).
    ids = [0, 1, 5, 6, *range(17, 4096, 37)]
    for _ in range(2):
        for skip in (True, False):
            for i in ids:
                assert tok.decode([i], skip_special_tokens=skip) == tok.backend.decode([i], skip_special_tokens=skip)
    assert tok.decode((7,)) == tok.backend.decode([7])  # any iterable
    assert tok.decode([5, 300]) == tok.backend.decode([5, 300])


def test_code_compresses(tok):
    code = "def main():\n    for i in range(10):\n        print(i)\n    return None\n"
    assert len(code.encode()) / len(tok.encode(code)) > 2.5


def test_encode_batch(tok):
    texts = ["a b c", "def f():\n    pass\n"]
    assert tok.encode_batch(texts) == [tok.encode(t) for t in texts]


def test_tokenizer_config(tok):
    cfg = json.loads((DEMO_TOKENIZER_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert cfg["bos_token"] == EXPECTED_SPECIALS[0]
    assert cfg["eos_token"] == EXPECTED_SPECIALS[1]
    assert cfg["pad_token"] == EXPECTED_SPECIALS[2]
    assert isinstance(cfg["model_max_length"], int)
    dec = cfg["added_tokens_decoder"]
    assert {int(k): v["content"] for k, v in dec.items()} == dict(enumerate(EXPECTED_SPECIALS))
    assert all(v["special"] for v in dec.values())


def test_transformers_can_load():
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(DEMO_TOKENIZER_DIR / "tokenizer.json"))
    ours = Tokenizer(DEMO_TOKENIZER_DIR)
    text = "def f():\n    return '😀'<think>x</think>"
    assert hf.encode(text, add_special_tokens=False) == ours.encode(text)
    auto = transformers.AutoTokenizer.from_pretrained(str(DEMO_TOKENIZER_DIR))
    assert (auto.bos_token_id, auto.eos_token_id, auto.pad_token_id) == (0, 1, 2)
    assert len(auto) == 4096
    ids = auto(text)["input_ids"]
    assert ids == [0] + ours.encode(text)
    assert auto.decode(ids, skip_special_tokens=True) == "def f():\n    return '😀'x"


# --- error handling -------------------------------------------------------------------------------


def test_missing_dir_raises_clear_error(tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        load_tokenizer(missing)
    with pytest.raises(FileNotFoundError, match="no_such_model"):
        Tokenizer(missing)


def test_dir_without_tokenizer_json_raises(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        load_tokenizer(tmp_path)


def test_malformed_tokenizer_json_raises_value_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{ this is not json", encoding="utf-8")
    with pytest.raises(ValueError, match=str(tmp_path.name)):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "Nope"}}), encoding="utf-8")
    with pytest.raises(ValueError, match="tokenizer.json"):
        Tokenizer(tmp_path)


# --- the corpus split -----------------------------------------------------------------------------


def _rule(rel: str) -> bool:
    return hashlib.sha1(rel.encode("utf-8")).digest()[0] % 10 == 0


def test_split_disjoint_and_matches_hash_rule():
    train, heldout = corpus.train_files(), corpus.heldout_files()
    assert train and heldout
    assert not set(train) & set(heldout)
    assert train == sorted(train) and heldout == sorted(heldout)
    assert all(not _rule(p) for p in train)
    assert all(_rule(p) for p in heldout)
    assert sorted(train + heldout) == corpus.all_files()
    # roughly a tenth is held out
    assert 0.03 < len(heldout) / (len(train) + len(heldout)) < 0.2
    # stable across calls
    assert corpus.train_files() == train and corpus.heldout_files() == heldout


def test_split_excludes_tests_and_site_packages():
    for p in corpus.all_files():
        parts = p.split("/")
        assert p.endswith(".py")
        assert not {"test", "tests", "idle_test", "site-packages", "dist-packages"} & set(parts[:-1]), p


def test_split_pinned_examples():
    # The rule depends only on the relative path; these are fixed forever.
    for p in ("_markupbase.py", "asyncio/taskgroups.py", "email/_header_value_parser.py"):
        assert corpus.is_heldout(p) and _rule(p)
    for p in ("os.py", "typing.py", "json/__init__.py", "argparse.py"):
        assert not corpus.is_heldout(p) and not _rule(p)


def test_corpus_on_fake_root_is_robust_to_missing_files(tmp_path):
    files = ["a.py", "pkg/b.py", "pkg/test/t.py", "tests/x.py", "idlelib/idle_test/y.py",
             "site-packages/z.py", "notes.txt", "_markupbase.py"]
    for rel in files:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(f"# {rel}\n", encoding="utf-8")
    assert corpus.all_files(tmp_path) == ["_markupbase.py", "a.py", "pkg/b.py"]
    assert corpus.heldout_files(tmp_path) == ["_markupbase.py"]
    assert corpus.train_files(tmp_path) == ["a.py", "pkg/b.py"]
    assert corpus.read_text("a.py", tmp_path) == "# a.py\n"
    assert corpus.read_text("gone.py", tmp_path, missing_ok=True) is None
    with pytest.raises(FileNotFoundError, match="gone.py"):
        corpus.read_text("gone.py", tmp_path)
    assert list(corpus.iter_texts(["a.py", "gone.py"], tmp_path)) == ["# a.py\n"]
    assert corpus.all_files(tmp_path / "missing_root") == []
