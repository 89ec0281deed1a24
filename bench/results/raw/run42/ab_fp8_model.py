"""Decode steps of the 4-layer V4-Flash-shaped model with the FP8 decode path as stream-K vs split-K, same process."""
import json, os, sys
sys.path.insert(0, ".")
from bench.layer_sweep import FLASH, build, decode_ms, from_layer, per_layer_ms
from deepinfer.ops.triton import fp8_linear as fp8

model = build(from_layer(FLASH, 2), 4, "cuda")
rows = []
for b in (1, 8, 32):
    for rep in range(2):
        for path in ("streamk", "splitk"):
            fp8.DECODE_PATH = path
            t = decode_ms(model, b, 1024, "cuda", 1024 + 256)
            ms = per_layer_ms(t["replay_ms"], t["head_ms"], max(t["graph_ms"] - t["replay_ms"], 0.0), 4, t["preamble_ms"])
            rows.append({"batch": b, "path": path, "rep": rep, "ms_per_layer": ms, "replay_ms_per_layer": t["replay_ms"] / 4})
            print(json.dumps(rows[-1]), flush=True)
fp8.DECODE_PATH = "streamk"
open(os.path.join(os.environ.get("OUT", "."), "ab_fp8_model.json"), "w").write(json.dumps(rows, indent=2))
