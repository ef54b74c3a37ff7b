#!/usr/bin/env bash
# bench/sched's core probe (docs/engine.md, "Issue 13, twenty-second round"):
# with it, a block after the runs gives the fastest probe and, per live count,
# the share of steps on a quiet core (0-100 %) and the step medians there and
# elsewhere; with --no-probe, no such block. Fails naming what is missing.
set -euo pipefail
sched=$1
out=$("$sched" --live 16,32 --steps 200 --runs 2)
fail() { echo "sched_probe: $1"; echo "$out"; exit 1; }
grep -Eq '^core probe: [0-9]+ rounds of register-only work after each step pair, fastest [0-9]+\.[0-9]{2} us' <<<"$out" ||
    fail "no 'core probe:' line with the fastest reading"
for live in 16 32; do
    line=$(grep -E "^live +$live: quiet core in" <<<"$out") || fail "no probe line for live $live"
    share=$(sed -E 's/.*quiet core in ([0-9]+) % of steps.*/\1/' <<<"$line")
    [ "$share" -ge 0 ] && [ "$share" -le 100 ] || fail "live $live: quiet share $share is not 0-100"
    # Each side is either two medians or "no steps"; at least one side has steps.
    re='(prefill [0-9]+\.[0-9]{2} us, decode [0-9]+\.[0-9]{2} us|no steps)'
    grep -Eq "there: $re \| elsewhere: $re\$" <<<"$line" || fail "live $live: malformed sides: $line"
    grep -q 'prefill' <<<"$line" || fail "live $live: neither side has steps"
done
# The probe does not change the figures' lines, and --no-probe drops its block.
[ "$(grep -c 'step median' <<<"$out")" -eq 2 ] || fail "expected two 'step median' lines"
plain=$("$sched" --live 16 --steps 200 --runs 1 --no-probe)
if grep -Eq '^core probe|quiet core' <<<"$plain"; then
    echo "sched_probe: --no-probe still printed the probe block"; echo "$plain"; exit 1
fi
grep -q 'live   16: prefill step median' <<<"$plain" || { echo "sched_probe: --no-probe lost the figures"; exit 1; }
# --trace: a header and one line a step of every run, plus the probe before
# each run's first step (live 16, 2 runs of 50 steps: 2 x 51 lines).
csv=$(mktemp)
trap 'rm -f "$csv"' EXIT
"$sched" --live 16 --steps 50 --runs 2 --trace "$csv" >/dev/null
[ "$(head -1 "$csv")" = "live,run,step,prefill_us,decode_us,probe_ns" ] || { echo "sched_probe: --trace header"; exit 1; }
[ "$(tail -n +2 "$csv" | grep -cE '^16,[12],(-1,,|[0-9]+,[0-9]+\.[0-9]{3},[0-9]+\.[0-9]{3}),[0-9]+$')" -eq 102 ] ||
    { echo "sched_probe: --trace wants 102 well-formed lines"; cat "$csv"; exit 1; }
echo "sched_probe: ok"
