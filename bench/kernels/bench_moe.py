"""Routed FP4 experts on the GPU: the Triton grouped GEMM vs the bytes floor and vs a torch peer.

    python bench/kernels/bench_moe.py [--tokens 1 8 32 128 4096] [--scales e8m0 fp32] [--no-sweep]

V4-Flash shapes: H=4096, I=2048, E=256, k=6, bf16 activations, uniform random top-k routing.
Per T it reports, for each scale format (fp32 multipliers as the op's signature documents, or the raw
UE8M0 bytes the checkpoint ships):
  floor   the fewest bytes a call must move: each *hit* expert's packed w13 + w2 and their scales, plus x
          and out (bf16), divided by 4.25 TB/s (the H200's measured copy bandwidth);
  graph   median µs of the whole op (align + 3 kernels) on the layout the model stores (tile-major, placed
          codes: ``fp4_codes.expert_layout``) replayed from a CUDA graph (what a graph-captured
          decode step pays); eager: the same without a graph (adds launch gaps); align: the torch sort/pad
          step alone, in a graph;
  TB/s    floor bytes / graph time, and the fraction of 4.25 TB/s; TFLOP/s = 6*T*k*H*I / graph time;
  peer    torch with all experts pre-dequantized to bf16, a per-expert loop (model/moe.py's scheme):
          eager µs (it syncs to the host for its expert list, so no graph).
Each timed call cycles through --rotate routing sets, so the 78-94 MB a decode step touches is not served
from the 50 MB L2 on repeat. A short sweep of tile configs and weight layouts at T = 1, 8, 32, 128, 512, 4096
follows (``SWEEP``; --no-sweep skips it).
Prints markdown tables last; writes $OUT/bench_moe.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere without installing

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench, do_bench_cudagraph

from deepinfer.model.quant import dequant_fp4, ue8m0_to_float
from deepinfer.ops.triton import fp4_codes
from deepinfer.ops.triton import moe_experts as tri

H, I, E, K = 4096, 2048, 256, 6
LIMIT = 10.0
COPY_BW = 4.25e12  # bytes/s, measured device-to-device copy (shared/docs/h200-facts.md)
DEVICE = "cuda"  # a dry run of the script's logic under TRITON_INTERPRET swaps in "cpu" and tiny shapes


def make_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def rand(shape: tuple[int, ...], lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(lo, hi, shape, generator=g, device=DEVICE, dtype=dtype)

    w13 = rand((E, 2 * I, H // 2), -128, 128, torch.int8)
    w2 = rand((E, H, I // 2), -128, 128, torch.int8)
    e13 = rand((E, 2 * I, H // 32), 120, 123, torch.uint8)  # scales 2^-7..2^-5: gate/up rms of a few units
    e2 = rand((E, H, I // 32), 118, 121, torch.uint8)
    return {"w13": w13, "w2": w2, "e13": e13, "e2": e2}


def routing(n_tok: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(n_tok, H, generator=g, device=DEVICE).to(torch.bfloat16)
    ids = torch.rand(n_tok, E, generator=g, device=DEVICE).argsort(dim=1)[:, :K].contiguous()
    w = torch.rand(n_tok, K, generator=g, device=DEVICE) + 0.1
    return x, ids, (w / w.sum(dim=1, keepdim=True) * 1.5).contiguous()


def expert_bytes(scale_bytes: int) -> int:
    packed = 2 * I * H // 2 + H * I // 2
    scales = (2 * I * H // 32 + H * I // 32) * scale_bytes
    return packed + scales


def torch_peer(x, ids, w, w13_bf16, w2_bf16) -> torch.Tensor:
    """The per-expert loop of model/moe.py on pre-dequantized bf16 weights."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        gate, up = (x[tok] @ w13_bf16[e].t()).split(I, dim=-1)
        hid = F.silu(gate.float().clamp(max=LIMIT)) * up.float().clamp(min=-LIMIT, max=LIMIT)
        y = (hid.to(x.dtype) @ w2_bf16[e].t()).float() * w[tok, slot, None]
        out.index_add_(0, tok, y.to(x.dtype))
    return out


def time_op(fn, rotate: int, graph: bool) -> float:
    """Median µs per call of fn(r) over r in range(rotate)."""
    def run() -> None:
        for r in range(rotate):
            fn(r)
    if graph:
        ms = do_bench_cudagraph(run, rep=200, return_mode="median")
    else:
        ms = do_bench(run, warmup=25, rep=200, return_mode="median")
    return ms * 1e3 / rotate


