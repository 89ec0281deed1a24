#!/usr/bin/env bash
# One GPU call: kernel tests, then kernel benchmarks. Logs and JSON land in $OUT (the device tool fetches them).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
timeout 300 python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -n 40 | tee "$OUT/gpu_tests.log"
for b in ${BENCHES:-fp8_linear attention moe}; do
  timeout 240 python3 bench/kernels/bench_$b.py 2>&1 | tee "$OUT/bench_$b.log" | tail -n 60
done
