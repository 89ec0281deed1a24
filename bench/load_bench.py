"""Load a truncated V4-Flash-shaped checkpoint in the native format through the engine's loader.

    python bench/load_bench.py [--layers 4] [--experts 256] [--dir /tmp/flash_ckpt] [--shard-gb 4]
                               [--device cuda|cpu] [--layout triton|ref] [--runs warm,cold,dummy] [--reuse]
                               [--profile 25] [--out bench/results/load.json]

Writes the checkpoint first (``make_checkpoint.write_dummy_checkpoint``: the dummy weights, generated on
--device, in shards of --shard-gb; --reuse keeps a checkpoint already in --dir written from the same config),
then loads it in a fresh process per run with ``load_model(..., ops=...)`` (quantized-first, streamed one
shard at a time into the FP4 experts' layout: --layout triton, the Triton kernels' tile-major placed codes,
or ref, the checkpoint's layout) and reports the load time, GB/s of checkpoint bytes, peak host RSS above the
process's baseline (after CUDA is initialized), and the model's device bytes against the checkpoint's (no
dequantized copy: they must agree up to the FP8 scales stored as fp32). Runs: "warm" (files in the page
cache, right after writing), "cold" (each file's cached pages dropped first with posix_fadvise(DONTNEED),
so the shards are read from the disk) and, for comparison, the same model with ``load_format="dummy"`` (no
files). --profile N: the warm run under cProfile, its N costliest functions (cumulative time) printed.

On --device cpu the op table is REF with the FP4 layout of --layout (``ops/fp4_layout.py``, the Triton
table's host-side transform, plain torch): the loader's host work, timed without a GPU (the layout's
arithmetic included, which a GPU does on the device). --experts N (fewer routed experts than V4-Flash's
256) and --layers keep such a checkpoint small enough for the host's memory; its peak RSS includes the
model itself, which lives in host memory there.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RUN = r"""
import cProfile, dataclasses, io, json, pstats, resource, sys, time, torch
from deepinfer.config import ModelConfig
from deepinfer.model.loader import load_model
path, run, device, layout, top = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
cuda = device == "cuda"
if cuda:
    from deepinfer.ops.table import triton_ops
    torch.zeros(1, device="cuda"); ops = triton_ops()
else:
    from deepinfer.ops import fp4_layout
    from deepinfer.ops.table import REF
    ops = dataclasses.replace(REF, name="ref-" + layout, fp4_expert_layout=fp4_layout.expert_layout) \
        if layout == "triton" else REF
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
def sync(): torch.cuda.synchronize() if cuda else None
base = rss()
prof = cProfile.Profile() if top else None
sync(); t = time.perf_counter()
prof and prof.enable()
if run == "dummy":
    model = load_model(None, dtype=torch.bfloat16, device=device, cfg=ModelConfig.from_model_dir(path),
                       load_format="dummy", ops=ops, progress=False)
else:
    model = load_model(path, dtype=torch.bfloat16, device=device, ops=ops, progress=False)
sync(); secs = time.perf_counter() - t
prof and prof.disable()
if prof:
    text = io.StringIO(); pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(top)
    print(text.getvalue(), file=sys.stderr)
seen = {}
for p in [*model.parameters(), *model.buffers()]:
    seen[p.untyped_storage().data_ptr()] = (p.untyped_storage().nbytes(), p.dtype)
fp32 = sum(n for n, d in seen.values() if d == torch.float32)
print(json.dumps({"seconds": secs, "peak_rss_above_base": rss() - base, "device_bytes": sum(n for n, _ in seen.values()),
                  "device_fp32_bytes": fp32, "gpu_peak_bytes": torch.cuda.max_memory_allocated() if cuda else 0}))
"""

RUNS = ("warm", "cold", "dummy")


def drop_cache(path: Path) -> None:
    for f in path.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def checkpoint(path: Path, config: dict, shard_gb: float, device: str, reuse: bool) -> tuple[int, float]:
    """(bytes of the checkpoint's tensors, seconds spent writing it: 0 when an identical one was reused)."""
    from deepinfer.testing.make_checkpoint import write_dummy_checkpoint

    shards, written = sorted(path.glob("*.safetensors")), path / "config.json"
    if reuse and shards and written.is_file() and json.loads(written.read_text()) == config:
        from safetensors import safe_open

        total = 0
        for f in shards:
            with safe_open(str(f), framework="pt") as h:
                total += sum(_nbytes(h.get_slice(k)) for k in h.keys())
        return total, 0.0
    t = time.perf_counter()
    total = write_dummy_checkpoint(path, config, seed=0, shard_max_bytes=int(shard_gb * 1e9), device=device)
    return total, time.perf_counter() - t


def _nbytes(view) -> int:
    from deepinfer.model.ckpt_files import _DTYPES

    n = 1
    for s in view.get_shape():
        n *= s
    return n * _DTYPES[view.get_dtype()].itemsize


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--layers", type=int, default=4)
    a.add_argument("--experts", type=int, default=None, help="routed experts a layer (default: V4-Flash's)")
    a.add_argument("--dir", default="/tmp/flash_ckpt")
    a.add_argument("--shard-gb", type=float, default=4.0)
    a.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a.add_argument("--layout", choices=("triton", "ref"), default="triton",
                   help="the FP4 experts' layout on --device cpu (cuda: always the Triton table's)")
    a.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    a.add_argument("--reuse", action="store_true", help="keep a checkpoint of the same config already in --dir")
    a.add_argument("--profile", type=int, default=0, help="print the warm run's N costliest functions")
    a.add_argument("--out", default=None)
    args = a.parse_args()
    runs = args.runs.split(",")
    if not runs or any(r not in RUNS for r in runs):
        raise SystemExit(f"--runs: expected a comma-separated list of {', '.join(RUNS)}, got {args.runs!r}")
    if args.layout == "ref" and args.device == "cuda":
        raise SystemExit("--layout: ref is for --device cpu; the Triton table on cuda lays experts out its own way")
    from bench.layer_sweep import FLASH

    config = {**FLASH, "num_hidden_layers": args.layers, "compress_ratios": FLASH["compress_ratios"][: args.layers]}
    if args.experts is not None:
        config["n_routed_experts"] = args.experts
    path = Path(args.dir)
    total, write_s = checkpoint(path, config, args.shard_gb, args.device, args.reuse)
    shards = sorted(f.stat().st_size for f in path.glob("*.safetensors"))
    result = {"layers": args.layers, "experts": config.get("n_routed_experts"), "device": args.device,
              "layout": args.layout if args.device == "cpu" else "triton", "checkpoint_bytes": total,
              "shards": len(shards), "largest_shard": shards[-1], "write_seconds": write_s}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for run in runs:
        if run == "cold":
            drop_cache(path)
        top = args.profile if run == "warm" else 0
        out = subprocess.run([sys.executable, "-c", RUN, str(path), run, args.device, args.layout, str(top)],
                             env=env, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-4000:])
        if top:
            print(out.stderr, flush=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r["gb_per_s"] = total / r["seconds"] / 1e9
        result[run] = r
        print(run, json.dumps(r), flush=True)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
