/*
 * pdserve bench — loads a deployment and measures it: TTFT, TPOT, ITL, E2E,
 * throughput, goodput, with aborts at random moments, and checks at the end
 * that every pdserve node given with --check-node is idle and clean (no
 * leaked pool unit). docs/bench-serving.md describes it.
 *
 * Exit codes: 0 done, 1 the run could not happen (server unreachable, a file
 * unreadable), 2 usage error, 3 the idle check failed.
 */
#include <curl/curl.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "args.h"
#include "commands.h"
#include "pdserve/loadgen.h"
#include "pdserve/report.h"

static void usage_results(FILE *to);
static void usage_load(FILE *to);

static void usage(FILE *to) {
    fprintf(
        to,
        "usage: pdserve bench [options]\n"
        "\n"
        "Loads a server with the /generate or OpenAI API (pdserve's router, a node or `serve`,\n"
        "an SGLang or vLLM server) and reports TTFT, TPOT, ITL and end-to-end latency,\n"
        "throughput and goodput. A fraction of the requests can be aborted at random moments.\n"
        "Every pdserve node given with --check-node must be idle and clean at the end: no unit\n"
        "of any pool held by a request or quarantined; else the bench fails (exit 3) naming\n"
        "the pool. See docs/bench-serving.md.\n"
        "\n"
        "target:\n"
        "  --base-url URL              the server (default http://127.0.0.1:30000)\n"
        "  --host H                    with --port: the same as --base-url http://H:P\n"
        "  --port P                    (default 127.0.0.1 and 30000)\n"
        "  --backend NAME              pdserve or sglang: POST /generate (default); openai,\n"
        "                              vllm or sglang-oai: /v1/completions; openai-chat,\n"
        "                              vllm-chat or sglang-oai-chat: /v1/chat/completions\n"
        "  --endpoint PATH             another path for the requests\n"
        "  --model NAME                the OpenAI \"model\" field (default: none sent)\n"
        "  --api-key KEY               sent as 'Authorization: Bearer KEY' (default:\n"
        "                              $OPENAI_API_KEY when set)\n"
        "  --extra-request-body JSON   an object merged into every request body\n"
        "  --disable-stream            ask for whole answers (TTFT is then the E2E latency)\n"
        "  --disable-ignore-eos        let the model stop at its end-of-sequence token\n"
        "  --request-timeout-s N       a request's time limit (default 600)\n"
        "\n"
        "dataset (the same options and seed give the same requests; --dump-dataset shows them):\n"
        "  --dataset-name NAME         random (default), shared-prefix, multi-turn, sharegpt,\n"
        "                              trace\n"
        "  --dataset-path FILE         sharegpt: a ShareGPT JSON file; trace: one JSON object\n"
        "                              per line with \"timestamp\" (ms) and \"output_length\", "
        "and\n"
        "                              \"input_ids\", \"text\" or \"input_length\" (+ "
        "\"hash_ids\")\n"
        "  --num-prompts N             requests measured (default 200)\n"
        "  --random-input-len N        prompt tokens (default 256); multi-turn: per turn\n"
        "  --random-output-len N       max_new_tokens (default 32)\n"
        "  --random-range-ratio R      lengths uniform in [len * R, len] (default 0.5)\n"
        "  --gsp-num-groups N          shared-prefix: system prompts (default 8)\n"
        "  --gsp-system-prompt-len N   their tokens (default 512)\n"
        "  --gsp-question-len N        each question's tokens (default 64)\n"
        "  --multi-turn-turns N        multi-turn: turns per conversation (default 4); each\n"
        "                              turn goes out when the last one ended\n"
        "  --sharegpt-output-len N     sharegpt: max_new_tokens of every request (default:\n"
        "                              the answer's length at 4 bytes a token)\n"
        "  --trace-block-tokens N      trace: tokens per hash id (default 512)\n"
        "  --prompt-kind ids|text      prompts as token ids (default; exact lengths) or as\n"
        "                              words (default for chat and sharegpt)\n"
        "  --vocab-size N              ids are drawn below it (default: the server's\n"
        "                              /get_model_info vocab_size, else 256)\n"
        "  --seed N                    the request sequence's seed (default 1)\n"
        "  --warmup-requests N         sent first and not measured (default 0)\n"
        "  --dump-dataset FILE         write the requests, one JSON object per line\n"
        "  --dry-run                   build (and dump) the requests, send nothing\n"
        "\n");
    usage_load(to);
}

