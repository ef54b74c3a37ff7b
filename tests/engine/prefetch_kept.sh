#!/bin/bash
# A helper's prefetches are in the compiled caller (issue 13, fourteenth
# round): gcc deletes a call to a function that only prefetches when it is not
# inlined early, as dead code, so retire_prefetch (engine) and prefetch_victim
# (cache) issued nothing in the Release build until they were made always
# inline. Counts the prefetch instructions in the functions of LIBRARY whose
# name is FUNC or starts with FUNC. (a gcc clone such as FUNC.part.0). FUNC
# may name several functions, a|b|c, counted together: where a static
# function's code lands depends on the build's inlining (decode.c's
# retire_done is its own function in the Debug build, part of decode_step in
# the Release one).
#   prefetch_kept.sh LIBRARY FUNC MIN
set -u
lib=$1
func=$2
min=$3
if ! command -v objdump >/dev/null; then
    echo "prefetch_kept: no objdump, skipped"
    exit 77
fi
n=$(objdump -d --no-show-raw-insn "$lib" | awk -v fs="$func" '
    BEGIN { k = split(fs, f, "|") }
    /^[0-9a-f]+ <[^>]*>:$/ { name = substr($2, 2, length($2) - 3); inside = 0
                             for (i = 1; i <= k; i++)
                                 if (name == f[i] || index(name, f[i] ".") == 1) inside = 1 }
    inside && /prefetch/ { n++ }
    END { print n + 0 }')
if [ "$n" -lt "$min" ]; then
    echo "prefetch_kept: $func holds $n prefetch instructions, expected at least $min" \
         "(a prefetching helper's call deleted, or the helper not inlined)"
    exit 1
fi
echo "prefetch_kept: $func holds $n prefetch instructions (at least $min)"
