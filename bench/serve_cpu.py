"""CPU time per streamed token of each process of a served run: the API server, the engine core and the
`deepinfer bench serve` client, read from /proc/<pid>/stat around each run. It answers which process is the
bottleneck: one near 100% of a core caps what the others can do.

    python bench/serve_cpu.py [--runs 64:128 256:512] [--input-len 512] [--output-len 128] [--spy 6] [--clients N]
                              [--server-args "--max-num-seqs 256 --max-model-len 2048"] [--out /tmp/serve_cpu]

Starts `deepinfer serve` itself, warms it up (64 requests), then runs one benchmark per ``--runs`` entry
(concurrency:prompts, random prompts, --ignore-eos). ``--spy S``: py-spy records S seconds of every
process during the last run (raw collapsed stacks in --out; needs the py-spy binary). Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
            except OSError:  # gone meanwhile
                pass
    return out


def start_server(port: int, args: list[str], log: Path) -> subprocess.Popen:
    server = subprocess.Popen([sys.executable, "-m", "deepinfer.server", "--port", str(port), *args],
                              stdout=log.open("w"), stderr=subprocess.STDOUT)
    for _ in range(1200):
        if server.poll() is not None:
            raise SystemExit(f"the server exited; see {log}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
            return server
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"the server did not come up; see {log}")


def bench(a, port: int, procs: dict[int, str], concurrency: int, prompts: int, output_len: int, name: str,
          spy: int | None = None) -> tuple[float, dict, dict[str, float]]:
    cmd = [sys.executable, "-m", "deepinfer.cli", "bench", "serve", "--base-url", f"http://127.0.0.1:{port}",
           "--backend", "openai", "--dataset-name", "random", "--random-input-len", str(a.input_len),
           "--random-output-len", str(output_len), "--random-range-ratio", "0", "--num-prompts", str(prompts),
           "--max-concurrency", str(concurrency), "--ignore-eos", "--seed", "0", "--disable-tqdm",
           "--save-result", "--result-dir", str(a.out), "--result-filename", name,
           "--num-client-processes", str(min(a.clients, concurrency))]
    before = {pid: cpu_seconds(pid) for pid in procs}
    t0 = time.time()
    client = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    spies = []
    if spy:
        time.sleep(4)  # into the steady state
        targets = [("client", client.pid)] + [(label, pid) for pid, label in procs.items()]
        spies = [subprocess.Popen([a.spy_bin, "record", "--nonblocking", "-r", "250", "-d", str(spy), "--format", "raw",
                                   "-o", str(a.out / f"spy_{label}.txt"), "--pid", str(pid)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for label, pid in targets]
    seen: dict[int, float] = {}  # the client's and its client processes' time, each read while it lives
    while client.poll() is None:
        for pid in [client.pid, *children(client.pid)]:
            try:
                seen[pid] = cpu_seconds(pid)
            except OSError:
                pass
        time.sleep(0.05)
    client_cpu = sum(seen.values())
    wall = time.time() - t0
    for s in spies:
        s.wait()
    result = json.loads((a.out / name).read_text())
    used = {label: cpu_seconds(pid) - before[pid] for pid, label in procs.items()}
    used["client"] = client_cpu
    return wall, result, used


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=["64:128"], help="concurrency:prompts per run")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--server-args", default="--max-num-seqs 256 --max-model-len 2048")
    p.add_argument("--port", type=int, default=8131)
    p.add_argument("--clients", type=int, default=1,
                   help="client processes (bench serve --num-client-processes); their CPU is summed as the client's")
    p.add_argument("--spy", type=int, default=None, help="py-spy seconds per process in the last run")
    p.add_argument("--spy-bin", default="py-spy")
    p.add_argument("--out", type=Path, default=Path("/tmp/serve_cpu"))
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    server = start_server(a.port, shlex.split(a.server_args), a.out / "server.log")
    try:
        procs = {server.pid: "api"}
        for pid in children(server.pid):  # the engine core (multiprocessing spawn) and its resource tracker
            procs[pid] = "core" if "spawn_main" in Path(f"/proc/{pid}/cmdline").read_text() else f"child{pid}"
        bench(a, a.port, procs, 64, 64, 16, "warm.json")
        for i, run in enumerate(a.runs):
            concurrency, prompts = map(int, run.split(":"))
            wall, result, used = bench(a, a.port, procs, concurrency, prompts, a.output_len, f"c{concurrency}.json",
                                       a.spy if i == len(a.runs) - 1 else None)
            tokens = result["total_output_tokens"]
            print(f"concurrency {concurrency}, {prompts} prompts: {result['output_throughput']:.0f} tok/s, "
                  f"TPOT {result['mean_tpot_ms']:.2f} ms | " + " | ".join(
                      f"{label} {1e6 * s / tokens:.0f} us/token ({100 * s / wall:.0f}% of a core)"
                      for label, s in used.items()), flush=True)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