static void usage_load(FILE *to) {
    fprintf(to,
            "load:\n"
            "  --request-rate R            requests/s (default inf: all at once)\n"
            "  --burstiness B              gaps are gamma-distributed with shape B: 1 = Poisson\n"
            "                              (default), below 1 burstier\n"
            "  --max-concurrency N         requests in flight at most (default: no limit)\n"
            "  --duration S                stop sending after S seconds (default: send all)\n"
            "\n"
            "aborts:\n"
            "  --abort-fraction F          this fraction of the requests is aborted (default 0)\n"
            "  --abort-mode M              request (POST /abort_request), close (hang up) or\n"
            "                              mixed (default: half each)\n"
            "  --abort-after-ms LO:HI      at a moment uniform in [LO, HI] ms after sending\n"
            "                              (default 0:500)\n"
            "  --abort-all-every-s S       POST /abort_request {\"abort_all\": true} every S s\n"
            "\n");
    usage_results(to);
}

static void usage_results(FILE *to) {
    fprintf(
        to,
        "results:\n"
        "  --slo ttft=200ms,tpot=50ms  goodput counts completed requests within these (keys\n"
        "                              ttft, tpot, itl, e2e; units ms or s)\n"
        "  --output-file FILE          append the results as one JSON line (SGLang\n"
        "                              bench_serving's field names, pdserve's under \"pdserve\")\n"
        "  --report DIR                write DIR/report.html: latency CDFs, throughput and\n"
        "                              concurrency over time, aborts, each node's pools\n"
        "  --check-node URL            a pdserve node (or a router: its workers) to watch and\n"
        "                              check idle and clean at the end; repeatable\n"
        "  --idle-timeout-s N          how long the nodes get to become idle (default 30)\n"
        "  --sample-interval-ms N      how often the nodes' pools are sampled (default 250)\n"
        "  --timeline-interval-ms N    the timeline's resolution (default 250)\n"
        "  --no-progress               no progress line on stderr\n"
        "  --help                      this text\n"
        "\n"
        "Every option also takes the form --opt=VALUE.\n"
        "Exit codes: 0 done, 1 the run could not happen, 2 usage error, 3 idle check failed.\n");
}

typedef struct bench_args {
    pd_lg_dataset_config dc;
    pd_lg_run_config rc;
    pd_lg_slo slo;
    bool has_slo, dry_run, vocab_given, kind_given;
    const char *dump, *output, *report, *host;
    char base[512];
    uint32_t port;
} bench_args;

static int usage_error(const char *what, const char *detail) {
    fprintf(stderr, "pdserve bench: %s%s (see pdserve bench --help)\n", what, detail);
    return 2;
}

static bool parse_backend(const char *v, pd_lg_api *api) {
    static const struct {
        const char *name;
        pd_lg_api api;
    } names[] = {{"pdserve", PD_LG_API_GENERATE},       {"sglang", PD_LG_API_GENERATE},
                 {"sglang-native", PD_LG_API_GENERATE}, {"openai", PD_LG_API_COMPLETIONS},
                 {"vllm", PD_LG_API_COMPLETIONS},       {"sglang-oai", PD_LG_API_COMPLETIONS},
                 {"openai-chat", PD_LG_API_CHAT},       {"vllm-chat", PD_LG_API_CHAT},
                 {"sglang-oai-chat", PD_LG_API_CHAT}};
    for (size_t i = 0; i < PD_ARRAY_LEN(names); i++)
        if (!strcmp(v, names[i].name)) {
            *api = names[i].api;
            return true;
        }
    return false;
}

static bool parse_double(const char *v, double lo, double hi, double *out) {
    char *end;
    double x = strtod(v, &end);
    if (end == v || *end || !isfinite(x) || x < lo || x > hi) return false;
    *out = x;
    return true;
}

static bool parse_u32(const char *v, uint32_t lo, uint32_t hi, uint32_t *out) {
    uint64_t x;
    if (!cli_u64(v, lo, hi, &x)) return false;
    *out = (uint32_t)x;
    return true;
}

