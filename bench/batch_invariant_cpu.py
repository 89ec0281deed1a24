"""What ``DEEPINFER_BATCH_INVARIANT=1`` costs on the CPU: engine throughput on the bundled demo model, mode off
against on, in one process, the rounds interleaved (off, on, off, on, ...) so that a busy machine slows
both alike; the best round of each is reported.

    python bench/batch_invariant_cpu.py [--batches 1 16] [--prompt-len 128] [--tokens 32] [--rounds 3]

Per batch size B: B greedy requests of --prompt-len random tokens each generating --tokens tokens
(ignore_eos), all submitted at once; prefill tokens/s (the first step) and decode tokens/s (the rest).
Writes ``bench/results/batch_invariant_cpu.{json,md}`` (or under --out).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from pathlib import Path

import torch

from deepinfer import LLMEngine, SamplingParams


def _engine(invariant: bool, batch: int) -> LLMEngine:
    old = os.environ.get("DEEPINFER_BATCH_INVARIANT")
    os.environ["DEEPINFER_BATCH_INVARIANT"] = "1" if invariant else "0"
    try:
        return LLMEngine.from_engine_args(device="cpu", load_progress=False, block_size=128, max_num_seqs=batch,
                                          max_num_batched_tokens=8192, max_model_len=1024,
                                          enable_prefix_caching=False)
    finally:
        if old is None:
            del os.environ["DEEPINFER_BATCH_INVARIANT"]
        else:
            os.environ["DEEPINFER_BATCH_INVARIANT"] = old


def _round(engine: LLMEngine, batch: int, prompt_len: int, tokens: int, seed: int) -> tuple[float, float]:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{seed}-{i}", {"prompt_token_ids": [rng.randrange(3, 4096) for _ in range(prompt_len)]},
                           params)
    t0 = time.perf_counter()
    engine.step()
    t1 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    t2 = time.perf_counter()
    return batch * prompt_len / (t1 - t0), batch * (tokens - 1) / (t2 - t1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args(argv)
    rows = []
    for b in args.batches:
        engines = {mode: _engine(mode, b) for mode in (False, True)}
        best = {mode: [0.0, 0.0] for mode in engines}
        for r in range(args.rounds):
            for mode, engine in engines.items():
                pre, dec = _round(engine, b, args.prompt_len, args.tokens, seed=r)
                best[mode] = [max(best[mode][0], pre), max(best[mode][1], dec)]
        off, on = best[False], best[True]
        rows.append({"batch": b, "prefill_tok_s_off": off[0], "prefill_tok_s_on": on[0],
                     "decode_tok_s_off": off[1], "decode_tok_s_on": on[1],
                     "prefill_ratio": on[0] / off[0], "decode_ratio": on[1] / off[1]})
        print(rows[-1], flush=True)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "processor": platform.processor(), "prompt_len": args.prompt_len, "tokens": args.tokens,
            "rounds": args.rounds}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "batch_invariant_cpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = ["# DEEPINFER_BATCH_INVARIANT on the CPU: demo-model engine throughput, mode off vs on", "",
             f"`python bench/batch_invariant_cpu.py` (torch {meta['torch']}, {meta['threads']} threads; prompts of "
             f"{args.prompt_len} tokens, {args.tokens} generated, greedy; best of {args.rounds} interleaved rounds).",
             "", "| batch | prefill tok/s off | on | on/off | decode tok/s off | on | on/off |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['prefill_tok_s_off']:.0f} | {r['prefill_tok_s_on']:.0f} | "
                     f"{r['prefill_ratio']:.2f} | {r['decode_tok_s_off']:.1f} | {r['decode_tok_s_on']:.1f} | "
                     f"{r['decode_ratio']:.2f} |")
    (out / "batch_invariant_cpu.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
