/*
 * detmath.c — exp, log and sin/cos from basic IEEE operations. See
 * detmath.h for why.
 *
 * exp: x = k ln2 + r with |r| <= ln2 / 2 (Cody-Waite: ln2 split in a part
 *      with trailing zero bits, so k * LN2_HI is exact), e^r by its Taylor
 *      series to r^13 (truncation below 1e-17 relative), times 2^k (ldexp,
 *      an exact operation).
 * log: x = m 2^e with m in [sqrt(1/2), sqrt(2)) (frexp, exact), then
 *      ln m = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172, by its series
 *      to s^23; ln x = e ln2 + ln m.
 * sin/cos: x = k pi/2 + r with |r| <= pi/4 (pi/2 split in three parts, the
 *      first two with 20 trailing zero bits so k * part is exact for
 *      k < 2^20), then Taylor series of sin and cos on r and the quadrant.
 * The split constants are the ones published with fdlibm.
 */
#include "detmath.h"

#include <math.h>

static const double LN2_HI = 6.93147180369123816490e-01; /* 0x3fe62e42fee00000 */
static const double LN2_LO = 1.90821492927058770002e-10;
static const double INV_LN2 = 1.44269504088896338700e+00;

double mdl_exp(double x) {
    if (x != x) return x;
    if (x > 709.782712893384) return INFINITY;
    if (x < -745.2) return 0.0;
    double k = floor(x * INV_LN2 + 0.5);
    double r = (x - k * LN2_HI) - k * LN2_LO;
    /* e^r = 1 + r + r^2/2! + ... + r^13/13!, Horner from the top */
    double p = 1.0 / 6227020800.0;
    static const double inv_fact[] = {1.0 / 479001600.0,
                                      1.0 / 39916800.0,
                                      1.0 / 3628800.0,
                                      1.0 / 362880.0,
                                      1.0 / 40320.0,
                                      1.0 / 5040.0,
                                      1.0 / 720.0,
                                      1.0 / 120.0,
                                      1.0 / 24.0,
                                      1.0 / 6.0,
                                      1.0 / 2.0,
                                      1.0,
                                      1.0};
    for (int i = 0; i < 13; i++) p = p * r + inv_fact[i];
    return ldexp(p, (int)k);
}

double mdl_log(double x) {
    if (x != x || x < 0.0) return NAN;
    if (x == 0.0) return -INFINITY;
    if (isinf(x)) return x;
    int e;
    double m = frexp(x, &e); /* x = m 2^e, m in [0.5, 1) */
    if (m < 0.70710678118654752440) {
        m *= 2.0;
        e -= 1;
    }
    double s = (m - 1.0) / (m + 1.0), s2 = s * s;
    /* atanh(s) / s = 1 + s^2/3 + s^4/5 + ... + s^22/23 */
    double p = 1.0 / 23.0;
    for (int n = 21; n >= 1; n -= 2) p = p * s2 + 1.0 / n;
    double ln_m = 2.0 * s * p;
    return (double)e * LN2_HI + ((double)e * LN2_LO + ln_m);
}

static const double PIO2_1 = 1.57079632673412561417e+00;  /* first 33 bits of pi/2 */
static const double PIO2_2 = 6.07710050630396597660e-11;  /* next 33 bits */
static const double PIO2_3 = 2.02226624879595063154e-21;  /* the rest */
static const double INV_PIO2 = 6.36619772367581382433e-01;

void mdl_sincos(double x, double *sin_out, double *cos_out) {
    double k = floor(x * INV_PIO2 + 0.5);
    double r = ((x - k * PIO2_1) - k * PIO2_2) - k * PIO2_3;
    double r2 = r * r;
    /* sin r = r (1 - r^2/3! + ... - r^18/19!),  cos r = 1 - r^2/2! + ... + r^20/20! */
    static const double sin_c[] = {-1.0 / 121645100408832000.0, 1.0 / 355687428096000.0,
                                   -1.0 / 1307674368000.0,      1.0 / 6227020800.0,
                                   -1.0 / 39916800.0,           1.0 / 362880.0,
                                   -1.0 / 5040.0,               1.0 / 120.0,
                                   -1.0 / 6.0,                  1.0};
    static const double cos_c[] = {1.0 / 2432902008176640000.0, -1.0 / 6402373705728000.0,
                                   1.0 / 20922789888000.0,      -1.0 / 87178291200.0,
                                   1.0 / 479001600.0,           -1.0 / 3628800.0,
                                   1.0 / 40320.0,               -1.0 / 720.0,
                                   1.0 / 24.0,                  -1.0 / 2.0,
                                   1.0};
    double sp = 0.0, cp = 0.0;
    for (int n = 0; n < 10; n++) sp = sp * r2 + sin_c[n];
    for (int n = 0; n < 11; n++) cp = cp * r2 + cos_c[n];
    double s = r * sp, c = cp;
    long q = (long)fmod(k, 4.0);
    if (q < 0) q += 4;
    switch (q) {
    case 0: *sin_out = s, *cos_out = c; break;
    case 1: *sin_out = c, *cos_out = -s; break;
    case 2: *sin_out = -s, *cos_out = -c; break;
    default: *sin_out = -c, *cos_out = s; break;
    }
}
