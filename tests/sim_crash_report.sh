#!/usr/bin/env bash
# A crash is a report: when the process running the seeds of `pdserve sim`
# dies (here: killed with SIGSEGV, as a wild pointer would — under ASan the
# sanitizer's handler turns that into a report and exit status 1 — or with
# SIGABRT, as a failed PD_ASSERT does), the run
# still names the seed, its configuration and the line that reproduces it,
# prints the summary with the seed counted as failed, and exits 1.
#
# usage: sim_crash_report.sh PDSERVE
set -u
pdserve=$1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fail() {
    echo "FAIL: $*" >&2
    for f in "$tmp"/*.out "$tmp"/*.err; do
        [ -f "$f" ] && { echo "---- $f" >&2; tail -n 20 "$f" >&2; }
    done
    exit 1
}

child_of() {
    pgrep -P "$1" 2>/dev/null | head -n 1
}

# crash NAME SIGNAL ARGS...: runs `pdserve ARGS...`, kills the child running
# its seeds with SIGNAL once it is well into them, and waits (bounded) for
# the parent's exit; its status lands in $rc.
crash() {
    local name=$1 signal=$2 parent child="" i
    shift 2
    "$pdserve" "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" &
    parent=$!
    for i in $(seq 100); do # up to 10 s for the fork
        child=$(child_of "$parent")
        [ -n "$child" ] && break
        kill -0 "$parent" 2>/dev/null || break
        sleep 0.1
    done
    if [ -z "$child" ]; then
        kill -0 "$parent" 2>/dev/null || {
            wait "$parent"
            fail "$name: the run ended by itself (exit status $?) before it could be killed"
        }
        kill -KILL "$parent"
        fail "$name: no child process running the seeds"
    fi
    sleep 1
    kill -"$signal" "$child" || fail "$name: the child ended before it could be killed"
    for i in $(seq 300); do # up to 30 s for the report
        kill -0 "$parent" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$parent" 2>/dev/null; then
        kill -KILL "$parent"
        fail "$name: the run did not end after its child crashed"
    fi
    wait "$parent"
    rc=$?
}

# check NAME REQUESTS: the crash report on NAME's stderr, in order: what
# crashed, the configuration, the reproduce line for the same seed.
check_report() {
    local name=$1 requests=$2 err="$tmp/$1.err"
    [ "$rc" -eq 1 ] || fail "$name: exit status $rc, expected 1"
    head_line=$(grep -E '^seed [0-9]+ crashed \((signal [0-9]+: [A-Z]+|exit status [0-9]+)\)$' \
        "$err") || fail "$name: no 'seed N crashed (...)' line"
    seed=${head_line#seed }
    seed=${seed%% *}
    config=$(grep -A1 -E '^seed [0-9]+ crashed' "$err" | tail -n 1)
    case $config in
    "config page_size="*) ;;
    *) fail "$name: the line after the crash is not the configuration: $config" ;;
    esac
    grep -qF "# reproduce: pdserve sim --seed $seed --requests $requests --faults all" "$err" ||
        fail "$name: no reproduce line for seed $seed"
    echo "$name: $head_line"
}

# The swarm: the configuration is the seed's own, and it is on the reproduce line.
crash swarm SEGV sim --seeds 1..100000 --faults all --quiet
check_report swarm 50
grep -qxF "# reproduce: pdserve sim --seed $seed --requests 50 --faults all --config \"$config\"" \
    "$tmp/swarm.err" || fail "swarm: the reproduce line does not carry the configuration"
grep -qE '^\{"seeds":100000,"failed_seeds":1,.*"violations":1,' "$tmp/swarm.out" ||
    fail "swarm: no summary counting the crashed seed"
# The configuration named is the one the seed runs (line 2 of its trace), and
# the reproduce line runs it: the seed passes, as it did not really crash.
"$pdserve" sim --seeds "$seed..$seed" --trace "$tmp/seed.scn" >/dev/null 2>&1 ||
    fail "swarm: seed $seed fails when run alone"
[ "$(sed -n 2p "$tmp/seed.scn")" = "$config" ] ||
    fail "swarm: seed $seed runs $(sed -n 2p "$tmp/seed.scn"), the report said $config"
"$pdserve" sim --seed "$seed" --requests 50 --faults all --config "$config" >/dev/null 2>&1 ||
    fail "swarm: the reproduce line does not run"

# One seed, long enough to be killed in the middle, with a trace: the same
# report, nothing on stdout, and the trace ends with a whole line.
crash single ABRT sim --seed 3 --requests 100000 --trace "$tmp/single.scn"
check_report single 100000
[ "$seed" = 3 ] || fail "single: the report names seed $seed, not 3"
grep -qF "# its last lines: $tmp/single.scn" "$tmp/single.err" ||
    fail "single: the report does not point at the trace"
[ ! -s "$tmp/single.out" ] || fail "single: a result on stdout for a run that crashed"
[ "$(sed -n 1p "$tmp/single.scn")" = "# pdserve sim --seed 3" ] ||
    fail "single: the trace lost its head"
[ -z "$(tail -c 1 "$tmp/single.scn")" ] || fail "single: the trace ends in the middle of a line"
echo "PASS"
