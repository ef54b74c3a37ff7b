#!/usr/bin/env bash
# Back-to-back benchmark comparison of two revisions, for "performance stays
# within noise" at the close of a refactor.
#
#   tools/bench_compare.sh [-n ROUNDS] [--quick] [--only a,b] OLD_REV [NEW_REV]
#
# NEW_REV defaults to HEAD; `.` means the working tree as it is, uncommitted
# changes included. Each revision is checked out in a git worktree under
# build/bench-compare/ and built there as `make release` builds (Release, no
# tests, but -Wno-error; kept, so a second comparison of the same commits does
# not rebuild).
# Then every benchmark of `make bench` (scripts/bench.sh, same sizes; --quick:
# its --quick sizes) runs alternately old, new, old, new, ... ROUNDS times
# (default 3), and a table gives, per figure the programs print, the median of
# old and of new over the rounds, new/old, and the change in the better
# direction (+ = new is better). With ROUNDS >= 2, `spread` is the larger
# relative range of one revision's own rounds: a change inside it is noise.
# Figures that must not change (hit rates, evictions, simulated steps) are
# marked `=`, and `CHANGED` if they do.
#
#   --only pools,radix,sched,sim,model,xfer   a subset of the benchmarks
#   -n N                                      rounds (default 3)
# Raw outputs: build/bench-compare/out/{old,new}/ROUND/BENCH.txt.
set -euo pipefail

rounds=3 quick=0 only=""
while [ $# -gt 0 ]; do
    case $1 in
        -n) rounds=${2:?-n needs a number}; shift 2 ;;
        --quick) quick=1; shift ;;
        --only) only=${2:?--only needs a list}; shift 2 ;;
        -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;;
        -*) echo "bench_compare: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) break ;;
    esac
done
if [ $# -lt 1 ] || [ $# -gt 2 ]; then
    echo "usage: tools/bench_compare.sh [-n N] [--quick] [--only LIST] OLD_REV [NEW_REV]" >&2
    exit 2
fi
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "bench_compare: -n wants a positive number" >&2; exit 2; }

root=$(cd "$(dirname "$0")/.." && pwd)
work=$root/build/bench-compare
jobs=${JOBS:-2}
mkdir -p "$work"

# prepare REV LABEL: a worktree of REV (or the working tree for `.`) built
# under $work; sets src_LABEL/bin_LABEL/desc_LABEL.
prepare() {
    local rev=$1 label=$2 sha src bld
    if [ "$rev" = . ]; then
        sha=worktree
        src=$root
        desc="working tree ($(git -C "$root" rev-parse --short HEAD) + uncommitted changes)"
    else
        sha=$(git -C "$root" rev-parse --verify --quiet "$rev^{commit}") ||
            { echo "bench_compare: $rev is not a commit" >&2; exit 2; }
        src=$work/src-${sha:0:12}
        if [ ! -e "$src/.git" ]; then
            git -C "$root" worktree add -q --detach "$src" "$sha"
        fi
        desc="$rev = $(git -C "$root" log -1 --format='%h %s' "$sha" | cut -c1-70)"
    fi
    bld=$work/build-${sha:0:12}
    echo "bench_compare: $label: $desc" >&2
    if [ ! -f "$bld/CMakeCache.txt" ]; then
        cmake -S "$src" -B "$bld" -DCMAKE_BUILD_TYPE=Release -DPD_BUILD_TESTS=OFF \
            -DCMAKE_C_COMPILER_LAUNCHER="$work/no-werror" > "$bld.configure.log" 2>&1 ||
            { cat "$bld.configure.log" >&2; exit 1; }
    fi
    cmake --build "$bld" -j "$jobs" > "$bld.build.log" 2>&1 ||
        { tail -n 30 "$bld.build.log" >&2; echo "bench_compare: $label does not build" >&2; exit 1; }
    printf -v "bin_$label" '%s' "$bld"
    printf -v "desc_$label" '%s' "$desc"
}

