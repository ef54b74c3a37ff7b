/*
 * pdserve prefill | decode | serve — one server process each.
 *
 * All three share the option parser below; `pdserve run` (cmd_run.c) starts
 * a prefill node, a decode node and a router in one process.
 */
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "args.h"
#include "commands.h"
#include "node_options.h"
#include "pdserve/http.h"

/* Every node option, in --help's order. Options in `restricted` below apply
 * to some commands only; --help lists an option only where it applies. */
static const struct {
    const char *flag, *arg, *help;
} options[] = {
    {"--disaggregation-mode", "prefill|decode|null",
     "the role, SGLang's way: serve runs as pdserve prefill or decode (null: colocated)"},
    {"--host", "ADDR", "HTTP listen address (default 127.0.0.1)"},
    {"--port", "N", "HTTP port (default 30000 serve, 30001 prefill, 30002 decode; 0 = any free)"},
    {"--model", "DIR",
     "model directory (config.json + model.safetensors, see `pdserve model init`)"},
    {"--chat-template", "FILE",
     "the chat template (Jinja) for /v1/chat/completions instead of the model directory's "
     "tokenizer_config.json chat_template"},
    {"--model-config", "NAME",
     "built-in model when --model is not given: tiny (default), small, llama, qwen3, granite, "
     "qwen3-0.6b or granite-4.0-h-350m"},
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
    {"--context-length", "N",
     "longest prompt + max_new_tokens of a request (default: only the two limits above)"},
    {"--host-cache-tokens", "N",
     "host-memory tier of the prefix cache, in tokens (default 0: off)"},
    {"--optimistic-attempts", "N",
     "prefill: start computing before the bootstrap completes (default 0)"},
    {"--disable-overlap", "", "wait for each prompt forward's result before launching the next"},
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
    {"--transfer-copy-threads", "N",
     "prefill: threads copying a hand-off's puts of 4 MiB or more into a decode node's shared "
     "memory on this host (1-8, default 2; 1: UCX's own one-thread copy)"},
    {"--prefill-peers", "H:P,...",
     "decode: the only prefill bootstrap addresses a request may name (403 otherwise)"},
    {"--enable-metrics", "", "serve GET /metrics (Prometheus text)"},
    {"--log-requests", "", "one JSON line per request on stderr as it ends (hang-ups always)"},
    {"--incremental-streaming-output", "",
     "/generate streams send only the new text and ids (default: the whole output so far)"},
    {"--max-body-bytes", "N", "largest request body (default 1048576)"},
    {"--http-header-timeout-ms", "N", "408 when a request's headers take longer (default 10000)"},
    {"--http-body-timeout-ms", "N", "408 when a request's body takes longer (default 30000)"},
    {"--http-idle-timeout-ms", "N", "close a keep-alive connection idle this long (default 60000)"},
    {"--http-write-timeout-ms", "N",
     "close a connection that reads nothing of its answer this long (default 30000)"},
    {"--served-model-name", "NAME", "\"model\" in /v1/completions answers (default pdserve-tiny)"},
    {"--api-key", "KEY",
     "every request but /health* and /metrics* needs 'Authorization: Bearer KEY' (else 401)"},
    {"--log-level", "LEVEL", "debug, info (default), warning or error: what is printed"},
};

/* The node commands as bits, for `restricted`. */
#define ON(cmd) (1u << (cmd))
#define ON_PD (ON(CLI_NODE_PREFILL) | ON(CLI_NODE_DECODE))

/* Options that apply to some node commands only. Elsewhere they are refused,
 * never ignored (issue 11: serve took prefill-only options in silence). */
