/*
 * One request's two halves; see forward.h for the phases and the order of
 * decisions.
 *
 * The one rule behind every exit path: a half the router stops waiting for
 * is told so. abandon_all() sends /abort_request {"rid"} to both workers
 * (even a half that already finished: it costs a 404 and covers the race
 * where a worker had not registered the rid yet) and closes both
 * connections; abort_half() does the same for the one still running when
 * the other half's failure decided the answer. A half that ended by itself
 * (the decode node's final answer, the prefill node's hand-off) is never
 * aborted afterwards.
 *
 * Event stream bookkeeping: sse.h (one window of SSE_WINDOW bytes, complete
 * events before `ready`). Only complete events go out, so a router-made
 * ending (error event or abort event, then [DONE]) never lands in the middle
 * of a worker's event.
 */
#include "forward.h"

#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>

#include "client.h"
#include "sse.h"
#include "pdserve/http.h"
#include "stats.h"

#define PREFILL_BODY_MAX (64u * 1024u)     /* kept of the prefill node's answer */
#define SETTLE_MS 500u                     /* after the decode's answer, for the prefill's */
#define POLL_SLICE_MS 1000u                /* a wait is never longer: re-check the clock */

enum { PREFILL = 0, DECODE = 1 };

typedef struct half {
    rt_fwd *f;
    int role;
    char url[PD_ROUTER_URL_MAX + 32];
    char abort_url[PD_ROUTER_URL_MAX + 32];
    CURL *easy;
    bool added;           /* in the multi handle */
    bool done;            /* ended: completed, failed or closed by the router */
    bool closed;          /* closed by the router before it completed */
    bool aborted;         /* an /abort_request went to this worker */
    bool failed;          /* for the worker's failure count */
    CURLcode rc;
    long status;
    bool head_known;
    bool sse;             /* decode: passing an event stream through */
    bool paused;
    bool overflow;        /* the answer outgrew its bound */
    char content_type[128];
    char *body;           /* buffered answer (not used when sse) */
    size_t len, cap, cap_max;
} half;

/* How long a prefill failure waits for the decode node's answer before it
 * decides the response (see rt_fwd_head_wait). */
#define PREFILL_FAIL_GRACE_MS 250u

struct rt_fwd {
    rt_fwd_api api;
    char rid[PD_RID_MAX];
    char model[128];
    bool stream;
    char *body;
    size_t body_len;
    int client_fd;
    uint32_t timeout_ms, connect_timeout_ms, abort_timeout_ms, abort_grace_ms;
    const char *api_key; /* the router's, which outlives every forward */

    CURLM *multi;
    struct curl_slist *hdrs;
    half h[2];
    bool started;
    uint64_t deadline_ms;
    uint64_t grace_deadline_ms; /* 0 until an abort was requested and seen */
    uint64_t prefill_failed_ms; /* 0 until the prefill half was seen failed */
    atomic_bool abort_requested;
    atomic_bool shutdown_requested;
    atomic_bool client_gone_told; /* rt_fwd_client_gone: the server saw the hang-up */
    bool watch_client;
    bool client_gone;
    bool ended;                   /* nothing more to produce after what is queued */
    unsigned outcome;
    unsigned aborts_sent;

    /* FULL answers made by the router, and the content type handed out. */
    char *own_body;
    char content_type[128];

    /* STREAM */
    rt_sse ev; /* the decode node's event stream, when streaming */
    char *tail;
    size_t tail_len, tail_off;
};

/* ---- small helpers ------------------------------------------------------ */

static void copy_str(char *dst, size_t cap, const char *src) {
    snprintf(dst, cap, "%s", src ? src : "");
}

static bool half_transport_failed(const half *h) {
    return h->done && !h->closed && h->rc != CURLE_OK;
}
static bool half_http_failed(const half *h) {
    return h->done && !h->closed && h->rc == CURLE_OK && h->status >= 400;
}
static bool half_running(const half *h) { return h->added && !h->done; }

