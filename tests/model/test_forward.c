/* The forward pass's promise: a position's output depends only on the tokens
 * before it — not on chunking, page size, page placement, threads, batching,
 * or the node that computed the earlier positions. Every test compares two
 * ways of computing the same thing bit for bit; the negative controls show
 * that the comparison does notice when state is actually missing. */
#include <math.h>
#include <stdlib.h>

#include "model_fixture.h"
#include "model_internal.h"

#define PROMPT_LEN 70
#define DECODE 8

static fx_run *new_run(void) {
    fx_run *r = calloc(1, sizeof(fx_run));
    assert_non_null(r);
    return r;
}

/* Positions PROMPT_LEN + DECODE in pages of page_size. */
static uint32_t pages_needed(uint32_t page_size) {
    return PD_DIV_CEIL(PROMPT_LEN + DECODE, page_size);
}

static void chunk_sizes_give_bit_identical_logits_and_tokens(void **state) {
    (void)state;
    pd_model *m = fx_model("MAMA", 11);
    const uint32_t ps = 4, n_pages = pages_needed(ps);
    pd_executor ex = fx_exec(m, ps, n_pages, 1, 1);
    int32_t prompt[PROMPT_LEN];
    fx_prompt(prompt, PROMPT_LEN, 5);
    uint32_t pages[64];
    fx_iota(pages, n_pages, 0);
    fx_run *whole = new_run(), *chunked = new_run();
    fx_run_request(&ex, prompt, PROMPT_LEN, PROMPT_LEN, pages, n_pages, 0, DECODE, NULL, whole);
    const uint32_t chunks[] = {1, 3, 8, 64};
    for (size_t c = 0; c < PD_ARRAY_LEN(chunks); c++) {
        fx_run_request(&ex, prompt, PROMPT_LEN, chunks[c], pages, n_pages, 0, DECODE, NULL,
                       chunked);
        fx_assert_same(whole, chunked);
    }
    free(chunked);
    free(whole);
    pd_model_destroy(m);
    pd_model_executor_destroy(&ex);
}

static void page_size_does_not_change_the_output(void **state) {
    (void)state;
    pd_model *m = fx_model("AMMA", 12);
    int32_t prompt[PROMPT_LEN];
    fx_prompt(prompt, PROMPT_LEN, 6);
    fx_run *first = new_run(), *other = new_run();
    const uint32_t sizes[] = {16, 1, 3, 128};
    for (size_t s = 0; s < PD_ARRAY_LEN(sizes); s++) {
        uint32_t n_pages = pages_needed(sizes[s]);
        uint32_t *pages = malloc(sizeof(uint32_t) * n_pages);
        fx_iota(pages, n_pages, 0);
        pd_executor ex = fx_exec(m, sizes[s], n_pages, 1, 1);
        fx_run *into = s == 0 ? first : other;
        fx_run_request(&ex, prompt, PROMPT_LEN, 10, pages, n_pages, 0, DECODE, NULL, into);
        if (s > 0) fx_assert_same(first, other);
        pd_model_executor_destroy(&ex);
        free(pages);
    }
    free(other);
    free(first);
    pd_model_destroy(m);
}

