/* Placeholder until the router lands: `pdserve run --no-router` works. */
#include "run_router.h"

pd_err pd_run_router_start(pd_run_router **out, const char *host, uint16_t port, uint16_t prefill_port,
                           uint16_t decode_port, uint16_t bootstrap_port, char *msg, size_t cap) {
    (void)host, (void)port, (void)prefill_port, (void)decode_port, (void)bootstrap_port;
    *out = NULL;
    return pd_errorf(msg, cap, PD_ERR_STATE, "the router is not in this build yet (use --no-router)");
}

uint16_t pd_run_router_port(const pd_run_router *r) {
    (void)r;
    return 0;
}

void pd_run_router_stop(pd_run_router *r) { (void)r; }
