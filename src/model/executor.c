/*
 * executor.c — the tiny hybrid model behind the engines' executor vtable.
 *
 * The engines are written against an asynchronous device: launch a batch,
 * poll for it later, with batches, state copies and host copies ordered like
 * one GPU stream. On the CPU the simplest faithful implementation is
 * synchronous: launch validates the batch, computes it at once and parks the
 * results in a ring of PD_MODEL_INFLIGHT_MAX entries; poll hands back the
 * oldest. Submission order is trivially kept because every operation is
 * complete when its call returns, and launch needs no copy of the batch.
 * Host loads are plain copies, so load_poll is true at once and load_cancel
 * has nothing to abandon.
 *
 * Misuse that the contract forbids and an engine can cause (a bad page or
 * slot index, a batch too large) is refused with an error; misuse that can
 * only be an engine bug (polling out of order) is an assertion.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runner.h"

typedef struct pending_batch {
    uint64_t id;
    uint32_t n_items;
    pd_item_result results[PD_MODEL_BATCH_ITEMS_MAX];
    pd_item_top tops[PD_MODEL_BATCH_ITEMS_MAX];
} pending_batch;

typedef struct model_exec {
    pd_runner *runner;
    pending_batch ring[PD_MODEL_INFLIGHT_MAX];
    uint32_t head, count;       /* oldest entry, entries in use */
    bool launched_any;
    uint64_t last_id;
} model_exec;

static const pd_executor_vtable model_vtable;

static model_exec *self_of(const pd_executor *ex) {
    PD_ASSERTF(ex && ex->vt == &model_vtable, "not a model executor");
    return ex->self;
}

static pd_err exec_launch(void *self, const pd_batch *batch) {
    model_exec *e = self;
    if (e->count == PD_MODEL_INFLIGHT_MAX) return PD_ERR_NOMEM;
    if (e->launched_any && batch->id <= e->last_id) return PD_ERR_INVALID;
    pd_err err = mdl_runner_check(e->runner, batch->items, batch->n_items, NULL, 0);
    if (err != PD_OK) return err;
    pending_batch *p = &e->ring[(e->head + e->count) % PD_MODEL_INFLIGHT_MAX];
    p->id = batch->id;
    p->n_items = batch->n_items;
    mdl_runner_run(e->runner, batch->items, batch->n_items, p->results, p->tops, NULL);
    e->count++;
    e->launched_any = true;
    e->last_id = batch->id;
    return PD_OK;
}

static bool exec_poll(void *self, uint64_t batch_id, pd_item_result *results, pd_item_top *tops) {
    model_exec *e = self;
    if (e->count == 0) return false;
    pending_batch *p = &e->ring[e->head];
    PD_ASSERTF(p->id == batch_id, "poll(%llu) but the oldest batch is %llu",
               (unsigned long long)batch_id, (unsigned long long)p->id);
    pd_item_results_copy(results, tops, p->results, p->tops, p->n_items);
    e->head = (e->head + 1) % PD_MODEL_INFLIGHT_MAX;
    e->count--;
    return true;
}

static pd_err exec_copy_state(void *self, uint32_t dst_slot, uint32_t src_slot) {
    model_exec *e = self;
    pd_runner *r = e->runner;
    if (dst_slot >= r->mamba_slots || src_slot >= r->mamba_slots) return PD_ERR_INVALID;
    if (dst_slot != src_slot)
        memcpy(mdl_runner_slot(r, dst_slot), mdl_runner_slot(r, src_slot), r->mamba_slot_bytes);
    return PD_OK;
}

static char *kv_page(const pd_runner *r, uint32_t p) {
    return (char *)r->kv + (size_t)p * r->kv_page_bytes;
}

static char *host_page(const pd_runner *r, uint32_t h) {
    return (char *)r->host + (size_t)h * r->kv_page_bytes;
}

static void exec_write_back(void *self, const uint32_t *dev, const uint32_t *host, uint32_t n) {
    model_exec *e = self;
    pd_runner *r = e->runner;
    for (uint32_t i = 0; i < n; i++) {
        PD_ASSERTF(dev[i] < r->kv_pages && host[i] < r->host_pages, "write_back page %u -> host %u",
                   dev[i], host[i]);
        memcpy(host_page(r, host[i]), kv_page(r, dev[i]), r->kv_page_bytes);
    }
}

