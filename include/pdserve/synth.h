/*
 * pd_synth — the synthetic executor of the simulator (DESIGN.md section 9).
 *
 * No arithmetic worth the name: each token position of each "layer" holds a
 * 64-bit value that chains the previous position's value with the token and
 * the position, the Mamba state chains the tokens, and a sampled token is a
 * hash of every KV value of the sequence and the state. So the output
 * depends on every page and the state being exactly where the page table
 * says: a page sent to the wrong place, a missing state, a page overwritten
 * by a late write or reused too early all change the tokens, which the
 * simulator compares with pd_synth_reference (the same request run alone,
 * without pages, caches or transfers).
 *
 * Work is an in-order stream (batches, state copies, host loads), executed
 * only when the driver calls pd_synth_run — so the driver decides when a
 * forward "happens" relative to everything else, and a held batch blocks the
 * ones behind it as on a real GPU stream. A forward reads and writes memory
 * when it runs, not when it was launched.
 */
#ifndef PDSERVE_SYNTH_H
#define PDSERVE_SYNTH_H

#include "pdserve/executor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_synth pd_synth;

typedef struct pd_synth_config {
    uint32_t page_size, kv_pages, mamba_slots, host_pages;
    uint32_t layers;         /* values per token position */
    uint32_t vocab;
    int32_t eos_token;       /* -1: none */
    uint32_t batch_max;      /* items per batch */
} pd_synth_config;

pd_err pd_synth_create(pd_synth **out, const pd_synth_config *cfg);
void pd_synth_destroy(pd_synth *s);
pd_executor pd_synth_executor(pd_synth *s);

/* Called for every item at launch: PD_SYNTH_HOLD holds the whole batch until
 * released, a positive value delays it by that many ticks, 0 runs it as soon
 * as it reaches the head of the stream. */
#define PD_SYNTH_HOLD (-1)
typedef int (*pd_synth_hold_fn)(void *ctx, uint64_t batch_id, const pd_batch_item *item);
void pd_synth_set_hold_fn(pd_synth *s, pd_synth_hold_fn fn, void *ctx);
/* While on, host loads launched from now on are held until it is turned off. */
void pd_synth_hold_loads(pd_synth *s, bool on);
/* Holds or releases a launched batch that has not run yet. */
void pd_synth_hold(pd_synth *s, uint64_t batch_id, bool held);

/* The driver's clock: delayed batches become ready when it reaches their time. */
void pd_synth_set_now(pd_synth *s, uint64_t now);
/* Runs queued work in order until the queue is empty or its head is held or
 * not ready yet. Returns the number of operations run. */
uint32_t pd_synth_run(pd_synth *s);
/* Runs at most one operation (if the head is runnable). */
bool pd_synth_run_one(pd_synth *s);
uint32_t pd_synth_queued(const pd_synth *s);
bool pd_synth_blocked(const pd_synth *s);
/* Id of the batch at the head of the queue, or 0 (for the explorer). */
uint64_t pd_synth_head_batch(const pd_synth *s);

/* The tokens a request produces when run alone: the first from the prompt,
 * then one per step, stopping at eos (unless ignore_eos), a stop token, or
 * max_new. Writes up to max_new tokens to out, returns how many. */
uint32_t pd_synth_reference(const pd_synth_config *cfg, bool mamba, const int32_t *prompt,
                            uint32_t len, uint32_t max_new, const int32_t *stop,
                            uint32_t n_stop, bool ignore_eos, const pd_sampling *sampling,
                            int32_t *out);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_SYNTH_H */
