/* Prefix cache operations one by one: match, insert (duplicates, splits),
 * locks, LRU eviction, Mamba snapshots, host write-back and loads. After each
 * test step the ledger is checked against the cache's sums and the tree's
 * invariants are recomputed from scratch. */
#include "cache_fixture.h"

static void seq(int32_t *t, uint32_t n, int32_t base) {
    for (uint32_t i = 0; i < n; i++) t[i] = base + (int32_t)i;
}

static void match_on_empty_cache_finds_nothing(void **state) {
    (void)state;
    cfx *f = cfx_new(4, 32, 0, 0);
    int32_t t[16];
    seq(t, 16, 100);
    uint32_t pages[4];
    pd_cache_match_result m;
    assert_ok(pd_cache_match(f->c, t, 16, pages, 4, &m));
    assert_int_equal(m.dev_tokens, 0);
    assert_int_equal(m.host_tokens, 0);
    assert_int_equal(m.dev_node, PD_CNODE_ROOT);
    assert_int_equal(m.mamba_slot, PD_POOL_NONE);
    assert_err(pd_cache_match(f->c, t, 16, pages, 3, &m), PD_ERR_INVALID);
    cfx_check(f, true);
    cfx_free(f);
}

static void insert_then_match_returns_the_same_pages(void **state) {
    (void)state;
    cfx *f = cfx_new(4, 32, 0, 0);
    int32_t t[18];
    seq(t, 18, 1);
    uint32_t pages[4], dups[4];
    cfx_compute(f, 1, t, 0, 4, pages);
    uint32_t orig[4];
    memcpy(orig, pages, sizeof(orig));
    pd_cache_insert_result r;
    assert_ok(pd_cache_insert(f->c, t, 16, pages, 1, PD_POOL_NONE, dups, &r));
    assert_int_equal(r.covered_tokens, 16);
    assert_int_equal(r.dup_pages, 0);
    assert_memory_equal(pages, orig, sizeof(orig));
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_CACHE_EVICTABLE), 4);
    assert_int_equal(pd_ledger_owner_units(f->l, f->kv_id, PD_UNIT_REQ, 1), 0);
    cfx_check(f, true);

    uint32_t got[4];
    pd_cache_match_result m;
    /* 18 tokens: the partial last page (2 tokens) is never matched. */
    assert_ok(pd_cache_match(f->c, t, 18, got, 4, &m));
    assert_int_equal(m.dev_tokens, 16);
    assert_int_equal(m.dev_node, r.node);
    assert_memory_equal(got, orig, sizeof(orig));
    /* A prefix that diverges inside the third page matches two pages and
     * splits the node so that a node ends exactly there. */
    int32_t u[16];
    memcpy(u, t, sizeof(u));
    u[9] = -5;
    assert_ok(pd_cache_match(f->c, u, 16, got, 4, &m));
    assert_int_equal(m.dev_tokens, 8);
    assert_int_not_equal(m.dev_node, r.node);
    assert_memory_equal(got, orig, 2 * sizeof(uint32_t));
    pd_cache_stats st;
    pd_cache_stats_get(f->c, &st);
    assert_int_equal(st.nodes, 2);
    cfx_check(f, true);
    cfx_free(f);
}

static void insert_returns_duplicates_and_substitutes_cached_pages(void **state) {
    (void)state;
    cfx *f = cfx_new(2, 32, 0, 0);
    int32_t t[12];
    seq(t, 12, 7);
    pd_cache_insert_result r1 = cfx_insert(f, 1, t, 3, PD_POOL_NONE);
    uint32_t cached[6];
    pd_cache_match_result m;
    assert_ok(pd_cache_match(f->c, t, 6, cached, 6, &m));
    /* A second request computed the same 3 pages plus 3 more. */
    uint32_t pages[6], dups[6];
    cfx_compute(f, 2, t, 0, 6, pages);
    uint32_t mine[6];
    memcpy(mine, pages, sizeof(mine));
    pd_cache_insert_result r2;
    assert_ok(pd_cache_insert(f->c, t, 12, pages, 2, PD_POOL_NONE, dups, &r2));
    assert_int_equal(r2.dup_pages, 3);
    assert_memory_equal(dups, mine, 3 * sizeof(uint32_t));
    assert_memory_equal(pages, cached, 3 * sizeof(uint32_t));
    assert_memory_equal(pages + 3, mine + 3, 3 * sizeof(uint32_t));
    assert_int_equal(r2.covered_tokens, 12);
    assert_int_not_equal(r2.node, r1.node);
    /* The duplicates are still the caller's until it frees them. */
    assert_int_equal(pd_ledger_owner_units(f->l, f->kv_id, PD_UNIT_REQ, 2), 3);
    assert_ok(pd_ledger_free(f->l, f->kv_id, dups, 3, PD_UNIT_REQ, 2));
    cfx_check(f, true);
    /* Re-inserting with the cache's own pages is not a duplicate. */
    pd_cache_insert_result r3;
    assert_ok(pd_cache_insert(f->c, t, 12, pages, 3, PD_POOL_NONE, dups, &r3));
    assert_int_equal(r3.dup_pages, 0);
    assert_int_equal(r3.node, r2.node);
    cfx_check(f, true);
    cfx_free(f);
}

static void lock_protects_a_path_from_eviction(void **state) {
    (void)state;
    cfx *f = cfx_new(4, 16, 0, 0);
    int32_t a[16], b[16];
    seq(a, 16, 0);
    seq(b, 16, 1000);
    pd_cache_insert_result ra = cfx_insert(f, 1, a, 4, PD_POOL_NONE);
    cfx_insert(f, 2, b, 4, PD_POOL_NONE);
    assert_ok(pd_cache_lock(f->c, ra.node));
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_CACHE_PROTECTED), 4);
    cfx_check(f, true);
    uint32_t freed;
    assert_ok(pd_cache_evict(f->c, 100, &freed));
    assert_int_equal(freed, 4); /* only b */
    uint32_t pages[4];
    pd_cache_match_result m;
    assert_ok(pd_cache_match(f->c, a, 16, pages, 4, &m));
    assert_int_equal(m.dev_tokens, 16);
    cfx_check(f, true);
    assert_ok(pd_cache_unlock(f->c, ra.node));
    assert_err(pd_cache_unlock(f->c, ra.node), PD_ERR_STATE);
    assert_ok(pd_cache_evict(f->c, 100, &freed));
    assert_int_equal(freed, 4);
    cfx_check(f, true);
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_FREE), 16);
    cfx_free(f);
}

