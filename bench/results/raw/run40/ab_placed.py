"""Same process A/B: tile-major codes vs tile-major + placed codes (same scales), graph-timed, alternating."""
import json, os, sys
import torch
sys.path[:0] = [".", "bench/kernels"]
import bench_moe as bm
from deepinfer.ops.triton import fp4_codes, moe_experts as tri

wts = bm.make_weights(0)
s13, s2 = wts["e13"].view(torch.float8_e8m0fnu), wts["e2"].view(torch.float8_e8m0fnu)
lay = {p: (*fp4_codes.expert_layout(wts["w13"], s13, placed=p), *fp4_codes.expert_layout(wts["w2"], s2, placed=p))
       for p in (False, True)}
rows = []
for T in (1, 8, 32, 128, 512, 4096):
    rot = 2 if T >= 1024 else 8
    sets = [bm.routing(T, 1000 * T + r) for r in range(rot)]
    us = {}
    for i in range(2):
        for p in (False, True):
            us[f"{'placed' if p else 'tiled'}{i}"] = bm.time_op(
                lambda r, wt=lay[p]: tri.moe_experts_fp4(*sets[r], *wt, bm.LIMIT), rot, graph=True)
    same = torch.equal(tri.moe_experts_fp4(*sets[0], *lay[False], bm.LIMIT),
                       tri.moe_experts_fp4(*sets[0], *lay[True], bm.LIMIT))
    hit = sum(torch.unique(ids).numel() for _, ids, _ in sets) / rot
    floor_us = (hit * bm.expert_bytes(1) + 2 * T * bm.H * 2) / bm.COPY_BW * 1e6
    row = {"T": T, **{k: round(v, 1) for k, v in us.items()}, "bitwise": same, "floor_us": round(floor_us, 1)}
    rows.append(row)
    print(json.dumps(row), flush=True)
open(os.path.join(os.environ.get("OUT", "."), "ab_placed.json"), "w").write(json.dumps(rows, indent=2))
