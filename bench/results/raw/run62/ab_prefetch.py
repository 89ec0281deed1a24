"""The expert op at small T: two launches vs one launch of the tile queue, the waiting down tiles' L2 prefetch on
and off, for the 64-row (table row 0) and the 128-row, 168-register (row 1) gate/up tiles. Graph-timed, the
model's weight layout, 4 routing sets rotated (bench_moe.py's harness). Ran at 54fdd6e; the prefetch switch
(moe_one_launch.PREFETCH) was removed after this run."""
import dataclasses, json, os, sys
sys.path[:0] = ["."]
import torch
from bench.kernels.bench_moe import E, K, LIMIT, make_weights, routing, time_op
from deepinfer.ops.triton import fp4_codes, moe_one_launch
from deepinfer.ops.triton import moe_experts as tri

wts = make_weights(0)
s13, s2 = wts["e13"].view(torch.float8_e8m0fnu), wts["e2"].view(torch.float8_e8m0fnu)
weights = (*fp4_codes.expert_layout(wts["w13"], s13), *fp4_codes.expert_layout(wts["w2"], s2))
row0, row1 = tri.CONFIG_TABLE[0][1], tri.CONFIG_TABLE[1][1]
variants = []
for tag, base in (("n64", row0), ("n128 r168", row1)):
    variants += [(f"{tag} two", dataclasses.replace(base, one_launch=False), True),
                 (f"{tag} one", dataclasses.replace(base, one_launch=True), True),
                 (f"{tag} one no-prefetch", dataclasses.replace(base, one_launch=True), False)]
rows = []
for n_tok in (1, 2, 4, 8, 16, 32):
    sets = [routing(n_tok, 1000 * n_tok + r) for r in range(4)]
    ref = None
    for name, cfg, pf in variants:
        moe_one_launch.PREFETCH = pf
        op = lambda r, cfg=cfg: tri.moe_experts_fp4_with_config(*sets[r], *weights, LIMIT, cfg)
        out = op(0)
        ref = out if ref is None else ref
        rows.append({"T": n_tok, "variant": name, "us": time_op(op, 4, graph=True), "same": torch.equal(out, ref)})
        print(json.dumps(rows[-1]), flush=True)
moe_one_launch.PREFETCH = True
open(os.path.join(os.environ.get("OUT", "."), "ab_prefetch.json"), "w").write(json.dumps(rows, indent=2))