static void lock_of_a_child_protects_its_ancestors(void **state) {
    (void)state;
    cfx *f = cfx_new(1, 16, 0, 0);
    int32_t t[8];
    seq(t, 8, 0);
    pd_cache_insert_result r4 = cfx_insert(f, 1, t, 4, PD_POOL_NONE);
    pd_cache_insert_result r8 = cfx_insert(f, 2, t, 8, PD_POOL_NONE);
    assert_int_not_equal(r4.node, r8.node);
    assert_ok(pd_cache_lock(f->c, r8.node));
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_CACHE_PROTECTED), 8);
    uint32_t freed;
    assert_ok(pd_cache_evict(f->c, 8, &freed));
    assert_int_equal(freed, 0);
    assert_ok(pd_cache_unlock(f->c, r8.node));
    cfx_check(f, true);
    cfx_free(f);
}

static void eviction_takes_least_recently_used_leaves_first(void **state) {
    (void)state;
    cfx *f = cfx_new(2, 64, 0, 0);
    int32_t x[8], y[8], z[8];
    seq(x, 8, 100);
    seq(y, 8, 200);
    seq(z, 8, 300);
    cfx_insert(f, 1, x, 4, PD_POOL_NONE);
    cfx_insert(f, 2, y, 4, PD_POOL_NONE);
    cfx_insert(f, 3, z, 4, PD_POOL_NONE);
    uint32_t pages[4];
    pd_cache_match_result m;
    assert_ok(pd_cache_match(f->c, x, 8, pages, 4, &m)); /* x is now the newest */
    uint32_t freed;
    assert_ok(pd_cache_evict(f->c, 1, &freed));
    assert_int_equal(freed, 4);
    assert_ok(pd_cache_match(f->c, y, 8, pages, 4, &m));
    assert_int_equal(m.dev_tokens, 0); /* y went first */
    assert_ok(pd_cache_match(f->c, z, 8, pages, 4, &m));
    assert_int_equal(m.dev_tokens, 8);
    assert_ok(pd_cache_match(f->c, x, 8, pages, 4, &m));
    assert_int_equal(m.dev_tokens, 8);
    cfx_check(f, true);
    cfx_free(f);
}

typedef struct ev_log {
    pd_evict_event ev[64];
    uint32_t n;
} ev_log;

static void log_evict(void *ctx, const pd_evict_event *ev) {
    ev_log *lg = ctx;
    if (lg->n < 64) lg->ev[lg->n++] = *ev;
}

/* pd_cache_evict_to: the evicted node's first pages go to the request
 * (REQ of its owner) instead of the pool, the rest of the node's to the pool;
 * with nothing evictable it takes nothing; bad arguments change nothing. */
static void evict_to_hands_the_evicted_pages_to_the_request(void **state) {
    (void)state;
    cfx *f = cfx_new(4, 16, 0, 0);
    int32_t x[16], y[16];
    seq(x, 16, 100);
    seq(y, 16, 200);
    cfx_insert(f, 1, x, 4, PD_POOL_NONE);
    pd_cache_insert_result ry = cfx_insert(f, 2, y, 4, PD_POOL_NONE);
    uint32_t xp[4], rest[8], out[8], taken = 99;
    pd_cache_match_result m;
    assert_ok(pd_cache_match(f->c, x, 16, xp, 4, &m));
    assert_ok(pd_cache_match(f->c, y, 16, out, 4, &m));     /* y is now the newer */
    assert_ok(pd_ledger_alloc(f->l, f->kv_id, 8, 9, rest)); /* the pool is empty */
    assert_int_equal(pd_pool_free_count(f->kv), 0);

    assert_ok(pd_cache_evict_to(f->c, 3, 5, out, &taken));
    assert_int_equal(taken, 3);
    assert_memory_equal(out, xp, 3 * sizeof(uint32_t)); /* x, the older, in page order */
    assert_int_equal(pd_ledger_owner_units(f->l, f->kv_id, PD_UNIT_REQ, 5), 3);
    assert_int_equal(pd_pool_free_count(f->kv), 1); /* x's last page went to the pool */
    assert_true(pd_pool_is_free(f->kv, xp[3]));
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_CACHE_EVICTABLE), 4);
    pd_cache_stats st;
    pd_cache_stats_get(f->c, &st);
    assert_int_equal(st.evicted_dev_pages, 4);
    assert_ok(pd_cache_match(f->c, x, 16, xp, 4, &m));
    assert_int_equal(m.dev_tokens, 0);
    cfx_check(f, false);

    /* Bad arguments: refused, nothing evicted. */
    assert_err(pd_cache_evict_to(NULL, 1, 5, out, &taken), PD_ERR_INVALID);
    assert_err(pd_cache_evict_to(f->c, 1, PD_OWNER_NONE, out, &taken), PD_ERR_INVALID);
    assert_err(pd_cache_evict_to(f->c, 1, 5, NULL, &taken), PD_ERR_INVALID);
    assert_err(pd_cache_evict_to(f->c, 1, 5, out, NULL), PD_ERR_INVALID);
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_CACHE_EVICTABLE), 4);

    /* Locked, y cannot go: nothing is taken. */
    assert_ok(pd_cache_lock(f->c, ry.node));
    assert_ok(pd_cache_evict_to(f->c, 2, 6, out + 3, &taken));
    assert_int_equal(taken, 0);
    assert_int_equal(pd_ledger_owner_units(f->l, f->kv_id, PD_UNIT_REQ, 6), 0);
    assert_ok(pd_cache_unlock(f->c, ry.node));
    /* Unlocked, all of y goes to the request and none to the pool. */
    assert_ok(pd_cache_evict_to(f->c, 4, 6, out + 3, &taken));
    assert_int_equal(taken, 4);
    assert_int_equal(pd_pool_free_count(f->kv), 1);
    assert_int_equal(pd_ledger_owner_units(f->l, f->kv_id, PD_UNIT_REQ, 6), 4);
    cfx_check(f, false);

    assert_ok(pd_ledger_free(f->l, f->kv_id, out, 3, PD_UNIT_REQ, 5));
    assert_ok(pd_ledger_free(f->l, f->kv_id, out + 3, 4, PD_UNIT_REQ, 6));
    assert_ok(pd_ledger_free(f->l, f->kv_id, rest, 8, PD_UNIT_REQ, 9));
    assert_int_equal(pd_pool_free_count(f->kv), 16);
    cfx_check(f, true);
    cfx_free(f);
}

