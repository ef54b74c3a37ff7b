/*
 * The worker table and worker URL parsing; see workers.h for the health
 * rule and the locking.
 */
#include "workers.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy.h"

const char *rt_role_name(rt_role role) { return role == RT_PREFILL ? "prefill" : "decode"; }

/* Digits only, 1..65535. */
static bool parse_port(const char *s, size_t len, uint16_t *out) {
    if (len == 0 || len > 5) return false;
    unsigned v = 0;
    for (size_t i = 0; i < len; i++) {
        if (!isdigit((unsigned char)s[i])) return false;
        v = v * 10 + (unsigned)(s[i] - '0');
    }
    if (v == 0 || v > 65535) return false;
    *out = (uint16_t)v;
    return true;
}

pd_err pd_router_url_parse(const char *spec, bool allow_bootstrap, pd_router_url *out,
                           char *msg, size_t msg_cap) {
    static const char scheme[] = "http://";
    memset(out, 0, sizeof *out);
    if (!spec || strncmp(spec, scheme, sizeof scheme - 1) != 0)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "worker URL '%s' must start with http://",
                         spec ? spec : "(null)");
    const char *auth = spec + sizeof scheme - 1;
    size_t len = strlen(auth);
    const char *at = memchr(auth, '@', len);
    if (at) {
        if (!allow_bootstrap)
            return pd_errorf(msg, msg_cap, PD_ERR_INVALID,
                             "worker URL '%s': '@' (a bootstrap port) is for prefill nodes only",
                             spec);
        if (!parse_port(at + 1, len - (size_t)(at + 1 - auth), &out->bootstrap_port))
            return pd_errorf(msg, msg_cap, PD_ERR_INVALID,
                             "worker URL '%s': the bootstrap port after '@' must be 1..65535",
                             spec);
        len = (size_t)(at - auth);
    }
    if (len > 0 && auth[len - 1] == '/') len--;
    if (len == 0 || len >= PD_ROUTER_URL_MAX - sizeof scheme)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "worker URL '%s': bad length", spec);
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)auth[i];
        if (ch <= ' ' || ch == '/' || ch == '?' || ch == '#' || ch == '@' || ch >= 0x7f)
            return pd_errorf(msg, msg_cap, PD_ERR_INVALID,
                             "worker URL '%s': expected http://host:port (no path, no user info)",
                             spec);
    }
    const char *host = auth;
    size_t host_len;
    const char *port_str;
    if (auth[0] == '[') {
        const char *close = memchr(auth, ']', len);
        if (!close || close + 1 >= auth + len || close[1] != ':')
            return pd_errorf(msg, msg_cap, PD_ERR_INVALID,
                             "worker URL '%s': expected http://[v6addr]:port", spec);
        host = auth + 1;
        host_len = (size_t)(close - host);
        port_str = close + 2;
    } else {
        const char *colon = NULL;
        for (size_t i = 0; i < len; i++)
            if (auth[i] == ':') colon = auth + i;
        if (!colon)
            return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "worker URL '%s' has no port", spec);
        host_len = (size_t)(colon - auth);
        port_str = colon + 1;
        if (memchr(auth, ':', host_len))
            return pd_errorf(msg, msg_cap, PD_ERR_INVALID,
                             "worker URL '%s': write IPv6 hosts in brackets", spec);
    }
    if (host_len == 0)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "worker URL '%s' has no host", spec);
    if (!parse_port(port_str, len - (size_t)(port_str - auth), &out->port))
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "worker URL '%s': port must be 1..65535",
                         spec);
    memcpy(out->base, spec, sizeof scheme - 1 + len);
    out->base[sizeof scheme - 1 + len] = '\0';
    memcpy(out->host, host, host_len);
    out->host[host_len] = '\0';
    return PD_OK;
}

