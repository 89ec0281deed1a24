"""The local text corpus, the Python standard library, and its train / held-out split.

One rule for everything that reads it: the demo tokenizer and model trainers (``tools/``) train on
``train_files()`` only, and ``deepinfer eval`` scores ``heldout_files()``.

The corpus is the running Python's own standard library source: every ``*.py`` file under
``sysconfig.get_paths()["stdlib"]``, addressed by its POSIX path relative to that directory and
always returned sorted by that path.

Excluded:

* test suites: any file with a directory component named ``test``, ``tests`` or ``idle_test``
  (this covers ``test/``, ``tests/``, ``idlelib/idle_test/``, ``lib2to3/tests/`` and the
  per-package ``*/test/`` directories such as ``unittest/test/``);
* third-party code: anything under ``site-packages`` or ``dist-packages``;
* ``__pycache__`` directories.

Split (stable, independent of Python version, platform and file contents)::

    heldout  <=>  hashlib.sha1(relative_path.encode("utf-8")).digest()[0] % 10 == 0

Held-out files are the evaluation set and must never be trained on. Because the rule depends on
the relative path alone, a file present in one Python version and missing in another simply drops
out of (or joins) its bucket; it never moves between the buckets. The listing functions only return
files that exist in the given root; ``read_text`` raises ``FileNotFoundError`` for a missing file
unless ``missing_ok=True``, in which case it returns ``None``.

Usage::

    from deepinfer import corpus
    for rel in corpus.heldout_files():
        text = corpus.read_text(rel)

``python -m deepinfer.corpus`` prints the split's sizes for the running Python.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

EXCLUDED_DIR_NAMES = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
HELDOUT_MODULUS = 10


def stdlib_root() -> Path:
    """Directory of the running interpreter's pure-Python standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(rel_path: str) -> bool:
    """True when ``rel_path`` (POSIX, relative to the stdlib root) belongs to the held-out set."""
    return hashlib.sha1(rel_path.encode("utf-8")).digest()[0] % HELDOUT_MODULUS == 0


def _is_excluded(rel_path: str) -> bool:
    parts = rel_path.split("/")
    return any(part in EXCLUDED_DIR_NAMES for part in parts[:-1])


def all_files(root: str | os.PathLike[str] | None = None) -> list[str]:
    """Every corpus file (train and held-out) that exists under ``root``, sorted relative POSIX paths."""
    base = Path(root) if root is not None else stdlib_root()
    if not base.is_dir():
        return []
    out: list[str] = []
    for dirpath, dirnames, filenames in os.walk(base):
        # Prune excluded directories early (os.walk honours in-place edits of dirnames).
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIR_NAMES]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            full = Path(dirpath, name)
            if not full.is_file():  # dangling symlinks and the like
                continue
            rel = full.relative_to(base).as_posix()
            if not _is_excluded(rel):
                out.append(rel)
    out.sort()
    return out


def train_files(root: str | os.PathLike[str] | None = None) -> list[str]:
    """Corpus files that may be trained on (sorted relative POSIX paths)."""
    return [p for p in all_files(root) if not is_heldout(p)]


def heldout_files(root: str | os.PathLike[str] | None = None) -> list[str]:
    """Held-out evaluation files; never train on these (sorted relative POSIX paths)."""
    return [p for p in all_files(root) if is_heldout(p)]


def read_text(
    path: str | os.PathLike[str],
    root: str | os.PathLike[str] | None = None,
    *,
    missing_ok: bool = False,
) -> str | None:
    """Contents of a corpus file as ``str``.

    ``path`` is relative to ``root`` (default: the stdlib root) or absolute. Bytes are decoded as
    UTF-8 with invalid sequences replaced, and ``\\r\\n`` is kept as-is (no newline translation), so
    the result does not depend on the platform. A missing file raises ``FileNotFoundError``, or
    returns ``None`` when ``missing_ok`` is true.
    """
    p = Path(path)
    if not p.is_absolute():
        p = (Path(root) if root is not None else stdlib_root()) / p
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        if missing_ok:
            return None
        raise FileNotFoundError(f"corpus file not found: {p}") from None
    return data.decode("utf-8", errors="replace")


def iter_texts(paths: list[str], root: str | os.PathLike[str] | None = None):
    """Yield the text of each existing file in ``paths`` (missing files are skipped)."""
    for rel in paths:
        text = read_text(rel, root, missing_ok=True)
        if text is not None:
            yield text


if __name__ == "__main__":
    tr, ho = train_files(), heldout_files()
    size = lambda ps: sum((stdlib_root() / p).stat().st_size for p in ps)  # noqa: E731
    print(f"root={stdlib_root()}")
    print(f"train:   {len(tr)} files, {size(tr) / 1e6:.2f} MB")
    print(f"heldout: {len(ho)} files, {size(ho) / 1e6:.2f} MB")
