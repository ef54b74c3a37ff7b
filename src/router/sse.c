/* The router's event-stream reader; sse.h says what it decides. */
#include "sse.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

/* Collects the data lines of one event (joined by '\n', as the SSE format
 * says) into dst, growing into a heap buffer when it does not fit. Returns
 * the buffer holding them (dst or a new one the caller frees), NULL when
 * out of memory; *any says whether there was a data line at all. */
static char *event_data(const char *ev, size_t len, char *dst, size_t cap, size_t *dlen,
                        bool *any) {
    char *big = NULL;
    *dlen = 0;
    *any = false;
    for (size_t i = 0; i < len;) {
        size_t j = i;
        while (j < len && ev[j] != '\n') j++;
        size_t line_len = j - i;
        if (line_len && ev[i + line_len - 1] == '\r') line_len--;
        if (line_len >= 5 && !memcmp(ev + i, "data:", 5)) {
            const char *v = ev + i + 5;
            size_t vl = line_len - 5;
            if (vl && *v == ' ') v++, vl--;
            if (*dlen + (*any ? 1 : 0) + vl + 1 > cap) {
                char *nb = malloc(len + 2);
                if (!nb) {
                    free(big);
                    return NULL;
                }
                memcpy(nb, dst, *dlen);
                free(big);
                big = dst = nb;
                cap = len + 2;
            }
            if (*any) dst[(*dlen)++] = '\n';
            memcpy(dst + *dlen, v, vl);
            *dlen += vl;
            *any = true;
        }
        i = j + 1;
    }
    return dst;
}

/* Classifies one complete event; false for garbage (data not a JSON object). */
static bool classify_event(rt_sse *s, const char *ev, size_t len) {
    char small[4096];
    size_t dlen;
    bool any;
    char *data = event_data(ev, len, small, sizeof small, &dlen, &any);
    if (!data) return false;
    bool ok = true;
    if (!any) {
        /* a comment or an empty event: passed through */
    } else if (dlen == 6 && !memcmp(data, "[DONE]", 6)) {
        s->saw_done = true;
    } else {
        json_t *root = json_loadb(data, dlen, 0, NULL);
        if (!json_is_object(root)) {
            ok = false;
        } else {
            json_t *meta = json_object_get(root, "meta_info");
            json_t *choices = json_object_get(root, "choices");
            json_t *fr = json_object_get(meta, "finish_reason");
            if (!fr && json_is_array(choices))
                fr = json_object_get(json_array_get(choices, 0), "finish_reason");
            if ((fr && !json_is_null(fr)) || json_object_get(root, "error")) {
                json_t *sc = json_object_get(fr, "status_code");
                s->saw_final = true;
                s->final_at = (size_t)(ev - s->buf);
                s->final_failed = json_object_get(root, "error") ||
                    (json_is_integer(sc) && json_integer_value(sc) >= 500);
            }
        }
        json_decref(root);
    }
    if (data != small) free(data);
    return ok;
}

/* The end of the first complete event at or after `from`, or 0. */
static size_t event_end(const rt_sse *s, size_t from) {
    for (size_t i = from; i + 1 < s->len; i++) {
        if (s->buf[i] == '\n' && s->buf[i + 1] == '\n') return i + 2;
        if (i + 3 < s->len && !memcmp(s->buf + i, "\r\n\r\n", 4)) return i + 4;
    }
    return 0;
}

void rt_sse_scan(rt_sse *s) {
    while (!s->saw_done && !s->garbage) {
        size_t from = s->scanned > s->ready + 3 ? s->scanned - 3 : s->ready;
        size_t end = event_end(s, from);
        if (end == 0) {
            s->scanned = s->len;
            return;
        }
        if (!classify_event(s, s->buf + s->ready, end - s->ready)) {
            s->garbage = true;
            return;
        }
        s->ready = end;
        s->scanned = end;
        if (s->saw_done) s->len = end; /* nothing after [DONE] goes out */
    }
}
