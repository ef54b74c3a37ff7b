/* The Mamba2 mixer against a slow, obviously-correct reference of the same
 * formulas (double precision, one token at a time, every step spelled out),
 * on random weights, inputs and initial states, for several shapes
 * (grouped B/C, odd state sizes, short and long convolutions). Plus the
 * bitwise properties the engine relies on: rows computed together or one at
 * a time, on one thread or two, give the same bits. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "../test_util.h"
#include "model_internal.h"

#define TOKENS 24

typedef struct layer {
    pd_mamba2_dims d;
    float *in_proj, *conv_w, *conv_b, *dt_bias, *a_log, *dskip, *norm, *out_proj;
    pd_mamba2_weights w;
} layer;

static float unif(pd_rng *rng, double lo, double hi) {
    return (float)(lo + (hi - lo) * pd_rng_unit(rng));
}

static float *rand_vec(pd_rng *rng, size_t n, double lo, double hi) {
    float *v = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) v[i] = unif(rng, lo, hi);
    return v;
}

static layer make_layer(uint32_t dim, uint32_t expand, uint32_t heads, uint32_t groups,
                        uint32_t d_state, uint32_t d_conv, uint64_t seed) {
    layer L;
    pd_model_config cfg = {.dim = dim, .mamba_expand = expand, .mamba_heads = heads,
                           .mamba_groups = groups, .mamba_d_state = d_state,
                           .mamba_d_conv = d_conv, .norm_eps = 1e-5f};
    mdl_mamba2_dims_from_config(&cfg, &L.d);
    pd_rng rng;
    pd_rng_seed(&rng, seed);
    const pd_mamba2_dims *d = &L.d;
    L.in_proj = rand_vec(&rng, (size_t)d->in_proj * dim, -1.0 / sqrt(dim), 1.0 / sqrt(dim));
    L.conv_w = rand_vec(&rng, (size_t)d->conv_dim * d_conv, -0.5, 0.5);
    L.conv_b = rand_vec(&rng, d->conv_dim, -0.5, 0.5);
    L.dt_bias = malloc(sizeof(float) * heads);
    L.a_log = malloc(sizeof(float) * heads);
    for (uint32_t h = 0; h < heads; h++) {
        double dt = exp(log(1e-3) + pd_rng_unit(&rng) * (log(0.1) - log(1e-3)));
        L.dt_bias[h] = (float)(dt + log(-expm1(-dt)));
        L.a_log[h] = (float)log(1.0 + 15.0 * pd_rng_unit(&rng));
    }
    L.dskip = rand_vec(&rng, heads, 0.5, 1.5);
    L.norm = rand_vec(&rng, d->d_inner, 0.5, 1.5);
    L.out_proj = rand_vec(&rng, (size_t)dim * d->d_inner, -1.0 / sqrt(d->d_inner),
                          1.0 / sqrt(d->d_inner));
    L.w = (pd_mamba2_weights){{L.in_proj, NULL}, L.conv_w, L.conv_b, L.dt_bias,
                              L.a_log,           L.dskip,  L.norm,   {L.out_proj, NULL}};
    return L;
}

static void free_layer(layer *L) {
    free(L->in_proj);
    free(L->conv_w);
    free(L->conv_b);
    free(L->dt_bias);
    free(L->a_log);
    free(L->dskip);
    free(L->norm);
    free(L->out_proj);
}

/* ---- the reference ------------------------------------------------------------ */

typedef enum ref_variant { REF_EXACT, REF_WITHOUT_D_SKIP } ref_variant;

static double silu(double x) { return x / (1.0 + exp(-x)); }
static double softplus(double x) { return x > 20.0 ? x : log1p(exp(x)); }

/* One token through the layer. hist[c][k]: the last d_conv - 1 raw conv
 * inputs of channel c, oldest first; S[h][p][n] the ssm state. */