/* The status a transport failure maps to, and its message. */
static unsigned transport_status(const half *h, char *msg, size_t cap) {
    const char *who = h->role == PREFILL ? "prefill" : "decode";
    if (h->overflow) {
        snprintf(msg, cap, "the %s node's answer is larger than the router's limit", who);
        return 502;
    }
    if (h->rc == CURLE_OPERATION_TIMEDOUT) {
        snprintf(msg, cap, "the %s node did not accept the connection in time", who);
        return 504;
    }
    if (h->rc == CURLE_WEIRD_SERVER_REPLY && h->status != 0) {
        snprintf(msg, cap, "the %s node answered with status %ld, which is not an HTTP status", who,
                 h->status);
        return 502;
    }
    snprintf(msg, cap, "the %s node failed: %s", who, curl_easy_strerror(h->rc));
    return 502;
}

/* ---- libcurl callbacks ---------------------------------------------------- */

static void note_head(half *h) {
    if (h->head_known) return;
    h->head_known = true;
    curl_easy_getinfo(h->easy, CURLINFO_RESPONSE_CODE, &h->status);
    char *ct = NULL;
    curl_easy_getinfo(h->easy, CURLINFO_CONTENT_TYPE, &ct);
    copy_str(h->content_type, sizeof h->content_type, ct ? ct : "application/json");
    if (h->role == DECODE && h->f->stream && h->status == 200 &&
        !strncmp(h->content_type, "text/event-stream", 17))
        h->sse = true;
}

/* The blank line after a final (>= 200) status's headers: the head is known
 * before any body byte, so a stream's headers reach the client at once. */
static size_t half_header(char *buf, size_t size, size_t nitems, void *userdata) {
    half *h = userdata;
    size_t n = size * nitems;
    if ((n == 2 && buf[0] == '\r' && buf[1] == '\n') || (n == 1 && buf[0] == '\n')) {
        long status = 0;
        curl_easy_getinfo(h->easy, CURLINFO_RESPONSE_CODE, &status);
        if (status >= 200) note_head(h);
    }
    return n;
}

static size_t half_write(char *ptr, size_t size, size_t nmemb, void *userdata) {
    half *h = userdata;
    rt_fwd *f = h->f;
    size_t n = size * nmemb;
    note_head(h);
    if (h->sse) {
        /* Nothing after [DONE] goes out, nor anything after garbage. */
        if (f->ev.saw_done || f->ev.garbage) return n;
        if (n <= SSE_WINDOW - f->ev.len) {
            memcpy(f->ev.buf + f->ev.len, ptr, n);
            f->ev.len += n;
            h->paused = false;
            return n;
        }
        /* Full. Would the chunk fit once the client took every complete
         * event? If not, one event is larger than the window and the
         * stream is unusable; if so, wait for the client. */
        rt_sse_scan(&f->ev);
        if (f->ev.saw_done || f->ev.garbage) return n;
        if (n > SSE_WINDOW - (f->ev.len - f->ev.ready)) {
            h->overflow = true;
            return 0;
        }
        h->paused = true;
        return CURL_WRITEFUNC_PAUSE;
    }
    if (h->overflow) return h->role == PREFILL ? n : 0;
    if (n > h->cap_max - h->len) {
        h->overflow = true;
        /* The prefill node's answer matters only as an error message: keep
         * its start, drop the rest. The decode node's answer is the
         * client's: a truncated one would be wrong, so the transfer fails. */
        return h->role == PREFILL ? n : 0;
    }
    if (h->len + n + 1 > h->cap) {
        size_t cap = h->cap ? h->cap : 4096;
        while (cap < h->len + n + 1) cap *= 2;
        if (cap > h->cap_max + 1) cap = h->cap_max + 1;
        char *nb = realloc(h->body, cap);
        if (!nb) {
            h->overflow = true;
            return h->role == PREFILL ? n : 0;
        }
        h->body = nb;
        h->cap = cap;
    }
    memcpy(h->body + h->len, ptr, n);
    h->len += n;
    h->body[h->len] = '\0';
    return n;
}

/* ---- driving the transfers ------------------------------------------------ */

