/*
 * pdserve router — the HTTP router of a disaggregated deployment.
 *
 * Parses the options into a pd_router_config, starts the router
 * (src/router), prints one line saying where it listens and waits for
 * SIGINT or SIGTERM, then stops it: requests in flight get their workers
 * aborted and a 503. The signals are blocked before any thread starts and
 * taken with sigwait, so no handler runs in a library thread.
 *
 * Exit codes: 0 stopped by a signal, 1 runtime failure (cannot listen),
 * 2 usage error.
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "commands.h"
#include "node_options.h"
#include "pdserve/http.h"
#include "pdserve/router.h"

static void usage(FILE *to) {
    fprintf(to,
            "usage: pdserve router --prefill URL [--prefill URL ...] "
            "--decode URL [--decode URL ...]\n"
            "                      [options]\n"
            "\n"
            "An HTTP server with the client API of a serve node (docs/http-api.md). Each\n"
            "POST /generate or /v1/completions goes to one healthy prefill node and one healthy\n"
            "decode node at once, with a fresh random bootstrap room; the client gets the decode\n"
            "node's answer (streamed when it asked for \"stream\": true). See docs/router.md.\n"
            "\n"
            "workers:\n"
            "  --prefill URL[@PORT]        a prefill node, http://host:port; the optional @PORT\n"
            "                              is its bootstrap port (default: --bootstrap-port);\n"
            "                              sgl-router's form, --prefill URL PORT, too.\n"
            "                              Repeat for more nodes (at most %d per role)\n"
            "  --decode URL                a decode node, http://host:port; repeatable\n"
            "  --bootstrap-port N          bootstrap port of prefill nodes given without one\n"
            "                              (default 8998). The bootstrap host is the URL's host\n"
            "  --pd-disaggregation         sgl-router's PD mode switch; this router is always\n"
            "                              in it, so it changes nothing\n"
            "  --policy NAME               round_robin (default): each role's healthy nodes in\n"
            "                              turn; least_load: the healthy node with the fewest\n"
            "                              requests in flight from this router; random; or\n"
            "                              power_of_two: the less loaded of two drawn at random\n"
            "\n"
            "server:\n"
            "  --host H                    listen address (default 127.0.0.1)\n"
            "  --port P                    listen port (default 30000; 0 = any free port)\n"
            "  --max-body-bytes N          larger request bodies get 413 (default 1048576)\n"
            "  --max-connections N         client connections = requests in flight (default 1024)\n"
            "                              needs 1 open file each + 4 stream feeds per decode\n"
            "                              node + 64 under the hard RLIMIT_NOFILE\n"
            "  --max-connections-per-ip N  of them from one client address (default 256)\n"
            "  --client-timeout-s N        close a client connection silent this long\n"
            "                              (default 60)\n"
            "  --api-key KEY               clients must send 'Authorization: Bearer KEY' (else\n"
            "                              401; /health* and /metrics* exempt), and the router\n"
            "                              sends it to the workers (start them with the same)\n"
            "  --log-level LEVEL           debug, info (default), warning or error\n"
            "\n"
            "health and timeouts:\n"
            "  --health-interval-ms N      GET /health of every worker this often (default 1000);\n"
            "                              2 failures in a row take a worker out, 1 success\n"
            "                              brings it back\n"
            "  --health-timeout-ms N       one probe's time limit (default 1000)\n"
            "  --request-timeout-s N       a request's time limit, both halves, streaming\n"
            "                              included; then 504 and both halves aborted "
            "(default 600)\n"
            "  --abort-grace-ms N          after POST /abort_request, how long the decode node\n"
            "                              gets to end the answer itself (default 1000)\n"
            "  --help                      this text\n"
            "  --version                   the version, then exit\n"
            "\n"
            "sgl-router's spellings of the same options:\n"
            "  --request-timeout-secs N    = --request-timeout-s\n"
            "  --max-payload-size N        = --max-body-bytes\n"
            "\n"
            "Examples:\n"
            "  pdserve router --prefill http://10.0.0.5:30001@8998 --decode http://10.0.0.6:30002\n"
            "  pdserve router --pd-disaggregation --prefill http://10.0.0.5:30001 8998 \\\n"
            "                 --decode http://10.0.0.6:30002\n"
            "\n"
            "Every option also takes the form --opt=VALUE. Stops on SIGINT/SIGTERM.\n"
            "Exit codes: 0 stopped, 1 runtime error, 2 usage error.\n",
            PD_ROUTER_WORKERS_MAX);
}

static int usage_error(const char *what, const char *detail) {
    fprintf(stderr, "pdserve router: %s%s (see pdserve router --help)\n", what, detail);
    return 2;
}

/* The client-side limits; false if name is none of them. */
static bool limit_option(const char *name, const char *val, pd_router_config *cfg, bool *ok) {
    uint64_t v = 0;
    if (!strcmp(name, "--max-body-bytes")) {
        *ok = cli_u64(val, 1, (uint64_t)1 << 32, &v);
        cfg->max_body_bytes = (size_t)v;
    } else if (!strcmp(name, "--max-connections")) {
        *ok = cli_u64(val, 1, 65536, &v);
        cfg->connections_max = (uint32_t)v;
    } else if (!strcmp(name, "--max-connections-per-ip")) {
        *ok = cli_u64(val, 1, 65536, &v);
        cfg->connections_per_ip = (uint32_t)v;
    } else if (!strcmp(name, "--client-timeout-s")) {
        *ok = cli_u64(val, 1, 86400, &v);
        cfg->client_timeout_s = (uint32_t)v;
    } else if (!strcmp(name, "--api-key")) {
        *ok = pd_http_api_key_valid(val);
        cfg->api_key = val;
    } else if (!strcmp(name, "--log-level")) {
        *ok = cli_log_level_set(val);
    } else {
        return false;
    }
    return true;
}

