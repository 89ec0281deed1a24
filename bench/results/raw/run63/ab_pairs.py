"""Same-process A/B on the 4-layer V4-Flash-shaped model: the attention block's norm/RoPE pairs (latent_norms,
heads_norm_rope) in one launch each vs each op in its own launch (ops/triton/rope_norm._launch_pair patched to
its fallback). Decode steps at b1 / b8 / b32 ctx 1K and b1 ctx 8K, two reps, graph-timed by the sweep harness;
logits bits compared (each program runs the same code either way)."""
import json, os, sys
sys.path[:0] = ["."]
import torch
from deepinfer.ops.triton import rope_norm as rn
from bench.layer_sweep import FLASH, build, decode_ms, decode_tokens, from_layer, per_layer_ms, random_cache

paired = rn._launch_pair
VARIANTS = {"one launch per pair": paired, "separate": lambda a, b: (paired(a, None), paired(None, b))}
model = build(from_layer(FLASH, 2), 4, "cuda")
cache, sids = random_cache(model, 8, 1024, "cuda")
toks = decode_tokens(8, model.cfg.vocab_size)
logits = {}
for name, fn in VARIANTS.items():
    rn._launch_pair = fn
    for sid in sids:
        cache.truncate(sid, 1024)
    ids, fb = cache.plan({sid: [tok] for sid, tok in zip(sids, toks)})
    logits[name] = model.logits(model(ids.cuda(), fb, cache.storage)).clone()
assert all(torch.equal(v, logits["separate"]) for v in logits.values())
print(json.dumps({"check": "same bits", "batch": 8}), flush=True)
rows = []
for b, ctx in ((1, 1024), (8, 1024), (32, 1024), (1, 8192)):
    for rep in range(2):
        for name, fn in VARIANTS.items():
            rn._launch_pair = fn
            r = decode_ms(model, b, ctx, "cuda", ctx + 256)
            ms = per_layer_ms(r["replay_ms"], r["head_ms"], max(r["graph_ms"] - r["replay_ms"], 0.0), 4, r["preamble_ms"])
            rows.append({"batch": b, "context": ctx, "variant": name, "rep": rep, "ms_per_layer": ms,
                         "replay_ms_per_layer": r["replay_ms"] / 4})
            print(json.dumps(rows[-1]), flush=True)
rn._launch_pair = paired
open(os.path.join(os.environ.get("OUT", "."), "ab_pairs.json"), "w").write(json.dumps(rows, indent=2))
