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

bool rt_sgl_relay_url(rt_workers *t, bool decode_only, const char *path, char *url, size_t cap,
                      rt_sgl_answer *out) {
    PD_ASSERT(path && path[0] == '/');
    *out = (rt_sgl_answer){0};
    char base[PD_ROUTER_URL_MAX];
    bool found = healthy_base(t, RT_DECODE, base, sizeof base) ||
        (!decode_only && healthy_base(t, RT_PREFILL, base, sizeof base));
    if (!found) {
        refuse(out, 503, "no healthy %s to ask", decode_only ? "decode node" : "worker");
        return false;
    }
    snprintf(url, cap, "%s%s", base, path);
    return true;
}

void rt_sgl_relay_verdict(rt_call *c, size_t max_response_bytes, rt_sgl_answer *out) {
    *out = (rt_sgl_answer){0};
    json_t *check = c->body && !c->cut ? json_loadb(c->body, c->len, 0, NULL) : NULL;
    if (c->status < 200 || c->status > 599) refuse(out, 502, "%s did not answer", c->url);
    else if (c->cut)
        refuse(out, 502, "the answer of %s is over %zu bytes", c->url, max_response_bytes);
    else if (!check) refuse(out, 502, "the answer of %s is not JSON", c->url);
    else {
        *out = (rt_sgl_answer){.status = (unsigned)c->status, .body = c->body, .len = c->len};
        c->body = NULL; /* the answer's now */
    }
    json_decref(check);
    PD_ASSERT(out->body || out->status >= 500);
}

/* The fan-out's verdict: the first worker that did not answer 200, if any. */
void rt_sgl_flush_verdict(const rt_workers *t, const rt_call *calls, rt_sgl_answer *out) {
    *out = (rt_sgl_answer){0};
    json_t *per = json_array();
    for (size_t i = 0; i < t->count; i++) {
        const rt_worker *w = &t->w[i]; /* role and url are immutable */
        json_array_append_new(per,
                              json_pack("{s:s, s:s, s:i}", "url", w->url.base, "role",
                                        rt_role_name(w->role), "status", (int)calls[i].status));
        if (calls[i].status == 200 || out->status) continue;
        char message[256];
        rt_call_message(&calls[i], message, sizeof message);
        if (calls[i].status == 0)
            refuse(out, 502, "flush_cache: the %s worker %s did not answer", rt_role_name(w->role),
                   w->url.base);
        else
            refuse(out,
                   (unsigned)(calls[i].status >= 400 && calls[i].status <= 599 ? calls[i].status
                                                                               : 502),
                   "flush_cache: the %s worker %s answered %ld: %s", rt_role_name(w->role),
                   w->url.base, calls[i].status, message[0] ? message : "(no message)");
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

void rt_sgl_flush_calls(const rt_workers *t, rt_call *calls) {
    PD_ASSERT(t->count <= 2 * PD_ROUTER_WORKERS_MAX);
    for (size_t i = 0; i < t->count; i++) /* url fields are immutable */
        snprintf(calls[i].url, sizeof calls[i].url, "%s/flush_cache", t->w[i].url.base);
}
