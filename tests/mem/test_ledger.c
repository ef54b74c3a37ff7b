/* The ownership ledger: every transition checks the unit's previous state
 * (and owner, in strict mode), refusals change nothing, and the check finds
 * disagreements between the three sources and names the culprit. */
#include <jansson.h>
#include <stdlib.h>

#include "../test_util.h"
#include "pdserve/ledger.h"

typedef struct fixture {
    pd_ledger *l;
    pd_pool *kv, *row, *mamba, *meta;
    int kv_id, row_id, mamba_id, meta_id;
} fixture;

static fixture *fx_new(bool strict) {
    fixture *f = calloc(1, sizeof(*f));
    assert_ok(pd_ledger_create(&f->l, strict));
    assert_ok(pd_pool_create(&f->kv, "kv", PD_POOL_KV, 64, 16));
    assert_ok(pd_pool_create(&f->row, "row", PD_POOL_ROW, 4, 0));
    assert_ok(pd_pool_create(&f->mamba, "mamba", PD_POOL_MAMBA, 6, 0));
    assert_ok(pd_pool_create(&f->meta, "meta", PD_POOL_META, 4, 0));
    assert_ok(pd_ledger_add_pool(f->l, f->kv, &f->kv_id));
    assert_ok(pd_ledger_add_pool(f->l, f->row, &f->row_id));
    assert_ok(pd_ledger_add_pool(f->l, f->mamba, &f->mamba_id));
    assert_ok(pd_ledger_add_pool(f->l, f->meta, &f->meta_id));
    return f;
}

static void fx_free(fixture *f) {
    pd_ledger_destroy(f->l);
    pd_pool_destroy(f->kv);
    pd_pool_destroy(f->row);
    pd_pool_destroy(f->mamba);
    pd_pool_destroy(f->meta);
    free(f);
}

static pd_err check(fixture *f, const pd_cache_sums *sums, bool idle, char *buf, size_t cap) {
    pd_strbuf sb;
    pd_strbuf_init(&sb, buf, cap);
    pd_check_opts o = {.cache = sums, .expect_idle = idle, .deep = true};
    return pd_ledger_check(f->l, &o, &sb);
}

static void assert_clean(fixture *f) {
    char buf[4096];
    pd_err e = check(f, NULL, false, buf, sizeof(buf));
    if (e != PD_OK) fail_msg("%s", buf);
}

static void add_pool_refuses_duplicates_and_used_pools(void **state) {
    (void)state;
    fixture *f = fx_new(true);
    int id;
    assert_err(pd_ledger_add_pool(f->l, f->kv, &id), PD_ERR_EXISTS);
    pd_pool *used;
    assert_ok(pd_pool_create(&used, "used", PD_POOL_ROW, 3, 0));
    uint32_t idx;
    assert_ok(pd_pool_alloc(used, &idx));
    assert_err(pd_ledger_add_pool(f->l, used, &id), PD_ERR_STATE);
    pd_pool_destroy(used);
    fx_free(f);
}

static void alloc_and_free_move_counts(void **state) {
    (void)state;
    fixture *f = fx_new(true);
    uint32_t pages[10];
    assert_ok(pd_ledger_alloc(f->l, f->kv_id, 10, 7, pages));
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_REQ), 10);
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_FREE), 54);
    assert_int_equal(pd_pool_free_count(f->kv), 54);
    assert_int_equal(pd_ledger_owner_units(f->l, f->kv_id, PD_UNIT_REQ, 7), 10);
    assert_int_equal(pd_ledger_owner_of(f->l, f->kv_id, pages[3]), 7);
    assert_clean(f);
    assert_ok(pd_ledger_free(f->l, f->kv_id, pages, 10, PD_UNIT_REQ, 7));
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_FREE), 64);
    assert_int_equal(pd_ledger_owner_of(f->l, f->kv_id, pages[3]), PD_OWNER_NONE);
    assert_clean(f);
    fx_free(f);
}

