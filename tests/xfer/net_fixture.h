/*
 * Shared helpers for the pd_net tests: two nodes (prefill + decode) in one
 * process on 127.0.0.1, each with its own memory filled with a recognisable
 * pattern, and polling helpers with generous deadlines. A node's memory is
 * what its transport allocated (pd_net_allocator), as on a real node, unless
 * pair_opts.heap asks for plain heap memory registered as is. The UCX transport is
 * whatever UCX_TLS says (ctest runs every test binary once with shm and once
 * with tcp).
 */
#ifndef PDSERVE_TEST_NET_FIXTURE_H
#define PDSERVE_TEST_NET_FIXTURE_H

#include <stdio.h>
#include <time.h>

#include "../test_util.h"
#include "pdserve/net.h"

#define DEADLINE_MS 30000u

static inline uint64_t t_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static inline void t_sleep_ms(unsigned ms) {
    struct timespec ts = {.tv_sec = ms / 1000, .tv_nsec = (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Polls cond every millisecond until it holds; fails the test after the
 * deadline. Never a fixed sleep that hopes. */
#define WAIT_FOR(cond)                                                                  \
    do {                                                                                \
        uint64_t t0_ = t_now_ms();                                                      \
        while (!(cond)) {                                                               \
            if (t_now_ms() - t0_ > DEADLINE_MS) fail_msg("timed out waiting for %s", #cond); \
            t_sleep_ms(1);                                                              \
        }                                                                               \
    } while (0)

typedef struct node_mem {
    pd_exec_memory mem;
    pd_meta_row *meta;
    uint32_t meta_rows;
    pd_exec_alloc alloc; /* alloc NULL: the heap */
} node_mem;

typedef struct pair_opts {
    uint32_t page_size;
    uint32_t kv_pages;
    size_t kv_page_bytes;
    uint32_t mamba_slots;     /* 0: a model without Mamba layers */
    size_t mamba_slot_bytes;
    uint32_t meta_rows;
    uint32_t rooms_max;
    const char *token;        /* prefill's */
    const char *decode_token; /* decode's; defaults to token */
    uint64_t heartbeat_ms, dead_after_ms, drain_grace_ms;
    bool heap;               /* the nodes' memory from the heap, not from their transports */
    int32_t notice_data_max; /* prefill's (0: its default; < 0: every room as puts) */
    uint16_t prefill_protocol, decode_protocol; /* 0: the newest; 3, 4: an older node */
    int8_t sched_batch;                         /* both nodes' progress_sched_batch */
    uint32_t copy_threads;                      /* prefill's (0: its default) */
} pair_opts;

typedef struct pair {
    pair_opts o;
    pd_net *pre, *dec;
    node_mem pm, dm;
    pd_xfer px, dx;
    char peer[64];
} pair;

static inline pair_opts pair_defaults(void) {
    return (pair_opts){
        .page_size = 4, .kv_pages = 256, .kv_page_bytes = 512,
        .mamba_slots = 4, .mamba_slot_bytes = 3000, .meta_rows = 16, .rooms_max = 64,
        .heartbeat_ms = 100, .dead_after_ms = 2000, .drain_grace_ms = 300,
    };
}

/* Prefill memory: byte i of unit u of region reg is a function of all three;
 * decode memory starts as a sentinel that no pattern byte sequence matches. */
static inline uint8_t pattern(int reg, uint32_t unit, size_t i) {
    return (uint8_t)(reg * 97u + unit * 131u + (uint32_t)i * 7u + (uint32_t)(i >> 8) * 13u + 1u);
}
#define SENTINEL 0xEEu

static inline void *mem_get(const node_mem *m, size_t bytes) {
    return m->alloc.alloc ? m->alloc.alloc(m->alloc.self, bytes) : calloc(1, bytes);
}

/* owner: the transport whose memory to use (NULL: the heap). */
static inline void mem_alloc(node_mem *m, const pair_opts *o, bool fill, pd_net *owner) {
    memset(m, 0, sizeof(*m));
    if (owner && !o->heap) m->alloc = pd_net_allocator(owner);
    m->mem.kv_pages = o->kv_pages;
    m->mem.kv_page_bytes = o->kv_page_bytes;
    m->mem.kv = mem_get(m, o->kv_pages * o->kv_page_bytes);
    m->mem.mamba_slots = o->mamba_slots;
    m->mem.mamba_slot_bytes = o->mamba_slots ? o->mamba_slot_bytes : 0;
    m->mem.mamba = o->mamba_slots ? mem_get(m, o->mamba_slots * o->mamba_slot_bytes) : NULL;
    m->meta_rows = o->meta_rows;
    m->meta = mem_get(m, o->meta_rows * sizeof(pd_meta_row));
    assert_non_null(m->mem.kv);
    assert_non_null(m->meta);
    uint8_t *kv = m->mem.kv, *mb = m->mem.mamba;
    for (uint32_t p = 0; p < o->kv_pages; p++)
        for (size_t i = 0; i < o->kv_page_bytes; i++)
            kv[p * o->kv_page_bytes + i] = fill ? pattern(0, p, i) : SENTINEL;
    for (uint32_t s = 0; s < o->mamba_slots; s++)
        for (size_t i = 0; i < o->mamba_slot_bytes; i++)
            mb[s * o->mamba_slot_bytes + i] = fill ? pattern(1, s, i) : SENTINEL;
    for (uint32_t r = 0; r < o->meta_rows; r++)
        if (fill)
            m->meta[r] = (pd_meta_row){.nonce = 1000u + r, .first_token = (int32_t)(7 * r + 1),
                                       .first_logprob = -0.5f * (float)r, .prompt_tokens = 100 + r};
        else memset(&m->meta[r], SENTINEL, sizeof(pd_meta_row));
}

/* Before the owning transport is destroyed. */
static inline void mem_free(node_mem *m) {
    void *p[3] = {m->mem.kv, m->mem.mamba, m->meta};
    for (int i = 0; i < 3; i++) {
        if (m->alloc.free) m->alloc.free(m->alloc.self, p[i]);
        else free(p[i]);
    }
    m->mem.kv = m->mem.mamba = NULL;
    m->meta = NULL;
}

/* PD_NET_TEST_LOG=1 prints the transports' connection-level log. */
static inline void test_log(void *ctx, const char *line) {
    fprintf(stderr, "[%s %llu] %s\n", (const char *)ctx, (unsigned long long)t_now_ms() % 100000,
            line);
}

static inline pd_net_config node_config(const pair_opts *o, pd_net_role role) {
    pd_net_config c;
    pd_net_config_default(&c, role);
    c.listen_host = "127.0.0.1";
    c.bootstrap_port = 0;
    c.page_size = o->page_size;
    c.rooms_max = o->rooms_max;
    c.heartbeat_ms = o->heartbeat_ms;
    c.dead_after_ms = o->dead_after_ms;
    c.drain_grace_ms = o->drain_grace_ms;
    c.notice_data_max = o->notice_data_max;
    c.protocol_version = role == PD_NET_PREFILL ? o->prefill_protocol : o->decode_protocol;
    c.progress_sched_batch = o->sched_batch;
    c.copy_threads = o->copy_threads;
    c.token = role == PD_NET_PREFILL ? o->token : (o->decode_token ? o->decode_token : o->token);
    if (getenv("PD_NET_TEST_LOG")) {
        c.log = test_log;
        c.log_ctx = role == PD_NET_PREFILL ? "prefill" : "decode";
    }
    return c;
}

/* A node with fresh memory (fill: the pattern; else the sentinel). */
static inline pd_net *node_start(const pair_opts *o, pd_net_role role, node_mem *m, bool fill) {
    pd_net_config c = node_config(o, role);
    char msg[256];
    pd_net *n = NULL;
    if (pd_net_create(&n, &c, msg, sizeof(msg)) != PD_OK) fail_msg("pd_net_create: %s", msg);
    mem_alloc(m, o, fill, n);
    if (pd_net_register(n, &m->mem, m->meta, m->meta_rows, msg, sizeof(msg)) != PD_OK)
        fail_msg("pd_net_register: %s", msg);
    if (pd_net_start(n, msg, sizeof(msg)) != PD_OK) fail_msg("pd_net_start: %s", msg);
    return n;
}

static inline pair *pair_new(const pair_opts *o) {
    pair *w = calloc(1, sizeof(*w));
    assert_non_null(w);
    w->o = *o;
    w->pre = node_start(o, PD_NET_PREFILL, &w->pm, true);
    w->dec = node_start(o, PD_NET_DECODE, &w->dm, false);
    w->px = pd_net_endpoint(w->pre);
    w->dx = pd_net_endpoint(w->dec);
    snprintf(w->peer, sizeof(w->peer), "127.0.0.1:%u", pd_net_bootstrap_port(w->pre));
    return w;
}

/* A node dies (its memory first, then its transport, as a node goes down). */
static inline void pair_kill(pd_net **n, node_mem *m) {
    mem_free(m);
    pd_net_destroy(*n);
    *n = NULL;
}

/* A fresh decode node (after pair_kill of the old one). */
static inline void pair_new_decode(pair *w) {
    PD_ASSERT(w->dec == NULL);
    w->dec = node_start(&w->o, PD_NET_DECODE, &w->dm, false);
    w->dx = pd_net_endpoint(w->dec);
}

static inline void pair_free(pair *w) {
    pair_kill(&w->dec, &w->dm);
    pair_kill(&w->pre, &w->pm);
    free(w);
}

static inline pd_net_stats stats_of(pd_net *n) {
    pd_net_stats s;
    pd_net_stats_get(n, &s);
    return s;
}

/* The prefill's writes: puts, and (version 5, where UCX emulates puts) data
 * messages. */
static inline uint64_t writes_of(const pd_net_stats *s) {
    return s->writes_posted + s->data_messages;
}
static inline uint64_t writes_now(pd_net *n) {
    pd_net_stats s = stats_of(n);
    return writes_of(&s);
}

/* Whether UCX emulates puts on this run's transport (tcp), where version 5
 * sends a room's bytes as data messages instead. */
static inline bool puts_emulated(void) {
    const char *tls = getenv("UCX_TLS");
    return tls && !strcmp(tls, "tcp");
}

/* What the engine's step gets: while the node's mutex is busy, status()
 * may answer a published, older status and drained() "not yet". */
static inline pd_xfer_status st_now(pd_xfer x, uint64_t room) { return x.vt->status(x.self, room); }
static inline bool drained_now(pd_xfer x, uint64_t room) { return x.vt->drained(x.self, room); }

/* The answers under the mutex, which the tests' one-shot checks assert on:
 * asked again while the call was answered without it (the node's
 * *_unlocked counter moved). x is a pd_net endpoint. */
static inline pd_xfer_status st_of(pd_xfer x, uint64_t room) {
    for (;;) {
        uint64_t u = stats_of(x.self).status_unlocked;
        pd_xfer_status st = st_now(x, room);
        if (stats_of(x.self).status_unlocked == u) return st;
    }
}
static inline bool drained_of(pd_xfer x, uint64_t room) {
    for (;;) {
        uint64_t u = stats_of(x.self).drained_unlocked;
        bool d = drained_now(x, room);
        if (d || stats_of(x.self).drained_unlocked == u) return d;
    }
}

/* Byte-compares prefill unit src with decode unit dst of a region. */
static inline bool unit_equal(const pair *w, int reg, uint32_t src, uint32_t dst) {
    if (reg == 0)
        return !memcmp((uint8_t *)w->pm.mem.kv + src * w->o.kv_page_bytes,
                       (uint8_t *)w->dm.mem.kv + dst * w->o.kv_page_bytes, w->o.kv_page_bytes);
    if (reg == 1)
        return !memcmp((uint8_t *)w->pm.mem.mamba + src * w->o.mamba_slot_bytes,
                       (uint8_t *)w->dm.mem.mamba + dst * w->o.mamba_slot_bytes,
                       w->o.mamba_slot_bytes);
    return !memcmp(&w->pm.meta[src], &w->dm.meta[dst], sizeof(pd_meta_row));
}

/* Unit dst of a region of decode memory m still holds the sentinel. */
static inline bool unit_untouched_in(const node_mem *m, const pair_opts *o, int reg, uint32_t dst) {
    const uint8_t *p;
    size_t len;
    if (reg == 0) {
        p = (uint8_t *)m->mem.kv + dst * o->kv_page_bytes;
        len = o->kv_page_bytes;
    } else if (reg == 1) {
        p = (uint8_t *)m->mem.mamba + dst * o->mamba_slot_bytes;
        len = o->mamba_slot_bytes;
    } else {
        p = (const uint8_t *)&m->meta[dst];
        len = sizeof(pd_meta_row);
    }
    for (size_t i = 0; i < len; i++)
        if (p[i] != SENTINEL) return false;
    return true;
}

static inline bool unit_untouched(const pair *w, int reg, uint32_t dst) {
    return unit_untouched_in(&w->dm, &w->o, reg, dst);
}

#endif
