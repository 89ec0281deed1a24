"""Same-process A/B on the 4-layer V4-Flash-shaped model: the decode bucket's gate/up tile (moe_experts.CONFIG_TABLE
row 0) as 64 weight rows, 4 stages (the table) vs 128 rows on one warpgroup, 3 or 4 stages. Decode steps at
b1 / b8 / b32 / b128 ctx 1K, two reps, graph-timed by the sweep harness; logits bits compared across variants
(the tile does not change the sums)."""
import dataclasses, json, os, sys
sys.path[:0] = ["."]
import torch
from deepinfer.ops.triton import moe_experts as moe
from bench.layer_sweep import FLASH, build, decode_ms, decode_tokens, from_layer, per_layer_ms, random_cache

table = moe.CONFIG_TABLE
bound, pick = table[0]
VARIANTS = {"n64 s4": pick, "n128 s3": dataclasses.replace(pick, block_n1=128, num_stages=3),
            "n128 s4": dataclasses.replace(pick, block_n1=128)}
model = build(from_layer(FLASH, 2), 4, "cuda")
cache, sids = random_cache(model, 32, 1024, "cuda")
toks = decode_tokens(32, model.cfg.vocab_size)
logits = {}
for name, cfg in VARIANTS.items():
    moe.CONFIG_TABLE = ((bound, cfg),) + table[1:]
    for sid in sids:
        cache.truncate(sid, 1024)
    ids, fb = cache.plan({sid: [tok] for sid, tok in zip(sids, toks)})
    logits[name] = model.logits(model(ids.cuda(), fb, cache.storage)).clone()
assert all(torch.equal(v, logits["n64 s4"]) for v in logits.values())
print(json.dumps({"check": "same bits", "batch": 32}), flush=True)
rows = []
for b in (1, 8, 32, 128):
    for rep in range(2):
        for name, cfg in VARIANTS.items():
            moe.CONFIG_TABLE = ((bound, cfg),) + table[1:]
            t = decode_ms(model, b, 1024, "cuda", 1024 + 256)
            ms = per_layer_ms(t["replay_ms"], t["head_ms"], max(t["graph_ms"] - t["replay_ms"], 0.0), 4, t["preamble_ms"])
            rows.append({"batch": b, "variant": name, "rep": rep, "ms_per_layer": ms,
                         "replay_ms_per_layer": t["replay_ms"] / 4})
            print(json.dumps(rows[-1]), flush=True)
moe.CONFIG_TABLE = table
open(os.path.join(os.environ.get("OUT", "."), "ab_gate_up.json"), "w").write(json.dumps(rows, indent=2))
