"""Benchmark prompts: random token ids, a JSONL file, or a ShareGPT conversation dump.

Every loader returns :class:`BenchRequest` items whose ``prompt_len`` is counted with the benchmark's
tokenizer and whose ``output_len`` is the number of tokens to ask for. All randomness comes from a numpy
generator seeded with ``--seed``, so the same seed gives the same prompts in the same order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from deepinfer.tokenizer import Tokenizer

DATASETS = ("random", "jsonl", "sharegpt")
# ShareGPT dumps name the speakers either way depending on who exported them.
_HUMAN = frozenset({"human", "user"})
_ASSISTANT = frozenset({"gpt", "assistant", "chatgpt", "bard"})


@dataclass(frozen=True)
class BenchRequest:
    """One prompt to send. ``prompt`` is text, or token ids that the completions endpoint takes as they are
    (no BOS added), which makes the server's input length exactly ``prompt_len``."""

    prompt: str | tuple[int, ...]
    prompt_len: int
    output_len: int


def draw_lengths(rng: np.random.Generator, center: int, range_ratio: float, count: int,
                 minimum: int = 1) -> list[int]:
    """``count`` lengths drawn uniformly from the integers in
    [floor(center * (1 - ratio)), ceil(center * (1 + ratio))], never below ``minimum``."""
    low = max(minimum, math.floor(center * (1.0 - range_ratio)))
    high = max(low, math.ceil(center * (1.0 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=count)]


def _ordinary_ids(tokenizer: Tokenizer) -> np.ndarray:
    # Special tokens (BOS, chat markers, ...) would change what the server does with the prompt, not
    # only how long it is, so random prompts avoid them.
    special = np.fromiter(sorted(tokenizer.special_ids), dtype=np.int64)
    return np.setdiff1d(np.arange(tokenizer.vocab_size, dtype=np.int64), special)


def _text_of_length(tokenizer: Tokenizer, ids: list[int], target: int, rng: np.random.Generator,
                    vocab: np.ndarray) -> tuple[str, int]:
    """Text whose re-encoding has (nearly always) ``target`` tokens. Decoding random ids and encoding the
    text again rarely gives the same ids (byte fragments become U+FFFD, neighbours merge), so the ids are
    trimmed or topped up from the re-encoding until the count settles. Returns the text and its count."""
    text = tokenizer.decode(ids, skip_special_tokens=False)
    for _ in range(10):
        again = tokenizer.encode(text)
        if len(again) == target:
            break
        if len(again) > target:
            ids = again[:target]
        else:
            ids = again + [int(i) for i in rng.choice(vocab, target - len(again))]
        text = tokenizer.decode(ids, skip_special_tokens=False)
    return text, len(tokenizer.encode(text))


def random_requests(tokenizer: Tokenizer, num_prompts: int, input_len: int, output_len: int, *,
                    range_ratio: float = 0.0, prefix_len: int = 0, seed: int = 0,
                    as_text: bool = False) -> list[BenchRequest]:
    """Prompts of random ordinary token ids. Each prompt is a shared random prefix of ``prefix_len`` tokens
    (the same for every prompt, to exercise prefix reuse) followed by its own random part, whose length is
    drawn around ``input_len``; output lengths are drawn around ``output_len`` with the same ratio.

    With ``as_text`` (chat endpoints take no token ids) the ids are decoded to text whose token count is
    brought back to the drawn length; ``prompt_len`` is then the count of that text."""
    rng = np.random.default_rng(seed)
    vocab = _ordinary_ids(tokenizer)
    in_lens = draw_lengths(rng, input_len, range_ratio, num_prompts, minimum=0 if prefix_len else 1)
    out_lens = draw_lengths(rng, output_len, range_ratio, num_prompts)
    prefix = [int(i) for i in rng.choice(vocab, prefix_len)]
    requests = []
    for n_in, n_out in zip(in_lens, out_lens):
        ids = prefix + [int(i) for i in rng.choice(vocab, n_in)]
        if as_text:
            text, count = _text_of_length(tokenizer, ids, len(ids), rng, vocab)
            requests.append(BenchRequest(text, count, n_out))
        else:
            requests.append(BenchRequest(tuple(ids), len(ids), n_out))
    return requests


def _pick(rows: list[Any], num_prompts: int, seed: int, shuffle: bool) -> list[Any]:
    # A seeded shuffle samples across the whole file (dumps are often sorted by source or length).
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(rows))
        rows = [rows[i] for i in order]
    return rows[:num_prompts]


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: expected a positive integer, got {value!r}")
    return value


def jsonl_requests(path: str | Path, tokenizer: Tokenizer, num_prompts: int, *, default_output_len: int,
                   prompt_field: str = "prompt", output_len_field: str = "output_len", seed: int = 0,
                   shuffle: bool = True) -> list[BenchRequest]:
    """One JSON object per line: ``prompt_field`` (text) and optionally ``output_len_field`` (a positive
    integer; rows without it ask for ``default_output_len``). Blank lines are skipped."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get(prompt_field), str):
                raise ValueError(f"{where}: expected an object with a string {prompt_field!r} field")
            out = obj.get(output_len_field)
            out = default_output_len if out is None else _positive_int(out, f"{where}: {output_len_field}")
            rows.append((obj[prompt_field], out))
    if not rows:
        raise ValueError(f"{path}: no prompts (expected one JSON object per line)")
    chosen = _pick(rows, num_prompts, seed, shuffle)  # tokenize only what is sent
    lens = [len(ids) for ids in tokenizer.encode_batch([prompt for prompt, _ in chosen])] if chosen else []
    return [BenchRequest(prompt, n_in, n_out) for (prompt, n_out), n_in in zip(chosen, lens)]


def _first_turns(conversation: Sequence[Any]) -> tuple[str | None, str | None]:
    """The first human turn and the first assistant turn after it."""
    prompt = answer = None
    for turn in conversation:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            continue
        speaker = str(turn.get("from", "")).lower()
        if prompt is None and speaker in _HUMAN:
            prompt = turn["value"]
        elif prompt is not None and speaker in _ASSISTANT:
            answer = turn["value"]
            break
    return prompt, answer


def sharegpt_requests(path: str | Path, tokenizer: Tokenizer, num_prompts: int, *, output_len: int | None = None,
                      seed: int = 0, shuffle: bool = True) -> list[BenchRequest]:
    """A ShareGPT JSON file: a list of entries with ``conversations`` ([{"from": "human", "value": ...},
    {"from": "gpt", "value": ...}, ...]). The first human turn is the prompt; the output length is the
    token count of the first assistant turn, or ``output_len`` when given. Entries without a usable
    prompt or answer are skipped."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    rows = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        prompt, answer = _first_turns(turns) if isinstance(turns, list) else (None, None)
        if prompt and (answer or output_len is not None):
            rows.append((prompt, answer))
    if not rows:
        raise ValueError(f"{path}: no conversation has a human turn followed by an assistant turn")
    chosen = _pick(rows, num_prompts, seed, shuffle)  # tokenize only what is sent
    in_lens = [len(ids) for ids in tokenizer.encode_batch([prompt for prompt, _ in chosen])]
    if output_len is not None:
        out_lens = [output_len] * len(chosen)
    else:  # a non-empty answer has at least one token
        out_lens = [max(1, len(ids)) for ids in tokenizer.encode_batch([answer for _, answer in chosen])]
    return [BenchRequest(prompt, n_in, n_out) for (prompt, _), n_in, n_out in zip(chosen, in_lens, out_lens)]
