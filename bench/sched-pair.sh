#!/usr/bin/env bash
# bench/sched-pair.sh — two builds of bench/sched compared in paired rounds.
#
#   bench/sched-pair.sh [--rounds N] [--live N] A B
#
# A and B are two bench/sched binaries (say, the start's and a change's).
# Each round runs one of them and then the other (2,000 steps, one run
# each), alternating which goes first, and the comparison is the median of
# the rounds' B/A ratios, per node. On a shared machine whose load moves a
# step's median by tens of percent within seconds, comparing medians of
# runs spread over minutes hides a 3 % difference; two runs 0.1 s apart see
# nearly the same load (docs/engine.md, "Issue 13, twentieth round").
# Its resolution is about 3 %: one binary against a copy of itself read
# 1.027 / 1.019 over 40 rounds (docs/engine.md, "Issue 13, twenty-second
# round"); bench/sched's core probe block says how much of each run had the
# physical core to itself.
# Defaults: 40 rounds, 256 live. Needs python3 for the summary.
set -euo pipefail
rounds=40
live=256
while [ $# -gt 2 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --live) live=$2; shift 2 ;;
    *) echo "usage: bench/sched-pair.sh [--rounds N] [--live N] A B" >&2; exit 2 ;;
  esac
done
if [ $# -ne 2 ] || [ ! -x "$1" ] || [ ! -x "$2" ]; then
  echo "usage: bench/sched-pair.sh [--rounds N] [--live N] A B (two bench/sched binaries)" >&2
  exit 2
fi
a=$1
b=$2
medians() {
  "$1" --live "$live" --steps 2000 --runs 1 | grep "step median" |
    sed -E 's/.*prefill step median ([0-9.]+).*decode step median ([0-9.]+).*/\1 \2/'
}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for i in $(seq "$rounds"); do
  if [ $((i % 2)) -eq 0 ]; then
    ma=$(medians "$a")
    mb=$(medians "$b")
  else
    mb=$(medians "$b")
    ma=$(medians "$a")
  fi
  echo "$ma $mb" >>"$out"
done
echo "$rounds rounds at $live live; A = $a, B = $b"
python3 - "$out" <<'PY'
import statistics as st
import sys

rows = [list(map(float, line.split())) for line in open(sys.argv[1])]
for k, side in enumerate(["prefill", "decode"]):
    a = sorted(r[k] for r in rows)
    b = sorted(r[2 + k] for r in rows)
    ratio = sorted(r[2 + k] / r[k] for r in rows)
    q = lambda v, p: v[int(p * (len(v) - 1))]
    print("%-7s B/A median %.3f (quartiles %.3f-%.3f), B faster in %d of %d | "
          "A 10th pct %.2f median %.2f us | B 10th pct %.2f median %.2f us"
          % (side, st.median(ratio), q(ratio, 0.25), q(ratio, 0.75),
             sum(x < 1 for x in ratio), len(ratio), q(a, 0.1), st.median(a),
             q(b, 0.1), st.median(b)))
PY
