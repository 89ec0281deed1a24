"""Peak host memory of a quantized-first load: a sharded native-format checkpoint (the flash-like preset, ~50 MB
in ~8 MB shards, dummy values) loads onto the CPU through the device transform's modules (REF op table) in a fresh
process, and its peak RSS beyond what the loaded model itself occupies stays below the largest shard plus a
small constant (one tensor in flight, allocator slack). Loading everything first, keeping the shards mapped
or dequantizing would each exceed it (the whole checkpoint is 6x a shard)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.testing.make_checkpoint import PRESETS, write_dummy_checkpoint

SLACK = 32 << 20  # bytes beyond the largest shard: one tensor in flight and the allocator's retained pages

MEASURE = r"""
import gc, json, resource, sys
import torch
from deepinfer.model.loader import load_model
from deepinfer.ops.table import REF

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux

# Warm-up on a tiny checkpoint: torch's lazy one-time initialization is not the loader's memory.
del_me = load_model(sys.argv[1], dtype=torch.bfloat16, progress=False, ops=REF)
del del_me
gc.collect()
base = peak()
model = load_model(sys.argv[2], dtype=torch.bfloat16, progress=False, ops=REF)
top = peak()
storages = {}
for t in [*model.parameters(), *model.buffers()]:
    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
print(json.dumps({"base": base, "peak": top, "model": sum(storages.values())}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in kilobytes is Linux's convention")
def test_peak_host_memory_of_a_sharded_load(tmp_path: Path) -> None:
    big, warm = tmp_path / "flash", tmp_path / "tiny"
    write_dummy_checkpoint(big, copy.deepcopy(PRESETS["flash-like"]), seed=0, shard_max_bytes=8_000_000)
    write_dummy_checkpoint(warm, {**copy.deepcopy(PRESETS["tiny"]), "moe_intermediate_size": 32}, seed=0)
    shards = [p.stat().st_size for p in big.glob("*.safetensors")]
    assert len(shards) >= 5
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", MEASURE, str(warm), str(big)], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    overhead = m["peak"] - m["base"] - m["model"]
    assert m["model"] > 0.9 * sum(shards)  # the model holds the checkpoint's bytes, quantized
    assert overhead < max(shards) + SLACK, (overhead, max(shards), sum(shards))
