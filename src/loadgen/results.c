/*
 * A benchmark's figures: SGLang bench_serving's names where it has the
 * figure (so tooling that reads its --output-file reads ours), pdserve's
 * own under "pdserve". Latency statistics cover completed requests only,
 * as SGLang's do; aborted, failed and refused requests are counted apart.
 * Percentiles interpolate linearly between order statistics (numpy's
 * default), std is the population's.
 */
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "loadgen_internal.h"

/* ---- SLOs ---------------------------------------------------------------------------- */

bool pd_lg_slo_parse(const char *s, pd_lg_slo *out, char *err, size_t cap) {
    *out = (pd_lg_slo){0};
    char buf[256];
    if (snprintf(buf, sizeof(buf), "%s", s) >= (int)sizeof(buf))
        return pd_errorf(err, cap, PD_ERR_TOOBIG, "--slo is too long"), false;
    for (char *save = NULL, *kv = strtok_r(buf, ",", &save); kv; kv = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(kv, '=');
        if (!eq)
            return pd_errorf(err, cap, PD_ERR_PARSE, "--slo: '%s' is not KEY=VALUE", kv), false;
        *eq = '\0';
        char *end;
        double v = strtod(eq + 1, &end);
        double scale = !strcmp(end, "ms") ? 1 : !strcmp(end, "s") ? 1000 : -1;
        if (end == eq + 1 || scale < 0 || !(v > 0) || !isfinite(v))
            return pd_errorf(err, cap, PD_ERR_PARSE,
                             "--slo %s: '%s' is not a positive time with its unit (200ms, 1.5s)",
                             kv, eq + 1),
                   false;
        double *slot = !strcmp(kv, "ttft") ? &out->ttft_ms
            : !strcmp(kv, "tpot")          ? &out->tpot_ms
            : !strcmp(kv, "itl")           ? &out->itl_ms
            : !strcmp(kv, "e2e")           ? &out->e2e_ms
                                           : NULL;
        if (!slot)
            return pd_errorf(err, cap, PD_ERR_PARSE,
                             "--slo: unknown key '%s' (ttft, tpot, itl or e2e)", kv),
                   false;
        *slot = v * scale;
    }
    return true;
}

/* ---- statistics ---------------------------------------------------------------------- */

typedef struct series {
    double *v;
    size_t n, cap;
} series;

