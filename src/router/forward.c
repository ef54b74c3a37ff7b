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
#include "feed.h"
#include "loop.h"
#include "sse.h"
#include "pdserve/http.h"
#include "stats.h"

#define PREFILL_BODY_MAX (64u * 1024u) /* kept of the prefill node's answer */
#define SETTLE_MS 500u                 /* after the decode's answer, for the prefill's */

enum { PREFILL = 0, DECODE = 1 };

typedef struct half {
    rt_xfer x; /* first: the loop hands it back to half_done */
    rt_fwd *f;
    int role;
    char url[PD_ROUTER_URL_MAX + 32];
    char abort_url[PD_ROUTER_URL_MAX + 32];
    CURL *easy;   /* x.easy */
    bool added;   /* in the loop's multi handle */
    bool done;    /* ended: completed, failed or closed by the router */
    bool closed;  /* closed by the router before it completed */
    bool aborted; /* an /abort_request went to this worker */
    bool failed;  /* for the worker's failure count */
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

/* An /abort_request to one half's worker, on the loop like the halves. */
typedef struct abort_post {
    rt_xfer x; /* first */
    rt_fwd *f;
    bool busy; /* in the multi handle */
} abort_post;

typedef enum phase {
    PH_HEAD,   /* both halves run; the response's head is not decided */
    PH_FULL,   /* a FULL or GONE head is decided, held until the workers were told */
    PH_STREAM, /* the client has a 200 event stream; events go out as they come */
    PH_END,    /* everything was handed out; ends once the aborts are back */
} phase;

struct rt_fwd {
    rt_task task; /* first: the loop hands it back to fwd_step */
    rt_loop *loop;
    rt_fwd_sink sink;
    phase phase;
    rt_fwd_head head;
    atomic_bool armed; /* rt_fwd_start was called: steps may run */

    rt_fwd_api api;
    char rid[PD_RID_MAX];
    char model[128];
    bool stream;
    char *body;
    size_t body_len;
    uint32_t timeout_ms, connect_timeout_ms, abort_timeout_ms, abort_grace_ms;
    const char *api_key; /* the router's, which outlives every forward */

    struct curl_slist *hdrs;
    half h[2];
    abort_post ab[2];
    char *abort_body;
    unsigned aborts_in_flight;
    bool started;
    uint64_t deadline_ms;
    uint64_t grace_deadline_ms; /* 0 until an abort was requested and seen */
    uint64_t prefill_failed_ms; /* 0 until the prefill half was seen failed */
    uint64_t settle_until_ms;   /* 0, or the prefill node's time to end by itself */
    atomic_bool abort_requested;
    atomic_bool shutdown_requested;
    atomic_bool client_gone_told; /* rt_fwd_client_gone: the server saw the hang-up */
    atomic_bool writable_told;    /* rt_fwd_writable: the client took its backlog */
    bool client_gone;
    bool gone_handled; /* the hang-up was acted on (aborts sent, output dropped) */
    bool blocked;      /* the client refused bytes: wait for writable_told */
    bool ended;        /* nothing more to produce after what is queued */
    unsigned outcome;
    unsigned aborts_sent;

    /* FULL answers made by the router, and the content type handed out. */
    char *own_body;
    char content_type[128];

    /* The stream feed (feed.h): `fed` once attached at the start; the
     * decode half is then the submit (202) and the events come from the feed
     * until [DONE], the feed's end (feed_lost) or the router lets go. */
    struct rt_feed *feed;
    uint32_t slot;
    bool fed, feed_attached, feed_live, feed_lost, feed_overflow;
    char *fed_body; /* the decode node's body: f->body with the feed's fields */

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
/* A stream on a feed runs after its submit is answered, until its events
 * end or the forward lets go of the feed. */
static bool half_running(const half *h) {
    const rt_fwd *f = h->f;
    bool fed_running = h->role == DECODE && f->feed_attached && f->feed_live && !f->feed_lost &&
        !f->ev.saw_done;
    return (h->added && !h->done) || fed_running;
}

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
    rt_loop_mark(f->loop, &f->task);
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

/* The loop took a half's transfer out: it completed or failed. */
static void half_done(rt_xfer *x, CURLcode rc) {
    half *h = (half *)x;
    note_head(h);
    /* A worker's status outside 100..599 is not HTTP: never passed on. */
    if (rc == CURLE_OK && (h->status < 100 || h->status > 599)) rc = CURLE_WEIRD_SERVER_REPLY;
    h->rc = rc;
    h->done = true;
    h->added = false;
    if (rc != CURLE_OK || h->status >= 500) h->failed = true;
    if (h->role == DECODE && h->f->fed && rc == CURLE_OK && h->status == 202)
        h->f->feed_live = true; /* the events come from the feed */
    rt_loop_mark(h->f->loop, &h->f->task);
}

static void close_half(half *h) {
    rt_fwd *f = h->f;
    if (h->role == DECODE && f->feed_attached) { /* no more of its events (D2) */
        rt_feed_detach(f->feed, f->slot, f);
        f->feed_attached = false;
    }
    if (h->added) {
        rt_loop_remove_xfer(h->f->loop, &h->x);
        h->added = false;
    }
    if (!h->done) {
        h->done = true;
        h->closed = true;
    }
}

static size_t discard(char *ptr, size_t size, size_t nmemb, void *userdata) {
    (void)ptr, (void)userdata;
    return size * nmemb;
}

static void abort_done(rt_xfer *x, CURLcode rc) {
    (void)rc; /* a worker that does not answer an abort cannot be told twice */
    abort_post *a = (abort_post *)x;
    PD_ASSERT(a->busy && a->f->aborts_in_flight > 0);
    a->busy = false;
    a->f->aborts_in_flight--;
    rt_loop_mark(a->f->loop, &a->f->task);
}

/* One /abort_request {"rid"} on the loop; the answer waits for it (held). */
static void post_abort(rt_fwd *f, int role) {
    abort_post *a = &f->ab[role];
    PD_ASSERT(!a->busy && a->x.easy == NULL);
    if (!f->abort_body) {
        json_t *o = json_pack("{s:s}", "rid", f->rid);
        f->abort_body = o ? json_dumps(o, JSON_COMPACT) : NULL;
        json_decref(o);
    }
    a->f = f;
    a->x.done = abort_done;
    a->x.easy = f->abort_body ? curl_easy_init() : NULL;
    if (!a->x.easy) return;
    rt_client_setup(a->x.easy, f->connect_timeout_ms, f->api_key);
    curl_easy_setopt(a->x.easy, CURLOPT_URL, f->h[role].abort_url);
    curl_easy_setopt(a->x.easy, CURLOPT_HTTPHEADER, f->hdrs);
    curl_easy_setopt(a->x.easy, CURLOPT_POSTFIELDS, f->abort_body);
    curl_easy_setopt(a->x.easy, CURLOPT_POSTFIELDSIZE, (long)strlen(f->abort_body));
    curl_easy_setopt(a->x.easy, CURLOPT_TIMEOUT_MS, (long)f->abort_timeout_ms);
    curl_easy_setopt(a->x.easy, CURLOPT_WRITEFUNCTION, discard);
    if (!rt_loop_add_xfer(f->loop, &a->x)) return;
    a->busy = true;
    f->aborts_in_flight++;
    f->aborts_sent++;
}

/* /abort_request {"rid"} to the given halves' workers at once. */
static void send_aborts(rt_fwd *f, bool prefill, bool decode) {
    for (int r = 0; r < 2; r++) {
        if (!(r == PREFILL ? prefill : decode) || f->h[r].aborted) continue;
        f->h[r].aborted = true;
        post_abort(f, r);
    }
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

/* After the decode node's own final answer, the prefill node gets SETTLE_MS
 * to finish its (normally already finished) hand-off answer; held() tells
 * it afterwards if it has not. */
static void start_settle(rt_fwd *f) { f->settle_until_ms = rt_now_ms() + SETTLE_MS; }

/* True while what is decided must wait: the prefill node's settling time,
 * or aborts still on their way (a client hears the outcome only once the
 * workers were told, as when the aborts were sent inline). */
static bool held(rt_fwd *f) {
    if (f->settle_until_ms) {
        uint64_t now = rt_now_ms();
        if (half_running(&f->h[PREFILL]) && !f->client_gone && now < f->settle_until_ms) {
            rt_loop_wake_at(f->loop, &f->task, f->settle_until_ms);
            return true;
        }
        f->settle_until_ms = 0;
        abort_half(f, PREFILL);
        close_half(&f->h[DECODE]);
    }
    return f->aborts_in_flight > 0;
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

static void fwd_step(rt_task *t);

/* ---- creation ---------------------------------------------------------------- */

static pd_err half_init(rt_fwd *f, int role, const char *base, const char *path, char *msg,
                        size_t msg_cap) {
    half *h = &f->h[role];
    h->f = f;
    h->role = role;
    snprintf(h->url, sizeof h->url, "%s%s", base, path);
    snprintf(h->abort_url, sizeof h->abort_url, "%s/abort_request", base);
    h->cap_max = role == PREFILL ? PREFILL_BODY_MAX : 0;
    h->easy = h->x.easy = curl_easy_init();
    h->x.done = half_done;
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
    f->loop = p->loop;
    f->sink = p->sink;
    f->task.step = fwd_step;
    atomic_init(&f->armed, false);
    atomic_init(&f->writable_told, false);
    f->timeout_ms = p->timeout_ms;
    f->connect_timeout_ms = PD_MIN(p->connect_timeout_ms, p->timeout_ms);
    f->abort_timeout_ms = p->abort_timeout_ms;
    f->abort_grace_ms = p->abort_grace_ms;
    f->api_key = p->api_key;
    f->feed = p->stream ? p->feed : NULL;
    f->slot = p->slot;
    atomic_init(&f->abort_requested, false);
    atomic_init(&f->shutdown_requested, false);
    atomic_init(&f->client_gone_told, false);
    const char *path = p->api == RT_FWD_GENERATE ? "/generate"
        : p->api == RT_FWD_CHAT                  ? "/v1/chat/completions"
                                                 : "/v1/completions";
    pd_err err = PD_OK;
    struct curl_slist *a = curl_slist_append(NULL, "Content-Type: application/json");
    struct curl_slist *b = a ? curl_slist_append(a, "Expect:") : NULL;
    f->hdrs = b ? b : a;
    if (!b) err = pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
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
        start_settle(f);
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

/* The decode node's body on a feed: the client's (a JSON object, as
 * json_dumps wrote it) with "stream_feed" and "stream_feed_tag" added. */
static char *fed_body(const rt_fwd *f, const char *id, const char *tag) {
    PD_ASSERT(f->body_len >= 2 && f->body[f->body_len - 1] == '}');
    json_t *add = json_pack("{s:s, s:s}", "stream_feed", id, "stream_feed_tag", tag);
    char *fields = add ? json_dumps(add, JSON_COMPACT) : NULL; /* {"stream_feed":...} */
    json_decref(add);
    if (!fields) return NULL;
    size_t keep = f->body_len - 1, more = strlen(fields) - 1; /* without '}', '{' */
    char *b = malloc(keep + more + 2);
    if (b) {
        bool empty = f->body_len == 2;
        memcpy(b, f->body, keep);
        b[keep] = ',';
        memcpy(b + keep + !empty, fields + 1, more);
        b[keep + !empty + more] = '\0';
    }
    free(fields);
    return b;
}

/* A stream goes through the decode node's feed when it is open (feed.h);
 * otherwise, or out of memory, the direct path. */
static void try_feed(rt_fwd *f) {
    char id[RT_FEED_ID_MAX], tag[RT_FEED_TAG_MAX];
    if (!f->feed || !rt_feed_attach(f->feed, f->slot, f, id, tag)) return;
    f->fed_body = fed_body(f, id, tag);
    if (!f->fed_body) {
        rt_feed_detach(f->feed, f->slot, f);
        return;
    }
    f->fed = f->feed_attached = true;
    CURL *e = f->h[DECODE].easy;
    curl_easy_setopt(e, CURLOPT_POSTFIELDS, f->fed_body);
    curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE_LARGE, (curl_off_t)strlen(f->fed_body));
}

static void start_transfers(rt_fwd *f) {
    PD_ASSERT(!f->started);
    f->started = true;
    f->deadline_ms = rt_now_ms() + f->timeout_ms;
    try_feed(f);
    for (int r = 0; r < 2; r++) {
        if (rt_loop_add_xfer(f->loop, &f->h[r].x)) {
            f->h[r].added = true;
        } else {
            f->h[r].done = true;
            f->h[r].rc = CURLE_OUT_OF_MEMORY;
        }
    }
}

/* One look at the head phase: true when the head got decided (f->head),
 * else the task's wake time is set. */
static bool head_decide(rt_fwd *f) {
    rt_fwd_head *head = &f->head;
    half *p = &f->h[PREFILL], *d = &f->h[DECODE];
    if (f->client_gone) {
        abandon_all(f, false);
        head->kind = RT_FWD_GONE;
        f->outcome = RT_STATUS_CLIENT_GONE;
        f->ended = f->gone_handled = true;
        return true;
    }
    if (d->sse || f->feed_live) {
        head->kind = RT_FWD_STREAM;
        head->status = 200;
        copy_str(f->content_type, sizeof f->content_type,
                 f->feed_live ? "text/event-stream" : d->content_type);
        head->content_type = f->content_type;
        f->outcome = 200;
        return true;
    }
    if (d->done) {
        finish_full(f, head);
        return true;
    }
    /* After an abort was asked for, a prefill failure (the abort reached
     * it, its room failed) does not decide: the decode node's answer, or the
     * abort answer at the grace deadline, does. Nor does it decide at once:
     * a decode node that refused a request cancels the room, which fails the
     * prefill half, and the decode node's own answer (naming the real
     * reason) comes at about the same time. */
    uint64_t wait_ms = 0;
    if ((half_transport_failed(p) || half_http_failed(p)) && !atomic_load(&f->abort_requested)) {
        uint64_t now = rt_now_ms();
        if (!f->prefill_failed_ms) f->prefill_failed_ms = now;
        if (now >= f->prefill_failed_ms + PREFILL_FAIL_GRACE_MS) {
            prefill_failed(f, head);
            return true;
        }
        if (check_exits(f, head, &wait_ms)) return true;
        wait_ms = PD_MIN(wait_ms, f->prefill_failed_ms + PREFILL_FAIL_GRACE_MS - now);
    } else if (check_exits(f, head, &wait_ms)) {
        return true;
    }
    rt_loop_wake_at(f->loop, &f->task, rt_now_ms() + PD_MAX(wait_ms, 1));
    return false;
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

typedef enum out_rc { OUT_TAKEN, OUT_WAIT, OUT_GONE } out_rc;

/* Bytes to the client, straight from the window or the tail: the server
 * copies them into the connection's output, or refuses all of them while
 * the client is behind (then rt_fwd_writable wakes the forward). */
static out_rc out(rt_fwd *f, const char *buf, size_t n) {
    if (f->blocked) return OUT_WAIT;
    int r = f->sink.data(f->sink.user, buf, n);
    if (r > 0) f->blocked = true;
    if (r < 0) f->client_gone = true;
    return r > 0 ? OUT_WAIT : r == 0 ? OUT_TAKEN : OUT_GONE;
}

/* The client went before the stream was handed out whole: both workers
 * are told, nothing more goes out. */
static void stream_gone(rt_fwd *f) {
    f->gone_handled = true;
    if (f->ended && f->tail_off >= f->tail_len && f->ev.ready == 0) return;
    abandon_all(f, false);
    f->outcome = RT_STATUS_CLIENT_GONE;
    f->ended = true;
    f->ev.ready = f->ev.len = f->ev.scanned = 0;
    f->tail_len = f->tail_off = 0;
}

/* The decode node's answer went bad or ended early; true when it did. */
static bool stream_broken(rt_fwd *f) {
    half *d = &f->h[DECODE];
    if (f->ev.garbage || d->overflow) {
        d->failed = true;
        abandon_all(f, false);
        set_error_tail(f, 502, "the decode node sent a malformed or oversized event");
        return true;
    }
    if (f->feed_live) {
        if (!f->feed_lost) return false;
        d->failed = true;
        abort_half(f, PREFILL);
        set_error_tail(f, 502, "the decode node's stream feed closed before the stream ended");
        return true;
    }
    if (!d->done) return false;
    /* The decode stream ended without [DONE]. */
    abort_half(f, PREFILL);
    if (d->rc != CURLE_OK && !d->closed) {
        char why[256];
        unsigned status = transport_status(d, why, sizeof why);
        set_error_tail(f, status, "%s", why);
    } else {
        set_error_tail(f, 502, "the decode node ended the stream without a final event");
    }
    return true;
}

/* A fed stream whose client fell further behind than the window: a feed
 * cannot wait for one client (it carries other streams), so what the client
 * did not take is dropped, both halves are aborted, and the stream ends with
 * an error event once the client reads again (or its write deadline ends
 * the connection). Checked before anything waits for the client. */
static void stream_too_slow(rt_fwd *f) {
    f->ev.ready = f->ev.len = f->ev.scanned = 0;
    abandon_all(f, false);
    set_error_tail(f, 503,
                   "the client read the stream more slowly than the decode node wrote it "
                   "(more than %u KiB behind)",
                   SSE_WINDOW / 1024u);
}

/* After an /abort_request, a stream whose final event is a failure ends as
 * the abort the client asked for: the abort reached the prefill node first
 * and the decode node's room failed ("transfer failed", 500), which is the
 * abort's doing, as finish_full decides for a whole answer. The events
 * before it still go out; the failure does not, nor anything after it.
 * Found by pdserve bench's abort-all bursts through pdserve run. */
static void stream_abort_decides(rt_fwd *f) {
    f->ev.ready = f->ev.len = f->ev.scanned = f->ev.final_at;
    f->ev.saw_final = f->ev.final_failed = false;
    f->ev.saw_done = true; /* nothing more from the decode node goes out */
    abort_half(f, PREFILL);
    set_abort_tail(f);
}

/* The body of a STREAM response: relays complete events as they come and
 * ends the stream exactly once; returns when the client or a worker must
 * act first, or with phase PH_END. */
static void stream_step(rt_fwd *f) {
    half *p = &f->h[PREFILL];
    for (;;) {
        if (f->client_gone && !f->gone_handled) stream_gone(f);
        if (f->feed_overflow && !f->ended) stream_too_slow(f);
        if (f->ev.final_failed && !f->ended && atomic_load(&f->abort_requested))
            stream_abort_decides(f);
        if (f->ev.ready > 0) {
            out_rc rc = out(f, f->ev.buf, f->ev.ready);
            if (rc == OUT_WAIT) return;
            if (rc == OUT_GONE) continue;
            size_t n = f->ev.ready;
            memmove(f->ev.buf, f->ev.buf + n, f->ev.len - n);
            f->ev.len -= n;
            f->ev.ready = 0;
            f->ev.scanned -= n;
            continue;
        }
        if (f->ended) {
            if (held(f)) return;
            if (f->tail_off < f->tail_len) {
                out_rc rc = out(f, f->tail + f->tail_off, f->tail_len - f->tail_off);
                if (rc == OUT_WAIT) return;
                if (rc == OUT_TAKEN) f->tail_off = f->tail_len;
                continue;
            }
            f->phase = PH_END;
            return;
        }
        if (f->ev.saw_done) {
            start_settle(f);
            f->outcome = 200;
            f->ended = true;
            continue;
        }
        unpause(f);
        rt_sse_scan(&f->ev);
        if (f->ev.ready > 0 || f->ev.saw_done || stream_broken(f)) continue;
        /* After an abort was asked for, a prefill failure (the abort
         * reached it, its room failed) does not decide: the decode node's
         * answer, or the abort answer at the grace deadline, does. */
        if ((half_transport_failed(p) || half_http_failed(p)) &&
            !atomic_load(&f->abort_requested)) {
            prefill_failed(f, NULL);
            continue;
        }
        uint64_t wait_ms = 0;
        if (check_exits(f, NULL, &wait_ms)) continue;
        rt_loop_wake_at(f->loop, &f->task, rt_now_ms() + PD_MAX(wait_ms, 1));
        return;
    }
}

/* ---- the forward as the loop's task ---------------------------------------- */

static void fwd_step(rt_task *t) {
    rt_fwd *f = (rt_fwd *)t;
    if (!atomic_load(&f->armed)) return;
    rt_loop_wake_at(f->loop, t, 0);
    if (atomic_load(&f->client_gone_told)) f->client_gone = true;
    if (atomic_exchange(&f->writable_told, false)) f->blocked = false;
    if (!f->started) start_transfers(f);
    if (f->phase == PH_HEAD) {
        if (!head_decide(f)) return;
        f->phase = f->head.kind == RT_FWD_STREAM ? PH_STREAM : PH_FULL;
        if (f->phase == PH_STREAM) f->sink.head(f->sink.user, &f->head);
    }
    if (f->phase == PH_FULL) {
        if (held(f)) return;
        f->sink.head(f->sink.user, &f->head);
        f->phase = PH_END;
    }
    if (f->phase == PH_STREAM) stream_step(f);
    if (f->phase != PH_END || held(f)) return;
    close_half(&f->h[PREFILL]);
    close_half(&f->h[DECODE]);
    PD_ASSERT(f->aborts_in_flight == 0 && !f->h[PREFILL].added && !f->h[DECODE].added);
    rt_loop_forget(f->loop, t);
    f->sink.end(f->sink.user); /* may destroy f */
}

/* ---- control from other threads, queries ------------------------------------ */

void rt_fwd_start(rt_fwd *f) {
    PD_ASSERT(!atomic_load(&f->armed));
    atomic_store(&f->armed, true);
    rt_loop_poke(f->loop, &f->task);
}

void rt_fwd_request_abort(rt_fwd *f) {
    atomic_store(&f->abort_requested, true);
    rt_loop_poke(f->loop, &f->task);
}

void rt_fwd_client_gone(rt_fwd *f) {
    atomic_store(&f->client_gone_told, true);
    rt_loop_poke(f->loop, &f->task);
}

void rt_fwd_writable(rt_fwd *f) {
    atomic_store(&f->writable_told, true);
    rt_loop_poke(f->loop, &f->task);
}

void rt_fwd_request_shutdown(rt_fwd *f) {
    atomic_store(&f->shutdown_requested, true);
    rt_loop_poke(f->loop, &f->task);
}

unsigned rt_fwd_outcome(const rt_fwd *f) { return f->outcome; }

bool rt_fwd_half_failed(const rt_fwd *f, rt_role role) {
    return f->h[role == RT_PREFILL ? PREFILL : DECODE].failed;
}

unsigned rt_fwd_aborts_sent(const rt_fwd *f) { return f->aborts_sent; }

bool rt_fwd_fed(const rt_fwd *f) { return f->fed; }

void rt_fwd_feed_bytes(rt_fwd *f, const char *buf, size_t n) {
    PD_ASSERT(f->feed_attached);
    rt_loop_mark(f->loop, &f->task);
    if (f->ev.saw_done || f->ev.garbage || f->feed_overflow || f->ended) return;
    if (n > SSE_WINDOW - f->ev.len) {
        f->feed_overflow = true; /* the client is that far behind */
        return;
    }
    memcpy(f->ev.buf + f->ev.len, buf, n);
    f->ev.len += n;
}

void rt_fwd_feed_lost(rt_fwd *f) {
    f->feed_attached = false; /* the feed let go of it (D3) */
    f->feed_lost = true;
    rt_loop_mark(f->loop, &f->task);
}

void rt_fwd_destroy(rt_fwd *f) {
    if (!f) return;
    /* A poke that came after the end (an abort, a hang-up) is dropped. */
    if (atomic_load(&f->armed)) rt_loop_forget(f->loop, &f->task);
    for (int r = 0; r < 2; r++) {
        half *h = &f->h[r];
        PD_ASSERT(!h->added && !f->ab[r].busy); /* ended, or never started */
        if (h->easy) curl_easy_cleanup(h->easy);
        if (f->ab[r].x.easy) curl_easy_cleanup(f->ab[r].x.easy);
        free(h->body);
    }
    curl_slist_free_all(f->hdrs);
    free(f->body);
    free(f->abort_body);
    free(f->own_body);
    PD_ASSERT(!f->feed_attached);
    free(f->fed_body);
    free(f->ev.buf);
    free(f->tail);
    free(f);
}
