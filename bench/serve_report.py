"""Tabulate `bench/serve_sweep.sh` results: one row per (input length, concurrency, engine mode, loop, repeat), with
ratios to the synchronous loop of the same mode and repeat and to the engine thread with the same loop.

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
        # {mode}_{loop}_{input}_{concurrency}[_r{repeat}].json; files without the mode are older runs, all thread
        # mode.
        m = re.fullmatch(r"(?:(thread|process)_)?(async|sync)_(\d+)_(\d+)(?:_r(\d+))?\.json", f.name)
        if m:
            runs[(m[1] or "thread", m[2], int(m[3]), int(m[4]), int(m[5] or 1))] = json.loads(f.read_text())
    repeats = len({k[4] for k in runs}) > 1
    lines = ["# deepinfer serve, demo model: engine thread vs engine process, sync vs async scheduling, under "
             "`deepinfer bench serve`\n"]
    if a.header:
        lines.append(a.header + "\n")
    lines += ["| input/output | concurrency | engine | loop |" + (" run |" if repeats else "") + " output tok/s | / sync | "
              "/ thread | TPOT mean ms | TPOT p99 ms | TTFT mean ms | ITL median ms | completed |",
              "|---|---|---|---|" + ("---|" if repeats else "") + "---|---|---|---|---|---|---|---|"]
    for key in sorted(runs, key=lambda k: (k[2], k[3], k[0] != "thread", k[1] != "sync", k[4])):
        mode, loop, in_len, c, rep = key
        r = runs[key]

        def ratio(base_key) -> str:
            base = runs.get(base_key)
            return f"{r['output_throughput'] / base['output_throughput']:.2f}" if base else ""

        lines.append(f"| {in_len}/128 | {c} | {mode} | {loop} | " + (f"{rep} | " if repeats else "")
                     + f"{r['output_throughput']:.0f} | "
                     f"{ratio((mode, 'sync', in_len, c, rep))} | {ratio(('thread', loop, in_len, c, rep))} | "
                     f"{r['mean_tpot_ms']:.2f} | {r['p99_tpot_ms']:.2f} | {r['mean_ttft_ms']:.1f} | "
                     f"{r['median_itl_ms']:.2f} | {r['completed']}/{r['num_prompts']} |")
    text = "\n".join(lines) + "\n"
    Path(a.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
