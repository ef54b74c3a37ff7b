/*
 * Small helpers shared by the benchmark programs: a monotonic clock, medians
 * and percentiles. Benchmarks print their figures; nothing here asserts on
 * time.
 */
#ifndef PDSERVE_BENCH_UTIL_H
#define PDSERVE_BENCH_UTIL_H

#include <stdint.h>
#include <stdlib.h>
#include <time.h>

static inline uint64_t bench_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Sorts v in place; p in [0, 100]. Nearest-rank percentile. */
static inline double bench_percentile(double *v, size_t n, double p) {
    if (n == 0) return 0.0;
    qsort(v, n, sizeof(double), bench_cmp_double);
    size_t rank = (size_t)(p / 100.0 * (double)n + 0.5);
    if (rank < 1) rank = 1;
    if (rank > n) rank = n;
    return v[rank - 1];
}

static inline double bench_median(double *v, size_t n) {
    if (n == 0) return 0.0;
    qsort(v, n, sizeof(double), bench_cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

#endif