static void eviction_goes_leaf_first_up_a_chain(void **state) {
    (void)state;
    ev_log lg = {0};
    cfx *f = cfx_new_ex(1, 16, 0, 0, false, log_evict, &lg);
    int32_t t[6];
    seq(t, 6, 0);
    cfx_insert(f, 1, t, 2, PD_POOL_NONE);
    cfx_insert(f, 2, t, 4, PD_POOL_NONE);
    cfx_insert(f, 3, t, 6, PD_POOL_NONE);
    uint32_t freed;
    assert_ok(pd_cache_evict(f->c, 6, &freed));
    assert_int_equal(freed, 6);
    assert_int_equal(lg.n, 3);
    assert_int_equal(lg.ev[0].end_tokens, 6);
    assert_int_equal(lg.ev[1].end_tokens, 4);
    assert_int_equal(lg.ev[2].end_tokens, 2);
    for (uint32_t i = 0; i < 3; i++) {
        assert_int_equal(lg.ev[i].kind, PD_EVICT_DEVICE);
        assert_true(lg.ev[i].node_deleted);
    }
    cfx_check(f, true);
    pd_cache_stats st;
    pd_cache_stats_get(f->c, &st);
    assert_int_equal(st.nodes, 0);
    cfx_free(f);
}

static void hybrid_match_stops_at_the_deepest_snapshot(void **state) {
    (void)state;
    cfx *f = cfx_new(4, 32, 4, 0);
    int32_t t[32];
    seq(t, 32, 50);
    uint32_t slot;
    assert_ok(pd_ledger_alloc(f->l, f->mamba_id, 1, 1, &slot));
    pd_cache_insert_result r = cfx_insert(f, 1, t, 2, slot);
    assert_true(r.mamba_taken);
    assert_int_equal(pd_ledger_state_of(f->l, f->mamba_id, slot), PD_UNIT_CACHE_EVICTABLE);
    cfx_insert(f, 2, t, 6, PD_POOL_NONE); /* deeper KV, no snapshot */
    uint32_t pages[8];
    pd_cache_match_result m;
    assert_ok(pd_cache_match(f->c, t, 32, pages, 8, &m));
    assert_int_equal(m.dev_tokens, 24);
    assert_int_equal(m.mamba_tokens, 8);
    assert_int_equal(m.mamba_node, r.node);
    assert_int_equal(m.mamba_slot, slot);
    /* A second snapshot at the same place is not taken: the caller frees it. */
    uint32_t slot2;
    assert_ok(pd_ledger_alloc(f->l, f->mamba_id, 1, 3, &slot2));
    pd_cache_insert_result r2 = cfx_insert(f, 3, t, 2, slot2);
    assert_false(r2.mamba_taken);
    assert_int_equal(pd_ledger_state_of(f->l, f->mamba_id, slot2), PD_UNIT_REQ);
    assert_ok(pd_ledger_free(f->l, f->mamba_id, &slot2, 1, PD_UNIT_REQ, 3));
    cfx_check(f, true);
    cfx_free(f);
}

static void snapshots_evict_alone_and_respect_their_lock(void **state) {
    (void)state;
    cfx *f = cfx_new(4, 32, 4, 0);
    int32_t t[16];
    seq(t, 16, 9);
    uint32_t slot;
    assert_ok(pd_ledger_alloc(f->l, f->mamba_id, 1, 1, &slot));
    pd_cache_insert_result r = cfx_insert(f, 1, t, 4, slot);
    /* Snapshot lock needs the node locked. */
    assert_err(pd_cache_mamba_lock(f->c, r.node), PD_ERR_STATE);
    assert_ok(pd_cache_lock(f->c, r.node));
    assert_ok(pd_cache_mamba_lock(f->c, r.node));
    assert_int_equal(pd_ledger_state_of(f->l, f->mamba_id, slot), PD_UNIT_CACHE_PROTECTED);
    uint32_t freed;
    assert_ok(pd_cache_evict_snapshots(f->c, 1, &freed));
    assert_int_equal(freed, 0);
    /* The last KV lock cannot go while the snapshot is locked. */
    assert_err(pd_cache_unlock(f->c, r.node), PD_ERR_STATE);
    cfx_check(f, true);
    assert_ok(pd_cache_mamba_unlock(f->c, r.node));
    assert_err(pd_cache_mamba_unlock(f->c, r.node), PD_ERR_STATE);
    assert_ok(pd_cache_unlock(f->c, r.node));
    assert_ok(pd_cache_evict_snapshots(f->c, 1, &freed));
    assert_int_equal(freed, 1);
    uint32_t pages[4];
    pd_cache_match_result m;
    assert_ok(pd_cache_match(f->c, t, 16, pages, 4, &m));
    assert_int_equal(m.dev_tokens, 16); /* KV stays */
    assert_int_equal(m.mamba_tokens, 0);
    assert_int_equal(pd_ledger_count(f->l, f->mamba_id, PD_UNIT_FREE), 4);
    cfx_check(f, true);
    cfx_free(f);
}

static void device_eviction_frees_the_snapshot_too(void **state) {
    (void)state;
    cfx *f = cfx_new(4, 8, 2, 0);
    int32_t t[16];
    seq(t, 16, 9);
    uint32_t slot;
    assert_ok(pd_ledger_alloc(f->l, f->mamba_id, 1, 1, &slot));
    cfx_insert(f, 1, t, 4, slot);
    uint32_t freed;
    assert_ok(pd_cache_evict(f->c, 4, &freed));
    assert_int_equal(pd_ledger_count(f->l, f->mamba_id, PD_UNIT_FREE), 2);
    cfx_check(f, true);
    cfx_free(f);
}

/* A match moves the snapshots on its path behind every other one, deepest
 * first, also when they lie apart in the snapshot list (the touch moves the
 * path's nodes in runs, issue 13): the list here holds c, d, b, a (the path
 * a-b-c with d, another prompt's, between c and b) before the last match
 * touches c, b, a. Snapshot eviction then takes d, c, b, a in that order. */
static void a_touch_moves_its_snapshots_behind_the_others_in_runs(void **state) {
    (void)state;
    ev_log lg = {0};
    cfx *f = cfx_new_ex(4, 32, 4, 0, false, log_evict, &lg);
    int32_t t[12], u[16];
    seq(t, 12, 1000);
    seq(u, 16, 2000);
    uint32_t slot[4];
    for (int i = 0; i < 4; i++) assert_ok(pd_ledger_alloc(f->l, f->mamba_id, 1, 1, &slot[i]));
    cfx_insert(f, 1, t, 1, slot[0]); /* a: ends at 4 tokens */
    cfx_insert(f, 1, t, 2, slot[1]); /* b: 8 */
    cfx_insert(f, 1, t, 3, slot[2]); /* c: 12 */
    cfx_insert(f, 1, u, 4, slot[3]); /* d: 16 */
    uint32_t pages[4];
    pd_cache_match_result m;
    assert_ok(pd_cache_match(f->c, t, 12, pages, 4, &m)); /* d c b a */
    assert_ok(pd_cache_match(f->c, u, 16, pages, 4, &m)); /* c b a d */
    assert_ok(pd_cache_match(f->c, t, 8, pages, 4, &m));  /* c d b a */
    assert_int_equal(m.mamba_tokens, 8);
    assert_ok(pd_cache_match(f->c, t, 12, pages, 4, &m)); /* d c b a */
    assert_int_equal(m.mamba_tokens, 12);
    cfx_check(f, true);
    uint32_t freed;
    assert_ok(pd_cache_evict_snapshots(f->c, 4, &freed));
    assert_int_equal(freed, 4);
    assert_int_equal(lg.n, 4);
    const uint32_t want[4] = {16, 12, 8, 4};
    for (uint32_t i = 0; i < 4; i++) {
        assert_int_equal(lg.ev[i].kind, PD_EVICT_SNAPSHOT);
        assert_int_equal(lg.ev[i].end_tokens, want[i]);
    }
    cfx_check(f, true);
    cfx_free(f);
}

