/*
 * Helpers for the model tests: small models, executors, and one request run
 * the way an engine would run it (prefill in chunks, then greedy or sampled
 * decode), recording the logits of every sampled position so tests can
 * compare runs bit for bit.
 */
#ifndef PDSERVE_TESTS_MODEL_FIXTURE_H
#define PDSERVE_TESTS_MODEL_FIXTURE_H

#include <stdio.h>
#include <string.h>

#include "../test_util.h"
#include "pdserve/model.h"
#include "pdserve/tokenizer.h"

#define FX_DECODE_MAX 32

/* The tiny preset with two B/C groups (so grouped Mamba heads are covered)
 * and the given layer pattern. */
static inline pd_model_config fx_config(const char *layers) {
    pd_model_config cfg;
    char msg[200];
    PD_MUST(pd_model_config_preset(&cfg, "tiny", msg, sizeof(msg)));
    cfg.mamba_groups = 2;
    snprintf(cfg.layers, sizeof(cfg.layers), "%s", layers);
    return cfg;
}

static inline pd_model *fx_model(const char *layers, uint64_t seed) {
    pd_model_config cfg = fx_config(layers);
    pd_model *m = NULL;
    char msg[200];
    pd_err err = pd_model_create_random(&m, &cfg, seed, msg, sizeof(msg));
    if (err != PD_OK) fail_msg("create_random: %s", msg);
    return m;
}

static inline pd_executor fx_exec(const pd_model *m, uint32_t page_size, uint32_t kv_pages,
                                  uint32_t mamba_slots, uint32_t threads) {
    pd_executor ex;
    char msg[200];
    pd_err err = pd_model_executor_create(&ex, m, page_size, kv_pages, mamba_slots, 4, threads, msg,
                                          sizeof(msg));
    if (err != PD_OK) fail_msg("executor_create: %s", msg);
    return ex;
}

/* A prompt of n byte tokens after BOS, drawn from seed. */
static inline void fx_prompt(int32_t *out, uint32_t n, uint64_t seed) {
    pd_rng rng;
    pd_rng_seed(&rng, seed);
    out[0] = PD_TOKEN_BOS;
    for (uint32_t i = 1; i < n; i++) out[i] = (int32_t)pd_rng_below(&rng, 256);
}

typedef struct fx_run {
    uint32_t n;                              /* sampled tokens */
    int32_t tokens[FX_DECODE_MAX + 1];
    float logprobs[FX_DECODE_MAX + 1];
    float logits[FX_DECODE_MAX + 1][PD_TOKENIZER_VOCAB];
} fx_run;

static inline void fx_forward(pd_executor *ex, const pd_batch_item *items, uint32_t n,
                              pd_item_result *res, float *logits) {
    char msg[300];
    pd_item_top *tops = calloc(n ? n : 1, sizeof(pd_item_top)); /* what the items ask is kept */
    pd_err err = pd_model_forward(ex, items, n, res, tops, logits, msg, sizeof(msg));
    free(tops);
    if (err != PD_OK) fail_msg("forward: %s", msg);
}

/* Prefills prompt[0..n_prompt) in chunks of `chunk` tokens over `pages`
 * (enough for the prompt and the decode) and `slot`, samples the first
 * token, then decodes n_decode more, one per step. */
static inline void fx_run_request(pd_executor *ex, const int32_t *prompt, uint32_t n_prompt,
                                  uint32_t chunk, const uint32_t *pages, uint32_t n_pages,
                                  uint32_t slot, uint32_t n_decode, const pd_sampling *sp,
                                  fx_run *out) {
    PD_ASSERT(n_decode <= FX_DECODE_MAX);
    memset(out, 0, sizeof(*out));
    pd_sampling greedy = {.temperature = 0.0f, .top_p = 1.0f};
    pd_batch_item it = {.req = 7, .pages = pages, .n_pages = n_pages, .mamba_slot = slot,
                        .snapshot_slot = PD_POOL_NONE, .sampling = sp ? *sp : greedy};
    pd_item_result r;
    for (uint32_t pos = 0; pos < n_prompt; pos += it.n_tokens) {
        it.tokens = prompt + pos;
        it.start_pos = pos;
        it.n_tokens = PD_MIN(chunk, n_prompt - pos);
        it.sample = pos + it.n_tokens == n_prompt;
        fx_forward(ex, &it, 1, &r, out->logits[0]);
    }
    out->tokens[0] = r.token;
    out->logprobs[0] = r.logprob;
    out->n = 1;
    for (uint32_t k = 1; k <= n_decode; k++) {
        it.tokens = &out->tokens[k - 1];
        it.n_tokens = 1;
        it.start_pos = n_prompt + k - 1;
        it.sample = true;
        it.sample_index = k;
        fx_forward(ex, &it, 1, &r, out->logits[k]);
        out->tokens[k] = r.token;
        out->logprobs[k] = r.logprob;
        out->n++;
    }
}

/* Bitwise equality of two runs: tokens, logprobs and every logit. */
static inline void fx_assert_same(const fx_run *a, const fx_run *b) {
    assert_int_equal(a->n, b->n);
    for (uint32_t k = 0; k < a->n; k++) {
        if (a->tokens[k] != b->tokens[k])
            fail_msg("token %u differs: %d vs %d", k, a->tokens[k], b->tokens[k]);
        if (memcmp(a->logits[k], b->logits[k], sizeof(a->logits[k])) != 0)
            fail_msg("logits after sampled position %u differ", k);
        if (memcmp(&a->logprobs[k], &b->logprobs[k], sizeof(float)) != 0)
            fail_msg("logprob %u differs", k);
    }
}

static inline bool fx_logits_differ(const fx_run *a, const fx_run *b, uint32_t k) {
    return memcmp(a->logits[k], b->logits[k], sizeof(a->logits[k])) != 0;
}

static inline void fx_iota(uint32_t *v, uint32_t n, uint32_t first) {
    for (uint32_t i = 0; i < n; i++) v[i] = first + i;
}

#endif