static void freeing_a_free_unit_is_refused_at_the_call(void **state) {
    (void)state;
    fixture *f = fx_new(true);
    uint32_t slot;
    assert_ok(pd_ledger_alloc(f->l, f->mamba_id, 1, 3, &slot));
    assert_ok(pd_ledger_free(f->l, f->mamba_id, &slot, 1, PD_UNIT_REQ, 3));
    assert_err(pd_ledger_free(f->l, f->mamba_id, &slot, 1, PD_UNIT_REQ, 3), PD_ERR_STATE);
    assert_non_null(strstr(pd_ledger_last_error(f->l), "expected req(3) but is free"));
    assert_int_equal(pd_pool_free_count(f->mamba), 6);
    assert_clean(f);
    fx_free(f);
}

static void releasing_as_the_wrong_owner_is_refused(void **state) {
    (void)state;
    fixture *f = fx_new(true);
    uint32_t pages[4];
    assert_ok(pd_ledger_alloc(f->l, f->kv_id, 4, /*A*/ 11, pages));
    assert_err(pd_ledger_free(f->l, f->kv_id, pages, 4, PD_UNIT_REQ, /*B*/ 12), PD_ERR_STATE);
    assert_non_null(strstr(pd_ledger_last_error(f->l), "expected req(12) but is req(11)"));
    assert_err(pd_ledger_move(f->l, f->kv_id, pages, 4, PD_UNIT_REQ, 12,
                              PD_UNIT_QUARANTINE, 99), PD_ERR_STATE);
    /* Nothing changed. */
    assert_int_equal(pd_ledger_owner_units(f->l, f->kv_id, PD_UNIT_REQ, 11), 4);
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_QUARANTINE), 0);
    assert_clean(f);
    fx_free(f);
}

static void non_strict_mode_still_catches_wrong_states(void **state) {
    (void)state;
    fixture *f = fx_new(false);
    uint32_t rows[2];
    assert_ok(pd_ledger_alloc(f->l, f->row_id, 2, 1, rows));
    /* Owners are not tracked, so another owner's release goes through ... */
    assert_ok(pd_ledger_free(f->l, f->row_id, rows, 1, PD_UNIT_REQ, 2));
    /* ... but a second release of the same unit does not. */
    assert_err(pd_ledger_free(f->l, f->row_id, rows, 1, PD_UNIT_REQ, 1), PD_ERR_STATE);
    assert_int_equal(pd_ledger_owner_units(f->l, f->row_id, PD_UNIT_REQ, 1), 0);
    assert_clean(f);
    fx_free(f);
}

static void array_calls_are_all_or_nothing(void **state) {
    (void)state;
    fixture *f = fx_new(true);
    uint32_t p[3];
    assert_ok(pd_ledger_alloc(f->l, f->kv_id, 3, 5, p));
    uint32_t dup[3] = {p[0], p[1], p[0]};
    assert_err(pd_ledger_free(f->l, f->kv_id, dup, 3, PD_UNIT_REQ, 5), PD_ERR_STATE);
    assert_int_equal(pd_ledger_owner_units(f->l, f->kv_id, PD_UNIT_REQ, 5), 3);
    assert_int_equal(pd_pool_free_count(f->kv), 61);
    uint32_t foreign[2] = {p[2], 64};
    assert_err(pd_ledger_move(f->l, f->kv_id, foreign, 2, PD_UNIT_REQ, 5,
                              PD_UNIT_CACHE_EVICTABLE, PD_OWNER_CACHE), PD_ERR_STATE);
    assert_non_null(strstr(pd_ledger_last_error(f->l), "has no unit 64"));
    assert_int_equal(pd_ledger_state_of(f->l, f->kv_id, p[2]), PD_UNIT_REQ);
    assert_clean(f);
    fx_free(f);
}

/* The counting ledger (the production setting) checks states in a loop of
 * its own and moves the counters once per call: a refused array call must
 * still leave every state and every counter as it found them. */
