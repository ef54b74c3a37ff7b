/*
 * forward.c — the forward pass, read top to bottom:
 *
 *   mdl_runner_run    cuts the batch's tokens into passes of at most
 *                     PD_RUNNER_ROWS rows (each row: token, position, item)
 *   run_pass          embeds the rows, runs every block, then for each item
 *                     whose last token is in the pass: final norm, lm_head,
 *                     sample, and the optional Mamba snapshot
 *   block             x += mixer(RMSNorm(x));  x += MLP(RMSNorm(x))
 *                     mixer = Mamba2 (mamba2.c) or attention (attention.c)
 *                     MLP = W_down (SiLU(W_gate h) * W_up h)   (SwiGLU)
 *                     (Granite: each addition scaled by residual_multiplier,
 *                     the embedding by embedding_multiplier, the logits
 *                     divided by logits_scaling)
 *
 * The node's memory is allocated once in mdl_runner_create and so is every
 * scratch buffer; nothing on the per-token path allocates.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runner.h"

float *mdl_runner_slot(const pd_runner *r, uint32_t slot) {
    PD_ASSERT(slot < r->mamba_slots);
    return r->mamba + (size_t)slot * (r->mamba_slot_bytes / sizeof(float));
}

/* ---- one block ----------------------------------------------------------------- */

/* x += y, or x += y * mult (Granite's residual_multiplier; 0: none). */
static void add_into(float *x, const float *y, size_t n, float mult) {
    if (mult == 0.0f)
        for (size_t i = 0; i < n; i++) x[i] += y[i];
    else
        for (size_t i = 0; i < n; i++) x[i] += y[i] * mult;
}

static void norm_rows(const pd_runner *r, float *out, const float *in, const float *w) {
    const pd_model_config *c = &r->model->cfg;
    for (uint32_t t = 0; t < r->rows; t++)
        mdl_rmsnorm(out + (size_t)t * c->dim, in + (size_t)t * c->dim, w, c->dim, c->norm_eps);
}

static void mixer(pd_runner *r, const pd_block_weights *b) {
    if (b->kind == 'M') {
        for (uint32_t t = 0; t < r->rows; t++)
            r->row_state[t] = r->row_slot[t] + (size_t)b->kind_index * r->mamba_layer_floats;
        mdl_mamba2_forward(&r->par, &r->mamba_dims, &b->mamba, r->xb, r->xo, r->rows, r->row_state,
                           &r->mamba_scratch);
        r->flops += 5ull * r->rows * r->mamba_dims.d_inner * r->mamba_dims.d_state;
    } else {
        r->attn_dims.layer = b->kind_index;
        pd_attn_rows rows = {r->row_pos, r->row_pages, r->rope_cos, r->rope_sin};
        r->flops += mdl_attention_forward(&r->par, &r->attn_dims, &b->attn, r->xb, r->xo, r->rows,
                                          &rows, r->kv, &r->attn_scratch);
    }
}

static void mlp(pd_runner *r, const pd_block_weights *b) {
    const pd_model_config *c = &r->model->cfg;
    mdl_matmul_w(&r->par, r->gate, r->xb, b->gate, r->rows, c->dim, c->mlp_hidden);
    mdl_matmul_w(&r->par, r->up, r->xb, b->up, r->rows, c->dim, c->mlp_hidden);
    for (size_t i = 0; i < (size_t)r->rows * c->mlp_hidden; i++)
        r->gate[i] = mdl_silu(r->gate[i]) * r->up[i];
    mdl_matmul_w(&r->par, r->xo, r->gate, b->down, r->rows, c->mlp_hidden, c->dim);
}

static void block(pd_runner *r, const pd_block_weights *b) {
    const size_t n = (size_t)r->rows * r->model->cfg.dim;
    norm_rows(r, r->xb, r->x, b->norm_mixer);
    mixer(r, b);
    add_into(r->x, r->xo, n, r->model->cfg.residual_mult);
    norm_rows(r, r->xb, r->x, b->norm_mlp);
    mlp(r, b);
    add_into(r->x, r->xo, n, r->model->cfg.residual_mult);
}

