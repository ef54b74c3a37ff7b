/*
 * Common libcurl settings and the fan-out POST; see client.h.
 */
#include "client.h"

#include <jansson.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "loop.h"
#include "pdserve/router.h"

/* libcurl's global state belongs to the process, not to a router: it must be
 * initialised once before any handle exists, and (unless libcurl was built
 * thread-safe) never while another thread might be initialising it. Routers
 * come and go, several per process in tests, each on any thread, so one
 * process-wide once stands for that state here. It is written once, under
 * pthread_once, and only read after.
 *
 * The same once makes the connection pool: a curl share handle holding the
 * connection cache (and DNS cache) that every handle of every router in the
 * process uses, so a request's halves, aborts and health probes reuse kept-
 * alive connections to the workers instead of opening (and leaving in
 * TIME_WAIT) one per transfer. Connections are keyed by host and port, so
 * routers sharing it never mix workers up. libcurl calls the lock functions
 * around every use from any thread. */
static struct {
    pthread_once_t once;
    CURLcode rc;
    CURLSH *share;
    pthread_mutex_t locks[CURL_LOCK_DATA_LAST];
} curl_global = {PTHREAD_ONCE_INIT, CURLE_OK, NULL, {PTHREAD_MUTEX_INITIALIZER}};

static void share_lock(CURL *easy, curl_lock_data data, curl_lock_access access, void *user) {
    (void)easy, (void)access, (void)user;
    pthread_mutex_lock(&curl_global.locks[data]);
}

static void share_unlock(CURL *easy, curl_lock_data data, void *user) {
    (void)easy, (void)user;
    pthread_mutex_unlock(&curl_global.locks[data]);
}

static void curl_global_init_once(void) {
    curl_global.rc = curl_global_init(CURL_GLOBAL_DEFAULT);
    if (curl_global.rc != CURLE_OK) return;
    for (int i = 0; i < CURL_LOCK_DATA_LAST; i++) pthread_mutex_init(&curl_global.locks[i], NULL);
    CURLSH *sh = curl_share_init();
    if (!sh) return; /* no pool: every transfer opens its own connection */
    bool ok = curl_share_setopt(sh, CURLSHOPT_LOCKFUNC, share_lock) == CURLSHE_OK &&
        curl_share_setopt(sh, CURLSHOPT_UNLOCKFUNC, share_unlock) == CURLSHE_OK &&
        curl_share_setopt(sh, CURLSHOPT_SHARE, CURL_LOCK_DATA_CONNECT) == CURLSHE_OK &&
        curl_share_setopt(sh, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS) == CURLSHE_OK;
    if (ok) curl_global.share = sh;
    else curl_share_cleanup(sh);
}

pd_err rt_client_global_init(char *msg, size_t msg_cap) {
    pthread_once(&curl_global.once, curl_global_init_once);
    if (curl_global.rc != CURLE_OK)
        return pd_errorf(msg, msg_cap, PD_ERR_INTERNAL, "curl_global_init: %s",
                         curl_easy_strerror(curl_global.rc));
    return PD_OK;
}

