/*
 * pd_executor — what the engines need from a model: run batches of forward
 * passes over the node's paged memory, in order, asynchronously.
 *
 * The engines are sans-I/O state machines: they never block on a forward.
 * They launch a batch and later poll for its result; with overlap on, batch
 * N+1 is launched before batch N's result is processed. Two implementations
 * exist: the tiny hybrid model (src/model, a real forward pass on the CPU)
 * and the synthetic executor of the simulator (src/sim), which fills pages
 * and states with a deterministic function of the token prefix.
 *
 * Contract:
 *   - Work executes in submission order: batches, state copies and host
 *     copies form one stream, like a GPU stream. A forward may write KV pages
 *     and Mamba slots at any time between its launch and the moment poll
 *     reports it complete; it never touches memory afterwards.
 *   - launch() copies everything it needs (tokens, page tables): the batch
 *     and the arrays it points to may be reused as soon as it returns.
 *   - poll() is non-blocking and is called for batch ids in launch order.
 *   - Memory: the executor owns the device KV pages, Mamba state slots and
 *     host pages that the engine's pools index (same counts, same page
 *     size); memory() describes them so a transport can register them.
 */
#ifndef PDSERVE_EXECUTOR_H
#define PDSERVE_EXECUTOR_H

#include <string.h>

#include "pdserve/base.h"
#include "pdserve/pool.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Most likely tokens a result can report beside the chosen one (OpenAI's
 * top_logprobs allows 20). */
#define PD_TOP_LOGPROBS_MAX 20

/* How the next token is chosen (src/model/sample.c has the exact rules).
 * Every field's zero value means "off", except top_p (1 = off); a
 * repetition_penalty of 0 or 1 is off. The penalties look at the tokens the
 * request generated so far (pd_batch_item.history), not at the prompt. */
typedef struct pd_sampling {
    float temperature;        /* 0: greedy (argmax, first index wins ties) */
    float top_p;              /* (0, 1]; 1 = no nucleus cut */
    uint64_t seed;            /* per-request generator seed */
    uint32_t top_k;           /* keep the k most likely tokens; 0: all */
    float min_p;              /* [0, 1]: keep tokens at least min_p times the likeliest's */
    float repetition_penalty; /* > 0: logits of generated tokens divided (if > 0) or multiplied */
    float frequency_penalty;  /* [-2, 2]: minus this times the token's count so far */
    float presence_penalty;   /* [-2, 2]: minus this once the token was generated */
    uint32_t top_logprobs;    /* report this many most likely tokens, <= PD_TOP_LOGPROBS_MAX */
} pd_sampling;

/* min_p in [0, 1], repetition_penalty finite and >= 0, the other two
 * penalties in [-2, 2], top_logprobs <= PD_TOP_LOGPROBS_MAX. (temperature and
 * top_p are checked where they are used.) */
static inline bool pd_sampling_valid(const pd_sampling *s) {
    return s->min_p >= 0.0f && s->min_p <= 1.0f && s->repetition_penalty >= 0.0f &&
        s->repetition_penalty <= 1e6f && s->frequency_penalty >= -2.0f &&
        s->frequency_penalty <= 2.0f && s->presence_penalty >= -2.0f &&
        s->presence_penalty <= 2.0f && s->top_logprobs <= PD_TOP_LOGPROBS_MAX;
}

/* Whether the sampler needs the tokens generated so far. */
static inline bool pd_sampling_penalized(const pd_sampling *s) {
    return (s->repetition_penalty != 0.0f && s->repetition_penalty != 1.0f) ||
        s->frequency_penalty != 0.0f || s->presence_penalty != 0.0f;
}

/* The fields a kept decode item changes every step (its position and sample
 * index; its page count as the page table grows), with the request id that
 * the executor and the poll read, come first, in 24 bytes: a decode step
 * walks its 256 items, and with these fields spread over the item's 104
 * bytes each took two cache lines (issue 13). Every initializer names its
 * fields, so the order is free. */
typedef struct pd_batch_item {
    uint64_t req; /* engine's request id, echoed in the result */
    uint32_t start_pos;
    uint32_t sample_index; /* which output token is sampled (0 = the first) */
    uint32_t n_pages;      /* of pages, below */
    uint32_t n_tokens;
    const int32_t *tokens; /* tokens at positions [start_pos, start_pos + n_tokens) */
    /* Page table: pages[i] holds positions [i*page_size, (i+1)*page_size).
     * Covers at least start_pos + n_tokens positions. Positions before
     * start_pos already hold valid KV (computed, cached or transferred). */
    const uint32_t *pages;
    /* Running Mamba state: read, advanced over the tokens, written back.
     * PD_POOL_NONE for a model without Mamba layers. */
    uint32_t mamba_slot;
    /* If not PD_POOL_NONE: after the last token, copy the state here too. */
    uint32_t snapshot_slot;
    bool sample;               /* produce the next token after the last position */
    /* The output tokens so far (sample_index of them), for the penalties;
     * NULL when the sampling is not penalized. */
    const int32_t *history;
    pd_sampling sampling;
} pd_batch_item;

