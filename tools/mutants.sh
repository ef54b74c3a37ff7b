#!/usr/bin/env bash
# tools/mutants.sh — mutation testing: would the simulator's generic checks
# catch each bug we know how to plant?
#
#   tools/mutants.sh [PATCH...]        run every tests/mutants/*.patch, or the ones named
#   tools/mutants.sh --check [PATCH...]        only check that each patch still applies
#   tools/mutants.sh --check-build [PATCH...]  ... applies and the result still builds
#   make mutants                       the same as the first line (never part of make test)
# --head tests the last commit instead of the working tree (which is the default,
# as for make test: tracked files plus untracked ones git does not ignore).
#
# A mutant is one planted bug kept as a unified diff against the repository root
# (tests/mutants/<bug>.patch). For each one this script applies the patch to a
# scratch copy of the tree, rebuilds pdserve and runs the checks that make test
# runs which know nothing about the bug: the swarm (pdserve sim --seeds A..B) and
# the exhaustive explore (pdserve sim --explore). Scenario files are not run: a
# scenario replays a race someone already knew about, so it proves nothing about
# catching the next one. The tiny-model swarm is not run either (same generator,
# slower executor).
#
# One place for the commands: they are read from the add_test lines of
# CMakeLists.txt ("the simulator" section), every `COMMAND pdserve sim` line that
# has --seeds (without --model) or --explore, and run with exactly those
# arguments. ctest splits the swarm into two halves for two cores; they run here
# in parallel the same way. Change the range there, and this follows.
#
# How it stays within minutes:
#   - the working tree (or HEAD with --head) is copied once to $MUTANTS_DIR/tree,
#     made its own throwaway git repository (the index is the baseline to
#     restore from), configured once as an optimised build (-DCMAKE_BUILD_TYPE=
#     Release -DPD_BUILD_TESTS=OFF, as the Makefile's release target) and
#     pdserve is built once;
#   - the unmutated binary runs the same checks first (capped at 600 s each):
#     they must pass, and their times set the per-run cap for the mutants
#     (5 times the slowest, at least 60 s);
#   - per mutant: git apply, an incremental build of pdserve (only the patched
#     files recompile), the swarm halves in parallel — each stops at its first
#     failing seed — then the explore only if the swarm missed it; then
#     git checkout + git clean restore the tree for the next one.
#
# What the table says, per mutant (time_s covers apply, build and runs):
#   seed N                    the swarm failed at seed N (lowest over the halves);
#                             its log (swarm<i>.err) ends with the reproduce line
#   seed N (crash: SIGSEGV)   the run died on a signal, at seed N
#   hang (seed N)             the run passed its time cap, stuck in seed N (the
#                             seeds' child process is stopped so that pdserve
#                             names the seed it was in)
#   explore schedule N        the explore reported a violation in schedule N
#   explore (crash: ...)      the explore died; hang (explore): it passed its cap
#   NOT CAUGHT                every check passed: a gap in the generic checks
#   NOT CAUGHT (crash|hang, seed unknown)
#                             the swarm died or hung but no seed could be named
#                             (the run is rerun with --trace and the seeds after
#                             the last one it started are tried one by one first)
#   PATCH FAILED / BUILD FAILED   the mutant itself is broken, see below
# The exit status is 0 only if every mutant was caught; 2 for bad usage or when
# the unmutated tree fails to build or fails its own checks. Logs of every step
# are kept under $MUTANTS_DIR/logs/<mutant>/ until the next run.
#
# Adding a mutant
#   1. Plant the bug in a scratch worktree, never in a checkout others edit:
#        git worktree add --detach /tmp/mut HEAD && $EDITOR /tmp/mut/src/...
#      Keep it the smallest change a reviewer could plausibly let through, and
#      make it compile cleanly (-Werror): a mutant that does not build tests nothing.
#   2. git -C /tmp/mut diff > tests/mutants/<what_the_bug_does>.patch
#      git worktree remove --force /tmp/mut
#   3. Start the file with a header of '#' lines (git apply and patch skip
#      everything before the first `diff`/`---` line): the bug class it plants
#      and the rule it breaks (an invariant named in a header, e.g. L1 in
#      src/mem/ledger.c, or a step of the retire path in src/engine/engine.c).
#   4. tools/mutants.sh tests/mutants/<name>.patch must report it caught. If it
#      says NOT CAUGHT, the generic checks have a gap: strengthen them (an
#      invariant the sim checks, a fault the swarm injects) rather than the
#      patch, and add no scenario file to "catch" it — scenarios do not count.
#
# When a patch no longer applies (PATCH FAILED, or --check fails)
#   The code it mutates has moved or changed. Re-plant the same bug on today's
#   code: in a scratch worktree try `git apply --3way` or `patch -p1 --merge`,
#   or redo it by hand from the header's description, then regenerate the diff
#   and keep the header. BUILD FAILED is the same: re-plant it so it compiles.
#   If the code the bug lived in is gone and the bug can no longer be written,
#   delete the patch and say why in the commit message.
#
# Environment:
#   MUTANTS_DIR         scratch folder (default build/mutants; emptied at start)
#   MUTANTS_JOBS        compile jobs (default: nproc)
#   MUTANTS_TIMEOUT_S   cap per sim run, seconds (default: from the unmutated run)
#   MUTANTS_CMAKE_ARGS  configure arguments (default the release build's;
#                       add -DPD_SANITIZE=ON to also let ASan/UBSan catch, slower)
#
# Limits: a bug that only a sanitizer would see is NOT CAUGHT in the default
# release build, although make test (ASan+UBSan) might catch it.
set -euo pipefail

