#!/usr/bin/env bash
# bench/router.sh — the router's figures (issue 13), in one run:
#
#   1. /generate (max_new_tokens 1) with wrk, requests/s and p50/p99,
#      alternately (ROUNDS rounds, medians) against
#        serve        a `pdserve serve` node, direct
#        run          `pdserve run`: the router in front of a prefill and a
#                     decode node (loopback transfer), so router + PD
#        stub         bench/router_streams worker, direct (a worker that
#                     answers at once: the floor of an HTTP exchange)
#        stub+router  `pdserve router` in front of two such workers
#      and the overhead per request the router adds (p50 differences).
#   2. TIME_WAIT sockets after SECONDS_TW s of wrk through `pdserve run`.
#   3. STREAMS streaming clients held HOLD_S s through `pdserve router` in
#      front of stub workers (pdserve's nodes take 4096 connections each; the
#      decode stub serves stream feeds as a pdserve node does), with the
#      router's RSS, thread and descriptor counts from /proc.
#   4. An admin route: POST /abort_request {"abort_all": true} (the router
#      tells every worker: one call to each stub) with wrk through
#      `pdserve router` in front of the stubs, ROUNDS rounds, medians; with
#      ROUTER_BEFORE=/path/to/another/pdserve, that router too, in front of
#      the same stubs, alternating (before/after in one run); and section 3
#      first runs STREAMS_BEFORE (9800) streams through that router too.
#
# usage: bench/router.sh [BUILD_DIR] (default build/release); knobs in the
# environment: SECONDS_EACH (10), ROUNDS (3), SECONDS_TW (30), STREAMS
# (10000), HOLD_S (30), CONNS (32), ROUTER_BEFORE (none). A benchmark: it
# prints, asserts nothing.
set -euo pipefail
B=${1:-build/release}
PD=$B/pdserve
RS=$B/bench/router_streams
SECONDS_EACH=${SECONDS_EACH:-10}
ROUNDS=${ROUNDS:-3}
SECONDS_TW=${SECONDS_TW:-30}
STREAMS=${STREAMS:-10000}
HOLD_S=${HOLD_S:-30}
CONNS=${CONNS:-32}
BASE=${BASE_PORT:-21000} # below the ephemeral range: a client port cannot hold it
for f in "$PD" "$RS"; do [[ -x $f ]] || { echo "bench/router.sh: $f is missing (build it)" >&2; exit 2; }; done
command -v wrk > /dev/null || { echo "bench/router.sh: wrk is not installed (Debian: apt-get install wrk)" >&2; exit 2; }

TMP=$(mktemp -d)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2> /dev/null || true; done; wait 2> /dev/null || true; rm -rf "$TMP"; }
trap cleanup EXIT

start() { # name, then the command
    local name=$1; shift
    "$@" > "$TMP/$name.log" 2>&1 &
    PIDS+=($!)
    eval "PID_${name//[^a-z]/_}=$!"
}
wait_health() {
    for _ in $(seq 1 200); do curl -sf "http://127.0.0.1:$1/health" > /dev/null && return 0; sleep 0.1; done
    echo "bench/router.sh: nothing healthy on port $1" >&2; exit 1
}

SERVE=$BASE RUN=$((BASE + 10)) STUB_P=$((BASE + 21)) STUB_D=$((BASE + 22)) STUB_R=$((BASE + 20))
start serve "$PD" serve --port "$SERVE"
start run "$PD" run --port "$RUN"
start stubp "$RS" worker "$STUB_P" prefill
start stubd "$RS" worker "$STUB_D" decode
start router "$PD" router --port "$STUB_R" --prefill "http://127.0.0.1:$STUB_P" \
    --decode "http://127.0.0.1:$STUB_D" --max-connections "$STREAMS" \
    --max-connections-per-ip "$STREAMS"
for p in "$SERVE" "$RUN" "$STUB_D" "$STUB_R"; do wait_health "$p"; done

cat > "$TMP/post.lua" << 'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"text": "Hello, my name is", "sampling_params": {"max_new_tokens": 1}}'
EOF

# wrk's summary as "rps p50_ms p99_ms errors"; args: seconds, port, and
# optionally the path (/generate) and the wrk script (post.lua).
measure() {
    wrk -t2 -c"$CONNS" -d"$1"s --latency -s "$TMP/${4:-post.lua}" \
        "http://127.0.0.1:$2${3:-/generate}" |
        python3 -c '
import re, sys
t = sys.stdin.read()
def ms(v, u): return float(v) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[u]
rps = float(re.search(r"Requests/sec:\s+([\d.]+)", t).group(1))
p = {q: ms(*re.search(r"\s%s%%\s+([\d.]+)(us|ms|s)" % q, t).groups()) for q in ("50", "99")}
m = re.search(r"Non-2xx or 3xx responses: (\d+)", t)
e = re.search(r"Socket errors: .*", t)
print(rps, p["50"], p["99"], (int(m.group(1)) if m else 0) + (1 if e else 0))'
}

echo "== /generate, max_new_tokens 1: wrk -t2 -c$CONNS, ${SECONDS_EACH}s each, $ROUNDS rounds, alternating"
: > "$TMP/results"
for round in $(seq 1 "$ROUNDS"); do
    for t in serve:$SERVE run:$RUN stub:$STUB_D stub+router:$STUB_R; do
        r=$(measure "$SECONDS_EACH" "${t#*:}")
        echo "${t%%:*} $r" >> "$TMP/results"
        printf 'round %d  %-12s %s\n' "$round" "${t%%:*}" "$r"
    done
