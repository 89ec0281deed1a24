"""The expert op at T = 1..4: K splits (existing TileConfig options: splits2 = down K chunks summed in the combine;
split_gate_up + splits1 = gate|up K chunks summed by the SwiGLU kernel) against the table's pick. More, shorter
programs where one decode token leaves ~1.5 per SM. Graph-timed on the model's layout, 4 routing sets rotated
(bench_moe.py's harness); K splits change the summation order, so bits are compared only to the reference
tolerance (rel diff printed)."""
import dataclasses, json, os, sys
sys.path[:0] = ["."]
import torch
from bench.kernels.bench_moe import E, K, LIMIT, make_weights, routing, time_op
from deepinfer.ops.triton import fp4_codes
from deepinfer.ops.triton import moe_experts as tri

wts = make_weights(0)
s13, s2 = wts["e13"].view(torch.float8_e8m0fnu), wts["e2"].view(torch.float8_e8m0fnu)
weights = (*fp4_codes.expert_layout(wts["w13"], s13), *fp4_codes.expert_layout(wts["w2"], s2))
rows = []
for n_tok in (1, 2, 4):
    base = tri.pick_config(n_tok * K, E)
    two = dataclasses.replace(base, one_launch=False, max_regs=None)
    variants = {"table": base, "two": two,
                "down/2": dataclasses.replace(two, splits2=2), "down/4": dataclasses.replace(two, splits2=4),
                "gu/2": dataclasses.replace(two, split_gate_up=True, splits1=2),
                "gu/2 down/2": dataclasses.replace(two, split_gate_up=True, splits1=2, splits2=2),
                "gu/4 down/2": dataclasses.replace(two, split_gate_up=True, splits1=4, splits2=2),
                "gu/1 split": dataclasses.replace(two, split_gate_up=True)}
    sets = [routing(n_tok, 1000 * n_tok + r) for r in range(4)]
    ref = None
    for name, cfg in variants.items():
        op = lambda r, cfg=cfg: tri.moe_experts_fp4_with_config(*sets[r], *weights, LIMIT, cfg)
        out = op(0)
        ref = out if ref is None else ref
        diff = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        rows.append({"T": n_tok, "variant": name, "us": time_op(op, 4, graph=True), "rel_diff": diff})
        print(json.dumps(rows[-1]), flush=True)
open(os.path.join(os.environ.get("OUT", "."), "sweep_splits.json"), "w").write(json.dumps(rows, indent=2))
