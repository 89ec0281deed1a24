"""Same-process A/B on the 4-layer V4-Flash-shaped model: the kv norm+RoPE writing its row straight into the
window cache and the indexer's head weights upcast and scaled inside the op (new) vs a separate index_copy_
and a separate fp32 cast and multiply (old; op-table wrappers reproduce the previous launches). Logits bits
compared first (b8 ctx 1K); then decode steps at b1 / b8 / b32 ctx 1K and b1 ctx 8K, two reps."""
import dataclasses, json, os, sys
sys.path[:0] = ["."]
import torch
from bench.layer_sweep import FLASH, build, decode_ms, decode_tokens, from_layer, per_layer_ms, random_cache

model = build(from_layer(FLASH, 2), 4, "cuda")
new_ops = model.ops


def norm_rope_old(x, w, eps, cos, sin, *, out=None, rows=None):
    y = new_ops.norm_rope(x, w, eps, cos, sin)
    return y if rows is None else out.index_copy_(0, rows, y)


def topk_old(q, weights, *args, weight_scale=1.0, **kw):
    return new_ops.indexer_topk(q, weights.float() * weight_scale, *args, **kw)


old_ops = dataclasses.replace(new_ops, norm_rope=norm_rope_old, indexer_topk=topk_old)
mods = [m for m in model.modules() if getattr(m, "ops", None) is new_ops]


def use(ops):
    for m in mods:
        m.ops = ops


cache, sids = random_cache(model, 8, 1024, "cuda")
toks = decode_tokens(8, model.cfg.vocab_size)
got = {}
for name, ops in (("new", new_ops), ("old", old_ops)):
    use(ops)
    for sid in sids:
        cache.truncate(sid, 1024)
    ids, fb = cache.plan({sid: [tok] for sid, tok in zip(sids, toks)})
    got[name] = model.logits(model(ids.cuda(), fb, cache.storage)).clone()
assert torch.equal(got["new"], got["old"])
print(json.dumps({"check": "same bits", "batch": 8}), flush=True)
rows = []
for ctx, b in ((1024, 1), (1024, 8), (1024, 32), (8192, 1)):
    for rep in range(2):
        for name, ops in (("new", new_ops), ("old", old_ops)):
            use(ops)
            t = decode_ms(model, b, ctx, "cuda", ctx + 256)
            ms = per_layer_ms(t["replay_ms"], t["head_ms"], max(t["graph_ms"] - t["replay_ms"], 0.0), 4, t["preamble_ms"])
            rows.append({"ctx": ctx, "batch": b, "variant": name, "rep": rep, "ms_per_layer": ms})
            print(json.dumps(rows[-1]), flush=True)
use(new_ops)
open(os.path.join(os.environ.get("OUT", "."), "ab_glue.json"), "w").write(json.dumps(rows, indent=2))
