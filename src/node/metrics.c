/*
 * metrics.c — what a node measures of the requests it serves, and the two
 * ways it tells: the Prometheus text of GET /metrics and, with
 * --log-requests, one JSON line per request as it ends (docs/http-api.md).
 *
 * Which node measures what. A request ends on one node — the decode node of
 * a prefill/decode pair, the serve node colocated — and only that node
 * emits its tokens: it alone observes time to first token and inter-token
 * latency. A prefill node emits no token; it observes how long the prompt
 * took to compute instead, and each half of a pair observes its side of the
 * hand-off (latency and bytes). A family a role could only ever export at
 * zero is not exported on that role. Where SGLang has the same quantity the
 * node exports it under SGLang's name too (labelled model_name, as SGLang
 * does), so SGLang's dashboards work unchanged.
 *
 * Windowed gauges (SGLang's gen_throughput and cache_hit_rate) cover the
 * recent past: the tick samples the totals every RATE_PERIOD_US, and a
 * gauge is the change since the older of the last two samples, so it spans
 * one to two periods however often, and by however many, it is scraped.
 *
 * Everything here runs on the scheduler thread (the sink's events, the
 * METRICS command, the loop's tick): nothing is locked.
 */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "node_internal.h"

#define HIST_BUCKETS 12
#define RATE_PERIOD_US 5000000u /* the windowed gauges' period: 5 s */
#define LABELS_MAX 320          /* model_name="...", escaped */

typedef struct hist {
    const double *bounds; /* HIST_BUCKETS - 1 finite upper bounds; the last bucket is +Inf */
    uint64_t counts[HIST_BUCKETS];
    double sum;
    uint64_t n;
} hist;

/* The totals the windowed gauges difference. */
typedef struct totals {
    uint64_t t_us;
    uint64_t generated; /* tokens emitted */
    uint64_t prompt;    /* prompt tokens of admitted requests that ended */
    uint64_t cached;    /* of them, taken from this node's prefix cache */
} totals;

struct node_metrics {
    pd_node_role role;
    char labels[LABELS_MAX]; /* the sglang: families' model_name="..." */
    hist ttft, itl, e2e;     /* e2e: every role; ttft, itl: the roles that emit tokens */
    hist prefill;            /* prefill, serve: admission to the prompt's last chunk */
    hist xfer;               /* prefill, decode: the hand-off */
    hist xfer_rate;          /* prefill: a room's bytes over its sending time */
    uint64_t xfer_bytes;
    uint64_t prompt_tokens, completion_tokens; /* of every request that ended here */
    totals now, older, newer;
};

static const double latency_bounds[HIST_BUCKETS - 1] = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                        0.5,   1,    2.5,   5,    10};
static const double itl_bounds[HIST_BUCKETS - 1] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                                    0.05,   0.1,   0.25,   0.5,   1};
static const double xfer_bounds[HIST_BUCKETS - 1] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
                                                     0.05,   0.1,   0.25,   1,     5};
static const double rate_bounds[HIST_BUCKETS - 1] = {1e6,   1e7, 1e8,  2.5e8,  5e8, 1e9,
                                                     2.5e9, 5e9, 1e10, 2.5e10, 5e10};

static bool emits_tokens(pd_node_role r) { return r != PD_NODE_PREFILL; }
static bool computes_prompts(pd_node_role r) { return r != PD_NODE_DECODE; }
static bool transfers(pd_node_role r) { return r != PD_NODE_SERVE; }

static void hist_add(hist *h, double v) {
    int b = 0;
    while (b < HIST_BUCKETS - 1 && v > h->bounds[b]) b++;
    h->counts[b]++;
    h->sum += v;
    h->n++;
}

static double seconds_between(uint64_t from_us, uint64_t to_us) {
    return to_us > from_us ? (double)(to_us - from_us) / 1e6 : 0.0;
}

