/*
 * bench/radix — replays a request trace through the prefix cache the way a
 * scheduler handles each request: match, lock, allocate pages for the
 * uncached rest (evicting when needed), insert, free duplicates and the
 * partial tail page, unlock.
 *
 *   radix --trace FILE [--page-size N] [--pages N] [--hybrid] [--mamba-slots N]
 *         [--host-pages N] [--runs R] [--strict]
 *
 * Every run replays the whole trace on a fresh cache; figures are medians
 * over the runs. Each run replays it three times: with no prefix cache
 * (allocate every page, free it), so the cost of matching and inserting can
 * be read against plain allocation on the same machine state; through the
 * cache as it was before issue 13 (bench/radix_v0.c, a renamed copy); and
 * through the tree's cache. The two caches alternate which goes first. Each
 * request's hit tokens, and the pages evicted, must be the same for both:
 * any difference is printed and the benchmark exits 1.
 * The last four lines are the tree's cache: requests/s, tokens/s, mean us,
 * p99 us.
 */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "bench_util.h"
#include "pdserve/cache.h"
#include "radix_impl.h"

RADIX_IMPL_DEFINE(radix_impl_new, "after (this tree)")

typedef struct trace {
    int32_t **req;
    uint32_t *len;
    uint32_t n, cap;
    uint64_t tokens;
    uint32_t max_len;
} trace;

static int load_trace(const char *path, trace *t) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "radix: cannot open trace %s\n", path);
        return -1;
    }
    memset(t, 0, sizeof(*t));
    char *line = NULL;
    size_t line_cap = 0;
    ssize_t got;
    uint32_t lineno = 0;
    while ((got = getline(&line, &line_cap, f)) >= 0) {
        lineno++;
        uint32_t cap = 64, n = 0;
        int32_t *toks = malloc(cap * sizeof(int32_t));
        char *p = line;
        for (;;) {
            while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n') p++;
            if (!*p) break;
            char *end;
            long v = strtol(p, &end, 10);
            if (end == p || v < 0 || v > INT32_MAX) {
                fprintf(stderr, "radix: %s:%u: not a token id near \"%.16s\"\n", path, lineno, p);
                free(toks);
                free(line);
                fclose(f);
                return -1;
            }
            if (n == cap) toks = realloc(toks, (cap *= 2) * sizeof(int32_t));
            toks[n++] = (int32_t)v;
            p = end;
        }
        if (n == 0) {
            free(toks);
            continue;
        }
        if (t->n == t->cap) {
            t->cap = t->cap ? t->cap * 2 : 256;
            t->req = realloc(t->req, t->cap * sizeof(int32_t *));
            t->len = realloc(t->len, t->cap * sizeof(uint32_t));
        }
        t->req[t->n] = toks;
        t->len[t->n] = n;
        t->n++;
        t->tokens += n;
        if (n > t->max_len) t->max_len = n;
    }
    free(line);
    fclose(f);
    if (t->n == 0) {
        fprintf(stderr, "radix: trace %s has no requests\n", path);
        return -1;
    }
    return 0;
}

typedef struct opts {
    uint32_t page_size, pages, mamba_slots, host_pages;
    bool hybrid, strict, warm;
    int runs;
    const radix_impl *only; /* --only: that cache alone (profiling), no comparison */
} opts;

typedef struct result {
    double req_s, tok_s, mean_us, p99_us, hit_rate, host_rate;
    double cpu_us; /* the replay's thread CPU time per request */
    uint64_t evicted, skipped, hit_tokens;
} result;

/* One replay's node: the ledger, its pools, the cache, and page buffers
 * long enough for the trace's longest request. */
typedef struct node {
    pd_ledger *l;
    pd_pool *kv, *mamba, *host;
    int kv_id, mamba_id, host_id;
    const radix_impl *api;
    void *c;
    uint32_t max_pages;
    uint32_t *pages, *dups;
} node;

