"""Same process A/B of the sparse attention's small-batch split: SMALL_SPLIT = 128 vs 0 (the batch-invariant
SPLIT path), decode steps of the 4-layer V4-Flash-shaped model at b1 / b8 / b32 / b64, ctx 1K and 8K, two reps."""
import json, os, sys
sys.path[:0] = ["."]
from deepinfer.ops.triton import sparse_attention as sa
from bench.layer_sweep import FLASH, build, decode_ms, from_layer, per_layer_ms

rows = []
model = build(from_layer(FLASH, 2), 4, "cuda")
for ctx in (1024, 8192):
    for b in (1, 8, 32, 64):
        for rep in range(2):
            for small in (128, 0):
                sa.SMALL_SPLIT = small
                t = decode_ms(model, b, ctx, "cuda", ctx + 256)
                ms = per_layer_ms(t["replay_ms"], t["head_ms"], max(t["graph_ms"] - t["replay_ms"], 0.0), 4,
                                  t["preamble_ms"])
                rows.append({"ctx": ctx, "batch": b, "small_split": small, "rep": rep, "ms_per_layer": ms,
                             "replay_ms_per_layer": t["replay_ms"] / 4})
                print(json.dumps(rows[-1]), flush=True)
sa.SMALL_SPLIT = 128
open(os.path.join(os.environ.get("OUT", "."), "ab_attn.json"), "w").write(json.dumps(rows, indent=2))
