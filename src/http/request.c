/*
 * request.c — the request handle: what a handler reads, how an answer
 * becomes bytes, and the contract between the thread that answers and the
 * loop that writes.
 *
 * The contract, all of it under the handle's mutex:
 *   H1  loop != NULL exactly while the connection waits for this answer
 *       ("attached"); only the loop thread sets or clears it, and while it
 *       is set the loop (its eventfd, its ready list) exists, because the
 *       loop detaches every handle before it goes away.
 *   H2  An answering call appends the answer's bytes, already framed
 *       (status line, headers, chunk sizes), to `pending` and puts the
 *       handle on the loop's ready list once (`queued`), taking a reference
 *       for the list; the loop moves the bytes to the connection. So bytes
 *       reach the wire in the order the calls were made, from any thread.
 *   H3  After the answer ended, or the connection did (`gone`), every
 *       answering call returns PD_ERR_STATE and touches nothing else.
 *   H4  An attached handle holds a reference for the loop; the last
 *       release frees it, and only a detached handle can be freed.
 *
 * Lock order: a handle's mutex, then the loop's; the loop never holds its
 * own while taking a handle's. Watch callbacks run with no lock held.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "pdserve/http.h"
#include "server_internal.h"

/* ---- the byte buffer ------------------------------------------------------ */

bool http_buf_append(http_buf *b, const void *p, size_t n) {
    if (n > b->cap - b->len) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap - b->len < n) {
            if (cap > SIZE_MAX / 2) return false;
            cap *= 2;
        }
        char *d = realloc(b->data, cap);
        if (!d) return false;
        b->data = d;
        b->cap = cap;
    }
    if (n) memcpy(b->data + b->len, p, n);
    b->len += n;
    return true;
}

bool http_buf_printf(http_buf *b, const char *fmt, ...) {
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    PD_ASSERT(n >= 0 && (size_t)n < sizeof line); /* callers print bounded pieces */
    return http_buf_append(b, line, (size_t)n);
}

void http_buf_consume(http_buf *b, size_t n) {
    PD_ASSERT(n <= b->len);
    memmove(b->data, b->data + n, b->len - n);
    b->len -= n;
}

void http_buf_free(http_buf *b) {
    free(b->data);
    *b = (http_buf){0};
}

/* ---- status lines ----------------------------------------------------------- */

const char *http_status_reason(unsigned status) {
    switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 201: return "Created";
    case 202: return "Accepted";
    case 204: return "No Content";
    case 304: return "Not Modified";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 413: return "Content Too Large";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 499: return "Client Closed Request";
    case 500: return "Internal Server Error";
    case 502: return "Bad Gateway";
    case 503: return "Service Unavailable";
    case 504: return "Gateway Timeout";
    case 505: return "HTTP Version Not Supported";
    default: return status >= 500 ? "Server Error" : status >= 400 ? "Client Error" : "OK";
    }
}

/* RFC 9110's IMF-fixdate, without the C locale's say in the names. */
static void http_date(char *out, size_t cap) {
    static const char days[7][4] = {"Sun", "Mon", "Tue", "Wed", "Thu", "Fri", "Sat"};
    static const char months[12][4] = {"Jan", "Feb", "Mar", "Apr", "May", "Jun",
                                       "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"};
    time_t now = time(NULL);
    struct tm tm;
    if (!gmtime_r(&now, &tm)) memset(&tm, 0, sizeof tm);
    /* Every field reduced to its range, so -O2's truncation check can bound it. */
    snprintf(out, cap, "%.3s, %02u %.3s %04u %02u:%02u:%02u GMT", days[(unsigned)tm.tm_wday % 7u],
             (unsigned)tm.tm_mday % 32u, months[(unsigned)tm.tm_mon % 12u],
             (unsigned)(tm.tm_year + 1900) % 10000u, (unsigned)tm.tm_hour % 24u,
             (unsigned)tm.tm_min % 60u, (unsigned)tm.tm_sec % 61u);
}

char *http_error_response(unsigned status, const char *message, size_t *len) {
    char *body = pd_http_error_body(status, "%s", message);
    if (!body) return NULL;
    char date[64];
    http_date(date, sizeof date);
    http_buf b = {0};
    bool ok = http_buf_printf(&b,
                              "HTTP/1.1 %u %s\r\nDate: %s\r\nContent-Type: application/json\r\n"
                              "Content-Length: %zu\r\nConnection: close\r\n\r\n",
                              status, http_status_reason(status), date, strlen(body)) &&
        http_buf_append(&b, body, strlen(body) + 1);
    free(body);
    if (!ok) {
        http_buf_free(&b);
        return NULL;
    }
    *len = b.len - 1; /* NUL-terminated, the NUL not counted */
    return b.data;
}