static bool parse_abort_window(const char *v, pd_lg_dataset_config *dc) {
    const char *colon = strchr(v, ':');
    double lo = 0, hi;
    char a[64];
    if (colon) {
        if ((size_t)(colon - v) >= sizeof(a)) return false;
        memcpy(a, v, (size_t)(colon - v));
        a[colon - v] = '\0';
        if (!parse_double(a, 0, 86400e3, &lo)) return false;
        v = colon + 1;
    }
    if (!parse_double(v, 0, 86400e3, &hi) || hi < lo) return false;
    dc->abort_min_s = lo / 1e3;
    dc->abort_max_s = hi / 1e3;
    return true;
}

/* Each option group: false when name is not one of its options; *ok says
 * whether the value was good. */
static bool target_option(bench_args *a, const char *name, const char *v, bool *ok) {
    pd_lg_run_config *rc = &a->rc;
    double d = 0;
    if (!strcmp(name, "--base-url")) {
        size_t n = strlen(v);
        while (n && v[n - 1] == '/') n--;
        *ok = n > 7 && n < sizeof(a->base) &&
            (!strncmp(v, "http://", 7) || !strncmp(v, "https://", 8));
        snprintf(a->base, sizeof(a->base), "%.*s", (int)n, v);
    } else if (!strcmp(name, "--host")) {
        a->host = v;
        *ok = *v && strlen(v) < 256;
    } else if (!strcmp(name, "--port")) {
        *ok = parse_u32(v, 1, 65535, &a->port);
    } else if (!strcmp(name, "--backend")) {
        *ok = parse_backend(v, &rc->api);
    } else if (!strcmp(name, "--endpoint")) {
        rc->endpoint = v;
        *ok = v[0] == '/';
    } else if (!strcmp(name, "--model")) {
        rc->model = v;
    } else if (!strcmp(name, "--api-key")) {
        rc->api_key = v;
        *ok = *v && !strpbrk(v, "\r\n");
    } else if (!strcmp(name, "--extra-request-body")) {
        json_t *o = json_loads(v, 0, NULL);
        *ok = json_is_object(o);
        json_decref(o);
        rc->extra_body = v;
    } else if (!strcmp(name, "--request-timeout-s")) {
        *ok = parse_double(v, 0.001, 86400, &d);
        rc->request_timeout_s = d;
    } else {
        return false;
    }
    return true;
}

static bool length_option(bench_args *a, const char *name, const char *v, bool *ok) {
    pd_lg_dataset_config *dc = &a->dc;
    static const struct {
        const char *name;
        size_t off;
        uint32_t lo, hi;
    } u32s[] = {
        {"--num-prompts", offsetof(pd_lg_dataset_config, num_prompts), 1, 10000000},
        {"--random-input-len", offsetof(pd_lg_dataset_config, input_len), 1, 1 << 24},
        {"--random-output-len", offsetof(pd_lg_dataset_config, output_len), 1, 1 << 20},
        {"--gsp-output-len", offsetof(pd_lg_dataset_config, output_len), 1, 1 << 20},
        {"--gsp-num-groups", offsetof(pd_lg_dataset_config, gsp_groups), 1, 100000},
        {"--gsp-system-prompt-len", offsetof(pd_lg_dataset_config, gsp_system_len), 0, 1 << 24},
        {"--gsp-question-len", offsetof(pd_lg_dataset_config, gsp_question_len), 1, 1 << 24},
        {"--multi-turn-turns", offsetof(pd_lg_dataset_config, turns), 1, PD_LG_SEGMENTS_MAX / 2},
        {"--sharegpt-output-len", offsetof(pd_lg_dataset_config, sharegpt_output_len), 1, 1 << 20},
        {"--trace-block-tokens", offsetof(pd_lg_dataset_config, trace_block_tokens), 1, 1 << 20},
        {"--warmup-requests", offsetof(pd_lg_dataset_config, warmup), 0, 100000},
        {"--token-min", offsetof(pd_lg_dataset_config, token_min), 0, INT32_MAX},
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(u32s); i++)
        if (!strcmp(name, u32s[i].name)) {
            *ok = parse_u32(v, u32s[i].lo, u32s[i].hi, (uint32_t *)((char *)dc + u32s[i].off));
            return true;
        }
    return false;
}