/* A Prometheus label value: backslash, quote and newline escaped. */
static void label_escape(char *out, size_t cap, const char *s) {
    size_t k = 0;
    for (; *s && k + 3 < cap; s++) {
        if (*s == '\\' || *s == '"') out[k++] = '\\';
        if (*s == '\n') {
            out[k++] = '\\';
            out[k++] = 'n';
            continue;
        }
        out[k++] = *s;
    }
    out[k] = '\0';
    PD_ASSERT(k < cap);
}

node_metrics *node_metrics_new(pd_node_role role, const char *model_name) {
    node_metrics *m = calloc(1, sizeof(*m));
    if (!m) return NULL;
    m->role = role;
    char name[LABELS_MAX - 16];
    label_escape(name, sizeof(name), model_name ? model_name : "");
    snprintf(m->labels, sizeof(m->labels), "model_name=\"%s\"", name);
    m->ttft.bounds = m->e2e.bounds = m->prefill.bounds = latency_bounds;
    m->itl.bounds = itl_bounds;
    m->xfer.bounds = xfer_bounds;
    m->xfer_rate.bounds = rate_bounds;
    return m;
}

void node_metrics_free(node_metrics *m) { free(m); }

void node_metrics_token(node_metrics *m, bool first, double seconds) {
    PD_ASSERT(emits_tokens(m->role) && seconds >= 0);
    hist_add(first ? &m->ttft : &m->itl, seconds);
    m->now.generated++;
}

/* The hand-off's figures, on the two halves of a pair. The prefill's rate
 * divides the room's bytes by the time from its first send to success: for
 * a prompt of several chunks that includes computing the later ones, so it
 * is what the hand-off achieved, a lower bound on what the link can do. */
static void end_transfer(node_metrics *m, const pd_terminal_event *ev) {
    m->xfer_bytes += ev->xfer_bytes;
    if (!ev->xfer_start_us || !ev->xfer_done_us) return;
    hist_add(&m->xfer, seconds_between(ev->xfer_start_us, ev->xfer_done_us));
    double sending_s = seconds_between(ev->xfer_first_us, ev->xfer_done_us);
    if (m->role == PD_NODE_PREFILL && ev->xfer_first_us && sending_s > 0)
        hist_add(&m->xfer_rate, (double)ev->xfer_bytes / sending_s);
}

void node_metrics_end(node_metrics *m, const pd_terminal_event *ev, uint64_t now_us) {
    PD_ASSERT(ev->kind != PD_TERM_NONE && ev->submit_us <= now_us);
    hist_add(&m->e2e, seconds_between(ev->submit_us, now_us));
    if (ev->admit_us && ev->computed_us)
        hist_add(&m->prefill, seconds_between(ev->admit_us, ev->computed_us));
    if (transfers(m->role)) end_transfer(m, ev);
    m->prompt_tokens += ev->prompt_tokens;
    m->completion_tokens += ev->completion_tokens;
    /* The cache hit rate counts the requests that got as far as the cache:
     * one aborted in its queue never asked it. */
    bool admitted = m->role == PD_NODE_DECODE ? ev->xfer_start_us != 0 : ev->admit_us != 0;
    if (admitted) {
        m->now.prompt += ev->prompt_tokens;
        m->now.cached += ev->cached_tokens;
    }
    PD_ASSERT(m->now.cached <= m->now.prompt || !admitted);
}

void node_metrics_tick(node_metrics *m, uint64_t now_us) {
    if (m->newer.t_us && now_us - m->newer.t_us < RATE_PERIOD_US) return;
    m->now.t_us = now_us;
    m->older = m->newer.t_us ? m->newer : m->now;
    m->newer = m->now;
    PD_ASSERT(m->older.t_us <= m->newer.t_us);
}

/* ---- the Prometheus text ------------------------------------------------------------ */

