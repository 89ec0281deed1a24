"""What the FP4 expert kernels' weight access pattern can reach on its own: streaming reads, no math.

    python bench/kernels/bench_stream.py            (on the GPU)

The expert kernels read each program's weight rows in K steps: 64 rows x 64 bytes per step (BK = 128 FP4
codes), rows H/2 = 2048 bytes apart, Triton's cp.async pipeline num_stages deep. This bench runs the same
loop with the dequantization replaced by a bitcast (the bits go to one MMA, so Triton pipelines the loads
the same way and nothing is optimised away) over the same bytes in three layouts and reports GB/s
against a device-to-device copy (bytes read + written) measured in the same run:
  rows       the checkpoint layout: [rows, K/2] bytes, a program's step is 64 strided 64-byte pieces;
  rows-128   the same layout, 128 bytes per row and step (BK = 256): whole 128-byte lines;
  tiles      tile-major: each program's step is one contiguous 4 KB block (64 rows x 64 bytes).
Two sizes: 6 experts' gate|up (T=1; 50 MB, partly L2-resident on repeats) and 137 experts' (T=32).
If "rows" runs well below "tiles", the layout, not the arithmetic, caps the expert kernels.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere without installing

from bench.kernels.ceilings import copy_bandwidth  # noqa: E402

ROWS_PER_EXPERT = 2 * 2048  # gate|up rows of one V4-Flash expert
ROW_BYTES = 4096 // 2  # H / 2 packed bytes per row


@triton.jit
def _stream_kernel(w_ptr, b_ptr, out_ptr, K_HALVES, stride_row, stride_tile_row, STEP: tl.constexpr,
                   TILED: tl.constexpr, BN: tl.constexpr):
    """Reads BN rows x K_HALVES 16-bit words in steps of STEP and feeds them to an MMA as bf16 bits (so
    Triton stages the loads through its cp.async pipeline as in the expert kernels); one value per row out."""
    pid = tl.program_id(0)
    r = tl.arange(0, BN)
    c = tl.arange(0, STEP)
    if TILED:  # step s of this program: one contiguous [BN, STEP] block
        off = r[:, None] * STEP + c[None, :]
        base = w_ptr + pid.to(tl.int64) * stride_tile_row
        step = BN * STEP
    else:
        off = r[:, None] * stride_row + c[None, :]
        base = w_ptr + pid.to(tl.int64) * BN * stride_row
        step = STEP
    b = tl.load(b_ptr + c[:, None] * 16 + tl.arange(0, 16)[None, :])
    acc = tl.zeros([BN, 16], dtype=tl.float32)
    for s in range(0, K_HALVES // STEP):
        acc = tl.dot(tl.load(base + s * step + off), b, acc)
    tl.store(out_ptr + pid * BN + r, tl.sum(acc, axis=1))


def gbps(nbytes: int, fn) -> float:
    ms = do_bench_cudagraph(fn, rep=200, return_mode="median")
    return nbytes / (ms * 1e-3) / 1e9


def main() -> None:
    rows_all = []
    copy_gbps = copy_bandwidth() / 1e9
    for experts in (6, 137):
        n_rows = experts * ROWS_PER_EXPERT
        # Small finite bf16 values (exponent field 120..127) as the streamed bits: no NaN or inf in the MMA.
        bits = torch.randint(120 << 7, 128 << 7, (n_rows, ROW_BYTES // 2), dtype=torch.int16, device="cuda")
        w = bits.view(torch.bfloat16)
        b = torch.full((64, 16), 0.5, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(n_rows, dtype=torch.float32, device="cuda")
        k_halves = ROW_BYTES // 2
        for name, step, tiled in (("rows", 32, False), ("rows-128", 64, False), ("tiles", 32, True)):
            for stages in (3, 4):
                bn = 64

                def run(step=step, tiled=tiled, stages=stages, bn=bn):
                    _stream_kernel[(n_rows // bn,)](w, b, out, k_halves, w.stride(0), bn * k_halves,
                                                    STEP=step, TILED=tiled, BN=bn, num_warps=4, num_stages=stages)
                rate = gbps(w.numel() * 2, run)
                rows_all.append({"experts": experts, "layout": name, "stages": stages, "GBps": rate,
                                 "of_copy": rate / copy_gbps})
                print(json.dumps(rows_all[-1]), flush=True)
        del bits, w, out
    print(f"\ndevice-to-device copy: {copy_gbps:.0f} GB/s (read + write)\n")
    print("| experts | layout | stages | GB/s | of copy |\n|---|---|---|---|---|")
    for r in rows_all:
        print(f"| {r['experts']} | {r['layout']} | {r['stages']} | {r['GBps']:.0f} | {r['of_copy']:.0%} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "bench_stream.json").write_text(json.dumps(
            {"copy_GBps": copy_gbps, "rows": rows_all}, indent=2))


if __name__ == "__main__":
    main()