static bool dataset_option(bench_args *a, const char *name, const char *v, bool *ok) {
    pd_lg_dataset_config *dc = &a->dc;
    uint64_t u;
    if (length_option(a, name, v, ok)) return true;
    if (!strcmp(name, "--dataset-name")) {
        *ok = pd_lg_kind_parse(v, &dc->kind);
    } else if (!strcmp(name, "--dataset-path")) {
        dc->path = v;
    } else if (!strcmp(name, "--random-range-ratio")) {
        *ok = parse_double(v, 0, 1, &dc->range_ratio);
    } else if (!strcmp(name, "--prompt-kind")) {
        *ok = !strcmp(v, "ids") || !strcmp(v, "text");
        dc->text = !strcmp(v, "text");
        a->kind_given = true;
    } else if (!strcmp(name, "--vocab-size")) {
        *ok = parse_u32(v, 2, INT32_MAX, &dc->vocab);
        a->vocab_given = true;
    } else if (!strcmp(name, "--seed")) {
        *ok = cli_u64(v, 0, UINT64_MAX, &u);
        dc->seed = a->rc.seed = u;
    } else if (!strcmp(name, "--dump-dataset")) {
        a->dump = v;
    } else {
        return false;
    }
    return true;
}

static bool load_option(bench_args *a, const char *name, const char *v, bool *ok) {
    pd_lg_dataset_config *dc = &a->dc;
    if (!strcmp(name, "--request-rate")) {
        *ok = !strcmp(v, "inf") || parse_double(v, 1e-6, 1e7, &dc->request_rate);
        if (!strcmp(v, "inf")) dc->request_rate = 0;
    } else if (!strcmp(name, "--burstiness")) {
        *ok = parse_double(v, 0.01, 1000, &dc->burstiness);
    } else if (!strcmp(name, "--max-concurrency")) {
        *ok = parse_u32(v, 1, 1000000, &a->rc.max_concurrency);
    } else if (!strcmp(name, "--duration")) {
        *ok = parse_double(v, 0.001, 30 * 86400, &a->rc.duration_s);
    } else if (!strcmp(name, "--abort-fraction")) {
        *ok = parse_double(v, 0, 1, &dc->abort_fraction);
    } else if (!strcmp(name, "--abort-mode")) {
        *ok = !strcmp(v, "request") || !strcmp(v, "close") || !strcmp(v, "mixed");
        dc->abort_mode = !strcmp(v, "request") ? PD_LG_ABORT_REQUEST
            : !strcmp(v, "close")              ? PD_LG_ABORT_CLOSE
                                               : PD_LG_ABORT_NONE;
    } else if (!strcmp(name, "--abort-after-ms")) {
        *ok = parse_abort_window(v, dc);
    } else if (!strcmp(name, "--abort-all-every-s")) {
        *ok = parse_double(v, 0.001, 86400, &a->rc.abort_all_every_s);
    } else {
        return false;
    }
    return true;
}

static bool result_option(bench_args *a, const char *name, const char *v, bool *ok) {
    pd_lg_run_config *rc = &a->rc;
    double d = 0;
    char err[256];
    if (!strcmp(name, "--slo")) {
        *ok = a->has_slo = pd_lg_slo_parse(v, &a->slo, err, sizeof(err));
        if (!*ok) fprintf(stderr, "pdserve bench: %s\n", err);
    } else if (!strcmp(name, "--output-file")) {
        a->output = v;
    } else if (!strcmp(name, "--report")) {
        a->report = v;
    } else if (!strcmp(name, "--check-node")) {
        size_t n = strlen(v);
        while (n && v[n - 1] == '/') n--;
        *ok = rc->n_nodes < PD_LG_NODES_MAX && n > 7 && n < 200 && !strncmp(v, "http", 4);
        if (*ok) rc->nodes[rc->n_nodes++] = strndup(v, n);
    } else if (!strcmp(name, "--idle-timeout-s")) {
        *ok = parse_double(v, 0, 86400, &rc->idle_timeout_s);
    } else if (!strcmp(name, "--sample-interval-ms")) {
        *ok = parse_double(v, 10, 3600e3, &d);
        rc->sample_interval_s = d / 1e3;
    } else if (!strcmp(name, "--timeline-interval-ms")) {
        *ok = parse_double(v, 10, 3600e3, &d);
        rc->timeline_interval_s = d / 1e3;
    } else {
        return false;
    }
    return true;
}