bin_old='' bin_new='' desc_old='' desc_new=''
# The compiler's warnings are not what is compared: an old revision that a
# newer compiler warns about under -Werror still builds (same code generated).
printf '#!/bin/sh\nexec "$@" -Wno-error\n' > "$work/no-werror"
chmod +x "$work/no-werror"
prepare "$1" old
prepare "${2:-HEAD}" new

if [ $quick -eq 1 ]; then
    requests=3000 runs=3 iters=200000 sched_args="--steps 1000 --runs 3"
    model_args="--quick" xfer_args="--quick"
else
    requests=20000 runs=5 iters=1000000 sched_args="--steps 4000 --runs 5"
    model_args="--runs 5" xfer_args="--runs 5"
fi

# Each tree replays traces made by its own gen_trace (the same seeds); if they
# differ the comparison is of different inputs, and that is said.
for label in old new; do
    b=bin_$label
    b=${!b}
    mkdir -p "$b/traces"
    "$b/bench/gen_trace" --kind shared --requests $requests --system-prompts 4 --system-len 2048 \
        --suffix-len 256 --seed 1 --out "$b/traces/shared.txt" > /dev/null
    "$b/bench/gen_trace" --kind multiturn --requests $requests --conversations 64 --turn-len 160 \
        --max-len 8192 --seed 2 --out "$b/traces/multiturn.txt" > /dev/null
done
for t in shared multiturn; do
    cmp -s "$bin_old/traces/$t.txt" "$bin_new/traces/$t.txt" ||
        echo "bench_compare: warning: gen_trace makes a different $t trace in old and new" >&2
done

# name|command, with @B for the build directory (bench.sh's list and sizes).
benches=(
    "pools|@B/bench/pools --iters $iters --runs $runs"
    "radix shared p16|@B/bench/radix --runs $runs --trace @B/traces/shared.txt --page-size 16 --pages 65536"
    "radix multiturn p16|@B/bench/radix --runs $runs --trace @B/traces/multiturn.txt --page-size 16 --pages 65536"
    "radix multiturn p1|@B/bench/radix --runs $runs --trace @B/traces/multiturn.txt --page-size 1 --pages 1048576"
    "radix hybrid p16|@B/bench/radix --runs $runs --trace @B/traces/multiturn.txt --page-size 16 --pages 65536 --hybrid --mamba-slots 512"
    "radix host tier|@B/bench/radix --runs $runs --trace @B/traces/multiturn.txt --page-size 16 --pages 4096 --host-pages 32768"
    "sched|@B/bench/sched $sched_args"
    "sim swarm|@B/pdserve sim --seeds 1..200 --quiet"
    "model|@B/bench/model $model_args"
    "xfer|@B/bench/xfer $xfer_args"
)

# How busy the CPUs are (percent) over half a second while this script waits:
# other work (a test suite, a build) makes every figure noisy.
cpu_ticks() { awk '/^cpu / { print $2 + $3 + $4 + $7 + $8, $2 + $3 + $4 + $5 + $6 + $7 + $8 }' /proc/stat; }
others_busy() {
    local b1 t1 b2 t2
    read -r b1 t1 < <(cpu_ticks)
    sleep 0.5
    read -r b2 t2 < <(cpu_ticks)
    echo $(( 100 * (b2 - b1) / (t2 - t1 > 0 ? t2 - t1 : 1) ))
}
busiest=0

