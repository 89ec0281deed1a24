#!/usr/bin/env python
"""Train the bundled demo model's byte-level BPE tokenizer (deepinfer/assets/demo/tokenizer.json).

Reproduce from the repository root::

    python tools/train_tokenizer.py            # writes deepinfer/assets/demo/tokenizer{,_config}.json
    python tools/train_tokenizer.py --check    # trains twice in fresh processes, asserts byte-identical output

Data selection (``deepinfer/corpus.py``): the running Python's standard library sources, i.e. every
``*.py`` under ``sysconfig.get_paths()["stdlib"]`` sorted by relative POSIX path, without test suites
(any ``test/``, ``tests/``, ``idle_test/`` directory, which covers ``test/``, ``idlelib/idle_test``,
``lib2to3/tests``) and without ``site-packages``. Files with
``sha1(relative_path)[0] % 10 == 0`` are held out for evaluation and are never trained on. The committed
artifacts were trained with CPython 3.11.7: 667 training files (10.97 MB), 67 held-out files (1.15 MB).
Other Python versions have slightly different stdlibs and therefore produce a slightly different (but
equally deterministic) tokenizer; ``--check`` compares with the committed file only when the training
corpus fingerprint equals :data:`COMMITTED_CORPUS_SHA256`.

Model: byte-level BPE, no normalizer, vocabulary exactly 4096 entries = 17 special tokens (ids 0..16,
in the order of ``deepinfer.tokenizer.SPECIAL_TOKENS``) + the 256-symbol byte alphabet + 3823 merges.
Pre-tokenization: a GPT-4-style ``Split`` regex (:data:`SPLIT_PATTERN`, behaviour "isolated") followed by
``ByteLevel(add_prefix_space=False, use_regex=False)``. Differences from the GPT-4 pattern, chosen on a
validation split of the *training* files (``sha1[0] % 10 == 1``, trained on the rest) and never on the
held-out set: a newline run absorbs the indentation that follows it (``"\\n        "`` is one pre-token),
and may be preceded by the punctuation that ends the line (``"):\\n        "``). Validation bytes/token:
GPT-4 pattern 3.596, newline+indent 3.663, punctuation+newline+indent (chosen) 3.736. Digits are split
in groups of at most 3, words keep one leading non-letter (``" def"``, ``".append"``).

Post-processor: ``TemplateProcessing`` that prepends BOS when ``add_special_tokens=True`` (the
DeepSeek convention); ``deepinfer.tokenizer.Tokenizer.encode`` defaults to ``add_special_tokens=False``.

Seed / determinism: BPE training in ``tokenizers`` has no random component (merge ties are broken by
the pair ids), so there is no seed to set; the only inputs are the file list, their bytes and the
hyper-parameters below. ``--check`` verifies this by training in two fresh interpreter processes (so
the Rust hash maps get different random states) and comparing the bytes.

Wall time: about 3 s of training (+1 s held-out evaluation) on 2 CPU cores with tokenizers 0.23.3.
Held-out result (CPython 3.11.7 stdlib, 67 files, 1,145,963 bytes): 3.81 bytes/token (see ``--eval``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # run from the repository root without installing the package

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from tokenizers import Tokenizer as HFTokenizer  # noqa: E402

from deepinfer import corpus  # noqa: E402
from deepinfer.tokenizer import (  # noqa: E402
    BOS_TOKEN,
    EOS_TOKEN,
    PAD_TOKEN,
    SPECIAL_TOKENS,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
)

VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 4096
DEFAULT_OUT = REPO_ROOT / "deepinfer" / "assets" / "demo"

SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"  # English contractions
    r"|[^\r\n\p{L}\p{N}]?\p{L}+"  # a word with at most one leading non-letter: " def", ".append", "_x"
    r"|\p{N}{1,3}"  # digits, at most 3 per pre-token
    r"| ?[^\s\p{L}\p{N}]+(?:[ \t]*[\r\n]+[ \t]*)?"  # punctuation run, plus a line break and next indent
    r"|[ \t]*[\r\n]+[ \t]*"  # line break(s) with the following indentation
    r"|\s+(?!\S)"  # whitespace not followed by a word (the last space joins the word)
    r"|\s+"
)

# sha256 over the training files (relative path + content hash) the committed artifacts were built from.
COMMITTED_CORPUS_SHA256 = "735e599c7419b0daf67f38a1c4eda4d6c768035f85a90a85f8d878f01e2d1b49"


def corpus_fingerprint(files: list[str]) -> str:
    h = hashlib.sha256()
    for rel in files:
        text = corpus.read_text(rel, missing_ok=True)
        if text is None:
            continue
        h.update(rel.encode("utf-8") + b"\0" + hashlib.sha256(text.encode("utf-8")).digest())
    return h.hexdigest()


def build_untrained() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train(files: list[str]) -> HFTokenizer:
    tok = build_untrained()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus.iter_texts(files), trainer=trainer, length=len(files))
    # Make sure the special tokens are registered as special added tokens with their trained ids.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    bos = tok.token_to_id(BOS_TOKEN)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A:0",
        pair=f"{BOS_TOKEN} $A:0 {BOS_TOKEN}:1 $B:1",
        special_tokens=[(BOS_TOKEN, bos)],
    )
    validate(tok)
    return tok


def validate(tok: HFTokenizer) -> None:
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != VOCAB_SIZE:
        raise RuntimeError(f"vocab size {size} != {VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise RuntimeError(f"special token {t!r} has id {tok.token_to_id(t)}, expected {i}")
    added = tok.get_added_tokens_decoder()
    if sorted(added) != list(range(len(SPECIAL_TOKENS))) or not all(a.special for a in added.values()):
        raise RuntimeError(f"unexpected added tokens: {added}")
    vocab = tok.get_vocab(with_added_tokens=False)
    missing = [c for c in pre_tokenizers.ByteLevel.alphabet() if c not in vocab]
    if missing:
        raise RuntimeError(f"byte alphabet incomplete, missing {missing}")


def tokenizer_config() -> dict:
    decoder = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": decoder,
        "bos_token": BOS_TOKEN,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "extra_special_tokens": list(SPECIAL_TOKENS[3:]),
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": PAD_TOKEN,
        "padding_side": "left",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def write_artifacts(tok: HFTokenizer, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / TOKENIZER_FILE).write_text(tok.to_str(pretty=True) + "\n", encoding="utf-8")
    (out_dir / TOKENIZER_CONFIG_FILE).write_text(
        json.dumps(tokenizer_config(), ensure_ascii=False, indent=2) + "\n", encoding="utf-8"
    )


def evaluate(tok: HFTokenizer, files: list[str]) -> tuple[int, int, int]:
    """(files, bytes, tokens) over ``files``; asserts the decode(encode(x)) == x round trip."""
    n_files = n_bytes = n_tokens = 0
    for rel in files:
        text = corpus.read_text(rel, missing_ok=True)
        if text is None:
            continue
        ids = tok.encode(text, add_special_tokens=False).ids
        if tok.decode(ids, skip_special_tokens=False) != text:
            raise RuntimeError(f"round trip failed on {rel}")
        n_files += 1
        n_bytes += len(text.encode("utf-8"))
        n_tokens += len(ids)
    return n_files, n_bytes, n_tokens


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run_check(out_dir: Path) -> int:
    fingerprint = corpus_fingerprint(corpus.train_files())
    digests = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(2):
            d = Path(tmp) / f"run{k}"
            subprocess.run([sys.executable, __file__, "--out", str(d), "--no-eval"], check=True)
            digests.append((sha256_file(d / TOKENIZER_FILE), sha256_file(d / TOKENIZER_CONFIG_FILE)))
    print(f"run 1: tokenizer.json sha256 {digests[0][0]}")
    print(f"run 2: tokenizer.json sha256 {digests[1][0]}")
    if digests[0] != digests[1]:
        print("FAIL: two training runs produced different artifacts")
        return 1
    print("OK: two training runs are byte-identical")
    committed = out_dir / TOKENIZER_FILE
    if fingerprint != COMMITTED_CORPUS_SHA256:
        print(f"note: training corpus fingerprint {fingerprint[:16]}... differs from the committed one "
              f"({COMMITTED_CORPUS_SHA256[:16]}...; other Python version?), not comparing with {committed}")
        return 0
    if not committed.is_file():
        print(f"note: no committed artifact at {committed}")
        return 0
    committed_digests = (sha256_file(committed), sha256_file(out_dir / TOKENIZER_CONFIG_FILE))
    if committed_digests != digests[0]:
        print(f"FAIL: same corpus but the committed artifacts in {out_dir} differ from a fresh run")
        return 1
    print(f"OK: identical to the committed artifacts in {out_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output directory (default {DEFAULT_OUT})")
    ap.add_argument("--check", action="store_true", help="train twice in fresh processes and compare bytes")
    ap.add_argument("--eval", action="store_true", help="only evaluate the tokenizer in --out on the held-out files")
    ap.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation after training")
    args = ap.parse_args(argv)

    if args.check:
        return run_check(args.out)

    heldout = corpus.heldout_files()
    if args.eval:
        tok = HFTokenizer.from_file(str(args.out / TOKENIZER_FILE))
    else:
        files = corpus.train_files()
        overlap = set(files) & set(heldout)
        assert not overlap, overlap
        print(f"python {sys.version.split()[0]}, stdlib {corpus.stdlib_root()}")
        print(f"training on {len(files)} files, corpus fingerprint {corpus_fingerprint(files)}")
        t0 = time.perf_counter()
        tok = train(files)
        dt = time.perf_counter() - t0
        write_artifacts(tok, args.out)
        size = (args.out / TOKENIZER_FILE).stat().st_size
        print(f"trained in {dt:.1f} s; wrote {args.out / TOKENIZER_FILE} ({size / 1024:.0f} KiB, "
              f"sha256 {sha256_file(args.out / TOKENIZER_FILE)}) and {TOKENIZER_CONFIG_FILE}")
        if args.no_eval:
            return 0
    t0 = time.perf_counter()
    n_files, n_bytes, n_tokens = evaluate(tok, heldout)
    print(f"held-out: {n_files} files, {n_bytes} bytes, {n_tokens} tokens, "
          f"{n_bytes / max(n_tokens, 1):.4f} bytes/token (round trip OK, {time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
