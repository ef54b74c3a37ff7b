/*
 * kernels.c — the fixed-order numeric kernels. See kernels.h for why the
 * order is fixed.
 *
 * mdl_matmul works on tiles: two weight rows against four input rows at a
 * time (eight running sums, each a 4-lane vector; every weight and input
 * vector loaded is used two or four times), four weight rows against one
 * input row for the rows left over (the decode case), and mdl_dot for the
 * rest. Each output is produced by the same lane assignment and reduction
 * as mdl_dot, so it does not depend on which tile it fell in; the test suite
 * checks that equality bit for bit.
 */
#include "kernels.h"
#include "detmath.h"

#include <math.h>
#include <string.h>

typedef float v4 __attribute__((vector_size(16)));

static inline v4 load4(const float *p) {
    v4 v;
    memcpy(&v, p, sizeof(v)); /* unaligned load */
    return v;
}

/* The one reduction of the four lanes. */
static inline float fold(v4 a) { return (a[0] + a[2]) + (a[1] + a[3]); }

void mdl_par_run(const pd_par *par, uint32_t units, uint64_t flops, pd_task_fn fn, void *ctx) {
    if (par->tp && mdl_threads_count(par->tp) > 1 && flops >= par->min_flops)
        mdl_threads_run(par->tp, units, fn, ctx);
    else if (units > 0)
        fn(ctx, 0, units, 0);
}

float mdl_dot(const float *a, const float *b, uint32_t n) {
    v4 acc = {0, 0, 0, 0};
    uint32_t i = 0;
    for (; i + 4 <= n; i += 4) acc += load4(a + i) * load4(b + i);
    for (; i < n; i++) acc[i % 4] += a[i] * b[i];
    return fold(acc);
}

/* w0, w1 against x0..x3: out0[r] = mdl_dot(w0, xr), out1[r] = mdl_dot(w1, xr). */
static void tile_2x4(const float *w0, const float *w1, const float *x0, const float *x1,
                     const float *x2, const float *x3, uint32_t n, float *out0, float *out1) {
    v4 a0 = {0, 0, 0, 0}, a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
    uint32_t i = 0;
    for (; i + 4 <= n; i += 4) {
        v4 u = load4(w0 + i), v = load4(w1 + i);
        v4 p = load4(x0 + i), q = load4(x1 + i), r = load4(x2 + i), s = load4(x3 + i);
        a0 += u * p;
        a1 += u * q;
        a2 += u * r;
        a3 += u * s;
        b0 += v * p;
        b1 += v * q;
        b2 += v * r;
        b3 += v * s;
    }
    for (; i < n; i++) {
        uint32_t j = i % 4;
        a0[j] += w0[i] * x0[i];
        a1[j] += w0[i] * x1[i];
        a2[j] += w0[i] * x2[i];
        a3[j] += w0[i] * x3[i];
        b0[j] += w1[i] * x0[i];
        b1[j] += w1[i] * x1[i];
        b2[j] += w1[i] * x2[i];
        b3[j] += w1[i] * x3[i];
    }
    out0[0] = fold(a0), out0[1] = fold(a1), out0[2] = fold(a2), out0[3] = fold(a3);
    out1[0] = fold(b0), out1[1] = fold(b1), out1[2] = fold(b2), out1[3] = fold(b3);
}

/* w0..w3 against x: out[k] = mdl_dot(wk, x). */
static void tile_4x1(const float *w0, const float *w1, const float *w2, const float *w3,
                     const float *x, uint32_t n, float *out) {
    v4 a0 = {0, 0, 0, 0}, a1 = a0, a2 = a0, a3 = a0;
    uint32_t i = 0;
    for (; i + 4 <= n; i += 4) {
        v4 p = load4(x + i);
        a0 += load4(w0 + i) * p;
        a1 += load4(w1 + i) * p;
        a2 += load4(w2 + i) * p;
        a3 += load4(w3 + i) * p;
    }
    for (; i < n; i++) {
        a0[i % 4] += w0[i] * x[i];
        a1[i % 4] += w1[i] * x[i];
        a2[i % 4] += w2[i] * x[i];
        a3[i % 4] += w3[i] * x[i];
    }
    out[0] = fold(a0), out[1] = fold(a1), out[2] = fold(a2), out[3] = fold(a3);
}

typedef struct matmul_job {
    float *out;
    const float *x, *w;
    uint32_t rows, n_in, n_out;
} matmul_job;

/* Outputs [begin, end) for every row. */
static void matmul_range(void *ctx, uint32_t begin, uint32_t end, uint32_t worker) {
    (void)worker;
    const matmul_job *j = ctx;
    const size_t in = j->n_in, on = j->n_out;
    const uint32_t full = j->rows / 4 * 4;
    /* rows in groups of four, outputs in pairs */
    for (uint32_t t = 0; t < full; t += 4) {
        const float *x = j->x + t * in;
        float *out = j->out + t * on;
        uint32_t o = begin;
        for (; o + 2 <= end; o += 2) {
            float r0[4], r1[4];
            tile_2x4(j->w + o * in, j->w + (o + 1) * in, x, x + in, x + 2 * in, x + 3 * in, j->n_in,
                     r0, r1);
            for (uint32_t q = 0; q < 4; q++) {
                out[q * on + o] = r0[q];
                out[q * on + o + 1] = r1[q];
            }
        }
        for (; o < end; o++)
            for (uint32_t q = 0; q < 4; q++)
                out[q * on + o] = mdl_dot(j->w + o * in, x + q * in, j->n_in);
    }
    /* the remaining rows, outputs in fours */
    for (uint32_t t = full; t < j->rows; t++) {
        const float *x = j->x + t * in;
        float *out = j->out + t * on;
        uint32_t o = begin;
        for (; o + 4 <= end; o += 4)
            tile_4x1(j->w + o * in, j->w + (o + 1) * in, j->w + (o + 2) * in, j->w + (o + 3) * in,
                     x, j->n_in, out + o);
        for (; o < end; o++) out[o] = mdl_dot(j->w + o * in, x, j->n_in);
    }
}

void mdl_matmul(const pd_par *par, float *out, const float *x, const float *w, uint32_t rows,
                uint32_t n_in, uint32_t n_out) {
    matmul_job job = {out, x, w, rows, n_in, n_out};
    mdl_par_run(par, n_out, 2ull * rows * n_in * n_out, matmul_range, &job);
}

void mdl_rmsnorm(float *out, const float *x, const float *w, uint32_t n, float eps) {
    PD_ASSERT(n > 0);
    float ms = mdl_dot(x, x, n) / (float)n;
    float inv = 1.0f / sqrtf(ms + eps);
    for (uint32_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

float mdl_softplus(float x) {
    if (x > 20.0f) return x;
    double e = mdl_exp((double)x);
    /* log(1 + e); for tiny e the series keeps the digits 1 + e would lose */
    return (float)(e < 1e-5 ? e - 0.5 * e * e : mdl_log(1.0 + e));
}
