"""bench/multi_gpu.py runs end to end on the CPU: a 2-rank gloo world (DP2 + EP, context parallel over both
ranks) of the demo model's shapes truncated to two layers with dummy weights, decode, prefill and a long
prefill under context parallelism timed, JSON and markdown written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from deepinfer.assets import demo_model_dir

ROOT = Path(__file__).resolve().parents[2]


def test_multi_gpu_bench_smoke(tmp_path: Path) -> None:
    cmd = [sys.executable, str(ROOT / "bench" / "multi_gpu.py"), "--model", str(demo_model_dir()), "--layers", "2",
           "--device", "cpu", "--data-parallel-size", "2", "--enable-expert-parallel", "--batches", "1", "4",
           "--prompt-len", "16", "--tokens", "4", "--prefill", "64", "--out", str(tmp_path),
           "--context-parallel-size", "2", "--context-parallel-min-tokens", "32"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "multi_gpu_tp1-dp2-ep-cp2.json").read_text())
    assert (result["layout"], result["layers"], result["world_size"]) == ("tp1-dp2-ep-cp2", 2, 2)
    assert [d["batch"] for d in result["decode"]] == [1, 4]
    for d in result["decode"]:
        assert d["decode_steps"] == 3 and d["tokens_per_s"] > 0  # 4 tokens: the first from the prefill
    assert result["prefill"]["seqs"] == 2 and result["prefill"]["tokens_per_s"] > 0
    assert result["long_prefill"]["cp_chunks"] == 1 and result["long_prefill"]["tokens_per_s"] > 0
    table = (tmp_path / "multi_gpu_tp1-dp2-ep-cp2.md").read_text()
    assert "| 4 |" in table and "Prefill: 2 x 64 tokens" in table and "(CP2): 1 x 64 tokens" in table