static void counting_ledger_array_calls_are_all_or_nothing(void **state) {
    (void)state;
    fixture *f = fx_new(false);
    uint32_t p[3];
    assert_ok(pd_ledger_alloc(f->l, f->kv_id, 3, 5, p));
    uint32_t dup[3] = {p[0], p[1], p[0]};
    assert_err(pd_ledger_free(f->l, f->kv_id, dup, 3, PD_UNIT_REQ, 5), PD_ERR_STATE);
    assert_non_null(strstr(pd_ledger_last_error(f->l), "expected req"));
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_REQ), 3);
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_FREE), 61);
    assert_int_equal(pd_pool_free_count(f->kv), 61);
    uint32_t foreign[2] = {p[2], 64};
    assert_err(pd_ledger_move(f->l, f->kv_id, foreign, 2, PD_UNIT_REQ, 5, PD_UNIT_CACHE_EVICTABLE,
                              PD_OWNER_CACHE),
               PD_ERR_STATE);
    assert_non_null(strstr(pd_ledger_last_error(f->l), "has no unit 64"));
    for (int i = 0; i < 3; i++)
        assert_int_equal(pd_ledger_state_of(f->l, f->kv_id, p[i]), PD_UNIT_REQ);
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_CACHE_EVICTABLE), 0);
    assert_ok(pd_ledger_move(f->l, f->kv_id, p, 3, PD_UNIT_REQ, 5, PD_UNIT_CACHE_EVICTABLE,
                             PD_OWNER_CACHE));
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_REQ), 0);
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_CACHE_EVICTABLE), 3);
    assert_ok(pd_ledger_free(f->l, f->kv_id, p, 3, PD_UNIT_CACHE_EVICTABLE, PD_OWNER_CACHE));
    assert_clean(f);
    fx_free(f);
}

static void moves_to_or_from_free_and_freeing_protected_are_refused(void **state) {
    (void)state;
    fixture *f = fx_new(true);
    uint32_t p[2];
    assert_ok(pd_ledger_alloc(f->l, f->kv_id, 2, 5, p));
    assert_err(pd_ledger_move(f->l, f->kv_id, p, 2, PD_UNIT_REQ, 5, PD_UNIT_FREE, 0), PD_ERR_STATE);
    assert_ok(pd_ledger_move(f->l, f->kv_id, p, 2, PD_UNIT_REQ, 5, PD_UNIT_CACHE_PROTECTED,
                             PD_OWNER_CACHE));
    assert_err(pd_ledger_free(f->l, f->kv_id, p, 2, PD_UNIT_CACHE_PROTECTED, PD_OWNER_CACHE),
               PD_ERR_STATE);
    assert_ok(pd_ledger_move(f->l, f->kv_id, p, 2, PD_UNIT_CACHE_PROTECTED, PD_OWNER_CACHE,
                             PD_UNIT_CACHE_EVICTABLE, PD_OWNER_CACHE));
    assert_ok(pd_ledger_free(f->l, f->kv_id, p, 2, PD_UNIT_CACHE_EVICTABLE, PD_OWNER_CACHE));
    assert_err(pd_ledger_alloc_as(f->l, f->kv_id, 1, PD_UNIT_FREE, 0, p), PD_ERR_STATE);
    assert_clean(f);
    fx_free(f);
}

static void quarantine_is_released_by_its_room_only(void **state) {
    (void)state;
    fixture *f = fx_new(true);
    uint32_t p[4];
    assert_ok(pd_ledger_alloc(f->l, f->kv_id, 4, 8, p));
    assert_ok(pd_ledger_move(f->l, f->kv_id, p, 4, PD_UNIT_REQ, 8, PD_UNIT_QUARANTINE, 0xABCD));
    assert_err(pd_ledger_free(f->l, f->kv_id, p, 4, PD_UNIT_QUARANTINE, 0xABCE), PD_ERR_STATE);
    assert_err(pd_ledger_free(f->l, f->kv_id, p, 4, PD_UNIT_REQ, 8), PD_ERR_STATE);
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_QUARANTINE), 4);
    assert_ok(pd_ledger_free(f->l, f->kv_id, p, 4, PD_UNIT_QUARANTINE, 0xABCD));
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_FREE), 64);
    assert_clean(f);
    fx_free(f);
}

