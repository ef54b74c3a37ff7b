/* Base containers: pd_index against a brute-force reference under random
 * inserts and removals (colliding tags included), and pd_list's links. */
#include <stdlib.h>

#include "../test_util.h"
#include "pdserve/index.h"
#include "pdserve/list.h"

enum { N = 500 };

typedef struct rec {
    uint64_t key;
    bool in;
    pd_link link;
} rec;

/* Few distinct hashes, so long probe runs and wrap-around get exercised. */
static uint64_t key_hash(uint64_t key) { return pd_hash_u64(key % 37) ^ (key % 37); }

static uint64_t rec_hash(const void *ctx, uint32_t v) {
    return key_hash(((const rec *)ctx)[v].key);
}

static uint32_t lookup(const pd_index *ix, const rec *r, uint64_t key) {
    pd_index_probe p;
    for (uint32_t v = pd_index_first(ix, key_hash(key), &p); v != PD_NONE;
         v = pd_index_next(ix, &p))
        if (r[v].key == key) return v;
    return PD_NONE;
}

static void index_matches_reference_under_churn(void **state) {
    (void)state;
    static rec r[N];
    pd_index ix;
    assert_int_equal(pd_index_init(&ix, N, rec_hash, r), PD_OK);
    pd_rng rng;
    pd_rng_seed(&rng, 7);
    for (uint32_t i = 0; i < N; i++) r[i] = (rec){.key = 1000 + i};
    for (int step = 0; step < 20000; step++) {
        uint32_t i = (uint32_t)pd_rng_below(&rng, N);
        if (r[i].in) {
            pd_index_remove(&ix, key_hash(r[i].key), i);
            r[i].in = false;
        } else {
            pd_index_insert(&ix, key_hash(r[i].key), i);
            r[i].in = true;
        }
        if (step % 97 == 0) {
            uint32_t live = 0;
            for (uint32_t k = 0; k < N; k++) {
                live += r[k].in;
                assert_int_equal(lookup(&ix, r, r[k].key), r[k].in ? k : PD_NONE);
            }
            assert_int_equal(ix.n, live);
        }
    }
    assert_int_equal(lookup(&ix, r, 5), PD_NONE);
    pd_index_clear(&ix);
    for (uint32_t k = 0; k < N; k++) assert_int_equal(lookup(&ix, r, r[k].key), PD_NONE);
    pd_index_free(&ix);
    assert_int_equal(pd_index_init(&ix, 0, rec_hash, r), PD_ERR_INVALID);
    pd_index_free(&ix);
}

static void list_keeps_order_and_length(void **state) {
    (void)state;
    rec r[6];
    pd_links ls = PD_LINKS(r, rec, link);
    pd_list l;
    pd_list_init(&l);
    for (uint32_t i = 0; i < 6; i++) pd_link_init(&r[i].link);
    pd_list_push_back(&l, ls, 1);
    pd_list_push_back(&l, ls, 2);
    pd_list_push_front(&l, ls, 0);
    pd_list_insert_after(&l, ls, 2, 3);
    pd_list_insert_after(&l, ls, 0, 4); /* 0 4 1 2 3 */
    uint32_t want[] = {0, 4, 1, 2, 3}, got = 0;
    for (uint32_t i = l.head; i != PD_NONE; i = r[i].link.next) assert_int_equal(i, want[got++]);
    assert_int_equal(got, 5);
    assert_int_equal(l.len, 5);
    assert_int_equal(l.tail, 3);
    pd_list_remove(&l, ls, 0);
    pd_list_remove(&l, ls, 3);
    pd_list_remove(&l, ls, 1); /* 4 2 */
    assert_int_equal(l.head, 4);
    assert_int_equal(l.tail, 2);
    assert_int_equal(r[4].link.next, 2);
    assert_int_equal(r[2].link.prev, 4);
    assert_int_equal(l.len, 2);
    assert_int_equal(r[1].link.prev, PD_NONE);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(index_matches_reference_under_churn),
        cmocka_unit_test(list_keeps_order_and_length),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