out=$work/out
rm -rf "$out"
for entry in "${benches[@]}"; do
    name=${entry%%|*}
    cmd=${entry#*|}
    if [ -n "$only" ] && ! [[ ",$only," == *",${name%% *},"* ]]; then continue; fi
    file=${name// /_}.txt
    busy=$(others_busy)
    if [ "$busy" -ge 20 ]; then
        echo "bench_compare: warning: the CPUs are $busy% busy with other work before $name" >&2
    fi
    [ "$busy" -le "$busiest" ] || busiest=$busy
    mkdir -p "$out"
    echo "$name" >> "$out/order"
    for r in $(seq "$rounds"); do
        for label in old new; do
            b=bin_$label
            mkdir -p "$out/$label/$r"
            echo "bench_compare: round $r/$rounds: $name ($label)" >&2
            start=$(date +%s%N)
            # shellcheck disable=SC2086  # the command is a list of words
            if ! ${cmd//@B/${!b}} > "$out/$label/$r/$file" 2>&1; then
                echo "bench_compare: warning: $name ($label) failed; see $out/$label/$r/$file" >&2
                continue
            fi
            echo "bench_compare wall ms: $(( ($(date +%s%N) - start) / 1000000 ))" >> "$out/$label/$r/$file"
        done
    done
done

echo
echo "old: $desc_old"
echo "new: $desc_new"
echo "rounds: $rounds, alternating old/new$([ $quick -eq 1 ] && echo ", --quick sizes")"
if [ "$busiest" -ge 20 ]; then
    echo "warning: other work kept the CPUs up to $busiest% busy between benchmarks: noisy figures"
fi
python3 - "$out" "$rounds" <<'EOF'
import math, os, re, statistics, sys

out, rounds = sys.argv[1], int(sys.argv[2])
HI, LO, EQ = "hi", "lo", "="


def us(value, unit):
    return float(value) * {"us": 1, "ms": 1e3, "s": 1e6}[unit]


def parse(bench, text):
    """(figure, direction, value) for each figure the program printed."""
    figs = []
    add = lambda name, d, v: figs.append((name, d, float(v)))
    if bench != "sim swarm":  # the swarm's wall time is its figure; the others time themselves
        text = re.sub(r"(?m)^bench_compare wall ms: .*$", "", text)
    for line in text.splitlines():
        m = re.match(r"^(\S.*?)\s+(\d+)\s+(\d+)\s+(\d+)$", line)
        if bench == "pools" and m and m.group(1) != "pool":
            for mode, v in zip(("pool", "ledger", "strict"), m.groups()[1:]):
                add("%s, %s ops/s" % (m.group(1), mode), HI, v)
            continue
        m = re.match(r"baseline \(.*\): ([\d.]+) requests/s, mean ([\d.]+) us", line)
        if m:
            add("no cache requests/s", HI, m.group(1))
            continue
        m = re.match(r"prefix cache: hit rate ([\d.]+)%.*?, (\d+) pages evicted", line)
        if m:
            add("hit rate %", EQ, m.group(1))
            add("pages evicted", EQ, m.group(2))
            continue
        m = re.match(r"(requests/s|mean us per request|p99 us per request): ([\d.]+)$", line)
        if m:
            add(m.group(1), HI if m.group(1) == "requests/s" else LO, m.group(2))
            continue
        m = re.match(r"live\s+(\d+): prefill step median ([\d.]+) us p99 ([\d.]+) us \| "
                     r"decode step median ([\d.]+) us p99 ([\d.]+) us \| ([\d.]+) requests/s", line)
        if m:
            live = "live %s" % m.group(1)
            for k, (what, d) in enumerate([("prefill step median us", LO), ("prefill step p99 us", LO),
                                           ("decode step median us", LO), ("decode step p99 us", LO),
                                           ("requests/s", HI)]):
                add("%s %s" % (live, what), d, m.group(k + 2))
            continue
        m = re.match(r'\{"seeds":\d+.*"steps":(\d+)', line)
        if m:
            add("simulated steps", EQ, m.group(1))
            continue
        m = re.match(r"bench_compare wall ms: (\d+)", line)
        if m:
            add("wall ms", LO, m.group(1))
            continue
        m = re.match(r"^(\w+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)$", line)
        if bench == "model" and m:
            add("%s %st prefill tok/s" % m.group(1, 2), HI, m.group(3))
            add("%s %st decode tok/s" % m.group(1, 2), HI, m.group(5))
            continue
        m = re.match(r"baseline (\w+) .*textbook loop ([\d.]+) GFLOP/s, fixed-order kernel ([\d.]+)",
                     line)
        if m:
            add("%s textbook GFLOP/s" % m.group(1), HI, m.group(2))
            add("%s kernel GFLOP/s" % m.group(1), HI, m.group(3))
            continue
        m = re.match(r"^(\w+)\s+(\d+)\s+[\d.]+ [KMG]iB\s+(\S+)\s+([\d.]+) (us|ms|s)\s", line)
        if bench == "xfer" and m:
            add("%s %s tokens %s hand-off us" % m.group(1, 2, 3), LO, us(m.group(4), m.group(5)))
            continue
        m = re.match(r"^\s+(ucx-\w+)\s+([\d.]+) (us|ms|s)\s+\(", line)
        if bench == "xfer" and m:
            add("%s per-room fixed cost us" % m.group(1), LO, us(m.group(2), m.group(3)))
    return figs


with open(os.path.join(out, "order")) as fh:
    benches = [l.strip() for l in fh if l.strip()]
values = {}  # (bench, figure) -> {"old": [...], "new": [...]}
direction = {}
for label in ("old", "new"):
    for r in range(1, rounds + 1):
        d = os.path.join(out, label, str(r))
        if not os.path.isdir(d):
            continue
        for f in sorted(os.listdir(d)):
            bench = f[:-4].replace("_", " ")
            with open(os.path.join(d, f)) as fh:
                for name, dr, v in parse(bench, fh.read()):
                    values.setdefault((bench, name), {"old": [], "new": []})[label].append(v)
                    direction[(bench, name)] = dr


def fmt(v):
    return "%.0f" % v if abs(v) >= 1000 or v == int(v) else "%.2f" % v


rows, goods, over = [], [], 0
for (bench, name), v in sorted(values.items(), key=lambda kv: benches.index(kv[0][0])):
    o, n = v["old"], v["new"]
    if not o or not n:
        rows.append((bench, name, fmt(statistics.median(o)) if o else "-",
                     fmt(statistics.median(n)) if n else "-", "-", "-", "-", "missing"))
        continue
    mo, mn = statistics.median(o), statistics.median(n)
    ratio = mn / mo if mo else (1.0 if mn == mo else float("inf"))
    dr = direction[(bench, name)]
    spread = None
    if rounds >= 2:
        spread = max((max(x) - min(x)) / statistics.median(x) if statistics.median(x) else 0
                     for x in (o, n))
    if dr == EQ:
        change, verdict = "", "=" if mo == mn else "CHANGED"
    else:
        good = ratio if dr == HI else (1 / ratio if ratio else float("inf"))
        goods.append(good)
        change = "%+.1f%%" % (100 * (good - 1))
        if spread is None:
            verdict = ""
        elif abs(good - 1) <= spread:
            verdict = "noise"
        else:
            verdict = "better" if good > 1 else "WORSE"
            over += 1
    rows.append((bench, name, fmt(mo), fmt(mn), "%.3f" % ratio, change,
                 "%.1f%%" % (100 * spread) if spread is not None else "-", verdict))

head = ("benchmark", "figure", "old", "new", "new/old", "change", "spread", "")
widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
right = {2, 3, 4, 5, 6}
def line(r):
    return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                     for i, (c, w) in enumerate(zip(r, widths))).rstrip()
print(line(head))
print("  ".join("-" * w for w in widths))
for r in rows:
    print(line(r))
if goods:
    g = math.exp(sum(math.log(x) for x in goods) / len(goods))
    print("\n%d timed figures: geometric mean change %+.1f%% (+ = new better), from %+.1f%% to %+.1f%%"
          % (len(goods), 100 * (g - 1), 100 * (min(goods) - 1), 100 * (max(goods) - 1)))
    if rounds >= 2:
        print("%d outside their spread" % over)
    else:
        print("one round: no spread to judge noise by (use -n 3 or more)")
changed = [r for r in rows if r[-1] in ("CHANGED", "missing")]
if changed:
    print("%d figures that must not change changed, or are missing: see the table" % len(changed))
EOF