static const char *const flags[] = {"--disable-stream", "--disable-ignore-eos", "--dry-run",
                                    "--no-progress"};

static bool flag_option(bench_args *a, const char *arg) {
    if (!strcmp(arg, flags[0])) a->rc.stream = false;
    else if (!strcmp(arg, flags[1])) a->rc.ignore_eos = false;
    else if (!strcmp(arg, flags[2])) a->dry_run = true;
    else if (!strcmp(arg, flags[3])) a->rc.progress_to = NULL;
    else return false;
    return true;
}

static void help_text(FILE *to) { usage(to); }

/* Whether name is an option that takes a value (for "needs a value"). */
static bool valued(const char *name) {
    static const char *const names[] = {"--base-url",
                                        "--host",
                                        "--port",
                                        "--backend",
                                        "--endpoint",
                                        "--model",
                                        "--api-key",
                                        "--extra-request-body",
                                        "--request-timeout-s",
                                        "--dataset-name",
                                        "--dataset-path",
                                        "--num-prompts",
                                        "--random-input-len",
                                        "--random-output-len",
                                        "--random-range-ratio",
                                        "--gsp-num-groups",
                                        "--gsp-system-prompt-len",
                                        "--gsp-question-len",
                                        "--gsp-output-len",
                                        "--multi-turn-turns",
                                        "--sharegpt-output-len",
                                        "--trace-block-tokens",
                                        "--prompt-kind",
                                        "--vocab-size",
                                        "--token-min",
                                        "--seed",
                                        "--warmup-requests",
                                        "--dump-dataset",
                                        "--request-rate",
                                        "--burstiness",
                                        "--max-concurrency",
                                        "--duration",
                                        "--abort-fraction",
                                        "--abort-mode",
                                        "--abort-after-ms",
                                        "--abort-all-every-s",
                                        "--slo",
                                        "--output-file",
                                        "--report",
                                        "--check-node",
                                        "--idle-timeout-s",
                                        "--sample-interval-ms",
                                        "--timeline-interval-ms"};
    for (size_t i = 0; i < PD_ARRAY_LEN(names); i++)
        if (!strcmp(name, names[i])) return true;
    return false;
}

/* 0 parsed, 2 usage error, -1 --help printed. */
static int parse(bench_args *a, int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return -1;
        }
        if (flag_option(a, argv[i])) continue;
        char name[64];
        const char *v = cli_option(argc, argv, &i, name, sizeof(name));
        bool ok = true;
        bool known = v &&
            (target_option(a, name, v, &ok) || dataset_option(a, name, v, &ok) ||
             load_option(a, name, v, &ok) || result_option(a, name, v, &ok));
        if (!v && valued(name)) return usage_error(name, " needs a value");
        if (!known) return cli_unknown_option_usage("bench", name, help_text, NULL);
        if (!ok) {
            fprintf(stderr, "pdserve bench: %s: bad value '%s' (see pdserve bench --help)\n", name,
                    v);
            return 2;
        }
    }
    return 0;
}

/* ---- the summary table --------------------------------------------------------------- */

static void row_num(FILE *to, const char *label, json_t *v, const char *fmt) {
    if (json_is_number(v))
        fprintf(to, "%-40s ", label), fprintf(to, fmt, json_number_value(v)), fputc('\n', to);
    else fprintf(to, "%-40s %s\n", label, "-");
}

static void latency_rows(FILE *to, const json_t *o, const char *title, const char *key,
                         const char *shown) {
    fprintf(to, "%s\n", title);
    static const char *const stat[] = {"mean", "median", "p90", "p99", "max"};
    static const char *const label[] = {"Mean", "Median", "P90", "P99", "Max"};
    for (int k = 0; k < 5; k++) {
        char name[64], l[64];
        snprintf(name, sizeof(name), "%s_%s_ms", stat[k], key);
        snprintf(l, sizeof(l), "%s %s (ms):", label[k], shown);
        row_num(to, l, json_object_get(o, name), "%.2f");
    }
}

