/* Pools: allocation order, contiguity, misuse detection, all-or-nothing bulk
 * calls, and a randomized comparison with a plain boolean array. */
#include <stdlib.h>

#include "../test_util.h"
#include "pdserve/pool.h"

static pd_pool *mk(uint32_t n, pd_pool_kind kind, uint32_t unit_tokens) {
    pd_pool *p = NULL;
    assert_ok(pd_pool_create(&p, "t", kind, n, unit_tokens));
    return p;
}

static void verify(pd_pool *p) {
    char msg[160];
    pd_err e = pd_pool_verify(p, msg, sizeof(msg));
    if (e != PD_OK) fail_msg("%s", msg);
}

static void create_rejects_bad_arguments(void **state) {
    (void)state;
    pd_pool *p = NULL;
    assert_err(pd_pool_create(&p, "x", PD_POOL_KV, 0, 16), PD_ERR_INVALID);
    assert_err(pd_pool_create(&p, "x", PD_POOL_KV, 10, 0), PD_ERR_INVALID);
    assert_err(pd_pool_create(&p, "x", PD_POOL_ROW, 10, 4), PD_ERR_INVALID);
    assert_err(pd_pool_create(&p, "x", PD_POOL_KIND__COUNT, 10, 0), PD_ERR_INVALID);
    assert_err(pd_pool_create(&p, "x", PD_POOL_MAMBA, PD_POOL_UNITS_MAX + 1, 0), PD_ERR_INVALID);
    assert_null(p);
}

static void alloc_hands_out_every_unit_once_then_nomem(void **state) {
    (void)state;
    const uint32_t sizes[] = {1, 63, 64, 65, 130, 4097};
    for (size_t s = 0; s < PD_ARRAY_LEN(sizes); s++) {
        uint32_t n = sizes[s];
        pd_pool *p = mk(n, PD_POOL_ROW, 0);
        bool *seen = calloc(n, 1);
        for (uint32_t i = 0; i < n; i++) {
            uint32_t idx;
            assert_ok(pd_pool_alloc(p, &idx));
            assert_true(idx < n);
            assert_false(seen[idx]);
            assert_int_equal(idx, i); /* lowest free first */
            seen[idx] = true;
        }
        uint32_t idx = 12345;
        assert_err(pd_pool_alloc(p, &idx), PD_ERR_NOMEM);
        assert_int_equal(idx, 12345);
        assert_int_equal(pd_pool_free_count(p), 0);
        verify(p);
        free(seen);
        pd_pool_destroy(p);
    }
}

static void free_detects_foreign_index_and_double_free(void **state) {
    (void)state;
    pd_pool *p = mk(100, PD_POOL_KV, 16);
    uint32_t idx;
    assert_ok(pd_pool_alloc(p, &idx));
    assert_err(pd_pool_free(p, 100), PD_ERR_INVALID);
    assert_err(pd_pool_free(p, UINT32_MAX), PD_ERR_INVALID);
    assert_ok(pd_pool_free(p, idx));
    assert_err(pd_pool_free(p, idx), PD_ERR_STATE);
    assert_err(pd_pool_free(p, 50), PD_ERR_STATE); /* never allocated */
    assert_int_equal(pd_pool_free_count(p), 100);
    verify(p);
    pd_pool_destroy(p);
}

static void free_n_is_all_or_nothing(void **state) {
    (void)state;
    pd_pool *p = mk(64, PD_POOL_KV, 4);
    uint32_t got[10];
    assert_ok(pd_pool_alloc_n(p, 10, got));
    uint32_t with_dup[3] = {got[0], got[1], got[0]};
    assert_err(pd_pool_free_n(p, with_dup, 3), PD_ERR_STATE);
    assert_int_equal(pd_pool_free_count(p), 54);
    assert_false(pd_pool_is_free(p, got[0]));
    assert_false(pd_pool_is_free(p, got[1]));
    uint32_t with_foreign[2] = {got[2], 64};
    assert_err(pd_pool_free_n(p, with_foreign, 2), PD_ERR_INVALID);
    assert_false(pd_pool_is_free(p, got[2]));
    assert_ok(pd_pool_free_n(p, got, 10));
    assert_int_equal(pd_pool_free_count(p), 64);
    verify(p);
    pd_pool_destroy(p);
}

