"""Seeded Gumbel-max sampling on the GPU: the fused kernel (``ops/triton/gumbel_argmax.py``) against the
reference's chain of tensor ops (``sampling/rng.gumbel_argmax``), same inputs, same run; checks the tokens agree.

    python bench/kernels/bench_gumbel.py [--vocab 129280] [--batches 1 16 64 256] [--iters 50]
"""

from __future__ import annotations

import argparse
import time

import torch

from deepinfer.ops.triton.gumbel_argmax import gumbel_argmax as fused
from deepinfer.sampling import rng


def timed(fn, iters: int, *args) -> tuple[float, torch.Tensor]:
    for _ in range(3):
        out = fn(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=129280)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args()
    for b in a.batches:
        g = torch.Generator(device="cuda").manual_seed(b)
        scores = torch.randn(b, a.vocab, device="cuda", generator=g)
        seeds = torch.arange(b, dtype=torch.int64, device="cuda") * 7919
        positions = torch.arange(b, dtype=torch.int64, device="cuda") + 1000
        ref_ms, want = timed(rng.gumbel_argmax, a.iters, scores, seeds, positions)
        fused_ms, got = timed(fused, a.iters, scores, seeds, positions)
        print(f"batch {b}, vocab {a.vocab}: reference {ref_ms:.3f} ms, fused {fused_ms:.3f} ms, "
              f"x{ref_ms / fused_ms:.1f}, same tokens {torch.equal(want, got)}")


if __name__ == "__main__":
    main()