/* ---- one pass ----------------------------------------------------------------- */

static void run_pass(pd_runner *r, const pd_batch_item *items, pd_item_result *results,
                     pd_item_top *tops, float *logits_out) {
    const pd_model *m = r->model;
    const pd_model_config *c = &m->cfg;
    const uint32_t half = c->attn_head_dim / 2;
    PD_ASSERT(r->rows > 0 && r->rows <= PD_RUNNER_ROWS);

    /* embeddings, and each row's rotary angles */
    for (uint32_t t = 0; t < r->rows; t++) {
        /* checked at launch */
        PD_ASSERT(r->row_token[t] >= 0 && (uint32_t)r->row_token[t] < c->vocab);
        float *x = r->x + (size_t)t * c->dim;
        mdl_wmat_row(m->embed, (uint64_t)r->row_token[t], c->dim, x);
        for (uint32_t i = 0; c->embed_mult != 0.0f && i < c->dim; i++) x[i] *= c->embed_mult;
        if (m->shape.n_attn && !c->no_rope)
            mdl_rope_angles(r->row_pos[t], half, r->rope_inv, r->rope_cos + (size_t)t * half,
                            r->rope_sin + (size_t)t * half);
    }

    for (uint32_t l = 0; l < m->shape.n_layers; l++) block(r, &m->blocks[l]);
    r->flops += (m->shape.matmul_flops_per_token - 2ull * c->vocab * c->dim) * r->rows;

    /* the items that end in this pass: sample, snapshot */
    uint32_t n_sample = 0;
    uint32_t sample_row[PD_RUNNER_ROWS];
    for (uint32_t t = 0; t < r->rows; t++) {
        const pd_batch_item *it = &items[r->row_item[t]];
        if (!r->row_last[t] || !it->sample) continue;
        mdl_rmsnorm(r->xb + (size_t)n_sample * c->dim, r->x + (size_t)t * c->dim, m->final_norm,
                    c->dim, c->norm_eps);
        sample_row[n_sample++] = t;
    }
    if (n_sample) {
        mdl_matmul_w(&r->par, r->logits, r->xb, m->lm_head, n_sample, c->dim, c->vocab);
        r->flops += 2ull * n_sample * c->vocab * c->dim;
    }
    for (uint32_t s = 0; s < n_sample; s++) {
        const uint32_t i = r->row_item[sample_row[s]];
        float *lg = r->logits + (size_t)s * c->vocab;
        for (uint32_t v = 0; c->logits_div != 0.0f && v < c->vocab; v++) lg[v] /= c->logits_div;
        mdl_sample(lg, c->vocab, &items[i].sampling, items[i].sample_index, items[i].history,
                   r->probs, r->keys, &results[i], tops ? &tops[i] : NULL);
        if (logits_out) memcpy(logits_out + (size_t)i * c->vocab, lg, sizeof(float) * c->vocab);
    }
    for (uint32_t t = 0; t < r->rows; t++) {
        const pd_batch_item *it = &items[r->row_item[t]];
        if (r->row_last[t] && m->shape.n_mamba && it->snapshot_slot != PD_POOL_NONE)
            memcpy(mdl_runner_slot(r, it->snapshot_slot), r->row_slot[t], r->mamba_slot_bytes);
    }
    r->rows = 0;
}

