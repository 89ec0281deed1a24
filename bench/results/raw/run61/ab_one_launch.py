"""Same-process A/B on the 4-layer V4-Flash-shaped model: the expert op's two launches (the table) vs one launch
of the tile queue (moe_one_launch.py) in the decode rows (rows 0 and 1; row 1's 128-row tiles capped at 168
registers). Decode steps at b1 / b8 / b32 / b128 ctx 1K, two reps, graph-timed by the sweep harness; logits bits
compared across variants (same tiles, same sums)."""
import dataclasses, json, os, sys
sys.path[:0] = ["."]
import torch
from deepinfer.ops.triton import moe_experts as moe
from bench.layer_sweep import FLASH, build, decode_ms, decode_tokens, from_layer, per_layer_ms, random_cache

table = moe.CONFIG_TABLE
one = tuple((b, dataclasses.replace(c, one_launch=True, max_regs=168 if c.block_n1 == 128 else None))
            if i < 2 else (b, c) for i, (b, c) in enumerate(table))
VARIANTS = {"two launches": table, "one launch": one}
model = build(from_layer(FLASH, 2), 4, "cuda")
for b in (1, 32):
    cache, sids = random_cache(model, b, 1024, "cuda")
    toks = decode_tokens(b, model.cfg.vocab_size)
    logits = {}
    for name, t in VARIANTS.items():
        moe.CONFIG_TABLE = t
        for sid in sids:
            cache.truncate(sid, 1024)
        ids, fb = cache.plan({sid: [tok] for sid, tok in zip(sids, toks)})
        logits[name] = model.logits(model(ids.cuda(), fb, cache.storage)).clone()
    assert all(torch.equal(v, logits["two launches"]) for v in logits.values())
    print(json.dumps({"check": "same bits", "batch": b}), flush=True)
rows = []
for b in (1, 8, 32, 128):
    for rep in range(2):
        for name, t in VARIANTS.items():
            moe.CONFIG_TABLE = t
            r = decode_ms(model, b, 1024, "cuda", 1024 + 256)
            ms = per_layer_ms(r["replay_ms"], r["head_ms"], max(r["graph_ms"] - r["replay_ms"], 0.0), 4, r["preamble_ms"])
            rows.append({"batch": b, "variant": name, "rep": rep, "ms_per_layer": ms,
                         "replay_ms_per_layer": r["replay_ms"] / 4})
            print(json.dumps(rows[-1]), flush=True)
moe.CONFIG_TABLE = table
open(os.path.join(os.environ.get("OUT", "."), "ab_one_launch.json"), "w").write(json.dumps(rows, indent=2))
