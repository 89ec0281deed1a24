#!/usr/bin/env bash
# GPU sweep (run on the H200): per-layer V4-Flash decode/prefill vs HF transformers, then the kernel benches.
#   LAYERS=4 bash bench/run_sweep.sh            # results -> $OUT (device tool) or bench/results
#   COMMIT=abc1234 ...                          # the commit to record where the checkout has no git history
# Writes layer_sweep.{json,md,png} (the PNG where matplotlib is installed; else run bench/sweep_report.py
# on the fetched JSON).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# The peer is HF transformers $HF_VERSION: the importable one if it is that version, else its wheel carried in
# .whl/ (`pip download transformers==5.23.0 --no-deps -d .whl` on a machine with network), installed into a
# scratch folder for this run only. Without either the sweep still runs and records the version it timed.
HF_VERSION=${HF_VERSION:-5.23.0}
have=$(python3 -c "import transformers; print(transformers.__version__)" 2>/dev/null || true)
if [ "${HF---hf}" = "--hf" ] && [ "$have" != "$HF_VERSION" ]; then
  wheel=$(ls .whl/transformers-"$HF_VERSION"-*.whl 2>/dev/null | head -n 1)
  if [ -n "$wheel" ]; then
    site=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheel" \
      && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "run_sweep: transformers ${have:-missing} importable, $HF_VERSION wanted for the peer (no .whl/ wheel)" >&2
  fi
fi
python3 bench/layer_sweep.py --layers "${LAYERS:-4}" --batches ${BATCHES:-1 8 32 128} --contexts 1024 8192 \
  --prefill ${PREFILL:-1024 4096 16384} ${HF:---hf} ${COMMIT:+--commit "$COMMIT"} --out "$OUT" 2>&1 \
  | tee "$OUT/layer_sweep.log"
python3 bench/sweep_report.py "$OUT/layer_sweep.json" > /dev/null || true
[ -n "${BENCHES-x}" ] && BENCHES="${BENCHES:-fp8_linear moe attention}" bash bench/gpu_check.sh
