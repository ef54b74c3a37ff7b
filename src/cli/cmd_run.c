/*
 * pdserve run — the embedded default: a prefill node, a decode node and a
 * router in one process, the two nodes joined by the in-process loopback
 * transport, serving the tiny hybrid model. What `make run` starts.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "commands.h"
#include "node_options.h"
#include "pdserve/loopback_mt.h"
#include "run_router.h"

static const char *what =
    "The embedded default: a prefill node, a decode node and a router in one process,\n"
    "the nodes joined by the in-process loopback transport. Clients talk to the router\n"
    "(--port, default 30000) exactly as to `pdserve serve`. The node options below apply\n"
    "to both nodes (--api-key to the router too: it asks its clients for the key and\n"
    "sends it to the nodes); in addition:\n"
    "  --prefill-port N        the prefill node's HTTP port (default 0: any free port)\n"
    "  --decode-port N         the decode node's HTTP port (default 0: any free port)\n"
    "  --no-router             start only the two nodes (clients must add the bootstrap fields)";

typedef struct run_opts {
    pd_node_config base; /* both nodes' options; .port is the router's */
    uint16_t prefill_port, decode_port;
    bool router;
} run_opts;

/* run's own options at argv[*i]: 0 taken, 2 bad value (message printed), -1
 * not one of them. */
static int take_run_option(int argc, char **argv, int *i, run_opts *o) {
    if (!strcmp(argv[*i], "--no-router")) {
        o->router = false;
        return 0;
    }
    const size_t n = strcspn(argv[*i], "=");
    const bool prefill = n == 14 && !strncmp(argv[*i], "--prefill-port", n);
    if (!prefill && !(n == 13 && !strncmp(argv[*i], "--decode-port", n))) return -1;
    char name[32];
    const char *v = cli_option(argc, argv, i, name, sizeof name);
    uint64_t p = 0;
    if (!cli_u64(v, 0, 65535, &p)) {
        fprintf(stderr, "pdserve run: option %s needs a port number%s%s\n", name, v ? ", got " : "",
                v ? v : "");
        return 2;
    }
    *(prefill ? &o->prefill_port : &o->decode_port) = (uint16_t)p;
    return 0;
}

/* Our own options first, the node options for the rest. Returns -1 to go
 * on, else the exit code (0 after --help, the usage printed). */
static int parse_args(int argc, char **argv, run_opts *o) {
    pd_node_config_default(&o->base, PD_NODE_PREFILL);
    o->base.port = 30000;
    o->prefill_port = o->decode_port = 0;
    o->router = true;
    char **rest = calloc((size_t)argc + 1, sizeof(char *));
    if (!rest) {
        fprintf(stderr, "pdserve run: out of memory\n");
        return 1;
    }
    int nrest = 0, rc = 0;
    rest[nrest++] = argv[0];
    for (int i = 1; i < argc && rc <= 0; i++) {
        rc = take_run_option(argc, argv, &i, o);
        if (rc < 0) rest[nrest++] = argv[i];
    }
    if (rc <= 0) rc = cli_node_parse(nrest, rest, &o->base);
    free(rest);
    if (rc == 1) {
        cli_node_usage(stdout, CLI_NODE_RUN, "run", what);
        return 0;
    }
    if (rc) return rc;
    if (strcmp(o->base.transfer_backend, "loopback") != 0) {
        fprintf(stderr,
                "pdserve run: --transfer-backend %s: the nodes share one process, and "
                "loopback is the only transport there (see pdserve run --help)\n",
                o->base.transfer_backend);
        return 2;
    }
    return -1;
}

/* The prefill node, then the decode node, both on lb. 0, or 1 with the
 * failure printed. */
static int start_nodes(const run_opts *o, pd_loopback_mt *lb, pd_node *nodes[2]) {
    const pd_node_role roles[2] = {PD_NODE_PREFILL, PD_NODE_DECODE};
    char msg[512];
    for (int k = 0; k < 2; k++) {
        pd_node_config c = o->base;
        c.role = roles[k];
        c.port = k == 0 ? o->prefill_port : o->decode_port;
        c.loopback = lb;
        c.transfer_backend = "loopback";
        if (pd_node_create(&nodes[k], &c, msg, sizeof(msg)) != PD_OK ||
            pd_node_start(nodes[k], msg, sizeof(msg)) != PD_OK) {
            cli_log(CLI_LOG_ERROR, "pdserve run: %s node: %s", pd_node_role_name(roles[k]), msg);
            return 1;
        }
    }
    return 0;
}

static void print_endpoints(const run_opts *o, pd_node *const nodes[2], const pd_run_router *rt) {
    const char *host = o->base.host;
    cli_log(CLI_LOG_INFO,
            "pdserve run: prefill node http://%s:%u, decode node http://%s:%u "
            "(loopback transport)",
            host, pd_node_http_port(nodes[0]), host, pd_node_http_port(nodes[1]));
    if (o->router) {
        const unsigned port = cli_run_router_port(rt);
        const char *auth = o->base.api_key ? " -H 'Authorization: Bearer KEY'" : "";
        cli_log(CLI_LOG_INFO,
                "pdserve run: send requests to http://%s:%u\n\n"
                "  curl -s%s http://%s:%u/generate -d '{\"text\": \"Hello\", "
                "\"sampling_params\": {\"max_new_tokens\": 16}}'\n"
                "  curl -s%s http://%s:%u/abort_request -d '{\"rid\": \"my-request\"}'\n",
                host, port, auth, host, port, auth, host, port);
    }
    cli_log(CLI_LOG_INFO, "Ctrl-C stops it.");
}

int cli_cmd_run(int argc, char **argv) {
    run_opts o;
    int rc = parse_args(argc, argv, &o);
    if (rc >= 0) return rc;
    cli_catch_stop_signals(); /* before anything answers (cmd_node.c) */
    cli_node_log_config("run", &o.base);
    pd_loopback_mt *lb;
    const uint32_t rooms_max = o.base.max_queued_requests * 4 + 64;
    if (pd_loopback_mt_create(&lb, o.base.page_size, rooms_max) != PD_OK ||
        pd_loopback_mt_start(lb) != PD_OK) {
        fprintf(stderr, "pdserve run: could not start the loopback transport\n");
        return 1;
    }
    pd_node *nodes[2] = {NULL, NULL};
    int status = start_nodes(&o, lb, nodes);
    pd_run_router *rt = NULL;
    if (!status && o.router) {
        char msg[512];
        if (cli_run_router_start(&rt, o.base.host, o.base.port, pd_node_http_port(nodes[0]),
                                 pd_node_http_port(nodes[1]), pd_node_bootstrap_port(nodes[0]),
                                 o.base.api_key, msg, sizeof(msg)) != PD_OK) {
            cli_log(CLI_LOG_ERROR, "pdserve run: router: %s", msg);
            status = 1;
        }
    }
    if (!status) {
        print_endpoints(&o, nodes, rt);
        cli_wait_for_signal();
        cli_log(CLI_LOG_INFO, "pdserve run: shutting down");
    }
    cli_run_router_stop(rt);
    for (int k = 1; k >= 0; k--) pd_node_destroy(nodes[k]);
    pd_loopback_mt_destroy(lb);
    return status;
}