static void print_summary(const json_t *o, FILE *to) {
    fprintf(to, "============ Serving Benchmark Result ============\n");
    fprintf(to, "%-40s %s\n", "Backend:", json_string_value(json_object_get(o, "backend")));
    fprintf(to, "%-40s %s\n", "Dataset:", json_string_value(json_object_get(o, "dataset_name")));
    if (json_is_number(json_object_get(o, "request_rate")))
        row_num(to, "Traffic request rate:", json_object_get(o, "request_rate"), "%.2f");
    else fprintf(to, "%-40s %s\n", "Traffic request rate:", "inf");
    row_num(to, "Max request concurrency:", json_object_get(o, "max_concurrency"), "%.0f");
    static const char *const counts[][2] = {
        {"Requests sent:", "num_prompts"},
        {"Successful requests:", "completed"},
        {"Aborted requests:", "aborted"},
        {"Failed requests:", "failed"},
        {"Refused requests:", "refused"},
        {"Total input tokens:", "total_input_tokens"},
        {"Total generated tokens:", "total_output_tokens"},
        {"Cache-hit tokens (answers' meta_info):", "cache_hit_tokens"}};
    row_num(to, "Benchmark duration (s):", json_object_get(o, "duration"), "%.2f");
    for (size_t k = 0; k < PD_ARRAY_LEN(counts); k++)
        row_num(to, counts[k][0], json_object_get(o, counts[k][1]), "%.0f");
    json_t *nc = json_object_get(json_object_get(o, "pdserve"), "node_cache_hit_tokens");
    if (json_is_integer(nc)) row_num(to, "Prefill cache-hit tokens (node counters):", nc, "%.0f");
    row_num(to, "Request throughput (req/s):", json_object_get(o, "request_throughput"), "%.2f");
    row_num(to, "Input token throughput (tok/s):", json_object_get(o, "input_throughput"), "%.2f");
    row_num(to, "Output token throughput (tok/s):", json_object_get(o, "output_throughput"),
            "%.2f");
    row_num(to, "Total token throughput (tok/s):", json_object_get(o, "total_throughput"), "%.2f");
    if (json_is_number(json_object_get(o, "goodput")))
        row_num(to, "Goodput (req/s, within the SLOs):", json_object_get(o, "goodput"), "%.2f");
    row_num(to, "Concurrency:", json_object_get(o, "concurrency"), "%.2f");
    latency_rows(to, o, "---------------Time to First Token----------------", "ttft", "TTFT");
    latency_rows(to, o, "-----Time per Output Token (excl. 1st token)------", "tpot", "TPOT");
    latency_rows(to, o, "---------------Inter-token Latency----------------", "itl", "ITL");
    latency_rows(to, o, "----------------End-to-End Latency----------------", "e2e_latency",
                 "E2E Latency");
    fprintf(to, "==================================================\n");
}

/* ---- running it ---------------------------------------------------------------------- */

static int finish_args(bench_args *a) {
    if (a->host || a->port)
        snprintf(a->base, sizeof(a->base), "http://%s:%u", a->host ? a->host : "127.0.0.1",
                 a->port ? a->port : 30000);
    if (a->base[0]) a->rc.base_url = a->base;
    if (!a->kind_given) a->dc.text = a->rc.api == PD_LG_API_CHAT || a->dc.kind == PD_LG_SHAREGPT;
    if (a->rc.api == PD_LG_API_CHAT && !a->dc.text)
        return usage_error("chat requests carry text", ": --prompt-kind text");
    if ((a->dc.kind == PD_LG_SHAREGPT || a->dc.kind == PD_LG_TRACE) && !a->dc.path)
        return usage_error("this dataset needs ", "--dataset-path FILE");
    if (a->dc.kind != PD_LG_SHAREGPT && a->dc.kind != PD_LG_TRACE && a->dc.path)
        return usage_error("--dataset-path is for the sharegpt and trace datasets", "");
    return 0;
}

static int dump_dataset(const bench_args *a, const pd_lg_dataset *d) {
    FILE *f = !strcmp(a->dump, "-") ? stdout : fopen(a->dump, "w");
    if (!f) {
        perror(a->dump);
        return 1;
    }
    bool ok = pd_lg_dataset_dump(d, f);
    if (f != stdout) ok = fclose(f) == 0 && ok;
    if (!ok) fprintf(stderr, "pdserve bench: cannot write %s\n", a->dump);
    return ok ? 0 : 1;
}

