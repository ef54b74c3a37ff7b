/*
 * synth.c — the synthetic executor (see include/pdserve/synth.h).
 *
 * The model, per position p with token t:
 *     h(p)     = mix(mix(h(p-1), t), p)          h(-1) = H0
 *     kv(p, 0) = h(p),  kv(p, l) = mix(h(p), l)  for l >= 1
 *     s(p)     = mix(s(p-1) ^ 0x5A, t)           s(-1) = S0   (Mamba state)
 * and a token sampled after position q is
 *     x = mix(mix(fold(kv(0..q, all l)), s(q)), q)   [mixed with seed and
 *         index when temperature > 0],  token = x mod vocab.
 * h(p-1) is read back from the KV page of position p-1 and s from the slot,
 * exactly as a real model reads its cache and state.
 */
#include "pdserve/synth.h"

#include <stdlib.h>
#include <string.h>

#define OPS_MAX 64
#define H0 0x1234567812345678ull
#define S0 0x0BADC0DE0BADC0DEull
#define GARBAGE 0xDEADBEEFDEADBEEFull

typedef enum { SO_BATCH, SO_COPY, SO_LOAD } so_kind;
typedef enum { ST_FREE, ST_QUEUED, ST_DONE } so_state;

typedef struct sitem {
    pd_batch_item item;   /* tokens and pages point into the op's own copies */
    int32_t *tokens;
    uint32_t *pages;
} sitem;

typedef struct sop {
    so_state state;
    so_kind kind;
    uint64_t id;          /* batch id / load id */
    bool held;
    uint64_t ready_at;    /* the driver's time from which it may run */
    uint32_t n;
    sitem *items;         /* batch_max */
    pd_item_result *results;
    uint32_t dst, src;    /* copy */
    uint32_t *dev, *host; /* load */
} sop;

struct pd_synth {
    pd_synth_config cfg;
    uint64_t *kv, *mamba, *host;
    sop ops[OPS_MAX];
    uint32_t fifo[OPS_MAX], fifo_head, fifo_n;
    pd_synth_hold_fn hold_fn;
    void *hold_ctx;
    uint64_t now;
    bool hold_loads;
};

static inline uint64_t mix(uint64_t a, uint64_t b) {
    return pd_hash_u64(a ^ pd_hash_u64(b + 0x9E3779B97F4A7C15ull));
}

static inline uint64_t *kv_at(pd_synth *s, const uint32_t *pages, uint32_t pos, uint32_t l) {
    uint32_t ps = s->cfg.page_size, L = s->cfg.layers;
    uint32_t page = pages[pos / ps];
    PD_ASSERT(page < s->cfg.kv_pages);
    return &s->kv[((size_t)page * ps + pos % ps) * L + l];
}

static uint64_t sample_value(uint64_t agg, uint64_t state, uint32_t pos, const pd_sampling *sp,
                             uint32_t index) {
    uint64_t x = mix(mix(agg, state), pos);
    if (sp->temperature > 0.0f) x = mix(x, sp->seed ^ ((uint64_t)index << 32));
    return x;
}

static void run_item(pd_synth *s, const pd_batch_item *it, pd_item_result *res) {
    uint32_t L = s->cfg.layers;
    bool mamba = it->mamba_slot != PD_POOL_NONE;
    uint64_t st = 0;
    if (mamba) {
        PD_ASSERT(it->mamba_slot < s->cfg.mamba_slots);
        st = it->start_pos == 0 ? S0 : s->mamba[it->mamba_slot];
    }
    for (uint32_t t = 0; t < it->n_tokens; t++) {
        uint32_t pos = it->start_pos + t;
        uint64_t prev = pos == 0 ? H0 : *kv_at(s, it->pages, pos - 1, 0);
        uint64_t h = mix(mix(prev, (uint64_t)(uint32_t)it->tokens[t]), pos);
        *kv_at(s, it->pages, pos, 0) = h;
        for (uint32_t l = 1; l < L; l++) *kv_at(s, it->pages, pos, l) = mix(h, l);
        if (mamba) st = mix(st ^ 0x5A, (uint64_t)(uint32_t)it->tokens[t]);
    }
    if (mamba) {
        s->mamba[it->mamba_slot] = st;
        if (it->snapshot_slot != PD_POOL_NONE) {
            PD_ASSERT(it->snapshot_slot < s->cfg.mamba_slots);
            s->mamba[it->snapshot_slot] = st;
        }
    }
    res->req = it->req;
    res->token = -1;
    res->logprob = 0.0f;
    if (!it->sample) return;
    uint32_t last = it->start_pos + it->n_tokens - 1;
    uint64_t agg = H0;
    for (uint32_t pos = 0; pos <= last; pos++)
        for (uint32_t l = 0; l < L; l++) agg = mix(agg, *kv_at(s, it->pages, pos, l));
    uint64_t x = sample_value(agg, st, last, &it->sampling, it->sample_index);
    res->token = (int32_t)(x % s->cfg.vocab);
    res->logprob = -(float)((x >> 40) % 1000) / 100.0f;
}

