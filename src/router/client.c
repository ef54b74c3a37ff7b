/*
 * Common libcurl settings and the fan-out POST; see client.h.
 */
#include "client.h"

#include <jansson.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

/* An answer body, kept up to a small bound: aborts answer a few bytes. */
typedef struct small_body {
    char data[1024];
    size_t len;
} small_body;

static size_t small_body_write(char *ptr, size_t size, size_t nmemb, void *userdata) {
    small_body *b = userdata;
    size_t n = size * nmemb;
    size_t room = sizeof b->data - 1 - b->len;
    size_t take = n < room ? n : room;
    memcpy(b->data + b->len, ptr, take);
    b->len += take;
    b->data[b->len] = '\0';
    return n; /* the excess is dropped, not an error */
}

void rt_fanout_post(rt_post *posts, size_t n, const char *body, uint32_t timeout_ms,
                    uint32_t connect_timeout_ms, const char *api_key) {
    PD_ASSERT(n <= 2 * PD_ROUTER_WORKERS_MAX);
    CURL *easy[2 * PD_ROUTER_WORKERS_MAX] = {0};
    small_body *bodies = calloc(n ? n : 1, sizeof *bodies);
    struct curl_slist *hdrs = curl_slist_append(NULL, "Content-Type: application/json");
    struct curl_slist *more = hdrs ? curl_slist_append(hdrs, "Expect:") : NULL;
    if (!more) {
        curl_slist_free_all(hdrs);
        hdrs = NULL;
    }
    CURLM *multi = rt_client_multi();
    for (size_t i = 0; i < n; i++) {
        posts[i].status = 0;
        posts[i].aborted = -1;
        posts[i].message[0] = '\0';
        if (!multi || !hdrs || !bodies) continue;
        easy[i] = curl_easy_init();
        if (!easy[i]) continue;
        rt_client_setup(easy[i], connect_timeout_ms, api_key);
        curl_easy_setopt(easy[i], CURLOPT_URL, posts[i].url);
        curl_easy_setopt(easy[i], CURLOPT_HTTPHEADER, hdrs);
        curl_easy_setopt(easy[i], CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(easy[i], CURLOPT_POSTFIELDSIZE, (long)strlen(body));
        curl_easy_setopt(easy[i], CURLOPT_TIMEOUT_MS, (long)timeout_ms);
        curl_easy_setopt(easy[i], CURLOPT_WRITEFUNCTION, small_body_write);
        curl_easy_setopt(easy[i], CURLOPT_WRITEDATA, &bodies[i]);
        if (curl_multi_add_handle(multi, easy[i]) != CURLM_OK) {
            curl_easy_cleanup(easy[i]);
            easy[i] = NULL;
        }
    }
    if (multi) {
        /* Each handle ends by its own CURLOPT_TIMEOUT_MS; the loop bound is a
         * backstop against a clock or library surprise. */
        uint64_t give_up_ms = rt_now_ms() + (uint64_t)timeout_ms + connect_timeout_ms + 1000;
        int running = 1;
        while (running > 0 && rt_now_ms() < give_up_ms) {
            if (curl_multi_perform(multi, &running) != CURLM_OK) break;
            if (running > 0) curl_multi_poll(multi, NULL, 0, 100, NULL);
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (!easy[i]) continue;
        long status = 0;
        curl_easy_getinfo(easy[i], CURLINFO_RESPONSE_CODE, &status);
        posts[i].status = status;
        json_t *root = json_loadb(bodies[i].data, bodies[i].len, 0, NULL);
        json_t *aborted = root ? json_object_get(root, "aborted") : NULL;
        if (json_is_integer(aborted)) posts[i].aborted = (long long)json_integer_value(aborted);
        const char *m =
            json_string_value(json_object_get(json_object_get(root, "error"), "message"));
        snprintf(posts[i].message, sizeof posts[i].message, "%s", m ? m : "");
        json_decref(root);
        curl_multi_remove_handle(multi, easy[i]);
        curl_easy_cleanup(easy[i]);
    }
    if (multi) curl_multi_cleanup(multi);
    curl_slist_free_all(hdrs);
    free(bodies);
}

long rt_get(const char *url, uint32_t timeout_ms, uint32_t connect_timeout_ms, const char *api_key,
            char *body, size_t cap) {
    PD_ASSERT(cap > 0);
    body[0] = '\0';
    CURL *easy = curl_easy_init();
    if (!easy) return 0;
    small_body b = {.len = 0};
    rt_client_setup(easy, connect_timeout_ms, api_key);
    curl_easy_setopt(easy, CURLOPT_URL, url);
    curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, (long)timeout_ms);
    curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, small_body_write);
    curl_easy_setopt(easy, CURLOPT_WRITEDATA, &b);
    long status = 0;
    if (curl_easy_perform(easy) == CURLE_OK)
        curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &status);
    curl_easy_cleanup(easy);
    snprintf(body, cap, "%s", b.data);
    return status;
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

void rt_fetch(const char *url, const char *body, size_t body_len, uint32_t timeout_ms,
              uint32_t connect_timeout_ms, const char *api_key, size_t cap, rt_fetched *out) {
    PD_ASSERT(url != NULL && cap > 0);
    *out = (rt_fetched){0};
    grow_body b = {.cap = cap};
    CURL *easy = curl_easy_init();
    struct curl_slist *hdrs = body ? curl_slist_append(NULL, "Content-Type: application/json")
                                   : NULL;
    struct curl_slist *more = hdrs ? curl_slist_append(hdrs, "Expect:") : NULL;
    if (!easy || (body && !more)) {
        curl_slist_free_all(hdrs);
        if (easy) curl_easy_cleanup(easy);
        return;
    }
    rt_client_setup(easy, connect_timeout_ms, api_key);
    curl_easy_setopt(easy, CURLOPT_URL, url);
    curl_easy_setopt(easy, CURLOPT_TIMEOUT_MS, (long)timeout_ms);
    curl_easy_setopt(easy, CURLOPT_WRITEFUNCTION, grow_body_write);
    curl_easy_setopt(easy, CURLOPT_WRITEDATA, &b);
    if (body) {
        curl_easy_setopt(easy, CURLOPT_HTTPHEADER, hdrs);
        curl_easy_setopt(easy, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(easy, CURLOPT_POSTFIELDSIZE, (long)body_len);
    }
    if (curl_easy_perform(easy) == CURLE_OK)
        curl_easy_getinfo(easy, CURLINFO_RESPONSE_CODE, &out->status);
    curl_easy_cleanup(easy);
    curl_slist_free_all(hdrs);
    PD_ASSERT(b.len <= cap);
    *out = (rt_fetched){.status = out->status, .body = b.data, .len = b.len, .cut = b.cut};
}