static void alloc_beyond_capacity_changes_nothing(void **state) {
    (void)state;
    fixture *f = fx_new(true);
    uint32_t p[65];
    assert_err(pd_ledger_alloc(f->l, f->kv_id, 65, 1, p), PD_ERR_NOMEM);
    assert_non_null(strstr(pd_ledger_last_error(f->l), "64 free, 65 asked"));
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_FREE), 64);
    assert_clean(f);
    fx_free(f);
}

static void check_finds_pool_bypassing_the_ledger(void **state) {
    (void)state;
    fixture *f = fx_new(true);
    uint32_t p[2];
    assert_ok(pd_ledger_alloc(f->l, f->kv_id, 2, 1, p));
    /* A bug frees a page behind the ledger's back. */
    assert_ok(pd_pool_free(f->kv, p[0]));
    char buf[4096];
    assert_err(check(f, NULL, false, buf, sizeof(buf)), PD_ERR_INTERNAL);
    assert_non_null(strstr(buf, "ledger counts 62 free, the pool 63"));
    assert_non_null(strstr(buf, "ledger says req, the pool bitmap says free"));
    uint32_t again;
    assert_ok(pd_pool_alloc(f->kv, &again));
    assert_int_equal(again, p[0]);
    assert_clean(f);
    fx_free(f);
}

static void check_compares_with_the_cache_sums(void **state) {
    (void)state;
    fixture *f = fx_new(true);
    uint32_t p[5];
    assert_ok(pd_ledger_alloc(f->l, f->kv_id, 5, 1, p));
    assert_ok(pd_ledger_move(f->l, f->kv_id, p, 3, PD_UNIT_REQ, 1, PD_UNIT_CACHE_EVICTABLE, 0));
    assert_ok(pd_ledger_move(f->l, f->kv_id, p + 3, 2, PD_UNIT_REQ, 1, PD_UNIT_CACHE_PROTECTED, 0));
    pd_cache_sums sums = {0};
    char buf[4096];
    /* No cache view: the cache "holds nothing", which is wrong. */
    assert_err(check(f, NULL, false, buf, sizeof(buf)), PD_ERR_INTERNAL);
    assert_non_null(strstr(buf, "ledger counts 3 cache-evictable, the prefix cache 0"));
    sums.evictable[f->kv_id] = 3;
    sums.protected_[f->kv_id] = 1;
    assert_err(check(f, &sums, false, buf, sizeof(buf)), PD_ERR_INTERNAL);
    assert_non_null(strstr(buf, "ledger counts 2 cache-protected, the prefix cache 1"));
    sums.protected_[f->kv_id] = 2;
    assert_ok(check(f, &sums, false, buf, sizeof(buf)));
    fx_free(f);
}

static bool describe(void *ctx, pd_owner owner, pd_owner_desc *d) {
    (void)ctx;
    if (owner != 7) return false;
    snprintf(d->rid, sizeof(d->rid), "req-7");
    d->room = 4242;
    snprintf(d->state, sizeof(d->state), "PREFILL");
    snprintf(d->terminal, sizeof(d->terminal), "aborted");
    return true;
}