static void harvest(rt_fwd *f) {
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(f->multi, &left))) {
        if (m->msg != CURLMSG_DONE) continue;
        half *h = NULL;
        curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&h);
        PD_ASSERT(h != NULL && h->easy == m->easy_handle);
        CURLcode rc = m->data.result;
        note_head(h);
        /* A worker's status outside 100..599 is not HTTP: never passed on. */
        if (rc == CURLE_OK && (h->status < 100 || h->status > 599)) rc = CURLE_WEIRD_SERVER_REPLY;
        h->rc = rc;
        h->done = true;
        curl_multi_remove_handle(f->multi, h->easy);
        h->added = false;
        if (rc != CURLE_OK || h->status >= 500) h->failed = true;
    }
}

/* A hang-up shows as end-of-file (or an error) on a peek. Data means the
 * client pipelined its next request: from then on a hang-up cannot be told
 * from data without reading it, so the watch stops (the stream's writes
 * still notice a hang-up). */
static void check_client(rt_fwd *f) {
    if (atomic_load(&f->client_gone_told)) f->client_gone = true;
    if (!f->watch_client || f->client_gone) return;
    char c;
    ssize_t r = recv(f->client_fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (r == 0) f->client_gone = true;
    else if (r > 0) f->watch_client = false;
    else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) f->client_gone = true;
}

static void pump(rt_fwd *f, uint64_t wait_ms) {
    if (wait_ms > POLL_SLICE_MS) wait_ms = POLL_SLICE_MS;
    struct curl_waitfd wfd = {.fd = f->client_fd, .events = CURL_WAIT_POLLIN, .revents = 0};
    bool watch = f->watch_client && !f->client_gone;
    curl_multi_poll(f->multi, watch ? &wfd : NULL, watch ? 1u : 0u, (int)wait_ms, NULL);
    /* Checked after every wait, not only when poll flags the socket: a
     * reset can come back as POLLERR alone, which curl does not report. */
    check_client(f);
    int running = 0;
    curl_multi_perform(f->multi, &running);
    harvest(f);
}

static void close_half(half *h) {
    if (h->added) {
        curl_multi_remove_handle(h->f->multi, h->easy);
        h->added = false;
    }
    if (!h->done) {
        h->done = true;
        h->closed = true;
    }
}

/* /abort_request {"rid"} to the given halves' workers at once. */
static void send_aborts(rt_fwd *f, bool prefill, bool decode) {
    rt_post posts[2];
    size_t n = 0;
    for (int r = 0; r < 2; r++) {
        if (!(r == PREFILL ? prefill : decode) || f->h[r].aborted) continue;
        f->h[r].aborted = true;
        copy_str(posts[n].url, sizeof posts[n].url, f->h[r].abort_url);
        n++;
    }
    if (n == 0) return;
    json_t *o = json_pack("{s:s}", "rid", f->rid);
    char *body = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!body) return;
    rt_fanout_post(posts, n, body, f->abort_timeout_ms, f->connect_timeout_ms, f->api_key);
    free(body);
    f->aborts_sent += (unsigned)n;
}

/* Both workers are told and both connections closed. `blame`: the halves
 * still running count as failed (they ran out of time). */
static void abandon_all(rt_fwd *f, bool blame) {
    for (int r = 0; r < 2; r++)
        if (blame && half_running(&f->h[r])) f->h[r].failed = true;
    send_aborts(f, true, true);
    close_half(&f->h[PREFILL]);
    close_half(&f->h[DECODE]);
}

/* The other half decided the answer: tell this one if it still runs. */
static void abort_half(rt_fwd *f, int role) {
    if (!half_running(&f->h[role])) return;
    send_aborts(f, role == PREFILL, role == DECODE);
    close_half(&f->h[role]);
}

/* After the decode node's own final answer: give the prefill node a moment
 * to finish its (normally already finished) hand-off answer, then tell it if
 * it has not. The decode connection, if still open, is simply closed. */
static void settle(rt_fwd *f) {
    uint64_t until_ms = rt_now_ms() + SETTLE_MS;
    while (half_running(&f->h[PREFILL]) && !f->client_gone) {
        uint64_t now = rt_now_ms();
        if (now >= until_ms) break;
        pump(f, until_ms - now);
    }
    abort_half(f, PREFILL);
    close_half(&f->h[DECODE]);
}

/* ---- router-made answers ---------------------------------------------------- */