static void ref_token(const layer *L, const float *u, double *hist, double *S, double *out,
                      ref_variant v) {
    const pd_mamba2_dims *d = &L->d;
    const uint32_t K = d->d_conv, N = d->d_state, P = d->head_dim, G = d->groups;
    double *proj = calloc(d->in_proj, sizeof(double));
    double *xbc = calloc(d->conv_dim, sizeof(double));
    double *y = calloc(d->d_inner, sizeof(double));
    for (uint32_t o = 0; o < d->in_proj; o++)
        for (uint32_t i = 0; i < d->dim; i++)
            proj[o] += (double)L->in_proj[(size_t)o * d->dim + i] * u[i];
    const double *z = proj, *raw = proj + d->d_inner, *dt_raw = proj + d->d_inner + d->conv_dim;

    for (uint32_t c = 0; c < d->conv_dim; c++) {
        double *h = hist + (size_t)c * (K - 1);
        double acc = L->conv_b[c];
        for (uint32_t k = 0; k < K - 1; k++) acc += (double)L->conv_w[(size_t)c * K + k] * h[k];
        acc += (double)L->conv_w[(size_t)c * K + K - 1] * raw[c];
        for (uint32_t k = 0; k + 1 < K - 1; k++) h[k] = h[k + 1];
        h[K - 2] = raw[c];
        xbc[c] = silu(acc);
    }
    const double *x = xbc, *B = xbc + d->d_inner, *C = xbc + d->d_inner + (size_t)G * N;
    for (uint32_t h = 0; h < d->heads; h++) {
        uint32_t g = h / (d->heads / G);
        double dt = softplus(dt_raw[h] + L->dt_bias[h]);
        double A = -exp((double)L->a_log[h]);
        for (uint32_t p = 0; p < P; p++) {
            double acc = 0;
            for (uint32_t n = 0; n < N; n++) {
                double *s = &S[((size_t)h * P + p) * N + n];
                *s = *s * exp(dt * A) + dt * B[(size_t)g * N + n] * x[h * P + p];
                acc += *s * C[(size_t)g * N + n];
            }
            y[h * P + p] = acc + (v == REF_WITHOUT_D_SKIP ? 0.0 : L->dskip[h] * x[h * P + p]);
        }
    }
    uint32_t gs = d->d_inner / G;
    for (uint32_t i = 0; i < d->d_inner; i++) y[i] *= silu(z[i]);
    for (uint32_t g = 0; g < G; g++) {
        double ms = 0;
        for (uint32_t i = 0; i < gs; i++) ms += y[g * gs + i] * y[g * gs + i];
        double inv = 1.0 / sqrt(ms / gs + d->eps);
        for (uint32_t i = 0; i < gs; i++) y[g * gs + i] = y[g * gs + i] * inv * L->norm[g * gs + i];
    }
    for (uint32_t o = 0; o < d->dim; o++) {
        out[o] = 0;
        for (uint32_t i = 0; i < d->d_inner; i++)
            out[o] += (double)L->out_proj[(size_t)o * d->d_inner + i] * y[i];
    }
    free(y);
    free(xbc);
    free(proj);
}

/* ---- running the real layer ----------------------------------------------------- */

typedef struct run {
    float *out;                 /* [TOKENS][dim] */
    float *state;               /* the layer state after the last token */
} run;

/* Runs TOKENS tokens through mdl_mamba2_forward in pieces of `rows`, starting
 * from init (a layer state), on `threads` threads. */
static run run_layer(const layer *L, const float *in, const float *init, uint32_t rows,
                     uint32_t threads) {
    const pd_mamba2_dims *d = &L->d;
    size_t sf = mdl_mamba2_state_floats(d);
    run r = {malloc(sizeof(float) * TOKENS * d->dim), malloc(sizeof(float) * sf)};
    memcpy(r.state, init, sizeof(float) * sf);
    float *mem = malloc(sizeof(float) * mdl_mamba2_scratch_floats(d, rows));
    pd_mamba2_scratch s;
    mdl_mamba2_scratch_bind(&s, d, rows, mem);
    pd_threads *tp;
    assert_ok(mdl_threads_create(&tp, threads));
    pd_par par = {tp, 0};
    float *states[TOKENS];
    for (uint32_t t = 0; t < TOKENS; t++) states[t] = r.state;
    for (uint32_t t = 0; t < TOKENS; t += rows) {
        uint32_t n = PD_MIN(rows, TOKENS - t);
        mdl_mamba2_forward(&par, d, &L->w, in + (size_t)t * d->dim, r.out + (size_t)t * d->dim, n,
                           states, &s);
    }
    mdl_threads_destroy(tp);
    free(mem);
    return r;
}

static void free_run(run *r) {
    free(r->out);
    free(r->state);
}

typedef struct shape {
    uint32_t dim, expand, heads, groups, d_state, d_conv;
} shape;

static const shape shapes[] = {
    {24, 2, 6, 3, 5, 4},   /* three groups, odd d_state (dot-product tail) */
    {16, 1, 2, 1, 20, 2},  /* shortest convolution: one remembered input */
    {32, 2, 4, 2, 16, 3},
    {8, 3, 3, 3, 33, 5},
};

/* Largest |real - reference| over outputs and final state, relative to
 * max(1, |reference|). */
static double compare_with_reference(const layer *L, const float *in, const float *init,
                                     ref_variant v, const run *real) {
    const pd_mamba2_dims *d = &L->d;
    const size_t conv_floats = (size_t)d->conv_dim * (d->d_conv - 1);
    const size_t sf = mdl_mamba2_state_floats(d);
    double *hist = malloc(sizeof(double) * (conv_floats ? conv_floats : 1));
    double *S = malloc(sizeof(double) * (sf - conv_floats));
    double *out = malloc(sizeof(double) * d->dim);
    for (size_t i = 0; i < conv_floats; i++) hist[i] = init[i];
    for (size_t i = conv_floats; i < sf; i++) S[i - conv_floats] = init[i];
    double worst = 0;
    for (uint32_t t = 0; t < TOKENS; t++) {
        ref_token(L, in + (size_t)t * d->dim, hist, S, out, v);
        for (uint32_t o = 0; o < d->dim; o++) {
            double e = fabs(real->out[(size_t)t * d->dim + o] - out[o]) / fmax(1.0, fabs(out[o]));
            if (e > worst) worst = e;
        }
    }
    for (size_t i = 0; i < sf; i++) {
        double want = i < conv_floats ? hist[i] : S[i - conv_floats];
        double e = fabs(real->state[i] - want) / fmax(1.0, fabs(want));
        if (e > worst) worst = e;
    }
    free(out);
    free(S);
    free(hist);
    return worst;
}