static void run_op(pd_synth *s, sop *o) {
    size_t page_vals = (size_t)s->cfg.page_size * s->cfg.layers;
    switch (o->kind) {
    case SO_BATCH:
        for (uint32_t i = 0; i < o->n; i++) run_item(s, &o->items[i].item, &o->results[i]);
        o->state = ST_DONE;
        break;
    case SO_COPY:
        s->mamba[o->dst] = s->mamba[o->src];
        o->state = ST_FREE;
        break;
    case SO_LOAD:
        for (uint32_t i = 0; i < o->n; i++)
            memcpy(s->kv + o->dev[i] * page_vals, s->host + o->host[i] * page_vals,
                   page_vals * sizeof(uint64_t));
        o->state = ST_DONE;
        break;
    }
}

bool pd_synth_run_one(pd_synth *s) {
    if (s->fifo_n == 0) return false;
    sop *o = &s->ops[s->fifo[s->fifo_head]];
    if (o->held || o->ready_at > s->now) return false;
    s->fifo_head = (s->fifo_head + 1) % OPS_MAX;
    s->fifo_n--;
    run_op(s, o);
    return true;
}

uint32_t pd_synth_run(pd_synth *s) {
    uint32_t n = 0;
    while (pd_synth_run_one(s)) n++;
    return n;
}

uint32_t pd_synth_queued(const pd_synth *s) { return s->fifo_n; }

bool pd_synth_blocked(const pd_synth *s) {
    return s->fifo_n > 0 && s->ops[s->fifo[s->fifo_head]].held;
}

uint64_t pd_synth_head_batch(const pd_synth *s) {
    if (s->fifo_n == 0) return 0;
    const sop *o = &s->ops[s->fifo[s->fifo_head]];
    return o->kind == SO_BATCH ? o->id : 0;
}

