/*
 * The pdserve nodes a benchmark watches (--check-node): their pool units by
 * ledger state, sampled from GET /server_info while the run goes on, and
 * the idle check at the end: every node must report idle_clean (no unit
 * held by a request, none quarantined) within the timeout, or the check
 * fails naming the pools that still hold units. A router's URL stands for
 * its workers: its /server_info lists them.
 */
#include <jansson.h>
#include <string.h>
#include <time.h>

#include "loadgen_internal.h"

/* ---- parsing /server_info ------------------------------------------------------------ */

static uint64_t count_of(json_t *o, const char *k) {
    json_t *v = json_object_get(o, k);
    return json_is_integer(v) && json_integer_value(v) > 0 ? (uint64_t)json_integer_value(v) : 0;
}

/* The pools of a node's /server_info; false when it has none (not a node). */
static bool parse_pools(json_t *info, pd_lg_node_sample *s) {
    json_t *pools = json_object_get(json_object_get(info, "pools"), "pools");
    if (!json_is_array(pools)) return false;
    size_t i;
    json_t *p;
    s->n_pools = 0;
    json_array_foreach(pools, i, p) {
        if (s->n_pools == PD_LG_POOLS_MAX) break;
        pd_lg_pool_sample *q = &s->pools[s->n_pools++];
        const char *name = json_string_value(json_object_get(p, "name"));
        snprintf(q->name, sizeof(q->name), "%s", name ? name : "?");
        q->total = count_of(p, "total");
        q->free = count_of(p, "free");
        q->req = count_of(p, "req");
        q->cache_evictable = count_of(p, "cache_evictable");
        q->cache_protected = count_of(p, "cache_protected");
        q->quarantine = count_of(p, "quarantine");
    }
    return true;
}

/* counters.cached_tokens and prefill_tokens; false when absent. */
static bool parse_counters(json_t *info, uint64_t *cached, uint64_t *prefill) {
    json_t *c = json_object_get(info, "counters");
    if (!json_is_integer(json_object_get(c, "cached_tokens"))) return false;
    *cached = count_of(c, "cached_tokens");
    *prefill = count_of(c, "prefill_tokens");
    return true;
}

static void node_add_sample(pd_lg_node *n, const pd_lg_node_sample *s) {
    if (n->n_samples == n->cap_samples) {
        n->cap_samples = n->cap_samples ? n->cap_samples * 2 : 64;
        n->samples = realloc(n->samples, n->cap_samples * sizeof(*n->samples));
        PD_ASSERT(n->samples);
    }
    n->samples[n->n_samples++] = *s;
}

/* ---- before the run: which nodes ----------------------------------------------------- */

/* GET url/server_info, blocking; the parsed answer or NULL (err says why). */
json_t *lg_get_json(struct curl_slist *hdrs, const char *full, double timeout_s, char *err,
                    size_t cap) {
    lg_buf body = {0};
    CURL *h = lg_easy_with(hdrs, full, &body);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, (long)(timeout_s * 1000));
    CURLcode rc = curl_easy_perform(h);
    long status = 0;
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(h);
    json_t *o = NULL;
    if (rc != CURLE_OK)
        snprintf(err, cap, "no answer from %.300s: %s", full, curl_easy_strerror(rc));
    else if (status != 200) snprintf(err, cap, "%.300s answered HTTP %ld", full, status);
    else if (!(o = json_loads(body.p ? body.p : "", 0, NULL)))
        snprintf(err, cap, "%.300s: the answer is not JSON", full);
    lg_buf_free(&body);
    return o;
}

static json_t *get_info(lg_run *run, const char *url, double timeout_s, char *err, size_t cap) {
    char full[600];
    snprintf(full, sizeof(full), "%.580s/server_info", url);
    return lg_get_json(run->hdrs, full, timeout_s, err, cap);
}

uint32_t pd_lg_server_vocab(const pd_lg_run_config *c) {
    char url[600], why[400];
    snprintf(url, sizeof(url), "%.570s/get_model_info", c->base_url);
    struct curl_slist *hdrs = lg_headers(c);
    json_t *o = lg_get_json(hdrs, url, 10, why, sizeof(why));
    curl_slist_free_all(hdrs);
    json_t *v = json_object_get(o, "vocab_size");
    uint32_t vocab = 0;
    if (json_is_integer(v) && json_integer_value(v) > 1 && json_integer_value(v) <= INT32_MAX)
        vocab = (uint32_t)json_integer_value(v);
    json_decref(o);
    return vocab;
}

static pd_err add_node(lg_run *run, const char *url, const char *role, char *err, size_t cap) {
    pd_lg_results *o = run->out;
    if (o->n_nodes == PD_LG_NODES_MAX)
        return pd_errorf(err, cap, PD_ERR_TOOBIG, "more than %d nodes to check", PD_LG_NODES_MAX);
    pd_lg_node *n = &o->nodes[o->n_nodes++];
    *n = (pd_lg_node){0};
    snprintf(n->url, sizeof(n->url), "%s", url);
    snprintf(n->role, sizeof(n->role), "%s", role ? role : "?");
    return PD_OK;
}