/* ---- getters ------------------------------------------------------------------ */

const char *pd_http_req_method(const pd_http_req *r) { return r->method; }
const char *pd_http_req_path(const pd_http_req *r) { return r->path; }
const char *pd_http_req_query(const pd_http_req *r) { return r->query; }
unsigned pd_http_req_version_minor(const pd_http_req *r) { return r->version_minor; }
const char *pd_http_req_client(const pd_http_req *r) { return r->client; }

const char *pd_http_req_header(const pd_http_req *r, const char *name) {
    for (uint32_t i = 0; i < r->headers_n; i++)
        if (!strcasecmp(r->head + r->headers[i].name, name)) return r->head + r->headers[i].value;
    return NULL;
}

const char *pd_http_req_body(const pd_http_req *r, size_t *len) {
    if (len) *len = r->body_len;
    return r->body ? r->body : "";
}

/* ---- references --------------------------------------------------------------- */

void pd_http_req_retain(pd_http_req *r) {
    unsigned before = atomic_fetch_add_explicit(&r->refs, 1, memory_order_relaxed);
    PD_ASSERT(before > 0);
}

void pd_http_req_release(pd_http_req *r) {
    if (!r) return;
    unsigned before = atomic_fetch_sub_explicit(&r->refs, 1, memory_order_acq_rel);
    PD_ASSERT(before > 0);
    if (before > 1) return;
    PD_ASSERT(r->loop == NULL && !r->queued); /* H4 */
    pthread_cond_destroy(&r->called);
    pthread_mutex_destroy(&r->mu);
    http_buf_free(&r->pending);
    free(r->body);
    free(r);
}

/* ---- answers -------------------------------------------------------------------- */

/* A header name is a token; a value holds no CR, LF or NUL. */
static bool header_ok(const char *name, const char *value) {
    if (!name || !*name || !value) return false;
    for (const char *c = name; *c; c++)
        if (*c <= ' ' || *c >= 127 || strchr("()<>@,;:\\\"/[]?={}", *c)) return false;
    return strpbrk(value, "\r\n") == NULL;
}

pd_err pd_http_req_add_header(pd_http_req *r, const char *name, const char *value) {
    if (!header_ok(name, value)) return PD_ERR_INVALID;
    size_t need = strlen(name) + strlen(value) + 4;
    pthread_mutex_lock(&r->mu);
    pd_err err = PD_OK;
    if (!r->loop || r->begun || r->gone) err = PD_ERR_STATE;
    else if (need > sizeof r->extra - r->extra_len) err = PD_ERR_TOOBIG;
    else
        r->extra_len += (size_t)snprintf(r->extra + r->extra_len, sizeof r->extra - r->extra_len,
                                         "%s: %s\r\n", name, value);
    pthread_mutex_unlock(&r->mu);
    return err;
}

/* H2: on the ready list once; the list holds a reference. Under r->mu. */
static void post(pd_http_req *r) {
    PD_ASSERT(r->loop != NULL);
    if (r->queued) return;
    r->queued = true;
    pd_http_req_retain(r);
    http_loop_post(r->loop, r);
}

/* Status line and headers into pending. framing: the Content-Length or
 * Transfer-Encoding line, or "". Under r->mu. */
static bool put_head(pd_http_req *r, unsigned status, const char *content_type,
                     const char *framing) {
    char date[64];
    http_date(date, sizeof date);
    bool ok = http_buf_printf(&r->pending, "HTTP/1.1 %u %s\r\nDate: %s\r\n", status,
                              http_status_reason(status), date);
    if (ok && content_type) ok = http_buf_printf(&r->pending, "Content-Type: %s\r\n", content_type);
    if (ok) ok = http_buf_append(&r->pending, framing, strlen(framing));
    if (ok && r->close_after) ok = http_buf_printf(&r->pending, "Connection: close\r\n");
    else if (ok && r->version_minor == 0)
        ok = http_buf_printf(&r->pending, "Connection: keep-alive\r\n");
    return ok && http_buf_append(&r->pending, r->extra, r->extra_len) &&
        http_buf_append(&r->pending, "\r\n", 2);
}

