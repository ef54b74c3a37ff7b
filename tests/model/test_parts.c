/* The model's small parts: fixed-order kernels, the thread pool, sampling,
 * the byte tokenizer and UTF-8 sanitiser, fp16/bf16 conversions, config
 * validation and the derived sizes. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "../test_util.h"
#include "detmath.h"
#include "model_internal.h"
#include "pdserve/tokenizer.h"

/* ---- kernels ------------------------------------------------------------------- */

/* The four-row product path, the remainder path and mdl_dot agree bit for
 * bit for every length (including lengths that are not lane multiples). */
static void matmul_rows_equal_single_dot_products_bitwise(void **state) {
    (void)state;
    pd_rng rng;
    pd_rng_seed(&rng, test_seed(1));
    pd_threads *tp;
    assert_ok(mdl_threads_create(&tp, 2));
    pd_par one = {NULL, 0}, two = {tp, 0};
    for (uint32_t n_in = 1; n_in <= 70; n_in += 3) {
        const uint32_t rows = 9, n_out = 7;
        float *x = malloc(sizeof(float) * rows * n_in), *w = malloc(sizeof(float) * n_out * n_in);
        float out1[9 * 7], out2[9 * 7];
        for (uint32_t i = 0; i < rows * n_in; i++) x[i] = (float)(pd_rng_unit(&rng) * 2 - 1);
        for (uint32_t i = 0; i < n_out * n_in; i++) w[i] = (float)(pd_rng_unit(&rng) * 2 - 1);
        mdl_matmul(&one, out1, x, w, rows, n_in, n_out);
        mdl_matmul(&two, out2, x, w, rows, n_in, n_out);
        assert_memory_equal(out1, out2, sizeof(out1));
        for (uint32_t t = 0; t < rows; t++)
            for (uint32_t o = 0; o < n_out; o++) {
                float want = mdl_dot(w + o * n_in, x + t * n_in, n_in);
                assert_memory_equal(&out1[t * n_out + o], &want, sizeof(float));
            }
        free(w);
        free(x);
    }
    mdl_threads_destroy(tp);
}

static void dot_product_is_accurate(void **state) {
    (void)state;
    float a[100], b[100];
    double want = 0;
    for (int i = 0; i < 100; i++) {
        a[i] = (float)(i % 7) - 3.0f;
        b[i] = 0.5f * (float)(i % 5);
        want += (double)a[i] * b[i];
    }
    assert_float_equal(mdl_dot(a, b, 100), want, 1e-4);
    assert_float_equal(mdl_dot(a, b, 0), 0.0, 0.0);
}

typedef struct cover {
    uint32_t hits[1000];
    uint32_t workers_seen;
} cover;

static void mark(void *ctx, uint32_t begin, uint32_t end, uint32_t worker) {
    cover *c = ctx;
    for (uint32_t i = begin; i < end; i++) c->hits[i]++;
    if (begin < end) __atomic_fetch_or(&c->workers_seen, 1u << worker, __ATOMIC_RELAXED);
}

static void thread_pool_covers_every_unit_exactly_once(void **state) {
    (void)state;
    pd_threads *tp;
    assert_ok(mdl_threads_create(&tp, 3));
    const uint32_t sizes[] = {1, 2, 3, 7, 1000};
    for (size_t s = 0; s < PD_ARRAY_LEN(sizes); s++) {
        for (int rep = 0; rep < 20; rep++) {
            cover c = {0};
            mdl_threads_run(tp, sizes[s], mark, &c);
            for (uint32_t i = 0; i < sizes[s]; i++) assert_int_equal(c.hits[i], 1);
            if (sizes[s] >= 3) assert_int_equal(c.workers_seen, 7u);
        }
    }
    mdl_threads_destroy(tp);
    assert_err(mdl_threads_create(&tp, 0), PD_ERR_INVALID);
}

/* ---- deterministic math ------------------------------------------------------------ */

static double rel_err(double got, double want) {
    return fabs(got - want) / fmax(fabs(want), 1e-300);
}

/* mdl_exp, mdl_log and mdl_sincos agree with libm to a few double ulps over
 * the ranges the model uses, and handle the edges. */