void mdl_runner_run(pd_runner *r, const pd_batch_item *items, uint32_t n_items,
                    pd_item_result *results, pd_item_top *tops, float *logits) {
    const bool has_mamba = r->model->shape.n_mamba > 0;
    PD_ASSERT(r->rows == 0 && n_items <= PD_MODEL_BATCH_ITEMS_MAX);
    PD_ASSERT(results != NULL || n_items == 0);
    for (uint32_t i = 0; i < n_items; i++) {
        const pd_batch_item *it = &items[i];
        results[i].req = it->req;
        results[i].token = -1;
        results[i].logprob = 0.0f;
        results[i].n_top = 0;
        float *slot = has_mamba ? mdl_runner_slot(r, it->mamba_slot) : NULL;
        /* A request's first chunk starts from the zero state. */
        if (has_mamba && it->start_pos == 0) memset(slot, 0, r->mamba_slot_bytes);
        for (uint32_t k = 0; k < it->n_tokens; k++) {
            uint32_t t = r->rows++;
            r->row_token[t] = it->tokens[k];
            r->row_pos[t] = it->start_pos + k;
            r->row_item[t] = i;
            r->row_last[t] = k + 1 == it->n_tokens;
            r->row_pages[t] = it->pages;
            r->row_slot[t] = slot;
            if (r->rows == PD_RUNNER_ROWS) run_pass(r, items, results, tops, logits);
        }
    }
    if (r->rows > 0) run_pass(r, items, results, tops, logits);
    PD_ASSERT(r->rows == 0);
}

/* ---- the batch check ---------------------------------------------------------------- */

/* An attention item's page table covers positions [0, end), in the pool. */
static pd_err check_pages(const pd_runner *r, const pd_batch_item *it, uint32_t i, uint64_t end,
                          char *msg, size_t cap) {
    const unsigned long long req = it->req;
    uint64_t need = PD_DIV_CEIL(end, (uint64_t)r->page_size);
    if (need > r->kv_pages)
        return pd_errorf(
            msg, cap, PD_ERR_INVALID,
            "item %u (req %llu): %llu positions need more pages than the pool has (%u)", i, req,
            (unsigned long long)end, r->kv_pages);
    if (!it->pages || it->n_pages < need)
        return pd_errorf(
            msg, cap, PD_ERR_INVALID,
            "item %u (req %llu): page table has %u pages, positions up to %llu need %llu", i, req,
            it->n_pages, (unsigned long long)end, (unsigned long long)need);
    for (uint64_t p = 0; p < need; p++)
        if (it->pages[p] >= r->kv_pages)
            return pd_errorf(msg, cap, PD_ERR_INVALID,
                             "item %u (req %llu): page %u at index %llu outside the pool", i, req,
                             it->pages[p], (unsigned long long)p);
    return PD_OK;
}

/* A Mamba item's slots are in the pool and used once in the batch; marks
 * them in r->slot_seen, which mdl_runner_check clears. */
static pd_err check_slots(pd_runner *r, const pd_batch_item *it, uint32_t i, char *msg,
                          size_t cap) {
    const unsigned long long req = it->req;
    if (it->mamba_slot >= r->mamba_slots)
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "item %u (req %llu): Mamba slot %u outside the pool (%u)", i, req,
                         it->mamba_slot, r->mamba_slots);
    if (it->snapshot_slot != PD_POOL_NONE && it->snapshot_slot >= r->mamba_slots)
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "item %u (req %llu): snapshot slot %u outside the pool", i, req,
                         it->snapshot_slot);
    uint32_t slots[2] = {it->mamba_slot, it->snapshot_slot};
    for (int s = 0; s < 2; s++) {
        if (slots[s] == PD_POOL_NONE) continue;
        if (r->slot_seen[slots[s]])
            return pd_errorf(msg, cap, PD_ERR_INVALID,
                             "item %u (req %llu): Mamba slot %u used twice in the batch", i, req,
                             slots[s]);
        r->slot_seen[slots[s]] = 1;
    }
    return PD_OK;
}

/* One item against the contract of model.h and executor.h; the first
 * breach found is the message. */
