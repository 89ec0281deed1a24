"""Loading and using a model directory's ``tokenizer.json`` (Hugging Face ``tokenizers`` format).

``load_tokenizer(model_dir)`` returns the raw :class:`tokenizers.Tokenizer`; :class:`Tokenizer` is a
thin wrapper with the few operations the engine needs (ids in, ids out, special-token ids).

The bundled demo model's tokenizer lives in ``deepinfer/assets/demo`` (:data:`DEMO_TOKENIZER_DIR`);
it is a 4096-entry byte-level BPE trained by ``tools/train_tokenizer.py`` whose first ids are the
DeepSeek special tokens listed in :data:`SPECIAL_TOKENS`, in that order.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"

# Special tokens of the demo tokenizer, in id order (id 0, 1, 2, ...). "｜" is U+FF5C, "▁" is U+2581.
SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜latest_reminder｜>",
    "｜DSML｜",
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
    "<tool_result>",
    "</tool_result>",
)

DEMO_TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "demo"


def _tokenizer_path(model_dir: str | os.PathLike[str]) -> Path:
    path = Path(model_dir)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    elif not path.exists():
        raise FileNotFoundError(f"tokenizer directory not found: {path} (expected a directory containing {TOKENIZER_FILE})")
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    return path


def load_tokenizer(model_dir: str | os.PathLike[str]) -> tokenizers.Tokenizer:
    """Load ``<model_dir>/tokenizer.json`` (``model_dir`` may also be the file itself).

    Raises ``FileNotFoundError`` naming the path when the directory or file is missing, and
    ``ValueError`` naming the path when the file is not a valid ``tokenizers`` JSON document.
    """
    path = _tokenizer_path(model_dir)
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for parse errors
        raise ValueError(f"malformed tokenizer file {path}: {exc}") from exc


def _read_config(model_dir: Path) -> dict:
    cfg_path = model_dir / TOKENIZER_CONFIG_FILE
    if not cfg_path.is_file():
        return {}
    try:
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"malformed tokenizer config {cfg_path}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ValueError(f"malformed tokenizer config {cfg_path}: expected a JSON object")
    return cfg


def _token_content(value: object) -> str | None:
    # tokenizer_config.json writes special tokens either as plain strings or as AddedToken dicts.
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """Minimal wrapper around a :class:`tokenizers.Tokenizer` for the engine.

    ``Tokenizer(model_dir)`` loads ``tokenizer.json`` (and ``tokenizer_config.json`` when present,
    for the BOS/EOS/PAD token names; the DeepSeek names are the defaults).
    """

    def __init__(self, model_dir: str | os.PathLike[str] = DEMO_TOKENIZER_DIR) -> None:
        path = _tokenizer_path(model_dir)
        cfg = _read_config(path.parent)
        self._setup(
            load_tokenizer(path),
            path,
            _token_content(cfg.get("bos_token")) or BOS_TOKEN,
            _token_content(cfg.get("eos_token")) or EOS_TOKEN,
            _token_content(cfg.get("pad_token")) or PAD_TOKEN,
        )

    @classmethod
    def from_tokenizer(cls, backend: tokenizers.Tokenizer) -> "Tokenizer":
        """Wrap an already constructed :class:`tokenizers.Tokenizer` (DeepSeek special-token names)."""
        self = cls.__new__(cls)
        self._setup(backend, None, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
        return self

    def _setup(self, backend: tokenizers.Tokenizer, path: Path | None, bos: str, eos: str, pad: str) -> None:
        self.path = path
        self.backend = backend
        self.bos_token, self.eos_token, self.pad_token = bos, eos, pad
        self.bos_id: int = self._required_id(bos, "BOS")
        self.eos_id: int = self._required_id(eos, "EOS")
        pad_id = backend.token_to_id(pad)
        self.pad_id: int = pad_id if pad_id is not None else self.eos_id
        self.special_ids: frozenset[int] = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        # Single-id decodes, per skip_special_tokens value (index 0: False, 1: True). The incremental
        # detokenizer decodes each new token alone once (its next window's prefix text); an id's text never
        # changes, and the vocabulary bounds the entries.
        self._single: tuple[dict[int, str], dict[int, str]] = ({}, {})
        # decode(a + b) == decode(a) + decode(b) whenever neither text holds U+FFFD. A byte-level decoder maps
        # each token to its bytes and decodes their concatenation once, invalid UTF-8 becoming U+FFFD; two texts
        # without one come from valid byte strings, whose concatenation decodes to the texts joined. (Skipped
        # special tokens and unknown ids add no bytes either way.) The incremental detokenizer then needs one
        # single-id decode per token instead of decoding its window (tests/unit/test_detokenizer.py).
        self.decodes_by_concatenation: bool = isinstance(backend.decoder, tokenizers.decoders.ByteLevel)

    def _required_id(self, token: str, what: str) -> int:
        idx = self.backend.token_to_id(token)
        if idx is None:
            where = self.path if self.path is not None else "tokenizer"
            raise ValueError(f"{where}: {what} token {token!r} is not in the vocabulary")
        return idx

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text are always single ids;
        ``add_special_tokens=True`` additionally applies the post-processor (prepends BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        # A list goes as it is (the detokenizer decodes a list slice twice per token: no third copy).
        if type(ids) is not list:
            ids = list(ids)
        if len(ids) == 1 and type(ids[0]) is int:
            single = self._single[1 if skip_special_tokens else 0]
            text = single.get(ids[0])
            if text is None:
                text = single[ids[0]] = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
            return text
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def single_decodes(self, skip_special_tokens: bool = True) -> dict[int, str]:
        """The cache of single-id decodes for that setting (filled by ``decode``; callers only read it): the
        incremental detokenizer looks a token up there before calling ``decode``."""
        return self._single[1 if skip_special_tokens else 0]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        return self.backend.id_to_token(idx)

    def is_special(self, idx: int) -> bool:
        return idx in self.special_ids

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(path={None if self.path is None else str(self.path)!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_id={self.eos_id})"