static void scrambled_page_placement_gives_identical_output(void **state) {
    (void)state;
    pd_model *m = fx_model("MAMA", 13);
    const uint32_t ps = 4, n_pages = pages_needed(ps), pool = 3 * n_pages;
    pd_executor ex = fx_exec(m, ps, pool, 3, 1);
    int32_t prompt[PROMPT_LEN];
    fx_prompt(prompt, PROMPT_LEN, 7);
    uint32_t packed[64], scrambled[64], perm[3 * 64];
    fx_iota(packed, n_pages, 0);
    /* a random choice of pages across the whole pool, in random order */
    fx_iota(perm, pool, 0);
    pd_rng rng;
    pd_rng_seed(&rng, test_seed(99));
    for (uint32_t i = pool - 1; i > 0; i--) {
        uint32_t j = (uint32_t)pd_rng_below(&rng, i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    memcpy(scrambled, perm, sizeof(uint32_t) * n_pages);
    assert_true(pd_index_runs(scrambled, n_pages) > n_pages / 2);
    fx_run *a = new_run(), *b = new_run();
    fx_run_request(&ex, prompt, PROMPT_LEN, 16, packed, n_pages, 0, DECODE, NULL, a);
    fx_run_request(&ex, prompt, PROMPT_LEN, 16, scrambled, n_pages, 2, DECODE, NULL, b);
    fx_assert_same(a, b);
    free(b);
    free(a);
    pd_model_executor_destroy(&ex);
    pd_model_destroy(m);
}

static void one_and_two_threads_are_bit_identical(void **state) {
    (void)state;
    pd_model *m = fx_model("MAMA", 14);
    const uint32_t ps = 8, n_pages = pages_needed(ps);
    pd_executor one = fx_exec(m, ps, n_pages, 1, 1);
    pd_executor two = fx_exec(m, ps, n_pages, 1, 2);
    pd_model_executor_set_min_parallel_flops(&two, 0); /* split every step */
    int32_t prompt[PROMPT_LEN];
    fx_prompt(prompt, PROMPT_LEN, 8);
    uint32_t pages[64];
    fx_iota(pages, n_pages, 0);
    fx_run *a = new_run(), *b = new_run();
    fx_run_request(&one, prompt, PROMPT_LEN, 32, pages, n_pages, 0, DECODE, NULL, a);
    fx_run_request(&two, prompt, PROMPT_LEN, 32, pages, n_pages, 0, DECODE, NULL, b);
    fx_assert_same(a, b);
    free(b);
    free(a);
    pd_model_executor_destroy(&two);
    pd_model_executor_destroy(&one);
    pd_model_destroy(m);
}

/* Three requests decoded together in one batch per step give what each gives
 * alone, greedy and sampled (the sampled token's generator is seeded by the
 * request's seed and the token's index, not by the batch). */
static void batched_decode_matches_each_request_alone(void **state) {
    (void)state;
    pd_model *m = fx_model("MAMA", 15);
    enum { REQS = 3, LEN = 20, STEPS = 6, PAGES_PER = 4 };
    const uint32_t ps = 8;
    pd_executor ex = fx_exec(m, ps, REQS * PAGES_PER, REQS, 1);
    int32_t prompts[REQS][LEN];
    uint32_t pages[REQS][PAGES_PER];
    pd_sampling sp[REQS] = {{.temperature = 0.0f, .top_p = 1.0f},
                            {.temperature = 0.9f, .top_p = 0.8f, .seed = 41},
                            {.temperature = 1.3f, .top_p = 1.0f, .seed = 42}};
    fx_run *alone[REQS];
    for (int r = 0; r < REQS; r++) {
        fx_prompt(prompts[r], LEN, 100 + (uint64_t)r);
        fx_iota(pages[r], PAGES_PER, (uint32_t)r * PAGES_PER);
        alone[r] = new_run();
        fx_run_request(&ex, prompts[r], LEN, LEN, pages[r], PAGES_PER, (uint32_t)r, STEPS, &sp[r],
                       alone[r]);
    }
    /* again: prefill all three in one batch, then decode them together */
    pd_batch_item items[REQS];
    pd_item_result res[REQS];
    int32_t last[REQS];
    float (*logits)[PD_TOKENIZER_VOCAB] = calloc(REQS, sizeof(*logits));
    for (int r = 0; r < REQS; r++)
        items[r] = (pd_batch_item){.req = (uint64_t)r, .tokens = prompts[r], .n_tokens = LEN,
                                   .start_pos = 0, .pages = pages[r], .n_pages = PAGES_PER,
                                   .mamba_slot = (uint32_t)r, .snapshot_slot = PD_POOL_NONE,
                                   .sample = true, .sampling = sp[r]};
    for (uint32_t k = 0; k <= STEPS; k++) {
        fx_forward(&ex, items, REQS, res, logits[0]);
        for (int r = 0; r < REQS; r++) {
            assert_int_equal(res[r].req, (uint64_t)r);
            assert_int_equal(res[r].token, alone[r]->tokens[k]);
            assert_memory_equal(logits[r], alone[r]->logits[k], sizeof(logits[r]));
            last[r] = res[r].token;
            items[r].tokens = &last[r];
            items[r].n_tokens = 1;
            items[r].start_pos = LEN + k;
            items[r].sample_index = k + 1;
        }
    }
    free(logits);
    for (int r = 0; r < REQS; r++) free(alone[r]);
    pd_model_executor_destroy(&ex);
    pd_model_destroy(m);
}

/* ---- the hand-off ------------------------------------------------------------ */

typedef enum handoff_fault {
    HANDOFF_COMPLETE,
    HANDOFF_NO_CONV_STATE,
    HANDOFF_MISSING_PAGE
} handoff_fault;

/* Prefill on node A, copy the request's pages and Mamba slot into node B at
 * other page ids and another slot, decode on B from A's first token; `local`
 * gets the same decode done on A itself. */
static void handoff(handoff_fault fault, fx_run *local, fx_run *remote) {
    pd_model *m = fx_model("MAMA", 16);
    const pd_model_shape *s = pd_model_shape_get(m);
    const uint32_t ps = 4, n_pages = pages_needed(ps);
    pd_executor a = fx_exec(m, ps, n_pages, 2, 1);
    pd_executor b = fx_exec(m, ps, 2 * n_pages + 5, 6, 1);
    int32_t prompt[PROMPT_LEN];
    fx_prompt(prompt, PROMPT_LEN, 9);
    uint32_t pa[64], pb[64];
    fx_iota(pa, n_pages, 0);
    for (uint32_t i = 0; i < n_pages; i++) pb[i] = 2 * n_pages + 4 - 2 * i; /* descending, spread */
    const uint32_t slot_a = 1, slot_b = 4;

    /* prefill on A: the prompt in chunks, the first token sampled */
    fx_run *prefill = new_run();
    fx_run_request(&a, prompt, PROMPT_LEN, 24, pa, n_pages, slot_a, 0, NULL, prefill);
    const int32_t first = prefill->tokens[0];

    /* the transfer: the prompt's pages, the running slot, the first token */
    pd_exec_memory ma, mb;
    a.vt->memory(a.self, &ma);
    b.vt->memory(b.self, &mb);
    assert_int_equal(ma.kv_page_bytes, mb.kv_page_bytes);
    assert_int_equal(ma.mamba_slot_bytes, mb.mamba_slot_bytes);
    const uint32_t prompt_pages = PD_DIV_CEIL(PROMPT_LEN, ps);
    for (uint32_t i = 0; i < prompt_pages; i++) {
        if (fault == HANDOFF_MISSING_PAGE && i == prompt_pages / 2) continue;
        memcpy((char *)mb.kv + pb[i] * mb.kv_page_bytes, (char *)ma.kv + pa[i] * ma.kv_page_bytes,
               ma.kv_page_bytes);
    }
    char *dst = (char *)mb.mamba + slot_b * mb.mamba_slot_bytes;
    memcpy(dst, (char *)ma.mamba + slot_a * ma.mamba_slot_bytes, ma.mamba_slot_bytes);
    if (fault == HANDOFF_NO_CONV_STATE) {
        size_t layer = s->mamba_conv_bytes_per_layer + s->mamba_ssm_bytes_per_layer;
        for (uint32_t l = 0; l < s->n_mamba; l++)
            memset(dst + l * layer, 0, s->mamba_conv_bytes_per_layer);
    }

    /* decode DECODE tokens from `first` on both nodes */
    fx_run *runs[2] = {local, remote};
    pd_executor *nodes[2] = {&a, &b};
    const uint32_t *tables[2] = {pa, pb};
    const uint32_t slots[2] = {slot_a, slot_b};
    for (int n = 0; n < 2; n++) {
        fx_run *out = runs[n];
        memset(out, 0, sizeof(*out));
        int32_t tok = first;
        pd_batch_item it = {.req = 1, .n_tokens = 1, .pages = tables[n], .n_pages = n_pages,
                            .mamba_slot = slots[n], .snapshot_slot = PD_POOL_NONE, .sample = true};
        for (uint32_t k = 0; k < DECODE; k++) {
            pd_item_result r;
            it.tokens = &tok;
            it.start_pos = PROMPT_LEN + k;
            it.sample_index = k + 1;
            fx_forward(nodes[n], &it, 1, &r, out->logits[k]);
            out->tokens[k] = tok = r.token;
            out->logprobs[k] = r.logprob;
            out->n++;
        }
    }
    free(prefill);
    pd_model_executor_destroy(&b);
    pd_model_executor_destroy(&a);
    pd_model_destroy(m);
}

static void handoff_to_other_pages_and_slot_matches_local_decode(void **state) {
    (void)state;
    fx_run *local = new_run(), *remote = new_run();
    handoff(HANDOFF_COMPLETE, local, remote);
    fx_assert_same(local, remote);
    free(remote);
    free(local);
}

static void handoff_without_conv_state_changes_the_output(void **state) {
    (void)state;
    fx_run *local = new_run(), *remote = new_run();
    handoff(HANDOFF_NO_CONV_STATE, local, remote);
    assert_true(fx_logits_differ(local, remote, 0));
    free(remote);
    free(local);
}

static void handoff_missing_one_page_changes_the_output(void **state) {
    (void)state;
    fx_run *local = new_run(), *remote = new_run();
    handoff(HANDOFF_MISSING_PAGE, local, remote);
    assert_true(fx_logits_differ(local, remote, 0));
    free(remote);
    free(local);
}

/* ---- Mamba slots --------------------------------------------------------------- */

/* A prefix-cache hit: request 1 prefills its first 32 tokens with a snapshot
 * into a track slot, then the rest. Request 2, with the same prompt, reuses
 * the first 32 tokens' pages, copies the snapshot into its own running slot
 * and computes only the rest. Both must agree bit for bit. */
static void snapshot_slot_resumes_like_the_running_state(void **state) {
    (void)state;
    pd_model *m = fx_model("MAMA", 17);
    const uint32_t ps = 8, n_pages = pages_needed(ps), cut = 32;
    pd_executor ex = fx_exec(m, ps, 2 * n_pages, 3, 1);
    int32_t prompt[PROMPT_LEN];
    fx_prompt(prompt, PROMPT_LEN, 10);
    uint32_t p1[64], p2[64];
    fx_iota(p1, n_pages, 0);
    fx_iota(p2, n_pages, n_pages);
    memcpy(p2, p1, sizeof(uint32_t) * (cut / ps)); /* shared prefix pages */
    const uint32_t run1 = 0, track = 1, run2 = 2;

    pd_item_result r1, r2;
    float *l1 = calloc(PD_TOKENIZER_VOCAB, sizeof(float));
    float *l2 = calloc(PD_TOKENIZER_VOCAB, sizeof(float));
    pd_batch_item it = {.req = 1, .tokens = prompt, .n_tokens = cut, .start_pos = 0, .pages = p1,
                        .n_pages = n_pages, .mamba_slot = run1, .snapshot_slot = track};
    fx_forward(&ex, &it, 1, &r1, NULL);
    it = (pd_batch_item){.req = 1, .tokens = prompt + cut, .n_tokens = PROMPT_LEN - cut,
                         .start_pos = cut, .pages = p1, .n_pages = n_pages, .mamba_slot = run1,
                         .snapshot_slot = PD_POOL_NONE, .sample = true};
    fx_forward(&ex, &it, 1, &r1, l1);

    assert_ok(ex.vt->copy_state(ex.self, run2, track));
    it.req = 2;
    it.pages = p2;
    it.mamba_slot = run2;
    fx_forward(&ex, &it, 1, &r2, l2);
    assert_int_equal(r1.token, r2.token);
    assert_memory_equal(l1, l2, sizeof(float) * PD_TOKENIZER_VOCAB);
    /* and the two running slots hold the same state */
    pd_exec_memory mem;
    ex.vt->memory(ex.self, &mem);
    assert_memory_equal((char *)mem.mamba + run1 * mem.mamba_slot_bytes,
                        (char *)mem.mamba + run2 * mem.mamba_slot_bytes, mem.mamba_slot_bytes);
    free(l2);
    free(l1);
    pd_model_executor_destroy(&ex);
    pd_model_destroy(m);
}

static void first_chunk_ignores_stale_slot_contents(void **state) {
    (void)state;
    pd_model *m = fx_model("MAMA", 18);
    const uint32_t ps = 16, n_pages = pages_needed(ps);
    pd_executor ex = fx_exec(m, ps, n_pages, 1, 1);
    int32_t prompt[PROMPT_LEN];
    fx_prompt(prompt, PROMPT_LEN, 11);
    uint32_t pages[64];
    fx_iota(pages, n_pages, 0);
    fx_run *a = new_run(), *b = new_run();
    fx_run_request(&ex, prompt, PROMPT_LEN, 16, pages, n_pages, 0, 2, NULL, a);
    pd_exec_memory mem;
    ex.vt->memory(ex.self, &mem);
    memset(mem.mamba, 0x3f, mem.mamba_slot_bytes); /* 0.747 in every float */
    fx_run_request(&ex, prompt, PROMPT_LEN, 16, pages, n_pages, 0, 2, NULL, b);
    fx_assert_same(a, b);
    free(b);
    free(a);
    pd_model_executor_destroy(&ex);
    pd_model_destroy(m);
}

/* ---- other patterns, long prompts ------------------------------------------------- */

static void attention_only_and_mamba_only_models_are_chunk_invariant(void **state) {
    (void)state;
    const char *patterns[] = {"AA", "MM", "MMMA"};
    for (size_t p = 0; p < PD_ARRAY_LEN(patterns); p++) {
        pd_model *m = fx_model(patterns[p], 19);
        const uint32_t ps = 4, n_pages = pages_needed(ps);
        pd_executor ex = fx_exec(m, ps, n_pages, 1, 1);
        pd_model_info info;
        ex.vt->info(ex.self, &info);
        assert_int_equal(info.has_mamba, strchr(patterns[p], 'M') != NULL);
        int32_t prompt[PROMPT_LEN];
        fx_prompt(prompt, PROMPT_LEN, 12);
        uint32_t pages[64];
        fx_iota(pages, n_pages, 0);
        uint32_t slot = info.has_mamba ? 0 : PD_POOL_NONE;
        fx_run *a = new_run(), *b = new_run();
        fx_run_request(&ex, prompt, PROMPT_LEN, PROMPT_LEN, pages, n_pages, slot, 4, NULL, a);
        fx_run_request(&ex, prompt, PROMPT_LEN, 3, pages, n_pages, slot, 4, NULL, b);
        fx_assert_same(a, b);
        free(b);
        free(a);
        pd_model_executor_destroy(&ex);
        pd_model_destroy(m);
    }
}

/* With the dummy initialisation the residual stream neither explodes nor
 * collapses over a long prompt: the logits stay finite, spread out, and of
 * moderate size at the end of 1,500 tokens. */
static void long_prompt_keeps_activations_in_range(void **state) {
    (void)state;
    enum { LEN = 1500 };
    pd_model *m = fx_model("MAMA", 20);
    const uint32_t ps = 16, n_pages = PD_DIV_CEIL(LEN + 1, ps);
    pd_executor ex = fx_exec(m, ps, n_pages, 1, 1);
    int32_t *prompt = malloc(sizeof(int32_t) * LEN);
    uint32_t *pages = malloc(sizeof(uint32_t) * n_pages);
    fx_prompt(prompt, LEN, 13);
    fx_iota(pages, n_pages, 0);
    fx_run *a = new_run();
    fx_run_request(&ex, prompt, LEN, 256, pages, n_pages, 0, 0, NULL, a);
    double sum = 0, sum2 = 0, max_abs = 0;
    for (uint32_t i = 0; i < PD_TOKENIZER_VOCAB; i++) {
        float v = a->logits[0][i];
        assert_true(isfinite(v));
        sum += v;
        sum2 += (double)v * v;
        if (fabs(v) > max_abs) max_abs = fabs(v);
    }
    double mean = sum / PD_TOKENIZER_VOCAB, sd = sqrt(sum2 / PD_TOKENIZER_VOCAB - mean * mean);
    assert_true(sd > 0.05);
    assert_true(max_abs < 50.0);
    free(a);
    free(pages);
    free(prompt);
    pd_model_executor_destroy(&ex);
    pd_model_destroy(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(chunk_sizes_give_bit_identical_logits_and_tokens),
        cmocka_unit_test(page_size_does_not_change_the_output),
        cmocka_unit_test(scrambled_page_placement_gives_identical_output),
        cmocka_unit_test(one_and_two_threads_are_bit_identical),
        cmocka_unit_test(batched_decode_matches_each_request_alone),
        cmocka_unit_test(handoff_to_other_pages_and_slot_matches_local_decode),
        cmocka_unit_test(handoff_without_conv_state_changes_the_output),
        cmocka_unit_test(handoff_missing_one_page_changes_the_output),
        cmocka_unit_test(snapshot_slot_resumes_like_the_running_state),
        cmocka_unit_test(first_chunk_ignores_stale_slot_contents),
        cmocka_unit_test(attention_only_and_mamba_only_models_are_chunk_invariant),
        cmocka_unit_test(long_prompt_keeps_activations_in_range),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