typedef struct pd_batch {
    uint64_t id;               /* increasing, chosen by the engine */
    const pd_batch_item *items;
    uint32_t n_items;
} pd_batch;

/* One item's result. Dense (24 bytes): a decode step reads one per running
 * request, and the top-logprob entries that few requests ask for live apart,
 * in a pd_item_top beside it (issue 13: with the entries inline, 184 bytes a
 * result, a batch of 256 results alone was larger than the L1 cache). */
typedef struct pd_item_result {
    uint64_t req;
    int32_t token;             /* sampled token, or -1 when !sample */
    float logprob;             /* its log-probability (0 when !sample) */
    /* How many top-logprob entries the item's pd_item_top holds:
     * sampling.top_logprobs of them, else 0. */
    uint32_t n_top;
} pd_item_result;

/* The sampling.top_logprobs most likely tokens of a result, by the model's
 * raw distribution, most likely first (ties: lower id first), with their
 * log-probabilities: n_top entries of each. */
typedef struct pd_item_top {
    int32_t token[PD_TOP_LOGPROBS_MAX];
    float logprob[PD_TOP_LOGPROBS_MAX];
} pd_item_top;

/* An executor's poll handing back n stored results (src, src_tops): the
 * results, and the top-logprob entries of those that have any. */
static inline void pd_item_results_copy(pd_item_result *dst, pd_item_top *dst_tops,
                                        const pd_item_result *src, const pd_item_top *src_tops,
                                        uint32_t n) {
    memcpy(dst, src, n * sizeof(pd_item_result));
    for (uint32_t i = 0; i < n; i++)
        if (src[i].n_top) dst_tops[i] = src_tops[i];
}

/* Where the node's memory lives, for transport registration. Unit i of each
 * region starts at base + i * unit_bytes; a KV page holds that page's K and V
 * for every attention layer. A region with no units has base NULL. */
typedef struct pd_exec_memory {
    void *kv;
    size_t kv_page_bytes;
    uint32_t kv_pages;
    void *mamba;
    size_t mamba_slot_bytes;
    uint32_t mamba_slots;
    void *host;
    size_t host_page_bytes;
    uint32_t host_pages;
} pd_exec_memory;

/* Where an executor gets the memory a transport moves (KV pages, Mamba
 * slots). A transport that can write some memory faster than plain heap
 * memory hands out an allocator (pd_net_allocator: memory UCX allocated and
 * mapped); create calls take it as an option, NULL meaning the heap. alloc
 * returns `bytes` of zeroed memory, or NULL; free takes back what alloc gave
 * (NULL is ignored). The allocator belongs to whoever owns the transport and
 * outlives every executor created with it. Pools above the executor do not
 * see the difference: the ledger does not care where the bytes live. */
typedef struct pd_exec_alloc {
    void *(*alloc)(void *self, size_t bytes);
    void (*free)(void *self, void *p);
    void *self;
} pd_exec_alloc;

typedef struct pd_model_info {
    uint32_t vocab;
    int32_t eos_token;         /* -1: none */
    uint32_t page_size;
    bool has_mamba;
} pd_model_info;

typedef struct pd_executor_vtable {
    /* Enqueues a batch. PD_ERR_NOMEM if too many batches are in flight. */
    pd_err (*launch)(void *self, const pd_batch *batch);
    /* If batch `id` (the oldest not yet returned) is complete, writes one
     * result per item, in item order, and returns true. tops has an entry
     * per item as well: tops[i] is written when results[i].n_top > 0 and
     * left alone otherwise. */
    bool (*poll)(void *self, uint64_t batch_id, pd_item_result *results, pd_item_top *tops);
    /* Copies Mamba state slot src into dst, ordered after launched work. */
    pd_err (*copy_state)(void *self, uint32_t dst_slot, uint32_t src_slot);
    /* Host tier. Synchronous write-back of evicted pages (device -> host). */
    void (*write_back)(void *self, const uint32_t *dev, const uint32_t *host, uint32_t n);
    /* Asynchronous load (host -> device), ordered with batches; load_poll
     * returns true once it is complete; load_cancel abandons it (the device
     * pages may have been partially written, and are not touched after). */
    pd_err (*load_begin)(void *self, uint64_t load_id, const uint32_t *dev,
                         const uint32_t *host, uint32_t n);
    bool (*load_poll)(void *self, uint64_t load_id);
    void (*load_cancel)(void *self, uint64_t load_id);
    void (*memory)(void *self, pd_exec_memory *out);
    void (*info)(void *self, pd_model_info *out);
} pd_executor_vtable;

typedef struct pd_executor {
    const pd_executor_vtable *vt;
    void *self;
} pd_executor;

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_EXECUTOR_H */
