"""CPU engine benchmark on the bundled demo model: decode throughput and per-step overhead at batch 1/16/64.

    python bench/cpu_engine.py [--batches 1 16 64] [--tokens 32] [--out bench/results]

For each batch size B: B greedy requests with short prompts, each generating --tokens tokens
(ignore_eos). Reported per decode step: wall time, time in the model forward (incl. logits), time in the
sampler, and the rest (scheduling, cache bookkeeping, detokenization, output building) = Python overhead.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

import torch

from deepinfer import LLMEngine, SamplingParams


class Timers:
    def __init__(self) -> None:
        self.model = 0.0
        self.sampler = 0.0

    def wrap(self, obj, name: str, bucket: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                setattr(self, bucket, getattr(self, bucket) + time.perf_counter() - t)

        setattr(obj, name, timed)


def run(batch: int, tokens: int) -> dict:
    engine = LLMEngine.from_engine_args(device="cpu", load_progress=False, block_size=128, max_num_seqs=max(batch, 1),
                                        max_num_batched_tokens=4096)
    timers = Timers()
    timers.wrap(engine.runner.model, "forward", "model")
    timers.wrap(engine.runner.model, "logits", "model")
    timers.wrap(engine.runner, "sampler", "sampler")
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{i}", f"def function_{i}(x):", params)
    engine.step()  # prefill step, not counted
    timers.model = timers.sampler = 0.0
    steps, generated = 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        generated += sum(1 for o in outs for _ in o.outputs)
    wall = time.perf_counter() - t0
    per_step = wall / steps
    return {
        "batch": batch, "decode_steps": steps, "tokens_generated": generated,
        "tokens_per_s": generated / wall, "step_ms": per_step * 1e3,
        "model_ms": timers.model / steps * 1e3, "sampler_ms": timers.sampler / steps * 1e3,
        "overhead_ms": (wall - timers.model - timers.sampler) / steps * 1e3,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = p.parse_args()
    rows = [run(b, a.tokens) for b in a.batches]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(), "torch": torch.__version__}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu_engine.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = ["# CPU engine benchmark (demo model)\n", f"{meta}\n",
             "| batch | tok/s | step ms | model ms | sampler ms | overhead ms |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['tokens_per_s']:.1f} | {r['step_ms']:.2f} | {r['model_ms']:.2f} | "
                     f"{r['sampler_ms']:.2f} | {r['overhead_ms']:.2f} |")
    text = "\n".join(lines) + "\n"
    (out / "cpu_engine.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
