/* The fixed-order kernels (src/model/kernels.c): the AVX2 and the portable
 * code give the same bits, both follow the order kernels.h documents, and
 * neither the tile an output falls in, the number of rows computed together,
 * the term blocks nor the thread count changes a bit. bf16 weights give
 * exactly what their f32 widening gives. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "../test_util.h"
#include "kernels.h"
#include "model_fixture.h"
#include "pdserve/safetensors.h"

/* kernels.h's definition, transcribed term by term. */
static float spec_dot(const float *a, const float *b, uint32_t n) {
    float l[8] = {0};
    for (uint32_t i = 0; i < n; i++) l[i % 8] = fmaf(a[i], b[i], l[i % 8]);
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

/* Values over 16 binades, so that a different order of the terms would
 * almost surely change the rounded sum. */
static void fill_spread(pd_rng *rng, float *v, size_t n) {
    for (size_t i = 0; i < n; i++)
        v[i] = (float)((pd_rng_unit(rng) * 2 - 1) * ldexp(1.0, (int)pd_rng_below(rng, 16) - 8));
}

static void paths_note(void) {
    if (strcmp(mdl_kernels_path(), "avx2") != 0)
        print_message("no AVX2+FMA here: both runs take the portable code\n");
}

static void dot_follows_the_documented_order_on_both_paths(void **state) {
    (void)state;
    paths_note();
    pd_rng rng;
    pd_rng_seed(&rng, test_seed(11));
    const uint32_t long_n[] = {255, 513, 1031, 4099};
    float *a = malloc(sizeof(float) * 4099), *b = malloc(sizeof(float) * 4099);
    for (uint32_t c = 0; c < 81 + PD_ARRAY_LEN(long_n); c++) {
        uint32_t n = c <= 80 ? c : long_n[c - 81];
        fill_spread(&rng, a, n);
        fill_spread(&rng, b, n);
        const uint32_t want = bits(spec_dot(a, b, n));
        for (int portable = 0; portable < 2; portable++) {
            mdl_kernels_force_portable(portable);
            if (bits(mdl_dot(a, b, n)) != want)
                fail_msg("mdl_dot n=%u (%s) is not the documented order", n, mdl_kernels_path());
        }
    }
    mdl_kernels_force_portable(false);
    free(b);
    free(a);
}

/* A lane that holds -0 keeps it when the vector's tail does not reach it:
 * tails are not padded with 0 * 0 terms (which would give +0). */
static void negative_zero_lanes_survive_the_tail(void **state) {
    (void)state;
    float a[12], b[12], out[4 * 5];
    uint16_t w16[5 * 12];
    for (int i = 0; i < 12; i++) a[i] = -ldexpf(1, -100), b[i] = ldexpf(1, -100);
    for (int i = 0; i < 5 * 12; i++) w16[i] = pd_f32_to_bf16(-ldexpf(1, -100));
    float x[4 * 12], w[5 * 12];
    for (int i = 0; i < 4 * 12; i++) x[i] = b[i % 12];
    for (int i = 0; i < 5 * 12; i++) w[i] = a[i % 12];
    assert_int_equal(bits(spec_dot(a, b, 12)), 0x80000000u);
    pd_par one = {NULL, 0};
    for (int portable = 0; portable < 2; portable++) {
        mdl_kernels_force_portable(portable);
        assert_int_equal(bits(mdl_dot(a, b, 12)), 0x80000000u);
        for (uint32_t rows = 1; rows <= 4; rows++)
            for (uint32_t n_out = 1; n_out <= 5; n_out++)
                for (int bf16 = 0; bf16 < 2; bf16++) {
                    if (bf16) mdl_matmul_bf16(&one, out, x, w16, rows, 12, n_out);
                    else mdl_matmul(&one, out, x, w, rows, 12, n_out);
                    for (uint32_t i = 0; i < rows * n_out; i++)
                        assert_int_equal(bits(out[i]), 0x80000000u);
                }
    }
    mdl_kernels_force_portable(false);
}

typedef struct shape {
    uint32_t rows, n_in, n_out;
} shape;

/* out[t][o] of every way of computing the product is mdl_dot's definition:
 * both paths, 1 and 2 threads (pieces that split tiles), f32 and bf16. */
static void check_product(pd_rng *rng, pd_threads *tp, shape s) {
    const size_t nx = (size_t)s.rows * s.n_in, nw = (size_t)s.n_out * s.n_in;
    const size_t no = (size_t)s.rows * s.n_out;
    float *x = malloc(sizeof(float) * nx), *w = malloc(sizeof(float) * nw);
    float *want = malloc(sizeof(float) * no), *got = malloc(sizeof(float) * no);
    uint16_t *w16 = malloc(sizeof(uint16_t) * nw);
    fill_spread(rng, x, nx);
    fill_spread(rng, w, nw);
    for (int bf16 = 0; bf16 < 2; bf16++) {
        if (bf16) /* w becomes the exact widening of w16 */
            for (size_t i = 0; i < nw; i++)
                w16[i] = pd_f32_to_bf16(w[i]), w[i] = pd_bf16_to_f32(w16[i]);
        for (uint32_t t = 0; t < s.rows; t++)
            for (uint32_t o = 0; o < s.n_out; o++)
                want[(size_t)t * s.n_out + o] =
                    spec_dot(w + (size_t)o * s.n_in, x + (size_t)t * s.n_in, s.n_in);
        for (int run = 0; run < 4; run++) {
            pd_par par = {run & 1 ? tp : NULL, 0};
            mdl_kernels_force_portable(run >= 2);
            memset(got, 0xff, sizeof(float) * no);
            if (bf16) mdl_matmul_bf16(&par, got, x, w16, s.rows, s.n_in, s.n_out);
            else mdl_matmul(&par, got, x, w, s.rows, s.n_in, s.n_out);
            for (size_t i = 0; i < no; i++)
                if (bits(got[i]) != bits(want[i]))
                    fail_msg("%s rows=%u n_in=%u n_out=%u %s, %s thread(s): out[%zu][%zu] "
                             "differs",
                             bf16 ? "bf16" : "f32", s.rows, s.n_in, s.n_out, mdl_kernels_path(),
                             run & 1 ? "2" : "1", i / s.n_out, i % s.n_out);
        }
    }
    mdl_kernels_force_portable(false);
    free(w16);
    free(got);
    free(want);
    free(w);
    free(x);
}

static void matmul_is_every_output_in_the_fixed_order(void **state) {
    (void)state;
    paths_note();
    pd_rng rng;
    pd_rng_seed(&rng, test_seed(12));
    pd_threads *tp;
    assert_ok(mdl_threads_create(&tp, 2));
    /* n_in under, at and around the lane count, and across term blocks */
    const uint32_t small_in[] = {1, 3, 7, 8, 9, 17, 64, 100};
    /* odd counts, and enough 8-output decode groups to prefetch the next */
    const uint32_t n_out[] = {1, 5, 13, 41};
    for (size_t i = 0; i < PD_ARRAY_LEN(small_in); i++)
        for (uint32_t rows = 1; rows <= 70; rows++)
            check_product(&rng, tp, (shape){rows, small_in[i], n_out[rows % 4]});
    const uint32_t big_in[] = {511, 513, 1100};
    const uint32_t some_rows[] = {1, 2, 3, 4, 5, 7, 10, 16, 63, 64, 65, 70};
    for (size_t i = 0; i < PD_ARRAY_LEN(big_in); i++)
        for (size_t r = 0; r < PD_ARRAY_LEN(some_rows); r++)
            check_product(&rng, tp, (shape){some_rows[r], big_in[i], n_out[r % 4] + 2});
    mdl_threads_destroy(tp);
}

static void rmsnorm_is_the_same_on_both_paths(void **state) {
    (void)state;
    pd_rng rng;
    pd_rng_seed(&rng, test_seed(13));
    const uint32_t sizes[] = {1, 5, 8, 13, 64, 100, 1027};
    for (size_t s = 0; s < PD_ARRAY_LEN(sizes); s++) {
        const uint32_t n = sizes[s];
        float *x = malloc(sizeof(float) * n), *w = malloc(sizeof(float) * n);
        float *a = malloc(sizeof(float) * n), *b = malloc(sizeof(float) * n);
        fill_spread(&rng, x, n);
        fill_spread(&rng, w, n);
        mdl_rmsnorm(a, x, w, n, 1e-6f);
        mdl_kernels_force_portable(true);
        mdl_rmsnorm(b, x, w, n, 1e-6f);
        mdl_kernels_force_portable(false);
        assert_memory_equal(a, b, sizeof(float) * n);
        free(b);
        free(a);
        free(w);
        free(x);
    }
}

/* The whole forward pass, prefill in chunks then decode, on each path. */
static void forward_is_the_same_on_both_paths(void **state) {
    (void)state;
    paths_note();
    pd_model *m = fx_model("MAMA", 5);
    int32_t prompt[21];
    fx_prompt(prompt, 21, 3);
    uint32_t pages[8];
    fx_iota(pages, 8, 0);
    fx_run *runs = calloc(2, sizeof(fx_run));
    for (int portable = 0; portable < 2; portable++) {
        mdl_kernels_force_portable(portable);
        pd_executor ex = fx_exec(m, 16, 8, 2, 2);
        pd_model_executor_set_min_parallel_flops(&ex, 0);
        fx_run_request(&ex, prompt, 21, 8, pages, 8, 1, 6, NULL, &runs[portable]);
        pd_model_executor_destroy(&ex);
    }
    mdl_kernels_force_portable(false);
    fx_assert_same(&runs[0], &runs[1]);
    free(runs);
    pd_model_destroy(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(dot_follows_the_documented_order_on_both_paths),
        cmocka_unit_test(negative_zero_lanes_survive_the_tail),
        cmocka_unit_test(matmul_is_every_output_in_the_fixed_order),
        cmocka_unit_test(rmsnorm_is_the_same_on_both_paths),
        cmocka_unit_test(forward_is_the_same_on_both_paths),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