readonly TIME_CAP_MIN_S=60     # the smallest per-run cap derived from the base run
readonly TIME_CAP_FACTOR=5     # cap = factor * the slowest unmutated run
readonly LOCATE_SEEDS_MAX=200  # seeds tried one by one when a run dies unnamed
readonly LOCATE_SEED_CAP_S=30  # cap for one of those single-seed runs
readonly BASE_CAP_S=600        # cap for the unmutated runs

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mode=run
from_head=0
patches=()

usage() {
    sed -n '5,10p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 2
}

die() {
    echo "mutants: $*" >&2
    exit 2
}

# Microseconds since the epoch, and a duration in microseconds as "12.3".
now_us() {
    local t=$EPOCHREALTIME
    echo "${t/[.,]/}"
}
fmt_s() {
    printf '%d.%d' $(($1 / 1000000)) $((($1 / 100000) % 10))
}

# ---- arguments --------------------------------------------------------------

for a in "$@"; do
    case "$a" in
    --check) mode=check ;;
    --check-build) mode=check-build ;;
    --head) from_head=1 ;;
    -h | --help) usage ;;
    -*) echo "mutants: unknown option $a" >&2; usage ;;
    *)
        # A path, or a bare name under tests/mutants.
        if [ -f "$a" ]; then
            patches+=("$(cd "$(dirname "$a")" && pwd)/$(basename "$a")")
        elif [ -f "$root/tests/mutants/$a" ]; then
            patches+=("$root/tests/mutants/$a")
        elif [ -f "$root/tests/mutants/$a.patch" ]; then
            patches+=("$root/tests/mutants/$a.patch")
        else
            die "no such patch: $a"
        fi
        ;;
    esac
