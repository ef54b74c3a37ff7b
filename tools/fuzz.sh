#!/usr/bin/env bash
# tools/fuzz.sh BUILD_DIR SECONDS — runs every libFuzzer target in
# BUILD_DIR/fuzz/ for SECONDS each (make fuzz builds them). Each starts from
# its seed corpus, tests/fuzz/corpus/<target>/, and grows a working corpus in
# BUILD_DIR/corpus/<target>/ (the seeds in the repository are not touched).
# A crash leaves its input in BUILD_DIR/crashes/<target>-*: copy it into the
# seed corpus once fixed, so that `make test` replays it from then on.
# Prints one line per target (executions, corpus size, crashes); exits 1 if
# any target crashed.
set -u
build=${1:?usage: tools/fuzz.sh BUILD_DIR SECONDS}
seconds=${2:?usage: tools/fuzz.sh BUILD_DIR SECONDS}
root=$(cd "$(dirname "$0")/.." && pwd)
status=0
mkdir -p "$build/crashes"
for bin in "$build"/fuzz/fuzz_*; do
  t=${bin##*/fuzz_}
  work="$build/corpus/$t"
  mkdir -p "$work"
  log="$build/fuzz_$t.log"
  "$bin" -max_total_time="$seconds" -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$build/crashes/$t-" "$work" "$root/tests/fuzz/corpus/$t" > "$log" 2>&1
  rc=$?
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$')
  crashes=$(ls "$build/crashes/$t-"* 2>/dev/null | wc -l)
  printf 'fuzz %-12s %10s executions in %ss, corpus %s inputs, %s crashes (rc %d)\n' \
    "$t" "${execs:-?}" "$seconds" "$(ls "$work" | wc -l)" "$crashes" "$rc"
  if [ "$rc" -ne 0 ] || [ "$crashes" -ne 0 ]; then status=1; tail -n 30 "$log"; fi
done
exit $status