static void deterministic_math_matches_libm_closely(void **state) {
    (void)state;
    pd_rng rng;
    pd_rng_seed(&rng, test_seed(8));
    double worst_exp = 0, worst_log = 0, worst_trig = 0;
    for (int i = 0; i < 200000; i++) {
        double x = (pd_rng_unit(&rng) * 2 - 1) * 700.0;
        worst_exp = fmax(worst_exp, rel_err(mdl_exp(x), exp(x)));
        double y = ldexp(0.5 + pd_rng_unit(&rng), (int)pd_rng_range(&rng, -1000, 1000));
        worst_log = fmax(worst_log, fabs(mdl_log(y) - log(y)) / fmax(1.0, fabs(log(y))));
        double a = pd_rng_unit(&rng) * 200000.0 * (i % 2 ? 1 : -1), s, c;
        mdl_sincos(a, &s, &c);
        worst_trig = fmax(worst_trig, fmax(fabs(s - sin(a)), fabs(c - cos(a))));
    }
    assert_true(worst_exp < 1e-15);
    assert_true(worst_log < 1e-15);
    assert_true(worst_trig < 1e-13); /* absolute, angles up to 2e5 rad */
    assert_true(mdl_exp(0.0) == 1.0 && mdl_log(1.0) == 0.0);
    assert_true(mdl_exp(-1000.0) == 0.0 && isinf(mdl_exp(1000.0)) && isnan(mdl_exp(NAN)));
    assert_true(isinf(mdl_log(0.0)) && mdl_log(0.0) < 0 && isnan(mdl_log(-1.0)));
    double s, c;
    mdl_sincos(0.0, &s, &c);
    assert_true(s == 0.0 && c == 1.0);
    /* float exp: within one float ulp of libm's */
    for (float x = -80.0f; x < 80.0f; x += 0.37f) {
        float got = mdl_expf(x), want = expf(x);
        assert_true(fabsf(got - want) <= fabsf(want) * 1.2e-7f);
    }
    /* softplus: x above 20, and tiny values keep their digits */
    assert_true(mdl_softplus(25.0f) == 25.0f);
    assert_float_equal(mdl_softplus(-30.0f), exp(-30.0), 1e-20);
    assert_float_equal(mdl_softplus(0.0f), log(2.0), 1e-7);
}

/* ---- sampling --------------------------------------------------------------------- */

/* mdl_sample into a result and a top list filled with garbage first; top
 * NULL: the alternatives go nowhere. */
static pd_item_result sample_top(const float *logits, uint32_t vocab, const pd_sampling *sp,
                                 uint32_t index, const int32_t *history, pd_item_top *top) {
    float probs[64];
    uint64_t keys[64];
    PD_ASSERT(vocab <= 64);
    pd_item_result out;
    memset(&out, 0xA5, sizeof(out));
    if (top) memset(top, 0xA5, sizeof(*top));
    mdl_sample(logits, vocab, sp, index, history, probs, keys, &out, top);
    return out;
}

static pd_item_result sample_with(const float *logits, uint32_t vocab, const pd_sampling *sp,
                                  uint32_t index, const int32_t *history) {
    pd_item_top top;
    return sample_top(logits, vocab, sp, index, history, &top);
}

static void sample(const float *logits, uint32_t vocab, float temperature, float top_p,
                   uint64_t seed, uint32_t index, int32_t *token, float *logprob) {
    pd_sampling sp = {.temperature = temperature, .top_p = top_p, .seed = seed};
    pd_item_result out = sample_with(logits, vocab, &sp, index, NULL);
    assert_int_equal(out.n_top, 0);
    *token = out.token;
    *logprob = out.logprob;
}

/* top_k 2 draws only the two likeliest; min_p 0.5 only those at least half
 * as likely as the first; both over many draws, where without the cut the
 * other tokens do come up. */
static void top_k_and_min_p_cut_the_tail(void **state) {
    (void)state;
    const float logits[5] = {1.0f, 2.0f, 0.5f, 1.9f, 1.8f};
    uint32_t outside_k = 0, outside_minp = 0, plain_other = 0;
    for (uint32_t k = 0; k < 400; k++) {
        pd_sampling sp = {.temperature = 1.0f, .top_p = 1.0f, .seed = 3, .top_k = 2};
        int32_t t = sample_with(logits, 5, &sp, k, NULL).token;
        outside_k += t != 1 && t != 3;
        /* p(3)/p(1) = e^-0.1, p(4)/p(1) = e^-0.2, p(0)/p(1) = e^-1 < 0.5 */
        sp = (pd_sampling){.temperature = 1.0f, .top_p = 1.0f, .seed = 3, .min_p = 0.5f};
        t = sample_with(logits, 5, &sp, k, NULL).token;
        outside_minp += t == 0 || t == 2;
        sp = (pd_sampling){.temperature = 1.0f, .top_p = 1.0f, .seed = 3};
        t = sample_with(logits, 5, &sp, k, NULL).token;
        plain_other += t == 0 || t == 2;
    }
    assert_int_equal(outside_k, 0);
    assert_int_equal(outside_minp, 0);
    assert_true(plain_other > 20);
    /* top_k 1 is greedy whatever the temperature */
    pd_sampling one = {.temperature = 5.0f, .top_p = 1.0f, .seed = 9, .top_k = 1};
    for (uint32_t k = 0; k < 50; k++)
        assert_int_equal(sample_with(logits, 5, &one, k, NULL).token, 1);
}