pd_err rt_workers_init(rt_workers *t, const pd_router_config *cfg, char *msg, size_t msg_cap) {
    memset(t, 0, sizeof *t);
    if (cfg->prefill_count == 0 || cfg->decode_count == 0)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID,
                         "the router needs at least one prefill and one decode node");
    if (cfg->prefill_count > PD_ROUTER_WORKERS_MAX || cfg->decode_count > PD_ROUTER_WORKERS_MAX)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "at most %d workers per role",
                         PD_ROUTER_WORKERS_MAX);
    if (cfg->bootstrap_port == 0)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "the bootstrap port must be 1..65535");
    for (size_t i = 0; i < cfg->prefill_count + cfg->decode_count; i++) {
        bool prefill = i < cfg->prefill_count;
        const char *spec = prefill ? cfg->prefill[i] : cfg->decode[i - cfg->prefill_count];
        rt_worker *w = &t->w[i];
        pd_err err = pd_router_url_parse(spec, prefill, &w->url, msg, msg_cap);
        if (err) return err;
        w->role = prefill ? RT_PREFILL : RT_DECODE;
        if (prefill && w->url.bootstrap_port == 0) w->url.bootstrap_port = cfg->bootstrap_port;
        w->healthy = true;
        for (size_t j = 0; j < i; j++)
            if (!strcmp(t->w[j].url.base, w->url.base))
                return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "worker %s is listed twice",
                                 w->url.base);
    }
    t->count = cfg->prefill_count + cfg->decode_count;
    t->prefill_count = cfg->prefill_count;
    t->policy = cfg->policy;
    t->unhealthy_after = cfg->unhealthy_after ? cfg->unhealthy_after : 2;
    if (pthread_mutex_init(&t->mu, NULL) != 0)
        return pd_errorf(msg, msg_cap, PD_ERR_INTERNAL, "pthread_mutex_init failed");
    return PD_OK;
}

void rt_workers_destroy(rt_workers *t) {
    if (t->count) pthread_mutex_destroy(&t->mu);
    t->count = 0;
}

/* Index (into t->w) of the pick for one role, or RT_PICK_NONE. Lock held. */
static size_t pick_role(rt_workers *t, rt_role role) {
    size_t lo = role == RT_PREFILL ? 0 : t->prefill_count;
    size_t n = role == RT_PREFILL ? t->prefill_count : t->count - t->prefill_count;
    rt_candidate c[PD_ROUTER_WORKERS_MAX];
    PD_ASSERT(n <= PD_ROUTER_WORKERS_MAX);
    for (size_t i = 0; i < n; i++)
        c[i] = (rt_candidate){t->w[lo + i].healthy, t->w[lo + i].in_flight};
    size_t k = rt_policy_pick(t->policy, c, n, &t->cursor[role]);
    return k == RT_PICK_NONE ? k : lo + k;
}

pd_err rt_workers_pick(rt_workers *t, size_t *prefill, size_t *decode) {
    pthread_mutex_lock(&t->mu);
    size_t saved[2] = {t->cursor[0], t->cursor[1]};
    size_t p = pick_role(t, RT_PREFILL);
    size_t d = pick_role(t, RT_DECODE);
    if (p == RT_PICK_NONE || d == RT_PICK_NONE) {
        /* Nothing was sent: the turn order is unchanged. */
        t->cursor[0] = saved[0];
        t->cursor[1] = saved[1];
        pthread_mutex_unlock(&t->mu);
        return PD_ERR_NOTFOUND;
    }
    PD_ASSERT(t->w[p].role == RT_PREFILL && t->w[d].role == RT_DECODE);
    t->w[p].in_flight++;
    t->w[p].requests_total++;
    t->w[d].in_flight++;
    t->w[d].requests_total++;
    pthread_mutex_unlock(&t->mu);
    *prefill = p;
    *decode = d;
    return PD_OK;
}

void rt_workers_release(rt_workers *t, size_t i, bool failed) {
    PD_ASSERT(i < t->count);
    pthread_mutex_lock(&t->mu);
    PD_ASSERTF(t->w[i].in_flight > 0, "worker %s released with nothing in flight",
               t->w[i].url.base);
    t->w[i].in_flight--;
    if (failed) t->w[i].failures_total++;
    pthread_mutex_unlock(&t->mu);
}

bool rt_workers_probe(rt_workers *t, size_t i, bool ok) {
    PD_ASSERT(i < t->count);
    pthread_mutex_lock(&t->mu);
    rt_worker *w = &t->w[i];
    bool was = w->healthy;
    w->probes_total++;
    if (ok) {
        w->probe_failures_consecutive = 0;
        w->healthy = true;
    } else {
        w->probe_failures_total++;
        if (w->probe_failures_consecutive < UINT32_MAX) w->probe_failures_consecutive++;
        if (w->probe_failures_consecutive >= t->unhealthy_after) w->healthy = false;
    }
    bool changed = was != w->healthy;
    pthread_mutex_unlock(&t->mu);
    return changed;
}

bool rt_workers_have_pair(rt_workers *t) {
    bool role_ok[2] = {false, false};
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->count; i++)
        if (t->w[i].healthy) role_ok[t->w[i].role] = true;
    pthread_mutex_unlock(&t->mu);
    return role_ok[0] && role_ok[1];
}

void rt_workers_snapshot(rt_workers *t, rt_worker *out) {
    pthread_mutex_lock(&t->mu);
    memcpy(out, t->w, t->count * sizeof *out);
    pthread_mutex_unlock(&t->mu);
}