static pd_err exec_load_begin(void *self, uint64_t load_id, const uint32_t *dev,
                              const uint32_t *host, uint32_t n) {
    (void)load_id;
    model_exec *e = self;
    pd_runner *r = e->runner;
    for (uint32_t i = 0; i < n; i++)
        if (dev[i] >= r->kv_pages || host[i] >= r->host_pages) return PD_ERR_INVALID;
    for (uint32_t i = 0; i < n; i++)
        memcpy(kv_page(r, dev[i]), host_page(r, host[i]), r->kv_page_bytes);
    return PD_OK;
}

static bool exec_load_poll(void *self, uint64_t load_id) {
    (void)self;
    (void)load_id;
    return true; /* loads complete inside load_begin */
}

static void exec_load_cancel(void *self, uint64_t load_id) {
    (void)self;
    (void)load_id;
}

static void exec_memory(void *self, pd_exec_memory *out) {
    const pd_runner *r = ((model_exec *)self)->runner;
    *out = (pd_exec_memory){
        .kv = r->kv, .kv_page_bytes = r->kv_page_bytes, .kv_pages = r->kv_pages,
        .mamba = r->mamba, .mamba_slot_bytes = r->mamba_slot_bytes, .mamba_slots = r->mamba_slots,
        .host = r->host, .host_page_bytes = r->kv_page_bytes, .host_pages = r->host_pages};
}

static void exec_info(void *self, pd_model_info *out) {
    const pd_runner *r = ((model_exec *)self)->runner;
    const pd_model_config *c = &r->model->cfg;
    *out = (pd_model_info){.vocab = c->vocab, .eos_token = c->eos_token, .page_size = r->page_size,
                           .has_mamba = r->model->shape.n_mamba > 0};
}

static const pd_executor_vtable model_vtable = {
    .launch = exec_launch,
    .poll = exec_poll,
    .copy_state = exec_copy_state,
    .write_back = exec_write_back,
    .load_begin = exec_load_begin,
    .load_poll = exec_load_poll,
    .load_cancel = exec_load_cancel,
    .memory = exec_memory,
    .info = exec_info,
};

pd_err pd_model_executor_create(pd_executor *out, const pd_model *model, uint32_t page_size,
                                uint32_t kv_pages, uint32_t mamba_slots, uint32_t host_pages,
                                uint32_t threads, char *msg, size_t msg_cap) {
    return pd_model_executor_create_in(out, model, page_size, kv_pages, mamba_slots, host_pages,
                                       threads, NULL, msg, msg_cap);
}

pd_err pd_model_executor_create_in(pd_executor *out, const pd_model *model, uint32_t page_size,
                                   uint32_t kv_pages, uint32_t mamba_slots, uint32_t host_pages,
                                   uint32_t threads, const pd_exec_alloc *alloc, char *msg,
                                   size_t msg_cap) {
    PD_ASSERT(out != NULL && model != NULL);
    out->vt = NULL;
    out->self = NULL;
    model_exec *e = calloc(1, sizeof(*e));
    if (!e) return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    pd_err err = mdl_runner_create(&e->runner, model, page_size, kv_pages, mamba_slots, host_pages,
                                   threads, alloc, msg, msg_cap);
    if (err != PD_OK) {
        free(e);
        return err;
    }
    out->vt = &model_vtable;
    out->self = e;
    return PD_OK;
}

void pd_model_executor_destroy(pd_executor *ex) {
    if (!ex || !ex->self) return;
    model_exec *e = self_of(ex);
    mdl_runner_destroy(e->runner);
    free(e);
    ex->vt = NULL;
    ex->self = NULL;
}

bool pd_model_executor_is(const pd_executor *ex) { return ex && ex->vt == &model_vtable; }

pd_err pd_model_forward(pd_executor *ex, const pd_batch_item *items, uint32_t n_items,
                        pd_item_result *results, pd_item_top *tops, float *logits, char *msg,
                        size_t msg_cap) {
    model_exec *e = self_of(ex);
    pd_err err = mdl_runner_check(e->runner, items, n_items, msg, msg_cap);
    if (err != PD_OK) return err;
    for (uint32_t i = 0; i < n_items && !tops; i++) {
        if (items[i].sample && items[i].sampling.top_logprobs)
            return pd_errorf(msg, msg_cap, PD_ERR_INVALID,
                             "item %u asks for %u top logprobs but no tops were given", i,
                             items[i].sampling.top_logprobs);
    }
    mdl_runner_run(e->runner, items, n_items, results, tops, logits);
    return PD_OK;
}

void pd_model_executor_set_min_parallel_flops(pd_executor *ex, uint64_t flops) {
    self_of(ex)->runner->par.min_flops = flops;
}

uint64_t pd_model_executor_flops(const pd_executor *ex) { return self_of(ex)->runner->flops; }