/* The ledger's counts of each pool at the idle check's last look. */
static void print_pools(const pd_lg_node *n) {
    if (!n->has_last) return;
    for (uint32_t i = 0; i < n->last.n_pools; i++) {
        const pd_lg_pool_sample *p = &n->last.pools[i];
        printf("  %-8s %8llu units: %llu free, %llu held by requests, %llu cached (%llu "
               "evictable, %llu protected), %llu quarantined\n",
               p->name, (unsigned long long)p->total, (unsigned long long)p->free,
               (unsigned long long)p->req,
               (unsigned long long)(p->cache_evictable + p->cache_protected),
               (unsigned long long)p->cache_evictable, (unsigned long long)p->cache_protected,
               (unsigned long long)p->quarantine);
    }
}

/* The idle check's lines, each node's pools under it; true when every node
 * passed (or none was given). */
static bool print_idle(const pd_lg_results *r) {
    bool all = true;
    for (uint32_t k = 0; k < r->n_nodes; k++) {
        const pd_lg_node *n = &r->nodes[k];
        if (n->passed)
            printf("Idle check: %s (%s) idle and clean after %.2f s\n", n->url, n->role,
                   n->waited_s);
        else printf("IDLE CHECK FAILED: %s (%s): %s\n", n->url, n->role, n->problem);
        print_pools(n);
        all = all && n->passed;
    }
    return all;
}

static int write_outputs(const bench_args *a, json_t *results) {
    int rc = 0;
    if (a->output) {
        FILE *f = fopen(a->output, "a");
        char *s = json_dumps(results, JSON_COMPACT | JSON_PRESERVE_ORDER);
        if (!f || !s || fprintf(f, "%s\n", s) < 0) {
            fprintf(stderr, "pdserve bench: cannot write %s\n", a->output);
            rc = 1;
        }
        if (f && fclose(f) != 0) rc = 1;
        free(s);
    }
    if (a->report) {
        char err[512];
        if (pd_report_write(results, a->report, err, sizeof(err)) != 0) {
            fprintf(stderr, "pdserve bench: the report: %s\n", err);
            rc = 1;
        } else {
            printf("Report: %s/report.html\n", a->report);
        }
    }
    return rc;
}

static int run_bench(bench_args *a, pd_lg_dataset *d) {
    pd_lg_results r;
    char err[512];
    if (pd_lg_run(&a->rc, d, &r, err, sizeof(err)) != PD_OK) {
        fprintf(stderr, "pdserve bench: %s\n", err);
        return 1;
    }
    json_t *results = pd_lg_results_json(&a->rc, &a->dc, d, &r, a->has_slo ? &a->slo : NULL);
    print_summary(results, stdout);
    bool clean = print_idle(&r);
    int rc = write_outputs(a, results);
    fflush(stdout);
    json_decref(results);
    pd_lg_results_free(&r);
    return !clean ? 3 : rc;
}

int cli_cmd_bench(int argc, char **argv) {
    bench_args a = {0};
    pd_lg_dataset_config_default(&a.dc);
    pd_lg_run_config_default(&a.rc);
    const char *key = getenv("OPENAI_API_KEY");
    if (key && *key) a.rc.api_key = key;
    a.rc.progress_to = stderr;
    struct winsize ws = {0};
    a.rc.progress_columns = ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 ? ws.ws_col : 0;
    int rc = parse(&a, argc, argv);
    if (!rc) rc = finish_args(&a);
    curl_global_init(CURL_GLOBAL_DEFAULT);
    if (!rc && !a.dc.text && !a.vocab_given && !a.dry_run) {
        uint32_t v = pd_lg_server_vocab(&a.rc);
        if (v) a.dc.vocab = v;
    }
    pd_lg_dataset d = {0};
    char err[512];
    if (!rc && pd_lg_dataset_build(&a.dc, &d, err, sizeof(err)) != PD_OK) {
        fprintf(stderr, "pdserve bench: %s\n", err);
        rc = 1;
    }
    if (!rc && a.dump) rc = dump_dataset(&a, &d);
    if (!rc && a.dry_run)
        printf("%u requests built (%u warm-up); --dry-run: nothing sent\n", d.n, a.dc.warmup);
    else if (!rc) rc = run_bench(&a, &d);
    pd_lg_dataset_free(&d);
    for (uint32_t k = 0; k < a.rc.n_nodes; k++) free((char *)a.rc.nodes[k]);
    curl_global_cleanup();
    return rc < 0 ? 0 : rc;
}
