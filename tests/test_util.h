/*
 * Shared helpers for the cmocka test programs.
 */
#ifndef PDSERVE_TEST_UTIL_H
#define PDSERVE_TEST_UTIL_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "pdserve/base.h"

/* assert that an expression returning pd_err returns `want`. */
#define assert_err(expr, want) assert_int_equal((int)(expr), (int)(want))
#define assert_ok(expr) assert_err(expr, PD_OK)

/* Seed for randomized tests: PD_TEST_SEED in the environment overrides. */
static inline uint64_t test_seed(uint64_t dflt) {
    const char *s = getenv("PD_TEST_SEED");
    return s ? strtoull(s, NULL, 0) : dflt;
}

#endif
