/*
 * pdserve prefill | decode | serve — one server process each.
 *
 * All three share the option parser below; `pdserve run` (cmd_run.c) starts
 * a prefill node, a decode node and a router in one process.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "args.h"
#include "commands.h"
#include "node_options.h"

static const struct {
    const char *flag, *arg, *help;
} options[] = {
    {"--host", "ADDR", "HTTP listen address (default 127.0.0.1)"},
    {"--port", "N", "HTTP port (default 30000 serve, 30001 prefill, 30002 decode; 0 = any free)"},
    {"--model", "DIR",
     "model directory (config.json + model.safetensors, see `pdserve model init`)"},
    {"--model-config", "tiny|small", "built-in model when --model is not given (default tiny)"},
    {"--layers", "PATTERN", "layer pattern of the built-in model, M = Mamba2, A = attention"},
    {"--seed", "N", "seed of the built-in model's dummy weights (default 0)"},
    {"--threads", "N", "executor threads (default 1)"},
    {"--page-size", "N", "tokens per KV page (default 16)"},
    {"--max-total-tokens", "N", "KV pool size in tokens (default 65536)"},
    {"--max-running-requests", "N", "requests holding memory at once (default 64)"},
    {"--max-queued-requests", "N", "live requests in all, queued included (default 1024)"},
    {"--chunked-prefill-size", "N", "prompt tokens per forward (default 512)"},
    {"--max-prompt-tokens", "N", "longest prompt accepted (default 8192)"},
    {"--max-new-tokens", "N", "largest max_new_tokens accepted (default 4096)"},
    {"--host-cache-tokens", "N",
     "host-memory tier of the prefix cache, in tokens (default 0: off)"},
    {"--optimistic-attempts", "N",
     "prefill: start computing before the bootstrap completes (default 0)"},
    {"--disable-overlap", "", "prefill: wait for each forward's result before launching the next"},
    {"--disable-prefix-cache", "", "never reuse KV across requests"},
    {"--strict", "", "keep the per-unit owner map and check ownership after every step"},
    {"--bootstrap-timeout-ms", "N", "fail a request whose bootstrap takes longer (default 30000)"},
    {"--transfer-timeout-ms", "N", "fail a request whose transfer takes longer (default 60000)"},
    {"--transfer-backend", "loopback|ucx",
     "prefill/decode transport (default ucx; loopback only inside `run`)"},
    {"--disaggregation-bootstrap-port", "N", "prefill: bootstrap channel port (default 8998)"},
    {"--bootstrap-host", "ADDR", "prefill: bootstrap listen address (default: --host)"},
    {"--insecure-bootstrap", "",
     "prefill: let the bootstrap channel listen beyond loopback without a token"},
    {"--bootstrap-token", "SECRET", "shared secret decode peers must present (default none)"},
    {"--prefill-peers", "H:P,...",
     "decode: the only prefill bootstrap addresses a request may name (403 otherwise)"},
    {"--enable-metrics", "", "serve GET /metrics (Prometheus text)"},
    {"--incremental-streaming-output", "",
     "/generate streams send only the new text and ids (default: the whole output so far)"},
    {"--max-body-bytes", "N", "largest request body (default 1048576)"},
    {"--http-header-timeout-ms", "N", "408 when a request's headers take longer (default 10000)"},
    {"--http-body-timeout-ms", "N", "408 when a request's body takes longer (default 30000)"},
    {"--http-idle-timeout-ms", "N", "close a keep-alive connection idle this long (default 60000)"},
    {"--http-write-timeout-ms", "N",
     "close a connection that reads nothing of its answer this long (default 30000)"},
    {"--served-model-name", "NAME", "\"model\" in /v1/completions answers (default pdserve-tiny)"},
};

void cli_node_usage(FILE *to, const char *cmd, const char *what) {
    fprintf(to, "usage: pdserve %s [options]\n\n%s\n\noptions:\n", cmd, what);
    for (size_t i = 0; i < sizeof(options) / sizeof(options[0]); i++) {
        char left[64];
        snprintf(left, sizeof(left), "%s %s", options[i].flag, options[i].arg);
        fprintf(to, "  %-38s %s\n", left, options[i].help);
    }
    fprintf(to, "  %-38s %s\n", "--help", "this text");
    fprintf(to, "  %-38s %s\n", "--version", "the version, then exit");
    fprintf(to,
            "\nEvery option also takes the form --opt=VALUE. SGLang's spellings are accepted:\n"
            "  --model-path (--model), --disable-radix-cache (--disable-prefix-cache),\n"
            "  --disable-overlap-schedule (--disable-overlap), --random-seed (--seed),\n"
            "  --disaggregation-transfer-backend (--transfer-backend).\n");
}

/* A failed strict-mode ownership check: the node hands its report here. */
static void print_violation(void *ctx, pd_node_role role, const char *report) {
    (void)ctx;
    fprintf(stderr, "pdserve %s: ownership check failed:\n%s\n", pd_node_role_name(role), report);
}

static bool parse_num(const char *v, uint64_t max, uint64_t *out) {
    return cli_u64(v, 0, max, out);
}