static void write_back_and_load_round_trip_the_data(void **state) {
    (void)state;
    cfx *f = cfx_new(4, 8, 0, 16);
    int32_t t[16];
    seq(t, 16, 3);
    uint32_t orig[4], dups[4];
    cfx_compute(f, 1, t, 0, 4, orig);
    uint64_t content[4];
    for (int i = 0; i < 4; i++) content[i] = f->dev_mem[orig[i]];
    uint32_t pages[4];
    memcpy(pages, orig, sizeof(pages));
    pd_cache_insert_result r;
    assert_ok(pd_cache_insert(f->c, t, 16, pages, 1, PD_POOL_NONE, dups, &r));
    uint32_t freed;
    assert_ok(pd_cache_evict(f->c, 4, &freed));
    assert_int_equal(freed, 4);
    assert_int_equal(f->copies_to_host, 4);
    assert_int_equal(pd_ledger_count(f->l, f->host_id, PD_UNIT_CACHE_EVICTABLE), 4);
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_FREE), 8);
    for (uint32_t i = 0; i < 8; i++) f->dev_mem[i] = 0; /* device memory reused */
    cfx_check(f, true);

    pd_cache_match_result m;
    assert_ok(pd_cache_match(f->c, t, 16, pages, 4, &m));
    assert_int_equal(m.dev_tokens, 0);
    assert_int_equal(m.host_tokens, 16);
    /* Loading requires the caller's lock on the host node. */
    uint32_t dev[4], host[4], n;
    pd_cache_ticket tk;
    assert_err(pd_cache_load_begin(f->c, m.host_node, 9, dev, host, 4, &n, &tk), PD_ERR_STATE);
    assert_ok(pd_cache_lock(f->c, m.host_node));
    assert_ok(pd_cache_load_begin(f->c, m.host_node, 9, dev, host, 4, &n, &tk));
    assert_int_equal(n, 4);
    assert_int_equal(pd_ledger_owner_units(f->l, f->kv_id, PD_UNIT_REQ, 9), 4);
    assert_int_equal(pd_cache_loads_in_flight(f->c), 1);
    /* While in flight the lock cannot be dropped and the node cannot be loaded again. */
    assert_err(pd_cache_unlock(f->c, m.host_node), PD_ERR_STATE);
    uint32_t n2;
    pd_cache_ticket tk2;
    assert_err(pd_cache_load_begin(f->c, m.host_node, 10, dev, host, 4, &n2, &tk2), PD_ERR_STATE);
    cfx_check(f, false); /* the load's pages are held by request 9: not idle */
    cfx_copy(f, PD_COPY_HOST_TO_DEV, dev, host, n);
    assert_ok(pd_cache_load_done(f->c, tk));
    assert_err(pd_cache_load_done(f->c, tk), PD_ERR_NOTFOUND);
    assert_int_equal(pd_ledger_owner_units(f->l, f->kv_id, PD_UNIT_REQ, 9), 0);
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_CACHE_PROTECTED), 4);
    assert_ok(pd_cache_match(f->c, t, 16, pages, 4, &m));
    assert_int_equal(m.dev_tokens, 16);
    for (int i = 0; i < 4; i++) assert_true(f->dev_mem[pages[i]] == content[i]);
    assert_ok(pd_cache_unlock(f->c, m.dev_node));
    cfx_check(f, true);
    cfx_free(f);
}

static void load_cancel_frees_device_pages_and_keeps_host(void **state) {
    (void)state;
    cfx *f = cfx_new(2, 8, 0, 8);
    int32_t t[8];
    seq(t, 8, 3);
    cfx_insert(f, 1, t, 4, PD_POOL_NONE);
    assert_ok(pd_cache_evict(f->c, 4, NULL));
    uint32_t pages[4], dev[4], host[4], n;
    pd_cache_match_result m;
    assert_ok(pd_cache_match(f->c, t, 8, pages, 4, &m));
    assert_int_equal(m.host_tokens, 8);
    assert_ok(pd_cache_lock(f->c, m.host_node));
    pd_cache_ticket tk;
    assert_ok(pd_cache_load_begin(f->c, m.host_node, 5, dev, host, 4, &n, &tk));
    /* Another request computed the same prefix meanwhile: its insert stops
     * before the node being loaded and the pages stay its own. */
    uint32_t mine[4], dups[4];
    cfx_compute(f, 6, t, 0, 4, mine);
    pd_cache_insert_result r;
    assert_ok(pd_cache_insert(f->c, t, 8, mine, 6, PD_POOL_NONE, dups, &r));
    assert_int_equal(r.covered_tokens, 0);
    assert_int_equal(pd_ledger_owner_units(f->l, f->kv_id, PD_UNIT_REQ, 6), 4);
    assert_ok(pd_ledger_free(f->l, f->kv_id, mine, 4, PD_UNIT_REQ, 6));
    cfx_check(f, false);
    /* The requester is aborted: cancel, then unlock. */
    assert_ok(pd_cache_load_cancel(f->c, tk));
    assert_int_equal(pd_ledger_owner_units(f->l, f->kv_id, PD_UNIT_REQ, 5), 0);
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_FREE), 8);
    assert_ok(pd_cache_unlock(f->c, m.host_node));
    assert_ok(pd_cache_match(f->c, t, 8, pages, 4, &m));
    assert_int_equal(m.dev_tokens, 0);
    assert_int_equal(m.host_tokens, 8);
    cfx_check(f, true);
    cfx_free(f);
}

static void insert_adopts_computed_pages_for_host_only_nodes(void **state) {
    (void)state;
    cfx *f = cfx_new(2, 8, 0, 8);
    int32_t t[8];
    seq(t, 8, 3);
    cfx_insert(f, 1, t, 4, PD_POOL_NONE);
    assert_ok(pd_cache_evict(f->c, 4, NULL));
    pd_cache_insert_result r = cfx_insert(f, 2, t, 4, PD_POOL_NONE);
    assert_int_equal(r.covered_tokens, 8);
    assert_int_equal(r.dup_pages, 0);
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_CACHE_EVICTABLE), 4);
    assert_int_equal(pd_ledger_count(f->l, f->host_id, PD_UNIT_CACHE_EVICTABLE), 4);
    uint32_t pages[4];
    pd_cache_match_result m;
    assert_ok(pd_cache_match(f->c, t, 8, pages, 4, &m));
    assert_int_equal(m.dev_tokens, 8);
    cfx_check(f, true);
    cfx_free(f);
}