static void node_open(node *n, const opts *o, const radix_impl *api, uint32_t max_len) {
    *n = (node){.mamba_id = -1, .host_id = -1, .api = api};
    PD_MUST(pd_ledger_create(&n->l, o->strict));
    PD_MUST(pd_pool_create(&n->kv, "kv", PD_POOL_KV, o->pages, o->page_size));
    PD_MUST(pd_ledger_add_pool(n->l, n->kv, &n->kv_id));
    if (o->hybrid) {
        PD_MUST(pd_pool_create(&n->mamba, "mamba", PD_POOL_MAMBA, o->mamba_slots, 0));
        PD_MUST(pd_ledger_add_pool(n->l, n->mamba, &n->mamba_id));
    }
    if (o->host_pages) {
        PD_MUST(pd_pool_create(&n->host, "host", PD_POOL_HOST, o->host_pages, o->page_size));
        PD_MUST(pd_ledger_add_pool(n->l, n->host, &n->host_id));
    }
    pd_cache_config cfg = {.ledger = n->l,
                           .kv_pool = n->kv_id,
                           .mamba_pool = n->mamba_id,
                           .host_pool = n->host_id,
                           .write_back = n->host != NULL};
    PD_MUST(api->create(&n->c, &cfg));
    n->max_pages = max_len / o->page_size + 2;
    n->pages = malloc(n->max_pages * sizeof(uint32_t));
    n->dups = malloc(n->max_pages * sizeof(uint32_t));
}

/* The replay must leave the node clean once the cache is emptied. */
static void node_check_clean(node *n) {
    n->api->clear(n->c);
    pd_cache_sums sums = {0};
    n->api->sums_get(n->c, &sums);
    char buf[2048];
    pd_strbuf sb;
    pd_strbuf_init(&sb, buf, sizeof(buf));
    pd_check_opts co = {.cache = &sums, .expect_idle = true, .deep = true};
    if (pd_ledger_check(n->l, &co, &sb) != PD_OK) {
        fprintf(stderr, "radix: ledger check failed after the replay:\n%s\n", buf);
        exit(1);
    }
}

static void node_close(node *n) {
    free(n->pages);
    free(n->dups);
    n->api->destroy(n->c);
    pd_ledger_destroy(n->l);
    pd_pool_destroy(n->kv);
    pd_pool_destroy(n->mamba);
    pd_pool_destroy(n->host);
}

static pd_err alloc_pages(node *n, uint32_t count, pd_owner owner, uint32_t *out) {
    pd_pool *kv = n->kv;
    if (pd_pool_free_count(kv) < count)
        PD_MUST(n->api->evict(n->c, count - pd_pool_free_count(kv), NULL));
    if (pd_pool_free_count(kv) < count) return PD_ERR_NOMEM;
    return pd_ledger_alloc(n->l, n->kv_id, count, owner, out);
}

/* The baseline: allocate every page of the request and free it. False if
 * the pool is too small. */
static bool replay_plain(node *n, uint32_t need_pages, pd_owner owner) {
    if (alloc_pages(n, need_pages, owner, n->pages) != PD_OK) return false;
    PD_MUST(pd_ledger_free(n->l, n->kv_id, n->pages, need_pages, PD_UNIT_REQ, owner));
    return true;
}

/* Match and lock the cached prefix, loading its host-only part back; adds
 * the cached tokens to *hit_tokens (the loaded ones to *host_tokens too) and
 * returns them. */