/* The final answer of an aborted request in the API's shape: a whole body
 * (non-streaming) or the data of one event (streaming). */
static char *abort_answer(const rt_fwd *f, bool event) {
    json_t *o;
    if (f->api == RT_FWD_GENERATE) {
        o = json_pack("{s:s, s:[], s:{s:s, s:{s:s, s:s, s:i}, s:i, s:i, s:i}}", "text", "",
                      "output_ids", "meta_info", "id", f->rid, "finish_reason", "type", "abort",
                      "message", "aborted by the router", "status_code", 499, "prompt_tokens", 0,
                      "completion_tokens", 0, "cached_tokens", 0);
    } else if (f->api == RT_FWD_CHAT) {
        char id[PD_RID_MAX + 12]; /* "chatcmpl-" and the rid */
        snprintf(id, sizeof id, "chatcmpl-%s", f->rid);
        o = json_pack("{s:s, s:s, s:I, s:s, s:[{s:i, s:{s:s, s:s}, s:s, s:n}]}", "id", id, "object",
                      event ? "chat.completion.chunk" : "chat.completion", "created",
                      (json_int_t)time(NULL), "model", f->model, "choices", "index", 0,
                      event ? "delta" : "message", "role", "assistant", "content", "",
                      "finish_reason", "abort", "logprobs");
        if (o && !event)
            json_object_set_new(o, "usage",
                                json_pack("{s:i, s:i, s:i}", "prompt_tokens", 0,
                                          "completion_tokens", 0, "total_tokens", 0));
    } else {
        char id[PD_RID_MAX + 8];   /* "cmpl-" and the rid */
        snprintf(id, sizeof id, "cmpl-%s", f->rid);
        o = json_pack("{s:s, s:s, s:I, s:s, s:[{s:i, s:s, s:s, s:n}]}", "id", id, "object",
                      "text_completion", "created", (json_int_t)time(NULL), "model", f->model,
                      "choices", "index", 0, "text", "", "finish_reason", "abort", "logprobs");
        if (o && !event)
            json_object_set_new(o, "usage",
                                json_pack("{s:i, s:i, s:i}", "prompt_tokens", 0,
                                          "completion_tokens", 0, "total_tokens", 0));
    }
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    return text;
}

static void set_full(rt_fwd *f, rt_fwd_head *head, unsigned status, char *own_body) {
    free(f->own_body);
    f->own_body = own_body;
    copy_str(f->content_type, sizeof f->content_type, "application/json");
    head->kind = RT_FWD_FULL;
    head->status = status;
    head->content_type = f->content_type;
    head->body = own_body ? own_body : "";
    head->body_len = own_body ? strlen(own_body) : 0;
    f->outcome = status;
    f->ended = true;
}

#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
static void set_error(rt_fwd *f, rt_fwd_head *head, unsigned status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *body = pd_http_error_body_v(status, fmt, ap);
    va_end(ap);
    set_full(f, head, status, body);
}

/* Ends the stream with `event_data` (may be NULL: no event) then [DONE]. */
static void set_tail(rt_fwd *f, char *event_data, unsigned outcome) {
    static const char done[] = "data: [DONE]\n\n";
    PD_ASSERT(f->ev.ready == 0);
    f->ev.len = 0; /* a partial event from the worker is dropped */
    f->ev.scanned = 0;
    size_t ev = event_data ? strlen(event_data) : 0;
    size_t cap = ev + 16 + sizeof done;
    free(f->tail);
    f->tail = malloc(cap);
    if (f->tail) {
        int n = event_data ? snprintf(f->tail, cap, "data: %s\n\n%s", event_data, done)
                           : snprintf(f->tail, cap, "%s", done);
        f->tail_len = n > 0 ? (size_t)n : 0;
    } else {
        f->tail_len = 0;
    }
    f->tail_off = 0;
    free(event_data);
    f->outcome = outcome;
    f->ended = true;
}

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static void set_error_tail(rt_fwd *f, unsigned status, const char *fmt, ...) {
    char *ev = NULL;
    if (!f->ev.saw_final) {
        va_list ap;
        va_start(ap, fmt);
        ev = pd_http_error_body_v(status, fmt, ap);
        va_end(ap);
    }
    set_tail(f, ev, f->ev.saw_final ? 200 : status);
}

