/*
 * A stream feed on an upstream loop; see feed.h for the protocol and its
 * invariants (D1-D4).
 *
 * The feed is a task of its loop (retries, the stop request) and one
 * transfer on it (the GET). The transfer's write callback is the frame
 * splitter: an "id: <tag>" line, then the event's bytes up to the blank line
 * that ends it, handed on as they come (a chunk boundary may fall anywhere),
 * so an event is copied once, into its forward's window, as on the direct
 * path.
 */
#include "feed.h"

#include <curl/curl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "client.h"
#include "forward.h"
#include "pdserve/router.h"

#define FEED_LINE_MAX (RT_FEED_TAG_MAX + 8u) /* "id: " + the tag + "\n" */

typedef struct feed_slot {
    uint64_t seq;
    struct rt_fwd *fwd; /* D2 */
} feed_slot;

typedef enum parse_state { P_LINE, P_EVENT } parse_state;

struct rt_feed {
    rt_task task; /* first: the loop hands it back to feed_step */
    rt_xfer x;
    rt_loop *loop;
    char url[PD_ROUTER_URL_MAX + 32];
    const char *api_key;
    uint32_t connect_timeout_ms;
    feed_slot *slots;
    uint32_t slots_n, attached;
    uint64_t seq; /* the last tag's */
    /* the transfer */
    bool running, headed, bad;
    long status;
    char id[RT_FEED_ID_MAX];
    uint64_t retry_ms; /* 0: open at once */
    atomic_bool open;
    /* the frame splitter */
    parse_state ps;
    char line[FEED_LINE_MAX];
    size_t line_len;
    struct rt_fwd *target; /* P_EVENT: where the event goes (NULL: dropped, D2) */
    bool nl;               /* P_EVENT: the last byte was '\n' */
    /* the stop handshake (D1) */
    atomic_bool stop;
    bool started, closed;
    pthread_mutex_t mu;
    pthread_cond_t cv;
};

bool rt_feed_is_open(const rt_feed *fd) { return atomic_load(&fd->open); }

/* ---- attached forwards ------------------------------------------------------ */

bool rt_feed_attach(rt_feed *fd, uint32_t slot, struct rt_fwd *f, char *id, char *tag) {
    PD_ASSERT(rt_loop_is_own_thread(fd->loop) && slot < fd->slots_n);
    if (!atomic_load(&fd->open) || fd->slots[slot].fwd) return false;
    fd->slots[slot] = (feed_slot){.seq = ++fd->seq, .fwd = f};
    fd->attached++;
    snprintf(id, RT_FEED_ID_MAX, "%s", fd->id);
    snprintf(tag, RT_FEED_TAG_MAX, "%u.%llu", slot, (unsigned long long)fd->seq);
    return true;
}

void rt_feed_detach(rt_feed *fd, uint32_t slot, const struct rt_fwd *f) {
    PD_ASSERT(rt_loop_is_own_thread(fd->loop) && slot < fd->slots_n);
    if (fd->slots[slot].fwd != f) return;
    if (fd->target == f) fd->target = NULL; /* the rest of its event is dropped */
    fd->slots[slot] = (feed_slot){0};
    PD_ASSERT(fd->attached > 0);
    fd->attached--;
}

/* D3: every attached forward hears once that its events stopped. */
static void lose_all(rt_feed *fd) {
    for (uint32_t i = 0; i < fd->slots_n && fd->attached > 0; i++) {
        struct rt_fwd *f = fd->slots[i].fwd;
        if (!f) continue;
        rt_feed_detach(fd, i, f);
        rt_fwd_feed_lost(f);
    }
    PD_ASSERT(fd->attached == 0);
    fd->target = NULL;
}

/* ---- the frame splitter ---------------------------------------------------- */

/* The forward an "id: <slot>.<seq>" line names, or NULL (D2); false when the
 * line is not one. */
