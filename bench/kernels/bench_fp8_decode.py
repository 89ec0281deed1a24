"""The FP8 linears of one V4-Flash decode layer, back to back, as the step runs them: tile and split-K sweep.

    python bench/kernels/bench_fp8_decode.py [--tokens 1 8 32 64] [--copies 4] [--profile-run]

Per token count M, the six FP8 GEMMs of a CSA layer (wq_a|wkv, wq_b|indexer wq_b, grouped wo_a, wo_b, the
shared expert's w1|w3 and w2; 140 MB of e4m3 weights) run in sequence over --copies layers' worth of
distinct weights (so the 50 MB L2 does not serve them on repeat), replayed from a CUDA graph. Reported: µs
per layer, what the weight bytes allow at the measured copy bandwidth, and each candidate tile
(BLOCK_M, BLOCK_N, warps, stages) of the split-K MMA path and (BLOCK_M, warps, stages) of the swap-AB decode
path, x split target (programs the split-K fills), against the table's pick; and the batch-invariant table's
choice (``KernelTuning.invariant()``: the MMA kernel on 64-row tiles, K in fixed segments) as path "invariant".
Every candidate's outputs are compared with the first candidate's (relative difference: split counts
add the K blocks in different groupings).
Writes $OUT/fp8_decode.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.kernels.ceilings import copy_bandwidth  # noqa: E402
from deepinfer.ops.triton import fp8_linear as fp8  # noqa: E402
from deepinfer.ops.tuning import KernelTuning  # noqa: E402

# (rows N, input width, groups) of one CSA layer's FP8 linears on the batched path (model/fused.py stacks);
# the grouped wo_a reads 8 groups of 4096 inputs through a [8 x 1024, 4096] weight.
LAYER = [(1536, 4096, 1), (40960, 1024, 1), (8192, 32768, 8), (4096, 8192, 1), (4096, 4096, 1), (4096, 2048, 1)]
TILES = {16: [(16, 64, 4, 4), (16, 32, 4, 4), (16, 128, 4, 4), (16, 64, 4, 6), (16, 128, 8, 4)],
         64: [(32, 64, 4, 4), (32, 128, 4, 4), (32, 32, 4, 4), (64, 64, 4, 4), (32, 64, 4, 6), (16, 64, 4, 4)]}
# The swap-AB decode path's (BLOCK_M, warps, stages) per decode bucket.
DECODE_TILES = {16: [(16, 4, 3), (16, 4, 4), (16, 4, 2)], 32: [(32, 4, 3), (32, 4, 4), (32, 4, 2)], 64: [(64, 4, 3), (64, 4, 4), (64, 4, 2)]}
BASE = KernelTuning.for_device()
TARGETS = [BASE.num_sms, 2 * BASE.num_sms, 4 * BASE.num_sms, 8 * BASE.num_sms]
DEFAULT_TARGET = BASE.split_target
DEFAULT_DECODE = dict(BASE.fp8_decode_tiles)
DEFAULT_DECODE_MAX_M = BASE.fp8_decode_max_m


def make_layer(copies: int) -> list[list[tuple[torch.Tensor, torch.Tensor, int]]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(copies):
        mats = []
        for n, k, groups in LAYER:
            w = (torch.randn(n, k // groups, device="cuda", generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
            s = torch.full((n // 128, k // groups // 128), 2.0**-13, device="cuda")
            mats.append((w, s, groups))
        layers.append(mats)
    return layers


def run_layer(layers, xs, tuning: KernelTuning = BASE) -> list[torch.Tensor]:
    outs = []
    for mats in layers:
        for (w, s, groups), x in zip(mats, xs):
            if groups == 1:
                outs.append(fp8.fp8_linear(x, w, s, pow2_scales=True, tuning=tuning))
            else:
                outs.append(fp8.fp8_linear_grouped(x, w, s, groups, pow2_scales=True, tuning=tuning))
    return outs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--profile-run", action="store_true",
                    help="only run each of the layer's GEMMs 3 times eagerly per M (a target for ncu: "
                         "bench/kernels/ncu_decode.sh)")
    ap.add_argument("--quick", action="store_true",
                    help="the MMA path only at its table tile and split target (the decode path swept in full)")
    args = ap.parse_args()
    if args.profile_run:
        layers = make_layer(1)
        for m in args.tokens:
            xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for _, k, _ in LAYER]
            for _ in range(3):
                run_layer(layers, xs)
        torch.cuda.synchronize()
        return
    bw = copy_bandwidth()
    layers = make_layer(args.copies)
    wbytes = sum(w.numel() + s.numel() * 4 for w, s, _ in layers[0])
    rows = []
    for m in args.tokens:
        bucket = 16 if m <= 16 else 64
        dbucket = next(b for b in sorted(DEFAULT_DECODE) if m <= b) if m <= max(DEFAULT_DECODE) else None
        xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for _, k, _ in LAYER]
        ref = None
        candidates = [("mma", tile) for tile in (TILES[bucket][:1] if args.quick else TILES[bucket])]
        candidates += [("decode", tile) for tile in DECODE_TILES.get(dbucket, [])]
        candidates += [("invariant", BASE.invariant().invariant_fp8_tile(m))]
        for path, tile in candidates:
            for target in ([DEFAULT_TARGET] if (args.quick and path == "mma") or path == "invariant" else TARGETS):
                tuning = dataclasses.replace(BASE, fp8_split_target=target)
                if path == "invariant":
                    tuning = BASE.invariant()
                elif path == "mma":
                    tuning = dataclasses.replace(tuning, fp8_decode_max_m=0).with_fp8_tile(bucket, tile)
                else:
                    tuning = tuning.with_fp8_decode_tile(dbucket, tile)
                try:
                    outs = run_layer(layers[:1], xs, tuning)
                    torch.cuda.synchronize()
                    us = do_bench_cudagraph(lambda: run_layer(layers, xs, tuning), rep=200,
                                            return_mode="median") * 1e3
                except Exception as exc:  # a tile that does not compile or fit is reported, not fatal
                    rows.append({"M": m, "path": path, "tile": tile, "target": target,
                                 "error": f"{type(exc).__name__}: {exc}"[:160]})
                    continue
                us /= args.copies
                if path == "mma":
                    splits = [fp8._config(m, n, k // g, tuning)[2] for n, k, g in LAYER]
                    pick = (m > DEFAULT_DECODE_MAX_M and tile == dict(BASE.fp8_tiles)[bucket]
                            and target == DEFAULT_TARGET)
                elif path == "invariant":
                    splits = [-(-(k // g) // tuning.k_segment(n, k // g)) for n, k, g in LAYER]  # K segments
                    pick = False
                else:
                    splits = None
                    pick = tile == DEFAULT_DECODE[dbucket] and target == DEFAULT_TARGET
                if ref is None:
                    ref = outs
                diff = max(((a.double() - b.double()).norm() / b.double().norm()).item() for a, b in zip(outs, ref))
                rows.append({"M": m, "path": path, "tile": tile, "target": target, "splits": splits,
                             "us_per_layer": us, "of_floor": wbytes / bw / (us * 1e-6), "table_pick": pick,
                             "rel_diff_vs_first": diff})
                print(json.dumps(rows[-1]), flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fp8_decode.json").write_text(json.dumps({"copy_bw": bw, "weight_bytes": wbytes,
                                                                          "rows": rows}, indent=2))
    print(f"\nweights {wbytes / 1e6:.1f} MB per layer, floor {wbytes / bw * 1e6:.1f} µs at {bw / 1e12:.2f} TB/s\n")
    print("| M | path | tile | split target | splits per GEMM | µs / layer | of floor | pick |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['M']} | {r['path']} | {r['tile']} | {r['target']} | {r['error']} | | | |")
        else:
            print(f"| {r['M']} | {r['path']} | {r['tile']} | {r['target']} | {r['splits'] or ''} | "
                  f"{r['us_per_layer']:.1f} | {r['of_floor']:.0%} | {'*' if r['table_pick'] else ''} |")


if __name__ == "__main__":
    main()