static void set_abort_tail(rt_fwd *f) {
    set_tail(f, f->ev.saw_final ? NULL : abort_answer(f, true), f->ev.saw_final ? 200 : 499);
}

/* ---- creation ---------------------------------------------------------------- */

static pd_err half_init(rt_fwd *f, int role, const char *base, const char *path, char *msg,
                        size_t msg_cap) {
    half *h = &f->h[role];
    h->f = f;
    h->role = role;
    snprintf(h->url, sizeof h->url, "%s%s", base, path);
    snprintf(h->abort_url, sizeof h->abort_url, "%s/abort_request", base);
    h->cap_max = role == PREFILL ? PREFILL_BODY_MAX : 0;
    h->easy = curl_easy_init();
    if (!h->easy) return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "curl_easy_init failed");
    rt_client_setup(h->easy, f->connect_timeout_ms, f->api_key);
    curl_easy_setopt(h->easy, CURLOPT_URL, h->url);
    curl_easy_setopt(h->easy, CURLOPT_HTTPHEADER, f->hdrs);
    curl_easy_setopt(h->easy, CURLOPT_POSTFIELDS, f->body);
    curl_easy_setopt(h->easy, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)f->body_len);
    curl_easy_setopt(h->easy, CURLOPT_WRITEFUNCTION, half_write);
    curl_easy_setopt(h->easy, CURLOPT_WRITEDATA, h);
    curl_easy_setopt(h->easy, CURLOPT_HEADERFUNCTION, half_header);
    curl_easy_setopt(h->easy, CURLOPT_HEADERDATA, h);
    curl_easy_setopt(h->easy, CURLOPT_PRIVATE, (char *)h);
    return PD_OK;
}

pd_err rt_fwd_create(rt_fwd **out, const rt_fwd_params *p, char *msg, size_t msg_cap) {
    *out = NULL;
    PD_ASSERT(p->rid && p->body && p->prefill_base && p->decode_base);
    PD_ASSERT(p->rid[0] != '\0' && strlen(p->rid) < PD_RID_MAX); /* checked at the door */
    PD_ASSERT(p->timeout_ms > 0 && p->max_response_bytes > 0);
    rt_fwd *f = calloc(1, sizeof *f);
    if (!f) {
        free(p->body);
        return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    }
    f->api = p->api;
    copy_str(f->rid, sizeof f->rid, p->rid);
    copy_str(f->model, sizeof f->model, p->model ? p->model : "pdserve");
    f->stream = p->stream;
    f->body = p->body;
    f->body_len = p->body_len;
    f->client_fd = p->client_fd;
    f->watch_client = p->client_fd >= 0;
    f->timeout_ms = p->timeout_ms;
    f->connect_timeout_ms = PD_MIN(p->connect_timeout_ms, p->timeout_ms);
    f->abort_timeout_ms = p->abort_timeout_ms;
    f->abort_grace_ms = p->abort_grace_ms;
    f->api_key = p->api_key;
    atomic_init(&f->abort_requested, false);
    atomic_init(&f->shutdown_requested, false);
    atomic_init(&f->client_gone_told, false);
    const char *path = p->api == RT_FWD_GENERATE ? "/generate"
        : p->api == RT_FWD_CHAT                  ? "/v1/chat/completions"
                                                 : "/v1/completions";
    pd_err err = PD_OK;
    f->multi = rt_client_multi();
    struct curl_slist *a = curl_slist_append(NULL, "Content-Type: application/json");
    struct curl_slist *b = a ? curl_slist_append(a, "Expect:") : NULL;
    f->hdrs = b ? b : a;
    if (!f->multi || !b) err = pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    if (!err) err = half_init(f, PREFILL, p->prefill_base, path, msg, msg_cap);
    if (!err) err = half_init(f, DECODE, p->decode_base, path, msg, msg_cap);
    f->h[DECODE].cap_max = p->max_response_bytes;
    if (!err && p->stream && !(f->ev.buf = malloc(SSE_WINDOW)))
        err = pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    if (err) {
        rt_fwd_destroy(f);
        return err;
    }
    *out = f;
    return PD_OK;
}

