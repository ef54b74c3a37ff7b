/*
 * Numeric kernels of the model: dot products, matrix products, RMSNorm and
 * the scalar activations, each with one fixed order of floating-point
 * operations.
 *
 * Why the order is fixed. Floating-point addition is not associative, so a
 * sum's bits depend on the order of its terms. Every reduction here splits
 * its terms into PD_DOT_LANES interleaved partial sums (term i goes to lane
 * i mod 4, in increasing i) and then adds the lanes as (l0 + l2) + (l1 + l3).
 * That order depends only on the length of the vectors, never on how many
 * rows are computed together, which thread computes them, or the batch or
 * chunk the row came in; so a token's activations are the same bits however
 * it was scheduled.
 *
 * The four lanes are one 16-byte vector of the vector extension that GCC and
 * Clang share (vector_size): each lane is an ordinary sequential sum, so the
 * vector code computes exactly what the scalar definition says, on any
 * target (where there is no SIMD the compiler emits scalar code). Written as
 * plain arrays, the same loops ran 3 to 5 times slower with GCC, which did
 * not vectorise them.
 */
#ifndef PDSERVE_MODEL_KERNELS_H
#define PDSERVE_MODEL_KERNELS_H

#include "detmath.h"
#include "pdserve/base.h"
#include "threads.h"

#define PD_DOT_LANES 4

/* How a step may be split across threads: work under min_flops stays on
 * the calling thread. */
typedef struct pd_par {
    pd_threads *tp;
    uint64_t min_flops;
} pd_par;

/* Runs fn over [0, units): on the pool when flops >= par->min_flops and the
 * pool has more than one thread, else directly on the caller. */
void mdl_par_run(const pd_par *par, uint32_t units, uint64_t flops, pd_task_fn fn, void *ctx);

/* sum_i a[i] * b[i] in the fixed lane order. */
float mdl_dot(const float *a, const float *b, uint32_t n);

/* out[t][o] = mdl_dot(w[o], x[t]) for rows t < rows and outputs o < n_out:
 * x is [rows][n_in], w is [n_out][n_in] (the PyTorch Linear layout), out is
 * [rows][n_out]. Split across threads by output o. */
void mdl_matmul(const pd_par *par, float *out, const float *x, const float *w, uint32_t rows,
                uint32_t n_in, uint32_t n_out);

/* out = x / sqrt(mean(x^2) + eps) * w, mean(x^2) = mdl_dot(x, x) / n. */
void mdl_rmsnorm(float *out, const float *x, const float *w, uint32_t n, float eps);

/* x * sigmoid(x), with the deterministic exp of detmath.h; inline because
 * it runs for every MLP and Mamba activation. */
static inline float mdl_silu(float x) { return x / (1.0f + mdl_expf(-x)); }
/* log(1 + exp(x)), and x itself above 20 as PyTorch does (detmath.h). */
float mdl_softplus(float x);

#endif