static const struct {
    const char *flag;
    unsigned on;
    const char *who; /* "applies only to ..." */
} restricted[] = {
    {"--disaggregation-mode", ON(CLI_NODE_SERVE) | ON_PD,
     "serve, prefill and decode (pdserve run starts both roles)"},
    {"--optimistic-attempts", ON(CLI_NODE_PREFILL) | ON(CLI_NODE_RUN),
     "prefill nodes (pdserve prefill, run)"},
    {"--disable-overlap", ON(CLI_NODE_SERVE) | ON(CLI_NODE_PREFILL) | ON(CLI_NODE_RUN),
     "nodes that compute prompts (serve, prefill, run); decode keeps one batch in flight"},
    {"--transfer-backend", ON_PD | ON(CLI_NODE_RUN), "prefill and decode nodes (and run)"},
    {"--bootstrap-timeout-ms", ON_PD | ON(CLI_NODE_RUN), "prefill and decode nodes (and run)"},
    {"--transfer-timeout-ms", ON_PD | ON(CLI_NODE_RUN), "prefill and decode nodes (and run)"},
    {"--bootstrap-token", ON_PD,
     "the UCX bootstrap channel of separate prefill and decode processes"},
    {"--disaggregation-bootstrap-port", ON(CLI_NODE_PREFILL),
     "a prefill node's UCX bootstrap channel (pdserve prefill)"},
    {"--bootstrap-host", ON(CLI_NODE_PREFILL),
     "a prefill node's UCX bootstrap channel (pdserve prefill)"},
    {"--insecure-bootstrap", ON(CLI_NODE_PREFILL),
     "a prefill node's UCX bootstrap channel (pdserve prefill)"},
    {"--prefill-peers", ON(CLI_NODE_DECODE), "decode nodes (pdserve decode)"},
    {"--transfer-copy-threads", ON(CLI_NODE_PREFILL),
     "a prefill node's UCX transport (pdserve prefill)"},
};

/* The index of option `canonical` in restricted, or -1. */
static int restriction(const char *canonical_name) {
    for (size_t i = 0; i < PD_ARRAY_LEN(restricted); i++)
        if (!strcmp(canonical_name, restricted[i].flag)) return (int)i;
    return -1;
}