static void idle_check_names_the_culprit(void **state) {
    (void)state;
    fixture *f = fx_new(true);
    uint32_t p[6], slots[3], row, q[2];
    assert_ok(pd_ledger_alloc(f->l, f->kv_id, 6, 7, p));
    assert_ok(pd_ledger_alloc(f->l, f->mamba_id, 3, 7, slots));
    assert_ok(pd_ledger_alloc(f->l, f->row_id, 1, 7, &row));
    assert_ok(pd_ledger_alloc(f->l, f->kv_id, 2, 9, q));
    assert_ok(pd_ledger_move(f->l, f->kv_id, q, 2, PD_UNIT_REQ, 9, PD_UNIT_QUARANTINE, 555));
    char buf[8192];
    pd_strbuf sb;
    pd_strbuf_init(&sb, buf, sizeof(buf));
    pd_check_opts o = {.expect_idle = true, .deep = true, .describe = describe};
    assert_err(pd_ledger_check(f->l, &o, &sb), PD_ERR_INTERNAL);
    assert_non_null(strstr(buf, "pool kv: idle but 6 units held by requests"));
    assert_non_null(strstr(buf, "pool kv: idle but 2 units in quarantine"));
    assert_non_null(strstr(buf, "pool row: idle but 1 of 4 rows in use"));
    assert_non_null(strstr(buf, "REQ owner 7 (rid=req-7 room=4242 state=PREFILL terminal=aborted) "
                                "holds kv 6 [0-5]; row 1 [0]; mamba 3 [0-2]"));
    assert_non_null(strstr(buf, "QUARANTINE room 555 holds kv 2 [6-7]"));
    /* Not idle: conservation alone holds. */
    o.expect_idle = false;
    pd_strbuf_reset(&sb);
    assert_ok(pd_ledger_check(f->l, &o, &sb));
    fx_free(f);
}

static void json_report_parses_and_groups_by_owner(void **state) {
    (void)state;
    fixture *f = fx_new(true);
    uint32_t p[5], m;
    assert_ok(pd_ledger_alloc(f->l, f->kv_id, 5, 7, p));
    assert_ok(pd_ledger_alloc(f->l, f->meta_id, 1, 7, &m));
    assert_ok(pd_ledger_free(f->l, f->kv_id, p + 2, 1, PD_UNIT_REQ, 7));
    char buf[8192];
    pd_strbuf sb;
    pd_strbuf_init(&sb, buf, sizeof(buf));
    pd_ledger_report(f->l, PD_REPORT_JSON, describe, NULL, &sb);
    json_error_t jerr;
    json_t *root = json_loads(buf, 0, &jerr);
    if (!root) fail_msg("report is not JSON (%s): %s", jerr.text, buf);
    json_t *pools = json_object_get(root, "pools");
    assert_int_equal(json_array_size(pools), 4);
    json_t *kv = json_array_get(pools, 0);
    assert_int_equal(json_integer_value(json_object_get(kv, "req")), 4);
    assert_int_equal(json_integer_value(json_object_get(kv, "free")), 60);
    json_t *holders = json_object_get(root, "holders");
    assert_int_equal(json_array_size(holders), 1);
    json_t *h = json_array_get(holders, 0);
    assert_string_equal(json_string_value(json_object_get(h, "rid")), "req-7");
    json_t *hk = json_object_get(json_object_get(h, "pools"), "kv");
    assert_int_equal(json_integer_value(json_object_get(hk, "units")), 4);
    json_t *ranges = json_object_get(hk, "ranges");
    assert_int_equal(json_array_size(ranges), 2); /* [0,1] and [3,4] */
    assert_int_equal(json_integer_value(json_array_get(json_array_get(ranges, 1), 0)), 3);
    assert_non_null(json_object_get(json_object_get(h, "pools"), "meta"));
    json_decref(root);
    fx_free(f);
}

static void non_strict_report_says_owners_unknown(void **state) {
    (void)state;
    fixture *f = fx_new(false);
    uint32_t p[2];
    assert_ok(pd_ledger_alloc(f->l, f->kv_id, 2, 7, p));
    char buf[2048];
    pd_err e = check(f, NULL, true, buf, sizeof(buf));
    assert_err(e, PD_ERR_INTERNAL);
    assert_non_null(strstr(buf, "strict mode off"));
    fx_free(f);
}

/* A one-unit free takes the pool's single-unit path: the pool must end as
 * pd_pool_free_n(.., 1) leaves it, the run hints (I5) included, so every
 * later run allocation chooses what it would have. Judged against a twin
 * pool that frees through pd_pool_free_n. */
