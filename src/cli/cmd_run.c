/*
 * pdserve run — the embedded default: a prefill node, a decode node and a
 * router in one process, the two nodes joined by the in-process loopback
 * transport, serving the tiny hybrid model. What `make run` starts.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "node_options.h"
#include "pdserve/loopback_mt.h"
#include "run_router.h"

static const char *what =
    "The embedded default: a prefill node, a decode node and a router in one process,\n"
    "the nodes joined by the in-process loopback transport. Clients talk to the router\n"
    "(--port, default 30000) exactly as to `pdserve serve`. The node options below apply\n"
    "to both nodes; in addition:\n"
    "  --prefill-port N        the prefill node's HTTP port (default 0: any free port)\n"
    "  --decode-port N         the decode node's HTTP port (default 0: any free port)\n"
    "  --no-router             start only the two nodes (clients must add the bootstrap fields)";

int cli_cmd_run(int argc, char **argv) {
    pd_node_config base;
    pd_node_config_default(&base, PD_NODE_PREFILL);
    base.port = 30000;
    uint16_t pport = 0, dport = 0;
    bool router = true;
    /* Our own flags first, the node flags for the rest. */
    char **rest = calloc((size_t)argc + 1, sizeof(char *));
    if (!rest) {
        fprintf(stderr, "pdserve run: out of memory\n");
        return 1;
    }
    int nrest = 0;
    rest[nrest++] = argv[0];
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--no-router")) {
            router = false;
        } else if ((!strcmp(argv[i], "--prefill-port") || !strcmp(argv[i], "--decode-port")) && i + 1 < argc) {
            char *end;
            unsigned long p = strtoul(argv[i + 1], &end, 10);
            if (*end || p > 65535) {
                fprintf(stderr, "pdserve run: %s needs a port number, got %s\n", argv[i], argv[i + 1]);
                free(rest);
                return 2;
            }
            if (!strcmp(argv[i], "--prefill-port")) pport = (uint16_t)p;
            else dport = (uint16_t)p;
            i++;
        } else {
            rest[nrest++] = argv[i];
        }
    }
    int rc = cli_node_parse(nrest, rest, &base, NULL);
    free(rest);
    if (rc == 1) {
        cli_node_usage(stdout, "run", what);
        return 0;
    }
    if (rc) return rc;
    if (strcmp(base.transfer_backend, "loopback") != 0) {
        fprintf(stderr, "pdserve run: the nodes share one process; only --transfer-backend loopback applies\n");
        return 2;
    }
    signal(SIGPIPE, SIG_IGN);
    pd_loopback_mt *lb;
    if (pd_loopback_mt_create(&lb, base.page_size, base.max_queued_requests * 4 + 64) != PD_OK ||
        pd_loopback_mt_start(lb) != PD_OK) {
        fprintf(stderr, "pdserve run: could not start the loopback transport\n");
        return 1;
    }
    char msg[512];
    pd_node *nodes[2] = {NULL, NULL};
    const pd_node_role roles[2] = {PD_NODE_PREFILL, PD_NODE_DECODE};
    int status = 0;
    for (int k = 0; k < 2 && !status; k++) {
        pd_node_config c = base;
        c.role = roles[k];
        c.port = k == 0 ? pport : dport;
        c.loopback = lb;
        c.transfer_backend = "loopback";
        if (pd_node_create(&nodes[k], &c, msg, sizeof(msg)) != PD_OK ||
            pd_node_start(nodes[k], msg, sizeof(msg)) != PD_OK) {
            fprintf(stderr, "pdserve run: %s node: %s\n", pd_node_role_name(roles[k]), msg);
            status = 1;
        }
    }
    pd_run_router *rt = NULL;
    if (!status && router) {
        if (cli_run_router_start(&rt, base.host, base.port, pd_node_http_port(nodes[0]),
                                pd_node_http_port(nodes[1]), pd_node_bootstrap_port(nodes[0]), msg,
                                sizeof(msg)) != PD_OK) {
            fprintf(stderr, "pdserve run: router: %s\n", msg);
            status = 1;
        }
    }
    if (!status) {
        printf("pdserve run: prefill node http://%s:%u, decode node http://%s:%u (loopback transport)\n",
               base.host, pd_node_http_port(nodes[0]), base.host, pd_node_http_port(nodes[1]));
        if (router) {
            printf("pdserve run: send requests to http://%s:%u\n\n", base.host, cli_run_router_port(rt));
            printf("  curl -s http://%s:%u/generate -d '{\"text\": \"Hello\", \"sampling_params\": "
                   "{\"max_new_tokens\": 16}}'\n",
                   base.host, cli_run_router_port(rt));
            printf("  curl -s http://%s:%u/abort_request -d '{\"rid\": \"my-request\"}'\n\n", base.host,
                   cli_run_router_port(rt));
        }
        printf("Ctrl-C stops it.\n");
        fflush(stdout);
        cli_wait_for_signal();
        printf("pdserve run: shutting down\n");
    }
    cli_run_router_stop(rt);
    for (int k = 1; k >= 0; k--) pd_node_destroy(nodes[k]);
    pd_loopback_mt_destroy(lb);
    return status;
}