static bool applies(const char *canonical_name, cli_node_cmd cmd) {
    int k = restriction(canonical_name);
    return k < 0 || (restricted[k].on & ON(cmd));
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

bool cli_node_option_known(const char *name) {
    const char *a = canonical(name);
    for (size_t i = 0; i < PD_ARRAY_LEN(options); i++)
        if (!strcmp(a, options[i].flag)) return true;
    return false;
}

/* One line of --help: an option, its argument, what it does. */
static void usage_line(FILE *to, const char *flag, const char *arg, const char *help) {
    char left[80];
    snprintf(left, sizeof(left), "%s %s", flag, arg);
    if (strlen(left) > 38) fprintf(to, "  %s\n  %-38s %s\n", left, "", help);
    else fprintf(to, "  %-38s %s\n", left, help);
}

/* The argument --help shows for an option (canonical name) of `which`. */
static const char *option_arg(const char *flag, cli_node_cmd which) {
    if (which == CLI_NODE_RUN && !strcmp(flag, "--transfer-backend")) return "loopback";
    for (size_t i = 0; i < PD_ARRAY_LEN(options); i++)
        if (!strcmp(flag, options[i].flag)) return options[i].arg;
    return "";
}

void cli_node_usage(FILE *to, cli_node_cmd which, const char *cmd, const char *what) {
    fprintf(to, "usage: pdserve %s [options]\n\n%s\n\noptions:\n", cmd, what);
    for (size_t i = 0; i < PD_ARRAY_LEN(options); i++) {
        if (!applies(options[i].flag, which)) continue;
        if (which == CLI_NODE_RUN && !strcmp(options[i].flag, "--transfer-backend"))
            usage_line(to, options[i].flag, option_arg(options[i].flag, which),
                       "the nodes share one process: loopback, the default, is the only one");
        else usage_line(to, options[i].flag, options[i].arg, options[i].help);
    }
    usage_line(to, "--help", "", "this text");
    usage_line(to, "--version", "", "the version, then exit");
    fprintf(to, "\nSGLang's spellings of the same options:\n");
    for (size_t i = 0; i < PD_ARRAY_LEN(aliases); i++) {
        if (!applies(aliases[i][1], which)) continue;
        char help[64];
        snprintf(help, sizeof help, "= %s", aliases[i][1]);
        usage_line(to, aliases[i][0], option_arg(aliases[i][1], which), help);
    }
    fprintf(to, "\nEvery option also takes the form --opt=VALUE.\n");
}

/* A failed strict-mode ownership check: the node hands its report here. */
static void print_violation(void *ctx, pd_node_role role, const char *report) {
    (void)ctx;
    cli_log(CLI_LOG_ERROR, "pdserve %s: ownership check failed:\n%s", pd_node_role_name(role),
            report);
}

/* A request's log line (--log-requests, and every client hang-up). */
static void print_request(void *ctx, const char *line) {
    (void)ctx;
    /* Info, as SGLang logs requests: on stderr, hidden by --log-level warning. */
    if (cli_log_level_get() <= CLI_LOG_INFO) fprintf(stderr, "%s\n", line);
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

/* The role --disaggregation-mode names (SGLang's values). */
static bool mode_role(const char *v, pd_node_role *r) {
    if (!v) return false;
    if (!strcmp(v, "prefill")) *r = PD_NODE_PREFILL;
    else if (!strcmp(v, "decode")) *r = PD_NODE_DECODE;
    else if (!strcmp(v, "null")) *r = PD_NODE_SERVE;
    else return false;
    return true;
}

/* The options of issue 11's list that set_option hands on; same contract. */
static bool set_more_option(pd_node_config *c, const char *a, const char *v, bool *ok_out) {
    uint64_t x = 0;
    pd_node_role r;
    bool ok = v != NULL;
    if (!strcmp(a, "--context-length"))
        ok = ok && parse_num(v, 1u << 25, &x) && x >= 2, c->context_length = (uint32_t)x;
    else if (!strcmp(a, "--api-key")) ok = ok && pd_http_api_key_valid(v), c->api_key = v;
    else if (!strcmp(a, "--log-level")) ok = ok && cli_log_level_set(v);
    else if (!strcmp(a, "--disaggregation-mode")) ok = mode_role(v, &r); /* see take_mode */
    else if (!strcmp(a, "--transfer-copy-threads"))
        ok = ok && parse_num(v, 8, &x) && x >= 1, c->transfer_copy_threads = (uint32_t)x;
    else return false;
    *ok_out = ok;
    return true;
}

/* What a valid value is, for the options whose message says it. */
static const char *value_rule(const char *a) {
    if (!strcmp(a, "--log-level")) return " (" CLI_LOG_LEVELS ")";
    if (!strcmp(a, "--disaggregation-mode")) return " (prefill, decode or null)";
    if (!strcmp(a, "--api-key")) return " (1 to 255 bytes of visible ASCII)";
    if (!strcmp(a, "--context-length")) return " (2 tokens or more)";
    if (!strcmp(a, "--transfer-copy-threads")) return " (1 to 8)";
    return "";
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
    else if (!strcmp(a, "--chat-template")) c->chat_template_path = v;
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
    else return set_more_option(c, a, v, ok_out);
    *ok_out = ok;
    return true;
}

static bool set_flag(pd_node_config *c, const char *a) {
    if (!strcmp(a, "--disable-overlap")) c->disable_overlap = true;
    else if (!strcmp(a, "--disable-prefix-cache")) c->disable_prefix_cache = true;
    else if (!strcmp(a, "--strict")) c->strict = true, c->on_violation = print_violation;
    else if (!strcmp(a, "--insecure-bootstrap")) c->insecure_bootstrap = true;
    else if (!strcmp(a, "--enable-metrics")) c->enable_metrics = true;
    else if (!strcmp(a, "--log-requests")) c->log_requests = true;
    else if (!strcmp(a, "--incremental-streaming-output")) c->incremental_streaming_output = true;
    else return false;
    return true;
}

static cli_node_cmd node_cmd(const char *argv0, pd_node_role role) {
    if (!strcmp(argv0, "run")) return CLI_NODE_RUN;
    return role == PD_NODE_PREFILL ? CLI_NODE_PREFILL
        : role == PD_NODE_DECODE   ? CLI_NODE_DECODE
                                   : CLI_NODE_SERVE;
}

static uint16_t default_port(pd_node_role role) {
    return role == PD_NODE_PREFILL ? 30001 : role == PD_NODE_DECODE ? 30002 : 30000;
}

/* An option given to a command it does not apply to. Returns 2. */
static int refuse_here(const char *cmd, cli_node_cmd which, const char *name, int k) {
    const unsigned on = restricted[k].on;
    const char *mode = (on & ON_PD) == ON_PD ? "prefill or decode"
        : (on & ON(CLI_NODE_PREFILL))        ? "prefill"
        : (on & ON(CLI_NODE_DECODE))         ? "decode"
                                             : NULL;
    fprintf(stderr, "pdserve %s: %s does not apply here: it applies only to %s", cmd, name,
            restricted[k].who);
    if (which == CLI_NODE_SERVE && mode)
        fprintf(stderr, "; serve takes it with --disaggregation-mode %s", mode);
    fprintf(stderr, " (see pdserve %s --help)\n", cmd);
    return 2;
}

/* One option at argv[*i] ("--opt VALUE" or "--opt=VALUE"): 0 when taken, 2
 * when refused (message printed), -1 when it is not a node option. */
static int take_option(int argc, char **argv, int *i, pd_node_config *c, cli_node_cmd which) {
    char name[64];
    const char *arg = argv[*i], *eq = !strncmp(arg, "--", 2) ? strchr(arg, '=') : NULL;
    const char *v = eq ? eq + 1 : *i + 1 < argc ? argv[*i + 1] : NULL;
    snprintf(name, sizeof name, "%.*s", eq ? (int)(eq - arg) : (int)strlen(arg), arg);
    const char *a = canonical(name);
    int k = restriction(a);
    if (k >= 0 && !(restricted[k].on & ON(which))) return refuse_here(argv[0], which, name, k);
    if (set_flag(c, a)) {
        if (!eq) return 0;
        fprintf(stderr, "pdserve %s: option %s takes no value\n", argv[0], name);
        return 2;
    }
    bool ok;
    if (!set_option(c, a, v, &ok)) return -1;
    if (!ok) {
        const bool say = v && strcmp(a, "--api-key"); /* a secret is not repeated */
        fprintf(stderr, "pdserve %s: option %s needs a valid value%s%s%s\n", argv[0], name,
                value_rule(a), say ? ", got " : "", say ? v : "");
        return 2;
    }
    if (!eq) (*i)++;
    return 0;
}

/* --disaggregation-mode, wherever it stands: the role decides which options
 * apply, so it is read before them. serve becomes the role it names (with
 * that role's default port); prefill and decode take only their own. A bad
 * value is left to take_option. 0, or 2 with the message printed. */
static int take_mode(int argc, char **argv, pd_node_config *c) {
    const char *mode = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--disaggregation-mode")) mode = i + 1 < argc ? argv[++i] : NULL;
        else if (!strncmp(argv[i], "--disaggregation-mode=", 22)) mode = argv[i] + 22;
    }
    pd_node_role r;
    if (!strcmp(argv[0], "run") || !mode_role(mode, &r) || r == c->role) return 0;
    if (c->role == PD_NODE_SERVE) {
        c->role = r;
        c->port = default_port(r);
        return 0;
    }
    fprintf(stderr,
            "pdserve %s: --disaggregation-mode %s contradicts the command: use pdserve %s, or "
            "pdserve serve --disaggregation-mode %s\n",
            argv[0], mode, r == PD_NODE_SERVE ? "serve" : mode, r == PD_NODE_SERVE ? "null" : mode);
    return 2;
}

/* The --help text of `which`, malloc'd (NULL when out of memory). */
static char *usage_text(cli_node_cmd which, const char *cmd) {
    char *text = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&text, &len);
    if (!m) return NULL;
    cli_node_usage(m, which, cmd, "");
    fclose(m);
    return text;
}