static void one_unit_frees_leave_the_pool_as_array_frees_do(void **state) {
    (void)state;
    enum { UNITS = 256, ROUNDS = 400 };
    fixture *f = fx_new(false);
    pd_pool *big, *twin;
    int big_id;
    assert_ok(pd_pool_create(&big, "big", PD_POOL_KV, UNITS, 16));
    assert_ok(pd_pool_create(&twin, "twin", PD_POOL_KV, UNITS, 16));
    assert_ok(pd_ledger_add_pool(f->l, big, &big_id));
    static bool held[UNITS];
    memset(held, 0, sizeof(held));
    pd_rng rng;
    pd_rng_seed(&rng, test_seed(13));
    uint32_t got[32], want[32];
    char msg[256];
    for (uint32_t round = 0; round < ROUNDS; round++) {
        uint32_t k = 1 + (uint32_t)pd_rng_below(&rng, 24);
        if (pd_pool_free_count(big) >= k && pd_rng_below(&rng, 3) != 0) {
            assert_ok(pd_ledger_alloc(f->l, big_id, k, 1, got));
            assert_ok(pd_pool_alloc_n(twin, k, want));
            assert_memory_equal(got, want, k * sizeof(uint32_t));
            for (uint32_t i = 0; i < k; i++) held[got[i]] = true;
        }
        for (uint32_t i = 0, frees = (uint32_t)pd_rng_below(&rng, 12); i < frees; i++) {
            uint32_t u = (uint32_t)pd_rng_below(&rng, UNITS);
            if (!held[u]) continue;
            assert_ok(pd_ledger_free(f->l, big_id, &u, 1, PD_UNIT_REQ, 1));
            assert_ok(pd_pool_free_n(twin, &u, 1));
            held[u] = false;
        }
        assert_int_equal(pd_pool_free_count(big), pd_pool_free_count(twin));
        if (pd_pool_verify(big, msg, sizeof(msg)) != PD_OK) fail_msg("%s", msg);
    }
    uint32_t u = UNITS; /* out of range: refused, nothing changes */
    assert_err(pd_ledger_free(f->l, big_id, &u, 1, PD_UNIT_REQ, 1), PD_ERR_STATE);
    assert_clean(f);
    fx_free(f);
    pd_pool_destroy(big);
    pd_pool_destroy(twin);
}

/* The counting ledger's one-unit allocs and frees take a short path
 * (transition_one); the strict ledger's go the general way. The same random
 * one-unit calls on both, refusals included (a unit freed from a state it is
 * not in, an empty pool): the same results, units, states and counters, and
 * both pass the deep check (L1 recounts the state bytes, L3 the bitmap). */