static bool parse_tag(rt_feed *fd, struct rt_fwd **out) {
    *out = NULL;
    unsigned slot;
    unsigned long long seq;
    int used = 0;
    fd->line[fd->line_len] = '\0';
    if (sscanf(fd->line, "id: %u.%llu%n", &slot, &seq, &used) != 2 || fd->line[used] != '\n')
        return false;
    if (slot < fd->slots_n && fd->slots[slot].seq == seq) *out = fd->slots[slot].fwd;
    return true;
}

/* Bytes of an event to its forward, up to the end of the event. */
static size_t take_event(rt_feed *fd, const char *p, size_t n) {
    size_t k = 0;
    bool end = false;
    for (; k < n && !end; k++) {
        end = fd->nl && p[k] == '\n';
        fd->nl = p[k] == '\n';
    }
    if (fd->target) rt_fwd_feed_bytes(fd->target, p, k);
    if (end) {
        fd->ps = P_LINE;
        fd->line_len = 0;
        fd->target = NULL;
    }
    return k;
}

/* Splits n bytes of the feed; false when they break the format. */
static bool split(rt_feed *fd, const char *p, size_t n) {
    while (n > 0) {
        if (fd->ps == P_EVENT) {
            size_t k = take_event(fd, p, n);
            p += k;
            n -= k;
            continue;
        }
        char c = *p++;
        n--;
        if (fd->line_len + 1 >= FEED_LINE_MAX) return false;
        fd->line[fd->line_len++] = c;
        if (c != '\n') continue;
        if (!parse_tag(fd, &fd->target)) return false;
        fd->ps = P_EVENT;
        fd->nl = false;
    }
    return true;
}

/* ---- the transfer ---------------------------------------------------------- */

static size_t feed_header(char *buf, size_t size, size_t nitems, void *userdata) {
    rt_feed *fd = userdata;
    size_t n = size * nitems;
    static const char name[] = "X-Stream-Feed:";
    if (n > sizeof name && !strncasecmp(buf, name, sizeof name - 1)) {
        const char *v = buf + sizeof name - 1;
        size_t len = n - (sizeof name - 1);
        while (len && (*v == ' ' || *v == '\t')) v++, len--;
        while (len && (v[len - 1] == '\r' || v[len - 1] == '\n' || v[len - 1] == ' ')) len--;
        if (len > 0 && len < sizeof fd->id) {
            memcpy(fd->id, v, len);
            fd->id[len] = '\0';
        }
    }
    if ((n == 2 && buf[0] == '\r' && buf[1] == '\n') || (n == 1 && buf[0] == '\n')) {
        curl_easy_getinfo(fd->x.easy, CURLINFO_RESPONSE_CODE, &fd->status);
        if (fd->status >= 200) {
            fd->headed = true;
            if (fd->status == 200 && fd->id[0]) atomic_store(&fd->open, true);
        }
    }
    return n;
}

static size_t feed_write(char *ptr, size_t size, size_t nmemb, void *userdata) {
    rt_feed *fd = userdata;
    size_t n = size * nmemb;
    if (!atomic_load(&fd->open)) return n; /* a 404's body (D4) */
    if (!split(fd, ptr, n)) {
        fd->bad = true;
        return 0; /* ends the transfer: D3 */
    }
    return n;
}

/* The loop took the transfer out: the feed is closed (D3). */
static void feed_done(rt_xfer *x, CURLcode rc) {
    (void)rc;
    rt_feed *fd = (rt_feed *)((char *)x - offsetof(rt_feed, x));
    /* Only a route the worker does not have (D4); a busy or stopping node
     * (503) is asked again soon. */
    bool unsupported = fd->headed && !atomic_load(&fd->open) &&
        (fd->status == 404 || fd->status == 405);
    fd->running = false;
    atomic_store(&fd->open, false);
    lose_all(fd);
    fd->retry_ms = rt_now_ms() + (unsupported ? RT_FEED_RETRY_UNSUPPORTED_MS : RT_FEED_RETRY_MS);
    rt_loop_mark(fd->loop, &fd->task);
}