/* The HTTP deadlines (--http-*-timeout-ms), 1 ms to a day. */
static bool set_http_timeout(pd_node_config *c, const char *a, const char *v, bool *ok_out) {
    uint32_t *to = !strcmp(a, "--http-header-timeout-ms") ? &c->http_header_timeout_ms
        : !strcmp(a, "--http-body-timeout-ms")            ? &c->http_body_timeout_ms
        : !strcmp(a, "--http-idle-timeout-ms")            ? &c->http_idle_timeout_ms
        : !strcmp(a, "--http-write-timeout-ms")           ? &c->http_write_timeout_ms
                                                          : NULL;
    if (!to) return false;
    uint64_t x = 0;
    *ok_out = v && parse_num(v, 86400000, &x) && x > 0;
    if (*ok_out) *to = (uint32_t)x;
    return true;
}

/* Sets option a to its value v (NULL when argv ends there). Returns false
 * when a is not a node option; otherwise *ok_out says whether v was valid. */
static bool set_option(pd_node_config *c, const char *a, const char *v, bool *ok_out) {
    uint64_t x = 0;
    bool ok = v != NULL;
    if (!strcmp(a, "--host")) c->host = v;
    else if (!strcmp(a, "--port")) ok = ok && parse_num(v, 65535, &x), c->port = (uint16_t)x;
    else if (!strcmp(a, "--model")) c->model_dir = v;
    else if (!strcmp(a, "--model-config")) c->model_preset = v;
    else if (!strcmp(a, "--layers")) c->layers = v;
    else if (!strcmp(a, "--seed")) ok = ok && parse_num(v, UINT64_MAX, &x), c->seed = x;
    else if (!strcmp(a, "--threads"))
        ok = ok && parse_num(v, 64, &x) && x > 0, c->threads = (uint32_t)x;
    else if (!strcmp(a, "--page-size"))
        ok = ok && parse_num(v, 4096, &x) && x > 0, c->page_size = (uint32_t)x;
    else if (!strcmp(a, "--max-total-tokens"))
        ok = ok && parse_num(v, 1u << 30, &x) && x > 0, c->max_total_tokens = (uint32_t)x;
    else if (!strcmp(a, "--max-running-requests"))
        ok = ok && parse_num(v, 65536, &x) && x > 0, c->max_running_requests = (uint32_t)x;
    else if (!strcmp(a, "--max-queued-requests"))
        ok = ok && parse_num(v, 1u << 20, &x) && x > 0, c->max_queued_requests = (uint32_t)x;
    else if (!strcmp(a, "--chunked-prefill-size"))
        ok = ok && parse_num(v, 1u << 20, &x) && x > 0, c->chunked_prefill_size = (uint32_t)x;
    else if (!strcmp(a, "--max-prompt-tokens"))
        ok = ok && parse_num(v, 1u << 24, &x) && x > 0, c->max_prompt_tokens = (uint32_t)x;
    else if (!strcmp(a, "--max-new-tokens"))
        ok = ok && parse_num(v, 1u << 24, &x) && x > 0, c->max_new_tokens_limit = (uint32_t)x;
    else if (!strcmp(a, "--host-cache-tokens"))
        ok = ok && parse_num(v, 1u << 30, &x), c->host_cache_tokens = (uint32_t)x;
    else if (!strcmp(a, "--optimistic-attempts"))
        ok = ok && parse_num(v, 64, &x), c->optimistic_attempts = (uint32_t)x;
    else if (!strcmp(a, "--bootstrap-timeout-ms"))
        ok = ok && parse_num(v, 86400000, &x), c->bootstrap_timeout_ms = x;
    else if (!strcmp(a, "--transfer-timeout-ms"))
        ok = ok && parse_num(v, 86400000, &x), c->transfer_timeout_ms = x;
    else if (!strcmp(a, "--transfer-backend")) c->transfer_backend = v;
    else if (!strcmp(a, "--disaggregation-bootstrap-port"))
        ok = ok && parse_num(v, 65535, &x), c->bootstrap_port = (uint16_t)x;
    else if (!strcmp(a, "--bootstrap-host")) c->bootstrap_host = v;
    else if (!strcmp(a, "--bootstrap-token")) c->bootstrap_token = v;
    else if (!strcmp(a, "--prefill-peers")) c->prefill_peers = v;
    else if (!strcmp(a, "--max-body-bytes"))
        ok = ok && parse_num(v, 1u << 30, &x) && x > 0, c->max_body_bytes = (size_t)x;
    else if (!strcmp(a, "--served-model-name")) c->served_model_name = v;
    else if (!strncmp(a, "--http-", 7)) return set_http_timeout(c, a, v, ok_out);
    else return false;
    *ok_out = ok;
    return true;
}

/* SGLang's spellings of the same options (issue 11): accepted as aliases. */
static const char *const aliases[][2] = {
    {"--model-path", "--model"},
    {"--disable-radix-cache", "--disable-prefix-cache"},
    {"--disable-overlap-schedule", "--disable-overlap"},
    {"--random-seed", "--seed"},
    {"--disaggregation-transfer-backend", "--transfer-backend"},
};

