#!/usr/bin/env bash
# make bench-serving: `pdserve bench` against `pdserve run` (router, prefill
# and decode nodes in one process) under three loads — steady Poisson
# traffic, shared system prompts (the prefix cache), and an abort storm (30 %
# of the requests aborted at random moments plus abort-all bursts) — on the
# tiny built-in model, then on a random checkpoint of granite-4.0-h-350m's
# shape (a real hybrid Mamba2 + attention model, 0.34 B parameters).
#
#   bench/serving.sh BUILD_DIR [OUT_DIR]      (OUT_DIR: BUILD_DIR/bench-serving)
#   SERVING_MODELS="tiny granite-350m"        the models to run (default both)
#
# For each model and load: OUT_DIR/<model>-<load>.json (the results, one JSON
# line: SGLang bench_serving's fields, pdserve's under "pdserve") and
# OUT_DIR/<model>-<load>/report.html. Every run checks that both nodes end
# idle and clean; a leak fails the script.
set -euo pipefail
build=${1:?usage: bench/serving.sh BUILD_DIR [OUT_DIR]}
out=${2:-$build/bench-serving}
pdserve=$build/pdserve
models=${SERVING_MODELS:-tiny granite-350m}
mkdir -p "$out"

# A port nothing is bound to, drawn below the kernel's ephemeral range by the
# e2e harness's free_port (tests/e2e/pdtest.py): one from bind(0) is also
# given to outgoing connections, which could take it before pdserve binds it.
root=$(cd "$(dirname "$0")/.." && pwd)
free_port() {
  PDSERVE=$pdserve python3 -c 'import sys; sys.path.insert(0, sys.argv[1]); import pdtest; print(pdtest.free_port())' "$root/tests/e2e"
}

run_pid=
stop_run() {
  if [ -n "$run_pid" ]; then
    kill "$run_pid" 2>/dev/null || true
    wait "$run_pid" 2>/dev/null || true
    run_pid=
  fi
}
trap stop_run EXIT

start_run() { # name, then pdserve run's options
  local name=$1; shift
  port=$(free_port)
  "$pdserve" run --port "$port" "$@" > "$out/$name-run.log" 2>&1 &
  run_pid=$!
  for _ in $(seq 1200); do
    if curl -sf "http://127.0.0.1:$port/health" > /dev/null 2>&1; then return 0; fi
    if ! kill -0 "$run_pid" 2>/dev/null; then break; fi
    sleep 0.1
  done
  echo "bench-serving: pdserve run did not start:" >&2
  tail -20 "$out/$name-run.log" >&2
  exit 1
}

load() { # model, load name, then pdserve bench's options
  local model=$1 name=$2; shift 2
  local tag="$model-$name"
  echo "== $tag =="
  rm -f "$out/$tag.json"
  "$pdserve" bench --base-url "http://127.0.0.1:$port" --check-node "http://127.0.0.1:$port" \
    --output-file "$out/$tag.json" --report "$out/$tag" --seed 1 "$@"
  echo
}

for model in $models; do
  case $model in
  tiny)
    start_run tiny --max-running-requests 64
    load tiny steady --num-prompts 600 --request-rate 40 --random-input-len 256 \
      --random-output-len 64 --slo ttft=500ms,tpot=50ms
    load tiny shared-prefix --dataset-name shared-prefix --num-prompts 400 --request-rate 20 \
      --max-concurrency 128 --gsp-num-groups 8 --gsp-system-prompt-len 512 \
      --gsp-question-len 64 --random-output-len 32 --slo ttft=500ms,tpot=50ms
    load tiny abort-storm --num-prompts 600 --max-concurrency 64 --random-input-len 256 \
      --random-output-len 128 --abort-fraction 0.3 --abort-after-ms 0:400 --abort-all-every-s 4
    stop_run
    ;;
  granite-350m)
    dir=$out/granite-4.0-h-350m
    if [ ! -f "$dir/config.json" ]; then
      "$pdserve" model init --config granite-4.0-h-350m --dtype bf16 --out "$dir" > /dev/null
    fi
    start_run granite-350m --model "$dir" --threads 2 --max-running-requests 16
    load granite-350m steady --num-prompts 24 --request-rate 0.5 --random-input-len 128 \
      --random-output-len 16 --slo ttft=5s,tpot=500ms
    load granite-350m shared-prefix --dataset-name shared-prefix --num-prompts 24 \
      --request-rate 0.5 --gsp-num-groups 2 --gsp-system-prompt-len 256 --gsp-question-len 32 \
      --random-output-len 16 --slo ttft=5s,tpot=500ms
    load granite-350m abort-storm --num-prompts 24 --max-concurrency 8 --random-input-len 128 \
      --random-output-len 32 --abort-fraction 0.3 --abort-after-ms 0:3000 --abort-all-every-s 20
    stop_run
    ;;
  *)
    echo "bench-serving: unknown model '$model' (tiny, granite-350m)" >&2
    exit 2
    ;;
  esac
done
echo "bench-serving: results and reports in $out"
