"""Same-process A/B on the 4-layer V4-Flash-shaped model: hc_post_pre as two launches (the two-pass post +
next mixes kernel at 8 and at 4 warps, then the finish kernel) vs three (hc_post, then hc_pre: FUSE off).
Decode steps at b1 / b8 / b32 ctx 1K and b1 ctx 8K, two reps, graph-timed by the sweep harness; logits compared (the new
streams' 4-term mix may sum in another order than hc_post's tl.sum: rare one-ulp differences)."""
import json, os, sys
sys.path[:0] = ["."]
import torch
from deepinfer.ops.triton import mhc_fused
from bench.layer_sweep import FLASH, build, decode_ms, decode_tokens, from_layer, per_layer_ms, random_cache

VARIANTS = {"fused 8 warps": (True, 8), "fused 4 warps": (True, 4), "separate": (False, 8)}
model = build(from_layer(FLASH, 2), 4, "cuda")
cache, sids = random_cache(model, 8, 1024, "cuda")
toks = decode_tokens(8, model.cfg.vocab_size)
logits = {}
for name, (fuse, nw) in VARIANTS.items():
    mhc_fused.FUSE, mhc_fused.NUM_WARPS = fuse, nw
    for sid in sids:
        cache.truncate(sid, 1024)
    ids, fb = cache.plan({sid: [tok] for sid, tok in zip(sids, toks)})
    logits[name] = model.logits(model(ids.cuda(), fb, cache.storage)).float().clone()
b = logits["separate"]
for name, a in logits.items():
    print(json.dumps({"check": "logits vs separate", "variant": name, "batch": 8, "equal": bool(torch.equal(a, b)),
                      "max_abs_diff": float((a - b).abs().max()), "rel_err": float((a - b).norm() / b.norm()),
                      "argmax_equal": bool(torch.equal(a.argmax(-1), b.argmax(-1)))}), flush=True)
rows = []
for bsz, ctx in ((1, 1024), (8, 1024), (32, 1024), (1, 8192)):
    for rep in range(2):
        for name, (fuse, nw) in VARIANTS.items():
            mhc_fused.FUSE, mhc_fused.NUM_WARPS = fuse, nw
            r = decode_ms(model, bsz, ctx, "cuda", ctx + 256)
            ms = per_layer_ms(r["replay_ms"], r["head_ms"], max(r["graph_ms"] - r["replay_ms"], 0.0), 4, r["preamble_ms"])
            rows.append({"batch": bsz, "context": ctx, "variant": name, "rep": rep, "ms_per_layer": ms,
                         "replay_ms_per_layer": r["replay_ms"] / 4})
            print(json.dumps(rows[-1]), flush=True)
mhc_fused.FUSE, mhc_fused.NUM_WARPS = True, 8
open(os.path.join(os.environ.get("OUT", "."), "ab_post_pre.json"), "w").write(json.dumps(rows, indent=2))

# The op alone, graph-timed µs per call (fn and streams rotated over sets that overflow the 50 MB L2).
from bench.kernels.bench_moe import time_op
from deepinfer.ops.triton import mhc
op_rows = []
for T in (1, 8, 32, 128, 4096):
    rot = 2 if T >= 4096 else 48
    g = torch.Generator(device="cuda").manual_seed(T)
    sets = []
    for _ in range(rot):
        s = torch.randn(T, 4, 4096, device="cuda", generator=g).bfloat16()
        o = torch.randn(T, 4096, device="cuda", generator=g).bfloat16()
        post = torch.rand(T, 4, device="cuda", generator=g) * 2
        comb = torch.rand(T, 4, 4, device="cuda", generator=g) / 4
        fn = torch.randn(24, 16384, device="cuda", generator=g) / 128
        sets.append((s, o, post, comb, fn, torch.zeros(24, device="cuda"), torch.ones(3, device="cuda")))
    for name, (fuse, nw) in VARIANTS.items():
        mhc_fused.FUSE, mhc_fused.NUM_WARPS = fuse, nw
        us = time_op(lambda r: mhc_fused.hc_post_pre(*sets[r], 20, 1e-6, 1e-6), rot, True)
        op_rows.append({"T": T, "variant": name, "us": us})
        print(json.dumps(op_rows[-1]), flush=True)
mhc_fused.FUSE, mhc_fused.NUM_WARPS = True, 8
open(os.path.join(os.environ.get("OUT", "."), "ab_post_pre_op.json"), "w").write(json.dumps(op_rows, indent=2))