static const char *canonical(const char *name) {
    for (size_t i = 0; i < PD_ARRAY_LEN(aliases); i++)
        if (!strcmp(name, aliases[i][0])) return aliases[i][1];
    return name;
}

static bool set_flag(pd_node_config *c, const char *a) {
    if (!strcmp(a, "--disable-overlap")) c->disable_overlap = true;
    else if (!strcmp(a, "--disable-prefix-cache")) c->disable_prefix_cache = true;
    else if (!strcmp(a, "--strict")) c->strict = true, c->on_violation = print_violation;
    else if (!strcmp(a, "--insecure-bootstrap")) c->insecure_bootstrap = true;
    else if (!strcmp(a, "--enable-metrics")) c->enable_metrics = true;
    else if (!strcmp(a, "--incremental-streaming-output")) c->incremental_streaming_output = true;
    else return false;
    return true;
}

/* One option at argv[*i] ("--opt VALUE" or "--opt=VALUE"): 0 when taken, 2
 * on a bad value, -1 when it is not a node option. */
static int take_option(int argc, char **argv, int *i, pd_node_config *c) {
    char name[64];
    const char *arg = argv[*i], *eq = !strncmp(arg, "--", 2) ? strchr(arg, '=') : NULL;
    const char *v = eq ? eq + 1 : *i + 1 < argc ? argv[*i + 1] : NULL;
    snprintf(name, sizeof name, "%.*s", eq ? (int)(eq - arg) : (int)strlen(arg), arg);
    const char *a = canonical(name);
    if (!eq && set_flag(c, a)) return 0;
    bool ok;
    if (!set_option(c, a, v, &ok)) return -1;
    if (!ok) {
        fprintf(stderr, "pdserve: option %s needs a valid value%s%s\n", name, v ? ", got " : "",
                v ? v : "");
        return 2;
    }
    if (!eq) (*i)++;
    return 0;
}

int cli_node_parse(int argc, char **argv, pd_node_config *c, int *consumed_until) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return 1;
        int rc = take_option(argc, argv, &i, c);
        if (rc > 0) return rc;
        if (rc == 0) continue;
        if (consumed_until) {
            *consumed_until = i;
            return 0;
        }
        fprintf(stderr, "pdserve %s: unknown option '%s' (see pdserve %s --help)\n", argv[0],
                argv[i], argv[0]);
        return 2;
    }
    if (consumed_until) *consumed_until = argc;
    return 0;
}

static volatile sig_atomic_t stop_flag;

static void on_signal(int sig) {
    (void)sig;
    stop_flag = 1;
}

void cli_wait_for_signal(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
    while (!stop_flag) {
        struct timespec ts = {0, 100 * 1000000L};
        nanosleep(&ts, NULL);
    }
}

static int run_node(int argc, char **argv, pd_node_role role, uint16_t default_port,
                    const char *what) {
    pd_node_config c;
    pd_node_config_default(&c, role);
    c.port = default_port;
    c.transfer_backend = "ucx";
    int rc = cli_node_parse(argc, argv, &c, NULL);
    if (rc == 1) {
        cli_node_usage(stdout, argv[0], what);
        return 0;
    }
    if (rc) return rc;
    signal(SIGPIPE, SIG_IGN);
    char msg[512];
    pd_node *n;
    if (pd_node_create(&n, &c, msg, sizeof(msg)) != PD_OK ||
        pd_node_start(n, msg, sizeof(msg)) != PD_OK) {
        fprintf(stderr, "pdserve %s: %s\n", argv[0], msg);
        return 1;
    }
    printf("pdserve %s listening on http://%s:%u", argv[0], c.host, pd_node_http_port(n));
    if (role == PD_NODE_PREFILL) printf(" (bootstrap port %u)", pd_node_bootstrap_port(n));
    printf("\n");
    fflush(stdout);
    cli_wait_for_signal();
    printf("pdserve %s: shutting down\n", argv[0]);
    pd_node_destroy(n);
    return 0;
}

int cli_cmd_serve(int argc, char **argv) {
    const char *what =
        "A colocated server: prefill and decode in one engine, no transfer. Serves the HTTP\n"
        "API of docs/http-api.md: POST /generate, POST /v1/completions, POST /abort_request,\n"
        "GET /health, GET /server_info, GET /metrics.";
    return run_node(argc, argv, PD_NODE_SERVE, 30000, what);
}

int cli_cmd_prefill(int argc, char **argv) {
    const char *what =
        "A prefill node: computes prompts and hands their KV cache and Mamba state to the\n"
        "decode node named by each request's bootstrap fields (set by `pdserve router`).\n"
        "Decode nodes connect to its bootstrap port.";
    return run_node(argc, argv, PD_NODE_PREFILL, 30001, what);
}

int cli_cmd_decode(int argc, char **argv) {
    const char *what =
        "A decode node: preallocates memory for each request, receives its KV cache and\n"
        "Mamba state from the prefill node at bootstrap_host:bootstrap_port, and generates.";
    return run_node(argc, argv, PD_NODE_DECODE, 30002, what);
}
