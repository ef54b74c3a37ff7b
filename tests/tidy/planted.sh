#!/usr/bin/env bash
# tools/tidy must catch a planted violation of each rule (docs/tidy.md).
#   tests/tidy/planted.sh [SOURCE_DIR]     (ctest: tidy_planted)
#
# Copies the tracked files of SOURCE_DIR (their working-tree contents, so an
# uncommitted change to tools/tidy is what gets tested) into a scratch git
# repository; the real working tree is only read. There it adds a file,
# src/base/planted.c, that tidy passes, then plants one violation at a time
# into it (or beside it), runs tools/tidy on it, and checks that tidy exits 1
# and reports exactly that rule at that file:line. Every plant is in a file of
# this script's own, so the test does not depend on the rest of the tree being
# clean: tidy reads the whole tree but reports on the paths it is given. Needs
# git, python3 and clang-format; no network; about a second per rule.
set -euo pipefail

src=$(cd "${1:-$(dirname "$0")/../..}" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/tidy_planted.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
repo=$tmp/repo
mkdir -p "$repo"

# ---- the scratch copy --------------------------------------------------------
(cd "$src" && git ls-files -z | while IFS= read -r -d '' f; do
    [ -f "$f" ] && printf '%s\0' "$f"
done | tar --null -T - -cf -) | tar -xf - -C "$repo"

g() { git -C "$repo" -c user.name=planted -c user.email=planted@localhost "$@"; }
g init -q
P=src/base/planted.c
# Line 3 is old and not clang-format clean: --lines must leave it alone.
cat > "$repo/$P" <<'EOF'
/* tests/tidy/planted.sh: the file violations are planted into. */

static int  planted_old(int x){ return x; }

static int planted_twice(int x) { return 2 * x; }
EOF
g add -A
g commit -qm "scratch copy" --no-verify
g rev-parse HEAD > "$repo/tools/format-base"
g commit -qm "format base" --no-verify -- tools/format-base

tidy() { (cd "$repo" && python3 tools/tidy "$@"); }
failed=0
fail() {
    echo "FAIL $1: $2"
    sed 's/^/    /' "$tmp/out"
    failed=1
}

# ---- tidy passes before anything is planted ------------------------------------
set +e
tidy --changed "$(cat "$repo/tools/format-base")" --lines "$P" > "$tmp/out" 2>&1
rc=$?
set -e
if [ $rc -ne 0 ]; then
    fail "clean" "tidy exits $rc on $P before anything is planted"
    exit 1
fi
echo "clean: tidy passes on $P (all rules, format on changed lines)"
if ! tidy > "$tmp/whole" 2>&1; then
    echo "note: the tree itself has $(grep -c '^[^ ]*:[0-9]*: ' "$tmp/whole") violation(s)" \
         "(make tidy); the plants are checked on their own files"
fi

# ---- plant, run, check ---------------------------------------------------------
# expect [--as LABEL] RULE FILE:LINE TIDY-ARGS...: tidy exits 1 and reports
# that rule at that place and nothing else; then the scratch copy is put back.
expect() {
    local label=
    if [ "$1" = --as ]; then label=$2; shift 2; fi
    local rule=$1 where=$2
    label=${label:-$rule}
    shift 2
    set +e
    tidy "$@" > "$tmp/out" 2>&1
    local rc=$?
    set -e
    local found
    found=$(grep -E '^[^ ]+:[0-9]+: [a-z-]+: ' "$tmp/out" || true)
    if [ $rc -ne 1 ]; then
        fail "$label" "tidy exits $rc, not 1"
    elif ! grep -q "^$where: $rule: " <<< "$found"; then
        fail "$label" "no '$where: $rule:' in tidy's report"
    elif [ "$(wc -l <<< "$found")" -ne 1 ]; then
        fail "$label" "more reported than the one planted violation"
    else
        echo "$label: caught at $where"
    fi
    g checkout -q -- .
    g clean -fdq
}
lines() { wc -l < "$repo/$1"; }
add() { printf '%s\n' "$2" >> "$repo/$1"; }

# func-length: a 71-line function (brace to brace).
n=$(( $(lines $P) + 1 ))
{
    echo "static int planted_long(int x) {"
    for _ in $(seq 69); do echo "    x += 1;"; done
    echo "}"
} >> "$repo/$P"
expect func-length "$P:$n" "$P"

# line-length: a comment of 101 columns.
add $P "/* $(printf 'x%.0s' $(seq 95)) */"
expect line-length "$P:$(lines $P)" "$P"

# layers: base reaching into the cli's internal header (a new one).
echo "/* planted */" > "$repo/src/cli/planted.h"
add $P '#include "../cli/planted.h"'
expect layers "$P:$(lines $P)" "$P"

# lib-io: library code printing.
add $P '#include <stdio.h>'
add $P 'static void planted_say(void) { puts("planted"); }'
expect lib-io "$P:$(lines $P)" "$P"

# static-mut: a mutable file-scope variable.
add $P 'static int planted_count;'
expect static-mut "$P:$(lines $P)" "$P"

# pd-names: a pd_ function that include/pdserve does not declare.
add $P 'int pd_planted_undeclared(void) { return 0; }'
expect pd-names "$P:$(lines $P)" "$P"

# format: a changed line clang-format would lay out differently, checked as CI
# does (all rules, format on the lines changed since tools/format-base).
add $P ''
add $P 'static int planted_tight(int a,int b) { return a+b; }'
expect format "$P:$(lines $P)" --changed "$(cat "$repo/tools/format-base")" --lines "$P"

# format, shallow clone: the base is not fetched, so HEAD's own commit is checked.
add $P ''
add $P 'static int planted_tight(int a,int b) { return a+b; }'
n=$(lines $P)
g commit -qam "planted format" --no-verify
git clone -q --depth 2 "file://$repo" "$tmp/shallow"
g reset -q --hard HEAD~1
repo_full=$repo
repo=$tmp/shallow
expect --as "format (shallow clone)" format "$P:$n" \
    --changed "$(cat "$repo/tools/format-base")" --lines "$P"
grep -q "not in this shallow clone" "$tmp/out" ||
    fail "format (shallow clone)" "tidy did not say that the base is missing"
repo=$repo_full

# the allow-list: an entry that matches nothing is reported where it stands.
add tools/tidy-allow.txt "func-length $P:planted_gone  planted: matches nothing"
expect --as "allow-list (stale entry)" func-length \
    "tools/tidy-allow.txt:$(lines tools/tidy-allow.txt)" "$P"

if [ $failed -ne 0 ]; then
    echo "tidy_planted: FAILED"
    exit 1
fi
echo "tidy_planted: every planted violation caught"
