#!/usr/bin/env bash
# GPU sweep (run on the H200): per-layer V4-Flash decode/prefill vs HF transformers, then the kernel benches.
#   LAYERS=4 bash bench/run_sweep.sh            # results -> $OUT (device tool) or bench/results
# Writes layer_sweep.{json,md,png} (the PNG where matplotlib is installed; else run bench/sweep_report.py
# on the fetched JSON).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 bench/layer_sweep.py --layers "${LAYERS:-4}" --batches ${BATCHES:-1 8 32 128} --contexts 1024 8192 \
  --prefill ${PREFILL:-1024 4096 16384} ${HF:---hf} --out "$OUT" 2>&1 | tee "$OUT/layer_sweep.log"
python3 bench/sweep_report.py "$OUT/layer_sweep.json" > /dev/null || true
[ -n "${BENCHES-x}" ] && BENCHES="${BENCHES:-fp8_linear moe attention}" bash bench/gpu_check.sh
