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
 * It computes inside launch; the simulator wraps it in a pd_stream so that a
 * forward happens when the driver decides, in order, as on a GPU stream.
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
    /* Where the KV pages and Mamba slots come from (a transport's allocator,
     * executor.h); NULL: the heap. Must outlive the executor. */
    const pd_exec_alloc *alloc;
} pd_synth_config;

pd_err pd_synth_create(pd_synth **out, const pd_synth_config *cfg);
void pd_synth_destroy(pd_synth *s);
pd_executor pd_synth_executor(pd_synth *s);

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