static void host_pool_pressure_evicts_older_host_copies(void **state) {
    (void)state;
    cfx *f = cfx_new(2, 4, 0, 4);
    int32_t a[8], b[8];
    seq(a, 8, 10);
    seq(b, 8, 90);
    cfx_insert(f, 1, a, 4, PD_POOL_NONE);
    assert_ok(pd_cache_evict(f->c, 4, NULL)); /* a -> host */
    cfx_insert(f, 2, b, 4, PD_POOL_NONE);
    assert_ok(pd_cache_evict(f->c, 4, NULL)); /* b -> host, a dropped */
    uint32_t pages[4];
    pd_cache_match_result m;
    assert_ok(pd_cache_match(f->c, a, 8, pages, 4, &m));
    assert_int_equal(m.dev_tokens + m.host_tokens, 0);
    assert_ok(pd_cache_match(f->c, b, 8, pages, 4, &m));
    assert_int_equal(m.host_tokens, 8);
    cfx_check(f, true);
    pd_cache_clear(f->c);
    cfx_check(f, true);
    assert_int_equal(pd_ledger_count(f->l, f->host_id, PD_UNIT_FREE), 4);
    cfx_free(f);
}

static void clear_returns_every_unit(void **state) {
    (void)state;
    cfx *f = cfx_new(3, 30, 3, 10);
    pd_rng rng;
    pd_rng_seed(&rng, 5);
    for (int i = 0; i < 20; i++) {
        int32_t t[30];
        for (int j = 0; j < 30; j++) t[j] = (int32_t)pd_rng_below(&rng, 3);
        uint32_t np = (uint32_t)pd_rng_range(&rng, 1, 5);
        if (pd_pool_free_count(f->kv) < np) assert_ok(pd_cache_evict(f->c, np, NULL));
        uint32_t slot = PD_POOL_NONE;
        if (pd_pool_free_count(f->mamba) == 0) assert_ok(pd_cache_evict_snapshots(f->c, 1, NULL));
        assert_ok(pd_ledger_alloc(f->l, f->mamba_id, 1, 100 + (pd_owner)i, &slot));
        pd_cache_insert_result r = cfx_insert(f, 100 + (pd_owner)i, t, np, slot);
        if (!r.mamba_taken)
            assert_ok(pd_ledger_free(f->l, f->mamba_id, &slot, 1, PD_UNIT_REQ, 100 + (pd_owner)i));
        cfx_check(f, true);
    }
    pd_cache_clear(f->c);
    cfx_check(f, true);
    assert_int_equal(pd_ledger_count(f->l, f->kv_id, PD_UNIT_FREE), 30);
    assert_int_equal(pd_ledger_count(f->l, f->mamba_id, PD_UNIT_FREE), 3);
    assert_int_equal(pd_ledger_count(f->l, f->host_id, PD_UNIT_FREE), 10);
    cfx_free(f);
}

/* A lookup tries the child its parent went to last (the hot child) before
 * hashing. An evicted child's entries keep their tokens on the free list, so
 * a hot link left pointing at it would match the same prompt again into
 * freed pages. */
static void evicted_child_is_not_matched_again(void **state) {
    (void)state;
    cfx *f = cfx_new(4, 32, 0, 0);
    int32_t x[8];
    seq(x, 8, 100);
    cfx_insert(f, 1, x, 2, PD_POOL_NONE);
    uint32_t pages[2], freed;
    pd_cache_match_result m;
    assert_ok(pd_cache_match(f->c, x, 8, pages, 2, &m));
    assert_int_equal(m.dev_tokens, 8);
    assert_ok(pd_cache_evict(f->c, 2, &freed));
    assert_int_equal(freed, 2);
    assert_ok(pd_cache_match(f->c, x, 8, pages, 2, &m));
    assert_int_equal(m.dev_tokens, 0);
    assert_int_equal(m.dev_node, PD_CNODE_ROOT);
    cfx_check(f, true);
    cfx_free(f);
}

/* A split moves a node one level down (its first part becomes a new parent
 * in its place). A root lookup for the page the moved node now starts with
 * must not find it at the root. */
static void split_child_is_not_found_above_its_new_parent(void **state) {
    (void)state;
    cfx *f = cfx_new(4, 32, 0, 0);
    int32_t x[4], w[8], v[8];
    seq(x, 4, 100);
    seq(w, 4, 500);
    memcpy(w + 4, x, sizeof(x)); /* w = [W0, X0] */
    memcpy(v, w, sizeof(v));
    v[4] = -1; /* v = [W0, Y0]: diverges from w in its second page */
    pd_cache_insert_result rw = cfx_insert(f, 1, w, 2, PD_POOL_NONE);
    pd_cache_insert_result rv = cfx_insert(f, 2, v, 2, PD_POOL_NONE);
    assert_int_equal(rv.covered_tokens, 8);
    /* w's node now holds [X0] alone, below the new node holding [W0]. */
    uint32_t pages[2];
    pd_cache_match_result m;
    assert_ok(pd_cache_match(f->c, x, 4, pages, 2, &m));
    assert_int_equal(m.dev_tokens, 0);
    assert_ok(pd_cache_match(f->c, w, 8, pages, 2, &m));
    assert_int_equal(m.dev_tokens, 8);
    assert_int_equal(m.dev_node, rw.node);
    cfx_check(f, true);
    cfx_free(f);
}

static void insert_refuses_unaligned_length(void **state) {
    (void)state;
    cfx *f = cfx_new(4, 8, 0, 0);
    int32_t t[6] = {0};
    uint32_t pages[2], dups[2];
    pd_cache_insert_result r;
    assert_err(pd_cache_insert(f->c, t, 6, pages, 1, PD_POOL_NONE, dups, &r), PD_ERR_INVALID);
    /* A mamba slot, but the cache has no mamba pool. */
    assert_err(pd_cache_insert(f->c, t, 4, pages, 1, 0, dups, &r), PD_ERR_INVALID);
    cfx_check(f, true);
    cfx_free(f);
}

/* The parent of a node, through the inspection walk. */
typedef struct parent_q {
    pd_cnode node, parent;
} parent_q;

static void find_parent(void *ctx, const pd_cnode_info *in) {
    parent_q *q = ctx;
    if (in->node == q->node) q->parent = in->parent;
}

static pd_cnode N_parent(cfx *f, pd_cnode node) {
    parent_q q = {node, PD_CNODE_NONE};
    pd_cache_walk(f->c, find_parent, &q);
    return q.parent;
}

