#!/usr/bin/env bash
# Profiles for the release build's scheduler core (CMake PD_PGO, docs/build.md).
#   scripts/pgo-train.sh GEN_DIR PROFILE_DIR [JOBS]
# Builds the instrumented benchmarks in GEN_DIR (incrementally), and when they
# are newer than PROFILE_DIR/trained runs the training workload and writes
# fresh profiles there; the stamp `trained` changes only then, so an unchanged
# tree recompiles nothing. The workload is the engines' and the cache's steady
# state on requests of their own: bench/sched at 128 and 512 live from seed
# 1000, bench/radix on a mixed trace of seed 7 (flat and hybrid). The
# benchmarks report other points (256 and 1,024 live from seed 42; the
# realistic trace of docs/prefix-cache.md), so the figures are not the
# training's own. The training's output goes to PROFILE_DIR/train.log.
set -euo pipefail
gen=${1:?usage: scripts/pgo-train.sh GEN_DIR PROFILE_DIR [JOBS]}
prof=${2:?usage: scripts/pgo-train.sh GEN_DIR PROFILE_DIR [JOBS]}
jobs=${3:-$(nproc 2>/dev/null || echo 2)}
mkdir -p "$prof"
prof=$(cd "$prof" && pwd)

if [ ! -f "$gen/CMakeCache.txt" ]; then
  cmake -S . -B "$gen" -DCMAKE_BUILD_TYPE=Release -DPD_BUILD_TESTS=OFF \
    -DPD_PGO=generate "-DPD_PGO_DIR=$prof" >/dev/null
fi
# Its own build, not a part of the calling make's (when a build runs this).
env -u MAKEFLAGS -u MFLAGS -u MAKELEVEL \
  cmake --build "$gen" -j "$jobs" --target bench_sched bench_radix bench_gen_trace >/dev/null

stamp=$prof/trained
newest=$gen/bench/sched
[ "$gen/bench/radix" -nt "$newest" ] && newest=$gen/bench/radix
if [ -f "$stamp" ] && [ ! "$newest" -nt "$stamp" ]; then
  echo "pgo: profiles in $prof are current"
  exit 0
fi

echo "pgo: training the scheduler core (bench/sched, bench/radix; log in $prof/train.log)"
find "$prof" -name '*.gcda' -delete
log=$prof/train.log
trace=$prof/train-trace.txt
{
  "$gen/bench/sched" --live 128,512 --steps 1500 --runs 1 --seed 1000
  "$gen/bench/gen_trace" --kind mixed --requests 600 --system-len 1024 --suffix-len 256 \
    --seed 7 --out "$trace"
  "$gen/bench/radix" --trace "$trace" --page-size 16 --pages 8000 --runs 1
  "$gen/bench/radix" --trace "$trace" --page-size 16 --pages 8000 --runs 1 --hybrid \
    --mamba-slots 256
} >"$log" 2>&1 || {
  echo "pgo: the training workload failed; its output:" >&2
  cat "$log" >&2
  exit 1
}
n=$(find "$prof" -name '*.gcda' | wc -l)
if [ "$n" -eq 0 ]; then
  echo "pgo: the training wrote no profiles under $prof" >&2
  exit 1
fi
touch "$stamp"
echo "pgo: $n profiles written"