static void alloc_n_prefers_one_contiguous_run(void **state) {
    (void)state;
    pd_pool *p = mk(256, PD_POOL_KV, 16);
    uint32_t all[256];
    assert_ok(pd_pool_alloc_n(p, 256, all));
    assert_int_equal(pd_index_runs(all, 256), 1);
    /* Free every other unit below 128 (singletons) and one run of 12 at 200. */
    for (uint32_t i = 0; i < 128; i += 2) assert_ok(pd_pool_free(p, i));
    for (uint32_t i = 200; i < 212; i++) assert_ok(pd_pool_free(p, i));
    uint32_t got[12];
    assert_ok(pd_pool_alloc_n(p, 8, got));
    assert_int_equal(pd_index_runs(got, 8), 1);
    assert_int_equal(got[0], 200);
    /* No run of 5 left except 208..211 (4): falls back to the lowest units. */
    assert_ok(pd_pool_alloc_n(p, 5, got));
    assert_int_equal(got[0], 0);
    assert_int_equal(got[4], 8);
    assert_int_equal(pd_index_runs(got, 5), 5);
    verify(p);
    pd_pool_destroy(p);
}

static void alloc_n_run_spans_word_boundaries(void **state) {
    (void)state;
    pd_pool *p = mk(300, PD_POOL_HOST, 8);
    uint32_t all[300];
    assert_ok(pd_pool_alloc_n(p, 300, all));
    for (uint32_t i = 60; i < 200; i++) assert_ok(pd_pool_free(p, i));
    assert_ok(pd_pool_free(p, 10));
    uint32_t got[140];
    assert_ok(pd_pool_alloc_n(p, 140, got));
    assert_int_equal(got[0], 60);
    assert_int_equal(pd_index_runs(got, 140), 1);
    assert_true(pd_pool_is_free(p, 10));
    verify(p);
    pd_pool_destroy(p);
}

/* The run search skips words with no free unit through the summary bits: a
 * run never bridges such a word, and one far above a stretch of full words is
 * still found. */
static void alloc_n_run_skips_full_words_without_bridging_them(void **state) {
    (void)state;
    pd_pool *p = mk(64 * 200, PD_POOL_KV, 16);
    uint32_t *all = malloc(64 * 200 * sizeof(uint32_t));
    assert_non_null(all);
    assert_ok(pd_pool_alloc_n(p, 64 * 200, all));
    /* Word 1 ends with 3 free units, word 2 is full, word 3 starts with 3
     * free: no run of 6 there. Word 190 holds units 12160..: a run of 6. */
    for (uint32_t i = 125; i < 128; i++) assert_ok(pd_pool_free(p, i));
    for (uint32_t i = 192; i < 195; i++) assert_ok(pd_pool_free(p, i));
    for (uint32_t i = 190 * 64 + 10; i < 190 * 64 + 16; i++) assert_ok(pd_pool_free(p, i));
    uint32_t got[6];
    assert_ok(pd_pool_alloc_n(p, 6, got));
    assert_int_equal(got[0], 190 * 64 + 10);
    assert_int_equal(pd_index_runs(got, 6), 1);
    /* A run across two adjacent words is still one run: 125..127 + 128..130. */
    for (uint32_t i = 128; i < 131; i++) assert_ok(pd_pool_free(p, i));
    assert_ok(pd_pool_alloc_n(p, 6, got));
    assert_int_equal(got[0], 125);
    assert_int_equal(pd_index_runs(got, 6), 1);
    verify(p);
    free(all);
    pd_pool_destroy(p);
}