/* ---- insert from a locked node, lock moves --------------------------------- */

/* Everything a walk reports of a node, folded into *ctx. */
static void fold_node(void *ctx, const pd_cnode_info *in) {
    uint64_t *h = ctx;
    uint64_t v[] = {in->node,       in->parent,    in->end_tokens, in->pages,
                    in->on_dev,     in->on_host,   in->lock_ref,   in->mamba_lock,
                    in->mamba_slot, in->stamp_dev, in->stamp_host, in->stamp_mamba};
    for (size_t i = 0; i < sizeof(v) / sizeof(v[0]); i++) *h = (*h ^ v[i]) * 0x100000001B3ull;
    for (uint32_t i = 0; in->dev_pages && i < in->pages; i++)
        *h = (*h ^ in->dev_pages[i]) * 0x100000001B3ull;
}

static uint64_t cache_state(cfx *f) {
    uint64_t h = 0xCBF29CE484222325ull ^ pd_cache_clock(f->c);
    pd_cache_walk(f->c, fold_node, &h);
    return h;
}

/* How chunk_insert inserts and moves the lock. */
enum { BY_ROOT, BY_MOVE, BY_LOCKED };
static uint32_t g_locked_inserts; /* chunk inserts pd_cache_insert_locked took */

/* One chunk of a request: pages [from, to) computed, then inserted and the
 * lock moved down: BY_ROOT from the root with a lock and an unlock, BY_MOVE
 * with pd_cache_insert_from and pd_cache_lock_move, BY_LOCKED with
 * pd_cache_insert_locked (one walk; where it refuses, as BY_MOVE). */
static void chunk_insert(cfx *f, int how, pd_owner owner, const int32_t *t, uint32_t *pages,
                         uint32_t from, uint32_t to, pd_cnode *lock) {
    uint32_t dups[64];
    pd_cache_insert_result r;
    cfx_compute(f, owner, t, from, to - from, pages + from);
    bool fast = how != BY_ROOT, moved = false;
    pd_cnode start = fast ? *lock : PD_CNODE_ROOT;
    if (how == BY_LOCKED) {
        pd_err err = pd_cache_insert_locked(f->c, start, t, to * f->ps, pages, owner, PD_POOL_NONE,
                                            dups, &r);
        if (err != PD_ERR_INVALID) assert_ok(err);
        moved = err == PD_OK;
        g_locked_inserts += moved;
    }
    if (!moved)
        assert_ok(
            pd_cache_insert_from(f->c, start, t, to * f->ps, pages, owner, PD_POOL_NONE, dups, &r));
    if (r.dup_pages)
        assert_ok(pd_ledger_free(f->l, f->kv_id, dups, r.dup_pages, PD_UNIT_REQ, owner));
    uint32_t covered = r.covered_tokens / f->ps;
    if (covered < to)
        assert_ok(
            pd_ledger_free(f->l, f->kv_id, pages + covered, to - covered, PD_UNIT_REQ, owner));
    if (moved) {
        *lock = r.node;
        return;
    }
    if (r.node == *lock) return;
    if (fast) {
        assert_ok(pd_cache_lock_move(f->c, *lock, r.node));
    } else {
        assert_ok(pd_cache_lock(f->c, r.node));
        assert_ok(pd_cache_unlock(f->c, *lock));
    }
    *lock = r.node;
}

/* Requests whose prompts share three system prompts, computed in two chunks,
 * replayed through three caches: one inserts each chunk from the root and
 * moves its lock by a lock and an unlock, one inserts from the node the
 * request holds and moves the lock along the path, one does both in one
 * walk (pd_cache_insert_locked). The three must stay identical after every
 * step (nodes, pages, locks, stamps, clock, and so what hits and what is
 * evicted). */
static void insert_from_lock_matches_insert_from_root(void **state) {
    (void)state;
    enum { K = 3 };
    cfx *f[K] = {cfx_new(2, 160, 0, 0), cfx_new(2, 160, 0, 0), cfx_new(2, 160, 0, 0)};
    uint64_t rng = 12345;
    int32_t t[48];
    uint32_t pages[K][24];
    for (pd_owner req = 1; req <= 400; req++) {
        rng = rng * 6364136223846793005ull + 1442695040888963407ull;
        uint32_t n = 4 + (uint32_t)(rng >> 59) % 20, sys = (uint32_t)(rng >> 40) % 3;
        for (uint32_t i = 0; i < 2 * n; i++)
            t[i] = i < 16 ? (int32_t)(sys * 100 + i) : (int32_t)(req * 7 + i);
        uint32_t cut = 1 + (uint32_t)(rng >> 20) % (n - 1);
        pd_cnode lock[K];
        uint32_t cached = 0;
        for (int k = 0; k < K; k++) {
            pd_cache_match_result m;
            assert_ok(pd_cache_match(f[k]->c, t, 2 * n, pages[k], 24, &m));
            cached = m.dev_tokens / 2;
            lock[k] = m.dev_node;
            assert_ok(pd_cache_lock(f[k]->c, lock[k]));
            if (pd_pool_free_count(f[k]->kv) < n - cached)
                assert_ok(pd_cache_evict(f[k]->c, n - cached, NULL));
            if (pd_pool_free_count(f[k]->kv) < n - cached) fail_msg("pool too small");
            uint32_t mid = cut > cached ? cut : cached;
            chunk_insert(f[k], k, req, t, pages[k], cached, mid, &lock[k]);
            chunk_insert(f[k], k, req, t, pages[k], mid, n, &lock[k]);
        }
        for (int k = 1; k < K; k++) assert_true(cache_state(f[0]) == cache_state(f[k]));
        if (req % 50 == 0)
            for (int k = 0; k < K; k++) cfx_check(f[k], false);
        for (int k = 0; k < K; k++) assert_ok(pd_cache_unlock(f[k]->c, lock[k]));
        for (int k = 1; k < K; k++) assert_true(cache_state(f[0]) == cache_state(f[k]));
        if (req % 50 == 0)
            for (int k = 0; k < K; k++) cfx_check(f[k], true);
    }
    for (int k = 0; k < K; k++) cfx_free(f[k]);
    assert_true(g_locked_inserts > 400); /* the one-walk insert was the one compared */
}

/* A snapshot read synchronously under a touch leaves the cache as a lock
 * and an unlock of it would: clock, list place, stamps; whether or not
 * another holder has the snapshot locked meanwhile. */