static uint32_t match_and_lock(node *n, const opts *o, const int32_t *q, uint32_t len,
                               pd_owner owner, pd_cnode *lock_node, uint64_t *hit_tokens,
                               uint64_t *host_tokens) {
    /* Match all but the last token: a request always computes at least one. */
    pd_cache_match_result m;
    PD_MUST(n->api->match(n->c, q, len - 1, n->pages, n->max_pages, &m));
    uint32_t cached_tokens = o->hybrid ? m.mamba_tokens : m.dev_tokens;
    *lock_node = o->hybrid ? m.mamba_node : m.dev_node;
    bool load = !o->hybrid && m.host_tokens > 0;
    if (load) *lock_node = m.host_node;
    PD_MUST(n->api->lock(n->c, *lock_node));
    if (load) {
        /* Bring the host-only part back (the copy itself is not timed
         * here: it is a memcpy or DMA of the same size as the pages). */
        uint32_t n_loaded;
        pd_cache_ticket tk;
        uint32_t first = m.dev_tokens / o->page_size;
        if (n->api->load_begin(n->c, m.host_node, owner, n->pages + first, n->dups, n->max_pages,
                               &n_loaded, &tk) == PD_OK) {
            PD_MUST(n->api->load_done(n->c, tk));
            cached_tokens += m.host_tokens;
            *host_tokens += m.host_tokens;
        }
    }
    *hit_tokens += cached_tokens;
    return cached_tokens;
}

/* A request as a scheduler handles it: match, lock, allocate the uncached
 * rest, insert, free duplicates and the partial tail, unlock. False if the
 * pool is too small. */
static bool replay_cached(node *n, const opts *o, const int32_t *q, uint32_t len, pd_owner owner,
                          uint64_t *hit_tokens, uint64_t *host_tokens) {
    uint32_t need_pages = PD_DIV_CEIL(len, o->page_size);
    uint32_t full = len / o->page_size;
    pd_cnode lock_node;
    uint32_t cached_tokens =
        match_and_lock(n, o, q, len, owner, &lock_node, hit_tokens, host_tokens);
    uint32_t cached = cached_tokens / o->page_size;
    if (alloc_pages(n, need_pages - cached, owner, n->pages + cached) != PD_OK) {
        PD_MUST(n->api->unlock(n->c, lock_node));
        return false;
    }
    uint32_t slot = PD_POOL_NONE;
    if (o->hybrid) {
        if (pd_pool_free_count(n->mamba) == 0) PD_MUST(n->api->evict_snapshots(n->c, 1, NULL));
        if (pd_pool_free_count(n->mamba) > 0)
            PD_MUST(pd_ledger_alloc(n->l, n->mamba_id, 1, owner, &slot));
    }
    /* (the forward pass would run here) */
    pd_cache_insert_result ins;
    PD_MUST(n->api->insert(n->c, lock_node, q, full * o->page_size, n->pages, owner, slot, n->dups,
                           &ins));
    if (ins.dup_pages)
        PD_MUST(pd_ledger_free(n->l, n->kv_id, n->dups, ins.dup_pages, PD_UNIT_REQ, owner));
    uint32_t covered = ins.covered_tokens / o->page_size;
    if (need_pages > covered)
        PD_MUST(pd_ledger_free(n->l, n->kv_id, n->pages + covered, need_pages - covered,
                               PD_UNIT_REQ, owner));
    if (slot != PD_POOL_NONE && !ins.mamba_taken)
        PD_MUST(pd_ledger_free(n->l, n->mamba_id, &slot, 1, PD_UNIT_REQ, owner));
    PD_MUST(n->api->unlock(n->c, lock_node));
    return true;
}

/* Reads a prompt (one token per cache line is enough), so that its request
 * finds it in the cache as it would right after tokenization. */
static void prompt_touch(const int32_t *q, uint32_t len) {
    volatile int32_t sink = 0;
    for (uint32_t i = 0; i < len; i += 16) sink += q[i];
    (void)sink;
}

/* This thread's CPU time: unlike the wall clock, it leaves out the time other
 * processes on a shared machine take the core away. */
static uint64_t thread_cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Replays the whole trace once on a fresh node: through the cache api, or
 * with api NULL the plain baseline. lat[i] receives request i's time (left
 * at -1 when skipped), hits[i] its cached tokens (UINT32_MAX when skipped). */
