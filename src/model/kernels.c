/*
 * kernels.c — the fixed-order numeric kernels. See kernels.h for why the
 * order is fixed.
 *
 * pd_matmul computes four rows of x against one row of w at a time (the
 * weights are read once for four tokens, which matters when a prefill chunk
 * streams through a matrix); each of the four results is produced by the
 * same lane assignment and reduction tree as pd_dot, so a row's result does
 * not depend on whether it fell in a group of four or in the remainder.
 * The test suite checks that equality bit for bit.
 */
#include "kernels.h"

#include <math.h>

void pd_par_run(const pd_par *par, uint32_t units, uint64_t flops, pd_task_fn fn, void *ctx) {
    if (par->tp && pd_threads_count(par->tp) > 1 && flops >= par->min_flops)
        pd_threads_run(par->tp, units, fn, ctx);
    else if (units > 0)
        fn(ctx, 0, units, 0);
}

/* The reduction tree shared by every reduction: halves folded onto halves. */
static inline float lanes_sum(float *acc) {
    for (int w = PD_DOT_LANES / 2; w >= 1; w /= 2)
        for (int j = 0; j < w; j++) acc[j] += acc[j + w];
    return acc[0];
}

float pd_dot(const float *a, const float *b, uint32_t n) {
    float acc[PD_DOT_LANES] = {0};
    uint32_t i = 0;
    for (; i + PD_DOT_LANES <= n; i += PD_DOT_LANES)
        for (int j = 0; j < PD_DOT_LANES; j++) acc[j] += a[i + j] * b[i + j];
    for (; i < n; i++) acc[i % PD_DOT_LANES] += a[i] * b[i];
    return lanes_sum(acc);
}

/* Four dot products of w against x0..x3, each in pd_dot's order. */
static void dot4(const float *w, const float *x0, const float *x1, const float *x2,
                 const float *x3, uint32_t n, float *out) {
    float a0[PD_DOT_LANES] = {0}, a1[PD_DOT_LANES] = {0};
    float a2[PD_DOT_LANES] = {0}, a3[PD_DOT_LANES] = {0};
    uint32_t i = 0;
    for (; i + PD_DOT_LANES <= n; i += PD_DOT_LANES) {
        for (int j = 0; j < PD_DOT_LANES; j++) {
            float wv = w[i + j];
            a0[j] += wv * x0[i + j];
            a1[j] += wv * x1[i + j];
            a2[j] += wv * x2[i + j];
            a3[j] += wv * x3[i + j];
        }
    }
    for (; i < n; i++) {
        a0[i % PD_DOT_LANES] += w[i] * x0[i];
        a1[i % PD_DOT_LANES] += w[i] * x1[i];
        a2[i % PD_DOT_LANES] += w[i] * x2[i];
        a3[i % PD_DOT_LANES] += w[i] * x3[i];
    }
    out[0] = lanes_sum(a0);
    out[1] = lanes_sum(a1);
    out[2] = lanes_sum(a2);
    out[3] = lanes_sum(a3);
}

typedef struct matmul_job {
    float *out;
    const float *x, *w;
    uint32_t rows, n_in, n_out;
} matmul_job;

static void matmul_range(void *ctx, uint32_t begin, uint32_t end, uint32_t worker) {
    (void)worker;
    const matmul_job *j = ctx;
    for (uint32_t o = begin; o < end; o++) {
        const float *wr = j->w + (size_t)o * j->n_in;
        uint32_t t = 0;
        for (; t + 4 <= j->rows; t += 4) {
            const float *x = j->x + (size_t)t * j->n_in;
            float r[4];
            dot4(wr, x, x + j->n_in, x + 2 * (size_t)j->n_in, x + 3 * (size_t)j->n_in, j->n_in, r);
            for (uint32_t q = 0; q < 4; q++) j->out[(size_t)(t + q) * j->n_out + o] = r[q];
        }
        for (; t < j->rows; t++)
            j->out[(size_t)t * j->n_out + o] = pd_dot(wr, j->x + (size_t)t * j->n_in, j->n_in);
    }
}

void pd_matmul(const pd_par *par, float *out, const float *x, const float *w, uint32_t rows,
               uint32_t n_in, uint32_t n_out) {
    matmul_job job = {out, x, w, rows, n_in, n_out};
    pd_par_run(par, n_out, 2ull * rows * n_in * n_out, matmul_range, &job);
}

void pd_rmsnorm(float *out, const float *x, const float *w, uint32_t n, float eps) {
    PD_ASSERT(n > 0);
    float ms = pd_dot(x, x, n) / (float)n;
    float inv = 1.0f / sqrtf(ms + eps);
    for (uint32_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

float pd_silu(float x) { return x / (1.0f + expf(-x)); }

float pd_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
