"""Check, then same-process A/B of programmatic dependent launch (ops/triton/pdl.py) on the 4-layer V4-Flash-shaped model:
PDL on (with the weight-slice L2 prefetch), PDL on with a one-line prefetch per row, PDL off. Decode steps at
b1 / b8 / b32 ctx 1K and b1 ctx 8K, two reps each, graph-timed by the sweep harness. First, the same steps'
logits (b8 and b32, ctx 1K) from graphs captured with PDL on and off, and eager with PDL off, must be the same
bits (every kernel of the path is run-to-run deterministic), over 20 replays each."""
import json, os, sys
sys.path[:0] = ["."]
from deepinfer.ops.triton import pdl
import torch
from bench.layer_sweep import FLASH, build, decode_ms, decode_tokens, from_layer, per_layer_ms, random_cache
from deepinfer.runner.cuda_graphs import DecodeGraphs

row_bytes = pdl.row_bytes
VARIANTS = {"pdl+prefetch": (True, row_bytes), "pdl, 1 line": (True, lambda span: 1), "off": (False, row_bytes)}
rows = []
model = build(from_layer(FLASH, 2), 4, "cuda")


def same_bits(batch, ctx):
    cache, sids = random_cache(model, batch, ctx, "cuda")
    toks = decode_tokens(batch, model.cfg.vocab_size)

    def plan():
        for sid in sids:
            cache.truncate(sid, ctx)
        return cache.plan({sid: [tok] for sid, tok in zip(sids, toks)})

    pdl.ENABLED = False
    ids, fb = plan()
    ref = model.logits(model(ids.cuda(), fb, cache.storage)).clone()
    for on in (True, False):
        pdl.ENABLED = on
        graphs = DecodeGraphs(model, cache.storage, ctx + 256, [batch])
        graphs.capture()
        for _ in range(20):
            ids, fb = plan()
            got = graphs.run(ids.tolist(), fb)
            assert torch.equal(got, ref), (on, batch, (got.float() - ref.float()).abs().max().item())
        del graphs
    print(json.dumps({"check": "same bits", "batch": batch, "ctx": ctx}), flush=True)


for b in (8, 32):
    same_bits(b, 1024)
for ctx, b in ((1024, 1), (1024, 8), (1024, 32), (8192, 1)):
    for rep in range(2):
        for name, (on, rb) in VARIANTS.items():
            pdl.ENABLED, pdl.row_bytes = on, rb
            t = decode_ms(model, b, ctx, "cuda", ctx + 256)
            ms = per_layer_ms(t["replay_ms"], t["head_ms"], max(t["graph_ms"] - t["replay_ms"], 0.0), 4, t["preamble_ms"])
            rows.append({"ctx": ctx, "batch": b, "variant": name, "rep": rep, "ms_per_layer": ms,
                         "replay_ms_per_layer": t["replay_ms"] / 4})
            print(json.dumps(rows[-1]), flush=True)
pdl.ENABLED, pdl.row_bytes = True, row_bytes
open(os.path.join(os.environ.get("OUT", "."), "ab_pdl.json"), "w").write(json.dumps(rows, indent=2))
