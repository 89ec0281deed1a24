"""A/B of the routed-expert op: another version of ``ops/triton/moe_experts.py`` vs the working tree.

    git show REV:deepinfer/ops/triton/moe_experts.py > /tmp/old_moe.py
    python bench/kernels/ab_moe.py /tmp/old_moe.py [T ...]        (on the GPU; default T = 1 8 32 128 4096)

Both run in one process on the same weights and routing sets (bench_moe.py's V4-Flash shapes, UE8M0
scales), each CUDA-graph timed twice in the order old, new, old, new, so the spread between repeats shows
the noise. Prints µs, % of the bytes floor, new/old and the relative difference of the outputs (nonzero
when a change reorders the reduction). Writes $OUT/ab_moe.json when $OUT is set.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere without installing

import torch  # noqa: E402

from bench.kernels import bench_moe as bm  # noqa: E402
from deepinfer.ops.triton import moe_experts as new  # noqa: E402


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("moe_experts_other", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    old = load_module(sys.argv[1])
    tokens = [int(a) for a in sys.argv[2:]] or [1, 8, 32, 128, 4096]
    wts = bm.make_weights(0)
    s13, s2 = wts["e13"].view(torch.float8_e8m0fnu), wts["e2"].view(torch.float8_e8m0fnu)
    rows = []
    for n_tok in tokens:
        rotate = 2 if n_tok >= 1024 else 8
        sets = [bm.routing(n_tok, 1000 * n_tok + r) for r in range(rotate)]
        hit = sum(torch.unique(ids).numel() for _, ids, _ in sets) / rotate
        res = {"T": n_tok, "floor_us": (hit * bm.expert_bytes(1) + 2 * n_tok * bm.H * 2) / bm.COPY_BW * 1e6}
        outs = {}
        for rep in range(2):
            for tag, mod in (("old", old), ("new", new)):
                def op(r: int, mod=mod) -> torch.Tensor:
                    x, ids, w = sets[r]
                    return mod.moe_experts_fp4(x, ids, w, wts["w13"], s13, wts["w2"], s2, bm.LIMIT)
                outs[tag] = op(0)
                res[f"{tag}{rep}"] = bm.time_op(op, rotate, graph=True)
        a, b = outs["old"].double(), outs["new"].double()
        res["rel_diff"] = ((a - b).norm() / a.norm()).item()
        res["nan"] = bool(torch.isnan(outs["new"]).any())
        rows.append(res)
        print(json.dumps(res), flush=True)
    print("\n| T | floor µs | old µs | new µs | old of floor | new of floor | new/old | rel diff |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        o, n = min(r["old0"], r["old1"]), min(r["new0"], r["new1"])
        print(f"| {r['T']} | {r['floor_us']:.1f} | {r['old0']:.1f}/{r['old1']:.1f} | {r['new0']:.1f}/{r['new1']:.1f} | "
              f"{r['floor_us'] / o:.0%} | {r['floor_us'] / n:.0%} | {n / o:.2f} | {r['rel_diff']:.1e} |")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "ab_moe.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