def bench_tokens(n_tok: int, scale_fmt: str, wts: dict, peer_w: tuple | None, rotate: int) -> dict:
    s13 = ue8m0_to_float(wts["e13"]) if scale_fmt == "fp32" else wts["e13"].view(torch.float8_e8m0fnu)
    s2 = ue8m0_to_float(wts["e2"]) if scale_fmt == "fp32" else wts["e2"].view(torch.float8_e8m0fnu)
    sets = [routing(n_tok, 1000 * n_tok + r) for r in range(rotate)]
    hit = sum(torch.unique(ids).numel() for _, ids, _ in sets) / rotate
    floor_bytes = hit * expert_bytes(4 if scale_fmt == "fp32" else 1) + 2 * n_tok * H * 2
    flops = 6.0 * n_tok * K * H * I
    cfg = tri.pick_config(n_tok * K, E)
    weights = (*fp4_codes.expert_layout(wts["w13"], s13), *fp4_codes.expert_layout(wts["w2"], s2))  # the model's

    def op(r: int) -> torch.Tensor:
        x, ids, w = sets[r]
        return tri.moe_experts_fp4(x, ids, w, *weights, LIMIT)

    row = {"T": n_tok, "scales": scale_fmt, "pairs": n_tok * K, "experts_hit": hit, "config": vars(cfg),
           "floor_MB": floor_bytes / 1e6, "floor_us": floor_bytes / COPY_BW * 1e6}
    got = op(0)
    row["nan"] = bool(torch.isnan(got).any())
    row["graph_us"] = time_op(op, rotate, graph=True)
    row["eager_us"] = time_op(op, rotate, graph=False)
    row["align_us"] = time_op(lambda r: tri.align_pairs(sets[r][1], E, cfg.block_m), rotate, graph=True)
    row["TBps"] = floor_bytes / (row["graph_us"] * 1e-6) / 1e12
    row["of_floor"] = row["floor_us"] / row["graph_us"]
    row["TFLOPs"] = flops / (row["graph_us"] * 1e-6) / 1e12
    if peer_w is not None:
        x, ids, w = sets[0]
        ref = torch_peer(x, ids, w, *peer_w)
        row["rel_err_vs_peer"] = ((got.double() - ref.double()).norm() / ref.double().norm()).item()
        row["peer_us"] = time_op(lambda r: torch_peer(*sets[r], *peer_w), rotate, graph=False)
        peer_bytes = hit * 2 * (3 * H * I) + 2 * n_tok * H * 2
        row["peer_TBps"] = peer_bytes / (row["peer_us"] * 1e-6) / 1e12
    return row


# Per T, TileConfig fields to change in the table's pick, timed after the pick itself; all on the layout the
# model stores (``fp4_codes.expert_layout``: tile-major, placed codes) unless "layout" names another:
# "tiled" (tile-major, unplaced codes) or "checkpoint". Configs without K splits must give the pick's bits;
# K-split ones (not batch invariant) report their relative difference instead.
# Earlier decode rows (layouts, stages 3 / 5, 8-warp 128-row gate/up tiles, 64-row down tiles, register caps)
# are measured in bench/results/README.md runs 25, 36, 41 and 46; 128-row gate/up tiles on one warpgroup in
# run 56 (now the table's pick from 0.125 pairs per expert on).
# 256-row down tiles on one warpgroup: 0.144 vs 0.161 instructions per weight byte for 244 registers (2
# programs per SM instead of 3).
# One launch (``moe_one_launch.py``, table row 1's form) against two: the gate/up and down tiles from one queue;
# 168 registers keep the 128-row decode tiles at 3 programs per SM (179 uncapped; no spills in the loops).
_DECODE_SWEEP = [dict(num_stages=3), dict(block_n1=64, num_stages=4), dict(block_n2=256),
                 dict(block_n2=256, num_stages=2), dict(one_launch=False, max_regs=None),
                 dict(one_launch=True, max_regs=168)]
# A k = 3 verify step at batch 1 (4 tokens, ~23.5 experts hit: one m-block each, mostly padding columns).
_VERIFY_SWEEP = [dict(num_stages=4), dict(num_stages=2), dict(max_regs=128), dict(num_warps=8, max_regs=None),
                 dict(block_n1=64, num_stages=4), dict(block_n2=256, max_regs=None),
                 dict(one_launch=False, max_regs=None)]
SWEEP: dict[int, list[dict]] = {
    **{t: _DECODE_SWEEP for t in (1, 8, 32, 128)},
    4: _VERIFY_SWEEP,
    512: [dict(layout="tiled"), dict(block_n2=128), dict(num_stages=3), dict(one_launch=True)],
    4096: [dict(layout="checkpoint"), dict(layout="tiled")],
}