done
if [ ${#patches[@]} -eq 0 ]; then
    shopt -s nullglob
    patches=("$root"/tests/mutants/*.patch)
    shopt -u nullglob
fi
if [ ${#patches[@]} -eq 0 ]; then
    echo "mutants: no patches under tests/mutants; nothing to do"
    exit 0
fi

mutant_name() {
    local b
    b=$(basename "$1")
    echo "${b%.patch}"
}

# copy_tree DEST: the tree under test, as plain files in DEST, made its own
# throwaway git repository whose index is the baseline every mutant is undone
# to (git apply then works relative to DEST, not to a checkout around it).
copy_tree() {
    if [ "$from_head" -eq 1 ]; then
        git -C "$root" archive --format=tar HEAD | tar -xf - -C "$1"
    else
        (cd "$root" && git ls-files -z -co --exclude-standard |
            while IFS= read -r -d '' f; do
                if [ -e "$f" ] || [ -L "$f" ]; then printf '%s\0' "$f"; fi
            done | tar --null -T - -cf -) | tar -xf - -C "$1"
    fi
    git -C "$1" -c init.defaultBranch=scratch init -q
    git -C "$1" add -A
}

# ---- --check: does every patch still apply? -----------------------------------

if [ "$mode" = check ]; then
    bad=0
    check_dir=$root
    if [ "$from_head" -eq 1 ]; then
        check_dir=$(mktemp -d)
        trap 'rm -rf "$check_dir"' EXIT
        copy_tree "$check_dir"
    fi
    for p in "${patches[@]}"; do
        if (cd "$check_dir" && git apply --check "$p") >/dev/null 2>&1; then
            printf '%-40s applies\n' "$(mutant_name "$p")"
        else
            printf '%-40s PATCH FAILED\n' "$(mutant_name "$p")"
            (cd "$check_dir" && git apply --check "$p") 2>&1 | sed 's/^/    /' || true
            bad=1
        fi
    done
    exit $bad
fi

# ---- the scratch tree ----------------------------------------------------------

work=${MUTANTS_DIR:-$root/build/mutants}
case "$work" in /*) ;; *) work=$root/$work ;; esac
jobs=${MUTANTS_JOBS:-$(nproc 2>/dev/null || echo 2)}
cmake_args=${MUTANTS_CMAKE_ARGS:--DCMAKE_BUILD_TYPE=Release -DPD_BUILD_TESTS=OFF}
tree=$work/tree
logs=$work/logs
bin=$tree/build/pdserve

children=()
cleanup() {
    local pid
    for pid in "${children[@]}"; do stop_sim KILL "$pid"; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

rm -rf "$work"
mkdir -p "$tree" "$logs/base"
if [ "$from_head" -eq 1 ]; then
    echo "mutants: copying HEAD ($(git -C "$root" rev-parse --short HEAD)) to $tree" >&2
else
    echo "mutants: copying the working tree to $tree" >&2
fi
copy_tree "$tree"

t0=$(now_us)
echo "mutants: configuring and building pdserve ($cmake_args)" >&2
read -ra cargs <<<"$cmake_args"
if ! (cd "$tree" && cmake -S . -B build "${cargs[@]}" &&
    cmake --build build --target pdserve -j "$jobs") >"$logs/base/build.log" 2>&1; then
    tail -n 30 "$logs/base/build.log" >&2
    die "the unmutated tree does not build (log: $logs/base/build.log)"
fi
base_build_us=$(($(now_us) - t0))

# ---- the commands make test runs, from CMakeLists.txt --------------------------

# "add_test(NAME name COMMAND pdserve sim ARGS)" on one line -> "name ARGS"
sim_args_re=' \(.*\))[[:blank:]]*$/\1 \2/p'
swarm_names=() swarm_args=() explore_args=""
while read -r name args; do
    case " $args " in
    *" --model "* | *" --scenario "*) continue ;;
    *" --seeds "*) ;;
    *" --explore "*) ;;
    *) continue ;;
    esac
    case "$args" in
    *[\$\"\'\;\(\)\\]*) die "CMakeLists.txt: cannot run test $name as written: $args" ;;
    esac
    case " $args " in
    *" --seeds "*) swarm_names+=("$name"); swarm_args+=("$args") ;;
    *) [ -z "$explore_args" ] || die "CMakeLists.txt: more than one --explore test"
       explore_args=$args ;;
    esac
done < <(sed -n "s/^[[:blank:]]*add_test(NAME \\([A-Za-z0-9_]*\\) COMMAND pdserve sim$sim_args_re" \
             "$tree/CMakeLists.txt")
[ ${#swarm_args[@]} -gt 0 ] ||
    die "CMakeLists.txt: no 'add_test(... COMMAND pdserve sim --seeds A..B ...)'"
[ -n "$explore_args" ] || die "CMakeLists.txt: no 'add_test(... COMMAND pdserve sim --explore)'"

# seeds_range ARGS... -> "A B" from --seeds A..B
seeds_range() {
    while [ $# -gt 0 ]; do
        if [ "$1" = --seeds ] && [ $# -ge 2 ]; then
            echo "${2%%..*} ${2##*..}"
            return 0
        fi
        shift
    done
    return 1
}

# with_seeds A B ARGS... -> ARGS with --seeds replaced by A..B, one per line
with_seeds() {
    local a=$1 b=$2 prev=""
    shift 2
    for w in "$@"; do
        if [ "$prev" = --seeds ]; then echo "$a..$b"; else echo "$w"; fi
        prev=$w
    done
}

# One swarm line and two cores: split it as ctest would.
if [ ${#swarm_args[@]} -eq 1 ]; then
    read -ra w <<<"${swarm_args[0]}"
    read -r lo hi < <(seeds_range "${w[@]}") || die "cannot read --seeds in: ${swarm_args[0]}"
    if [ "$hi" -gt "$lo" ]; then
        mid=$(((lo + hi) / 2))
        swarm_args=("$(with_seeds "$lo" "$mid" "${w[@]}" | paste -sd' ')"
                    "$(with_seeds $((mid + 1)) "$hi" "${w[@]}" | paste -sd' ')")
        swarm_names=("${swarm_names[0]}_a" "${swarm_names[0]}_b")
    fi
fi

# ---- running the checks ----------------------------------------------------------

# stop_sim SIG WRAPPER: each pdserve runs under a wrapper subshell (below).
# pdserve sim runs its seeds in a child process and, when that child dies, names
# the seed it was in; so a run past its cap is stopped through that child (found
# by parent id) and gets to report. One without a child (an older pdserve, or
# the explore) is stopped itself; SIGKILL always goes to pdserve itself (its
# child dies with it).
stop_sim() {
    local sig=$1 sim kids
    sim=$(pgrep -P "$2" | head -n 1 || true)
    [ -n "$sim" ] || return 0
    kids=""
    [ "$sig" = KILL ] || kids=$(pgrep -P "$sim" || true)
    # shellcheck disable=SC2086 # kids is a list of pids
    kill -"$sig" ${kids:-$sim} 2>/dev/null || true
}

# run_group CAP_S DIR PREFIX ARGS... : one `pdserve sim ARGS` per argument (a
# string of words), all in parallel, output in DIR/PREFIX<i>.out and .err.
# Past CAP_S each one still running is stopped (SIGTERM through its child, then
# SIGKILL 10 s later). Sets rcs[i] (exit status) and hung[i] (1: it was stopped).
run_group() {
    local cap=$1 dir=$2 prefix=$3 i now deadline alive w=() pids=()
    shift 3
    local specs=("$@")
    rcs=() hung=()
    for i in "${!specs[@]}"; do
        read -ra w <<<"${specs[$i]}"
        # A wrapper subshell that is not replaced by pdserve (rc=...; exit): bash
        # reports a job that died on a signal ("Aborted") on its own stderr, which
        # here is /dev/null; the status comes through as 128+signal.
        (
            rc=0
            "$bin" sim "${w[@]}" >"$dir/$prefix$i.out" 2>"$dir/$prefix$i.err" || rc=$?
            exit "$rc"
        ) 2>/dev/null &
        pids[i]=$!
        hung[i]=0
        children+=($!)
    done
    deadline=$(($(now_us) + cap * 1000000))
    while :; do
        alive=0
        for i in "${!pids[@]}"; do
            kill -0 "${pids[$i]}" 2>/dev/null || continue
            alive=1
            now=$(now_us)
            if [ "$now" -gt "$deadline" ] && [ "${hung[$i]}" -eq 0 ]; then
                hung[i]=1
                stop_sim TERM "${pids[$i]}"
            elif [ "$now" -gt $((deadline + 10000000)) ]; then
                stop_sim KILL "${pids[$i]}"
            fi
        done
        [ "$alive" -eq 1 ] || break
        sleep 0.2
    done
    for i in "${!pids[@]}"; do
        rcs[i]=0
        wait "${pids[$i]}" || rcs[i]=$?
    done
    children=()
}

# The seed a failed swarm run names on stderr: the reproduce line, else the last
# "seed N" it printed. jitter_seed=... in a configuration line is not one.
named_seed() {
    local s
    s=$(sed -n 's/^# reproduce: pdserve sim --seed \([0-9][0-9]*\).*/\1/p' "$1" | head -n 1)
    if [ -z "$s" ]; then
        s=$(grep -oE '(^|[^A-Za-z_])seed"?[ :=]+[0-9]+' "$1" | tail -n 1 |
            grep -oE '[0-9]+$' || true)
    fi
    echo "$s"
}

# locate_seed CAP_S DIR ARGS... : a run died or hung without naming its seed.
# Rerun it with --trace (the trace starts each seed with "# pdserve sim --seed N";
# what was still buffered when it died may be lost), then run the seeds from the
# last one it shows, one by one, until one fails. Prints the seed, or nothing.
locate_seed() {
    local cap=$1 dir=$2 lo hi start s
    shift 2
    read -r lo hi < <(seeds_range "$@") || return 0
    run_group "$cap" "$dir" locate "$* --trace $dir/locate.trace"
    start=$(sed -n 's/^# pdserve sim --seed \([0-9][0-9]*\)$/\1/p' "$dir/locate.trace" 2>/dev/null |
        tail -n 1 || true)
    rm -f "$dir/locate.trace"
    [ -n "$start" ] || start=$lo
    for ((s = start; s <= hi && s < start + LOCATE_SEEDS_MAX; s++)); do
        run_group "$LOCATE_SEED_CAP_S" "$dir" locate "$(with_seeds "$s" "$s" "$@" | paste -sd' ')"
        if [ "${rcs[0]}" -ne 0 ]; then
            echo "$s"
            return 0
        fi
    done
}

signal_of() { echo "SIG$(kill -l $(($1 - 128)) 2>/dev/null || echo $(($1 - 128)))"; }

# check_swarm CAP_S DIR: the swarm lines, in parallel. Sets verdict ("" when
# every seed passed), caught (1 when a seed is named) and swarm_us.
check_swarm() {
    local cap=$1 dir=$2 i rc seed kind how t0 best_seed="" best_verdict="" unnamed=""
    local w=() src=() hangs=()
    t0=$(now_us)
    run_group "$cap" "$dir" swarm "${swarm_args[@]}"
    swarm_us=$(($(now_us) - t0))
    src=("${rcs[@]}")
    hangs=("${hung[@]}")
    for i in "${!swarm_args[@]}"; do
        rc=${src[$i]}
        if [ "$rc" -eq 0 ] && grep -q '"failed_seeds":0,' "$dir/swarm$i.out"; then continue; fi
        read -ra w <<<"${swarm_args[$i]}"
        if [ "$rc" -eq 2 ]; then
            best_verdict="ERROR (pdserve sim ${swarm_args[$i]}: bad usage)"
            best_seed=0
            continue
        fi
        if [ "${hangs[$i]}" -eq 1 ]; then kind=hang
        elif [ "$rc" -gt 128 ]; then kind="crash: $(signal_of "$rc")"
        elif [ "$rc" -eq 1 ]; then kind=violation
        else kind="exit $rc"
        fi
        seed=$(named_seed "$dir/swarm$i.err")
        # pdserve sim names the seed its child died in: "seed N crashed
        # (signal 6: SIGABRT)" or "(exit status 1)".
        if [ -n "$seed" ] && [ "$kind" = violation ]; then
            how=$(sed -n "s/^seed $seed crashed (\\(.*\\))\$/\\1/p" "$dir/swarm$i.err" | head -n 1)
            [ -z "$how" ] || kind="crash: ${how#signal [0-9]*: }"
        fi
        if [ -z "$seed" ] && [ "$kind" != violation ]; then
            echo "mutants:   ${swarm_names[$i]}: $kind, no seed printed; locating it" >&2
            seed=$(locate_seed "$cap" "$dir" "${w[@]}")
        fi
        if [ -z "$seed" ]; then
            unnamed="NOT CAUGHT (${kind%%:*}, seed unknown)"
            continue
        fi
        if [ -z "$best_seed" ] || [ "$seed" -lt "$best_seed" ]; then
            best_seed=$seed
            case "$kind" in
            violation) best_verdict="seed $seed" ;;
            hang) best_verdict="hang (seed $seed)" ;;
            *) best_verdict="seed $seed ($kind)" ;;
            esac
        fi
    done
    caught=0
    verdict=""
    if [ -n "$best_verdict" ]; then
        verdict=$best_verdict
        case "$verdict" in ERROR*) ;; *) caught=1 ;; esac
    elif [ -n "$unnamed" ]; then
        verdict=$unnamed
    fi
}

