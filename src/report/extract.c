/*
 * The results JSON read into the report's model (report.h).
 *
 * Every field the report uses is checked here, once: a required one missing
 * or any one of the wrong type stops the extraction with a message naming
 * it by its path ("pdserve.nodes[1].samples[4].pools[0].free: expected a
 * number, found a string"). null is accepted wherever the schema allows an
 * empty statistic, and reads as NAN ("—" on the page). Strings are borrowed
 * from the JSON, which outlives the model.
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "report.h"

enum { OPT = 0, REQ = 1 };

typedef struct ctx {
    char *err;
    size_t errlen;
    pd_err code; /* the first error; PD_OK while none */
} ctx;

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static void
fail(ctx *c, pd_err code, const char *fmt, ...) {
    if (c->code != PD_OK) return; /* the first error names the problem */
    c->code = code;
    if (!c->err || !c->errlen) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->err, c->errlen, fmt, ap);
    va_end(ap);
}

static const char *type_name(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT: return "an object";
    case JSON_ARRAY: return "an array";
    case JSON_STRING: return "a string";
    case JSON_INTEGER:
    case JSON_REAL: return "a number";
    case JSON_TRUE:
    case JSON_FALSE: return "a boolean";
    default: return "null";
    }
}

/* obj[key] or NULL when absent or null; a required one absent or null is an
 * error. `where` is obj's path ("" at the top). */
static const json_t *field(ctx *c, const json_t *obj, const char *where, const char *key,
                           int flags) {
    const json_t *v = json_object_get(obj, key);
    if (v && !json_is_null(v)) return v;
    if (flags & REQ)
        fail(c, PD_ERR_PARSE, "%s%s%s: %s (required)", where, *where ? "." : "", key,
             v ? "null" : "missing");
    return NULL;
}

static bool check_type(ctx *c, const json_t *v, bool ok, const char *where, const char *key,
                       const char *want) {
    if (ok) return true;
    fail(c, PD_ERR_PARSE, "%s%s%s: expected %s, found %s", where, *where && *key ? "." : "", key,
         want, type_name(v));
    return false;
}

/* JSON numbers are finite, but products and sums of ones near DBL_MAX are
 * not: every number is kept within +-1e300, so the charts' arithmetic
 * (ms, stacked bands, headroom) never makes an infinity or a NaN. */
static double finite_value(const json_t *v) {
    double d = json_number_value(v);
    return d > 1e300 ? 1e300 : d < -1e300 ? -1e300 : d;
}

static double num(ctx *c, const json_t *obj, const char *where, const char *key, int flags) {
    const json_t *v = field(c, obj, where, key, flags);
    if (!v || !check_type(c, v, json_is_number(v), where, key, "a number")) return NAN;
    return finite_value(v);
}

static const char *str(ctx *c, const json_t *obj, const char *where, const char *key, int flags) {
    const json_t *v = field(c, obj, where, key, flags);
    if (!v || !check_type(c, v, json_is_string(v), where, key, "a string")) return NULL;
    return json_string_value(v);
}

static const json_t *arr(ctx *c, const json_t *obj, const char *where, const char *key, int flags) {
    const json_t *v = field(c, obj, where, key, flags);
    if (!v || !check_type(c, v, json_is_array(v), where, key, "an array")) return NULL;
    return v;
}

static const json_t *obj_of(ctx *c, const json_t *obj, const char *where, const char *key,
                            int flags) {
    const json_t *v = field(c, obj, where, key, flags);
    if (!v || !check_type(c, v, json_is_object(v), where, key, "an object")) return NULL;
    return v;
}

/* true -> 1, false -> 0, null or absent -> -1. */
static int tri(ctx *c, const json_t *obj, const char *where, const char *key) {
    const json_t *v = field(c, obj, where, key, OPT);
    if (!v || !check_type(c, v, json_is_boolean(v), where, key, "true, false or null")) return -1;
    return json_is_true(v) ? 1 : 0;
}