def sweep(wts: dict, rotate: int, only: list[int] | None = None) -> list[dict]:
    rows = []
    s13, s2 = wts["e13"].view(torch.float8_e8m0fnu), wts["e2"].view(torch.float8_e8m0fnu)
    layouts = {"checkpoint": (wts["w13"], s13, wts["w2"], s2)}
    for name, placed in (("tiled", False), ("model", True)):
        layouts[name] = (*fp4_codes.expert_layout(wts["w13"], s13, placed=placed),
                         *fp4_codes.expert_layout(wts["w2"], s2, placed=placed))
    for n_tok, cands in SWEEP.items():
        if only and n_tok not in only:
            continue
        sets = [routing(n_tok, 1000 * n_tok + r) for r in range(rotate)]
        hit = sum(torch.unique(ids).numel() for _, ids, _ in sets) / rotate
        floor_bytes = hit * expert_bytes(1) + 2 * n_tok * H * 2
        base = tri.pick_config(n_tok * K, E)
        runs = [(base, "model")] + [(dataclasses.replace(base, **{f: v for f, v in c.items() if f != "layout"}),
                                     c.get("layout", "model")) for c in cands]
        ref = None
        for cfg, layout in runs:
            def op(r: int, cfg=cfg, weights=layouts[layout]) -> torch.Tensor:
                x, ids, w = sets[r]
                return tri.moe_experts_fp4_with_config(x, ids, w, *weights, LIMIT, cfg)
            row = {"T": n_tok, "config": {**vars(cfg), "layout": layout}}
            try:
                out = op(0)
                ref = out if ref is None else ref
                same = torch.equal(out, ref)  # required unless the config splits K
                diff = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
                us = time_op(op, rotate, graph=True)
                rows.append({**row, "graph_us": us, "bitwise_same": same, "rel_diff": diff,
                             "of_floor": floor_bytes / COPY_BW * 1e6 / us,
                             "table_pick": cfg == base and layout == "model"})
            except Exception as exc:  # a config that fails to compile or launch is reported, not fatal
                rows.append({**row, "error": f"{type(exc).__name__}: {exc}"[:200]})
    return rows