# check_explore CAP_S DIR: sets verdict, caught and explore_us the same way.
check_explore() {
    local cap=$1 dir=$2 rc n t0
    t0=$(now_us)
    run_group "$cap" "$dir" explore "$explore_args"
    rc=${rcs[0]}
    explore_us=$(($(now_us) - t0))
    caught=1
    verdict=""
    if [ "${hung[0]}" -eq 1 ]; then
        verdict="hang (explore)"
    elif [ "$rc" -eq 0 ] && grep -q '"violations":0[,}]' "$dir/explore0.out"; then
        caught=0
    elif [ "$rc" -gt 128 ]; then
        verdict="explore (crash: $(signal_of "$rc"))"
    elif [ "$rc" -eq 2 ]; then
        verdict="ERROR (pdserve sim $explore_args: bad usage)"
        caught=0
    else
        n=$(sed -n 's/^{"schedules":\([0-9][0-9]*\),"violations":[1-9].*/\1/p' "$dir/explore0.out" |
            head -n 1)
        if [ -n "$n" ]; then verdict="explore schedule $n"; else verdict="explore (exit $rc)"; fi
    fi
}

# check_all CAP_S DIR: the swarm, then the explore if the swarm missed it.
check_all() {
    local swarm_verdict
    check_swarm "$1" "$2"
    explore_us=0
    [ "$caught" -eq 0 ] || return 0
    swarm_verdict=$verdict
    check_explore "$1" "$2"
    if [ "$caught" -eq 0 ] && [ -n "$swarm_verdict" ]; then verdict=$swarm_verdict; fi
}

