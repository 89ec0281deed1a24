"""Expert-parallel load balancing: how much flatter the per-rank expert load gets.

    python bench/eplb_balance.py                       # both parts, results into bench/results/eplb_cpu.md
    python bench/eplb_balance.py --skip-engine         # the placement part only (seconds)

1. placement (pure, V4-Flash's 256 routed experts): the balancedness (mean / max load per rank) that the
   static contiguous placement and the greedy rebalance (``balanced_placement``) give on skewed synthetic
   loads (Zipf popularity in a shuffled order), for several EP sizes and redundant-slot counts;
2. engine (measured): the demo model (trained; its own routing, no forced skew) served by a 2-process DP2 +
   EP engine on the CPU with EPLB on, prompts from held-out standard-library files: the balancedness each
   rebalance measured under the placement it replaced (the first under the static one), and the rebalance
   wall time (gather, plan, weight moves over gloo).
"""

from __future__ import annotations

import argparse
import datetime
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepinfer.model.parallel.placement import (balanced_placement, balancedness, rank_loads,  # noqa: E402
                                                static_placement)


def _zipf(n: int, s: float, seed: int) -> list[float]:
    loads = [1e6 / (i + 1) ** s for i in range(n)]
    random.Random(seed).shuffle(loads)
    return loads


def placement_table(seeds: int = 5) -> list[str]:
    rows = ["| Zipf s | EP ranks | redundant | static | static + redundant | rebalanced |", "|---|---|---|---|---|---|"]
    for s in (0.6, 1.0, 1.4):
        for ranks, redundant in ((8, 8), (8, 32), (16, 16), (16, 32), (32, 32)):
            vals = [0.0, 0.0, 0.0]
            for seed in range(seeds):
                loads = _zipf(256, s, seed)
                vals[0] += balancedness(rank_loads(loads, static_placement(256, ranks))) / seeds
                vals[1] += balancedness(rank_loads(loads, static_placement(256, ranks, redundant))) / seeds
                vals[2] += balancedness(rank_loads(loads, balanced_placement(loads, ranks, redundant))) / seeds
            rows.append(f"| {s} | {ranks} | {redundant} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    return rows


def engine_table(num_prompts: int, max_tokens: int, interval: int, window: int) -> list[str]:
    import torch

    from deepinfer import corpus
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.sampling import SamplingParams

    nonempty = (t for t in corpus.iter_texts(corpus.heldout_files()) if t.strip())
    texts = [t[:600] for _, t in zip(range(num_prompts), nonempty)]
    torch.set_num_threads(1)
    engine = LLMEngine.from_engine_args(
        device="cpu", dtype="bfloat16", data_parallel_size=2, enable_expert_parallel=True, load_progress=False,
        max_num_seqs=16, max_num_batched_tokens=256, block_size=128, enable_eplb=True,
        eplb_config={"num_redundant_experts": 2, "window_size": window, "step_interval": interval})
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, text in enumerate(texts):
            engine.add_request(f"r{i}", text, params)
        while engine.has_unfinished_requests():
            engine.step()
        history = list(engine.eplb.history)
    finally:
        engine.close()
    rows = ["| step | measured (under the placement replaced) | window under static | window: old -> new "
            "placement | slots moved | seconds |", "|---|---|---|---|---|---|"]
    rows += [f"| {h.step} | {h.measured:.3f} | {h.static:.3f} | {h.expected_before:.3f} -> {h.expected_after:.3f} | "
             f"{h.moved_slots} | {h.seconds:.3f} |" for h in history]
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-engine", action="store_true")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--step-interval", type=int, default=8)
    p.add_argument("--window-size", type=int, default=None, help="default: the step interval")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "eplb_cpu.md"))
    a = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    lines = [f"# EPLB balancedness ({datetime.date.today()}, commit {commit.strip()}, CPU)", "",
             "Balancedness = mean / max per-rank load (1.0 even). `python bench/eplb_balance.py`.", "",
             "## Placement on synthetic loads (256 experts; mean of 5 shuffles)", "", *placement_table()]
    if not a.skip_engine:
        window = a.window_size or a.step_interval
        lines += ["", f"## Demo model, DP2 + EP, 2 redundant slots, rebalance every {a.step_interval} steps, "
                  f"window {window} ({a.num_prompts} held-out stdlib prompts, {a.max_tokens} tokens each, bf16, "
                  "gloo)", "", "With window = interval, *measured* and *window under static* cover the same steps: "
                  "the replicated placement (chosen from the window before) against static on the same traffic.",
                  "", *engine_table(a.num_prompts, a.max_tokens, a.step_interval, window)]
    text = "\n".join(lines) + "\n"
    print(text)
    Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