/* ---- head ------------------------------------------------------------------- */

/* The answer of a request aborted through the router's /abort_request: a
 * final event with finish_reason abort (streams), or the API's abort answer. */
static void answer_aborted(rt_fwd *f, rt_fwd_head *head) {
    if (!head) {
        set_abort_tail(f);
    } else if (f->stream) {
        head->kind = RT_FWD_STREAM;
        head->status = 200;
        copy_str(f->content_type, sizeof f->content_type, "text/event-stream");
        head->content_type = f->content_type;
        set_abort_tail(f);
    } else {
        set_full(f, head, 200, abort_answer(f, false));
        f->outcome = 499;
    }
}

/* The decode node's complete (non-streamed) answer decides the response.
 * After an /abort_request, a failure is the abort's doing (it reached the
 * prefill half first, or the decode node before the request did, and the
 * room failed): the client gets the abort answer. */
static void finish_full(rt_fwd *f, rt_fwd_head *head) {
    half *d = &f->h[DECODE];
    char why[256];
    if (atomic_load(&f->abort_requested) && (d->rc != CURLE_OK || d->status >= 500)) {
        abort_half(f, PREFILL);
        answer_aborted(f, head);
        return;
    }
    if (d->rc != CURLE_OK) {
        unsigned status = transport_status(d, why, sizeof why);
        abort_half(f, PREFILL);
        set_error(f, head, status, "%s", why);
        return;
    }
    json_t *root = json_loadb(d->body ? d->body : "", d->len, 0, NULL);
    /* An object, or (a /generate batch or n > 1) an array of them. */
    bool is_object = json_is_object(root) ||
        (d->status < 400 && json_is_array(root) && json_is_object(json_array_get(root, 0)));
    json_decref(root);
    if (d->status >= 400) {
        abort_half(f, PREFILL);
        if (!is_object) {
            set_error(f, head, (unsigned)d->status, "the decode node answered HTTP %ld", d->status);
            return;
        }
    } else if (!is_object) {
        d->failed = true;
        abort_half(f, PREFILL);
        set_error(f, head, 502, "the decode node answered HTTP %ld with a body that is not JSON",
                  d->status);
        return;
    } else {
        settle(f);
    }
    head->kind = RT_FWD_FULL;
    head->status = (unsigned)d->status;
    copy_str(f->content_type, sizeof f->content_type, d->content_type);
    head->content_type = f->content_type;
    head->body = d->body ? d->body : "";
    head->body_len = d->len;
    f->outcome = head->status;
    f->ended = true;
}

/* The prefill node failed before the decode node answered: its failure is
 * the answer and the decode half is told to stop. */
static void prefill_failed(rt_fwd *f, rt_fwd_head *head) {
    half *p = &f->h[PREFILL];
    abort_half(f, DECODE);
    char why[256];
    if (p->rc != CURLE_OK) {
        unsigned status = transport_status(p, why, sizeof why);
        if (head) set_error(f, head, status, "%s", why);
        else set_error_tail(f, status, "%s", why);
        return;
    }
    /* Pass the node's own error body through when it is one, re-encoded on
     * one line (as an event it must be one line). */
    json_t *root = json_loadb(p->body ? p->body : "", p->len, 0, NULL);
    char *own = json_is_object(json_object_get(root, "error")) ? json_dumps(root, JSON_COMPACT)
                                                               : NULL;
    json_decref(root);
    unsigned status = (unsigned)p->status;
    if (head && own) set_full(f, head, status, own);
    else if (head) set_error(f, head, status, "the prefill node answered HTTP %u", status);
    else if (own && !f->ev.saw_final) set_tail(f, own, status);
    else {
        free(own);
        set_error_tail(f, status, "the prefill node answered HTTP %u", status);
    }
}

/* Common checks of both phases; true when the answer got decided. `head` is
 * NULL in the stream phase. */
