"""hc_pre (mixes + finish) at V4-Flash shapes, graph-timed, with the Sinkhorn divisions by div_rn vs by the
fast path (mhc.FAST_DIV), T = 1 / 8 / 32 / 128; comb bits compared between the two."""
import json, os, sys
sys.path[:0] = ["."]
import torch
from triton.testing import do_bench_cudagraph
from deepinfer.ops.triton import mhc

rows = []
g = torch.Generator(device="cuda").manual_seed(0)
N, H = 4, 4096
fn = torch.randn(24, N * H, generator=g, device="cuda") / (N * H) ** 0.5
base = torch.randn(24, generator=g, device="cuda") * 0.5
scale = torch.tensor([1.0, 1.5, 2.0], device="cuda")
for T in (1, 8, 32, 128):
    x = torch.randn(T, N, H, generator=g, device="cuda").bfloat16()
    res = {}
    for fast in (False, True):
        mhc.FAST_DIV = fast
        res[fast] = [r.clone() for r in mhc.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6)]
        us = do_bench_cudagraph(lambda: mhc.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6), rep=200,
                                return_mode="median") * 1e3
        rows.append({"T": T, "fast_div": fast, "us": us})
        print(json.dumps(rows[-1]), flush=True)
    assert all(torch.equal(a, b) for a, b in zip(res[True], res[False])), T
mhc.FAST_DIV = True
open(os.path.join(os.environ.get("OUT", "."), "mhc_fast_div.json"), "w").write(json.dumps(rows, indent=2))