# ---- the unmutated tree must pass, and sets the time cap ------------------------------

if [ "$mode" = run ]; then
    echo "mutants: running the unmutated checks" >&2
    check_all "${MUTANTS_TIMEOUT_S:-$BASE_CAP_S}" "$logs/base"
    [ -z "$verdict" ] ||
        die "the unmutated tree fails its own checks: $verdict (logs: $logs/base)"
    base_swarm_us=$swarm_us
    base_explore_us=$explore_us
    slowest_s=$(((base_swarm_us > base_explore_us ? base_swarm_us : base_explore_us) / 1000000 + 1))
    cap=$((TIME_CAP_FACTOR * slowest_s))
    [ "$cap" -ge "$TIME_CAP_MIN_S" ] || cap=$TIME_CAP_MIN_S
    cap=${MUTANTS_TIMEOUT_S:-$cap}
fi

# ---- every mutant ------------------------------------------------------------------

names=() verdicts=() times=()
failures=0
total=${#patches[@]}
k=0
for p in "${patches[@]}"; do
    k=$((k + 1))
    name=$(mutant_name "$p")
    dir=$logs/$name
    mkdir -p "$dir"
    echo "mutants: [$k/$total] $name" >&2
    t0=$(now_us)
    caught=0
    if ! (cd "$tree" && git apply "$p") >"$dir/apply.log" 2>&1; then
        verdict="PATCH FAILED"
    elif ! cmake --build "$tree/build" --target pdserve -j "$jobs" >"$dir/build.log" 2>&1; then
        verdict="BUILD FAILED"
    elif [ "$mode" = check-build ]; then
        verdict="builds"
        caught=1
    else
        check_all "$cap" "$dir"
        [ -n "$verdict" ] || verdict="NOT CAUGHT"
    fi
    # Undo the patch, whatever it did, before the next one.
    git -C "$tree" checkout -q -- .
    git -C "$tree" clean -fdq
    us=$(($(now_us) - t0))
    [ "$caught" -eq 1 ] || failures=$((failures + 1))
    names+=("$name")
    verdicts+=("$verdict")
    times+=("$(fmt_s "$us")")
    echo "mutants:   $verdict ($(fmt_s "$us") s)" >&2
done

# ---- the table ---------------------------------------------------------------------

w_name=6
for n in "${names[@]}"; do [ ${#n} -le "$w_name" ] || w_name=${#n}; done
echo
if [ "$mode" = run ]; then
    printf 'unmutated: build %s s, swarm %s s (%s), explore %s s; cap per run %s s\n' \
        "$(fmt_s "$base_build_us")" "$(fmt_s "$base_swarm_us")" "${swarm_names[*]}" \
        "$(fmt_s "$base_explore_us")" "$cap"
else
    printf 'unmutated: build %s s\n' "$(fmt_s "$base_build_us")"
fi
column=("caught by" caught)
[ "$mode" = run ] || column=(result built)
printf "%-${w_name}s  %-40s %7s\n" mutant "${column[0]}" time_s
for i in "${!names[@]}"; do
    printf "%-${w_name}s  %-40s %7s\n" "${names[$i]}" "${verdicts[$i]}" "${times[$i]}"
done
echo "$((total - failures)) of $total ${column[1]}; logs in $logs"
[ "$failures" -eq 0 ]
