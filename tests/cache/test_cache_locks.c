/*
 * The prefix cache's locks against a naive reference, under random
 * operations.
 *
 * The cache keeps its locks path-compressed (src/cache/cache.c: a node
 * counts the locks taken on it plus its locked children, and a lock or an
 * unlock stops at the first node whose lock state does not change). The
 * reference is the definition instead: a list of the locks held, each a
 * prefix of one of a few documents. A node is covered by every held lock
 * whose prefix extends the node's prefix, and it is locked exactly when one
 * covers it. After every operation each node's covering count, the locks
 * taken on it, its pages' ledger state (protected exactly when locked) and
 * the cache's own invariants (pd_cache_verify, which recounts the
 * compressed counts) are compared with the reference.
 *
 * Documents share long prefixes over a four-token alphabet, so matches and
 * inserts split nodes on locked paths all the time; locks move down paths
 * (pd_cache_lock_move) as a chunked prefill moves its lock. An unlock of a
 * node that only a lock below it covers must be refused and change nothing.
 *
 * PD_TEST_SEED overrides the seed.
 */
#include "cache_fixture.h"

#define PS 2
#define DOC_PAGES 10
#define DOCS 6
#define HELD_MAX 24
#define KV_PAGES 96

typedef struct lheld {
    pd_cnode node;
    uint32_t doc, pages; /* the lock's prefix: docs[doc][0, pages * PS) */
} lheld;

typedef struct lref {
    cfx *f;
    pd_rng rng;
    int32_t docs[DOCS][DOC_PAGES * PS];
    lheld held[HELD_MAX];
    uint32_t n_held;
    uint64_t checked_nodes, refused_unlocks, moves;
} lref;

/* Held locks whose prefix extends the node's (the node's prefix is tokens
 * [0, end)); and those taken on the node itself. */
static void reference_counts(const lref *m, const pd_cnode_info *in, uint32_t *cover,
                             uint32_t *here) {
    *cover = *here = 0;
    for (uint32_t i = 0; i < m->n_held; i++) {
        const lheld *h = &m->held[i];
        *here += h->node == in->node;
        if (h->pages * PS < in->end_tokens) continue;
        if (memcmp(m->docs[h->doc], in->prefix, in->end_tokens * sizeof(int32_t)) == 0) (*cover)++;
    }
}

static void check_node(void *ctx, const pd_cnode_info *in) {
    lref *m = ctx;
    uint32_t cover, here;
    reference_counts(m, in, &cover, &here);
    assert_int_equal(in->lock_ref, cover);
    assert_int_equal(in->locks, here);
    pd_unit_state want = cover > 0 ? PD_UNIT_CACHE_PROTECTED : PD_UNIT_CACHE_EVICTABLE;
    for (uint32_t i = 0; in->on_dev && i < in->pages; i++)
        assert_int_equal(pd_ledger_state_of(m->f->l, m->f->kv_id, in->dev_pages[i]), want);
    m->checked_nodes++;
}

static void check_all(lref *m) {
    cfx_check(m->f, false);
    pd_cache_walk(m->f->c, check_node, m);
}

/* A prefix of a document, matched and locked where the match ends (the root
 * when nothing matched), as an admitted request does. */
static void op_lock(lref *m) {
    if (m->n_held == HELD_MAX) return;
    uint32_t doc = (uint32_t)pd_rng_below(&m->rng, DOCS);
    uint32_t len = 1 + (uint32_t)pd_rng_below(&m->rng, DOC_PAGES);
    uint32_t pages[DOC_PAGES];
    pd_cache_match_result r;
    assert_ok(pd_cache_match(m->f->c, m->docs[doc], len * PS, pages, DOC_PAGES, &r));
    assert_ok(pd_cache_lock(m->f->c, r.dev_node));
    m->held[m->n_held++] = (lheld){.node = r.dev_node, .doc = doc, .pages = r.dev_tokens / PS};
}

static void op_unlock(lref *m) {
    if (m->n_held == 0) return;
    uint32_t i = (uint32_t)pd_rng_below(&m->rng, m->n_held);
    assert_ok(pd_cache_unlock(m->f->c, m->held[i].node));
    m->held[i] = m->held[--m->n_held];
}

