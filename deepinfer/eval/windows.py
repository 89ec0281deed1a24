"""The evaluation data: held-out stdlib files (:mod:`deepinfer.corpus`) cut into independent token windows."""

from __future__ import annotations

import math
import os
from pathlib import Path

from deepinfer import corpus


def heldout_windows(tokenizer, context: int, max_files: int | None = None, max_tokens: int | None = None,
                    root: str | os.PathLike[str] | None = None) -> list[list[int]]:
    """Token windows of the held-out files: ``[BOS] + file + [EOS]`` cut into ``context``-token pieces; at most
    ``max_tokens`` scored predictions in total (a window of L tokens scores L-1)."""
    return heldout_sample(tokenizer, context, max_files, max_tokens, root)[0]


def heldout_sample(tokenizer, context: int, max_files: int | None, max_tokens: int | None,
                   root: str | os.PathLike[str] | None) -> tuple[list[list[int]], int]:
    """(:func:`heldout_windows`, the number of files they come from)."""
    if context < 2:
        raise ValueError(f"context: must be >= 2, got {context}")
    base = Path(root) if root is not None else corpus.stdlib_root()
    files = corpus.heldout_files(base)[: max_files if max_files is not None else None]
    if not files:
        raise ValueError(f"no held-out files found under {base}")
    windows: list[list[int]] = []
    budget = max_tokens if max_tokens is not None else math.inf
    used = 0
    for rel in files:
        if budget <= 0:
            break
        used += 1
        text = corpus.read_text(rel, base)
        ids = [tokenizer.bos_id] + tokenizer.encode(text) + [tokenizer.eos_id]
        for start in range(0, len(ids), context):
            w = ids[start : start + context]
            if len(w) < 2 or budget <= 0:
                continue
            w = w[: int(min(len(w), budget + 1))]
            windows.append(w)
            budget -= len(w) - 1
    return windows, used
