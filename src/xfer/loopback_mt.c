/*
 * loopback_mt.c — the loopback transport for one process with several
 * threads (pdserve run: a prefill node and a decode node, each with its own
 * scheduler thread, sharing one fabric).
 *
 * A mutex serialises every call into the fabric, and a progress thread
 * advances it on the monotonic clock (in microseconds). Operations are
 * posted with zero latency and performed by the next advance; the thread is
 * woken when something is posted, and otherwise ticks every millisecond so
 * timeouts-by-time still progress.
 */
#include "pdserve/loopback_mt.h"

#include <pthread.h>
#include <stdlib.h>
#include <time.h>

typedef struct mt_endpoint {
    struct pd_loopback_mt *m;
    pd_xfer inner;
} mt_endpoint;

struct pd_loopback_mt {
    pd_loopback *lb;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread;
    bool running, stopping, kick;
    mt_endpoint eps[2];
};

static uint64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

#define LOCKED(ep, expr)                                                       \
    do {                                                                       \
        pthread_mutex_lock(&(ep)->m->mu);                                      \
        expr;                                                                  \
        (ep)->m->kick = true;                                                  \
        pthread_cond_signal(&(ep)->m->cv);                                     \
        pthread_mutex_unlock(&(ep)->m->mu);                                    \
    } while (0)

static pd_err mt_sender_open(void *self, uint64_t room) {
    mt_endpoint *ep = self;
    pd_err r;
    LOCKED(ep, r = ep->inner.vt->sender_open(ep->inner.self, room));
    return r;
}
static uint32_t mt_sender_peer_cached(void *self, uint64_t room) {
    mt_endpoint *ep = self;
    uint32_t r;
    LOCKED(ep, r = ep->inner.vt->sender_peer_cached(ep->inner.self, room));
    return r;
}
static pd_err mt_send_pages(void *self, uint64_t room, uint32_t first, const uint32_t *src,
                            uint32_t n) {
    mt_endpoint *ep = self;
    pd_err r;
    LOCKED(ep, r = ep->inner.vt->send_pages(ep->inner.self, room, first, src, n));
    return r;
}
static pd_err mt_send_final(void *self, uint64_t room, uint32_t first, const uint32_t *src,
                            uint32_t n, uint32_t mamba_slot, uint32_t meta_row) {
    mt_endpoint *ep = self;
    pd_err r;
    LOCKED(ep, r = ep->inner.vt->send_final(ep->inner.self, room, first, src, n, mamba_slot,
                                            meta_row));
    return r;
}
static pd_err mt_receiver_open(void *self, uint64_t room, const char *peer,
                               const pd_xfer_dest *dest) {
    mt_endpoint *ep = self;
    pd_err r;
    LOCKED(ep, r = ep->inner.vt->receiver_open(ep->inner.self, room, peer, dest));
    return r;
}
static pd_xfer_status mt_status(void *self, uint64_t room) {
    mt_endpoint *ep = self;
    pd_xfer_status r;
    LOCKED(ep, r = ep->inner.vt->status(ep->inner.self, room));
    return r;
}
static pd_err mt_abort(void *self, uint64_t room) {
    mt_endpoint *ep = self;
    pd_err r;
    LOCKED(ep, r = ep->inner.vt->abort(ep->inner.self, room));
    return r;
}
static bool mt_drained(void *self, uint64_t room) {
    mt_endpoint *ep = self;
    bool r;
    LOCKED(ep, r = ep->inner.vt->drained(ep->inner.self, room));
    return r;
}
static void mt_close(void *self, uint64_t room) {
    mt_endpoint *ep = self;
    LOCKED(ep, ep->inner.vt->close(ep->inner.self, room));
}

static void mt_cancel(void *self, uint64_t room, const char *peer) {
    mt_endpoint *ep = self;
    LOCKED(ep, ep->inner.vt->cancel(ep->inner.self, room, peer));
}

static const pd_xfer_vtable mt_vt = {
    .sender_open = mt_sender_open, .sender_peer_cached = mt_sender_peer_cached,
    .send_pages = mt_send_pages, .send_final = mt_send_final, .receiver_open = mt_receiver_open,
    .status = mt_status, .abort = mt_abort, .drained = mt_drained, .close = mt_close,
    .cancel = mt_cancel,
};

static void *progress_main(void *arg) {
    pd_loopback_mt *m = arg;
    pthread_mutex_lock(&m->mu);
    while (!m->stopping) {
        pd_loopback_advance(m->lb, now_us());
        if (!m->kick) {
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += 1000000; /* 1 ms */
            if (until.tv_nsec >= 1000000000) {
                until.tv_sec++;
                until.tv_nsec -= 1000000000;
            }
            pthread_cond_timedwait(&m->cv, &m->mu, &until);
        }
        m->kick = false;
    }
    pthread_mutex_unlock(&m->mu);
    return NULL;
}

pd_err pd_loopback_mt_create(pd_loopback_mt **out, uint32_t page_size, uint32_t rooms_max) {
    if (!out || page_size == 0 || rooms_max == 0) return PD_ERR_INVALID;
    pd_loopback_mt *m = calloc(1, sizeof(*m));
    if (!m) return PD_ERR_NOMEM;
    pd_loopback_config c = {
        .latency = 0, .dead_grace = 0, .rooms_max = rooms_max, .page_size = page_size};
    pd_err err = pd_loopback_create(&m->lb, &c);
    if (err) {
        free(m);
        return err;
    }
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->cv, NULL);
    for (int s = 0; s < 2; s++) {
        m->eps[s].m = m;
        m->eps[s].inner = pd_loopback_endpoint(m->lb, (pd_lb_side)s);
    }
    *out = m;
    return PD_OK;
}

pd_xfer pd_loopback_mt_endpoint(pd_loopback_mt *m, pd_lb_side side) {
    return (pd_xfer){.vt = &mt_vt, .self = &m->eps[side]};
}

void pd_loopback_mt_register(pd_loopback_mt *m, pd_lb_side side, const pd_exec_memory *mem,
                             pd_meta_row *meta, uint32_t meta_rows) {
    pthread_mutex_lock(&m->mu);
    pd_loopback_register(m->lb, side, mem, meta, meta_rows);
    pthread_mutex_unlock(&m->mu);
}

pd_err pd_loopback_mt_start(pd_loopback_mt *m) {
    if (m->running) return PD_ERR_STATE;
    if (pthread_create(&m->thread, NULL, progress_main, m) != 0) return PD_ERR_NOMEM;
    m->running = true;
    return PD_OK;
}

void pd_loopback_mt_destroy(pd_loopback_mt *m) {
    if (!m) return;
    if (m->running) {
        pthread_mutex_lock(&m->mu);
        m->stopping = true;
        pthread_cond_signal(&m->cv);
        pthread_mutex_unlock(&m->mu);
        pthread_join(m->thread, NULL);
    }
    pd_loopback_destroy(m->lb);
    pthread_mutex_destroy(&m->mu);
    pthread_cond_destroy(&m->cv);
    free(m);
}
