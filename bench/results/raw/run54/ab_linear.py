"""Same process A/B of the bf16 linears at decode sizes: the Triton split-K kernel (linear.MAX_M = 64) vs
cuBLAS (MAX_M = 0). (1) each bf16 stack of the 4-layer V4-Flash-shaped model (side projections) and the
router, M = 1 / 8 / 32, graph-timed; (2) decode steps at b1 / b8 / b32 ctx 1K and b1 ctx 8K, two reps."""
import json, os, sys
sys.path[:0] = ["."]
import torch
from triton.testing import do_bench_cudagraph
from deepinfer.ops.triton import linear as lin
from deepinfer.model.fused import StackedLinear
from deepinfer.model.linear import Linear
from bench.layer_sweep import FLASH, build, decode_ms, from_layer, per_layer_ms

rows = []
model = build(from_layer(FLASH, 2), 4, "cuda")
shapes = sorted({tuple(m.inner.weight.shape) for m in model.modules()
                 if isinstance(m, StackedLinear) and isinstance(m.inner, Linear)} | {(256, 4096)})
for n, k in shapes:
    w = torch.randn(n, k, device="cuda").bfloat16()
    for m in (1, 8, 32):
        x = torch.randn(m, k, device="cuda").bfloat16()
        for max_m in (64, 0):
            lin.MAX_M = max_m
            us = do_bench_cudagraph(lambda: lin.linear(x, w), rep=100, return_mode="median") * 1e3
            rows.append({"what": "linear", "N": n, "K": k, "M": m, "triton": max_m > 0, "us": us})
            print(json.dumps(rows[-1]), flush=True)
for ctx, b in ((1024, 1), (1024, 8), (1024, 32), (8192, 1)):
    for rep in range(2):
        for max_m in (64, 0):
            lin.MAX_M = max_m
            t = decode_ms(model, b, ctx, "cuda", ctx + 256)
            ms = per_layer_ms(t["replay_ms"], t["head_ms"], max(t["graph_ms"] - t["replay_ms"], 0.0), 4, t["preamble_ms"])
            rows.append({"what": "decode", "ctx": ctx, "batch": b, "triton": max_m > 0, "rep": rep, "ms_per_layer": ms,
                         "replay_ms_per_layer": t["replay_ms"] / 4})
            print(json.dumps(rows[-1]), flush=True)
lin.MAX_M = 64
open(os.path.join(os.environ.get("OUT", "."), "ab_linear.json"), "w").write(json.dumps(rows, indent=2))