static void alloc_n_nomem_changes_nothing(void **state) {
    (void)state;
    pd_pool *p = mk(10, PD_POOL_MAMBA, 0);
    uint32_t got[11];
    assert_ok(pd_pool_alloc_n(p, 4, got));
    assert_err(pd_pool_alloc_n(p, 7, got), PD_ERR_NOMEM);
    assert_int_equal(pd_pool_free_count(p), 6);
    assert_ok(pd_pool_alloc_n(p, 0, NULL));
    verify(p);
    pd_pool_destroy(p);
}

/* What pd_pool_alloc_n must choose, from the boolean array: the first run of
 * k free units (the lowest-starting one), else the k lowest free units. */
static void expected_alloc_n(const bool *used, uint32_t n, uint32_t k, uint32_t *out) {
    uint32_t run = 0;
    for (uint32_t i = 0; i < n && k > 1; i++) {
        run = used[i] ? 0 : run + 1;
        if (run == k) {
            for (uint32_t j = 0; j < k; j++) out[j] = i + 1 - k + j;
            return;
        }
    }
    uint32_t got = 0;
    for (uint32_t i = 0; i < n && got < k; i++)
        if (!used[i]) out[got++] = i;
}

static void random_operations_match_a_boolean_array(void **state) {
    (void)state;
    pd_rng rng;
    pd_rng_seed(&rng, test_seed(42));
    /* 5000: more than one summary word (4096 units) */
    const uint32_t sizes[] = {1, 7, 64, 65, 200, 1000, 5000};
    for (size_t s = 0; s < PD_ARRAY_LEN(sizes); s++) {
        uint32_t n = sizes[s];
        pd_pool *p = mk(n, PD_POOL_KV, 1);
        bool *used = calloc(n, 1);
        uint32_t *buf = calloc(n, sizeof(uint32_t));
        uint32_t *want = calloc(n, sizeof(uint32_t));
        uint32_t in_use = 0;
        for (int op = 0; op < 5000; op++) {
            uint32_t k = (uint32_t)pd_rng_range(&rng, 1, PD_MAX(1, n / 8));
            switch (pd_rng_below(&rng, 4)) {
            case 0: {
                uint32_t idx;
                pd_err e = pd_pool_alloc(p, &idx);
                if (in_use == n) {
                    assert_err(e, PD_ERR_NOMEM);
                    break;
                }
                assert_ok(e);
                assert_false(used[idx]);
                for (uint32_t j = 0; j < idx; j++) assert_true(used[j]); /* lowest */
                used[idx] = true;
                in_use++;
                break;
            }
            case 1: {
                pd_err e = pd_pool_alloc_n(p, k, buf);
                if (in_use + k > n) {
                    assert_err(e, PD_ERR_NOMEM);
                    break;
                }
                assert_ok(e);
                expected_alloc_n(used, n, k, want);
                for (uint32_t j = 0; j < k; j++) {
                    assert_int_equal(buf[j], want[j]);
                    assert_false(used[buf[j]]);
                    if (j) assert_true(buf[j] > buf[j - 1]);
                    used[buf[j]] = true;
                }
                in_use += k;
                break;
            }
            default: {
                uint32_t idx = (uint32_t)pd_rng_below(&rng, n);
                pd_err e = pd_pool_free(p, idx);
                assert_err(e, used[idx] ? PD_OK : PD_ERR_STATE);
                if (used[idx]) in_use--;
                used[idx] = false;
            }
            }
            assert_int_equal(pd_pool_free_count(p), n - in_use);
            if (op % 64 == 0) verify(p);
        }
        verify(p);
        free(used);
        free(buf);
        free(want);
        pd_pool_destroy(p);
    }
}

/* A bulk allocation's search starts where an earlier one found no shorter
 * run (I5 in pool.c); a free must move that start down far enough to find a
 * run that the freed units complete from below, here one that begins in the
 * word before the freed units and before the earlier run. */