/* The health and time limits; false if name is none of them. */
static bool time_option(const char *name, const char *val, pd_router_config *cfg, bool *ok) {
    uint64_t v = 0;
    if (!strcmp(name, "--health-interval-ms")) {
        *ok = cli_u64(val, 1, 3600000, &v);
        cfg->health_interval_ms = (uint32_t)v;
    } else if (!strcmp(name, "--health-timeout-ms")) {
        *ok = cli_u64(val, 1, 3600000, &v);
        cfg->health_timeout_ms = (uint32_t)v;
    } else if (!strcmp(name, "--request-timeout-s")) {
        *ok = cli_u64(val, 1, 86400, &v);
        cfg->request_timeout_ms = (uint32_t)(v * 1000);
    } else if (!strcmp(name, "--abort-grace-ms")) {
        *ok = cli_u64(val, 0, 3600000, &v);
        cfg->abort_grace_ms = (uint32_t)v;
    } else {
        return limit_option(name, val, cfg, ok);
    }
    return true;
}

/* A prefill URL given sgl-router's way, its bootstrap port as the next
 * argument, becomes URL@PORT here; the router keeps pointers. */
static char prefill_specs[PD_ROUTER_WORKERS_MAX][PD_ROUTER_URL_MAX + 8];

/* --prefill URL [PORT] and --decode URL: 0 taken, 2 refused. */
static int worker_option(int argc, char **argv, int *i, const char *name, const char *val,
                         pd_router_config *cfg) {
    const bool prefill = !strcmp(name, "--prefill");
    size_t *n = prefill ? &cfg->prefill_count : &cfg->decode_count;
    if (*n == PD_ROUTER_WORKERS_MAX)
        return usage_error(prefill ? "too many --prefill nodes" : "too many --decode nodes", "");
    uint64_t port = 0;
    if (prefill && *i + 1 < argc && cli_u64(argv[*i + 1], 1, 65535, &port)) {
        if (strchr(val, '@')) return usage_error("two bootstrap ports for ", val);
        snprintf(prefill_specs[*n], sizeof prefill_specs[*n], "%s@%u", val, (unsigned)port);
        val = prefill_specs[*n];
        (*i)++;
    }
    (prefill ? cfg->prefill : cfg->decode)[(*n)++] = val;
    return 0;
}

/* sgl-router's spellings of the same options. */
static const char *canonical(const char *name) {
    if (!strcmp(name, "--request-timeout-secs")) return "--request-timeout-s";
    if (!strcmp(name, "--max-payload-size")) return "--max-body-bytes";
    return name;
}