void rt_client_setup(CURL *easy, uint32_t connect_timeout_ms, const char *api_key) {
    curl_easy_setopt(easy, CURLOPT_NOSIGNAL, 1L);
    /* Workers are addressed directly; an http_proxy in the environment must
     * not reroute them. */
    curl_easy_setopt(easy, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(easy, CURLOPT_HTTP_VERSION, (long)CURL_HTTP_VERSION_1_1);
    curl_easy_setopt(easy, CURLOPT_CONNECTTIMEOUT_MS, (long)connect_timeout_ms);
    curl_easy_setopt(easy, CURLOPT_TCP_NODELAY, 1L);
    if (curl_global.share) curl_easy_setopt(easy, CURLOPT_SHARE, curl_global.share);
    /* The workers' --api-key: with Bearer the only method, libcurl sends it
     * on the first request, not after a 401. */
    if (api_key && api_key[0]) {
        curl_easy_setopt(easy, CURLOPT_HTTPAUTH, (long)CURLAUTH_BEARER);
        curl_easy_setopt(easy, CURLOPT_XOAUTH2_BEARER, api_key);
    }
}

CURLM *rt_client_multi(void) {
    CURLM *m = curl_multi_init();
    /* The pool is shared: without a bound of its own, a multi handle prunes
     * it to four connections per transfer it holds, closing the idle
     * connections other requests left for reuse. */
    if (m) curl_multi_setopt(m, CURLMOPT_MAXCONNECTS, (long)RT_POOL_CONNECTIONS_MAX);
    return m;
}

uint64_t rt_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* A growing answer body, cut (and flagged) at cap. */
typedef struct grow_body {
    char *data;
    size_t len, size, cap;
    bool cut;
} grow_body;

static size_t grow_body_write(char *ptr, size_t size, size_t nmemb, void *userdata) {
    grow_body *b = userdata;
    size_t n = size * nmemb;
    size_t take = PD_MIN(n, b->cap - b->len);
    if (take < n) b->cut = true;
    if (b->len + take + 1 > b->size) {
        size_t want = PD_MAX(b->size * 2, b->len + take + 1);
        char *grown = realloc(b->data, PD_MIN(want, b->cap + 1));
        if (!grown) {
            b->cut = true;
            return 0; /* ends the transfer: an answer we cannot hold is not relayed */
        }
        b->data = grown;
        b->size = PD_MIN(want, b->cap + 1);
    }
    memcpy(b->data + b->len, ptr, take);
    b->len += take;
    b->data[b->len] = '\0';
    return n;
}

long long rt_call_aborted(const rt_call *c) {
    json_t *root = c->body ? json_loadb(c->body, c->len, 0, NULL) : NULL;
    json_t *aborted = json_object_get(root, "aborted");
    long long v = json_is_integer(aborted) ? (long long)json_integer_value(aborted) : -1;
    json_decref(root);
    return v;
}

void rt_call_message(const rt_call *c, char *buf, size_t cap) {
    json_t *root = c->body ? json_loadb(c->body, c->len, 0, NULL) : NULL;
    const char *m = json_string_value(json_object_get(json_object_get(root, "error"), "message"));
    snprintf(buf, cap, "%s", m ? m : "");
    json_decref(root);
}

/* ---- the batch ------------------------------------------------------------------ */

typedef struct batch_xfer {
    rt_xfer x;
    struct rt_batch *b;
    grow_body answer;
    long status;
    bool running; /* on the loop's multi handle */
} batch_xfer;

typedef struct rt_batch {
    rt_task task; /* first: the loop steps &task */
    rt_batch_params p;
    char *post; /* the copied body, NULL for GETs */
    struct curl_slist *hdrs;
    rt_call *calls; /* p.n of them: the batch's copy, handed to done */
    batch_xfer *xs; /* p.n of them */
    int stage;      /* stages started: 0, 1 or 2 */
    size_t pending; /* transfers running */
    uint64_t give_up_ms;
} rt_batch;

static void batch_xfer_done(rt_xfer *x, CURLcode rc) {
    batch_xfer *bx = (batch_xfer *)x;
    PD_ASSERT(bx->running && bx->b->pending > 0);
    if (rc == CURLE_OK) curl_easy_getinfo(x->easy, CURLINFO_RESPONSE_CODE, &bx->status);
    curl_easy_cleanup(x->easy);
    x->easy = NULL;
    bx->running = false;
    bx->b->pending--;
    rt_loop_mark(bx->b->p.loop, &bx->b->task);
}

/* Adds call i's transfer; a call that cannot start is over (status 0). */
static void batch_add(rt_batch *b, size_t i) {
    batch_xfer *bx = &b->xs[i];
    CURL *easy = curl_easy_init();
    if (!easy) return;
    rt_client_setup(easy, b->p.connect_timeout_ms, b->p.api_key);
    curl_easy_setopt(easy, CURLOPT_URL, b->calls[i].url);
    curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, (long)b->p.timeout_ms);
    curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, grow_body_write);
    curl_easy_setopt(easy, CURLOPT_WRITEDATA, &bx->answer);
    if (b->post) {
        curl_easy_setopt(easy, CURLOPT_HTTPHEADER, b->hdrs);
        curl_easy_setopt(easy, CURLOPT_POSTFIELDS, b->post);
        curl_easy_setopt(easy, CURLOPT_POSTFIELDSIZE, (long)b->p.body_len);
    }
    bx->x = (rt_xfer){.easy = easy, .done = batch_xfer_done};
    bx->b = b;
    if (!rt_loop_add_xfer(b->p.loop, &bx->x)) {
        curl_easy_cleanup(easy);
        bx->x.easy = NULL;
        return;
    }
    bx->running = true;
    b->pending++;
}