static void feed_open(rt_feed *fd) {
    CURL *e = fd->x.easy;
    curl_easy_reset(e);
    rt_client_setup(e, fd->connect_timeout_ms, fd->api_key);
    curl_easy_setopt(e, CURLOPT_URL, fd->url);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, feed_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, fd);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, feed_write);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, fd);
    /* A connection of its own: a feed lives as long as the node does. */
    curl_easy_setopt(e, CURLOPT_FORBID_REUSE, 1L);
    curl_easy_setopt(e, CURLOPT_TCP_KEEPALIVE, 1L);
    fd->id[0] = '\0';
    fd->status = 0;
    fd->headed = fd->bad = false;
    fd->ps = P_LINE;
    fd->line_len = 0;
    fd->target = NULL;
    fd->running = rt_loop_add_xfer(fd->loop, &fd->x);
    if (!fd->running) fd->retry_ms = rt_now_ms() + RT_FEED_RETRY_MS;
}

static void feed_close(rt_feed *fd) {
    if (fd->running) rt_loop_remove_xfer(fd->loop, &fd->x);
    fd->running = false;
    atomic_store(&fd->open, false);
    lose_all(fd);
    rt_loop_forget(fd->loop, &fd->task);
    pthread_mutex_lock(&fd->mu);
    fd->closed = true;
    pthread_cond_broadcast(&fd->cv);
    pthread_mutex_unlock(&fd->mu);
}

static void feed_step(rt_task *t) {
    rt_feed *fd = (rt_feed *)t;
    rt_loop_wake_at(fd->loop, t, 0);
    if (atomic_load(&fd->stop)) {
        feed_close(fd); /* fd may be freed by rt_feed_destroy from here */
        return;
    }
    if (fd->running) return;
    if (rt_now_ms() >= fd->retry_ms) feed_open(fd);
    if (!fd->running) rt_loop_wake_at(fd->loop, t, fd->retry_ms);
}

/* ---- life ------------------------------------------------------------------ */

pd_err rt_feed_create(rt_feed **out, const rt_feed_params *p, char *msg, size_t msg_cap) {
    *out = NULL;
    PD_ASSERT(p->loop && p->base && p->slots > 0);
    rt_feed *fd = calloc(1, sizeof *fd);
    if (!fd) return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    fd->slots = calloc(p->slots, sizeof *fd->slots);
    fd->x.easy = curl_easy_init();
    if (!fd->slots || !fd->x.easy) {
        if (fd->x.easy) curl_easy_cleanup(fd->x.easy);
        free(fd->slots);
        free(fd);
        return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    }
    fd->task.step = feed_step;
    fd->x.done = feed_done;
    fd->loop = p->loop;
    snprintf(fd->url, sizeof fd->url, "%s/stream_feed", p->base);
    fd->api_key = p->api_key;
    fd->connect_timeout_ms = p->connect_timeout_ms;
    fd->slots_n = p->slots;
    atomic_init(&fd->open, false);
    atomic_init(&fd->stop, false);
    pthread_mutex_init(&fd->mu, NULL);
    pthread_cond_init(&fd->cv, NULL);
    *out = fd;
    return PD_OK;
}

void rt_feed_start(rt_feed *fd) {
    PD_ASSERT(!fd->started);
    fd->started = true;
    rt_loop_poke(fd->loop, &fd->task);
}

void rt_feed_destroy(rt_feed *fd) {
    if (!fd) return;
    if (fd->started) {
        PD_ASSERT(!rt_loop_is_own_thread(fd->loop));
        atomic_store(&fd->stop, true);
        rt_loop_poke(fd->loop, &fd->task);
        pthread_mutex_lock(&fd->mu);
        while (!fd->closed) pthread_cond_wait(&fd->cv, &fd->mu);
        pthread_mutex_unlock(&fd->mu);
    }
    PD_ASSERT(fd->attached == 0 && !fd->running);
    curl_easy_cleanup(fd->x.easy);
    pthread_mutex_destroy(&fd->mu);
    pthread_cond_destroy(&fd->cv);
    free(fd->slots);
    free(fd);
}
