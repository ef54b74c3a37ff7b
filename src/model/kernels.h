/*
 * Numeric kernels of the model: dot products, matrix products (f32 or bf16
 * weights), RMSNorm and the scalar activations, each with one fixed order of
 * floating-point operations.
 *
 * Why the order is fixed. Floating-point addition is not associative, so a
 * sum's bits depend on the order of its terms. Every reduction here is
 * defined as follows, for vectors a, b of length n:
 *
 *   lanes    l[0..7] = +0; term i goes to lane i mod 8, in increasing i, as
 *            l[i mod 8] = fmaf(a[i], b[i], l[i mod 8]): a fused multiply-add,
 *            one rounding per term. Nothing else is added to a lane (a
 *            vector's tail is not padded with zero terms, which would turn a
 *            lane's -0 into +0).
 *   fold     ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), i.e. the
 *            upper half of the 8-lane vector onto the lower, then the upper
 *            pair onto the lower, then lane 1 onto lane 0.
 *
 * That order depends only on n, never on how many rows are computed together,
 * which tile or thread computes an output, or the batch or chunk a row came
 * in; so a token's activations are the same bits however it was scheduled.
 *
 * Why 8 lanes. One lane per float of a 256-bit register: an output's running
 * sum is one AVX2 register, so the matrix product's tile of 4 weight rows x 3
 * input rows keeps its 12 sums, the 3 input vectors and one weight vector in
 * the 16 registers. (16 lanes would give mdl_dot two independent FMA chains
 * instead of one, but would halve that tile; mdl_dot runs on short vectors,
 * head_dim or d_state, where many independent calls overlap anyway.)
 *
 * Two implementations, one result. On x86-64 CPUs with AVX2 and FMA (checked
 * at run time with __builtin_cpu_supports; the binary itself targets any
 * x86-64) the kernels use 256-bit intrinsics in functions compiled for that
 * target. Elsewhere, the portable code computes the same lanes in the same
 * order with C's fmaf, which is correctly rounded exactly as the hardware
 * instruction is. mdl_kernels_force_portable switches every kernel to the
 * portable code, which is how the tests prove the two agree bit for bit.
 * The build keeps -ffp-contract=off, so the compiler never fuses or splits
 * an operation on its own: every FMA is one written here.
 */
#ifndef PDSERVE_MODEL_KERNELS_H
#define PDSERVE_MODEL_KERNELS_H

#include "detmath.h"
#include "pdserve/base.h"
#include "threads.h"

#define PD_DOT_LANES 8

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

/* mdl_matmul with bf16 weights: w holds bf16 bit patterns (the upper 16 bits
 * of an f32), widened exactly as they are read. The result is bit for bit
 * mdl_matmul's on the widened weights; the weights read are half the bytes. */
void mdl_matmul_bf16(const pd_par *par, float *out, const float *x, const uint16_t *w,
                     uint32_t rows, uint32_t n_in, uint32_t n_out);

/* out = x / sqrt(mean(x^2) + eps) * w, mean(x^2) = mdl_dot(x, x) / n. */
void mdl_rmsnorm(float *out, const float *x, const float *w, uint32_t n, float eps);

/* true: every kernel uses the portable code from now on, even where AVX2 is
 * available (tests; the results are the same bits, only slower). */
void mdl_kernels_force_portable(bool on);
/* "avx2" or "portable": the code the kernels use now. */
const char *mdl_kernels_path(void);

/* x * sigmoid(x), with the deterministic exp of detmath.h; inline because
 * it runs for every MLP and Mamba activation. */
static inline float mdl_silu(float x) { return x / (1.0f + mdl_expf(-x)); }
/* log(1 + exp(x)), and x itself above 20 as PyTorch does (detmath.h). */
float mdl_softplus(float x);

#endif
