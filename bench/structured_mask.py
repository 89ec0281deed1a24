"""Per-token cost of structured-output masks on the CPU, at the demo vocabulary and at DeepSeek-V4's 129,280
tokens: llguidance (the engine's backend, through ``GrammarBackend``) and, for the choice of backend, xgrammar
side by side when it is installed (``pip install xgrammar``; not a dependency of the project).

    python bench/structured_mask.py [--tokens 300] [--backends llguidance xgrammar] [--out bench/results]

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


def walk_xgrammar(tokenizer_json: str, vocab_size: int, tokens: int, seed: int) -> list[float]:
    """``walk`` through xgrammar's own matcher: the same schema, whitespace as strict as llguidance's (none
    between tokens), one thread, masks into its int32 bitmask."""
    import tempfile

    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        f.write(tokenizer_json)
        f.flush()
        info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=f.name), vocab_size=vocab_size)
    grammar = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    rng = np.random.default_rng(seed)
    m, bitmask = xgr.GrammarMatcher(grammar), xgr.allocate_token_bitmask(1, vocab_size)
    times = []
    while len(times) < tokens:
        t = time.perf_counter()
        m.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - t)
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")[:vocab_size]
        allowed = np.flatnonzero(bits)
        if m.is_terminated() or len(allowed) == 0:
            m = xgr.GrammarMatcher(grammar)
            continue
        m.accept_token(int(rng.choice(allowed)))
        if m.is_terminated():
            m = xgr.GrammarMatcher(grammar)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=300)
    p.add_argument("--backends", nargs="+", default=["llguidance"], choices=["llguidance", "xgrammar"])
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = p.parse_args()
    rows = []
    for name, size in (("demo", 4096), ("V4-sized", V4_VOCAB)):
        tokenizer_json = _tokenizer_json(size)
        for engine in a.backends:
            if engine == "llguidance":
                backend = GrammarBackend(tokenizer_json, size, eos_token_id=1)
                grammar = backend.compile(StructuredOutputsParams(json=SCHEMA))
                run = lambda n, seed: walk(backend, grammar, n, seed)  # noqa: E731
            else:
                run = lambda n, seed: walk_xgrammar(tokenizer_json, size, n, seed)  # noqa: E731
            run(20, 1)  # warm-up
            us = sorted(t * 1e6 for t in run(a.tokens, 0))
            rows.append((engine, name, size, statistics.mean(us), us[len(us) // 2], us[int(len(us) * 0.99) - 1]))
            print(rows[-1], flush=True)
    lines = ["# Structured-output mask cost on the CPU (JSON schema)\n",
             f"`python bench/structured_mask.py --tokens {a.tokens} --backends {' '.join(a.backends)}`\n",
             "| backend | vocabulary | tokens | mean us/token | median | p99 |", "|---|---|---|---|---|---|"]
    lines += [f"| {e} | {n} | {s} | {m:.1f} | {md:.1f} | {p99:.1f} |" for e, n, s, m, md, p99 in rows]
    text = "\n".join(lines) + "\n"
    Path(a.out).mkdir(parents=True, exist_ok=True)
    Path(a.out, "structured_mask.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