static pd_err check_item(pd_runner *r, const pd_batch_item *it, uint32_t i, char *msg, size_t cap) {
    const pd_model *m = r->model;
    const unsigned long long req = it->req;
    if (!it->tokens || it->n_tokens == 0)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "item %u (req %llu): no tokens", i, req);
    for (uint32_t k = 0; k < it->n_tokens; k++)
        if (it->tokens[k] < 0 || (uint32_t)it->tokens[k] >= m->cfg.vocab)
            return pd_errorf(
                msg, cap, PD_ERR_INVALID,
                "item %u (req %llu): token %d at offset %u outside the vocabulary (%u)", i, req,
                it->tokens[k], k, m->cfg.vocab);
    uint64_t end = (uint64_t)it->start_pos + it->n_tokens;
    if (end > UINT32_MAX)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "item %u: positions overflow", i);
    pd_err err = PD_OK;
    if (m->shape.n_attn) err = check_pages(r, it, i, end, msg, cap);
    if (err == PD_OK && m->shape.n_mamba) err = check_slots(r, it, i, msg, cap);
    if (err != PD_OK) return err;
    if (it->sample) {
        const pd_sampling *s = &it->sampling;
        if (!(s->temperature >= 0.0f) || !isfinite(s->temperature) ||
            (s->temperature > 0.0f && !(s->top_p > 0.0f && s->top_p <= 1.0f)))
            return pd_errorf(
                msg, cap, PD_ERR_INVALID,
                "item %u (req %llu): sampling needs temperature >= 0 and top_p in (0, 1]", i, req);
        if (!pd_sampling_valid(s))
            return pd_errorf(msg, cap, PD_ERR_INVALID,
                             "item %u (req %llu): sampling parameter out of range "
                             "(min_p, penalties or top_logprobs)",
                             i, req);
        if (pd_sampling_penalized(s) && it->sample_index > 0 && !it->history)
            return pd_errorf(msg, cap, PD_ERR_INVALID,
                             "item %u (req %llu): penalised sampling without the history", i, req);
    }
    return PD_OK;
}

pd_err mdl_runner_check(pd_runner *r, const pd_batch_item *items, uint32_t n_items, char *msg,
                        size_t cap) {
    if (n_items > PD_MODEL_BATCH_ITEMS_MAX)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "%u items in a batch (at most %u)", n_items,
                         PD_MODEL_BATCH_ITEMS_MAX);
    if (n_items > 0 && !items) return pd_errorf(msg, cap, PD_ERR_INVALID, "no items");
    pd_err err = PD_OK;
    uint32_t checked = 0;
    for (; checked < n_items && err == PD_OK; checked++)
        err = check_item(r, &items[checked], checked, msg, cap);
    /* clear the slot marks of every item looked at */
    for (uint32_t i = 0; r->model->shape.n_mamba && i < checked; i++) {
        if (items[i].mamba_slot < r->mamba_slots) r->slot_seen[items[i].mamba_slot] = 0;
        if (items[i].snapshot_slot < r->mamba_slots) r->slot_seen[items[i].snapshot_slot] = 0;
    }
    return err;
}

/* ---- creation ------------------------------------------------------------------------ */

/* The byte and layer sizes a pass needs, from the config and r->page_size. */
static void set_dims(pd_runner *r) {
    const pd_model_config *c = &r->model->cfg;
    const pd_model_shape *s = &r->model->shape;
    r->kv_page_bytes = s->kv_bytes_per_token * r->page_size;
    r->mamba_slot_bytes = s->mamba_slot_bytes;
    mdl_mamba2_dims_from_config(c, &r->mamba_dims);
    r->mamba_layer_floats = s->n_mamba ? mdl_mamba2_state_floats(&r->mamba_dims) : 0;
    r->attn_dims = (pd_attn_dims){.dim = c->dim,
                                  .heads = c->attn_heads,
                                  .kv_heads = c->attn_kv_heads,
                                  .head_dim = c->attn_head_dim,
                                  .norm_eps = c->norm_eps,
                                  .score_mult = c->attn_scale,
                                  .no_rope = c->no_rope,
                                  .q_dim = s->q_dim,
                                  .kv_dim = s->kv_dim,
                                  .page_size = r->page_size,
                                  .kv_pages = r->kv_pages,
                                  .n_attn = s->n_attn,
                                  .layer = 0,
                                  .page_floats = r->kv_page_bytes / sizeof(float)};
    PD_ASSERT(r->mamba_slot_bytes == s->n_mamba * r->mamba_layer_floats * sizeof(float));
    if (s->n_attn) {
        PD_ASSERT(c->attn_head_dim / 2 <= PD_ARRAY_LEN(r->rope_inv));
        mdl_rope_inv_freq(c, r->rope_inv);
    }
}