static void mamba_touch_is_a_lock_and_an_unlock(void **state) {
    (void)state;
    cfx *f[2] = {cfx_new(2, 64, 8, 0), cfx_new(2, 64, 8, 0)};
    int32_t t[3][8];
    pd_cnode node[2][3];
    for (int k = 0; k < 2; k++) {
        for (int d = 0; d < 3; d++) {
            seq(t[d], 8, 10 * d);
            uint32_t slot;
            assert_ok(pd_ledger_alloc(f[k]->l, f[k]->mamba_id, 1, 7, &slot));
            pd_cache_insert_result r = cfx_insert(f[k], 7, t[d], 4, slot);
            assert_true(r.mamba_taken);
            node[k][d] = r.node;
        }
        assert_err(pd_cache_mamba_touch(f[k]->c, node[k][0]), PD_ERR_STATE); /* not locked */
        assert_err(pd_cache_mamba_touch(f[k]->c, PD_CNODE_ROOT), PD_ERR_NOTFOUND);
        for (int d = 0; d < 3; d++) assert_ok(pd_cache_lock(f[k]->c, node[k][d]));
        assert_ok(pd_cache_mamba_lock(f[k]->c, node[k][2])); /* another holder */
    }
    for (int round = 0; round < 4; round++) {
        for (int d = 0; d < 3; d++) {
            int which = (round + d) % 3;
            assert_ok(pd_cache_mamba_lock(f[0]->c, node[0][which]));
            assert_ok(pd_cache_mamba_unlock(f[0]->c, node[0][which]));
            assert_ok(pd_cache_mamba_touch(f[1]->c, node[1][which]));
            assert_true(cache_state(f[0]) == cache_state(f[1]));
            cfx_check(f[1], false);
        }
    }
    for (int k = 0; k < 2; k++) {
        assert_ok(pd_cache_mamba_unlock(f[k]->c, node[k][2]));
        for (int d = 0; d < 3; d++) assert_ok(pd_cache_unlock(f[k]->c, node[k][d]));
        pd_cache_clear(f[k]->c);
        cfx_check(f[k], true);
        cfx_free(f[k]);
    }
}

/* A lock moves only down its own path; anything else is refused and changes
 * nothing. An insert whose start's pages are not the caller's walks from the
 * root and swaps the caller's duplicates as pd_cache_insert does. */
static void lock_move_and_insert_from_refuse_other_paths(void **state) {
    (void)state;
    cfx *f = cfx_new(4, 32, 0, 0);
    int32_t a[12], b[12];
    seq(a, 12, 100);
    seq(b, 12, 100);
    b[4] = -1; /* b shares a's first page only */
    pd_cache_insert_result ra = cfx_insert(f, 1, a, 3, PD_POOL_NONE);
    pd_cache_insert_result rb = cfx_insert(f, 2, b, 3, PD_POOL_NONE);
    pd_cnode top = N_parent(f, ra.node);
    assert_ok(pd_cache_lock(f->c, ra.node));
    uint64_t clock = pd_cache_clock(f->c);
    assert_err(pd_cache_lock_move(f->c, ra.node, rb.node), PD_ERR_INVALID); /* a sibling */
    assert_err(pd_cache_lock_move(f->c, ra.node, top), PD_ERR_INVALID);     /* upward */
    assert_err(pd_cache_lock_move(f->c, rb.node, ra.node), PD_ERR_STATE);   /* b not locked */
    assert_int_equal(pd_cache_clock(f->c), clock);
    cfx_check(f, false);
    /* Fresh pages of a's path handed with start = a's node: not the cache's,
     * so the insert walks from the root and returns all three as duplicates. */
    uint32_t pages[3], dups[3];
    cfx_compute(f, 3, a, 0, 3, pages);
    pd_cache_insert_result r;
    assert_ok(pd_cache_insert_from(f->c, ra.node, a, 12, pages, 3, PD_POOL_NONE, dups, &r));
    assert_int_equal(r.dup_pages, 3);
    assert_int_equal(r.node, ra.node);
    assert_ok(pd_ledger_free(f->l, f->kv_id, dups, 3, PD_UNIT_REQ, 3));
    assert_ok(pd_cache_unlock(f->c, ra.node));
    cfx_check(f, true);
    cfx_free(f);
}

/* Each node's walked fields and each 16-token page are one cache line
 * apiece: caches of several sizes (small ones from the heap, large ones
 * mapped) keep both arenas line-aligned, which pd_cache_verify checks; a
 * page straddling two lines cost every compare and every insert's copy a
 * second line. */
static void every_cache_keeps_its_node_and_token_arenas_line_aligned(void **state) {
    (void)state;
    const uint32_t sizes[] = {3, 5, 16, 17, 100, 1000, 4099, 65536};
    const uint32_t page_sizes[] = {1, 4, 16};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        for (size_t j = 0; j < sizeof(page_sizes) / sizeof(page_sizes[0]); j++) {
            uint32_t ps = page_sizes[j];
            cfx *f = cfx_new(ps, sizes[i], 0, i % 2 ? 7 : 0);
            int32_t t[32];
            seq(t, 2 * ps, (int32_t)(100 * i));
            pd_cache_insert_result r = cfx_insert(f, 1, t, PD_MIN(2u, sizes[i]), PD_POOL_NONE);
            assert_int_not_equal(r.node, PD_CNODE_ROOT);
            cfx_check(f, true);
            cfx_free(f);
        }
    }
}

/* The match guess and its prefetch are a hint: the guess reads no token
 * past the n it is given (prompts here are heap buffers of exactly that
 * size, so ASan sees a read past one), survives a hint that names a node
 * deleted or reused, and neither changes anything in the cache. The shape:
 * a two-page prefix with six continuations, more than a match scans child by
 * child, so a match past the prefix searches the child index and leaves its
 * hint there. */
static int32_t *prompt_of(uint32_t n, int32_t first, int32_t rest) {
    int32_t *t = malloc(n * sizeof(int32_t));
    for (uint32_t i = 0; i < n; i++) t[i] = i < 8 ? first + (int32_t)i : rest + (int32_t)i;
    return t;
}

/* The shape above, then a match of q (16 tokens of first token 100) past the
 * prefix: a table search, which leaves its hint at the prefix's end. */
static void six_continuations_matched(cfx *f, const int32_t *q) {
    for (int k = 0; k < 6; k++) {
        int32_t *t = prompt_of(16, 100, 1000 * (k + 1));
        cfx_insert(f, 1, t, 4, PD_POOL_NONE);
        free(t);
    }
    uint32_t pages[8];
    pd_cache_match_result m;
    assert_ok(pd_cache_match(f->c, q, 16, pages, 8, &m));
    assert_int_equal(m.dev_tokens, 8);
}

/* What the engine does with a prompt: the guess at submit, its prefetch at
 * the admission before. */
static void guess_and_prefetch(const pd_cache *c, const int32_t *tokens, uint32_t n) {
    pd_cache_guess g;
    pd_cache_match_guess(c, tokens, n, &g);
    pd_cache_guess_prefetch(c, g);
}