static void series_add(series *s, double v) {
    if (s->n == s->cap) {
        s->cap = s->cap ? s->cap * 2 : 256;
        s->v = realloc(s->v, s->cap * sizeof(double));
        PD_ASSERT(s->v);
    }
    s->v[s->n++] = v;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double percentile(const series *s, double q) {
    double pos = q / 100.0 * (double)(s->n - 1);
    size_t lo = (size_t)floor(pos), hi = PD_MIN(lo + 1, s->n - 1);
    return s->v[lo] + (s->v[hi] - s->v[lo]) * (pos - (double)lo);
}

/* mean, median, std, p90, p99, max of a series in seconds, as *_<name>_ms
 * (null when empty). Sorts it. */
static void put_stats(json_t *o, const char *name, series *s) {
    static const char *const stat[] = {"mean", "median", "std", "p90", "p99", "max"};
    double v[6] = {0};
    if (s->n) {
        qsort(s->v, s->n, sizeof(double), cmp_double);
        double sum = 0, sq = 0;
        for (size_t i = 0; i < s->n; i++) sum += s->v[i];
        v[0] = sum / (double)s->n;
        for (size_t i = 0; i < s->n; i++) sq += (s->v[i] - v[0]) * (s->v[i] - v[0]);
        v[1] = percentile(s, 50);
        v[2] = sqrt(sq / (double)s->n);
        v[3] = percentile(s, 90);
        v[4] = percentile(s, 99);
        v[5] = s->v[s->n - 1];
    }
    for (int k = 0; k < 6; k++) {
        char key[64];
        snprintf(key, sizeof(key), "%s_%s_ms", stat[k], name);
        json_object_set_new(o, key, s->n ? json_real(v[k] * 1e3) : json_null());
    }
}

/* ---- the JSON ------------------------------------------------------------------------ */

static const char *backend_name(pd_lg_api api) {
    return api == PD_LG_API_COMPLETIONS ? "openai-completions"
        : api == PD_LG_API_CHAT         ? "openai-chat"
                                        : "pdserve-generate";
}

static bool meets_slo(const pd_lg_result *r, double tpot, const pd_lg_slo *slo) {
    if (slo->ttft_ms > 0 && r->ttft_s * 1e3 > slo->ttft_ms) return false;
    if (slo->tpot_ms > 0 && tpot * 1e3 > slo->tpot_ms) return false;
    if (slo->e2e_ms > 0 && (r->end_s - r->start_s) * 1e3 > slo->e2e_ms) return false;
    for (uint32_t k = 0; slo->itl_ms > 0 && k < r->n_itl; k++)
        if (r->itl[k] * 1e3 > slo->itl_ms) return false;
    return true;
}

typedef struct totals {
    uint64_t count[PD_LG_REFUSED + 1];
    uint64_t input, output, cached, good;
    double e2e_sum;
    series ttft, tpot, itl, e2e;
} totals;

static void tally(const pd_lg_dataset *d, const pd_lg_results *r, const pd_lg_slo *slo, totals *t) {
    for (uint32_t i = 0; i < d->n; i++) {
        const pd_lg_result *x = &r->r[i];
        if (d->reqs[i].warmup || x->outcome == PD_LG_NOT_SENT) continue;
        t->count[x->outcome]++;
        t->e2e_sum += x->end_s - x->start_s;
        if (x->outcome != PD_LG_COMPLETED) continue;
        t->input += x->prompt_tokens;
        t->output += x->output_tokens;
        t->cached += x->cached_tokens;
        double e2e = x->end_s - x->start_s, tpot = 0;
        series_add(&t->e2e, e2e);
        if (x->ttft_s >= 0) series_add(&t->ttft, x->ttft_s);
        if (x->output_tokens > 1 && x->ttft_s >= 0) {
            tpot = (e2e - x->ttft_s) / (double)(x->output_tokens - 1);
            series_add(&t->tpot, tpot);
        }
        for (uint32_t k = 0; k < x->n_itl; k++) series_add(&t->itl, x->itl[k]);
        if (slo && meets_slo(x, tpot, slo)) t->good++;
    }
}

static json_t *slo_json(const pd_lg_slo *slo) {
    if (!slo) return json_null();
    double v[] = {slo->ttft_ms, slo->tpot_ms, slo->itl_ms, slo->e2e_ms};
    const char *k[] = {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"};
    json_t *o = json_object();
    for (int i = 0; i < 4; i++)
        json_object_set_new(o, k[i], v[i] > 0 ? json_real(v[i]) : json_null());
    return o;
}

static void put_header(json_t *o, const pd_lg_run_config *c, const pd_lg_dataset_config *dc,
                       uint64_t measured) {
    json_object_set_new(o, "backend", json_string(backend_name(c->api)));
    json_object_set_new(o, "dataset_name", json_string(pd_lg_kind_name(dc->kind)));
    json_object_set_new(o, "request_rate",
                        dc->request_rate > 0 ? json_real(dc->request_rate) : json_null());
    json_object_set_new(o, "burstiness", json_real(dc->burstiness));
    json_object_set_new(o, "max_concurrency",
                        c->max_concurrency ? json_integer(c->max_concurrency) : json_null());
    json_object_set_new(o, "seed", json_integer((json_int_t)dc->seed));
    json_object_set_new(o, "num_prompts", json_integer((json_int_t)measured));
    json_object_set_new(o, "random_input_len", json_integer(dc->input_len));
    json_object_set_new(o, "random_output_len", json_integer(dc->output_len));
    json_object_set_new(o, "random_range_ratio", json_real(dc->range_ratio));
}

static void put_totals(json_t *o, const totals *t, double dur, const pd_lg_slo *slo) {
    double div = dur > 0 ? dur : 1;
    json_object_set_new(o, "duration", json_real(dur));
    static const char *const names[] = {NULL, "completed", "aborted", "failed", "refused"};
    for (int k = PD_LG_COMPLETED; k <= PD_LG_REFUSED; k++)
        json_object_set_new(o, names[k], json_integer((json_int_t)t->count[k]));
    json_object_set_new(o, "total_input_tokens", json_integer((json_int_t)t->input));
    json_object_set_new(o, "total_output_tokens", json_integer((json_int_t)t->output));
    json_object_set_new(o, "cache_hit_tokens", json_integer((json_int_t)t->cached));
    json_object_set_new(o, "request_throughput",
                        json_real((double)t->count[PD_LG_COMPLETED] / div));
    json_object_set_new(o, "input_throughput", json_real((double)t->input / div));
    json_object_set_new(o, "output_throughput", json_real((double)t->output / div));
    json_object_set_new(o, "total_throughput", json_real((double)(t->input + t->output) / div));
    json_object_set_new(o, "goodput", slo ? json_real((double)t->good / div) : json_null());
    json_object_set_new(o, "good_requests", slo ? json_integer((json_int_t)t->good) : json_null());
    json_object_set_new(o, "slo", slo_json(slo));
    json_object_set_new(o, "concurrency", json_real(t->e2e_sum / div));
}

static json_t *opt_seconds(double v) { return v >= 0 ? json_real(v) : json_null(); }

/* SGLang's per-request arrays, over the measured requests that were sent. */
static void put_arrays(json_t *o, const pd_lg_dataset *d, const pd_lg_results *r) {
    json_t *in = json_array(), *out = json_array(), *ttfts = json_array(), *itls = json_array(),
           *errs = json_array();
    for (uint32_t i = 0; i < d->n; i++) {
        const pd_lg_result *x = &r->r[i];
        if (d->reqs[i].warmup || x->outcome == PD_LG_NOT_SENT) continue;
        json_array_append_new(in, json_integer(x->prompt_tokens));
        json_array_append_new(out, json_integer(x->output_tokens));
        json_array_append_new(ttfts, opt_seconds(x->ttft_s));
        json_t *a = json_array();
        for (uint32_t k = 0; k < x->n_itl; k++) json_array_append_new(a, json_real(x->itl[k]));
        json_array_append_new(itls, a);
        json_array_append_new(errs, json_string(x->error));
    }
    json_object_set_new(o, "input_lens", in);
    json_object_set_new(o, "output_lens", out);
    json_object_set_new(o, "ttfts", ttfts);
    json_object_set_new(o, "itls", itls);
    json_object_set_new(o, "errors", errs);
}

static json_t *requests_json(const pd_lg_run_config *c, const pd_lg_dataset *d,
                             const pd_lg_results *r) {
    json_t *a = json_array();
    for (uint32_t i = 0; i < d->n; i++) {
        const pd_lg_result *x = &r->r[i];
        if (d->reqs[i].warmup || x->outcome == PD_LG_NOT_SENT) continue;
        char rid[64];
        snprintf(rid, sizeof(rid), "%u", i);
        json_t *ab = json_null();
        if (x->abort_at_s >= 0)
            ab = json_pack("{s:s,s:f}", "mode", pd_lg_abort_name(d->reqs[i].abort), "at_s",
                           x->abort_at_s);
        json_array_append_new(
            a,
            json_pack("{s:i,s:f,s:f,s:o,s:s,s:o,s:i,s:i,s:i,s:i,s:s}", "index", (json_int_t)i,
                      "start_s", x->start_s, "end_s", x->end_s, "ttft_s", opt_seconds(x->ttft_s),
                      "outcome", pd_lg_outcome_name(x->outcome), "abort", ab, "status",
                      (json_int_t)x->status, "input_len", (json_int_t)x->prompt_tokens,
                      "output_len", (json_int_t)x->output_tokens, "cached_tokens",
                      (json_int_t)x->cached_tokens, "error", x->error));
    }
    (void)c;
    return a;
}

static json_t *u32_array(const uint32_t *v, uint32_t n, double scale) {
    json_t *a = json_array();
    for (uint32_t i = 0; i < n; i++)
        json_array_append_new(a, scale > 0 ? json_real(v[i] * scale) : json_integer(v[i]));
    return a;
}

static json_t *timeline_json(const pd_lg_run_config *c, const pd_lg_results *r) {
    double iv = c->timeline_interval_s;
    json_t *t = json_array();
    for (uint32_t k = 0; k < r->n_intervals; k++) json_array_append_new(t, json_real((k + 1) * iv));
    return json_pack("{s:f,s:o,s:o,s:o,s:o}", "interval_s", iv, "t_s", t, "requests_done_per_s",
                     u32_array(r->done, r->n_intervals, 1.0 / iv), "output_tokens_per_s",
                     u32_array(r->tokens, r->n_intervals, 1.0 / iv), "concurrency",
                     u32_array(r->inflight, r->n_intervals, 0));
}

static json_t *aborts_json(const pd_lg_results *r) {
    json_t *a = json_array();
    for (uint32_t k = 0; k < r->n_aborts; k++) {
        const pd_lg_abort_event *e = &r->aborts[k];
        json_array_append_new(
            a,
            json_pack("{s:f,s:s,s:o}", "t_s", e->t_s, "kind",
                      e->kind == PD_LG_ABORT_NONE ? "all" : pd_lg_abort_name(e->kind), "index",
                      e->req >= 0 ? json_integer(e->req) : json_null()));
    }
    return a;
}

static json_t *pools_json(const pd_lg_node_sample *s) {
    json_t *a = json_array();
    for (uint32_t i = 0; i < s->n_pools; i++) {
        const pd_lg_pool_sample *p = &s->pools[i];
        json_array_append_new(
            a,
            json_pack("{s:s,s:I,s:I,s:I,s:I,s:I,s:I}", "name", p->name, "total",
                      (json_int_t)p->total, "free", (json_int_t)p->free, "req", (json_int_t)p->req,
                      "cache_evictable", (json_int_t)p->cache_evictable, "cache_protected",
                      (json_int_t)p->cache_protected, "quarantine", (json_int_t)p->quarantine));
    }
    return a;
}

static json_t *node_json(const pd_lg_node *n) {
    json_t *samples = json_array();
    for (uint32_t k = 0; k < n->n_samples; k++)
        json_array_append_new(
            samples,
            json_pack("{s:f,s:o}", "t_s", n->samples[k].t_s, "pools", pools_json(&n->samples[k])));
    json_t *last = n->has_last ? pools_json(&n->last) : json_array();
    json_t *check = json_pack("{s:b,s:f,s:s,s:o}", "passed", n->passed, "waited_s", n->waited_s,
                              "problem", n->problem, "pools", last);
    json_t *o = json_pack("{s:s,s:s,s:o,s:o}", "url", n->url, "role", n->role, "samples", samples,
                          "idle_check", check);
    bool counted = n->has_counters && n->checked && n->cached1 >= n->cached0;
    json_object_set_new(o, "cached_tokens",
                        counted ? json_integer((json_int_t)(n->cached1 - n->cached0))
                                : json_null());
    json_object_set_new(o, "prefill_tokens",
                        counted && n->prefill1 >= n->prefill0
                            ? json_integer((json_int_t)(n->prefill1 - n->prefill0))
                            : json_null());
    return o;
}

static json_t *pdserve_json(const pd_lg_run_config *c, const pd_lg_dataset *d,
                            const pd_lg_results *r) {
    json_t *nodes = json_array();
    bool all = true, any_cached = false;
    uint64_t cached = 0;
    for (uint32_t k = 0; k < r->n_nodes; k++) {
        const pd_lg_node *n = &r->nodes[k];
        json_array_append_new(nodes, node_json(n));
        all = all && n->passed;
        /* the prefix caches that prompts go through: prefill and serve nodes */
        if (n->has_counters && n->checked && n->cached1 >= n->cached0 &&
            strcmp(n->role, "decode")) {
            cached += n->cached1 - n->cached0;
            any_cached = true;
        }
    }
    return json_pack(
        "{s:s,s:s,s:s,s:o,s:o,s:o,s:o,s:o,s:o}", "version", PD_VERSION, "url", c->base_url,
        "endpoint", c->endpoint ? c->endpoint : pd_lg_api_endpoint(c->api), "requests",
        requests_json(c, d, r), "timeline", timeline_json(c, r), "aborts", aborts_json(r), "nodes",
        nodes, "idle_check_passed", r->n_nodes ? json_boolean(all) : json_null(),
        "node_cache_hit_tokens", any_cached ? json_integer((json_int_t)cached) : json_null());
}

void *pd_lg_results_json(const pd_lg_run_config *c, const pd_lg_dataset_config *dc,
                         const pd_lg_dataset *d, const pd_lg_results *r, const pd_lg_slo *slo) {
    totals t = {0};
    tally(d, r, slo, &t);
    uint64_t measured = 0;
    for (int k = PD_LG_COMPLETED; k <= PD_LG_REFUSED; k++) measured += t.count[k];
    json_t *o = json_object();
    put_header(o, c, dc, measured);
    put_totals(o, &t, r->duration_s, slo);
    put_stats(o, "ttft", &t.ttft);
    put_stats(o, "tpot", &t.tpot);
    put_stats(o, "itl", &t.itl);
    put_stats(o, "e2e_latency", &t.e2e);
    put_arrays(o, d, r);
    json_object_set_new(o, "pdserve", pdserve_json(c, d, r));
    free(t.ttft.v);
    free(t.tpot.v);
    free(t.itl.v);
    free(t.e2e.v);
    return o;
}
