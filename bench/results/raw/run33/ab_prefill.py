import sys, time
sys.path.insert(0, '.')
import torch
from bench.layer_sweep import FLASH, build, from_layer, prefill_ms
from deepinfer.ops.triton import moe_experts as tri

keep = tri.expert_layout
models = {}
for name, layout in (("tiled", keep), ("natural", lambda w: w)):
    tri.expert_layout = layout
    models[name] = build(from_layer(FLASH, 2), 4, "cuda")
    print(name, type(models[name].layers[0].ffn.fused.w13.shape), tuple(models[name].layers[0].ffn.fused.w13.shape), flush=True)
tri.expert_layout = keep
for rep in range(3):
    for name, m in models.items():
        print(rep, name, "prefill 4096 ms/layer", round(prefill_ms(m, 4096, "cuda", 4096) / 4, 3), flush=True)