done
python3 - "$TMP/results" << 'EOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name, rps, p50, p99, err = line.split()
    rows.setdefault(name, []).append((float(rps), float(p50), float(p99), int(err)))
med = {n: [statistics.median(c) for c in zip(*v)] for n, v in rows.items()}
print("\n%-12s %10s %10s %10s %8s" % ("target", "req/s", "p50 ms", "p99 ms", "errors"))
for n in ("serve", "run", "stub", "stub+router"):
    r = med[n]
    print("%-12s %10.0f %10.3f %10.3f %8d" % (n, r[0], r[1], r[2], sum(x[3] for x in rows[n])))
print("\nper request (medians): run - serve: p50 %+.3f ms, p99 %+.3f ms;"
      " stub+router - stub: p50 %+.3f ms, p99 %+.3f ms"
      % (med["run"][1] - med["serve"][1], med["run"][2] - med["serve"][2],
         med["stub+router"][1] - med["stub"][1], med["stub+router"][2] - med["stub"][2]))
EOF

echo
echo "== TIME_WAIT after ${SECONDS_TW}s of wrk through pdserve run (the whole machine's count)"
before=$(ss -tan state time-wait | tail -n +2 | wc -l)
r=$(measure "$SECONDS_TW" "$RUN")
after=$(ss -tan state time-wait | tail -n +2 | wc -l)
echo "wrk: $r (req/s p50 p99 errors); TIME_WAIT before $before, after $after"

echo
echo "== POST /abort_request {\"abort_all\": true} through pdserve router (stub workers):" \
    "wrk -t2 -c$CONNS, ${SECONDS_EACH}s each, $ROUNDS rounds"
cat > "$TMP/abort.lua" << 'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"abort_all": true}'
EOF
targets="after:$STUB_R"
if [[ -n ${ROUTER_BEFORE:-} ]]; then
    STUB_RB=$((BASE + 23))
    start routerb "$ROUTER_BEFORE" router --port "$STUB_RB" --prefill "http://127.0.0.1:$STUB_P" \
        --decode "http://127.0.0.1:$STUB_D"
    wait_health "$STUB_RB"
    targets="before:$STUB_RB $targets"
fi
: > "$TMP/admin"
for round in $(seq 1 "$ROUNDS"); do
    for t in $targets; do
        r=$(measure "$SECONDS_EACH" "${t#*:}" /abort_request abort.lua)
        echo "${t%%:*} $r" >> "$TMP/admin"
        printf 'round %d  %-8s %s\n' "$round" "${t%%:*}" "$r"
    done
done
python3 - "$TMP/admin" << 'EOF'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name, rps, p50, p99, err = line.split()
    rows.setdefault(name, []).append((float(rps), float(p50), float(p99), int(err)))
print("\n%-8s %10s %10s %10s %8s" % ("router", "req/s", "p50 ms", "p99 ms", "errors"))
for n, v in rows.items():
    r = [statistics.median(c) for c in zip(*v)]
    print("%-8s %10.0f %10.3f %10.3f %8d" % (n, r[0], r[1], r[2], sum(x[3] for x in v)))
EOF
if [[ -n ${ROUTER_BEFORE:-} ]]; then kill "$PID_routerb" 2> /dev/null || true; fi

echo
echo "== $STREAMS streaming clients held ${HOLD_S}s through pdserve router (stub workers)"
kill "$PID_serve" "$PID_run" 2> /dev/null || true # their CPU back for the streams
rss() {
    grep -E '^(VmRSS|Threads)' "/proc/$1/status" | tr -s ' \t' ' ' | tr '\n' ' '
    echo "fds $(ls "/proc/$1/fd" | wc -l)"
}
curl -s "http://127.0.0.1:$STUB_R/server_info" | python3 -c '
import json, sys
print("router stream feeds open to the decode stub:",
      [w["stream_feeds_open"] for w in json.load(sys.stdin)["workers"] if w["role"] == "decode"])'
if [[ -n ${ROUTER_BEFORE:-} ]]; then
    STREAMS_BEFORE=${STREAMS_BEFORE:-9800} STUB_RS=$((BASE + 24))
    echo "-- first ROUTER_BEFORE, $STREAMS_BEFORE streams (the most its descriptor check allows here)"
    start routers "$ROUTER_BEFORE" router --port "$STUB_RS" --prefill "http://127.0.0.1:$STUB_P" \
        --decode "http://127.0.0.1:$STUB_D" --max-connections "$STREAMS_BEFORE" \
        --max-connections-per-ip "$STREAMS_BEFORE"
    wait_health "$STUB_RS"
    echo "router before: $(rss "$PID_routers")"
    "$RS" clients "$STUB_RS" "$STREAMS_BEFORE" "$HOLD_S" "$PID_routers"
    kill "$PID_routers" 2> /dev/null || true
    sleep 2
    echo "-- then this router, $STREAMS streams"
fi
echo "router before: $(rss "$PID_router")"
"$RS" clients "$STUB_R" "$STREAMS" "$HOLD_S" "$PID_router"
curl -s "http://127.0.0.1:$STUB_R/server_info" | python3 -c '
import json, sys
c = json.load(sys.stdin)["counters"]
print("router: %d streams went through a feed" % c["streams_fed"])' 