/* A computed prefix of a document goes into the cache (owner 1's pages). */
static void op_insert(lref *m) {
    uint32_t doc = (uint32_t)pd_rng_below(&m->rng, DOCS);
    uint32_t len = 1 + (uint32_t)pd_rng_below(&m->rng, DOC_PAGES);
    if (pd_pool_free_count(m->f->kv) < len) {
        assert_ok(pd_cache_evict(m->f->c, len, NULL));
        if (pd_pool_free_count(m->f->kv) < len) return; /* everything locked */
    }
    (void)cfx_insert(m->f, 1, m->docs[doc], len, PD_POOL_NONE);
}

/* A held lock moves down its document, as a chunk insert moves it: the
 * longer prefix is matched (its node is below the held one) and the lock
 * moves there. */
static void op_move(lref *m) {
    if (m->n_held == 0) return;
    lheld *h = &m->held[pd_rng_below(&m->rng, m->n_held)];
    uint32_t len = h->pages + (uint32_t)pd_rng_below(&m->rng, DOC_PAGES - h->pages + 1);
    if (len == 0) return;
    uint32_t pages[DOC_PAGES];
    pd_cache_match_result r;
    assert_ok(pd_cache_match(m->f->c, m->docs[h->doc], len * PS, pages, DOC_PAGES, &r));
    assert_true(r.dev_tokens >= h->pages * PS); /* the held prefix is locked: still there */
    assert_ok(pd_cache_lock_move(m->f->c, h->node, r.dev_node));
    h->node = r.dev_node;
    h->pages = r.dev_tokens / PS;
    m->moves++;
}

typedef struct covered_only {
    pd_cnode node;
} covered_only;

static void find_covered_only(void *ctx, const pd_cnode_info *in) {
    covered_only *q = ctx;
    if (q->node == PD_CNODE_NONE && in->lock_ref > 0 && in->locks == 0) q->node = in->node;
}

/* A node locked only by locks below it: unlocking it is refused, and the
 * cache (clock, tree, locks, stamps) is left as it was. */
static void op_bad_unlock(lref *m) {
    covered_only q = {PD_CNODE_NONE};
    pd_cache_walk(m->f->c, find_covered_only, &q);
    if (q.node == PD_CNODE_NONE) return;
    uint64_t clock = pd_cache_clock(m->f->c);
    assert_err(pd_cache_unlock(m->f->c, q.node), PD_ERR_STATE);
    assert_int_equal(pd_cache_clock(m->f->c), clock);
    m->refused_unlocks++;
}

static void docs_init(lref *m) {
    /* Each document copies a random prefix of an earlier one, then goes its
     * own way: many shared prefixes of every length. */
    for (uint32_t d = 0; d < DOCS; d++) {
        uint32_t shared = d == 0 ? 0 : (uint32_t)pd_rng_below(&m->rng, DOC_PAGES * PS);
        uint32_t from = d == 0 ? 0 : (uint32_t)pd_rng_below(&m->rng, d);
        for (uint32_t i = 0; i < DOC_PAGES * PS; i++)
            m->docs[d][i] = i < shared ? m->docs[from][i] : (int32_t)pd_rng_below(&m->rng, 4);
    }
}

static void locks_match_the_naive_reference(void **state) {
    (void)state;
    static lref m;
    memset(&m, 0, sizeof(m));
    uint64_t seed = test_seed(0x10C5);
    for (int round = 0; round < 40; round++) {
        pd_rng_seed(&m.rng, seed + (uint64_t)round);
        m.f = cfx_new(PS, KV_PAGES, 0, 0);
        m.n_held = 0;
        docs_init(&m);
        for (int op = 0; op < 400; op++) {
            uint32_t k = (uint32_t)pd_rng_below(&m.rng, 100);
            if (k < 30) op_insert(&m);
            else if (k < 55) op_lock(&m);
            else if (k < 75) op_unlock(&m);
            else if (k < 90) op_move(&m);
            else if (k < 95) op_bad_unlock(&m);
            else assert_ok(pd_cache_evict(m.f->c, 1 + (uint32_t)pd_rng_below(&m.rng, 8), NULL));
            check_all(&m);
        }
        while (m.n_held > 0) {
            op_unlock(&m);
            check_all(&m);
        }
        pd_cache_clear(m.f->c);
        cfx_check(m.f, true);
        cfx_free(m.f);
    }
    /* The operations did what the test is for. */
    assert_true(m.checked_nodes > 10000);
    assert_true(m.refused_unlocks > 50);
    assert_true(m.moves > 500);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(locks_match_the_naive_reference),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
