"""Same process A/B of the FP8 linears' e4m3 -> bf16: bit placement vs the hardware conversion.
(1) a decode layer's six FP8 GEMMs on L2-cold weights (bench_fp8_decode's set) at M = 1, 8, 32;
(2) decode steps of the 4-layer V4-Flash-shaped model at b1 / b8 / b32, ctx 1K; (3) prefill 4K per layer."""
import json, os, sys
sys.path[:0] = [".", "bench/kernels"]
import torch
from triton.testing import do_bench_cudagraph
import bench_fp8_decode as bd
from deepinfer.ops.triton import fp8_linear as fp8
from bench.layer_sweep import FLASH, build, decode_ms, from_layer, per_layer_ms, prefill_ms

rows = []
layers = bd.make_layer(4)
for m in (1, 8, 32):
    xs = [torch.randn(m, k, device="cuda").to(torch.bfloat16) for _, k, _ in bd.LAYER]
    for rep in range(2):
        for bits in (True, False):
            fp8.E4M3_BY_BITS = bits
            bd.run_layer(layers[:1], xs)
            us = do_bench_cudagraph(lambda: bd.run_layer(layers, xs), rep=200, return_mode="median") * 1e3 / 4
            rows.append({"what": "fp8_layer_gemms", "M": m, "bits": bits, "rep": rep, "us": us})
            print(json.dumps(rows[-1]), flush=True)
del layers
torch.cuda.empty_cache()
model = build(from_layer(FLASH, 2), 4, "cuda")
for b in (1, 8, 32):
    for rep in range(2):
        for bits in (True, False):
            fp8.E4M3_BY_BITS = bits
            t = decode_ms(model, b, 1024, "cuda", 1024 + 256)
            ms = per_layer_ms(t["replay_ms"], t["head_ms"], max(t["graph_ms"] - t["replay_ms"], 0.0), 4, t["preamble_ms"])
            rows.append({"what": "decode", "batch": b, "bits": bits, "rep": rep, "ms_per_layer": ms,
                         "replay_ms_per_layer": t["replay_ms"] / 4})
            print(json.dumps(rows[-1]), flush=True)
for bits in (True, False, True, False):
    fp8.E4M3_BY_BITS = bits
    rows.append({"what": "prefill4096", "bits": bits, "ms_per_layer": prefill_ms(model, 4096, "cuda", 4096) / 4})
    print(json.dumps(rows[-1]), flush=True)
fp8.E4M3_BY_BITS = True
open(os.path.join(os.environ.get("OUT", "."), "ab_cvt.json"), "w").write(json.dumps(rows, indent=2))
