"""Tabulate `bench/serve_sweep.sh` results: one row per (input length, concurrency), async against sync.

    python bench/serve_report.py DIR [--out bench/results/serve_demo.md]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "serve_demo.md"))
    p.add_argument("--header", default="", help="lines to put above the table (date, commit, device, command)")
    a = p.parse_args()
    runs = {}
    for f in Path(a.dir).glob("*.json"):
        m = re.fullmatch(r"(async|sync)_(\d+)_(\d+)\.json", f.name)
        if m:
            runs[(m[1], int(m[2]), int(m[3]))] = json.loads(f.read_text())
    lines = ["# deepinfer serve, demo model: async vs sync scheduling under `deepinfer bench serve`\n"]
    if a.header:
        lines.append(a.header + "\n")
    lines += ["| input/output | concurrency | loop | output tok/s | async / sync | TPOT mean ms | TPOT p99 ms | "
              "TTFT mean ms | ITL median ms | completed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for (loop, in_len, c) in sorted(runs, key=lambda k: (k[1], k[2], k[0] != "sync")):
        r = runs[(loop, in_len, c)]
        base = runs.get(("sync", in_len, c))
        ratio = f"{r['output_throughput'] / base['output_throughput']:.2f}" if base else ""
        lines.append(f"| {in_len}/128 | {c} | {loop} | {r['output_throughput']:.0f} | {ratio} | {r['mean_tpot_ms']:.2f} | "
                     f"{r['p99_tpot_ms']:.2f} | {r['mean_ttft_ms']:.1f} | {r['median_itl_ms']:.2f} | "
                     f"{r['completed']}/{r['num_prompts']} |")
    text = "\n".join(lines) + "\n"
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
