"""Same process A/B of the FP8 small-M paths: the swap-AB decode kernel (DECODE_MAX_M = 64) vs the split-K MMA
kernel (DECODE_MAX_M = 0), both with the 4-instruction e4m3 pair conversion.
(1) decode steps of the 4-layer V4-Flash-shaped model at b1 / b8 / b32 / b64, ctx 1K, two reps alternating;
(2) prefill 4K per layer with bit placement vs the hardware conversion (the weight-as-A prefill kernel)."""
import json, os, sys
sys.path[:0] = [".", "bench/kernels"]
from deepinfer.ops.triton import fp8_linear as fp8
from bench.layer_sweep import FLASH, build, decode_ms, from_layer, per_layer_ms, prefill_ms

rows = []
model = build(from_layer(FLASH, 2), 4, "cuda")
for b in (1, 8, 32, 64):
    for rep in range(2):
        for dec in (64, 0):
            fp8.DECODE_MAX_M = dec
            t = decode_ms(model, b, 1024, "cuda", 1024 + 256)
            ms = per_layer_ms(t["replay_ms"], t["head_ms"], max(t["graph_ms"] - t["replay_ms"], 0.0), 4, t["preamble_ms"])
            rows.append({"what": "decode", "batch": b, "decode_max_m": dec, "rep": rep, "ms_per_layer": ms,
                         "replay_ms_per_layer": t["replay_ms"] / 4})
            print(json.dumps(rows[-1]), flush=True)
fp8.DECODE_MAX_M = 64
for bits in (True, False, True, False):
    fp8.E4M3_BY_BITS = bits
    rows.append({"what": "prefill4096", "bits": bits, "ms_per_layer": prefill_ms(model, 4096, "cuda", 4096) / 4})
    print(json.dumps(rows[-1]), flush=True)
fp8.E4M3_BY_BITS = True
open(os.path.join(os.environ.get("OUT", "."), "ab_decode.json"), "w").write(json.dumps(rows, indent=2))
