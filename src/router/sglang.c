/*
 * SGLang's native utility endpoints on the router; see sglang.h.
 */
#include "sglang.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client.h"

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static void
refuse(rt_sgl_answer *out, unsigned status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out->message, sizeof out->message, fmt, ap);
    va_end(ap);
    out->status = status;
    out->body = NULL;
    out->len = 0;
}

/* The base URL of the first healthy worker of a role into base; false when none. */
static bool healthy_base(rt_workers *t, rt_role role, char *base, size_t cap) {
    rt_worker *snap = malloc(t->count * sizeof *snap);
    bool found = false;
    if (!snap) return false;
    rt_workers_snapshot(t, snap);
    for (size_t i = 0; i < t->count && !found; i++)
        if (snap[i].role == role && snap[i].healthy) {
            snprintf(base, cap, "%s", snap[i].url.base);
            found = true;
        }
    free(snap);
    return found;
}

void rt_sgl_relay(rt_workers *t, const pd_router_config *cfg, bool decode_only, const char *path,
                  const char *body, size_t body_len, rt_sgl_answer *out) {
    PD_ASSERT(path && path[0] == '/');
    char base[PD_ROUTER_URL_MAX], url[PD_ROUTER_URL_MAX + 64];
    bool found = healthy_base(t, RT_DECODE, base, sizeof base) ||
        (!decode_only && healthy_base(t, RT_PREFILL, base, sizeof base));
    if (!found) {
        refuse(out, 503, "no healthy %s to ask", decode_only ? "decode node" : "worker");
        return;
    }
    snprintf(url, sizeof url, "%s%s", base, path);
    rt_fetched f;
    rt_fetch(url, body, body_len, cfg->connect_timeout_ms + cfg->abort_timeout_ms,
             cfg->connect_timeout_ms, cfg->api_key, cfg->max_response_bytes, &f);
    json_t *check = f.body && !f.cut ? json_loadb(f.body, f.len, 0, NULL) : NULL;
    if (f.status < 200 || f.status > 599) refuse(out, 502, "%s did not answer", url);
    else if (f.cut)
        refuse(out, 502, "the answer of %s is over %zu bytes", url, cfg->max_response_bytes);
    else if (!check) refuse(out, 502, "the answer of %s is not JSON", url);
    else *out = (rt_sgl_answer){.status = (unsigned)f.status, .body = f.body, .len = f.len};
    json_decref(check);
    if (out->body != f.body) free(f.body);
    PD_ASSERT(out->body || out->status >= 500);
}

/* The fan-out's verdict: the first worker that did not answer 200, if any. */
static void flush_verdict(rt_workers *t, const rt_post *posts, rt_sgl_answer *out) {
    json_t *per = json_array();
    for (size_t i = 0; i < t->count; i++) {
        const rt_worker *w = &t->w[i]; /* role and url are immutable */
        json_array_append_new(per,
                              json_pack("{s:s, s:s, s:i}", "url", w->url.base, "role",
                                        rt_role_name(w->role), "status", (int)posts[i].status));
        if (posts[i].status == 200 || out->status) continue;
        if (posts[i].status == 0)
            refuse(out, 502, "flush_cache: the %s worker %s did not answer", rt_role_name(w->role),
                   w->url.base);
        else
            refuse(out,
                   (unsigned)(posts[i].status >= 400 && posts[i].status <= 599 ? posts[i].status
                                                                               : 502),
                   "flush_cache: the %s worker %s answered %ld: %s", rt_role_name(w->role),
                   w->url.base, posts[i].status,
                   posts[i].message[0] ? posts[i].message : "(no message)");
    }
    if (out->status) {
        json_decref(per);
        return;
    }
    json_t *o = json_pack("{s:s, s:s, s:o}", "status", "ok", "message",
                          "flushed the prefix cache of every worker", "workers", per);
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!text) refuse(out, 500, "out of memory");
    else *out = (rt_sgl_answer){.status = 200, .body = text, .len = strlen(text)};
}

void rt_sgl_flush(rt_workers *t, const pd_router_config *cfg, rt_sgl_answer *out) {
    PD_ASSERT(t->count <= 2 * PD_ROUTER_WORKERS_MAX);
    *out = (rt_sgl_answer){0};
    rt_post *posts = calloc(t->count ? t->count : 1, sizeof *posts);
    if (!posts) {
        refuse(out, 500, "out of memory");
        return;
    }
    for (size_t i = 0; i < t->count; i++)
        snprintf(posts[i].url, sizeof posts[i].url, "%s/flush_cache", t->w[i].url.base);
    rt_fanout_post(posts, t->count, "{}", cfg->connect_timeout_ms + cfg->abort_timeout_ms,
                   cfg->connect_timeout_ms, cfg->api_key);
    flush_verdict(t, posts, out);
    free(posts);
}
