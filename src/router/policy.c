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
    }
    return "?";
}

pd_err pd_router_policy_parse(const char *s, pd_router_policy *out) {
    if (!s) return PD_ERR_INVALID;
    if (!strcmp(s, "round_robin")) *out = PD_ROUTER_ROUND_ROBIN;
    else if (!strcmp(s, "least_load")) *out = PD_ROUTER_LEAST_LOAD;
    else return PD_ERR_INVALID;
    return PD_OK;
}

size_t rt_policy_pick(pd_router_policy policy, const rt_candidate *c, size_t n, size_t *cursor) {
    PD_ASSERT(cursor != NULL);
    if (n == 0) return RT_PICK_NONE;
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
