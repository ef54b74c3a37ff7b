/*
 * stream.c — the in-order work stream around a synchronous executor (see
 * include/pdserve/stream.h).
 *
 * Each launched batch is copied (tokens and page tables) because the engine
 * may reuse its arrays at once; copies of state and host loads wait in the
 * same queue, so everything the executor does to memory happens in launch
 * order, at the time the driver lets the stream run.
 */
#include "pdserve/stream.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define OPS_MAX 64

typedef enum { SO_BATCH, SO_COPY, SO_LOAD } so_kind;
typedef enum { ST_FREE, ST_QUEUED, ST_RUNNING, ST_DONE } so_state;

typedef struct sitem {
    pd_batch_item item;     /* tokens and pages point into the copies below */
    int32_t *tokens;
    uint32_t *pages;
    uint32_t tokens_cap, pages_cap;
} sitem;

typedef struct sop {
    so_state state;
    so_kind kind;
    uint64_t id;            /* batch id / load id */
    bool held;
    uint64_t ready_at;      /* the driver's time from which it may run */
    uint32_t n;
    sitem *items;           /* batch_max */
    pd_batch_item *flat;    /* batch_max, handed to the inner executor */
    pd_item_result *results;
    pd_item_top *tops;
    uint32_t dst, src;      /* copy */
    uint32_t *dev, *host;   /* load */
    uint32_t dev_cap, host_cap;
} sop;

struct pd_stream {
    pd_executor inner;
    uint32_t batch_max;
    sop ops[OPS_MAX];
    uint32_t fifo[OPS_MAX], fifo_head, fifo_n;
    pd_stream_hold_fn hold_fn;
    void *hold_ctx;
    uint64_t now;
    bool hold_loads;
    /* Everything above is guarded by mu; the inner executor runs outside it. */
    pthread_mutex_t mu;
    pthread_cond_t cv;           /* work queued / work done */
    pthread_t worker;
    bool has_worker, stopping;
};

static void run_op(pd_stream *s, sop *o) {
    switch (o->kind) {
    case SO_BATCH: {
        for (uint32_t i = 0; i < o->n; i++) o->flat[i] = o->items[i].item;
        pd_batch b = {.id = o->id, .items = o->flat, .n_items = o->n};
        PD_MUST(s->inner.vt->launch(s->inner.self, &b));
        bool done = s->inner.vt->poll(s->inner.self, o->id, o->results, o->tops);
        PD_ASSERTF(done, "the inner executor of a stream must compute in launch");
        break;
    }
    case SO_COPY:
        PD_MUST(s->inner.vt->copy_state(s->inner.self, o->dst, o->src));
        break;
    case SO_LOAD:
        PD_MUST(s->inner.vt->load_begin(s->inner.self, o->id, o->dev, o->host, o->n));
        PD_ASSERTF(s->inner.vt->load_poll(s->inner.self, o->id),
                   "the inner executor of a stream must finish loads in load_begin");
        break;
    }
}

/* Takes the head of the stream if it may run now (locked). */
static sop *take_head(pd_stream *s) {
    if (s->fifo_n == 0) return NULL;
    sop *o = &s->ops[s->fifo[s->fifo_head]];
    if (o->held || o->ready_at > s->now) return NULL;
    s->fifo_head = (s->fifo_head + 1) % OPS_MAX;
    s->fifo_n--;
    o->state = ST_RUNNING;
    return o;
}

