#!/usr/bin/env bash
# Nsight Compute on the decode kernels that bound a decode step (run on the GPU; runs 41 and 50 in
# bench/results/README.md read these): the routed experts' gate/up and down kernels at T tokens, and each FP8
# GEMM of a decode layer at M tokens.
#   T=32 M=1 bash bench/kernels/ncu_decode.sh        # reports -> $OUT (or /tmp/ncu)
# Throughput, occupancy (and what limits it) and warp stall reasons per kernel; --clock-control none keeps
# the clocks the benchmarks run at. The grep at the end prints the lines the results quote.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ncu}; mkdir -p "$OUT"
S="--section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats --section MemoryWorkloadAnalysis"
ncu --clock-control none $S -k regex:"_gate_up_kernel|_matmul_kernel" --launch-skip 2 --launch-count 2 \
  python3 bench/kernels/bench_moe.py --profile-run --tokens "${T:-32}" > "$OUT/ncu_moe.txt" 2>&1
# 6 GEMMs per layer, 3 repetitions per M: skip the first repetition, profile the second.
ncu --clock-control none $S -k regex:"_fp8_linear|_fp8_decode" --launch-skip 6 --launch-count 6 \
  python3 bench/kernels/bench_fp8_decode.py --profile-run --tokens ${M:-1} > "$OUT/ncu_fp8.txt" 2>&1
grep -E "^  _|Duration|DRAM Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Warp Cycles Per Issued|Grid Size|Block Limit (Registers|Shared)" \
  "$OUT/ncu_moe.txt" "$OUT/ncu_fp8.txt"