static bool status_ok(unsigned status, const char *content_type) {
    if (status < 200 || status > 599) return false;
    if (content_type && (strlen(content_type) > 200 || strpbrk(content_type, "\r\n"))) return false;
    return true;
}

/* 204 and 304 carry neither a body nor a Content-Length. */
static bool bodiless(unsigned status) { return status == 204 || status == 304; }

static pd_err respond_locked(pd_http_req *r, unsigned status, const char *content_type,
                             const void *body, size_t len) {
    if (!r->loop || r->begun || r->gone) return PD_ERR_STATE; /* H1, H3 */
    size_t mark = r->pending.len;
    char framing[64] = "";
    if (!bodiless(status)) snprintf(framing, sizeof framing, "Content-Length: %zu\r\n", len);
    bool ok = put_head(r, status, content_type, framing);
    if (ok && !r->head_only && !bodiless(status)) ok = http_buf_append(&r->pending, body, len);
    if (!ok) {
        r->pending.len = mark;
        return PD_ERR_NOMEM;
    }
    r->begun = r->ended = true;
    post(r);
    return PD_OK;
}

pd_err pd_http_req_respond(pd_http_req *r, unsigned status, const char *content_type,
                           const void *body, size_t len) {
    if (!status_ok(status, content_type) || (!body && len)) return PD_ERR_INVALID;
    pthread_mutex_lock(&r->mu);
    pd_err err = respond_locked(r, status, content_type, body, len);
    pthread_mutex_unlock(&r->mu);
    return err;
}

pd_err pd_http_req_respond_json(pd_http_req *r, unsigned status, const char *json, size_t len) {
    return pd_http_req_respond(r, status, "application/json", json, len);
}

pd_err pd_http_req_respond_error(pd_http_req *r, unsigned status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *body = pd_http_error_body_v(status, fmt, ap);
    va_end(ap);
    if (!body) return PD_ERR_NOMEM;
    pd_err err = pd_http_req_respond_json(r, status, body, strlen(body));
    free(body);
    return err;
}

pd_err pd_http_req_stream_begin(pd_http_req *r, unsigned status, const char *content_type) {
    if (!status_ok(status, content_type) || bodiless(status)) return PD_ERR_INVALID;
    pthread_mutex_lock(&r->mu);
    pd_err err = PD_OK;
    if (!r->loop || r->begun || r->gone) {
        err = PD_ERR_STATE;
    } else {
        /* HTTP/1.0 has no chunks: the end of the connection ends the body. */
        r->chunked = r->version_minor >= 1;
        if (!r->chunked) r->close_after = true;
        size_t mark = r->pending.len;
        if (!put_head(r, status, content_type,
                      r->chunked ? "Transfer-Encoding: chunked\r\n" : "")) {
            r->pending.len = mark;
            err = PD_ERR_NOMEM;
        } else {
            r->begun = true;
            post(r);
        }
    }
    pthread_mutex_unlock(&r->mu);
    return err;
}

static pd_err write_locked(pd_http_req *r, const void *data, size_t len) {
    if (!r->loop || !r->begun || r->ended || r->gone) return PD_ERR_STATE;
    if (len == 0 || r->head_only) return PD_OK;
    if (r->pending.len + r->out_unsent >= r->watermark) {
        r->congested = true;
        return PD_ERR_NOMEM;
    }
    size_t mark = r->pending.len;
    bool ok = !r->chunked || http_buf_printf(&r->pending, "%zx\r\n", len);
    ok = ok && http_buf_append(&r->pending, data, len);
    if (ok && r->chunked) ok = http_buf_append(&r->pending, "\r\n", 2);
    if (!ok) {
        r->pending.len = mark;
        return PD_ERR_NOMEM;
    }
    post(r);
    return PD_OK;
}

pd_err pd_http_req_stream_write(pd_http_req *r, const void *data, size_t len) {
    if (!data && len) return PD_ERR_INVALID;
    pthread_mutex_lock(&r->mu);
    pd_err err = write_locked(r, data, len);
    pthread_mutex_unlock(&r->mu);
    return err;
}

pd_err pd_http_req_stream_end(pd_http_req *r) {
    pthread_mutex_lock(&r->mu);
    pd_err err = PD_OK;
    if (!r->loop || !r->begun || r->ended || r->gone) {
        err = PD_ERR_STATE;
    } else if (r->chunked && !r->head_only && !http_buf_append(&r->pending, "0\r\n\r\n", 5)) {
        err = PD_ERR_NOMEM;
    } else {
        r->ended = true;
        post(r);
    }
    pthread_mutex_unlock(&r->mu);
    return err;
}