/* Runs a taken op without the lock, then publishes its completion. */
static void run_taken(pd_stream *s, sop *o) {
    run_op(s, o);
    pthread_mutex_lock(&s->mu);
    o->state = o->kind == SO_COPY ? ST_FREE : ST_DONE; /* a copy is never polled */
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

bool pd_stream_run_one(pd_stream *s) {
    pthread_mutex_lock(&s->mu);
    sop *o = take_head(s);
    pthread_mutex_unlock(&s->mu);
    if (!o) return false;
    run_taken(s, o);
    return true;
}

static void *worker_main(void *arg) {
    pd_stream *s = arg;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        sop *o;
        while (!s->stopping && !(o = take_head(s))) pthread_cond_wait(&s->cv, &s->mu);
        if (s->stopping) break;
        pthread_mutex_unlock(&s->mu);
        run_taken(s, o);
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

pd_err pd_stream_start_worker(pd_stream *s) {
    if (s->has_worker) return PD_ERR_STATE;
    if (pthread_create(&s->worker, NULL, worker_main, s) != 0) return PD_ERR_NOMEM;
    s->has_worker = true;
    return PD_OK;
}

uint32_t pd_stream_run(pd_stream *s) {
    uint32_t n = 0;
    while (pd_stream_run_one(s)) n++;
    return n;
}

/* The inspection functions read the queue without the lock: they serve the
 * single-threaded simulator. */
uint32_t pd_stream_queued(const pd_stream *s) { return s->fifo_n; }

bool pd_stream_blocked(const pd_stream *s) {
    return s->fifo_n > 0 && s->ops[s->fifo[s->fifo_head]].held;
}

uint64_t pd_stream_head_batch(const pd_stream *s) {
    if (s->fifo_n == 0) return 0;
    const sop *o = &s->ops[s->fifo[s->fifo_head]];
    return o->kind == SO_BATCH ? o->id : 0;
}

static sop *op_new(pd_stream *s, so_kind kind) {
    if (s->fifo_n == OPS_MAX) return NULL;
    for (uint32_t i = 0; i < OPS_MAX; i++) {
        if (s->ops[i].state != ST_FREE) continue;
        sop *o = &s->ops[i];
        o->state = ST_QUEUED;
        o->kind = kind;
        o->held = false;
        o->ready_at = 0;
        o->n = 0;
        s->fifo[(s->fifo_head + s->fifo_n) % OPS_MAX] = i;
        s->fifo_n++;
        return o;
    }
    return NULL;
}

static sop *find_op(pd_stream *s, so_kind kind, uint64_t id) {
    for (uint32_t i = 0; i < OPS_MAX; i++)
        if (s->ops[i].state != ST_FREE && s->ops[i].kind == kind && s->ops[i].id == id)
            return &s->ops[i];
    return NULL;
}

/* Grows *buf to hold n elements of size sz. */
static void reserve(void **buf, uint32_t *cap, uint32_t n, size_t sz) {
    if (n <= *cap && *buf) return;
    uint32_t c = n < 16 ? 16 : n;
    void *b = realloc(*buf, c * sz);
    PD_ASSERT(b);
    *buf = b;
    *cap = c;
}

/* ---- the executor vtable -------------------------------------------------------- */

static pd_err st_launch(void *self, const pd_batch *b) {
    pd_stream *s = self;
    if (b->n_items > s->batch_max) return PD_ERR_INVALID;
    pthread_mutex_lock(&s->mu);
    sop *o = op_new(s, SO_BATCH);
    if (!o) {
        pthread_mutex_unlock(&s->mu);
        return PD_ERR_NOMEM;
    }
    o->id = b->id;
    o->n = b->n_items;
    for (uint32_t i = 0; i < b->n_items; i++) {
        const pd_batch_item *in = &b->items[i];
        sitem *si = &o->items[i];
        reserve((void **)&si->tokens, &si->tokens_cap, in->n_tokens, sizeof(int32_t));
        reserve((void **)&si->pages, &si->pages_cap, in->n_pages, sizeof(uint32_t));
        memcpy(si->tokens, in->tokens, in->n_tokens * sizeof(int32_t));
        memcpy(si->pages, in->pages, in->n_pages * sizeof(uint32_t));
        si->item = *in;
        si->item.tokens = si->tokens;
        si->item.pages = si->pages;
        int h = s->hold_fn ? s->hold_fn(s->hold_ctx, b->id, in) : 0;
        if (h == PD_STREAM_HOLD) o->held = true;
        else if (h > 0 && s->now + 1 + (uint64_t)h > o->ready_at)
            o->ready_at = s->now + 1 + (uint64_t)h;
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return PD_OK;
}

static bool st_poll(void *self, uint64_t id, pd_item_result *results, pd_item_top *tops) {
    pd_stream *s = self;
    pthread_mutex_lock(&s->mu);
    sop *o = find_op(s, SO_BATCH, id);
    PD_ASSERTF(o, "poll of unknown batch %llu", (unsigned long long)id);
    bool done = o->state == ST_DONE;
    if (done) {
        pd_item_results_copy(results, tops, o->results, o->tops, o->n);
        o->state = ST_FREE;
    }
    pthread_mutex_unlock(&s->mu);
    return done;
}

static pd_err st_copy_state(void *self, uint32_t dst, uint32_t src) {
    pd_stream *s = self;
    pthread_mutex_lock(&s->mu);
    sop *o = op_new(s, SO_COPY);
    if (o) {
        o->dst = dst;
        o->src = src;
        pthread_cond_broadcast(&s->cv);
    }
    pthread_mutex_unlock(&s->mu);
    return o ? PD_OK : PD_ERR_NOMEM;
}

static void st_write_back(void *self, const uint32_t *dev, const uint32_t *host, uint32_t n) {
    /* Eviction copies synchronously: the pages are cached, computed long ago. */
    pd_stream *s = self;
    s->inner.vt->write_back(s->inner.self, dev, host, n);
}

static pd_err st_load_begin(void *self, uint64_t id, const uint32_t *dev, const uint32_t *host,
                            uint32_t n) {
    pd_stream *s = self;
    pthread_mutex_lock(&s->mu);
    sop *o = op_new(s, SO_LOAD);
    if (!o) {
        pthread_mutex_unlock(&s->mu);
        return PD_ERR_NOMEM;
    }
    o->id = id;
    o->n = n;
    o->held = s->hold_loads;
    reserve((void **)&o->dev, &o->dev_cap, n, sizeof(uint32_t));
    reserve((void **)&o->host, &o->host_cap, n, sizeof(uint32_t));
    memcpy(o->dev, dev, n * sizeof(uint32_t));
    memcpy(o->host, host, n * sizeof(uint32_t));
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return PD_OK;
}

static bool st_load_poll(void *self, uint64_t id) {
    pd_stream *s = self;
    pthread_mutex_lock(&s->mu);
    sop *o = find_op(s, SO_LOAD, id);
    PD_ASSERTF(o, "poll of unknown load %llu", (unsigned long long)id);
    bool done = o->state == ST_DONE;
    if (done) o->state = ST_FREE;
    pthread_mutex_unlock(&s->mu);
    return done;
}

static void st_load_cancel(void *self, uint64_t id) {
    pd_stream *s = self;
    pthread_mutex_lock(&s->mu);
    sop *o = find_op(s, SO_LOAD, id);
    /* A load the worker is copying right now finishes first: after cancel
     * returns, nothing writes its pages. */
    while (o && o->state == ST_RUNNING) {
        pthread_cond_wait(&s->cv, &s->mu);
        o = find_op(s, SO_LOAD, id);
    }
    if (!o) {
        pthread_mutex_unlock(&s->mu);
        return;
    }
    if (o->state == ST_QUEUED) {
        /* Take it out of the stream: it will never write. */
        uint32_t keep = 0, idx = (uint32_t)(o - s->ops);
        uint32_t tmp[OPS_MAX];
        for (uint32_t i = 0; i < s->fifo_n; i++) {
            uint32_t k = s->fifo[(s->fifo_head + i) % OPS_MAX];
            if (k != idx) tmp[keep++] = k;
        }
        for (uint32_t i = 0; i < keep; i++) s->fifo[(s->fifo_head + i) % OPS_MAX] = tmp[i];
        s->fifo_n = keep;
    }
    o->state = ST_FREE;
    pthread_mutex_unlock(&s->mu);
}

static void st_memory(void *self, pd_exec_memory *out) {
    pd_stream *s = self;
    s->inner.vt->memory(s->inner.self, out);
}

static void st_info(void *self, pd_model_info *out) {
    pd_stream *s = self;
    s->inner.vt->info(s->inner.self, out);
}

static const pd_executor_vtable stream_vt = {
    .launch = st_launch, .poll = st_poll, .copy_state = st_copy_state,
    .write_back = st_write_back, .load_begin = st_load_begin, .load_poll = st_load_poll,
    .load_cancel = st_load_cancel, .memory = st_memory, .info = st_info,
};

pd_executor pd_stream_executor(pd_stream *s) { return (pd_executor){.vt = &stream_vt, .self = s}; }

void pd_stream_set_hold_fn(pd_stream *s, pd_stream_hold_fn fn, void *ctx) {
    s->hold_fn = fn;
    s->hold_ctx = ctx;
}

void pd_stream_set_now(pd_stream *s, uint64_t now) { s->now = now; }

void pd_stream_hold_loads(pd_stream *s, bool on) {
    pthread_mutex_lock(&s->mu);
    s->hold_loads = on;
    if (!on)
        for (uint32_t i = 0; i < OPS_MAX; i++)
            if (s->ops[i].state == ST_QUEUED && s->ops[i].kind == SO_LOAD) s->ops[i].held = false;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

void pd_stream_hold(pd_stream *s, uint64_t batch_id, bool held) {
    pthread_mutex_lock(&s->mu);
    sop *o = find_op(s, SO_BATCH, batch_id);
    if (o && o->state == ST_QUEUED) o->held = held;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

pd_err pd_stream_create(pd_stream **out, pd_executor inner, uint32_t batch_max) {
    if (!out || !inner.vt || batch_max == 0) return PD_ERR_INVALID;
    pd_stream *s = calloc(1, sizeof(*s));
    if (!s) return PD_ERR_NOMEM;
    s->inner = inner;
    s->batch_max = batch_max;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    for (uint32_t i = 0; i < OPS_MAX; i++) {
        s->ops[i].items = calloc(batch_max, sizeof(sitem));
        s->ops[i].flat = calloc(batch_max, sizeof(pd_batch_item));
        s->ops[i].results = calloc(batch_max, sizeof(pd_item_result));
        s->ops[i].tops = calloc(batch_max, sizeof(pd_item_top));
        if (!s->ops[i].items || !s->ops[i].flat || !s->ops[i].results || !s->ops[i].tops) {
            pd_stream_destroy(s);
            return PD_ERR_NOMEM;
        }
    }
    *out = s;
    return PD_OK;
}

void pd_stream_destroy(pd_stream *s) {
    if (!s) return;
    if (s->has_worker) {
        pthread_mutex_lock(&s->mu);
        s->stopping = true;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->worker, NULL);
    }
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv);
    for (uint32_t i = 0; i < OPS_MAX; i++) {
        if (s->ops[i].items)
            for (uint32_t k = 0; k < s->batch_max; k++) {
                free(s->ops[i].items[k].tokens);
                free(s->ops[i].items[k].pages);
            }
        free(s->ops[i].items);
        free(s->ops[i].flat);
        free(s->ops[i].results);
        free(s->ops[i].tops);
        free(s->ops[i].dev);
        free(s->ops[i].host);
    }
    free(s);
}