static result run(const trace *t, const opts *o, const radix_impl *api, double *lat,
                  uint32_t *hits) {
    node n;
    node_open(&n, o, api ? api : &radix_impl_new, t->max_len);
    result r = {0};
    uint64_t hit_tokens = 0, host_tokens = 0;
    uint64_t cpu_start = thread_cpu_ns(), t_start = bench_now_ns();
    for (uint32_t i = 0; i < t->n; i++) {
        pd_owner owner = i + 1;
        uint64_t before = hit_tokens;
        if (o->warm) prompt_touch(t->req[i], t->len[i]);
        uint64_t t0 = bench_now_ns();
        bool done = api
            ? replay_cached(&n, o, t->req[i], t->len[i], owner, &hit_tokens, &host_tokens)
            : replay_plain(&n, PD_DIV_CEIL(t->len[i], o->page_size), owner);
        uint64_t t1 = bench_now_ns();
        hits[i] = done ? (uint32_t)(hit_tokens - before) : UINT32_MAX;
        if (!done) {
            r.skipped++;
            continue;
        }
        lat[i] = (double)(t1 - t0) / 1e3;
    }
    double secs = (double)(bench_now_ns() - t_start) / 1e9;
    r.cpu_us = (double)(thread_cpu_ns() - cpu_start) / 1e3 / t->n;
    uint32_t done = t->n - (uint32_t)r.skipped;
    double sum = 0;
    size_t k = 0;
    for (uint32_t i = 0; i < t->n; i++)
        if (lat[i] >= 0) {
            sum += lat[i];
            lat[k++] = lat[i];
        }
    r.req_s = done / secs;
    r.tok_s = (double)t->tokens / secs;
    r.mean_us = k ? sum / (double)k : 0;
    r.p99_us = bench_percentile(lat, k, 99.0);
    r.hit_tokens = hit_tokens;
    r.hit_rate = t->tokens ? (double)hit_tokens / (double)t->tokens : 0;
    r.host_rate = t->tokens ? (double)host_tokens / (double)t->tokens : 0;
    pd_cache_stats st;
    n.api->stats_get(n.c, &st);
    r.evicted = st.evicted_dev_pages;
    node_check_clean(&n);
    node_close(&n);
    return r;
}

static void usage(FILE *to) {
    fprintf(to,
            "usage: radix --trace FILE [--page-size N] [--pages N] [--hybrid]\n"
            "             [--mamba-slots N] [--host-pages N] [--runs R] [--strict]\n"
            "             [--only before|after] [--warm-prompts]\n"
            "  --trace FILE     one request per line, space-separated token ids\n"
            "  --page-size N    tokens per KV page (default 16)\n"
            "  --pages N        KV pool size in pages (default 65536)\n"
            "  --hybrid         take a Mamba snapshot per request and resume only\n"
            "                   from cached snapshots (attention+Mamba models)\n"
            "  --mamba-slots N  Mamba pool size with --hybrid (default 256)\n"
            "  --host-pages N   host tier size; evictions write back (default 0: off)\n"
            "  --runs R         replays; figures are medians (default 5)\n"
            "  --strict         strict ledger (per-unit owner map) instead of counts\n"
            "  --only before|after  replay one cache alone (for a profile): no comparison\n"
            "  --warm-prompts   read each prompt just before its request is timed, as a\n"
            "                   scheduler that has just tokenized it would have (the\n"
            "                   cpu column then counts those reads too)\n");
}

/* Fills o and *path from the command line; returns -1 to go on, or the
 * exit status. */