static double *alloc_doubles(ctx *c, size_t n) {
    double *p = malloc((n ? n : 1) * sizeof(double));
    if (!p) fail(c, PD_ERR_NOMEM, "out of memory for %zu values", n);
    return p;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* A double's bits as an unsigned key in the same order (JSON has no NaN):
 * the sign bit set for positives, every bit flipped for negatives. */
static uint64_t order_key(double d) {
    uint64_t u;
    memcpy(&u, &d, sizeof(u));
    return u >> 63 ? ~u : u | (1ull << 63);
}

static double from_key(uint64_t k) {
    uint64_t u = k >> 63 ? k & ~(1ull << 63) : ~k;
    double d;
    memcpy(&d, &u, sizeof(d));
    return d;
}

/* Sorted ascending. A run of 100,000 requests has millions of ITLs: an LSD
 * radix sort over the keys' bytes (skipping a byte every key shares) takes
 * a fraction of qsort's time; qsort remains when no scratch memory is had. */
static void sort_vec(rpt_vec *v) {
    if (v->n < 2) return;
    uint64_t *a = malloc(v->n * sizeof(uint64_t)), *b = malloc(v->n * sizeof(uint64_t));
    if (!a || !b) {
        free(a);
        free(b);
        qsort(v->v, v->n, sizeof(double), cmp_double);
        return;
    }
    for (size_t i = 0; i < v->n; i++) a[i] = order_key(v->v[i]);
    for (int shift = 0; shift < 64; shift += 8) {
        size_t count[257] = {0};
        for (size_t i = 0; i < v->n; i++) count[((a[i] >> shift) & 0xff) + 1]++;
        if (count[((a[0] >> shift) & 0xff) + 1] == v->n) continue; /* one value: no move */
        for (int d = 0; d < 256; d++) count[d + 1] += count[d];
        for (size_t i = 0; i < v->n; i++) b[count[(a[i] >> shift) & 0xff]++] = a[i];
        uint64_t *t = a;
        a = b;
        b = t;
    }
    for (size_t i = 0; i < v->n; i++) v->v[i] = from_key(a[i]);
    free(a);
    free(b);
}

/* ---- what was run, and the summary ----------------------------------------------------- */

static void extract_summary(ctx *c, const json_t *r, rpt_model *m) {
    m->backend = str(c, r, "", "backend", OPT);
    m->dataset = str(c, r, "", "dataset_name", OPT);
    m->request_rate = num(c, r, "", "request_rate", OPT);
    m->burstiness = num(c, r, "", "burstiness", OPT);
    m->max_concurrency = num(c, r, "", "max_concurrency", OPT);
    m->seed = num(c, r, "", "seed", OPT);
    m->duration = num(c, r, "", "duration", REQ);
    m->num_prompts = num(c, r, "", "num_prompts", REQ);
    m->completed = num(c, r, "", "completed", REQ);
    m->aborted = num(c, r, "", "aborted", REQ);
    m->failed = num(c, r, "", "failed", REQ);
    m->refused = num(c, r, "", "refused", REQ);
    m->total_input_tokens = num(c, r, "", "total_input_tokens", OPT);
    m->total_output_tokens = num(c, r, "", "total_output_tokens", OPT);
    m->cache_hit_tokens = num(c, r, "", "cache_hit_tokens", OPT);
    m->request_throughput = num(c, r, "", "request_throughput", OPT);
    m->input_throughput = num(c, r, "", "input_throughput", OPT);
    m->output_throughput = num(c, r, "", "output_throughput", OPT);
    m->total_throughput = num(c, r, "", "total_throughput", OPT);
    m->goodput = num(c, r, "", "goodput", OPT);
    m->good_requests = num(c, r, "", "good_requests", OPT);
    m->concurrency = num(c, r, "", "concurrency", OPT);
    const json_t *slo = obj_of(c, r, "", "slo", OPT);
    static const char *const slo_key[RPT_METRICS] = {"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"};
    m->has_slo = slo != NULL;
    for (int i = 0; i < RPT_METRICS; i++)
        m->slo_ms[i] = slo ? num(c, slo, "slo", slo_key[i], OPT) : NAN;
    static const char *const metric[RPT_METRICS] = {"ttft", "tpot", "itl", "e2e_latency"};
    static const char *const stat[RPT_STATS] = {"mean", "median", "p90", "p99", "max"};
    for (int i = 0; i < RPT_METRICS; i++) {
        for (int s = 0; s < RPT_STATS; s++) {
            char key[48];
            snprintf(key, sizeof(key), "%s_%s_ms", stat[s], metric[i]);
            m->stat[i][s] = num(c, r, "", key, OPT);
        }
    }
}

/* ---- requests and ITLs ------------------------------------------------------------------- */

static void extract_request(ctx *c, const json_t *q, size_t i, rpt_model *m) {
    char w[128];
    snprintf(w, sizeof(w), "pdserve.requests[%zu]", i);
    if (!check_type(c, q, json_is_object(q), w, "", "an object")) return;
    double start = num(c, q, w, "start_s", REQ), end = num(c, q, w, "end_s", REQ);
    double ttft = num(c, q, w, "ttft_s", OPT);
    const char *outcome = str(c, q, w, "outcome", REQ);
    str(c, q, w, "rid", OPT);
    str(c, q, w, "error", OPT);
    num(c, q, w, "status", OPT);
    if (c->code) return;
    bool completed = !strcmp(outcome, "completed");
    bool failed = !strcmp(outcome, "failed") || !strcmp(outcome, "refused");
    if (!completed && !failed && strcmp(outcome, "aborted")) {
        fail(c, PD_ERR_PARSE,
             "%s.outcome: \"%.40s\" is none of completed, aborted, failed, refused", w, outcome);
        return;
    }
    if (completed) {
        m->e2e_ms.v[m->e2e_ms.n++] = (end - start) * 1000.0;
        if (!isnan(ttft)) m->ttft_ms.v[m->ttft_ms.n++] = ttft * 1000.0;
    }
    if (failed && m->failures_n < RPT_FAILURES_SHOWN) m->failures[m->failures_n++] = q;
    m->failures_total += failed;
}

static void extract_requests(ctx *c, const json_t *pd, rpt_model *m) {
    const json_t *reqs = arr(c, pd, "pdserve", "requests", REQ);
    if (!reqs) return;
    size_t n = json_array_size(reqs);
    m->e2e_ms.v = alloc_doubles(c, n);
    m->ttft_ms.v = alloc_doubles(c, n);
    for (size_t i = 0; i < n && !c->code; i++) extract_request(c, json_array_get(reqs, i), i, m);
    sort_vec(&m->e2e_ms);
    sort_vec(&m->ttft_ms);
}

/* "itls": one array of seconds per request (null: none), flattened. */
static void extract_itls(ctx *c, const json_t *r, rpt_model *m) {
    const json_t *itls = arr(c, r, "", "itls", OPT);
    size_t total = 0, n = itls ? json_array_size(itls) : 0;
    char w[128];
    for (size_t i = 0; i < n && !c->code; i++) {
        const json_t *one = json_array_get(itls, i);
        snprintf(w, sizeof(w), "itls[%zu]", i);
        if (!json_is_null(one) && check_type(c, one, json_is_array(one), w, "", "an array"))
            total += json_array_size(one);
    }
    m->itl_ms.v = alloc_doubles(c, total);
    for (size_t i = 0; i < n && !c->code; i++) {
        const json_t *one = json_array_get(itls, i);
        for (size_t k = 0; k < json_array_size(one) && !c->code; k++) {
            const json_t *v = json_array_get(one, k);
            snprintf(w, sizeof(w), "itls[%zu][%zu]", i, k);
            if (check_type(c, v, json_is_number(v), w, "", "a number"))
                m->itl_ms.v[m->itl_ms.n++] = finite_value(v) * 1000.0;
        }
    }
    sort_vec(&m->itl_ms);
}

/* ---- timeline and aborts ------------------------------------------------------------------ */

/* tl[key]: an array of n numbers (null -> NAN); absent: all NAN. */
static double *timeline_series(ctx *c, const json_t *tl, const char *key, size_t n) {
    const json_t *a = arr(c, tl, "pdserve.timeline", key, OPT);
    double *out = alloc_doubles(c, n);
    if (c->code) return out;
    if (a && json_array_size(a) != n) {
        fail(c, PD_ERR_PARSE, "pdserve.timeline.%s: %zu values, but t_s has %zu", key,
             json_array_size(a), n);
        return out;
    }
    for (size_t i = 0; i < n && !c->code; i++) {
        const json_t *v = a ? json_array_get(a, i) : NULL;
        char w[128];
        snprintf(w, sizeof(w), "pdserve.timeline.%s[%zu]", key, i);
        out[i] = NAN;
        if (v && !json_is_null(v) && check_type(c, v, json_is_number(v), w, "", "a number"))
            out[i] = finite_value(v);
    }
    return out;
}

static void extract_timeline(ctx *c, const json_t *pd, rpt_model *m) {
    const json_t *tl = obj_of(c, pd, "pdserve", "timeline", OPT);
    if (!tl) return;
    m->interval_s = num(c, tl, "pdserve.timeline", "interval_s", OPT);
    const json_t *t = arr(c, tl, "pdserve.timeline", "t_s", REQ);
    if (!t) return;
    m->tl_n = json_array_size(t);
    m->tl_t = timeline_series(c, tl, "t_s", m->tl_n);
    for (size_t i = 0; i < m->tl_n && !c->code; i++) {
        if (isnan(m->tl_t[i]))
            fail(c, PD_ERR_PARSE, "pdserve.timeline.t_s[%zu]: null (required)", i);
    }
    m->tl_rps = timeline_series(c, tl, "requests_done_per_s", m->tl_n);
    m->tl_tps = timeline_series(c, tl, "output_tokens_per_s", m->tl_n);
    m->tl_conc = timeline_series(c, tl, "concurrency", m->tl_n);
}

static void extract_aborts(ctx *c, const json_t *pd, rpt_model *m) {
    const json_t *a = arr(c, pd, "pdserve", "aborts", OPT);
    size_t n = a ? json_array_size(a) : 0;
    m->abort_t = alloc_doubles(c, n);
    m->abort_kind = malloc(n ? n : 1);
    if (!m->abort_kind) fail(c, PD_ERR_NOMEM, "out of memory for %zu aborts", n);
    static const char *const kinds[RPT_ABORT_KINDS] = {"request", "close", "all"};
    for (size_t i = 0; i < n && !c->code; i++) {
        const json_t *e = json_array_get(a, i);
        char w[128];
        snprintf(w, sizeof(w), "pdserve.aborts[%zu]", i);
        if (!check_type(c, e, json_is_object(e), w, "", "an object")) break;
        double t = num(c, e, w, "t_s", REQ);
        const char *kind = str(c, e, w, "kind", REQ);
        str(c, e, w, "rid", OPT);
        if (c->code) break;
        int k = 0;
        while (k < RPT_ABORT_KINDS && strcmp(kinds[k], kind)) k++;
        if (k == RPT_ABORT_KINDS) {
            fail(c, PD_ERR_PARSE, "%s.kind: \"%.40s\" is none of request, close, all", w, kind);
            break;
        }
        m->abort_t[m->aborts_n] = t;
        m->abort_kind[m->aborts_n++] = (unsigned char)k;
        m->abort_count[k]++;
    }
}

/* ---- nodes -------------------------------------------------------------------------------- */

/* The pool's index in the node's series, added on first sight; -1 when the
 * node already has RPT_POOLS_MAX others. */
static int pool_slot(ctx *c, rpt_node *n, const char *name, const char *kind) {
    for (size_t i = 0; i < n->pools; i++)
        if (!strcmp(n->pool[i].name, name)) return (int)i;
    if (n->pools == RPT_POOLS_MAX) return -1;
    rpt_pool_series *p = &n->pool[n->pools];
    p->name = name;
    p->kind = kind;
    double **cols[] = {&p->total, &p->free, &p->req, &p->cache, &p->quarantine};
    for (size_t k = 0; k < PD_ARRAY_LEN(cols); k++) {
        *cols[k] = alloc_doubles(c, n->samples);
        for (size_t s = 0; *cols[k] && s < n->samples; s++) (*cols[k])[s] = NAN;
    }
    return (int)n->pools++;
}

/* One pool entry of a sample, or of the idle check (series NULL). */
static void extract_pool(ctx *c, const json_t *p, const char *w, double out[5]) {
    static const char *const keys[] = {"total",           "free",      "req", "cache_evictable",
                                       "cache_protected", "quarantine"};
    double v[6];
    for (int k = 0; k < 6; k++) v[k] = num(c, p, w, keys[k], REQ);
    out[0] = v[0];
    out[1] = v[1];
    out[2] = v[2];
    out[3] = v[3] + v[4];
    out[4] = v[5];
}

static void extract_sample(ctx *c, const json_t *s, const char *w, rpt_node *n, size_t si) {
    if (!check_type(c, s, json_is_object(s), w, "", "an object")) return;
    n->t_s[si] = num(c, s, w, "t_s", REQ);
    const json_t *pools = arr(c, s, w, "pools", REQ);
    for (size_t i = 0; pools && i < json_array_size(pools) && !c->code; i++) {
        const json_t *p = json_array_get(pools, i);
        char pw[192];
        snprintf(pw, sizeof(pw), "%s.pools[%zu]", w, i);
        if (!check_type(c, p, json_is_object(p), pw, "", "an object")) return;
        const char *name = str(c, p, pw, "name", REQ);
        const char *kind = str(c, p, pw, "kind", OPT);
        double v[5];
        extract_pool(c, p, pw, v);
        if (c->code) return;
        int slot = pool_slot(c, n, name, kind);
        if (slot < 0 || c->code) {
            n->pools_dropped += slot < 0 && si == 0;
            continue;
        }
        rpt_pool_series *ps = &n->pool[slot];
        ps->total[si] = v[0];
        ps->free[si] = v[1];
        ps->req[si] = v[2];
        ps->cache[si] = v[3];
        ps->quarantine[si] = v[4];
    }
}

/* The idle check: its verdict, and the pools it saw still held (units held
 * by requests or in quarantine), named for the page's banner. */
static void extract_idle(ctx *c, const json_t *node, const char *w, rpt_node *n) {
    char iw[128];
    snprintf(iw, sizeof(iw), "%s.idle_check", w);
    const json_t *ic = obj_of(c, node, w, "idle_check", OPT);
    n->idle = -1;
    n->idle_waited_s = NAN;
    if (!ic) return;
    n->idle = tri(c, ic, iw, "passed");
    n->idle_waited_s = num(c, ic, iw, "waited_s", OPT);
    n->idle_problem = str(c, ic, iw, "problem", OPT);
    const json_t *pools = arr(c, ic, iw, "pools", OPT);
    pd_strbuf sb;
    pd_strbuf_init(&sb, n->held, sizeof(n->held));
    for (size_t i = 0; pools && i < json_array_size(pools) && !c->code; i++) {
        const json_t *p = json_array_get(pools, i);
        char pw[192];
        snprintf(pw, sizeof(pw), "%s.pools[%zu]", iw, i);
        if (!check_type(c, p, json_is_object(p), pw, "", "an object")) return;
        const char *name = str(c, p, pw, "name", REQ);
        double v[5];
        extract_pool(c, p, pw, v);
        if (c->code || (v[2] <= 0 && v[4] <= 0)) continue;
        pd_strbuf_printf(&sb, "%s%s (req %.0f, quarantine %.0f)", sb.len ? ", " : "", name, v[2],
                         v[4]);
    }
}

static void extract_node(ctx *c, const json_t *node, size_t i, rpt_node *n) {
    char w[64];
    snprintf(w, sizeof(w), "pdserve.nodes[%zu]", i);
    if (!check_type(c, node, json_is_object(node), w, "", "an object")) return;
    n->url = str(c, node, w, "url", OPT);
    n->role = str(c, node, w, "role", OPT);
    const json_t *samples = arr(c, node, w, "samples", REQ);
    n->samples = samples ? json_array_size(samples) : 0;
    n->t_s = alloc_doubles(c, n->samples);
    for (size_t s = 0; s < n->samples && !c->code; s++) {
        char sw[128];
        snprintf(sw, sizeof(sw), "%s.samples[%zu]", w, s);
        extract_sample(c, json_array_get(samples, s), sw, n, s);
    }
    extract_idle(c, node, w, n);
}

static void extract_nodes(ctx *c, const json_t *pd, rpt_model *m) {
    const json_t *nodes = arr(c, pd, "pdserve", "nodes", OPT);
    size_t n = nodes ? json_array_size(nodes) : 0;
    m->nodes = calloc(n ? n : 1, sizeof(rpt_node));
    if (!m->nodes) {
        fail(c, PD_ERR_NOMEM, "out of memory for %zu nodes", n);
        return;
    }
    for (size_t i = 0; i < n && !c->code; i++) {
        m->nodes_n = i + 1;
        extract_node(c, json_array_get(nodes, i), i, &m->nodes[i]);
    }
}

pd_err rpt_extract(const json_t *results, rpt_model *m, char *err, size_t errlen) {
    memset(m, 0, sizeof(*m));
    ctx c = {.err = err, .errlen = errlen};
    if (err && errlen) err[0] = '\0';
    if (!results || !json_is_object(results)) {
        fail(&c, PD_ERR_PARSE, "results: expected an object, found %s",
             results ? type_name(results) : "nothing");
        return c.code;
    }
    extract_summary(&c, results, m);
    const json_t *pd = obj_of(&c, results, "", "pdserve", REQ);
    if (pd) {
        m->url = str(&c, pd, "pdserve", "url", OPT);
        m->endpoint = str(&c, pd, "pdserve", "endpoint", OPT);
        m->version = str(&c, pd, "pdserve", "version", OPT);
        m->idle_check_passed = tri(&c, pd, "pdserve", "idle_check_passed");
        extract_requests(&c, pd, m);
        extract_itls(&c, results, m);
        extract_timeline(&c, pd, m);
        extract_aborts(&c, pd, m);
        extract_nodes(&c, pd, m);
    }
    if (c.code) rpt_model_free(m);
    return c.code;
}

void rpt_model_free(rpt_model *m) {
    free(m->ttft_ms.v);
    free(m->itl_ms.v);
    free(m->e2e_ms.v);
    free(m->tl_t);
    free(m->tl_rps);
    free(m->tl_tps);
    free(m->tl_conc);
    free(m->abort_t);
    free(m->abort_kind);
    for (size_t i = 0; m->nodes && i < m->nodes_n; i++) {
        rpt_node *n = &m->nodes[i];
        free(n->t_s);
        for (size_t p = 0; p < n->pools; p++) {
            free(n->pool[p].total);
            free(n->pool[p].free);
            free(n->pool[p].req);
            free(n->pool[p].cache);
            free(n->pool[p].quarantine);
        }
    }
    free(m->nodes);
    memset(m, 0, sizeof(*m));
}
