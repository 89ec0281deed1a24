#!/usr/bin/env bash
# GPU sweep (run on the H200): per-layer V4-Flash decode/prefill vs HF transformers, then the kernel benches.
#   LAYERS=4 bash bench/run_sweep.sh            # results -> $OUT (device tool) or bench/results
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 bench/layer_sweep.py --layers "${LAYERS:-4}" --batches 1 8 32 128 --contexts 1024 8192 \
  --prefill 1024 4096 16384 --hf --out "$OUT" 2>&1 | tee "$OUT/layer_sweep.log"
BENCHES="${BENCHES:-fp8_linear moe attention}" bash bench/gpu_check.sh