static void counting_one_unit_calls_match_the_strict_ledger(void **state) {
    (void)state;
    enum { UNITS = 6, OPS = 3000 };
    fixture *fc = fx_new(false), *fs = fx_new(true);
    static const pd_unit_state held_as[] = {PD_UNIT_REQ, PD_UNIT_CACHE_EVICTABLE,
                                            PD_UNIT_QUARANTINE};
    pd_unit_state st[UNITS];
    for (int i = 0; i < UNITS; i++) st[i] = PD_UNIT_FREE;
    pd_rng rng;
    pd_rng_seed(&rng, test_seed(14));
    for (int op = 0; op < OPS; op++) {
        uint32_t u = (uint32_t)pd_rng_below(&rng, UNITS), got_c = PD_NONE, got_s = PD_NONE;
        pd_unit_state from = held_as[pd_rng_below(&rng, 3)];
        pd_owner who = from == PD_UNIT_REQ ? 7 : from == PD_UNIT_QUARANTINE ? 9 : PD_OWNER_CACHE;
        pd_err ec, es;
        switch (pd_rng_below(&rng, 3)) {
        case 0: /* alloc: NOMEM once the 6 units are out */
            ec = pd_ledger_alloc(fc->l, fc->mamba_id, 1, 7, &got_c);
            es = pd_ledger_alloc(fs->l, fs->mamba_id, 1, 7, &got_s);
            assert_int_equal(ec, es);
            if (ec == PD_OK) {
                assert_int_equal(got_c, got_s);
                st[got_c] = PD_UNIT_REQ;
            }
            break;
        case 1: /* a held unit to another state, so that frees from each occur */
            if (st[u] != PD_UNIT_REQ || from == PD_UNIT_REQ) break;
            assert_ok(pd_ledger_move(fc->l, fc->mamba_id, &u, 1, PD_UNIT_REQ, 7, from, who));
            assert_ok(pd_ledger_move(fs->l, fs->mamba_id, &u, 1, PD_UNIT_REQ, 7, from, who));
            st[u] = from;
            break;
        default: /* free from a random state: refused unless the unit is in it */
            ec = pd_ledger_free(fc->l, fc->mamba_id, &u, 1, from, who);
            es = pd_ledger_free(fs->l, fs->mamba_id, &u, 1, from, who);
            assert_int_equal(ec, es);
            assert_int_equal(ec, st[u] == from ? PD_OK : PD_ERR_STATE);
            if (ec == PD_OK) st[u] = PD_UNIT_FREE;
        }
        for (uint32_t i = 0; i < UNITS; i++) {
            assert_int_equal(pd_ledger_state_of(fc->l, fc->mamba_id, i), st[i]);
            assert_int_equal(pd_ledger_state_of(fs->l, fs->mamba_id, i), st[i]);
        }
        for (int s = 0; s < PD_UNIT_STATE__COUNT; s++)
            assert_int_equal(pd_ledger_count(fc->l, fc->mamba_id, (pd_unit_state)s),
                             pd_ledger_count(fs->l, fs->mamba_id, (pd_unit_state)s));
        assert_int_equal(pd_pool_free_count(fc->mamba), pd_pool_free_count(fs->mamba));
        /* The deep check, the model's evictable units as the cache's sums. */
        pd_cache_sums sums;
        memset(&sums, 0, sizeof(sums));
        for (uint32_t i = 0; i < UNITS; i++)
            sums.evictable[fc->mamba_id] += st[i] == PD_UNIT_CACHE_EVICTABLE;
        char buf[4096];
        if (check(fc, &sums, false, buf, sizeof(buf)) != PD_OK) fail_msg("counting: %s", buf);
        if (check(fs, &sums, false, buf, sizeof(buf)) != PD_OK) fail_msg("strict: %s", buf);
    }
    fx_free(fc);
    fx_free(fs);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(add_pool_refuses_duplicates_and_used_pools),
        cmocka_unit_test(alloc_and_free_move_counts),
        cmocka_unit_test(freeing_a_free_unit_is_refused_at_the_call),
        cmocka_unit_test(releasing_as_the_wrong_owner_is_refused),
        cmocka_unit_test(non_strict_mode_still_catches_wrong_states),
        cmocka_unit_test(array_calls_are_all_or_nothing),
        cmocka_unit_test(counting_ledger_array_calls_are_all_or_nothing),
        cmocka_unit_test(moves_to_or_from_free_and_freeing_protected_are_refused),
        cmocka_unit_test(quarantine_is_released_by_its_room_only),
        cmocka_unit_test(alloc_beyond_capacity_changes_nothing),
        cmocka_unit_test(check_finds_pool_bypassing_the_ledger),
        cmocka_unit_test(check_compares_with_the_cache_sums),
        cmocka_unit_test(idle_check_names_the_culprit),
        cmocka_unit_test(json_report_parses_and_groups_by_owner),
        cmocka_unit_test(non_strict_report_says_owners_unknown),
        cmocka_unit_test(one_unit_frees_leave_the_pool_as_array_frees_do),
        cmocka_unit_test(counting_one_unit_calls_match_the_strict_ledger),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