/* Starts the next stage's transfers. */
static void batch_next_stage(rt_batch *b) {
    PD_ASSERT(b->pending == 0 && b->stage < 2);
    size_t from = b->stage == 0 ? 0 : b->p.first_stage;
    size_t to = b->stage == 0 ? b->p.first_stage : b->p.n;
    b->stage++;
    /* Each transfer ends by its own CURLOPT_TIMEOUT_MS; this is a backstop
     * against a clock or library surprise. */
    b->give_up_ms = rt_now_ms() + (uint64_t)b->p.timeout_ms + b->p.connect_timeout_ms + 1000u;
    for (size_t i = from; i < to; i++) batch_add(b, i);
}

/* Past the backstop: the transfers still running end without an answer. */
static void batch_give_up(rt_batch *b) {
    for (size_t i = 0; i < b->p.n; i++) {
        batch_xfer *bx = &b->xs[i];
        if (!bx->running) continue;
        rt_loop_remove_xfer(b->p.loop, &bx->x);
        curl_easy_cleanup(bx->x.easy);
        bx->x.easy = NULL;
        bx->running = false;
        bx->status = 0;
        b->pending--;
    }
    PD_ASSERT(b->pending == 0);
}

static void batch_free(rt_batch *b) {
    for (size_t i = 0; b->xs && i < b->p.n; i++) free(b->xs[i].answer.data);
    free(b->xs);
    free(b->calls);
    curl_slist_free_all(b->hdrs);
    free(b->post);
    free(b);
}

/* Hands every answer to the caller, then frees the batch. */
static void batch_end(rt_batch *b) {
    PD_ASSERT(b->pending == 0);
    rt_loop_forget(b->p.loop, &b->task);
    for (size_t i = 0; i < b->p.n; i++) {
        batch_xfer *bx = &b->xs[i];
        rt_call *c = &b->calls[i];
        c->status = bx->status;
        c->body = bx->answer.data;
        c->len = bx->answer.len;
        c->cut = bx->answer.cut;
        bx->answer.data = NULL;
    }
    b->p.done(b->p.user, b->calls, b->p.n);
    for (size_t i = 0; i < b->p.n; i++) free(b->calls[i].body);
    batch_free(b);
}

static void batch_step(rt_task *t) {
    rt_batch *b = (rt_batch *)t;
    if (b->pending > 0 && rt_now_ms() >= b->give_up_ms) batch_give_up(b);
    while (b->pending == 0 && b->stage < 2) batch_next_stage(b);
    if (b->pending > 0) {
        rt_loop_wake_at(b->p.loop, t, b->give_up_ms);
        return;
    }
    batch_end(b); /* frees b */
}

pd_err rt_batch_start(const rt_batch_params *p, char *msg, size_t msg_cap) {
    PD_ASSERT(p->loop && p->done && p->first_stage <= p->n);
    PD_ASSERT(p->n <= 2 * PD_ROUTER_WORKERS_MAX && p->cap > 0);
    rt_batch *b = calloc(1, sizeof *b);
    if (!b) return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    b->p = *p;
    b->xs = calloc(p->n ? p->n : 1, sizeof *b->xs);
    b->calls = calloc(p->n ? p->n : 1, sizeof *b->calls);
    bool ok = b->xs != NULL && b->calls != NULL;
    for (size_t i = 0; ok && i < p->n; i++)
        snprintf(b->calls[i].url, sizeof b->calls[i].url, "%s", p->calls[i].url);
    for (size_t i = 0; ok && i < p->n; i++) b->xs[i].answer.cap = p->cap;
    if (ok && p->body) {
        b->post = malloc(p->body_len + 1);
        struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
        b->hdrs = h ? curl_slist_append(h, "Expect:") : NULL;
        if (!b->hdrs) curl_slist_free_all(h);
        ok = b->post && b->hdrs;
        if (b->post) memcpy(b->post, p->body, p->body_len);
        if (b->post) b->post[p->body_len] = '\0';
    }
    if (!ok) {
        batch_free(b);
        return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    }
    b->task.step = batch_step;
    rt_loop_poke(p->loop, &b->task); /* the first step starts the first stage */
    return PD_OK;
}
