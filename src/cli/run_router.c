/* The router inside `pdserve run`: one prefill node, one decode node. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "pdserve/router.h"
#include "run_router.h"

struct pd_run_router {
    pd_router *r;
    char prefill[96], decode[96];
};

/* The router's log: clients that hung up, one JSON line each. */
static void print_hang_up(void *ctx, const char *line) {
    (void)ctx;
    /* Info, as SGLang logs requests: on stderr, hidden by --log-level warning. */
    if (cli_log_level_get() <= CLI_LOG_INFO) fprintf(stderr, "%s\n", line);
}

pd_err cli_run_router_start(pd_run_router **out, const char *host, uint16_t port,
                            uint16_t prefill_port, uint16_t decode_port, uint16_t bootstrap_port,
                            const char *api_key, char *msg, size_t cap) {
    *out = NULL;
    pd_run_router *rr = calloc(1, sizeof(*rr));
    if (!rr) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    /* The nodes listen where the router does (a wildcard address is reached
     * through the loopback interface). */
    const char *node_host = (!host || !host[0] || !strcmp(host, "0.0.0.0")) ? "127.0.0.1" : host;
    snprintf(rr->prefill, sizeof(rr->prefill), "http://%s:%u@%u", node_host, prefill_port,
             bootstrap_port);
    snprintf(rr->decode, sizeof(rr->decode), "http://%s:%u", node_host, decode_port);
    pd_router_config c;
    pd_router_config_default(&c);
    c.host = host;
    c.port = port;
    c.prefill[0] = rr->prefill;
    c.prefill_count = 1;
    c.decode[0] = rr->decode;
    c.decode_count = 1;
    c.api_key = api_key; /* its clients' key, and the one its nodes want */
    c.on_log = print_hang_up;
    pd_err err = pd_router_create(&rr->r, &c, msg, cap);
    if (!err) err = pd_router_start(rr->r, msg, cap);
    if (err) {
        pd_router_destroy(rr->r);
        free(rr);
        return err;
    }
    *out = rr;
    return PD_OK;
}

uint16_t cli_run_router_port(const pd_run_router *r) { return r ? pd_router_port(r->r) : 0; }

void cli_run_router_stop(pd_run_router *r) {
    if (!r) return;
    pd_router_stop(r->r);
    pd_router_destroy(r->r);
    free(r);
}
