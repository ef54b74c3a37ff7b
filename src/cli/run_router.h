/* The router, started inside `pdserve run` in front of its two nodes. */
#ifndef PDSERVE_CLI_RUN_ROUTER_H
#define PDSERVE_CLI_RUN_ROUTER_H

#include "pdserve/base.h"

typedef struct pd_run_router pd_run_router;

/* api_key: the --api-key of run (NULL: none), asked of clients and sent to
 * the nodes. */
pd_err cli_run_router_start(pd_run_router **out, const char *host, uint16_t port,
                            uint16_t prefill_port, uint16_t decode_port, uint16_t bootstrap_port,
                            const char *api_key, char *msg, size_t cap);
uint16_t cli_run_router_port(const pd_run_router *r);
void cli_run_router_stop(pd_run_router *r);

#endif
