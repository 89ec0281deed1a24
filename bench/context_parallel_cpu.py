"""Context parallelism on the CPU: what can be measured without GPUs.

    PYTHONPATH=. python bench/context_parallel_cpu.py            # writes bench/results/context_parallel_cpu.md

1. Balance, counted: per-rank attention FLOPs of a long prefill's chunks with V4-Flash's shapes, zigzag vs a
   contiguous split (``model/parallel/context.py``). Per query at position p and per layer: the 128-key
   window (QK and PV: 4·H·D per key), HCA's (p+1)/128 entries, CSA's indexer over (p+1)/4 index keys
   (2·Hi·Di each) and its top-k entries. A step waits for its slowest rank, so the figure of merit is
   max/mean per chunk and the prefill's critical path (sum over chunks of the slowest rank) against the
   ideal (total / cp). Token-wise work (projections, MoE) is the same on every rank under both splits.
2. Wall time, measured: one long prompt prefilled by the demo model's engine in one process vs a DP2 world
   with CP2 (one thread per rank), time to the first token, and the greedy tokens compared.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepinfer.assets import demo_model_dir, shapes_dir  # noqa: E402
from deepinfer.config.model import CSA, HCA, ModelConfig  # noqa: E402
from deepinfer.model.parallel.context import contiguous_split, zigzag_split  # noqa: E402


def attention_flops(cfg: ModelConfig, positions: np.ndarray) -> float:
    """Attention FLOPs of queries at ``positions`` summed over the model's layers (see the module docstring)."""
    p1 = positions.astype(np.float64) + 1
    h, d = cfg.num_attention_heads, cfg.head_dim
    per_key = 4.0 * h * d
    window = np.minimum(p1, cfg.sliding_window)
    total = 0.0
    for kind, m in zip(cfg.layer_types, cfg.layer_compress_ratios):
        keys = window.copy()
        if kind == HCA:
            keys += np.floor(p1 / m)
        elif kind == CSA:
            n = np.floor(p1 / m)
            keys += np.minimum(n, cfg.index_topk)
            total += float((2.0 * cfg.index_n_heads * cfg.index_head_dim * n).sum())
        total += float((per_key * keys).sum())
    return total


def balance(cfg: ModelConfig, prompt: int, chunk: int, cp: int) -> dict:
    rows = {}
    for name, split in (("zigzag", zigzag_split), ("contiguous", contiguous_split)):
        per_chunk, critical, total = [], 0.0, 0.0
        for first in range(0, prompt, chunk):
            length = min(chunk, prompt - first)
            work = [attention_flops(cfg, first + s) for s in split(length, cp)]
            per_chunk.append(max(work) / (sum(work) / cp))
            critical += max(work)
            total += sum(work)
        rows[name] = {"first_chunk": per_chunk[0], "last_chunk": per_chunk[-1], "worst": max(per_chunk),
                      "critical_over_ideal": critical / (total / cp), "total_tflop": total / 1e12}
    return rows


def _engine_run(args: dict, prompt: list[int]) -> tuple[float, list[int], int]:
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.sampling import SamplingParams

    engine = LLMEngine.from_engine_args(**args)
    try:
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        best, tokens = float("inf"), None
        for rep in range(3):  # the first warms up (allocations, thread pools)
            engine.add_request(f"w{rep}", {"prompt_token_ids": prompt}, params)
            start, first = time.perf_counter(), None
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if first is None and out.outputs[0].token_ids:
                        first = time.perf_counter() - start
                    if out.finished:
                        tokens = list(out.outputs[0].token_ids)
            if rep:
                best = min(best, first)
        return best, tokens, getattr(engine, "context_parallel_chunks", 0)
    finally:
        engine.close()