static int parse_args(int argc, char **argv, opts *o, const char **path) {
    *o = (opts){.page_size = 16, .pages = 65536, .mamba_slots = 256, .runs = 5};
    *path = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--hybrid")) {
            o->hybrid = true;
            continue;
        }
        if (!strcmp(a, "--strict")) {
            o->strict = true;
            continue;
        }
        if (!strcmp(a, "--warm-prompts")) {
            o->warm = true;
            continue;
        }
        if (i + 1 >= argc) {
            usage(stderr);
            return 2;
        }
        const char *v = argv[++i];
        if (!strcmp(a, "--trace")) *path = v;
        else if (!strcmp(a, "--page-size")) o->page_size = (uint32_t)strtoul(v, NULL, 0);
        else if (!strcmp(a, "--pages")) o->pages = (uint32_t)strtoul(v, NULL, 0);
        else if (!strcmp(a, "--mamba-slots")) o->mamba_slots = (uint32_t)strtoul(v, NULL, 0);
        else if (!strcmp(a, "--host-pages")) o->host_pages = (uint32_t)strtoul(v, NULL, 0);
        else if (!strcmp(a, "--runs")) o->runs = atoi(v);
        else if (!strcmp(a, "--only") && !strcmp(v, "before")) o->only = &radix_impl_v0;
        else if (!strcmp(a, "--only") && !strcmp(v, "after")) o->only = &radix_impl_new;
        else {
            fprintf(stderr, "radix: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!*path) {
        fprintf(stderr, "radix: --trace FILE is required\n");
        usage(stderr);
        return 2;
    }
    if (o->page_size == 0 || o->pages == 0 || (o->hybrid && o->mamba_slots == 0) || o->runs < 1) {
        fprintf(stderr, "radix: page size, pages, mamba slots and runs must be positive\n");
        return 2;
    }
    return -1;
}

/* Medians over the runs of one contender's figures. */
typedef struct series {
    double *req_s, *tok_s, *mean_us, *p99_us, *cpu_us;
    result last;
} series;

/* A series whose five figures take runs doubles each from mem. */
static series series_at(double *mem, size_t runs) {
    return (series){.req_s = mem,
                    .tok_s = mem + runs,
                    .mean_us = mem + 2 * runs,
                    .p99_us = mem + 3 * runs,
                    .cpu_us = mem + 4 * runs};
}

static void series_add(series *s, int r, result res) {
    s->req_s[r] = res.req_s;
    s->tok_s[r] = res.tok_s;
    s->mean_us[r] = res.mean_us;
    s->p99_us[r] = res.p99_us;
    s->cpu_us[r] = res.cpu_us;
    s->last = res;
}

/* The new cache must hit exactly the tokens the baseline hit, request by
 * request, and evict as many pages: anything else is a behaviour change. */
static void hits_compare(const trace *t, const uint32_t *v0, const uint32_t *now, const result *r0,
                         const result *r1) {
    for (uint32_t i = 0; i < t->n; i++) {
        if (v0[i] == now[i]) continue;
        fprintf(stderr,
                "radix: FAIL: request %u (%u tokens) hits %u tokens %s but %u before "
                "(dfc8558): the new cache changed which tokens hit\n",
                i, t->len[i], now[i], radix_impl_new.label, v0[i]);
        exit(1);
    }
    if (r0->hit_tokens != r1->hit_tokens || r0->evicted != r1->evicted) {
        fprintf(stderr,
                "radix: FAIL: totals differ: hit tokens %llu vs %llu, evicted pages "
                "%llu vs %llu\n",
                (unsigned long long)r0->hit_tokens, (unsigned long long)r1->hit_tokens,
                (unsigned long long)r0->evicted, (unsigned long long)r1->evicted);
        exit(1);
    }
}

static void series_print(const char *label, series *s, size_t runs) {
    printf("%-20s %8.2f %8.2f %8.2f %11.0f %11llu %8llu\n", label, bench_median(s->mean_us, runs),
           bench_median(s->p99_us, runs), bench_median(s->cpu_us, runs),
           bench_median(s->req_s, runs), (unsigned long long)s->last.hit_tokens,
           (unsigned long long)s->last.evicted);
}

/* The plain baseline, then the old and the new cache alternately (which goes
 * first swaps every run), each the median of o->runs replays; every run's
 * hits are compared request by request. */