static void random_case(const shape *sh, uint64_t seed, layer *L, float **in, float **init) {
    *L = make_layer(sh->dim, sh->expand, sh->heads, sh->groups, sh->d_state, sh->d_conv, seed);
    pd_rng rng;
    pd_rng_seed(&rng, seed ^ 0xabcdef);
    *in = rand_vec(&rng, (size_t)TOKENS * sh->dim, -2.0, 2.0);
    *init = rand_vec(&rng, mdl_mamba2_state_floats(&L->d), -1.0, 1.0);
}

/* float vs double over 24 tokens stays below 1e-6 here; a wrong formula is
 * off by order 1. */
#define TOLERANCE 1e-5

static void mamba2_layer_matches_slow_reference(void **state) {
    (void)state;
    for (size_t c = 0; c < PD_ARRAY_LEN(shapes); c++) {
        layer L;
        float *in, *init;
        random_case(&shapes[c], test_seed(1000) + c, &L, &in, &init);
        run r = run_layer(&L, in, init, 7, 1);
        double err = compare_with_reference(&L, in, init, REF_EXACT, &r);
        if (err > TOLERANCE) fail_msg("shape %zu: relative error %g", c, err);
        free_run(&r);
        free(init);
        free(in);
        free_layer(&L);
    }
}

/* The comparison above is sharp enough to see a missing term: the same
 * check against a reference without the D skip fails for every shape. */
static void reference_check_detects_a_missing_term(void **state) {
    (void)state;
    for (size_t c = 0; c < PD_ARRAY_LEN(shapes); c++) {
        layer L;
        float *in, *init;
        random_case(&shapes[c], test_seed(1000) + c, &L, &in, &init);
        run r = run_layer(&L, in, init, 7, 1);
        double err = compare_with_reference(&L, in, init, REF_WITHOUT_D_SKIP, &r);
        if (err <= 100 * TOLERANCE) fail_msg("shape %zu: wrong reference only %g away", c, err);
        free_run(&r);
        free(init);
        free(in);
        free_layer(&L);
    }
}

static void rows_together_or_one_at_a_time_give_identical_bits(void **state) {
    (void)state;
    for (size_t c = 0; c < PD_ARRAY_LEN(shapes); c++) {
        layer L;
        float *in, *init;
        random_case(&shapes[c], 2000 + c, &L, &in, &init);
        run whole = run_layer(&L, in, init, TOKENS, 1);
        const uint32_t pieces[] = {1, 3, 5};
        for (size_t p = 0; p < PD_ARRAY_LEN(pieces); p++) {
            run part = run_layer(&L, in, init, pieces[p], 1);
            assert_memory_equal(whole.out, part.out, sizeof(float) * TOKENS * L.d.dim);
            assert_memory_equal(whole.state, part.state,
                                sizeof(float) * mdl_mamba2_state_floats(&L.d));
            free_run(&part);
        }
        run two = run_layer(&L, in, init, 4, 2);
        assert_memory_equal(whole.out, two.out, sizeof(float) * TOKENS * L.d.dim);
        assert_memory_equal(whole.state, two.state, sizeof(float) * mdl_mamba2_state_floats(&L.d));
        free_run(&two);
        free_run(&whole);
        free(init);
        free(in);
        free_layer(&L);
    }
}

/* The conv part of the state is exactly the last d_conv - 1 raw inputs of
 * each channel, oldest first: the in_proj outputs of the last tokens. */
static void conv_state_holds_the_last_raw_inputs_oldest_first(void **state) {
    (void)state;
    const shape *sh = &shapes[2];
    layer L;
    float *in, *init;
    random_case(sh, 3000, &L, &in, &init);
    run r = run_layer(&L, in, init, TOKENS, 1);
    const pd_mamba2_dims *d = &L.d;
    const uint32_t K = d->d_conv;
    for (uint32_t c = 0; c < d->conv_dim; c++) {
        for (uint32_t k = 0; k < K - 1; k++) {
            uint32_t t = TOKENS - (K - 1) + k;
            /* raw input of channel c at token t: row d_inner + c of in_proj */
            float want = mdl_dot(L.in_proj + (size_t)(d->d_inner + c) * d->dim,
                                 in + (size_t)t * d->dim, d->dim);
            assert_memory_equal(&r.state[(size_t)c * (K - 1) + k], &want, sizeof(float));
        }
    }
    free_run(&r);
    free(init);
    free(in);
    free_layer(&L);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(mamba2_layer_matches_slow_reference),
        cmocka_unit_test(reference_check_detects_a_missing_term),
        cmocka_unit_test(rows_together_or_one_at_a_time_give_identical_bits),
        cmocka_unit_test(conv_state_holds_the_last_raw_inputs_oldest_first),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