/* Penalties work on the history: greedy picks token 1 until it was
 * generated; a presence penalty of 2 then moves the choice to 3 (1.9 < 2.0 -
 * 2), a frequency penalty scales with the count, a repetition penalty
 * divides positive logits. The reported logprob stays the raw model's. */
static void penalties_look_at_the_history(void **state) {
    (void)state;
    const float logits[5] = {1.0f, 2.0f, 0.5f, 1.9f, 1.8f};
    const int32_t hist[4] = {1, 1, 3, 1};
    pd_sampling sp = {.top_p = 1.0f, .presence_penalty = 2.0f};
    assert_int_equal(sample_with(logits, 5, &sp, 0, hist).token, 1); /* no history yet */
    pd_item_result r = sample_with(logits, 5, &sp, 1, hist);
    assert_int_equal(r.token, 3);
    pd_item_result raw = sample_with(logits, 5, &(pd_sampling){.top_p = 1.0f}, 0, NULL);
    double z = 0;
    for (int i = 0; i < 5; i++) z += exp(logits[i]);
    assert_float_equal(r.logprob, 1.9 - log(z), 1e-6);
    assert_float_equal(raw.logprob, 2.0 - log(z), 1e-6);
    /* history {1, 1, 3}: frequency 0.1 takes 2.0 - 0.2 = 1.8 for token 1,
     * 1.9 - 0.1 = 1.8 for 3; token 4 keeps 1.8: the first index wins (1) */
    sp = (pd_sampling){.top_p = 1.0f, .frequency_penalty = 0.1f};
    assert_int_equal(sample_with(logits, 5, &sp, 3, hist).token, 1);
    sp.frequency_penalty = 0.15f; /* 1.7 and 1.75 fall below token 4's 1.8 */
    assert_int_equal(sample_with(logits, 5, &sp, 3, hist).token, 4);
    /* repetition 1.2 on {1, 3}: 2.0 / 1.2 = 1.67, 1.9 / 1.2 = 1.58: token 4 */
    sp = (pd_sampling){.top_p = 1.0f, .repetition_penalty = 1.2f};
    assert_int_equal(sample_with(logits, 5, &sp, 3, hist).token, 4);
    /* a repetition penalty of 1 is off */
    sp.repetition_penalty = 1.0f;
    assert_int_equal(sample_with(logits, 5, &sp, 3, hist).token, 1);
    /* the order of the history does not matter */
    const int32_t shuffled[4] = {3, 1, 1, 1};
    sp = (pd_sampling){.temperature = 0.7f,
                       .top_p = 1.0f,
                       .seed = 5,
                       .frequency_penalty = 0.3f,
                       .presence_penalty = 0.2f,
                       .repetition_penalty = 1.1f};
    for (uint32_t k = 0; k < 40; k++) {
        const int32_t a[4] = {hist[0], hist[1], hist[2], (int32_t)(k % 5)};
        const int32_t b[4] = {shuffled[0], shuffled[1], shuffled[2], (int32_t)(k % 5)};
        assert_int_equal(sample_with(logits, 5, &sp, 4, a).token,
                         sample_with(logits, 5, &sp, 4, b).token);
    }
}

/* top_logprobs: the n likeliest of the raw distribution, most likely first,
 * an equal logit at a higher id after; the chosen token need not be among
 * them, and n is capped at the vocabulary. */
static void top_logprobs_list_the_likeliest(void **state) {
    (void)state;
    const float logits[6] = {0.5f, 2.0f, 2.0f, -1.0f, 1.5f, 2.5f};
    double z = 0;
    for (int i = 0; i < 6; i++) z += exp(logits[i]);
    pd_sampling sp = {.top_p = 1.0f, .top_logprobs = 3};
    pd_item_top t;
    pd_item_result r = sample_top(logits, 6, &sp, 0, NULL, &t);
    assert_int_equal(r.token, 5);
    assert_int_equal(r.n_top, 3);
    assert_int_equal(t.token[0], 5);
    assert_int_equal(t.token[1], 1);
    assert_int_equal(t.token[2], 2);
    for (uint32_t i = 0; i < 3; i++)
        assert_float_equal(t.logprob[i], logits[t.token[i]] - log(z), 1e-6);
    sp.top_logprobs = 20;
    r = sample_top(logits, 6, &sp, 0, NULL, &t);
    assert_int_equal(r.n_top, 6);
    assert_int_equal(t.token[5], 3);
    /* nowhere to put them: none, and the same token */
    r = sample_top(logits, 6, &sp, 0, NULL, NULL);
    assert_int_equal(r.n_top, 0);
    assert_int_equal(r.token, 5);
    /* a penalised choice outside the top: still the raw list */
    const int32_t hist[1] = {5};
    sp = (pd_sampling){.top_p = 1.0f, .top_logprobs = 1, .presence_penalty = 2.0f};
    r = sample_top(logits, 6, &sp, 1, hist, &t);
    assert_int_equal(r.token, 1);
    assert_int_equal(r.n_top, 1);
    assert_int_equal(t.token[0], 5);
}