static void a_run_completed_by_a_free_below_an_earlier_search_is_found_first(void **state) {
    (void)state;
    pd_pool *p = mk(256, PD_POOL_KV, 16);
    uint32_t all[256], got[8];
    assert_ok(pd_pool_alloc_n(p, 256, all));
    for (uint32_t i = 188; i < 192; i++) assert_ok(pd_pool_free(p, i));
    uint32_t later[16];
    for (uint32_t i = 0; i < 8; i++) later[i] = 196 + i, later[8 + i] = 240 + i;
    assert_ok(pd_pool_free_n(p, later, 16));
    assert_ok(pd_pool_alloc_n(p, 8, got)); /* 188..191 is 4 long */
    assert_int_equal(got[0], 196);
    verify(p);
    uint32_t middle[4] = {192, 193, 194, 195};
    assert_ok(pd_pool_free_n(p, middle, 4)); /* 188..195 is 8 long now */
    verify(p);
    assert_ok(pd_pool_alloc_n(p, 8, got));
    assert_int_equal(got[0], 188);
    assert_int_equal(pd_index_runs(got, 8), 1);
    assert_ok(pd_pool_alloc_n(p, 8, got));
    assert_int_equal(got[0], 240);
    assert_err(pd_pool_alloc_n(p, 2, got), PD_ERR_NOMEM);
    verify(p);
    pd_pool_destroy(p);
}

/* The run search walks the summary bits (I2) one summary word (4,096 units)
 * at a time: a run two summary words above the lowest free unit, past a
 * summary word with no free unit, is found; a search with no run of its
 * length ends at the pool's last summary word (12,288 units: no partial one)
 * and takes the lowest free units. */
static void a_run_search_steps_over_summary_words_with_no_free_unit(void **state) {
    (void)state;
    const uint32_t n = 12288;
    pd_pool *p = mk(n, PD_POOL_KV, 1);
    uint32_t *all = calloc(n, sizeof(uint32_t));
    uint32_t got[9];
    assert_ok(pd_pool_alloc_n(p, n, all));
    assert_ok(pd_pool_free(p, 5));
    for (uint32_t i = 0; i < 8; i++) assert_ok(pd_pool_free(p, 12270 + i));
    assert_ok(pd_pool_alloc_n(p, 9, got)); /* no run of 9: the 9 lowest */
    assert_int_equal(got[0], 5);
    assert_int_equal(got[1], 12270);
    assert_int_equal(got[8], 12277);
    verify(p);
    for (uint32_t i = 0; i < 8; i++) assert_ok(pd_pool_free(p, 10000 + i));
    assert_ok(pd_pool_free(p, 100));
    assert_ok(pd_pool_alloc_n(p, 8, got)); /* over summary word 1, all taken */
    assert_int_equal(got[0], 10000);
    assert_int_equal(pd_index_runs(got, 8), 1);
    assert_int_equal(pd_pool_free_count(p), 1);
    verify(p);
    free(all);
    pd_pool_destroy(p);
}

/* A word whose free units are all isolated, neither at bit 0 nor at bit 63,
 * holds no run of 2 or more and none passes through it: the search steps
 * over it. A word with an isolated unit at either end is not such a word:
 * its end unit completes a run with the next or the previous word's. */
static void a_run_search_steps_over_words_of_isolated_units(void **state) {
    (void)state;
    const uint32_t n = 256;
    pd_pool *p = mk(n, PD_POOL_KV, 1);
    uint32_t all[256], got[3];
    assert_ok(pd_pool_alloc_n(p, n, all));
    /* word 0: isolated units only; word 1: isolated units and its last unit;
     * word 2: its first unit. The only run of 2 is 127-128. */
    const uint32_t freed[] = {10, 20, 30, 72, 90, 127, 128};
    for (size_t i = 0; i < PD_ARRAY_LEN(freed); i++) assert_ok(pd_pool_free(p, freed[i]));
    assert_ok(pd_pool_alloc_n(p, 2, got));
    assert_int_equal(got[0], 127);
    assert_int_equal(got[1], 128);
    verify(p);
    /* word 3: a run of 3 at its first units, 192-194 (word 2's last unit is
     * taken), beside isolated units 197, 199, ..., 253. */
    assert_ok(pd_pool_free(p, 192));
    for (uint32_t u = 197; u < 255; u += 2) assert_ok(pd_pool_free(p, u));
    assert_ok(pd_pool_free(p, 194));
    assert_ok(pd_pool_free(p, 193));
    assert_ok(pd_pool_alloc_n(p, 3, got));
    assert_int_equal(got[0], 192);
    assert_int_equal(got[2], 194);
    verify(p);
    /* No run of 2 left anywhere: the 2 lowest free units. */
    assert_ok(pd_pool_alloc_n(p, 2, got));
    assert_int_equal(got[0], 10);
    assert_int_equal(got[1], 20);
    verify(p);
    pd_pool_destroy(p);
}