static void family(pd_strbuf *t, const char *name, const char *type, const char *help) {
    pd_strbuf_printf(t, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* One series, name{labels} value (labels may be ""): a ratio or a rate... */
static void sample(pd_strbuf *t, const char *name, const char *labels, double v) {
    pd_strbuf_printf(t, "%s%s%s%s %.6g\n", name, labels[0] ? "{" : "", labels, labels[0] ? "}" : "",
                     v);
}

/* ...or a count, exact however large. */
static void sample_u64(pd_strbuf *t, const char *name, const char *labels, uint64_t v) {
    pd_strbuf_printf(t, "%s%s%s%s %llu\n", name, labels[0] ? "{" : "", labels, labels[0] ? "}" : "",
                     (unsigned long long)v);
}

static void hist_text(pd_strbuf *t, const char *name, const char *help, const char *labels,
                      const hist *h) {
    family(t, name, "histogram", help);
    const char *sep = labels[0] ? "," : "";
    uint64_t cum = 0;
    for (int b = 0; b < HIST_BUCKETS - 1; b++) {
        cum += h->counts[b];
        pd_strbuf_printf(t, "%s_bucket{%s%sle=\"%g\"} %llu\n", name, labels, sep, h->bounds[b],
                         (unsigned long long)cum);
    }
    cum += h->counts[HIST_BUCKETS - 1];
    PD_ASSERT(cum == h->n);
    pd_strbuf_printf(t, "%s_bucket{%s%sle=\"+Inf\"} %llu\n", name, labels, sep,
                     (unsigned long long)cum);
    pd_strbuf_printf(t, "%s_sum%s%s%s %.6f\n%s_count%s%s%s %llu\n", name, labels[0] ? "{" : "",
                     labels, labels[0] ? "}" : "", h->sum, name, labels[0] ? "{" : "", labels,
                     labels[0] ? "}" : "", (unsigned long long)h->n);
}

/* pdserve's own latency histograms, each on the roles where it can move. */
static void latency_text(pd_strbuf *t, const node_metrics *m) {
    if (emits_tokens(m->role)) {
        hist_text(t, "pdserve_time_to_first_token_seconds",
                  "From submit on this node to the request's first token (decode: the hand-off "
                  "included, as the decode half is submitted with the prefill half).",
                  "", &m->ttft);
        hist_text(t, "pdserve_inter_token_latency_seconds",
                  "Between consecutive tokens of a request.", "", &m->itl);
    }
    hist_text(t, "pdserve_e2e_latency_seconds", "From submit to the terminal event on this node.",
              "", &m->e2e);
    if (computes_prompts(m->role))
        hist_text(t, "pdserve_prefill_compute_seconds",
                  "From admission to the result of the prompt's last chunk.", "", &m->prefill);
    if (!transfers(m->role)) return;
    hist_text(t, "pdserve_transfer_latency_seconds",
              "The hand-off: prefill, from the final send posted to the transport's success; "
              "decode, from the destination sent to the data committed.",
              "", &m->xfer);
    family(t, "pdserve_transfer_bytes_total", "counter",
           "Bytes of KV pages, Mamba state and metadata rows posted (prefill) or received "
           "(decode) in hand-offs.");
    sample_u64(t, "pdserve_transfer_bytes_total", "", m->xfer_bytes);
    if (m->role == PD_NODE_PREFILL)
        hist_text(t, "pdserve_transfer_throughput_bytes_per_second",
                  "A room's bytes over the time from its first send posted to success.", "",
                  &m->xfer_rate);
}

/* KV pages held by requests (neither free nor evictable cache), as SGLang's
 * token_usage counts them. */
static double kv_usage(pd_ledger *l) {
    for (int pid = 0; pid < pd_ledger_pool_count(l); pid++) {
        pd_pool *p = pd_ledger_pool(l, pid);
        if (pd_pool_kind_of(p) != PD_POOL_KV || pd_pool_total(p) == 0) continue;
        uint64_t idle = pd_ledger_count(l, pid, PD_UNIT_FREE) +
            pd_ledger_count(l, pid, PD_UNIT_CACHE_EVICTABLE);
        PD_ASSERT(idle <= pd_pool_total(p));
        return (double)(pd_pool_total(p) - idle) / (double)pd_pool_total(p);
    }
    return 0.0;
}

/* SGLang's scheduler gauges. */
static void sglang_gauges(pd_strbuf *t, const node_metrics *m, const pd_engine_counters *c,
                          pd_ledger *l, uint64_t now_us) {
    const char *lb = m->labels;
    family(t, "sglang:num_running_reqs", "gauge", "The number of running requests.");
    sample_u64(t, "sglang:num_running_reqs", lb, c->running);
    family(t, "sglang:num_queue_reqs", "gauge",
           "The number of requests waiting for admission to compute (waiting and loading).");
    sample_u64(t, "sglang:num_queue_reqs", lb, c->queued_waiting + c->loading);
    family(t, "sglang:token_usage", "gauge", "Fraction of the KV pool held by requests.");
    sample(t, "sglang:token_usage", lb, kv_usage(l));
    const totals *o = &m->older;
    uint64_t prompt = m->now.prompt - o->prompt;
    family(t, "sglang:cache_hit_rate", "gauge",
           "Prompt tokens taken from the prefix cache over prompt tokens, of the requests "
           "admitted that ended in the last 5 to 10 s.");
    sample(t, "sglang:cache_hit_rate", lb,
           prompt ? (double)(m->now.cached - o->cached) / (double)prompt : 0.0);
    if (m->role == PD_NODE_PREFILL) {
        family(t, "sglang:num_prefill_prealloc_queue_reqs", "gauge",
               "Requests waiting for their bootstrap (the bootstrap queue).");
        sample_u64(t, "sglang:num_prefill_prealloc_queue_reqs", lb, c->queued_bootstrap);
        family(t, "sglang:num_prefill_inflight_queue_reqs", "gauge",
               "Requests computed and handing over (parked or transferring).");
        sample_u64(t, "sglang:num_prefill_inflight_queue_reqs", lb, c->transferring + c->parked);
    }
    if (m->role == PD_NODE_DECODE) {
        family(t, "sglang:num_decode_prealloc_queue_reqs", "gauge",
               "Requests waiting for memory to receive into.");
        sample_u64(t, "sglang:num_decode_prealloc_queue_reqs", lb, c->prealloc);
        family(t, "sglang:num_decode_transfer_queue_reqs", "gauge",
               "Requests whose destination is sent, waiting for their data.");
        sample_u64(t, "sglang:num_decode_transfer_queue_reqs", lb, c->wait_transfer);
    }
    if (!emits_tokens(m->role)) return;
    double window_s = seconds_between(o->t_us, now_us);
    family(t, "sglang:gen_throughput", "gauge",
           "The generation throughput (token/s) over the last 5 to 10 s.");
    sample(t, "sglang:gen_throughput", lb,
           window_s > 0 ? (double)(m->now.generated - o->generated) / window_s : 0.0);
}

/* SGLang's request families: on the node that ends the request only, as a
 * client sees it. */
static void sglang_requests(pd_strbuf *t, const node_metrics *m) {
    if (!emits_tokens(m->role)) return;
    const char *lb = m->labels;
    family(t, "sglang:prompt_tokens_total", "counter",
           "Number of prompt tokens of the requests that ended.");
    sample_u64(t, "sglang:prompt_tokens_total", lb, m->prompt_tokens);
    family(t, "sglang:generation_tokens_total", "counter",
           "Number of generated tokens of the requests that ended.");
    sample_u64(t, "sglang:generation_tokens_total", lb, m->completion_tokens);
    hist_text(t, "sglang:time_to_first_token_seconds",
              "Histogram of time to first token in seconds.", lb, &m->ttft);
    hist_text(t, "sglang:inter_token_latency_seconds",
              "Histogram of inter-token latency in seconds.", lb, &m->itl);
    hist_text(t, "sglang:e2e_request_latency_seconds",
              "Histogram of End-to-end request latency in seconds", lb, &m->e2e);
}

void node_metrics_text(const node_metrics *m, pd_strbuf *t, const pd_engine_counters *c,
                       pd_ledger *l, uint64_t now_us) {
    latency_text(t, m);
    sglang_gauges(t, m, c, l, now_us);
    sglang_requests(t, m);
}

/* ---- the request log ------------------------------------------------------------------ */

static json_t *ms_or_null(uint64_t from_us, uint64_t to_us) {
    if (!from_us || !to_us || to_us < from_us) return json_null();
    return json_real((double)(to_us - from_us) / 1000.0);
}

/* How long the request waited for this node's memory: admission (prefill,
 * colocated) or the destination sent (decode). */
static uint64_t queue_end_us(pd_node_role role, const pd_terminal_event *ev) {
    return role == PD_NODE_DECODE ? ev->xfer_start_us : ev->admit_us;
}

static void log_terminal(json_t *o, pd_node_role role, const call *c, const pd_terminal_event *ev,
                         uint64_t now_us) {
    json_object_set_new(o, "outcome", json_string(pd_terminal_kind_name(ev->kind)));
    json_object_set_new(o, "finish_reason",
                        ev->finish == PD_FINISH_NONE
                            ? json_null()
                            : json_string(pd_finish_reason_name(ev->finish)));
    json_object_set_new(o, "status", json_integer(ev->status_code));
    json_object_set_new(o, "prompt_tokens", json_integer(ev->prompt_tokens));
    json_object_set_new(o, "completion_tokens", json_integer(ev->completion_tokens));
    json_object_set_new(o, "cached_tokens", json_integer(ev->cached_tokens));
    json_object_set_new(o, "queue_ms", ms_or_null(ev->submit_us, queue_end_us(role, ev)));
    json_object_set_new(o, "ttft_ms", ms_or_null(c->t_submit_us, c->t_first_us));
    json_object_set_new(o, "e2e_ms", ms_or_null(ev->submit_us, now_us));
    if (computes_prompts(role))
        json_object_set_new(o, "prefill_ms", ms_or_null(ev->admit_us, ev->computed_us));
    if (transfers(role)) {
        json_object_set_new(o, "transfer_ms", ms_or_null(ev->xfer_start_us, ev->xfer_done_us));
        json_object_set_new(o, "transfer_bytes", json_integer((json_int_t)ev->xfer_bytes));
    }
    const char *msg = c->hung_up ? "the client hung up" : ev->message ? ev->message : "";
    if (msg[0]) json_object_set_new(o, "message", json_string(msg));
}

static void log_rejected(json_t *o, const call *c) {
    json_object_set_new(o, "outcome", json_string("rejected"));
    json_object_set_new(o, "finish_reason", json_null());
    json_object_set_new(o, "status", json_integer(c->reject.status ? c->reject.status : 500));
    json_object_set_new(o, "prompt_tokens", json_integer(c->prompt_len));
    json_object_set_new(o, "completion_tokens", json_integer(0));
    json_object_set_new(o, "cached_tokens", json_integer(0));
    json_object_set_new(o, "queue_ms", json_null());
    json_object_set_new(o, "ttft_ms", json_null());
    json_object_set_new(o, "e2e_ms", json_real(0.0));
    json_object_set_new(o, "message", json_string(c->reject.message));
}

char *node_request_line(pd_node_role role, const call *c, const pd_terminal_event *ev,
                        uint64_t now_us) {
    json_t *o = json_object();
    if (!o) return NULL;
    json_object_set_new(o, "rid", json_string(c->rid));
    json_object_set_new(o, "role", json_string(pd_node_role_name(role)));
    if (ev) log_terminal(o, role, c, ev, now_us);
    else log_rejected(o, c);
    if (c->hung_up) json_object_set_new(o, "client_hung_up", json_true());
    /* Compact: one line, whatever the strings hold (JSON escapes newlines). */
    char *line = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(9));
    json_decref(o);
    PD_ASSERT(!line || !strchr(line, '\n'));
    return line;
}