static void greedy_takes_the_first_of_equal_maxima(void **state) {
    (void)state;
    const float logits[6] = {0.5f, 2.0f, -1.0f, 2.0f, 2.0f, 1.0f};
    int32_t tok;
    float lp;
    sample(logits, 6, 0.0f, 1.0f, 0, 0, &tok, &lp);
    assert_int_equal(tok, 1);
    double z = 0;
    for (int i = 0; i < 6; i++) z += exp(logits[i]);
    assert_float_equal(lp, 2.0 - log(z), 1e-6);
}

static void sampled_token_depends_only_on_seed_and_index(void **state) {
    (void)state;
    float logits[32];
    for (int i = 0; i < 32; i++) logits[i] = (float)((i * 37) % 11) * 0.3f;
    int32_t a, b;
    float lp;
    uint32_t changed = 0;
    for (uint32_t k = 0; k < 50; k++) {
        sample(logits, 32, 1.0f, 0.95f, 1234, k, &a, &lp);
        sample(logits, 32, 1.0f, 0.95f, 1234, k, &b, &lp);
        assert_int_equal(a, b);
        int32_t other;
        sample(logits, 32, 1.0f, 0.95f, 9999, k, &other, &lp);
        changed += other != a;
    }
    assert_true(changed > 10); /* another seed is another stream */
}

/* With temperature 1 and no cut, draws follow softmax(logits): 20,000 draws
 * over three tokens land within 1.5 percentage points of the probabilities. */
static void temperature_sampling_follows_the_distribution(void **state) {
    (void)state;
    const float logits[3] = {0.0f, 1.0f, 2.0f};
    double z = 1 + exp(1) + exp(2);
    double want[3] = {1 / z, exp(1) / z, exp(2) / z};
    uint32_t count[3] = {0};
    const uint32_t draws = 20000;
    for (uint32_t k = 0; k < draws; k++) {
        int32_t tok;
        float lp;
        sample(logits, 3, 1.0f, 1.0f, 77, k, &tok, &lp);
        assert_true(tok >= 0 && tok < 3);
        count[tok]++;
        assert_float_equal(lp, logits[tok] - log(z), 1e-5);
    }
    for (int i = 0; i < 3; i++) assert_float_equal((double)count[i] / draws, want[i], 0.015);
}

static void top_p_keeps_only_the_nucleus(void **state) {
    (void)state;
    const float logits[5] = {0.0f, 3.0f, 0.1f, 2.9f, -1.0f};
    /* p(1) ~ 0.50, p(3) ~ 0.45: top_p 0.3 keeps token 1 only, 0.9 keeps 1 and 3 */
    for (uint32_t k = 0; k < 200; k++) {
        int32_t tok;
        float lp;
        sample(logits, 5, 1.0f, 0.3f, 5, k, &tok, &lp);
        assert_int_equal(tok, 1);
        sample(logits, 5, 1.0f, 0.9f, 5, k, &tok, &lp);
        assert_true(tok == 1 || tok == 3);
    }
}

static int by_logit_desc(const void *a, const void *b) {
    const float *x = a, *y = b;
    return (*x < *y) - (*x > *y);
}

/* Over 64 random logits, every token drawn with top_p 0.5 lies in the
 * nucleus computed by brute force, and the draws do spread over it. */
static void top_p_draws_stay_inside_the_brute_force_nucleus(void **state) {
    (void)state;
    enum { V = 64 };
    float logits[V], sorted[V];
    pd_rng rng;
    pd_rng_seed(&rng, test_seed(3));
    for (int i = 0; i < V; i++) logits[i] = (float)(pd_rng_unit(&rng) * 4.0);
    memcpy(sorted, logits, sizeof(sorted));
    qsort(sorted, V, sizeof(float), by_logit_desc);
    double z = 0, mass = 0;
    for (int i = 0; i < V; i++) z += exp(logits[i] - sorted[0]);
    float cutoff = sorted[0];
    for (int i = 0; i < V && mass < 0.5; i++) {
        mass += exp(sorted[i] - sorted[0]) / z;
        cutoff = sorted[i];
    }
    bool seen[V] = {false};
    uint32_t distinct = 0;
    for (uint32_t k = 0; k < 2000; k++) {
        int32_t tok;
        float lp;
        sample(logits, V, 1.0f, 0.5f, 11, k, &tok, &lp);
        assert_true(logits[tok] >= cutoff);
        if (!seen[tok]) distinct++;
        seen[tok] = true;
    }
    assert_true(distinct >= 3);
}