static bool check_exits(rt_fwd *f, rt_fwd_head *head, uint64_t *wait_ms) {
    uint64_t now = rt_now_ms();
    if (atomic_load(&f->shutdown_requested)) {
        abandon_all(f, false);
        if (head) set_error(f, head, 503, "the router is shutting down");
        else set_error_tail(f, 503, "the router is shutting down");
        return true;
    }
    if (now >= f->deadline_ms) {
        abandon_all(f, true);
        if (head) set_error(f, head, 504, "no answer within the request timeout (%u ms)",
                            f->timeout_ms);
        else set_error_tail(f, 504, "no answer within the request timeout (%u ms)", f->timeout_ms);
        return true;
    }
    uint64_t until = f->deadline_ms;
    if (atomic_load(&f->abort_requested)) {
        if (f->grace_deadline_ms == 0) f->grace_deadline_ms = now + f->abort_grace_ms;
        if (now >= f->grace_deadline_ms) {
            abandon_all(f, false);
            answer_aborted(f, head);
            return true;
        }
        until = PD_MIN(until, f->grace_deadline_ms);
    }
    *wait_ms = until - now;
    return false;
}

void rt_fwd_head_wait(rt_fwd *f, rt_fwd_head *head) {
    memset(head, 0, sizeof *head);
    PD_ASSERT(!f->started);
    f->started = true;
    f->deadline_ms = rt_now_ms() + f->timeout_ms;
    for (int r = 0; r < 2; r++) {
        if (curl_multi_add_handle(f->multi, f->h[r].easy) == CURLM_OK) {
            f->h[r].added = true;
        } else {
            f->h[r].done = true;
            f->h[r].rc = CURLE_OUT_OF_MEMORY;
        }
    }
    int running = 0;
    curl_multi_perform(f->multi, &running);
    harvest(f);
    half *p = &f->h[PREFILL], *d = &f->h[DECODE];
    for (;;) {
        if (f->client_gone) {
            abandon_all(f, false);
            head->kind = RT_FWD_GONE;
            f->outcome = RT_STATUS_CLIENT_GONE;
            f->ended = true;
            return;
        }
        if (d->sse) {
            head->kind = RT_FWD_STREAM;
            head->status = 200;
            copy_str(f->content_type, sizeof f->content_type, d->content_type);
            head->content_type = f->content_type;
            f->outcome = 200;
            return;
        }
        if (d->done) {
            finish_full(f, head);
            return;
        }
        /* After an abort was asked for, a prefill failure (the abort
         * reached it, its room failed) does not decide: the decode node's
         * answer, or the abort answer at the grace deadline, does. Nor does
         * it decide at once: a decode node that refused the request cancels
         * the room, which fails the prefill half, and the decode node's own
         * answer (naming the real reason) comes at about the same time. */
        uint64_t wait_ms = 0;
        if ((half_transport_failed(p) || half_http_failed(p)) &&
            !atomic_load(&f->abort_requested)) {
            uint64_t now = rt_now_ms();
            if (!f->prefill_failed_ms) f->prefill_failed_ms = now;
            if (now >= f->prefill_failed_ms + PREFILL_FAIL_GRACE_MS) {
                prefill_failed(f, head);
                return;
            }
            if (check_exits(f, head, &wait_ms)) return;
            wait_ms = PD_MIN(wait_ms, f->prefill_failed_ms + PREFILL_FAIL_GRACE_MS - now);
        } else if (check_exits(f, head, &wait_ms)) {
            return;
        }
        pump(f, wait_ms);
    }
}

/* ---- stream ------------------------------------------------------------------- */

/* Called once the client has taken every complete event: the chunk curl
 * holds back now fits (half_write refused for good any chunk that could not
 * fit even then). */
static void unpause(rt_fwd *f) {
    half *d = &f->h[DECODE];
    PD_ASSERT(f->ev.ready == 0);
    if (d->paused && d->added) {
        d->paused = false;
        /* May call half_write right here. */
        curl_easy_pause(d->easy, CURLPAUSE_CONT);
    }
}

