/*
 * Worker selection policies; see policy.h for what each promises.
 */
#include "policy.h"

#include <string.h>

#include "pdserve/base.h"

const char *pd_router_policy_name(pd_router_policy p) {
    switch (p) {
    case PD_ROUTER_ROUND_ROBIN: return "round_robin";
    case PD_ROUTER_LEAST_LOAD: return "least_load";
    case PD_ROUTER_RANDOM: return "random";
    case PD_ROUTER_POWER_OF_TWO: return "power_of_two";
    }
    return "?";
}

pd_err pd_router_policy_parse(const char *s, pd_router_policy *out) {
    if (!s) return PD_ERR_INVALID;
    if (!strcmp(s, "round_robin")) *out = PD_ROUTER_ROUND_ROBIN;
    else if (!strcmp(s, "least_load")) *out = PD_ROUTER_LEAST_LOAD;
    else if (!strcmp(s, "random")) *out = PD_ROUTER_RANDOM;
    else if (!strcmp(s, "power_of_two")) *out = PD_ROUTER_POWER_OF_TWO;
    else return PD_ERR_INVALID;
    return PD_OK;
}

/* The k-th healthy candidate (k < the number of healthy ones). */
static size_t nth_healthy(const rt_candidate *c, size_t n, size_t k) {
    for (size_t i = 0; i < n; i++)
        if (c[i].healthy && k-- == 0) return i;
    return RT_PICK_NONE;
}

/* random and power_of_two: the cursor is the state of a splitmix64 stream. */
static size_t pick_random(pd_router_policy policy, const rt_candidate *c, size_t n,
                          size_t *cursor) {
    size_t healthy = 0;
    for (size_t i = 0; i < n; i++) healthy += c[i].healthy;
    if (healthy == 0) return RT_PICK_NONE;
    uint64_t s = *cursor;
    size_t a = nth_healthy(c, n, (size_t)(pd_splitmix64(&s) % healthy));
    if (policy == PD_ROUTER_POWER_OF_TWO) {
        size_t b = nth_healthy(c, n, (size_t)(pd_splitmix64(&s) % healthy));
        if (c[b].in_flight < c[a].in_flight) a = b;
    }
    *cursor = (size_t)s;
    return a;
}

size_t rt_policy_pick(pd_router_policy policy, const rt_candidate *c, size_t n, size_t *cursor) {
    PD_ASSERT(cursor != NULL);
    if (n == 0) return RT_PICK_NONE;
    if (policy == PD_ROUTER_RANDOM || policy == PD_ROUTER_POWER_OF_TWO)
        return pick_random(policy, c, n, cursor);
    size_t start = *cursor % n;
    size_t best = RT_PICK_NONE;
    for (size_t k = 0; k < n; k++) {
        size_t i = (start + k) % n;
        if (!c[i].healthy) continue;
        if (policy == PD_ROUTER_ROUND_ROBIN) {
            best = i;
            break;
        }
        /* least_load: strictly fewer wins, so the first at or after the
         * cursor keeps a tie. */
        if (best == RT_PICK_NONE || c[i].in_flight < c[best].in_flight) best = i;
    }
    if (best != RT_PICK_NONE) {
        PD_ASSERT(best < n && c[best].healthy);
        *cursor = (best + 1) % n;
    }
    return best;
}
