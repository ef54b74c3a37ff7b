/*
 * Deterministic elementary functions: exp, log and sin/cos built only from
 * IEEE basic operations (+ - * /, exact scaling by powers of two), so they
 * return the same bits on every machine that runs the same code.
 *
 * Why not libm. glibc picks among several implementations of expf, exp, log,
 * sin and cos at load time according to the CPU (an FMA variant where the
 * CPU has FMA), and the variants may differ in the last bit. A prefill node
 * and a decode node on different CPU generations would then compute
 * different activations — or, with seeded dummy weights, different weights.
 * These routines trade a little speed and (irrelevant here) the last ulp of
 * accuracy for one answer everywhere: all arithmetic is double, evaluated in
 * a fixed order with -ffp-contract=off, and accurate to a few double ulps,
 * far below the float precision of the model.
 */
#ifndef PDSERVE_MODEL_DETMATH_H
#define PDSERVE_MODEL_DETMATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* e^x; 0 below -745, +inf above 709.78, NaN stays NaN. */
double mdl_exp(double x);
/* ln x for x > 0; -inf at 0, NaN below 0 or for NaN, +inf at +inf. */
double mdl_log(double x);
/* sin x and cos x, for |x| < 2^20 * pi / 2 (RoPE angles stay far below). */
void mdl_sincos(double x, double *sin_out, double *cos_out);
/* e^x for float x, the hot-path version (SiLU, softmax, Mamba decay): the
 * same reduction as mdl_exp, the Taylor series to r^8 (relative truncation
 * below 2e-10, far under a float ulp), and 2^k built from its bits. Inline
 * because it runs for every activation. */
static inline float mdl_expf(float xf) {
    const double x = xf;
    if (!(x < 88.8)) return x != x ? xf : (float)INFINITY;
    if (x < -104.0) return 0.0f;
    const double round = 0x1.8p52; /* adding and subtracting it rounds to an integer */
    const double k = (x * 1.44269504088896338700e+00 + round) - round;
    const double r = (x - k * 6.93147180369123816490e-01) - k * 1.90821492927058770002e-10;
    double p = 1.0 / 40320.0;
    p = p * r + 1.0 / 5040.0;
    p = p * r + 1.0 / 720.0;
    p = p * r + 1.0 / 120.0;
    p = p * r + 1.0 / 24.0;
    p = p * r + 1.0 / 6.0;
    p = p * r + 0.5;
    p = p * r + 1.0;
    p = p * r + 1.0;
    const uint64_t bits = (uint64_t)((int64_t)k + 1023) << 52; /* 2^k, k in [-151, 129] */
    double scale;
    memcpy(&scale, &bits, sizeof(scale));
    return (float)(p * scale);
}

#endif
