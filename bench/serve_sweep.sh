#!/usr/bin/env bash
# `deepinfer serve` on the bundled demo model under `deepinfer bench serve`: random prompts of INPUTS tokens,
# 128 output tokens, at each CONCURRENCY (16 prompts at 1, else 8 rounds of it within 256..1024 prompts), once
# per engine mode in MODES (default: "thread process": the engine in a thread of the server,
# --no-engine-process, and in its own process, the default) and scheduling loop
# in LOOPS (default: async, then sync), each server warmed up first; REPEATS > 1 runs the whole set again
# (loops interleaved: async, sync, async, sync, ...: how far a loop's figures move between servers). One JSON per
# run under $OUT/serve; `python bench/serve_report.py $OUT/serve` writes bench/results/serve_demo.md from them.
# MODEL_ARGS serves another model, e.g. 4 V4-Flash-shaped layers with dummy weights (the demo tokenizer has V4's
# vocabulary; JSON without spaces, the variable is split on them):
#   MODEL_ARGS='--model deepinfer/assets/shapes/v4-flash --load-format dummy --hf-overrides {"num_hidden_layers":4}
#   --tokenizer deepinfer/assets/demo' SERVER_ARGS="... --cache-memory-gb 24" bash bench/serve_sweep.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/serve"
CONCURRENCY=${CONCURRENCY:-"1 16 64 256"}
INPUTS=${INPUTS:-"512 1024"}
PORT=${PORT:-8123}
SERVER_ARGS=${SERVER_ARGS:-"--max-num-seqs 256 --max-model-len 2048 --max-num-batched-tokens 8192 --block-size 256 --cache-memory-gb 8"}
MODEL_ARGS=${MODEL_ARGS:-}
LOOPS=${LOOPS:-"async sync"}
MODES=${MODES:-"thread process"}
REPEATS=${REPEATS:-1}
CLIENTS=${CLIENTS:-1}  # deepinfer bench serve --num-client-processes: one client process can be the bottleneck
for rep in $(seq "$REPEATS"); do
for mode in $MODES; do
for loop in $LOOPS; do
  flag=--async-scheduling; [ "$loop" = sync ] && flag=--no-async-scheduling
  engine=--engine-process; [ "$mode" = thread ] && engine=--no-engine-process
  run="${mode}_$loop"
  suffix=""; [ "$REPEATS" -gt 1 ] && suffix="_r$rep"
  # shellcheck disable=SC2086
  python3 -m deepinfer.server --port "$PORT" $SERVER_ARGS $MODEL_ARGS "$flag" "$engine" > "$OUT/serve/server_$run$suffix.log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do
    kill -0 "$pid" 2>/dev/null || { echo "server ($run) exited:"; tail -n 20 "$OUT/serve/server_$run$suffix.log"; exit 1; }
    python3 -c "import httpx; httpx.get('http://127.0.0.1:$PORT/health').raise_for_status()" 2>/dev/null && break
    sleep 1
  done
  # Warm-up (not recorded): the first prefills of each shape compile kernels, which no loop should be charged.
  for in_len in $INPUTS; do
    python3 -m deepinfer.cli bench serve --base-url "http://127.0.0.1:$PORT" --backend openai --dataset-name random \
      --random-input-len "$in_len" --random-output-len 16 --num-prompts 64 --max-concurrency 64 --ignore-eos \
      --seed 1 --disable-tqdm > /dev/null 2>&1
  done
  for in_len in $INPUTS; do
    for c in $CONCURRENCY; do
      # Enough prompts for the steady state: two rounds of the concurrency measured mostly the opening burst
      # (all prompts arriving at once, one big prefill).
      n=$(( c == 1 ? 16 : (8 * c < 256 ? 256 : (8 * c > 1024 ? 1024 : 8 * c)) ))
      python3 -m deepinfer.cli bench serve --base-url "http://127.0.0.1:$PORT" --backend openai --dataset-name random \
        --random-input-len "$in_len" --random-output-len 128 --random-range-ratio 0 --num-prompts "$n" \
        --max-concurrency "$c" --num-client-processes "$(( CLIENTS < c ? CLIENTS : c ))" --ignore-eos --seed 0 --disable-tqdm --save-result --result-dir "$OUT/serve" \
        --result-filename "${run}_${in_len}_${c}${suffix}.json" --metadata "loop=$loop" --metadata "mode=$mode" 2>&1 | tail -n 4
    done
  done
  kill "$pid"; wait "$pid"
done
done
done
