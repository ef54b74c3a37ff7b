/*
 * pd_runner — the machine a forward pass runs on: the node's memory (KV
 * pages, Mamba slots, host pages), scratch for one pass of up to
 * PD_RUNNER_ROWS token rows, and the thread pool. forward.c runs batches on
 * it; executor.c wraps it in the engines' vtable.
 *
 * A batch of any size is computed as a sequence of passes of at most
 * PD_RUNNER_ROWS rows (a prefill chunk of 1000 tokens is 16 passes, a decode
 * step of 40 requests is one). Because a row's result does not depend on the
 * rows it shares a pass with, this is invisible in the output, and it is
 * what lets every buffer be sized once, at creation.
 */
#ifndef PDSERVE_MODEL_RUNNER_H
#define PDSERVE_MODEL_RUNNER_H

#include "model_internal.h"

#define PD_RUNNER_ROWS 64u

typedef struct pd_runner {
    const pd_model *model;
    uint32_t page_size, kv_pages, mamba_slots, host_pages;
    size_t kv_page_bytes, mamba_slot_bytes;
    float *kv;                  /* kv_pages * kv_page_bytes */
    float *mamba;               /* mamba_slots * mamba_slot_bytes */
    float *host;                /* host_pages * kv_page_bytes */
    pd_threads *threads;
    pd_par par;
    uint64_t flops;             /* cumulative */

    pd_mamba2_dims mamba_dims;
    size_t mamba_layer_floats;
    pd_attn_dims attn_dims;     /* .layer set per attention layer */

    /* scratch for one pass */
    float *x;                   /* [rows][dim] residual stream */
    float *xb;                  /* [rows][dim] normed input of a sublayer */
    float *xo;                  /* [rows][dim] output of a sublayer */
    float *gate, *up;           /* [rows][mlp_hidden] */
    float *rope_cos, *rope_sin; /* [rows][head_dim / 2] */
    double rope_inv[512];       /* the rotation frequencies (head_dim <= 1024) */
    float *logits;              /* [rows][vocab] */
    float *probs;               /* [vocab] */
    uint64_t *keys;             /* [vocab] */
    pd_mamba2_scratch mamba_scratch;
    pd_attn_scratch attn_scratch;
    float *scratch_mem;

    /* the rows of the current pass */
    uint32_t rows;
    int32_t row_token[PD_RUNNER_ROWS];
    uint32_t row_pos[PD_RUNNER_ROWS];
    uint32_t row_item[PD_RUNNER_ROWS];
    bool row_last[PD_RUNNER_ROWS];          /* the item's last token */
    const uint32_t *row_pages[PD_RUNNER_ROWS];
    float *row_slot[PD_RUNNER_ROWS];        /* the item's running slot */
    float *row_state[PD_RUNNER_ROWS];       /* this Mamba layer's part of it */

    uint8_t *slot_seen;  /* [mamba_slots], for the batch check */
    pd_exec_alloc alloc; /* where kv and mamba came from; alloc NULL: the heap */
} pd_runner;

pd_err mdl_runner_create(pd_runner **out, const pd_model *model, uint32_t page_size,
                         uint32_t kv_pages, uint32_t mamba_slots, uint32_t host_pages,
                         uint32_t threads, const pd_exec_alloc *alloc, char *msg, size_t msg_cap);
void mdl_runner_destroy(pd_runner *r);

/* PD_OK when every item keeps the contract (model.h, executor.h); otherwise
 * PD_ERR_INVALID and a message naming the item and the problem. */
pd_err mdl_runner_check(pd_runner *r, const pd_batch_item *items, uint32_t n_items, char *msg,
                        size_t msg_cap);

/* Computes checked items: results[i] per item, tops[i] for an item with
 * top logprobs (tops NULL: none computed); logits (optional) as in
 * pd_model_forward. */
void mdl_runner_run(pd_runner *r, const pd_batch_item *items, uint32_t n_items,
                    pd_item_result *results, pd_item_top *tops, float *logits);

float *mdl_runner_slot(const pd_runner *r, uint32_t slot);

#endif