/* ---- tokenizer -------------------------------------------------------------------- */

static void tokenizer_round_trips_every_byte(void **state) {
    (void)state;
    char text[256];
    for (int i = 0; i < 256; i++) text[i] = (char)(255 - i);
    int32_t toks[300];
    size_t n = pd_tokenizer_encode(text, 256, true, toks, 300);
    assert_int_equal(n, 257);
    assert_int_equal(toks[0], PD_TOKEN_BOS);
    for (int i = 0; i < 256; i++) assert_int_equal(toks[i + 1], 255 - i);
    toks[n] = PD_TOKEN_EOS;
    char back[300];
    size_t len = pd_tokenizer_decode(toks, n + 1, back, sizeof(back));
    assert_int_equal(len, 256);
    assert_memory_equal(back, text, 256);
    /* short buffers truncate but report the full length */
    char small[4];
    assert_int_equal(pd_tokenizer_decode(toks, n, small, sizeof(small)), 256);
    assert_int_equal(small[3], '\0');
    assert_int_equal(pd_tokenizer_encode(text, 10, true, toks, 3), 11);
}

static void utf8_sanitize_replaces_only_invalid_bytes(void **state) {
    (void)state;
    char out[64];
    /* valid: ASCII, 2-, 3-, 4-byte sequences */
    const char *ok = "a\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80";
    assert_int_equal(pd_utf8_sanitize(ok, strlen(ok), out, sizeof(out)), strlen(ok));
    assert_string_equal(out, ok);
    /* lone continuation, overlong, surrogate, truncated sequence, NUL */
    const char bad[] = {'x', (char)0x80, (char)0xc0, (char)0xaf, (char)0xed, (char)0xa0, (char)0x80,
                        (char)0xe2, (char)0x82, '\0', 'y'};
    size_t need = pd_utf8_sanitize(bad, sizeof(bad), out, sizeof(out));
    assert_int_equal(need, 2 + 9 * 3); /* x, y and nine replacements */
    assert_memory_equal(out, "x\xef\xbf\xbd", 4);
    assert_int_equal(out[need - 1], 'y');
    /* never splits a character at the end of a short buffer */
    char tiny[5];
    pd_utf8_sanitize("\xe2\x82\xac\xe2\x82\xac", 6, tiny, sizeof(tiny));
    assert_string_equal(tiny, "\xe2\x82\xac");
}

/* ---- fp16 / bf16 --------------------------------------------------------------------- */

