"""bench/layer_sweep_v41.py runs at tiny sizes on the CPU (the smoke test of the script the GPU sweep runs)."""

from __future__ import annotations

import json
import sys

from bench import layer_sweep_v41


def test_tiny_sweep_on_cpu_writes_every_point(tmp_path, monkeypatch, one_thread) -> None:
    monkeypatch.setattr(sys, "argv", ["layer_sweep_v41.py", "--tiny", "--device", "cpu", "--batches", "1", "4",
                                      "--prefill", "128", "--v4-layers", "1", "--out", str(tmp_path)])
    layer_sweep_v41.main()
    data = json.loads((tmp_path / "layer_sweep_v41_tiny.json").read_text())
    kinds = [(r["model"], r["kind"]) for r in data["rows"]]
    assert kinds == [("v4.1-flash", "decode")] * 2 + [("v4.1-flash", "prefill"), ("v4-flash", "decode"),
                                                       ("v4-flash", "decode"), ("v4-flash", "prefill")]
    decode = data["rows"][0]
    assert [layer["role"] for layer in decode["layers"]] == [r for r, _ in layer_sweep_v41.ROLES]
    assert all(layer["ms"] > 0 and layer["bytes_held"] > 0 for layer in decode["layers"])
    assert sum(layer_sweep_v41.ROLES[i][1] for i in range(6)) == 40 and decode["tpot_40_layers_ms"] > 0