/* A router's workers, each a node to check. */
static pd_err add_router_workers(lg_run *run, json_t *info, const char *url, char *err,
                                 size_t cap) {
    json_t *workers = json_object_get(info, "workers"), *w;
    size_t i;
    if (!json_array_size(workers))
        return pd_errorf(err, cap, PD_ERR_INVALID, "%s is a router without workers", url);
    json_array_foreach(workers, i, w) {
        const char *wu = json_string_value(json_object_get(w, "url"));
        if (!wu) return pd_errorf(err, cap, PD_ERR_PARSE, "%s: a worker without a url", url);
        pd_err e = add_node(run, wu, json_string_value(json_object_get(w, "role")), err, cap);
        if (e) return e;
        char why[400];
        json_t *winfo = get_info(run, wu, 10, why, sizeof(why));
        pd_lg_node *n = &run->out->nodes[run->out->n_nodes - 1];
        n->has_counters = winfo && parse_counters(winfo, &n->cached0, &n->prefill0);
        json_decref(winfo);
    }
    return PD_OK;
}

pd_err lg_nodes_resolve(lg_run *run, char *err, size_t cap) {
    for (uint32_t k = 0; k < run->c->n_nodes; k++) {
        const char *url = run->c->nodes[k];
        char why[400];
        json_t *info = get_info(run, url, 10, why, sizeof(why));
        if (!info) return pd_errorf(err, cap, PD_ERR_IO, "--check-node %s: %s", url, why);
        const char *role = json_string_value(json_object_get(info, "role"));
        pd_lg_node_sample s = {0};
        pd_err e = PD_OK;
        if (role && !strcmp(role, "router")) e = add_router_workers(run, info, url, err, cap);
        else if (!parse_pools(info, &s))
            e = pd_errorf(err, cap, PD_ERR_INVALID,
                          "--check-node %s: its /server_info has no pools: not a pdserve node "
                          "(give the URLs of prefill, decode or serve nodes, or of a router)",
                          url);
        else if (!(e = add_node(run, url, role, err, cap))) {
            pd_lg_node *n = &run->out->nodes[run->out->n_nodes - 1];
            n->has_counters = parse_counters(info, &n->cached0, &n->prefill0);
        }
        json_decref(info);
        if (e) return e;
    }
    return PD_OK;
}

/* ---- during the run ------------------------------------------------------------------ */

void lg_sample_start(lg_run *run, double now) {
    (void)now;
    for (uint32_t k = 0; k < run->out->n_nodes; k++) {
        if (run->sampling[k]) continue;
        char url[600];
        snprintf(url, sizeof(url), "%s/server_info", run->out->nodes[k].url);
        run->sampling[k] = true;
        lg_side_sample(run, url, (int)k);
    }
}

void lg_sample_done(lg_run *run, lg_side *s, CURLcode rc, double now) {
    run->sampling[s->node] = false;
    if (rc != CURLE_OK || !s->body.p) return;
    json_t *info = json_loads(s->body.p, 0, NULL);
    pd_lg_node_sample smp = {.t_s = now - run->t0};
    if (parse_pools(info, &smp)) node_add_sample(&run->out->nodes[s->node], &smp);
    json_decref(info);
}

/* ---- the idle check ------------------------------------------------------------------ */

/* Names the pools that hold units: "pool kv: 12 units held by requests". */
static void held_pools(const pd_lg_node_sample *s, char *out, size_t cap) {
    size_t len = 0;
    out[0] = '\0';
    for (uint32_t i = 0; i < s->n_pools && len < cap; i++) {
        const pd_lg_pool_sample *p = &s->pools[i];
        if (!p->req && !p->quarantine) continue;
        len += (size_t)snprintf(out + len, cap - len,
                                "%spool %s: %llu units held by requests, %llu quarantined",
                                len ? "; " : "", p->name, (unsigned long long)p->req,
                                (unsigned long long)p->quarantine);
    }
}

/* One look at a node; true when it is idle and clean (the check passed). */
static bool idle_look(lg_run *run, pd_lg_node *n, double waited) {
    char why[400];
    n->has_last = false;
    json_t *info = get_info(run, n->url, 2, why, sizeof(why));
    if (!info) {
        snprintf(n->problem, sizeof(n->problem), "%s", why);
        return false;
    }
    pd_lg_node_sample s = {.t_s = lg_now() - run->t0};
    bool has = parse_pools(info, &s), idle = json_is_true(json_object_get(info, "idle"));
    bool clean = json_is_true(json_object_get(info, "idle_clean"));
    if (n->has_counters) parse_counters(info, &n->cached1, &n->prefill1);
    json_decref(info);
    if (has) node_add_sample(n, &s);
    n->last = s;
    n->has_last = has;
    if (idle && clean) return true;
    char held[400];
    held_pools(&s, held, sizeof(held));
    snprintf(n->problem, sizeof(n->problem), "%s after %.1f s%s%s",
             idle ? "idle but not clean" : "still busy", waited, held[0] ? ": " : "", held);
    return false;
}

void lg_idle_check(lg_run *run) {
    pd_lg_results *o = run->out;
    double start = lg_now();
    uint32_t left = o->n_nodes;
    while (left) {
        double waited = lg_now() - start;
        for (uint32_t k = 0; k < o->n_nodes; k++) {
            pd_lg_node *n = &o->nodes[k];
            if (n->checked) continue;
            if (idle_look(run, n, waited)) {
                n->checked = n->passed = true;
                n->problem[0] = '\0';
                n->waited_s = waited;
                left--;
            } else if (waited >= run->c->idle_timeout_s) {
                n->checked = true;
                n->waited_s = waited;
                left--;
            }
        }
        if (left) nanosleep(&(struct timespec){.tv_nsec = 100 * 1000 * 1000}, NULL);
    }
}
