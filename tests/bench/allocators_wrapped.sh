#!/bin/bash
# bench/sched counts the core's heap allocations by wrapping the allocators
# at link time (CMakeLists.txt, bench_sched's link options). An allocator the
# link does not wrap is invisible to its figures: buf_fit moved the request
# buffers to aligned_alloc before it was wrapped, and the 0.03 allocations
# per request at submit at 1,024 live read 0.00 (issue 13). Fails when a
# library of the scheduler core calls a heap allocator outside WRAPPED.
#   allocators_wrapped.sh "WRAPPED" LIBRARY...
set -u
wrapped=$1
shift
if ! command -v nm >/dev/null; then
    echo "allocators_wrapped: no nm, skipped"
    exit 77
fi
heap='malloc|calloc|realloc|reallocarray|aligned_alloc|posix_memalign|memalign|valloc|pvalloc|strdup|strndup'
status=0
seen=0
for lib in "$@"; do
    for sym in $(nm -u "$lib" 2>/dev/null | awk '{ print $NF }' | sed 's/@.*//' | sort -u |
                 grep -xE "$heap"); do
        seen=$((seen + 1))
        case " $wrapped " in
        *" $sym "*) ;;
        *) echo "allocators_wrapped: $(basename "$lib") calls $sym, which bench/sched does not" \
                "count (add --wrap=$sym to bench_sched's link and a counting wrapper)"
           status=1 ;;
        esac
    done
done
# The core allocates (every library calls calloc or malloc): none seen means
# nm could not read the libraries, and the check would pass on nothing.
if [ $seen -eq 0 ]; then
    echo "allocators_wrapped: nm listed no heap allocator in $* (unreadable libraries?)"
    exit 1
fi
[ $status -eq 0 ] && echo "allocators_wrapped: every heap allocator the core calls is counted ($wrapped)"
exit $status