static void half_precision_conversions_round_to_nearest_even(void **state) {
    (void)state;
    assert_int_equal(pd_f32_to_f16(1.0f), 0x3c00);
    assert_int_equal(pd_f32_to_f16(-2.5f), 0xc100);
    assert_int_equal(pd_f32_to_f16(65504.0f), 0x7bff);
    assert_int_equal(pd_f32_to_f16(65520.0f), 0x7c00);          /* rounds up to inf */
    assert_int_equal(pd_f32_to_f16(0x1p-24f), 0x0001);          /* smallest subnormal */
    assert_int_equal(pd_f32_to_f16(0x1p-25f), 0x0000);          /* tie to even: zero */
    assert_int_equal(pd_f32_to_f16(0x1.8p-24f), 0x0002);        /* tie to even: two */
    assert_int_equal(pd_f32_to_f16(1.0f + 0x1p-11f), 0x3c00);   /* tie, even stays */
    assert_int_equal(pd_f32_to_f16(1.0f + 0x1.8p-10f), 0x3c02); /* tie, odd rounds up */
    assert_int_equal(pd_f32_to_f16(INFINITY), 0x7c00);
    assert_true((pd_f32_to_f16(NAN) & 0x7c00) == 0x7c00 && (pd_f32_to_f16(NAN) & 0x3ff));
    assert_true(pd_f16_to_f32(0x0001) == 0x1p-24f);
    assert_true(pd_f16_to_f32(0x3555) == 0x1.554p-2f);
    assert_true(isinf(pd_f16_to_f32(0xfc00)) && pd_f16_to_f32(0xfc00) < 0);
    /* every finite half survives a round trip */
    for (uint32_t h = 0; h < 0x10000; h++) {
        if ((h & 0x7c00) == 0x7c00) continue;
        assert_int_equal(pd_f32_to_f16(pd_f16_to_f32((uint16_t)h)), h);
    }
    assert_int_equal(pd_f32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(pd_f32_to_bf16(1.0f + 0x1p-8f), 0x3f80);   /* tie, even stays */
    assert_int_equal(pd_f32_to_bf16(1.0f + 0x1.8p-7f), 0x3f82); /* tie, odd rounds up */
    assert_true(isnan(pd_bf16_to_f32(pd_f32_to_bf16(NAN))));
    assert_true(pd_bf16_to_f32(0xc0a0) == -5.0f);
}

/* ---- config ------------------------------------------------------------------------- */

static void presets_are_valid_and_sizes_follow_the_layout(void **state) {
    (void)state;
    const char *names[] = {"tiny", "small"};
    char msg[200];
    for (size_t i = 0; i < 2; i++) {
        pd_model_config c;
        assert_ok(pd_model_config_preset(&c, names[i], msg, sizeof(msg)));
        assert_ok(pd_model_config_check(&c, msg, sizeof(msg)));
        pd_model_shape s;
        pd_model_config_shape(&c, &s);
        assert_int_equal(s.n_attn + s.n_mamba, strlen(c.layers));
        assert_int_equal(s.kv_bytes_per_token,
                         (size_t)s.n_attn * 2 * c.attn_kv_heads * c.attn_head_dim * 4);
        size_t conv_dim = (size_t)(c.mamba_expand * c.dim + 2 * c.mamba_groups * c.mamba_d_state);
        size_t conv = conv_dim * (c.mamba_d_conv - 1) * 4;
        size_t ssm = (size_t)c.mamba_expand * c.dim * c.mamba_d_state * 4;
        assert_int_equal(s.mamba_slot_bytes, s.n_mamba * (conv + ssm));
        assert_int_equal(pd_model_kv_page_bytes(&c, 16), 16 * s.kv_bytes_per_token);
        pd_model *m;
        assert_ok(pd_model_create_random(&m, &c, 1, msg, sizeof(msg)));
        uint64_t total = 0;
        for (uint32_t t = 0; t < pd_model_tensor_count(m); t++) {
            uint64_t n;
            assert_non_null(pd_model_tensor(m, pd_model_tensor_name(m, t), &n));
            total += n;
        }
        assert_int_equal(total, s.params);
        pd_model_destroy(m);
    }
    pd_model_config c;
    assert_err(pd_model_config_preset(&c, "huge", msg, sizeof(msg)), PD_ERR_INVALID);
    assert_non_null(strstr(msg, "huge"));
}

typedef struct bad_config {
    const char *what;
    void (*mutate)(pd_model_config *c);
} bad_config;

static void m_pattern(pd_model_config *c) { snprintf(c->layers, sizeof(c->layers), "MAXA"); }
static void m_empty(pd_model_config *c) { c->layers[0] = '\0'; }
static void m_kv_heads(pd_model_config *c) { c->attn_kv_heads = 3; }
static void m_head_dim(pd_model_config *c) { c->attn_head_dim = 15; }
static void m_mamba_heads(pd_model_config *c) { c->mamba_heads = 5; }
static void m_groups(pd_model_config *c) { c->mamba_groups = 3; }
static void m_d_conv(pd_model_config *c) { c->mamba_d_conv = 1; }
static void m_vocab(pd_model_config *c) { c->vocab = 1; }
static void m_eps(pd_model_config *c) { c->norm_eps = 0.0f; }
static void m_eos(pd_model_config *c) { c->eos_token = 300; }
static void m_huge(pd_model_config *c) {
    c->dim = 65536;
    c->mlp_hidden = 1u << 18;
    snprintf(c->layers, sizeof(c->layers), "AAAAAAAAAAAAAAAAAAAAAAAA");
}
static void m_rope(pd_model_config *c) { c->rope_base = NAN; }

static void config_check_names_the_inconsistency(void **state) {
    (void)state;
    const bad_config cases[] = {
        {"layer 2 is 'X'", m_pattern},
        {"1 to 64 layers", m_empty},
        {"multiple of attn_kv_heads", m_kv_heads},
        {"must be even", m_head_dim},
        {"not a multiple of mamba_heads", m_mamba_heads},
        {"not a multiple of mamba_groups", m_groups},
        {"mamba_d_conv", m_d_conv},
        {"vocab", m_vocab},
        {"norm_eps", m_eps},
        {"bos/eos", m_eos},
        {"parameters", m_huge},
        {"rope_base", m_rope},
    };
    char msg[200];
    for (size_t i = 0; i < PD_ARRAY_LEN(cases); i++) {
        pd_model_config c;
        assert_ok(pd_model_config_preset(&c, "tiny", msg, sizeof(msg)));
        cases[i].mutate(&c);
        msg[0] = '\0';
        assert_true(pd_model_config_check(&c, msg, sizeof(msg)) != PD_OK);
        if (!strstr(msg, cases[i].what))
            fail_msg("case %zu: message '%s' lacks '%s'", i, msg, cases[i].what);
    }
}

/* Hugging Face config.json: the defaults transformers applies, an eos list's
 * first entry, llama3 rope_scaling; what the forward pass lacks is refused
 * by name. */
#define HF_BASE                                                              \
    "\"vocab_size\": 300, \"hidden_size\": 64, \"intermediate_size\": 128, " \
    "\"num_hidden_layers\": 3, \"num_attention_heads\": 4"

static void hf_config_defaults_and_refusals(void **state) {
    (void)state;
    char msg[256];
    pd_model_config c;
    const char *ok =
        "{\"architectures\": [\"LlamaForCausalLM\"], " HF_BASE
        ", \"eos_token_id\": [299, 298], \"rope_scaling\": {\"rope_type\": \"llama3\", "
        "\"factor\": 8, \"original_max_position_embeddings\": 8192}}";
    assert_ok(pd_model_config_parse(&c, ok, strlen(ok), "c.json", msg, sizeof(msg)));
    assert_int_equal(c.arch, PD_ARCH_LLAMA);
    assert_string_equal(c.layers, "AAA");
    assert_int_equal(c.attn_kv_heads, 4);  /* default: the heads */
    assert_int_equal(c.attn_head_dim, 16); /* default: hidden / heads */
    assert_int_equal(c.eos_token, 299);    /* a list's first */
    assert_int_equal(c.bos_token, -1);
    assert_true(c.rope_base == 10000.0f && c.norm_eps == 1e-6f);
    assert_true(c.rope_factor == 8.0f && c.rope_low_freq_factor == 1.0f &&
                c.rope_high_freq_factor == 4.0f && c.rope_original_max == 8192);
    assert_false(c.tie_embeddings);
    static const struct {
        const char *extra, *what;
    } bad[] = {
        {", \"hidden_act\": \"gelu\"", "'hidden_act' other than silu"},
        {", \"attention_bias\": true", "'attention_bias'"},
        {", \"mlp_bias\": true", "'mlp_bias'"},
        {", \"use_sliding_window\": true", "'use_sliding_window'"},
        {", \"rope_scaling\": {\"type\": \"dynamic\", \"factor\": 2}", "rope_scaling other"},
        {", \"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 0.5, "
         "\"original_max_position_embeddings\": 10}",
         "factor 0.5"},
        {", \"num_key_value_heads\": 3", "multiple of attn_kv_heads"},
        {", \"head_dim\": 7", "must be even"},
        {", \"eos_token_id\": \"x\"", "'eos_token_id' must be a token id"},
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(bad); i++) {
        char text[512];
        snprintf(text, sizeof text, "{\"architectures\": [\"Qwen3ForCausalLM\"], %s%s}", HF_BASE,
                 bad[i].extra);
        msg[0] = '\0';
        assert_true(pd_model_config_parse(&c, text, strlen(text), "c.json", msg, sizeof(msg)) !=
                    PD_OK);
        if (!strstr(msg, bad[i].what)) fail_msg("case %zu: '%s' lacks '%s'", i, msg, bad[i].what);
    }
    const char *other = "{\"architectures\": [\"MistralForCausalLM\"], " HF_BASE "}";
    assert_true(pd_model_config_parse(&c, other, strlen(other), "c.json", msg, sizeof(msg)) !=
                PD_OK);
    assert_non_null(strstr(msg, "MistralForCausalLM is not supported"));
    /* what pdserve writes reads back the same */
    pd_model_config q, back;
    assert_ok(pd_model_config_preset(&q, "qwen3", msg, sizeof(msg)));
    json_t *j = mdl_hf_config_json(&q);
    char *text = json_dumps(j, 0);
    assert_ok(pd_model_config_parse(&back, text, strlen(text), "q.json", msg, sizeof(msg)));
    assert_memory_equal(&q, &back, sizeof(q));
    free(text);
    json_decref(j);
}

/* GraniteMoeHybridForCausalLM: layer_types, shared_intermediate_size, the
 * Mamba2 fields and multipliers; the MoE variants and what the forward pass
 * lacks refused by name; the presets read back as written. */
#define GRANITE_BASE                                                                    \
    "\"architectures\": [\"GraniteMoeHybridForCausalLM\"], " HF_BASE                    \
    ", \"shared_intermediate_size\": 96, \"mamba_n_heads\": 8, \"mamba_d_state\": 16, " \
    "\"mamba_n_groups\": 2"
#define DENSE ", \"num_local_experts\": 0"

static void granite_config_fields_and_refusals(void **state) {
    (void)state;
    char msg[256];
    pd_model_config c;
    const char *ok = "{" GRANITE_BASE DENSE
                     ", \"layer_types\": [\"mamba\", \"attention\", \"mamba\"], "
                     "\"embedding_multiplier\": 12, \"residual_multiplier\": 0.22, "
                     "\"logits_scaling\": 8, \"attention_multiplier\": 0.0078125, "
                     "\"mamba_d_head\": 16, \"position_embedding_type\": \"nope\"}";
    assert_ok(pd_model_config_parse(&c, ok, strlen(ok), "g.json", msg, sizeof(msg)));
    assert_int_equal(c.arch, PD_ARCH_GRANITE);
    assert_string_equal(c.layers, "MAM");
    assert_int_equal(c.mlp_hidden, 96); /* shared_intermediate_size, not intermediate_size */
    assert_int_equal(c.mamba_heads, 8);
    assert_int_equal(c.mamba_expand, 2); /* default */
    assert_int_equal(c.mamba_d_conv, 4); /* default */
    assert_true(c.embed_mult == 12.0f && c.residual_mult == 0.22f && c.logits_div == 8.0f &&
                c.attn_scale == 0.0078125f && c.no_rope);
    const char *all_mamba = "{" GRANITE_BASE DENSE ", \"position_embedding_type\": \"rope\"}";
    assert_ok(pd_model_config_parse(&c, all_mamba, strlen(all_mamba), "g.json", msg, sizeof(msg)));
    assert_string_equal(c.layers, "MMM"); /* no layer_types: all Mamba */
    assert_false(c.no_rope);
    assert_true(c.embed_mult == 1.0f && c.logits_div == 1.0f);
    static const struct {
        const char *extra, *what;
    } bad[] = {
        {", \"num_local_experts\": 4", "num_local_experts 4: mixture-of-experts"},
        {"", "num_local_experts 8"}, /* absent: transformers' default, 8 experts */
        {", \"mamba_proj_bias\": true", "'mamba_proj_bias' true"},
        {", \"mamba_conv_bias\": false", "'mamba_conv_bias' false"},
        {", \"layer_types\": [\"mamba\"]", "'layer_types' must be a list of num_hidden_layers"},
        {", \"layer_types\": [\"mamba\", \"moe\", \"mamba\"]", "layer_types[1]"},
        {", \"mamba_d_head\": 8", "mamba_d_head 8 x mamba_n_heads 8"},
        {", \"position_embedding_type\": \"alibi\"", "position_embedding_type"},
        {", \"residual_multiplier\": 0", "must be finite and > 0"},
        {", \"logits_scaling\": -1", "must be finite and > 0"},
        {", \"mamba_d_conv\": 1", "mamba_d_conv = 1 is outside"},
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(bad); i++) {
        char text[768];
        snprintf(text, sizeof text, "{%s%s%s}", GRANITE_BASE, bad[i].extra,
                 strstr(bad[i].extra, "experts") || !bad[i].extra[0] ? "" : DENSE);
        msg[0] = '\0';
        assert_true(pd_model_config_parse(&c, text, strlen(text), "g.json", msg, sizeof(msg)) !=
                    PD_OK);
        if (!strstr(msg, bad[i].what)) fail_msg("case %zu: '%s' lacks '%s'", i, msg, bad[i].what);
    }
    static const char *const presets[] = {"granite", "granite-4.0-h-350m", "qwen3-0.6b"};
    for (size_t i = 0; i < PD_ARRAY_LEN(presets); i++) {
        pd_model_config g, back;
        assert_ok(pd_model_config_preset(&g, presets[i], msg, sizeof(msg)));
        json_t *j = mdl_hf_config_json(&g);
        char *text = json_dumps(j, 0);
        assert_ok(pd_model_config_parse(&back, text, strlen(text), "g.json", msg, sizeof(msg)));
        assert_memory_equal(&g, &back, sizeof(g));
        free(text);
        json_decref(j);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(hf_config_defaults_and_refusals),
        cmocka_unit_test(granite_config_fields_and_refusals),
        cmocka_unit_test(matmul_rows_equal_single_dot_products_bitwise),
        cmocka_unit_test(dot_product_is_accurate),
        cmocka_unit_test(thread_pool_covers_every_unit_exactly_once),
        cmocka_unit_test(deterministic_math_matches_libm_closely),
        cmocka_unit_test(greedy_takes_the_first_of_equal_maxima),
        cmocka_unit_test(sampled_token_depends_only_on_seed_and_index),
        cmocka_unit_test(temperature_sampling_follows_the_distribution),
        cmocka_unit_test(top_p_keeps_only_the_nucleus),
        cmocka_unit_test(top_k_and_min_p_cut_the_tail),
        cmocka_unit_test(penalties_look_at_the_history),
        cmocka_unit_test(top_logprobs_list_the_likeliest),
        cmocka_unit_test(top_p_draws_stay_inside_the_brute_force_nucleus),
        cmocka_unit_test(tokenizer_round_trips_every_byte),
        cmocka_unit_test(utf8_sanitize_replaces_only_invalid_bytes),
        cmocka_unit_test(half_precision_conversions_round_to_nearest_even),
        cmocka_unit_test(presets_are_valid_and_sizes_follow_the_layout),
        cmocka_unit_test(config_check_names_the_inconsistency),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