def wall_time(prompt_len: int, budget: int) -> dict:
    rng = random.Random(0)
    prompt = [rng.randrange(3, 4096) for _ in range(prompt_len)]
    args = dict(model=str(demo_model_dir()), device="cpu", dtype="float32", block_size=128, max_num_seqs=4,
                max_num_batched_tokens=budget, max_model_len=prompt_len + 256,
                num_cache_blocks=prompt_len // 128 + 8, load_progress=False,
                enable_prefix_caching=False)  # every run computes the whole prompt
    torch.set_num_threads(1)
    one, t1, _ = _engine_run(args, prompt)
    two, t2, chunks = _engine_run(dict(args, data_parallel_size=2, context_parallel_size=2,
                                       context_parallel_min_tokens=256), prompt)
    return {"prompt": prompt_len, "budget": budget, "single_s": one, "cp2_s": two, "speedup": one / two,
            "same_tokens": t1 == t2, "cp_chunks_per_run": chunks // 3}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=131072, help="prompt tokens of the balance count")
    p.add_argument("--chunk", type=int, default=8192, help="prefill chunk (step budget) of the balance count")
    p.add_argument("--wall-prompt", type=int, default=4096, help="prompt tokens of the demo-model timing")
    p.add_argument("--wall-budget", type=int, default=1024, help="step budget of the demo-model timing")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "context_parallel_cpu.md"))
    a = p.parse_args(argv)
    cfg = ModelConfig.from_model_dir(str(shapes_dir("v4-flash")))
    lines = ["# Context parallelism on the CPU: balance (counted) and a long prefill (timed)", "",
             f"Command: `PYTHONPATH=. python bench/context_parallel_cpu.py --prompt {a.prompt} --chunk {a.chunk} "
             f"--wall-prompt {a.wall_prompt} --wall-budget {a.wall_budget}`", "",
             f"## Per-rank attention FLOPs, V4-Flash shapes ({cfg.num_hidden_layers} layers), counted", "",
             "max/mean of the ranks' attention FLOPs per chunk (1.0 = perfectly balanced); critical path = sum "
             "over chunks of the slowest rank / (total / cp).", ""]
    for prompt, chunk in ((a.prompt, a.chunk), (a.prompt // 4, a.prompt // 4)):
        lines += [f"Prompt {prompt} tokens in chunks of {chunk} ({-(-prompt // chunk)} chunks):", "",
                  "| cp | split | first chunk | last chunk | worst chunk | critical path / ideal |",
                  "|---:|---|---:|---:|---:|---:|"]
        for cp in (2, 4, 8):
            for name, r in balance(cfg, prompt, chunk, cp).items():
                lines.append(f"| {cp} | {name} | {r['first_chunk']:.4f} | {r['last_chunk']:.4f} | {r['worst']:.4f} | "
                             f"{r['critical_over_ideal']:.4f} |")
        lines.append("")
        print("\n".join(lines[-9:]), flush=True)
    lines += ["Zigzag balances a cost linear in the position exactly; V4's per-query attention cost is linear only "
              "once the window (128 keys) and CSA's top-k (512 entries, from position 2047 on) are full, so in the "
              "first chunk the rank holding the chunk's first piece has less work (max/mean above 1 there, the same "
              "for every cp: the heaviest ranks' pieces all lie past the saturation). Later chunks, and the "
              "prefill's critical path, are balanced to within a fraction of a percent; the contiguous split "
              "leaves the last rank up to 40 % above the mean on a long chunk.", ""]
    load = os.getloadavg()[0]  # the timing below shares the machine with whatever else runs
    w = wall_time(a.wall_prompt, a.wall_budget)
    lines += ["## Wall time of a long prefill on the demo model (float32, CPU, one thread per rank)", "",
              f"One prompt of {w['prompt']} tokens, chunks of {w['budget']}; time to its first token, best of two "
              f"after a warm-up run. {os.cpu_count()} cores, load average {load:.1f} when it started.", "",
              "| engine | seconds | speed-up |", "|---|---:|---:|",
              f"| one process | {w['single_s']:.3f} | 1.00 |",
              f"| DP2 + CP2 (2 processes, gloo) | {w['cp2_s']:.3f} | {w['speedup']:.2f} |", "",
              f"Chunks split over the CP group per run: {w['cp_chunks_per_run']}; greedy tokens identical: "
              f"{w['same_tokens']}. The demo model is tiny (hidden 256, 6 layers): per chunk and layer the CP "
              "step adds an all-gather of the chunk's rows, a broadcast of the owner's history and, after the "
              "last layer, an all-gather of the final streams, which on gloo costs a visible share of these "
              "small steps. The machine's cores are shared with other jobs: expect noise of tens of percent.",
              ""]
    out = Path(a.out)
    kept = out.read_text().split("\n## History broadcast per chunk", 1) if out.exists() else []
    if len(kept) == 2:  # bench/cp_history_bytes.py's section: its own command writes it
        lines += ["## History broadcast per chunk" + kept[1].rstrip("\n"), ""]
    out.write_text("\n".join(lines))
    print("\n".join(lines[-9:]))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