/* ---- what happens to the client ------------------------------------------------- */

/* Runs the watch callback for ev outside r->mu (called with it held;
 * returns with it released). While it runs, `calling` says so, and
 * pd_http_req_watch(r, NULL) from another thread waits for it to return:
 * whoever frees the callback's user data after clearing the watch never
 * races a callback still using it. */
static void watch_call(pd_http_req *r, pd_http_req_event ev) {
    pd_http_req_watch_fn fn = r->watch;
    void *user = r->watch_user;
    if (!fn) {
        pthread_mutex_unlock(&r->mu);
        return;
    }
    r->calling++;
    r->calling_thread = pthread_self();
    pthread_mutex_unlock(&r->mu);
    fn(r, ev, user);
    pthread_mutex_lock(&r->mu);
    if (--r->calling == 0) pthread_cond_broadcast(&r->called);
    pthread_mutex_unlock(&r->mu);
}

void pd_http_req_watch(pd_http_req *r, pd_http_req_watch_fn fn, void *user) {
    pthread_mutex_lock(&r->mu);
    r->watch = fn;
    r->watch_user = user;
    /* Clearing: wait out a callback running on another thread (never the
     * one running it: a callback may clear its own watch). */
    while (!fn && r->calling > 0 && !pthread_equal(r->calling_thread, pthread_self()))
        pthread_cond_wait(&r->called, &r->mu);
    bool gone = r->gone;
    pthread_mutex_unlock(&r->mu);
    if (gone && fn) fn(r, PD_HTTP_REQ_GONE, user);
}

bool pd_http_req_gone(pd_http_req *r) {
    pthread_mutex_lock(&r->mu);
    bool gone = r->gone;
    pthread_mutex_unlock(&r->mu);
    return gone;
}

uint64_t pd_http_req_backlog_bytes(pd_http_req *r) {
    pthread_mutex_lock(&r->mu);
    uint64_t n = r->pending.len + r->out_unsent;
    pthread_mutex_unlock(&r->mu);
    return n;
}

/* ---- the loop's side ------------------------------------------------------------ */

void http_req_attach(pd_http_req *r, struct http_loop *loop, uint32_t conn, uint64_t watermark,
                     bool close_after) {
    pthread_mutex_lock(&r->mu);
    PD_ASSERT(r->loop == NULL && !r->begun);
    r->loop = loop;
    r->conn = conn;
    r->watermark = watermark;
    r->close_after = close_after || !r->keep_alive;
    pthread_mutex_unlock(&r->mu);
}

void http_req_detach(pd_http_req *r) {
    pthread_mutex_lock(&r->mu);
    PD_ASSERT(r->loop != NULL);
    r->loop = NULL;
    bool gone = r->gone = !r->ended;
    if (gone) watch_call(r, PD_HTTP_REQ_GONE);
    else pthread_mutex_unlock(&r->mu);
}

int http_req_take(pd_http_req *r, http_buf *out, bool *ended, bool *close_after) {
    pthread_mutex_lock(&r->mu);
    r->queued = false;
    int rc = 0;
    if (r->loop && out) {
        rc = 1;
        if (out->len == 0) { /* the common case: hand the buffer over, no copy */
            http_buf t = *out;
            *out = r->pending;
            r->pending = t;
            r->pending.len = 0;
        } else if (http_buf_append(out, r->pending.data, r->pending.len)) {
            r->pending.len = 0;
        } else {
            rc = -1;
        }
        *ended = r->ended && r->pending.len == 0;
        *close_after = r->close_after;
    }
    pthread_mutex_unlock(&r->mu);
    return rc;
}

void http_req_set_unsent(pd_http_req *r, uint64_t unsent) {
    pthread_mutex_lock(&r->mu);
    r->out_unsent = unsent;
    bool writable = r->congested && r->pending.len + unsent < r->watermark / 2;
    if (writable) r->congested = false;
    if (writable) watch_call(r, PD_HTTP_REQ_WRITABLE);
    else pthread_mutex_unlock(&r->mu);
}

void http_req_close_after(pd_http_req *r) {
    pthread_mutex_lock(&r->mu);
    r->close_after = true;
    pthread_mutex_unlock(&r->mu);
}
