"""Same process A/B of the MoE pair alignment: moe_align_old.py beside this script (the one-hot fill and
counts: `git show 636ef29:deepinfer/ops/triton/moe_align.py > bench/results/raw/run52/moe_align_old.py`) vs
the working tree's ops/triton/moe_align.py (fill from the experts' side, tl.histogram counts), V4-Flash
routing (E=256, k=6, block_m=16), graph-timed, outputs compared bitwise."""
import importlib.util, json, os, sys
from pathlib import Path
sys.path[:0] = ["."]
import torch
from triton.testing import do_bench_cudagraph
from deepinfer.ops.triton import moe_align as new

spec = importlib.util.spec_from_file_location("moe_align_old", Path(__file__).with_name("moe_align_old.py"))
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
rows = []
g = torch.Generator(device="cuda").manual_seed(0)
for t in (1, 8, 16, 32, 64, 128, 4096):
    ids = torch.stack([torch.randperm(256, device="cuda", generator=g)[:6] for _ in range(t)])
    a, b = old.align_pairs(ids, 256, 16), new.align_pairs(ids, 256, 16)
    same = all(torch.equal(x, y) for x, y in zip(a, b))
    for rep in range(2):
        for name, mod in (("old", old), ("new", new)):
            us = do_bench_cudagraph(lambda: mod.align_pairs(ids, 256, 16), rep=100, return_mode="median") * 1e3
            rows.append({"T": t, "impl": name, "rep": rep, "us": us, "bitwise_equal": same})
            print(json.dumps(rows[-1]), flush=True)
open(os.path.join(os.environ.get("OUT", "."), "ab_align.json"), "w").write(json.dumps(rows, indent=2))
