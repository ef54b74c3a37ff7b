#!/usr/bin/env bash
# Runs the benchmarks of an optimised build and prints a readable summary.
#   scripts/bench.sh [--quick] BUILD_DIR
# --quick uses smaller traces and fewer runs (what `make run` shows).
set -euo pipefail
quick=0
if [ "${1:-}" = "--quick" ]; then quick=1; shift; fi
build=${1:?usage: scripts/bench.sh [--quick] BUILD_DIR}
bench=$build/bench
traces=$build/traces
mkdir -p "$traces"

if [ $quick -eq 1 ]; then
  requests=3000; runs=3; iters=200000
else
  requests=20000; runs=5; iters=1000000
fi

echo "== pools: alloc+free throughput (raw pool, counting ledger, strict ledger) =="
"$bench/pools" --iters $iters --runs $runs
echo

"$bench/gen_trace" --kind shared --requests $requests --system-prompts 4 --system-len 2048 \
  --suffix-len 256 --seed 1 --out "$traces/shared.txt"
"$bench/gen_trace" --kind multiturn --requests $requests --conversations 64 --turn-len 160 \
  --max-len 8192 --seed 2 --out "$traces/multiturn.txt"

run_radix() {
  local title=$1; shift
  echo "== radix: $title =="
  "$bench/radix" --runs $runs "$@"
  echo
}
run_radix "shared system prompts, page 16" --trace "$traces/shared.txt" --page-size 16 --pages 65536
run_radix "multi-turn, page 16" --trace "$traces/multiturn.txt" --page-size 16 --pages 65536
run_radix "multi-turn, page 1 (token-granular)" --trace "$traces/multiturn.txt" --page-size 1 --pages 1048576
run_radix "multi-turn, hybrid (Mamba snapshots), page 16" --trace "$traces/multiturn.txt" \
  --page-size 16 --pages 65536 --hybrid --mamba-slots 512
run_radix "multi-turn, small device pool + host tier" --trace "$traces/multiturn.txt" \
  --page-size 16 --pages 4096 --host-pages 32768
echo "== sched: scheduler step cost, zero-cost executor =="
if [ $quick -eq 1 ]; then "$bench/sched" --steps 1000 --runs 3; else "$bench/sched" --steps 4000 --runs 5; fi
echo
echo "== simulator: a random run and a small swarm (all faults) =="
"$build/pdserve" sim --seed 1
"$build/pdserve" sim --seeds 1..200 --quiet

echo "== model: tiny hybrid attention + Mamba2 forward pass on the CPU =="
if [ $quick -eq 1 ]; then
  "$bench/model" --quick
else
  "$bench/model" --runs $runs
fi
echo

echo "== xfer: prefill -> decode hand-off over pd_net (UCX shm and tcp) vs memcpy =="
if [ $quick -eq 1 ]; then "$bench/xfer" --quick; else "$bench/xfer" --runs $runs; fi
echo