/* One option at argv[*i]: 0 taken, 2 refused (message printed). */
static int take_option(int argc, char **argv, int *i, pd_router_config *cfg) {
    if (!strcmp(argv[*i], "--pd-disaggregation")) return 0; /* always this router's mode */
    char typed[64];
    const char *val = cli_option(argc, argv, i, typed, sizeof typed);
    const char *name = canonical(typed);
    if (strncmp(name, "--", 2)) return usage_error("unexpected argument ", name);
    if (!val) return usage_error(typed, " needs a value");
    uint64_t v = 0;
    bool ok = true;
    if (!strcmp(name, "--prefill") || !strcmp(name, "--decode"))
        return worker_option(argc, argv, i, name, val, cfg);
    if (!strcmp(name, "--host")) {
        cfg->host = val;
    } else if (!strcmp(name, "--port")) {
        ok = cli_u64(val, 0, 65535, &v);
        cfg->port = (uint16_t)v;
    } else if (!strcmp(name, "--bootstrap-port")) {
        ok = cli_u64(val, 1, 65535, &v);
        cfg->bootstrap_port = (uint16_t)v;
    } else if (!strcmp(name, "--policy")) {
        ok = pd_router_policy_parse(val, &cfg->policy) == PD_OK;
    } else if (!time_option(name, val, cfg, &ok)) {
        return cli_unknown_option_usage("router", typed, usage,
                                        cli_node_option_known(typed)
                                            ? "the node commands (serve, prefill, decode, run)"
                                            : NULL);
    }
    if (ok) return 0;
    if (!strcmp(name, "--api-key"))
        return usage_error("--api-key: 1 to 255 bytes of visible ASCII", "");
    if (!strcmp(name, "--log-level"))
        fprintf(stderr, "pdserve router: --log-level: bad value '%s' (%s)\n", val, CLI_LOG_LEVELS);
    else
        fprintf(stderr, "pdserve router: %s: bad value '%s' (see pdserve router --help)\n", typed,
                val);
    return 2;
}

static int parse_args(int argc, char **argv, pd_router_config *cfg, bool *help) {
    pd_router_config_default(cfg);
    *help = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            *help = true;
            return 0;
        }
        int rc = take_option(argc, argv, &i, cfg);
        if (rc) return rc;
    }
    if (cfg->prefill_count == 0) return usage_error("at least one --prefill URL is required", "");
    if (cfg->decode_count == 0) return usage_error("at least one --decode URL is required", "");
    return 0;
}

/* The router's log: clients that hung up, one JSON line each. */
static void print_hang_up(void *ctx, const char *line) {
    (void)ctx;
    /* Info, as SGLang logs requests: on stderr, hidden by --log-level warning. */
    if (cli_log_level_get() <= CLI_LOG_INFO) fprintf(stderr, "%s\n", line);
}

int cli_cmd_router(int argc, char **argv) {
    pd_router_config cfg;
    bool help;
    int rc = parse_args(argc, argv, &cfg, &help);
    if (rc) return rc;
    cfg.on_log = print_hang_up;
    if (help) {
        usage(stdout);
        return 0;
    }
    char msg[256];
    /* Worker URLs are checked here so that a typo is a usage error. */
    for (size_t i = 0; i < cfg.prefill_count + cfg.decode_count; i++) {
        bool prefill = i < cfg.prefill_count;
        pd_router_url u;
        const char *spec = prefill ? cfg.prefill[i] : cfg.decode[i - cfg.prefill_count];
        if (pd_router_url_parse(spec, prefill, &u, msg, sizeof msg) != PD_OK)
            return usage_error(msg, "");
    }
    /* A shell starts background jobs with SIGINT ignored; an ignored signal
     * is discarded, never seen by sigwait. The router wants both. */
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    sigset_t stop_signals;
    sigemptyset(&stop_signals);
    sigaddset(&stop_signals, SIGINT);
    sigaddset(&stop_signals, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop_signals, NULL);
    signal(SIGPIPE, SIG_IGN);

    pd_router *r = NULL;
    pd_err err = pd_router_create(&r, &cfg, msg, sizeof msg);
    if (err) {
        fprintf(stderr, "pdserve router: %s\n", msg);
        return err == PD_ERR_INVALID ? 2 : 1;
    }
    err = pd_router_start(r, msg, sizeof msg);
    if (err) {
        fprintf(stderr, "pdserve router: %s\n", msg);
        pd_router_destroy(r);
        return 1;
    }
    cli_log(CLI_LOG_DEBUG,
            "pdserve router: health every %u ms, request timeout %u ms, body up to %zu bytes, "
            "%u connections (%u per client), api key %s",
            cfg.health_interval_ms, cfg.request_timeout_ms, cfg.max_body_bytes, cfg.connections_max,
            cfg.connections_per_ip, cfg.api_key ? "set" : "none");
    cli_log(CLI_LOG_INFO,
            "pdserve router listening on http://%s:%u (%zu prefill, %zu decode, policy %s)",
            cfg.host, (unsigned)pd_router_port(r), cfg.prefill_count, cfg.decode_count,
            pd_router_policy_name(cfg.policy));
    int sig = 0;
    sigwait(&stop_signals, &sig);
    cli_log(CLI_LOG_INFO, "pdserve router: signal %d, stopping", sig);
    pd_router_destroy(r);
    return 0;
}
