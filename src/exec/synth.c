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

#define H0 0x1234567812345678ull
#define S0 0x0BADC0DE0BADC0DEull
#define GARBAGE 0xDEADBEEFDEADBEEFull
#define PENDING_MAX 8

/* Results of launched batches waiting for poll (computed at launch). */
typedef struct pending {
    bool used;
    uint64_t id;
    uint32_t n;
    pd_item_result *results;
} pending;

struct pd_synth {
    pd_synth_config cfg;
    uint64_t *kv, *mamba, *host;
    pd_exec_alloc alloc; /* where kv and mamba came from; alloc NULL: the heap */
    pending pend[PENDING_MAX];
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

/* ---- the executor vtable ------------------------------------------------------ */

static pd_err sx_launch(void *self, const pd_batch *b) {
    pd_synth *s = self;
    if (b->n_items > s->cfg.batch_max) return PD_ERR_INVALID;
    pending *p = NULL;
    for (uint32_t i = 0; i < PENDING_MAX && !p; i++)
        if (!s->pend[i].used) p = &s->pend[i];
    if (!p) return PD_ERR_NOMEM;
    for (uint32_t i = 0; i < b->n_items; i++) run_item(s, &b->items[i], &p->results[i]);
    p->used = true;
    p->id = b->id;
    p->n = b->n_items;
    return PD_OK;
}

static bool sx_poll(void *self, uint64_t id, pd_item_result *results, pd_item_top *tops) {
    (void)tops; /* no top logprobs: every result's n_top is 0 */
    pd_synth *s = self;
    for (uint32_t i = 0; i < PENDING_MAX; i++) {
        pending *p = &s->pend[i];
        if (!p->used || p->id != id) continue;
        memcpy(results, p->results, p->n * sizeof(pd_item_result));
        p->used = false;
        return true;
    }
    PD_ASSERTF(false, "poll of unknown batch %llu", (unsigned long long)id);
    return false;
}

static pd_err sx_copy_state(void *self, uint32_t dst, uint32_t src) {
    pd_synth *s = self;
    if (dst >= s->cfg.mamba_slots || src >= s->cfg.mamba_slots) return PD_ERR_INVALID;
    s->mamba[dst] = s->mamba[src];
    return PD_OK;
}

static void sx_write_back(void *self, const uint32_t *dev, const uint32_t *host, uint32_t n) {
    pd_synth *s = self;
    size_t page_vals = (size_t)s->cfg.page_size * s->cfg.layers;
    for (uint32_t i = 0; i < n; i++)
        memcpy(s->host + host[i] * page_vals, s->kv + dev[i] * page_vals,
               page_vals * sizeof(uint64_t));
}

static pd_err sx_load_begin(void *self, uint64_t id, const uint32_t *dev, const uint32_t *host,
                            uint32_t n) {
    (void)id;
    pd_synth *s = self;
    size_t page_vals = (size_t)s->cfg.page_size * s->cfg.layers;
    for (uint32_t i = 0; i < n; i++)
        memcpy(s->kv + dev[i] * page_vals, s->host + host[i] * page_vals,
               page_vals * sizeof(uint64_t));
    return PD_OK;
}

static bool sx_load_poll(void *self, uint64_t id) {
    (void)self;
    (void)id;
    return true;
}

static void sx_load_cancel(void *self, uint64_t id) {
    (void)self;
    (void)id;
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

/* Memory a transport may move: from the allocator the synth was created
 * with (executor.h), else the heap. */
static void *transferable_alloc(const pd_synth *s, size_t bytes) {
    return s->alloc.alloc ? s->alloc.alloc(s->alloc.self, bytes) : malloc(bytes);
}

static void transferable_free(const pd_synth *s, void *p) {
    if (s->alloc.free) s->alloc.free(s->alloc.self, p);
    else free(p);
}

pd_err pd_synth_create(pd_synth **out, const pd_synth_config *cfg) {
    if (!out || !cfg || cfg->page_size == 0 || cfg->kv_pages == 0 || cfg->layers == 0 ||
        cfg->vocab < 2 || cfg->batch_max == 0)
        return PD_ERR_INVALID;
    pd_synth *s = calloc(1, sizeof(*s));
    if (!s) return PD_ERR_NOMEM;
    s->cfg = *cfg;
    if (cfg->alloc) s->alloc = *cfg->alloc;
    s->cfg.alloc = NULL; /* the copy above is what counts; cfg's may go away */
    size_t page_vals = (size_t)cfg->page_size * cfg->layers;
    s->kv = transferable_alloc(s, cfg->kv_pages * page_vals * sizeof(uint64_t));
    s->mamba = transferable_alloc(s, (cfg->mamba_slots + 1) * sizeof(uint64_t));
    s->host = malloc((cfg->host_pages + 1) * page_vals * sizeof(uint64_t));
    bool ok = s->kv && s->mamba && s->host;
    for (uint32_t i = 0; ok && i < PENDING_MAX; i++)
        ok = (s->pend[i].results = calloc(cfg->batch_max, sizeof(pd_item_result))) != NULL;
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
    for (uint32_t i = 0; i < PENDING_MAX; i++) free(s->pend[i].results);
    transferable_free(s, s->kv);
    transferable_free(s, s->mamba);
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
