#!/bin/bash
# The retire's prefetches are in the compiled retire (issue 13, fourteenth
# round): gcc deletes a call to a function that only prefetches when it is not
# inlined early, as dead code, so retire_prefetch issued nothing in the Release
# build until it was made always inline. Counts the prefetch instructions in
# the functions whose name starts with eng_retire in the engine library.
#   prefetch_kept.sh LIBRARY [MIN]
set -u
lib=$1
min=${2:-7}
if ! command -v objdump >/dev/null; then
    echo "prefetch_kept: no objdump, skipped"
    exit 77
fi
n=$(objdump -d --no-show-raw-insn "$lib" | awk '
    /^[0-9a-f]+ <[^>]*>:$/ { inside = ($2 ~ /^<eng_retire[.>]/) }
    inside && /prefetch/ { n++ }
    END { print n + 0 }')
if [ "$n" -lt "$min" ]; then
    echo "prefetch_kept: eng_retire holds $n prefetch instructions, expected at least $min" \
         "(retire_prefetch's call deleted, or not inlined)"
    exit 1
fi
echo "prefetch_kept: eng_retire holds $n prefetch instructions (at least $min)"
