"""Per-token cost of structured-output masks on the CPU (llguidance), at the demo vocabulary and at
DeepSeek-V4's 129,280 tokens.

    python bench/structured_mask.py [--tokens 300] [--out bench/results]

For each vocabulary: a JSON schema constraint, a random walk of --tokens steps through the grammar (each step
computes the next-token mask, then consumes a token the mask allows, chosen with a fixed seed). Reported: the
mask computation's mean / median / p99 in microseconds per token. The V4-sized vocabulary is the demo
tokenizer's plus synthetic byte-level tokens (random 2-8 character strings of the byte-level alphabet):
no V4 tokenizer ships with the project, and the mask's cost depends on how many tokens its walk visits.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import numpy as np

from deepinfer.assets import demo_model_dir
from deepinfer.structured import StructuredOutputsParams
from deepinfer.structured.backend import GrammarBackend

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "address"],
          "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 40},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
                         "address": {"type": "object", "required": ["city", "zip"],
                                     "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                         "pattern": "^[0-9]{5}$"}}}}}
V4_VOCAB = 129_280


def _tokenizer_json(vocab_size: int) -> str:
    tj = json.loads((demo_model_dir() / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    alphabet = sorted({c for tok in vocab for c in tok if len(tok) == 1})
    rng = random.Random(0)
    nxt = max(vocab.values()) + 1 + len(tj["added_tokens"])
    while len(vocab) + len(tj["added_tokens"]) < vocab_size:
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
        if s not in vocab:
            vocab[s] = nxt
            nxt += 1
    return json.dumps(tj)


def walk(backend: GrammarBackend, grammar: str, tokens: int, seed: int) -> list[float]:
    rng = np.random.default_rng(seed)
    m = backend.matcher(grammar)
    times = []
    while len(times) < tokens:
        t = time.perf_counter()
        (mask,) = backend.masks([m])
        times.append(time.perf_counter() - t)
        bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[: backend.vocab_size]
        allowed = np.flatnonzero(bits)
        if m.is_stopped() or len(allowed) == 0:
            m = backend.matcher(grammar)
            continue
        m.consume_token(int(rng.choice(allowed)))
        if m.is_stopped():
            m = backend.matcher(grammar)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = p.parse_args()
    rows = []
    for name, size in (("demo", 4096), ("V4-sized", V4_VOCAB)):
        backend = GrammarBackend(_tokenizer_json(size), size, eos_token_id=1)
        grammar = backend.compile(StructuredOutputsParams(json=SCHEMA))
        walk(backend, grammar, 20, 1)  # warm-up
        us = [t * 1e6 for t in walk(backend, grammar, a.tokens, 0)]
        us.sort()
        rows.append((name, size, statistics.mean(us), us[len(us) // 2], us[int(len(us) * 0.99) - 1]))
        print(rows[-1], flush=True)
    lines = ["# Structured-output mask cost on the CPU (llguidance, JSON schema)\n",
             f"`python bench/structured_mask.py --tokens {a.tokens}`\n",
             "| vocabulary | tokens | mean us/token | median | p99 |", "|---|---|---|---|---|"]
    lines += [f"| {n} | {s} | {m:.1f} | {md:.1f} | {p99:.1f} |" for n, s, m, md, p99 in rows]
    text = "\n".join(lines) + "\n"
    Path(a.out, "structured_mask.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