static sop *op_new(pd_synth *s, so_kind kind) {
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

static sop *find_op(pd_synth *s, so_kind kind, uint64_t id) {
    for (uint32_t i = 0; i < OPS_MAX; i++)
        if (s->ops[i].state != ST_FREE && s->ops[i].kind == kind && s->ops[i].id == id) return &s->ops[i];
    return NULL;
}

/* ---- the executor vtable ------------------------------------------------------ */

static pd_err sx_launch(void *self, const pd_batch *b) {
    pd_synth *s = self;
    if (b->n_items > s->cfg.batch_max) return PD_ERR_INVALID;
    sop *o = op_new(s, SO_BATCH);
    if (!o) return PD_ERR_NOMEM;
    o->id = b->id;
    o->n = b->n_items;
    for (uint32_t i = 0; i < b->n_items; i++) {
        const pd_batch_item *in = &b->items[i];
        sitem *si = &o->items[i];
        free(si->tokens);
        free(si->pages);
        si->tokens = malloc((in->n_tokens + 1) * sizeof(int32_t));
        si->pages = malloc((in->n_pages + 1) * sizeof(uint32_t));
        PD_ASSERT(si->tokens && si->pages);
        memcpy(si->tokens, in->tokens, in->n_tokens * sizeof(int32_t));
        memcpy(si->pages, in->pages, in->n_pages * sizeof(uint32_t));
        si->item = *in;
        si->item.tokens = si->tokens;
        si->item.pages = si->pages;
        int h = s->hold_fn ? s->hold_fn(s->hold_ctx, b->id, in) : 0;
        if (h == PD_SYNTH_HOLD) o->held = true;
        else if (h > 0 && s->now + 1 + (uint64_t)h > o->ready_at) o->ready_at = s->now + 1 + (uint64_t)h;
    }
    return PD_OK;
}

static bool sx_poll(void *self, uint64_t id, pd_item_result *results) {
    pd_synth *s = self;
    sop *o = find_op(s, SO_BATCH, id);
    PD_ASSERTF(o, "poll of unknown batch %llu", (unsigned long long)id);
    if (o->state != ST_DONE) return false;
    memcpy(results, o->results, o->n * sizeof(pd_item_result));
    o->state = ST_FREE;
    return true;
}

static pd_err sx_copy_state(void *self, uint32_t dst, uint32_t src) {
    pd_synth *s = self;
    if (dst >= s->cfg.mamba_slots || src >= s->cfg.mamba_slots) return PD_ERR_INVALID;
    sop *o = op_new(s, SO_COPY);
    if (!o) return PD_ERR_NOMEM;
    o->dst = dst;
    o->src = src;
    return PD_OK;
}

static void sx_write_back(void *self, const uint32_t *dev, const uint32_t *host, uint32_t n) {
    pd_synth *s = self;
    size_t page_vals = (size_t)s->cfg.page_size * s->cfg.layers;
    for (uint32_t i = 0; i < n; i++)
        memcpy(s->host + host[i] * page_vals, s->kv + dev[i] * page_vals, page_vals * sizeof(uint64_t));
}

static pd_err sx_load_begin(void *self, uint64_t id, const uint32_t *dev, const uint32_t *host, uint32_t n) {
    pd_synth *s = self;
    sop *o = op_new(s, SO_LOAD);
    if (!o) return PD_ERR_NOMEM;
    o->id = id;
    o->n = n;
    o->held = s->hold_loads;
    free(o->dev);
    free(o->host);
    o->dev = malloc((n + 1) * sizeof(uint32_t));
    o->host = malloc((n + 1) * sizeof(uint32_t));
    PD_ASSERT(o->dev && o->host);
    memcpy(o->dev, dev, n * sizeof(uint32_t));
    memcpy(o->host, host, n * sizeof(uint32_t));
    return PD_OK;
}

static bool sx_load_poll(void *self, uint64_t id) {
    pd_synth *s = self;
    sop *o = find_op(s, SO_LOAD, id);
    PD_ASSERTF(o, "poll of unknown load %llu", (unsigned long long)id);
    if (o->state != ST_DONE) return false;
    o->state = ST_FREE;
    return true;
}

static void sx_load_cancel(void *self, uint64_t id) {
    pd_synth *s = self;
    sop *o = find_op(s, SO_LOAD, id);
    if (!o) return;
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
}

static void sx_memory(void *self, pd_exec_memory *out) {
    pd_synth *s = self;
    size_t page_bytes = (size_t)s->cfg.page_size * s->cfg.layers * sizeof(uint64_t);
    *out = (pd_exec_memory){
        .kv = s->kv, .kv_page_bytes = page_bytes, .kv_pages = s->cfg.kv_pages,
        .mamba = s->mamba, .mamba_slot_bytes = sizeof(uint64_t), .mamba_slots = s->cfg.mamba_slots,
        .host = s->host, .host_page_bytes = page_bytes, .host_pages = s->cfg.host_pages,
    };
}

static void sx_info(void *self, pd_model_info *out) {
    pd_synth *s = self;
    *out = (pd_model_info){.vocab = s->cfg.vocab, .eos_token = s->cfg.eos_token,
                           .page_size = s->cfg.page_size, .has_mamba = s->cfg.mamba_slots > 0};
}

static const pd_executor_vtable synth_vt = {
    .launch = sx_launch, .poll = sx_poll, .copy_state = sx_copy_state,
    .write_back = sx_write_back, .load_begin = sx_load_begin, .load_poll = sx_load_poll,
    .load_cancel = sx_load_cancel, .memory = sx_memory, .info = sx_info,
};

pd_executor pd_synth_executor(pd_synth *s) { return (pd_executor){.vt = &synth_vt, .self = s}; }

void pd_synth_set_hold_fn(pd_synth *s, pd_synth_hold_fn fn, void *ctx) {
    s->hold_fn = fn;
    s->hold_ctx = ctx;
}

void pd_synth_set_now(pd_synth *s, uint64_t now) { s->now = now; }

void pd_synth_hold_loads(pd_synth *s, bool on) {
    s->hold_loads = on;
    if (on) return;
    for (uint32_t i = 0; i < OPS_MAX; i++)
        if (s->ops[i].state == ST_QUEUED && s->ops[i].kind == SO_LOAD) s->ops[i].held = false;
}

void pd_synth_hold(pd_synth *s, uint64_t batch_id, bool held) {
    sop *o = find_op(s, SO_BATCH, batch_id);
    if (o && o->state == ST_QUEUED) o->held = held;
}

pd_err pd_synth_create(pd_synth **out, const pd_synth_config *cfg) {
    if (!out || !cfg || cfg->page_size == 0 || cfg->kv_pages == 0 || cfg->layers == 0 ||
        cfg->vocab < 2 || cfg->batch_max == 0)
        return PD_ERR_INVALID;
    pd_synth *s = calloc(1, sizeof(*s));
    if (!s) return PD_ERR_NOMEM;
    s->cfg = *cfg;
    size_t page_vals = (size_t)cfg->page_size * cfg->layers;
    s->kv = malloc(cfg->kv_pages * page_vals * sizeof(uint64_t));
    s->mamba = malloc((cfg->mamba_slots + 1) * sizeof(uint64_t));
    s->host = malloc((cfg->host_pages + 1) * page_vals * sizeof(uint64_t));
    bool ok = s->kv && s->mamba && s->host;
    for (uint32_t i = 0; ok && i < OPS_MAX; i++) {
        s->ops[i].items = calloc(cfg->batch_max, sizeof(sitem));
        s->ops[i].results = calloc(cfg->batch_max, sizeof(pd_item_result));
        ok = s->ops[i].items && s->ops[i].results;
    }
    if (!ok) {
        pd_synth_destroy(s);
        return PD_ERR_NOMEM;
    }
    /* Unwritten memory holds a recognisable pattern, never zeros that could
     * pass for a valid state by accident. */
    for (size_t i = 0; i < cfg->kv_pages * page_vals; i++) s->kv[i] = GARBAGE ^ i;
    for (size_t i = 0; i <= cfg->mamba_slots; i++) s->mamba[i] = GARBAGE ^ (i << 20);
    for (size_t i = 0; i < (cfg->host_pages + 1) * page_vals; i++) s->host[i] = GARBAGE ^ (i << 7);
    *out = s;
    return PD_OK;
}

void pd_synth_destroy(pd_synth *s) {
    if (!s) return;
    for (uint32_t i = 0; i < OPS_MAX; i++) {
        if (s->ops[i].items)
            for (uint32_t k = 0; k < s->cfg.batch_max; k++) {
                free(s->ops[i].items[k].tokens);
                free(s->ops[i].items[k].pages);
            }
        free(s->ops[i].items);
        free(s->ops[i].results);
        free(s->ops[i].dev);
        free(s->ops[i].host);
    }
    free(s->kv);
    free(s->mamba);
    free(s->host);
    free(s);
}

uint32_t pd_synth_reference(const pd_synth_config *cfg, bool mamba, const int32_t *prompt,
                            uint32_t len, uint32_t max_new, const int32_t *stop,
                            uint32_t n_stop, bool ignore_eos, const pd_sampling *sampling,
                            int32_t *out) {
    /* Straight-line: a flat array of every position's values, no pages. */
    uint32_t L = cfg->layers;
    uint32_t total = len + max_new;
    uint64_t *kv = malloc((size_t)total * L * sizeof(uint64_t));
    PD_ASSERT(kv);
    uint64_t h = H0, st = S0, agg = H0;
    uint32_t n_out = 0;
    int32_t tok = 0;
    for (uint32_t pos = 0; pos + 1 < total && n_out < max_new; pos++) {
        tok = pos < len ? prompt[pos] : out[n_out - 1];
        h = mix(mix(h, (uint64_t)(uint32_t)tok), pos);
        kv[(size_t)pos * L] = h;
        for (uint32_t l = 1; l < L; l++) kv[(size_t)pos * L + l] = mix(h, l);
        if (mamba) st = mix(st ^ 0x5A, (uint64_t)(uint32_t)tok);
        for (uint32_t l = 0; l < L; l++) agg = mix(agg, kv[(size_t)pos * L + l]);
        if (pos + 1 < len) continue;
        uint64_t x = sample_value(agg, mamba ? st : 0, pos, sampling, n_out);
        int32_t next = (int32_t)(x % cfg->vocab);
        out[n_out++] = next;
        bool stop_now = !ignore_eos && cfg->eos_token >= 0 && next == cfg->eos_token;
        for (uint32_t i = 0; i < n_stop; i++) stop_now |= next == stop[i];
        if (stop_now) break;
    }
    free(kv);
    return n_out;
}