int cli_node_parse(int argc, char **argv, pd_node_config *c) {
    c->on_log = print_request; /* every node the CLI starts logs on stderr */
    int rc = take_mode(argc, argv, c);
    if (rc) return rc;
    const cli_node_cmd which = node_cmd(argv[0], c->role);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) return 1;
        rc = take_option(argc, argv, &i, c, which);
        if (rc >= 0) {
            if (rc) return rc;
            continue;
        }
        char name[64], *help = usage_text(which, argv[0]);
        snprintf(name, sizeof name, "%.*s", (int)strcspn(argv[i], "="), argv[i]);
        cli_unknown_option(argv[0], name, help, NULL);
        free(help);
        return 2;
    }
    return 0;
}

/* Set by the handler, which may run on any of the process's threads (the
 * node's own threads do not block the signals): a lock-free atomic, which is
 * safe in a handler and across threads, where volatile sig_atomic_t is only
 * the former (ThreadSanitizer saw the race from a /health_generate probe's
 * thread). */
static atomic_int stop_flag;

static void on_signal(int sig) {
    (void)sig;
    atomic_store(&stop_flag, 1);
}

void cli_catch_stop_signals(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_signal;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

void cli_wait_for_signal(void) {
    cli_catch_stop_signals();
    while (!atomic_load(&stop_flag)) {
        struct timespec ts = {0, 100 * 1000000L};
        nanosleep(&ts, NULL);
    }
}

void cli_node_log_config(const char *cmd, const pd_node_config *c) {
    if (cli_log_level_get() > CLI_LOG_DEBUG) return;
    cli_log(CLI_LOG_DEBUG,
            "pdserve %s: role %s, model %s, page size %u, KV pool %u tokens, %u running and %u "
            "live requests at most, prompts up to %u tokens, max_new_tokens up to %u, context "
            "length %u%s, prefix cache %s, overlap %s, transfer %s, api key %s",
            cmd, pd_node_role_name(c->role), c->model_dir ? c->model_dir : c->model_preset,
            c->page_size, c->max_total_tokens, c->max_running_requests, c->max_queued_requests,
            c->max_prompt_tokens, c->max_new_tokens_limit, c->context_length,
            c->context_length ? "" : " (no limit)", c->disable_prefix_cache ? "off" : "on",
            c->disable_overlap ? "off" : "on",
            c->role == PD_NODE_SERVE ? "none" : c->transfer_backend, c->api_key ? "set" : "none");
}

/* What --help says each role's command is. */
static const char *what_of(pd_node_role role) {
    switch (role) {
    case PD_NODE_PREFILL:
        return "A prefill node: computes prompts and hands their KV cache and Mamba state to the\n"
               "decode node named by each request's bootstrap fields (set by `pdserve router`).\n"
               "Decode nodes connect to its bootstrap port.";
    case PD_NODE_DECODE:
        return "A decode node: preallocates memory for each request, receives its KV cache and\n"
               "Mamba state from the prefill node at bootstrap_host:bootstrap_port, and "
               "generates.";
    case PD_NODE_SERVE: break;
    }
    return "A colocated server: prefill and decode in one engine, no transfer. Serves the HTTP\n"
           "API of docs/http-api.md: POST /generate, POST /v1/completions, POST /abort_request,\n"
           "GET /health, GET /server_info, GET /metrics. With --disaggregation-mode prefill or\n"
           "decode it runs as pdserve prefill or decode would, and takes their options\n"
           "(pdserve serve --disaggregation-mode prefill --help lists them).";
}

static void usage_of(const char *argv0, pd_node_role asked, const pd_node_config *c) {
    char cmd[64];
    snprintf(cmd, sizeof cmd, "%s%s%s", argv0, c->role != asked ? " --disaggregation-mode " : "",
             c->role != asked ? pd_node_role_name(c->role) : "");
    cli_node_usage(stdout, node_cmd(argv0, c->role), cmd, what_of(c->role));
}

/* The address the prefill bootstrap channel listens on is beyond this host
 * with no token: pd_node_create allows it with --insecure-bootstrap only. */
static void warn_exposure(const char *cmd, const pd_node_config *c) {
    const char *h = c->bootstrap_host ? c->bootstrap_host : c->host;
    if (c->role != PD_NODE_PREFILL || !c->insecure_bootstrap || c->bootstrap_token) return;
    if (!strncmp(h, "127.", 4) || !strcmp(h, "::1") || !strcmp(h, "localhost")) return;
    cli_log(CLI_LOG_WARNING,
            "pdserve %s: the bootstrap channel listens on %s without a token "
            "(--insecure-bootstrap): whoever reaches it can talk to UCX on this node",
            cmd, h);
}

static int run_node(int argc, char **argv, pd_node_role role) {
    pd_node_config c;
    pd_node_config_default(&c, role);
    c.port = default_port(role);
    c.transfer_backend = "ucx";
    int rc = cli_node_parse(argc, argv, &c);
    if (rc == 1) {
        usage_of(argv[0], role, &c);
        return 0;
    }
    if (rc) return rc;
    /* Before the node answers anything: a SIGTERM right after /health said
     * ok must still stop it gracefully (e2e_flags saw one kill it). */
    cli_catch_stop_signals();
    cli_node_log_config(argv[0], &c);
    warn_exposure(argv[0], &c);
    char msg[512];
    pd_node *n;
    if (pd_node_create(&n, &c, msg, sizeof(msg)) != PD_OK ||
        pd_node_start(n, msg, sizeof(msg)) != PD_OK) {
        cli_log(CLI_LOG_ERROR, "pdserve %s: %s", argv[0], msg);
        return 1;
    }
    char boot[48] = "";
    if (c.role == PD_NODE_PREFILL)
        snprintf(boot, sizeof boot, " (bootstrap port %u)", pd_node_bootstrap_port(n));
    cli_log(CLI_LOG_INFO, "pdserve %s%s%s listening on http://%s:%u%s", argv[0],
            c.role != role ? " as " : "", c.role != role ? pd_node_role_name(c.role) : "", c.host,
            pd_node_http_port(n), boot);
    cli_wait_for_signal();
    cli_log(CLI_LOG_INFO, "pdserve %s: shutting down", argv[0]);
    pd_node_destroy(n);
    return 0;
}

int cli_cmd_serve(int argc, char **argv) { return run_node(argc, argv, PD_NODE_SERVE); }

int cli_cmd_prefill(int argc, char **argv) { return run_node(argc, argv, PD_NODE_PREFILL); }

int cli_cmd_decode(int argc, char **argv) { return run_node(argc, argv, PD_NODE_DECODE); }