static void match_prefetch_is_only_a_hint(void **state) {
    (void)state;
    cfx *f = cfx_new(4, 256, 0, 0);
    int32_t *p0 = prompt_of(2, 100, 0);
    guess_and_prefetch(f->c, p0, 0); /* empty cache, no token, short prompt */
    guess_and_prefetch(f->c, p0, 2);
    int32_t *q = prompt_of(16, 100, 9000);
    uint32_t pages[8];
    pd_cache_match_result m;
    six_continuations_matched(f, q);
    pd_cache_stats before;
    pd_cache_stats_get(f->c, &before);
    uint64_t clock = pd_cache_clock(f->c);
    /* The hint names the prefix's end (8 tokens): prompts of that first
     * token ending before, at and after a page past it. */
    for (uint32_t n = 0; n <= 16; n++) {
        int32_t *t = prompt_of(n, 100, 5000);
        guess_and_prefetch(f->c, t, n);
        free(t);
    }
    pd_cache_stats after;
    pd_cache_stats_get(f->c, &after);
    assert_memory_equal(&before, &after, sizeof(before));
    assert_int_equal(pd_cache_clock(f->c), clock);
    cfx_check(f, true);
    /* The hinted node deleted, then its record reused: eight one-page paths
     * take the seven records the clear freed (the free list's front). */
    pd_cache_clear(f->c);
    guess_and_prefetch(f->c, q, 16);
    int32_t *r = NULL;
    for (int k = 0; k < 8; k++) {
        free(r);
        r = prompt_of(4, 300 + 10 * k, 0);
        cfx_insert(f, 1, r, 1, PD_POOL_NONE);
    }
    for (uint32_t n = 0; n <= 16; n++) {
        int32_t *t = prompt_of(n, 100, 7000);
        guess_and_prefetch(f->c, t, n);
        free(t);
    }
    assert_ok(pd_cache_match(f->c, r, 4, pages, 8, &m));
    assert_int_equal(m.dev_tokens, 4);
    cfx_check(f, true);
    free(p0);
    free(q);
    free(r);
    cfx_free(f);
}

/* The guess made at submit (pd_cache_match_guess) and asked for later
 * (pd_cache_guess_prefetch): no guess before any match searched the child
 * index, nor for a prompt that ends before a page past the hinted node; a
 * guess depends on the prompt's page there, not on what follows it; neither
 * half changes the cache, and a guess kept past a clear is harmless. */
static void match_guess_is_the_prefetch_in_two_halves(void **state) {
    (void)state;
    cfx *f = cfx_new(4, 256, 0, 0);
    pd_cache_guess g = {.key = 1};
    int32_t *q = prompt_of(16, 100, 9000);
    pd_cache_match_guess(f->c, q, 16, &g); /* empty cache: no hint yet */
    assert_int_equal(g.key, 0);
    pd_cache_match_guess(NULL, q, 16, &g);
    assert_int_equal(g.key, 0);
    pd_cache_match_guess(f->c, q, 16, NULL); /* nowhere to write: nothing */
    pd_cache_guess_prefetch(NULL, (pd_cache_guess){.key = 5});
    six_continuations_matched(f, q); /* leaves the hint at 8 tokens */
    pd_cache_stats before;
    pd_cache_stats_get(f->c, &before);
    uint64_t clock = pd_cache_clock(f->c);
    /* A page past the prefix's 8 tokens is needed: 12 tokens at least. */
    for (uint32_t n = 0; n <= 16; n++) {
        int32_t *t = prompt_of(n, 100, 5000);
        pd_cache_match_guess(f->c, t, n, &g);
        assert_true((g.key != 0) == (n >= 12));
        pd_cache_guess_prefetch(f->c, g);
        free(t);
    }
    /* The same page at the hinted depth, different tokens after it: the
     * same slot; another page there: another key. */
    int32_t *a = prompt_of(16, 100, 5000), *b = prompt_of(16, 100, 5000);
    b[13] = -7;
    pd_cache_guess ga, gb, gc;
    pd_cache_match_guess(f->c, a, 16, &ga);
    pd_cache_match_guess(f->c, b, 16, &gb);
    assert_true(ga.key != 0 && ga.key == gb.key);
    b[9] = -7;
    pd_cache_match_guess(f->c, b, 16, &gc);
    assert_true(gc.key != 0 && gc.key != ga.key);
    pd_cache_stats after;
    pd_cache_stats_get(f->c, &after);
    assert_memory_equal(&before, &after, sizeof(before));
    assert_int_equal(pd_cache_clock(f->c), clock);
    pd_cache_clear(f->c); /* the guess outlives what it named */
    pd_cache_guess_prefetch(f->c, ga);
    cfx_check(f, true);
    free(a);
    free(b);
    free(q);
    cfx_free(f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(match_on_empty_cache_finds_nothing),
        cmocka_unit_test(insert_then_match_returns_the_same_pages),
        cmocka_unit_test(insert_returns_duplicates_and_substitutes_cached_pages),
        cmocka_unit_test(lock_protects_a_path_from_eviction),
        cmocka_unit_test(lock_of_a_child_protects_its_ancestors),
        cmocka_unit_test(eviction_takes_least_recently_used_leaves_first),
        cmocka_unit_test(evict_to_hands_the_evicted_pages_to_the_request),
        cmocka_unit_test(eviction_goes_leaf_first_up_a_chain),
        cmocka_unit_test(hybrid_match_stops_at_the_deepest_snapshot),
        cmocka_unit_test(snapshots_evict_alone_and_respect_their_lock),
        cmocka_unit_test(device_eviction_frees_the_snapshot_too),
        cmocka_unit_test(a_touch_moves_its_snapshots_behind_the_others_in_runs),
        cmocka_unit_test(write_back_and_load_round_trip_the_data),
        cmocka_unit_test(load_cancel_frees_device_pages_and_keeps_host),
        cmocka_unit_test(insert_adopts_computed_pages_for_host_only_nodes),
        cmocka_unit_test(host_pool_pressure_evicts_older_host_copies),
        cmocka_unit_test(clear_returns_every_unit),
        cmocka_unit_test(insert_refuses_unaligned_length),
        cmocka_unit_test(evicted_child_is_not_matched_again),
        cmocka_unit_test(split_child_is_not_found_above_its_new_parent),
        cmocka_unit_test(insert_from_lock_matches_insert_from_root),
        cmocka_unit_test(lock_move_and_insert_from_refuse_other_paths),
        cmocka_unit_test(mamba_touch_is_a_lock_and_an_unlock),
        cmocka_unit_test(every_cache_keeps_its_node_and_token_arenas_line_aligned),
        cmocka_unit_test(match_prefetch_is_only_a_hint),
        cmocka_unit_test(match_guess_is_the_prefetch_in_two_halves),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
