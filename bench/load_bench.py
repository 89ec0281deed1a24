"""Load a truncated V4-Flash-shaped checkpoint in the native format through the engine's loader.

    python bench/load_bench.py [--layers 4] [--dir /tmp/flash_ckpt] [--shard-gb 4] [--out bench/results/load.json]

Writes the checkpoint first (``make_checkpoint.write_dummy_checkpoint``: the dummy weights, generated on the
GPU, in shards of --shard-gb), then loads it in a fresh process per run with ``load_model(..., ops=triton_ops())``
(quantized-first, streamed one shard at a time into the Triton layout) and reports the load time, GB/s of
checkpoint bytes, peak host RSS above the process's baseline (after CUDA is initialized), and the model's
device bytes against the checkpoint's (no dequantized copy: they must agree up to the FP8 scales stored as
fp32). Two runs: "warm" (files in the page cache, right after writing) and "cold" (each file's cached pages
dropped first with posix_fadvise(DONTNEED), so the shards are read from the disk). For comparison, the
same model with ``load_format="dummy"`` (no files).
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
import json, resource, sys, time, torch
from deepinfer.config import ModelConfig
from deepinfer.model.loader import load_model
from deepinfer.ops.table import triton_ops
torch.zeros(1, device="cuda"); ops = triton_ops()
def rss(): return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
base = rss()
torch.cuda.synchronize(); t = time.perf_counter()
if sys.argv[2] == "dummy":
    model = load_model(None, dtype=torch.bfloat16, device="cuda", cfg=ModelConfig.from_model_dir(sys.argv[1]),
                       load_format="dummy", ops=ops, progress=False)
else:
    model = load_model(sys.argv[1], dtype=torch.bfloat16, device="cuda", ops=ops, progress=False)
torch.cuda.synchronize(); secs = time.perf_counter() - t
seen = {}
for p in [*model.parameters(), *model.buffers()]:
    seen[p.untyped_storage().data_ptr()] = (p.untyped_storage().nbytes(), p.dtype)
fp32 = sum(n for n, d in seen.values() if d == torch.float32)
print(json.dumps({"seconds": secs, "peak_rss_above_base": rss() - base, "device_bytes": sum(n for n, _ in seen.values()),
                  "device_fp32_bytes": fp32, "gpu_peak_bytes": torch.cuda.max_memory_allocated()}))
"""


def drop_cache(path: Path) -> None:
    for f in path.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--layers", type=int, default=4)
    a.add_argument("--dir", default="/tmp/flash_ckpt")
    a.add_argument("--shard-gb", type=float, default=4.0)
    a.add_argument("--out", default=None)
    args = a.parse_args()
    from bench.layer_sweep import FLASH
    from deepinfer.testing.make_checkpoint import write_dummy_checkpoint

    path = Path(args.dir)
    config = {**FLASH, "num_hidden_layers": args.layers, "compress_ratios": FLASH["compress_ratios"][: args.layers]}
    t = time.perf_counter()
    total = write_dummy_checkpoint(path, config, seed=0, shard_max_bytes=int(args.shard_gb * 1e9), device="cuda")
    write_s = time.perf_counter() - t
    shards = sorted(f.stat().st_size for f in path.glob("*.safetensors"))
    result = {"layers": args.layers, "checkpoint_bytes": total, "shards": len(shards), "largest_shard": shards[-1],
              "write_seconds": write_s}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for run in ("warm", "cold", "dummy"):
        if run == "cold":
            drop_cache(path)
        out = subprocess.run([sys.executable, "-c", RUN, str(path), run], env=env, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-4000:])
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