static void measure(const trace *t, const opts *o) {
    double *lat = malloc(t->n * sizeof(double));
    uint32_t *hits_v0 = malloc(t->n * sizeof(uint32_t)), *hits = malloc(t->n * sizeof(uint32_t));
    size_t runs = (size_t)o->runs;
    double *mem = malloc(sizeof(double) * runs * 15);
    series sp = series_at(mem, runs), s0 = series_at(mem + 5 * runs, runs),
           s1 = series_at(mem + 10 * runs, runs);
    for (int r = 0; r < o->runs; r++) {
        for (uint32_t i = 0; i < t->n; i++) lat[i] = -1;
        series_add(&sp, r, run(t, o, NULL, lat, hits));
        for (int k = 0; k < 2; k++) {
            bool v0 = (k == 0) == (r % 2 == 0);
            if (o->only && o->only != (v0 ? &radix_impl_v0 : &radix_impl_new)) continue;
            for (uint32_t i = 0; i < t->n; i++) lat[i] = -1;
            series_add(v0 ? &s0 : &s1, r,
                       run(t, o, v0 ? &radix_impl_v0 : &radix_impl_new, lat, v0 ? hits_v0 : hits));
        }
        if (!o->only) hits_compare(t, hits_v0, hits, &s0.last, &s1.last);
    }
    if (o->only == &radix_impl_v0) s1 = s0; /* the last lines describe the one replayed */
    double base_mean = bench_median(sp.mean_us, runs), mean = bench_median(s1.mean_us, runs);
    printf("baseline (allocate and free every page, no cache): %.0f requests/s, mean %.2f us\n",
           bench_median(sp.req_s, runs), base_mean);
    printf("prefix cache: hit rate %.1f%% of prompt tokens (%.1f%% loaded back from host), "
           "%llu pages evicted, %llu requests skipped (pool too small)\n",
           100.0 * s1.last.hit_rate, 100.0 * s1.last.host_rate, (unsigned long long)s1.last.evicted,
           (unsigned long long)s1.last.skipped);
    printf("whole request (match, lock, allocate, insert, unlock), medians of %zu runs "
           "alternating:\n",
           runs);
    printf("%-20s %8s %8s %8s %11s %11s %8s\n", "cache", "mean us", "p99 us", "cpu us",
           "requests/s", "hit tokens", "evicted");
    if (o->only) {
        series_print(o->only->label, &s1, runs);
    } else {
        series_print(radix_impl_v0.label, &s0, runs);
        series_print(radix_impl_new.label, &s1, runs);
        printf("hits identical request by request in all %zu runs; after/before: mean %.2fx, "
               "cpu %.2fx\n",
               runs, mean / bench_median(s0.mean_us, runs),
               bench_median(s1.cpu_us, runs) / bench_median(s0.cpu_us, runs));
    }
    printf("cache bookkeeping over plain allocation: %+.2f us per request\n", mean - base_mean);
    printf("requests/s: %.0f\n", bench_median(s1.req_s, runs));
    printf("tokens/s: %.0f\n", bench_median(s1.tok_s, runs));
    printf("mean us per request: %.2f\n", mean);
    printf("p99 us per request: %.2f\n", bench_median(s1.p99_us, runs));
    free(mem);
    free(hits_v0);
    free(hits);
    free(lat);
}

int main(int argc, char **argv) {
    opts o;
    const char *path;
    int status = parse_args(argc, argv, &o, &path);
    if (status >= 0) return status;
    trace t;
    if (load_trace(path, &t) != 0) return 1;
    if (PD_DIV_CEIL(t.max_len, o.page_size) > o.pages) {
        fprintf(stderr, "radix: the longest request (%u tokens) needs more than --pages %u\n",
                t.max_len, o.pages);
        return 2;
    }
    printf("trace %s: %u requests, %llu tokens (longest %u); page size %u, %u pages%s%s%s; "
           "%s build\n",
           path, t.n, (unsigned long long)t.tokens, t.max_len, o.page_size, o.pages,
           o.hybrid ? ", hybrid" : "", o.strict ? ", strict ledger" : "",
           o.warm ? ", prompts warm" : "", pd_build_kind());
    measure(&t, &o);
    for (uint32_t i = 0; i < t.n; i++) free(t.req[i]);
    free(t.req);
    free(t.len);
    return 0;
}