/* Frees up to 8 used units from a random window, in one pd_pool_free_n. */
static void free_some(pd_pool *p, pd_rng *rng, bool *used, uint32_t n, uint32_t *in_use) {
    uint32_t idx[8], k = 0, at = (uint32_t)pd_rng_below(rng, n);
    for (uint32_t i = at; i < n && i < at + 64 && k < 8; i++)
        if (used[i] && pd_rng_below(rng, 2)) idx[k++] = i;
    assert_ok(pd_pool_free_n(p, idx, k));
    for (uint32_t i = 0; i < k; i++) used[idx[i]] = false;
    *in_use -= k;
}

/* Bulk allocations of a few units against bulk frees, the pool verified
 * (I5 included) after each: the runs chosen are the boolean array's. */
static void bulk_frees_and_allocations_match_a_boolean_array(void **state) {
    (void)state;
    pd_rng rng;
    pd_rng_seed(&rng, test_seed(43));
    const uint32_t sizes[] = {200, 1000, 5000};
    for (size_t s = 0; s < PD_ARRAY_LEN(sizes); s++) {
        uint32_t n = sizes[s], in_use = 0;
        pd_pool *p = mk(n, PD_POOL_KV, 1);
        bool *used = calloc(n, 1);
        uint32_t buf[12], want[12];
        for (int op = 0; op < 4000; op++) {
            uint32_t k = (uint32_t)pd_rng_range(&rng, 2, 12);
            if (pd_rng_below(&rng, 3) == 0 || in_use + k > n) {
                free_some(p, &rng, used, n, &in_use);
            } else {
                assert_ok(pd_pool_alloc_n(p, k, buf));
                expected_alloc_n(used, n, k, want);
                for (uint32_t j = 0; j < k; j++) {
                    assert_int_equal(buf[j], want[j]);
                    used[buf[j]] = true;
                }
                in_use += k;
            }
            assert_int_equal(pd_pool_free_count(p), n - in_use);
            verify(p);
        }
        free(used);
        pd_pool_destroy(p);
    }
}

static void index_runs_counts_breaks(void **state) {
    (void)state;
    uint32_t a[] = {3, 4, 5, 9, 10, 2};
    assert_int_equal(pd_index_runs(a, 6), 3);
    assert_int_equal(pd_index_runs(a, 0), 0);
    assert_int_equal(pd_index_runs(a, 1), 1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(create_rejects_bad_arguments),
        cmocka_unit_test(alloc_hands_out_every_unit_once_then_nomem),
        cmocka_unit_test(free_detects_foreign_index_and_double_free),
        cmocka_unit_test(free_n_is_all_or_nothing),
        cmocka_unit_test(alloc_n_prefers_one_contiguous_run),
        cmocka_unit_test(alloc_n_run_spans_word_boundaries),
        cmocka_unit_test(alloc_n_run_skips_full_words_without_bridging_them),
        cmocka_unit_test(alloc_n_nomem_changes_nothing),
        cmocka_unit_test(random_operations_match_a_boolean_array),
        cmocka_unit_test(a_run_completed_by_a_free_below_an_earlier_search_is_found_first),
        cmocka_unit_test(bulk_frees_and_allocations_match_a_boolean_array),
        cmocka_unit_test(a_run_search_steps_over_summary_words_with_no_free_unit),
        cmocka_unit_test(a_run_search_steps_over_words_of_isolated_units),
        cmocka_unit_test(index_runs_counts_breaks),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
