"""Same-process A/B on the 4-layer V4-Flash-shaped model: each mHC site's Sinkhorn on a third stream beside
the block (Block.mhc_branches, hc_pre_split) vs the one-call hc_pre (INLINE). Logits bits compared first (b8);
then decode steps at b1 / b32 ctx 1K, two reps."""
import json, os, sys
sys.path[:0] = ["."]
import torch
from bench.layer_sweep import FLASH, build, decode_ms, decode_tokens, from_layer, per_layer_ms, random_cache
from deepinfer.model.branches import INLINE, Branches

model = build(from_layer(FLASH, 2), 4, "cuda")
side = Branches(torch.device("cuda"), lane=2)


def use(b):
    for layer in model.layers:
        layer.mhc_branches = b


cache, sids = random_cache(model, 8, 1024, "cuda")
toks = decode_tokens(8, model.cfg.vocab_size)
got = {}
for name, b in (("side", side), ("inline", INLINE)):
    use(b)
    for sid in sids:
        cache.truncate(sid, 1024)
    ids, fb = cache.plan({sid: [tok] for sid, tok in zip(sids, toks)})
    got[name] = model.logits(model(ids.cuda(), fb, cache.storage)).clone()
assert torch.equal(got["side"], got["inline"])
print(json.dumps({"check": "same bits", "batch": 8}), flush=True)
rows = []
for b in (1, 32):
    for rep in range(2):
        for name, br in (("side", side), ("inline", INLINE)):
            use(br)
            t = decode_ms(model, b, 1024, "cuda", 1024 + 256)
            ms = per_layer_ms(t["replay_ms"], t["head_ms"], max(t["graph_ms"] - t["replay_ms"], 0.0), 4, t["preamble_ms"])
            rows.append({"batch": b, "variant": name, "rep": rep, "ms_per_layer": ms})
            print(json.dumps(rows[-1]), flush=True)
use(side)
open(os.path.join(os.environ.get("OUT", "."), "ab_mhc_side.json"), "w").write(json.dumps(rows, indent=2))