def kernel_split(wts: dict, tokens: list[int], rotate: int, calls: int = 16) -> list[dict]:
    """Per T, the op's kernels one by one (torch.profiler, eager calls on the model's layout), for the table's
    pick and for it as two launches (``one_launch=False``): how the time divides between the gate/up GEMM,
    the down GEMM, alignment and combine, and each GEMM's rate on its own bytes."""
    from torch.profiler import ProfilerActivity, profile

    s13, s2 = wts["e13"].view(torch.float8_e8m0fnu), wts["e2"].view(torch.float8_e8m0fnu)
    weights = (*fp4_codes.expert_layout(wts["w13"], s13), *fp4_codes.expert_layout(wts["w2"], s2))
    rows = []
    for n_tok in tokens:
        sets = [routing(n_tok, 1000 * n_tok + r) for r in range(rotate)]
        hit = sum(torch.unique(ids).numel() for _, ids, _ in sets) / rotate
        base = tri.pick_config(n_tok * K, E)
        for cfg in {base, dataclasses.replace(base, one_launch=False)}:
            def op(r: int, cfg=cfg) -> torch.Tensor:
                x, ids, w = sets[r]
                return tri.moe_experts_fp4_with_config(x, ids, w, *weights, LIMIT, cfg)
            for r in range(rotate):
                op(r)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(calls):
                    op(i % rotate)
                torch.cuda.synchronize()
            per = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    per[e.name] = per.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / calls
            rows.append({"T": n_tok, "experts_hit": hit, "config": vars(cfg),
                         "gate_up_MB": hit * 2 * I * H * (0.5 + 1 / 32) / 1e6,
                         "down_MB": hit * H * I * (0.5 + 1 / 32) / 1e6,
                         "kernels_us": {n[:60]: round(v, 2) for n, v in sorted(per.items(), key=lambda kv: -kv[1])}})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def cfg_str(c: dict) -> str:
    regs = f" r{c['max_regs']}" if c.get("max_regs") else ""
    split = " split" if c.get("split_gate_up") else ""
    split += " one" if c.get("one_launch") else ""
    s1, s2 = c.get("splits1", 1), c.get("splits2", 1)
    chunks = f" k/{s1}/{s2}" if max(s1, s2) > 1 else ""
    chunks += f" {c['layout']}" if c.get("layout", "model") != "model" else ""
    return (f"m{c['block_m']} n{c['block_n1']}/{c['block_n2']} w{c['num_warps']} s{c['num_stages']}{regs}"
            f"{split}{chunks}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128, 4096])
    ap.add_argument("--scales", nargs="+", default=["e8m0", "fp32"], choices=["e8m0", "fp32"])
    ap.add_argument("--rotate", type=int, default=8, help="routing sets cycled per timed call")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-tokens", type=int, nargs="+", default=None, help="sweep only these T (default: all)")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--kernels", action="store_true",
                    help="also split each T's op into its kernels (torch.profiler), one launch and two")
    ap.add_argument("--profile-run", action="store_true",
                    help="only call the op 3 times eagerly per T, UE8M0 scales, tile-major weights as the model stores them "
                         "(a target for ncu; see bench/results/README.md run 26)")
    args = ap.parse_args()
    t0 = time.time()
    wts = make_weights(0)
    if args.profile_run:
        s13, s2 = wts["e13"].view(torch.float8_e8m0fnu), wts["e2"].view(torch.float8_e8m0fnu)
        weights = (*fp4_codes.expert_layout(wts["w13"], s13), *fp4_codes.expert_layout(wts["w2"], s2))
        for n_tok in args.tokens:
            for r in range(3):
                x, ids, w = routing(n_tok, 1000 * n_tok + r)
                tri.moe_experts_fp4(x, ids, w, *weights, LIMIT)
        torch.cuda.synchronize()
        return
    peer_w = None
    if not args.no_peer:  # 12.9 GB of bf16 experts
        w13_bf16 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=DEVICE)
        w2_bf16 = torch.empty(E, H, I, dtype=torch.bfloat16, device=DEVICE)
        for e in range(E):
            w13_bf16[e] = dequant_fp4(wts["w13"][e], wts["e13"][e]).to(torch.bfloat16)
            w2_bf16[e] = dequant_fp4(wts["w2"][e], wts["e2"][e]).to(torch.bfloat16)
        peer_w = (w13_bf16, w2_bf16)
    rows = []
    for n_tok in args.tokens:
        for fmt in args.scales:
            rotate = 2 if n_tok >= 1024 else args.rotate
            rows.append(bench_tokens(n_tok, fmt, wts, peer_w, rotate))
            print(json.dumps(rows[-1]), flush=True)
    sweep_rows = [] if args.no_sweep else sweep(wts, args.rotate, args.sweep_tokens)
    for r in sweep_rows:
        print(json.dumps(r), flush=True)
    split_rows = kernel_split(wts, args.tokens, args.rotate) if args.kernels else []
    meta = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE, "torch": torch.__version__,
            "triton": triton.__version__, "H": H, "I": I, "E": E, "k": K, "copy_bw_TBps": COPY_BW / 1e12,
            "wall_s": time.time() - t0}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)
        Path(os.environ["OUT"], "bench_moe.json").write_text(json.dumps(
            {"meta": meta, "rows": rows, "sweep": sweep_rows, "kernels": split_rows}, indent=2))

    print(f"\n{meta['device']}, V4-Flash experts H={H} I={I} E={E} k={K}, bf16 x, floor at {COPY_BW / 1e12} TB/s\n")
    print("| T | scales | hit | MB | floor µs | graph µs | eager µs | align µs | TB/s | of floor | TFLOP/s "
          "| peer µs | peer TB/s | vs peer | err vs peer | config |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        peer = (f"{r['peer_us']:.1f} | {r['peer_TBps']:.2f} | {r['peer_us'] / r['graph_us']:.2f}x | "
                f"{r['rel_err_vs_peer']:.1e}") if "peer_us" in r else "- | - | - | -"
        nan = " NaN!" if r["nan"] else ""
        print(f"| {r['T']} | {r['scales']} | {r['experts_hit']:.0f} | {r['floor_MB']:.1f} | {r['floor_us']:.1f} | "
              f"{r['graph_us']:.1f}{nan} | {r['eager_us']:.1f} | {r['align_us']:.1f} | {r['TBps']:.2f} | "
              f"{r['of_floor']:.0%} | {r['TFLOPs']:.1f} | {peer} | {cfg_str(r['config'])} |")
    if sweep_rows:
        print("\n| T | config (e8m0 scales) | graph µs | of floor | same bits | rel diff | table pick |")
        print("|---|---|---|---|---|---|---|")
        for r in sweep_rows:
            if "error" in r:
                print(f"| {r['T']} | {cfg_str(r['config'])} | {r['error']} | | | | |")
            else:
                print(f"| {r['T']} | {cfg_str(r['config'])} | {r['graph_us']:.1f} | {r['of_floor']:.0%} | "
                      f"{r['bitwise_same']} | {r['rel_diff']:.1e} | {'*' if r['table_pick'] else ''} |")


if __name__ == "__main__":
    main()