long rt_fwd_stream_read(rt_fwd *f, char *buf, size_t max) {
    PD_ASSERT(f->started && max > 0);
    half *p = &f->h[PREFILL], *d = &f->h[DECODE];
    for (;;) {
        if (f->ev.ready > 0) {
            size_t n = PD_MIN(max, f->ev.ready);
            memcpy(buf, f->ev.buf, n);
            memmove(f->ev.buf, f->ev.buf + n, f->ev.len - n);
            f->ev.len -= n;
            f->ev.ready -= n;
            f->ev.scanned -= n;
            return (long)n;
        }
        if (f->tail_off < f->tail_len) {
            size_t n = PD_MIN(max, f->tail_len - f->tail_off);
            memcpy(buf, f->tail + f->tail_off, n);
            f->tail_off += n;
            return (long)n;
        }
        if (f->ended) return 0;
        if (f->ev.saw_done) {
            settle(f);
            f->outcome = 200;
            f->ended = true;
            continue;
        }
        unpause(f);
        rt_sse_scan(&f->ev);
        if (f->ev.ready > 0 || f->ev.saw_done) continue;
        if (f->ev.garbage || d->overflow) {
            d->failed = true;
            abandon_all(f, false);
            set_error_tail(f, 502, "the decode node sent a malformed or oversized event");
            continue;
        }
        if (d->done) {
            /* The decode stream ended without [DONE]. */
            abort_half(f, PREFILL);
            if (d->rc != CURLE_OK && !d->closed) {
                char why[256];
                unsigned status = transport_status(d, why, sizeof why);
                set_error_tail(f, status, "%s", why);
            } else {
                set_error_tail(f, 502, "the decode node ended the stream without a final event");
            }
            continue;
        }
        /* After an abort was asked for, a prefill failure (the abort
         * reached it, its room failed) does not decide: the decode node's
         * answer, or the abort answer at the grace deadline, does. */
        if ((half_transport_failed(p) || half_http_failed(p)) &&
            !atomic_load(&f->abort_requested)) {
            prefill_failed(f, NULL);
            continue;
        }
        if (f->client_gone) {
            abandon_all(f, false);
            f->outcome = RT_STATUS_CLIENT_GONE;
            f->ended = true;
            return -1;
        }
        uint64_t wait_ms = 0;
        if (check_exits(f, NULL, &wait_ms)) continue;
        pump(f, wait_ms);
    }
}

/* ---- control from other threads, end, queries ------------------------------- */

void rt_fwd_request_abort(rt_fwd *f) {
    atomic_store(&f->abort_requested, true);
    curl_multi_wakeup(f->multi);
}

void rt_fwd_client_gone(rt_fwd *f) {
    atomic_store(&f->client_gone_told, true);
    curl_multi_wakeup(f->multi);
}

void rt_fwd_request_shutdown(rt_fwd *f) {
    atomic_store(&f->shutdown_requested, true);
    curl_multi_wakeup(f->multi);
}

void rt_fwd_close(rt_fwd *f) {
    if (!f->started) return;
    if (!f->ended || f->tail_off < f->tail_len || f->ev.ready > 0) {
        /* The exchange ended before the answer was fully handed out: the
         * client went away (or the connection failed) mid-answer. */
        abandon_all(f, false);
        f->outcome = RT_STATUS_CLIENT_GONE;
        f->ended = true;
        f->ev.ready = f->tail_len = f->tail_off = 0;
        return;
    }
    close_half(&f->h[PREFILL]);
    close_half(&f->h[DECODE]);
}

unsigned rt_fwd_outcome(const rt_fwd *f) { return f->outcome; }

bool rt_fwd_half_failed(const rt_fwd *f, rt_role role) {
    return f->h[role == RT_PREFILL ? PREFILL : DECODE].failed;
}

unsigned rt_fwd_aborts_sent(const rt_fwd *f) { return f->aborts_sent; }

void rt_fwd_destroy(rt_fwd *f) {
    if (!f) return;
    for (int r = 0; r < 2; r++) {
        half *h = &f->h[r];
        if (h->easy) {
            if (h->added) curl_multi_remove_handle(f->multi, h->easy);
            curl_easy_cleanup(h->easy);
        }
        free(h->body);
    }
    if (f->multi) curl_multi_cleanup(f->multi);
    curl_slist_free_all(f->hdrs);
    free(f->body);
    free(f->own_body);
    free(f->ev.buf);
    free(f->tail);
    free(f);
}
