"""MoE pair alignment (ops/triton/moe_align.py) on the GPU: one-program vs per-range launch paths.

    python bench/kernels/bench_align.py [--pairs-per-program 1024 128 64]

For V4-Flash routing (E=256, k=6, block_m=16) at decode and prefill sizes, times ``align_pairs`` replayed
from a CUDA graph with ONE_PROGRAM_PAIRS set to each candidate (the same rows either way: both paths run
the same helpers) and prints the fastest candidate's total over the decode sizes last.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from deepinfer.ops.triton import moe_align as tri  # noqa: E402

E, K, BM = 256, 6, 16
DECODE_TOKENS = (1, 8, 16, 32, 64, 128)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs-per-program", type=int, nargs="+", default=[1024, 128, 64])
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    totals = {}
    for per in args.pairs_per_program:
        tri.ONE_PROGRAM_PAIRS = per
        total = 0.0
        for t in DECODE_TOKENS + (4096,):
            ids = torch.rand(t, E, generator=g, device="cuda").argsort(dim=1)[:, :K].contiguous()
            ref = tri.align_pairs(ids, E, BM)
            us = do_bench_cudagraph(lambda: tri.align_pairs(ids, E, BM), rep=50, return_mode="median") * 1e3
            total += us if t in DECODE_TOKENS else 0.0
            print(f"pairs/program {per:5d}  T={t:5d} ({t * K:6d} pairs): {us:7.1f} µs  rows={ref[0].numel()}")
        totals[per] = total
    best = min(totals, key=totals.get)
    print(f"decode total by pairs/program: {totals}")
    print(f"best {best}")


if __name__ == "__main__":
    main()
