/*
 * Which worker of one role gets the next request.
 *
 * A pure function over a snapshot of candidates (healthy?, requests in
 * flight), so it is tested without sockets and called under the worker
 * table's lock. Prefill and decode nodes are picked independently, each role
 * with its own cursor: any prefill node can feed any decode node, so there
 * is no reason to tie them into fixed pairs.
 *
 *   round_robin  the next healthy worker after the previous pick. With n
 *                healthy workers every window of n requests visits each once.
 *   least_load   the healthy worker with the fewest requests in flight from
 *                this router; ties go to the first one at or after the
 *                cursor, so equally idle workers still take turns. The load
 *                is what this router sent, not what the worker holds from
 *                other routers: cheap and exact, blind to other clients.
 *   random       a healthy worker drawn uniformly (a splitmix64 stream kept
 *                in the cursor: deterministic for a given start).
 *   power_of_two two healthy workers drawn (possibly the same one); the one
 *                with fewer in flight, the first on a tie. Load-aware like
 *                least_load without everyone rushing the same idle worker.
 */
#ifndef PDSERVE_ROUTER_POLICY_H
#define PDSERVE_ROUTER_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pdserve/router.h"

typedef struct rt_candidate {
    bool healthy;
    uint32_t in_flight;
} rt_candidate;

#define RT_PICK_NONE ((size_t)-1)

/* Index of the chosen candidate, or RT_PICK_NONE when none is
 * healthy. *cursor (< n, or anything: it is reduced modulo n) is where the
 * scan starts and is advanced past the pick. */
size_t rt_policy_pick(pd_router_policy policy, const rt_candidate *c, size_t n, size_t *cursor);

#endif