/* Zeroed memory a transport may move: from the node's allocator if it has
 * one (the transport's, executor.h), else the heap. */
static void *transferable_alloc(const pd_runner *r, uint64_t bytes) {
    if (r->alloc.alloc) return r->alloc.alloc(r->alloc.self, bytes);
    return calloc(1, bytes);
}

static void transferable_free(const pd_runner *r, void *p) {
    if (r->alloc.free) r->alloc.free(r->alloc.self, p);
    else free(p);
}

/* The node's memory: KV pages and Mamba slots (which a transport moves, so
 * from the allocator) and host pages (which stay on this node), zeroed. */
static pd_err alloc_node_memory(pd_runner *r, char *msg, size_t cap) {
    uint64_t kv_bytes = (uint64_t)r->kv_pages * r->kv_page_bytes;
    uint64_t mamba_bytes = (uint64_t)r->mamba_slots * r->mamba_slot_bytes;
    uint64_t host_bytes = (uint64_t)r->host_pages * r->kv_page_bytes;
    if (kv_bytes) r->kv = transferable_alloc(r, kv_bytes);
    if (mamba_bytes) r->mamba = transferable_alloc(r, mamba_bytes);
    if (host_bytes) r->host = calloc(1, host_bytes);
    if ((kv_bytes && !r->kv) || (mamba_bytes && !r->mamba) || (host_bytes && !r->host))
        return pd_errorf(msg, cap, PD_ERR_NOMEM,
                         "cannot allocate %llu + %llu + %llu bytes of KV, Mamba and host memory",
                         (unsigned long long)kv_bytes, (unsigned long long)mamba_bytes,
                         (unsigned long long)host_bytes);
    return PD_OK;
}

static float *take(float **cursor, size_t n) {
    float *p = *cursor;
    *cursor += n;
    return p;
}

/* Scratch for one pass: one allocation of floats, cut into the buffers in
 * the order they are counted. */
static pd_err alloc_scratch(pd_runner *r, uint32_t threads, char *msg, size_t cap) {
    const pd_model_config *c = &r->model->cfg;
    const pd_model_shape *s = &r->model->shape;
    const size_t R = PD_RUNNER_ROWS;
    r->attn_scratch.context_max = (size_t)r->kv_pages * r->page_size;
    size_t floats = R * c->dim * 3 + R * c->mlp_hidden * 2 + R * c->vocab + c->vocab;
    if (s->n_attn)
        floats += R * (c->attn_head_dim / 2) * 2 +
            R * (2 * (size_t)s->q_dim + 2 * (size_t)s->kv_dim) +
            threads * r->attn_scratch.context_max;
    if (s->n_mamba) floats += mdl_mamba2_scratch_floats(&r->mamba_dims, PD_RUNNER_ROWS);
    r->scratch_mem = malloc(floats * sizeof(float));
    r->keys = malloc(sizeof(uint64_t) * c->vocab);
    r->slot_seen = calloc(r->mamba_slots ? r->mamba_slots : 1, 1);
    if (!r->scratch_mem || !r->keys || !r->slot_seen)
        return pd_errorf(msg, cap, PD_ERR_NOMEM, "cannot allocate %zu floats of scratch", floats);
    float *cur = r->scratch_mem;
    r->x = take(&cur, R * c->dim);
    r->xb = take(&cur, R * c->dim);
    r->xo = take(&cur, R * c->dim);
    r->gate = take(&cur, R * c->mlp_hidden);
    r->up = take(&cur, R * c->mlp_hidden);
    r->logits = take(&cur, R * c->vocab);
    r->probs = take(&cur, c->vocab);
    if (s->n_attn) {
        r->rope_cos = take(&cur, R * (c->attn_head_dim / 2));
        r->rope_sin = take(&cur, R * (c->attn_head_dim / 2));
        r->attn_scratch.q = take(&cur, R * s->q_dim);
        r->attn_scratch.att = take(&cur, R * s->q_dim);
        r->attn_scratch.k = take(&cur, R * s->kv_dim);
        r->attn_scratch.v = take(&cur, R * s->kv_dim);
        r->attn_scratch.scores = take(&cur, threads * r->attn_scratch.context_max);
    }
    if (s->n_mamba) {
        mdl_mamba2_scratch_bind(&r->mamba_scratch, &r->mamba_dims, PD_RUNNER_ROWS, cur);
        cur += mdl_mamba2_scratch_floats(&r->mamba_dims, PD_RUNNER_ROWS);
    }
    PD_ASSERT((size_t)(cur - r->scratch_mem) == floats);
    return PD_OK;
}

pd_err mdl_runner_create(pd_runner **out, const pd_model *model, uint32_t page_size,
                         uint32_t kv_pages, uint32_t mamba_slots, uint32_t host_pages,
                         uint32_t threads, const pd_exec_alloc *alloc, char *msg, size_t cap) {
    *out = NULL;
    PD_ASSERT(!alloc || (alloc->alloc && alloc->free));
    const pd_model_shape *s = &model->shape;
    if (page_size == 0 || page_size > PD_MODEL_PAGE_SIZE_MAX)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "page size %u outside [1, %u]", page_size,
                         PD_MODEL_PAGE_SIZE_MAX);
    if (threads == 0 || threads > PD_MODEL_THREADS_MAX)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "threads %u outside [1, %u]", threads,
                         PD_MODEL_THREADS_MAX);
    if (kv_pages > PD_POOL_UNITS_MAX || mamba_slots > PD_POOL_UNITS_MAX ||
        host_pages > PD_POOL_UNITS_MAX)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "pool sizes above %u", PD_POOL_UNITS_MAX);
    if (s->n_attn && kv_pages == 0)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "a model with attention layers needs KV pages");
    if (s->n_mamba && mamba_slots == 0)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "a model with Mamba layers needs Mamba slots");

    pd_runner *r = calloc(1, sizeof(*r));
    if (!r) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    r->model = model;
    if (alloc) r->alloc = *alloc;
    r->page_size = page_size;
    r->kv_pages = s->n_attn ? kv_pages : 0;
    r->mamba_slots = s->n_mamba ? mamba_slots : 0;
    r->host_pages = s->n_attn ? host_pages : 0;
    set_dims(r);

    pd_err err = alloc_node_memory(r, msg, cap);
    if (err == PD_OK) err = alloc_scratch(r, threads, msg, cap);
    if (err == PD_OK && mdl_threads_create(&r->threads, threads) != PD_OK)
        err = pd_errorf(msg, cap, PD_ERR_NOMEM, "cannot start %u threads", threads);
    if (err != PD_OK) {
        mdl_runner_destroy(r);
        return err;
    }
    r->par = (pd_par){r->threads, 200000};
    *out = r;
    return PD_OK;
}

void mdl_runner_destroy(pd_runner *r) {
    if (!r) return;
    mdl_threads_destroy(r->threads);
    free(r->slot_seen);
    free(r->keys);
    free(r->scratch_mem);
    free(r->host);
    transferable_free(r, r->mamba);
    transferable_free(r, r->kv);
    free(r);
}
