/*
 * Model-based randomized test of the prefix cache.
 *
 * The reference model is deliberately naive: a table with one record per
 * cached page position, keyed by the whole token prefix that ends with that
 * page. Each record says where that page lives (device page, host page, a
 * load in flight), how many locks cover it, whether a Mamba snapshot ends
 * there, and its recency stamps. Node boundaries, splits, hash tables and
 * LRU lists do not exist in the model.
 *
 * Every operation is applied to both. Match and insert results are predicted
 * by the model and compared exactly. Evictions are chosen by the cache and
 * judged by the model as they happen (through the eviction observer): the
 * victim must be eligible (unlocked, a leaf of the right kind) and no
 * eligible candidate may be older. After every operation the whole tree is
 * compared with the model, the ledger is checked against the cache's sums
 * (deep: per-unit states and pool bitmaps too) and the cache's structural
 * invariants are recomputed.
 *
 * At least 100,000 operations over several pool/page-size configurations.
 * PD_TEST_SEED overrides the seed; PD_CACHE_MODEL_OPS the operation count.
 */
#include "cache_fixture.h"

#define PENDING (UINT32_MAX - 1) /* host page chosen by the cache, not yet seen */
#define MAXP 48                  /* pages per query */
#define REF_CAP 8192

typedef struct rec {
    uint8_t used;     /* 0 empty, 1 live, 2 tombstone */
    uint32_t len;     /* pages */
    int32_t *tokens;
    uint64_t hash;
    uint32_t dev, host, snap;
    bool loading;
    uint32_t load_dev, load_ticket;
    uint32_t lock, mlock;
    uint64_t st_dev, st_host, st_mamba;
    /* scratch for eligibility scans */
    bool has_child, has_dev_child;
} rec;

typedef struct held {
    pd_cnode node;
    uint32_t len;          /* pages */
    int32_t tokens[MAXP * 4];
    bool mamba;            /* also holds the snapshot lock */
    bool loading;          /* a ticket of ours is in flight under this lock */
    pd_cache_ticket ticket;
    pd_owner owner;
} held;

typedef struct model {
    cfx *f;
    uint32_t ps;
    pd_rng rng;
    rec recs[REF_CAP];
    uint32_t n_recs, n_tomb;
    held held[16];
    uint32_t n_held;
    pd_owner next_owner;
    int32_t docs[6][MAXP * 4];
    uint32_t doc_len;
    /* eviction judging */
    int32_t victim[MAXP * 4 + 8];
    int32_t cascade_root[MAXP * 4 + 8];
    uint32_t cascade_len; /* 0: none */
    uint64_t events;
    uint64_t ops;
} model;

static model *M; /* the observer callback's context is the fixture; keep the model here */

/* ---- reference table ----------------------------------------------------- */

static uint64_t key_hash(const int32_t *t, uint32_t len_pages, uint32_t ps) {
    return pd_hash_tokens(t, (size_t)len_pages * ps, 77);
}

static rec *ref_find(model *m, const int32_t *t, uint32_t len) {
    uint64_t h = key_hash(t, len, m->ps);
    for (uint32_t i = (uint32_t)h & (REF_CAP - 1);; i = (i + 1) & (REF_CAP - 1)) {
        rec *r = &m->recs[i];
        if (r->used == 0) return NULL;
        if (r->used == 1 && r->hash == h && r->len == len &&
            memcmp(r->tokens, t, (size_t)len * m->ps * sizeof(int32_t)) == 0)
            return r;
    }
}

static void ref_rehash(model *m);

static rec *ref_add(model *m, const int32_t *t, uint32_t len) {
    assert_null(ref_find(m, t, len));
    if (m->n_recs + m->n_tomb > REF_CAP / 2) ref_rehash(m);
    uint64_t h = key_hash(t, len, m->ps);
    uint32_t i = (uint32_t)h & (REF_CAP - 1);
    while (m->recs[i].used == 1) i = (i + 1) & (REF_CAP - 1);
    rec *r = &m->recs[i];
    if (r->used == 2) m->n_tomb--;
    free(r->tokens);
    memset(r, 0, sizeof(*r));
    r->used = 1;
    r->len = len;
    r->hash = h;
    r->tokens = malloc((size_t)len * m->ps * sizeof(int32_t));
    memcpy(r->tokens, t, (size_t)len * m->ps * sizeof(int32_t));
    r->dev = r->host = r->snap = PD_NONE;
    r->load_dev = PD_NONE;
    m->n_recs++;
    return r;
}

static void ref_del(model *m, rec *r) {
    free(r->tokens);
    r->tokens = NULL;
    r->used = 2;
    m->n_recs--;
    m->n_tomb++;
}

static void ref_rehash(model *m) {
    rec *old = malloc(sizeof(rec) * REF_CAP);
    memcpy(old, m->recs, sizeof(rec) * REF_CAP);
    memset(m->recs, 0, sizeof(rec) * REF_CAP);
    m->n_tomb = 0;
    for (uint32_t i = 0; i < REF_CAP; i++) {
        if (old[i].used != 1) {
            free(old[i].used == 2 ? NULL : old[i].tokens);
            continue;
        }
        uint32_t j = (uint32_t)old[i].hash & (REF_CAP - 1);
        while (m->recs[j].used) j = (j + 1) & (REF_CAP - 1);
        m->recs[j] = old[i];
    }
    free(old);
}

/* Marks has_child / has_dev_child on every record. */
static void ref_scan_children(model *m) {
    for (uint32_t i = 0; i < REF_CAP; i++) m->recs[i].has_child = m->recs[i].has_dev_child = false;
    for (uint32_t i = 0; i < REF_CAP; i++) {
        rec *r = &m->recs[i];
        if (r->used != 1 || r->len < 2) continue;
        rec *p = ref_find(m, r->tokens, r->len - 1);
        assert_non_null(p);
        p->has_child = true;
        if (r->dev != PD_NONE) p->has_dev_child = true;
    }
}

/* ---- eviction judging (called by the cache as it evicts) ------------------- */

static bool is_prefix_of(const int32_t *a, uint32_t a_len, const int32_t *b, uint32_t b_len) {
    return a_len <= b_len && memcmp(a, b, a_len * sizeof(int32_t)) == 0;
}

/* The pages an eviction event covers: records first..end of m->victim. */
typedef struct victim_span {
    rec *last; /* the record of page `end` */
    uint32_t first, end;
    uint32_t end_tok;
    uint64_t clock;
} victim_span;

static void judge_device_eviction(model *m, const pd_evict_event *ev, const victim_span *v) {
    rec *last = v->last;
    uint32_t first = v->first, end = v->end, end_tok = v->end_tok;
    uint64_t clock = v->clock;
    m->cascade_len = 0;
    assert_true(last->dev != PD_NONE && last->lock == 0 && !last->loading);
    assert_false(last->has_dev_child);
    assert_true(ev->stamp == last->st_dev);
    for (uint32_t i = 0; i < REF_CAP; i++) {
        rec *r = &m->recs[i];
        if (r->used == 1 && r->dev != PD_NONE && r->lock == 0 && !r->has_dev_child)
            assert_true(last->st_dev <= r->st_dev); /* nothing older was eligible */
    }
    for (uint32_t p = first; p <= end; p++) {
        rec *r = ref_find(m, m->victim, p);
        assert_non_null(r);
        assert_true(r->dev != PD_NONE && r->lock == 0);
        if (r->snap != PD_NONE) {
            assert_int_equal(r->mlock, 0);
            r->snap = PD_NONE;
        }
        r->dev = PD_NONE;
        if (ev->written_back) {
            assert_true(r->host == PD_NONE);
            r->host = PENDING;
            r->st_host = clock;
        }
    }
    if (ev->node_deleted) {
        assert_false(ev->written_back);
        for (uint32_t p = first; p <= end; p++) {
            rec *r = ref_find(m, m->victim, p);
            assert_true(r->host == PD_NONE);
        }
        /* Its host-only subtree goes next, as cascade HOST events. */
        memcpy(m->cascade_root, m->victim, end_tok * sizeof(int32_t));
        m->cascade_len = end_tok;
        /* The node's own records go only once no child remains; with no
         * host copy they hold nothing, so drop them now unless children
         * still hang below (then the cascade removes them first). */
        if (!last->has_child)
            for (uint32_t p = first; p <= end; p++) ref_del(m, ref_find(m, m->victim, p));
    }
}

/* A cascade root whose last child just went disappears too. */
static void drop_emptied_cascade_root(model *m) {
    uint32_t root_pages = m->cascade_len / m->ps;
    rec *root = ref_find(m, m->cascade_root, root_pages);
    if (!root || root->dev != PD_NONE || root->host != PD_NONE) return;
    ref_scan_children(m);
    if (root->has_child) return;
    for (uint32_t p = root_pages; p >= 1; p--) {
        rec *r = ref_find(m, m->cascade_root, p);
        if (!r || r->dev != PD_NONE || r->host != PD_NONE || r->has_child) break;
        ref_del(m, r);
        ref_scan_children(m);
    }
}

static void judge_host_eviction(model *m, const pd_evict_event *ev, const victim_span *v) {
    rec *last = v->last;
    uint32_t first = v->first, end = v->end, end_tok = v->end_tok;
    bool cascade = m->cascade_len > 0 && end_tok > m->cascade_len &&
                   is_prefix_of(m->cascade_root, m->cascade_len, m->victim, end_tok);
    assert_true(last->host != PD_NONE && last->lock == 0 && !last->loading);
    assert_true(ev->node_deleted == (last->dev == PD_NONE));
    if (last->dev == PD_NONE) assert_false(last->has_child);
    if (!cascade) {
        assert_true(ev->stamp == last->st_host);
        for (uint32_t i = 0; i < REF_CAP; i++) {
            rec *r = &m->recs[i];
            if (r->used == 1 && r->host != PD_NONE && r->lock == 0 &&
                (r->dev != PD_NONE || !r->has_child))
                assert_true(last->st_host <= r->st_host);
        }
    } else {
        assert_true(ev->node_deleted);
    }
    for (uint32_t p = first; p <= end; p++) {
        rec *r = ref_find(m, m->victim, p);
        assert_non_null(r);
        assert_true(r->host != PD_NONE);
        r->host = PD_NONE;
    }
    if (ev->node_deleted) {
        for (uint32_t p = first; p <= end; p++) ref_del(m, ref_find(m, m->victim, p));
        if (cascade) drop_emptied_cascade_root(m);
    }
}

static void judge_snapshot_eviction(model *m, const pd_evict_event *ev, rec *last) {
    assert_true(last->snap != PD_NONE && last->mlock == 0);
    assert_true(ev->stamp == last->st_mamba);
    for (uint32_t i = 0; i < REF_CAP; i++) {
        rec *r = &m->recs[i];
        if (r->used == 1 && r->snap != PD_NONE && r->mlock == 0)
            assert_true(last->st_mamba <= r->st_mamba);
    }
    last->snap = PD_NONE;
}

static void on_evict(void *ctx, const pd_evict_event *ev) {
    (void)ctx;
    model *m = M;
    cfx *f = m->f;
    m->events++;
    uint32_t end_tok =
        pd_cache_node_prefix(f->c, ev->node, m->victim, sizeof(m->victim) / sizeof(int32_t));
    assert_int_equal(end_tok, ev->end_tokens);
    victim_span v = {.end_tok = end_tok, .end = end_tok / m->ps};
    v.first = v.end - ev->pages + 1;
    v.last = ref_find(m, m->victim, v.end);
    assert_non_null(v.last);
    v.clock = pd_cache_clock(f->c);
    ref_scan_children(m);

    if (ev->kind == PD_EVICT_DEVICE) judge_device_eviction(m, ev, &v);
    else if (ev->kind == PD_EVICT_HOST) judge_host_eviction(m, ev, &v);
    else judge_snapshot_eviction(m, ev, v.last);
}

/* ---- full comparison ------------------------------------------------------ */

typedef struct walk_ctx {
    model *m;
    uint32_t pages_seen;
} walk_ctx;

static void walk_node(void *ctx, const pd_cnode_info *ni) {
    walk_ctx *w = ctx;
    model *m = w->m;
    uint32_t start = ni->end_tokens / m->ps - ni->pages;
    for (uint32_t i = 0; i < ni->pages; i++) {
        uint32_t len = start + i + 1;
        rec *r = ref_find(m, ni->prefix, len);
        if (!r) fail_msg("op %llu: cache holds a page (len %u) the model does not",
                         (unsigned long long)m->ops, len);
        w->pages_seen++;
        if (ni->on_dev) {
            assert_false(r->loading);
            assert_int_equal(r->dev, ni->dev_pages[i]);
        } else if (ni->loading) {
            assert_true(r->loading);
            assert_int_equal(r->dev, PD_NONE);
            assert_int_equal(r->load_dev, ni->dev_pages[i]);
        } else {
            assert_int_equal(r->dev, PD_NONE);
            assert_false(r->loading);
        }
        if (ni->on_host) {
            if (r->host == PENDING) r->host = ni->host_pages[i];
            assert_int_equal(r->host, ni->host_pages[i]);
        } else {
            assert_int_equal(r->host, PD_NONE);
        }
        assert_int_equal(r->lock, ni->lock_ref);
        bool last = i + 1 == ni->pages;
        if (last) {
            assert_int_equal(r->snap, ni->mamba_slot == PD_POOL_NONE ? PD_NONE : ni->mamba_slot);
            assert_int_equal(r->mlock, ni->mamba_lock);
            if (ni->mamba_slot != PD_POOL_NONE && ni->mamba_lock == 0)
                assert_true(r->st_mamba == ni->stamp_mamba);
        } else {
            assert_int_equal(r->snap, PD_NONE);
        }
        if (ni->on_dev && ni->lock_ref == 0) assert_true(r->st_dev == ni->stamp_dev);
        if (ni->on_host && ni->lock_ref == 0) assert_true(r->st_host == ni->stamp_host);
    }
}

static void compare_all(model *m) {
    walk_ctx w = {.m = m};
    pd_cache_walk(m->f->c, walk_node, &w);
    if (w.pages_seen != m->n_recs)
        fail_msg("op %llu: cache holds %u pages, model %u", (unsigned long long)m->ops,
                 w.pages_seen, m->n_recs);
    cfx_check(m->f, false);
}

/* ---- helpers -------------------------------------------------------------- */

static uint32_t make_query(model *m, int32_t *q) {
    uint32_t d = (uint32_t)pd_rng_below(&m->rng, 6);
    uint32_t max_pages = PD_MIN(MAXP, m->doc_len / m->ps);
    uint32_t len = (uint32_t)pd_rng_range(&m->rng, 1, max_pages);
    memcpy(q, m->docs[d], (size_t)len * m->ps * sizeof(int32_t));
    if (pd_rng_chance(&m->rng, 1, 3)) {
        uint32_t pos = (uint32_t)pd_rng_below(&m->rng, len * m->ps);
        q[pos] = (int32_t)pd_rng_below(&m->rng, 4);
    }
    return len;
}

/* Stamps of the records on the path q[0..len pages) after a touch. */
static void touch(model *m, const int32_t *q, uint32_t len) {
    uint64_t clock = pd_cache_clock(m->f->c);
    for (uint32_t p = 1; p <= len; p++) {
        rec *r = ref_find(m, q, p);
        assert_non_null(r);
        if (r->dev != PD_NONE && r->lock == 0) r->st_dev = clock;
        if (r->host != PD_NONE && r->lock == 0) r->st_host = clock;
        if (r->snap != PD_NONE && r->mlock == 0) r->st_mamba = clock;
    }
}

static void check_node_is(model *m, pd_cnode node, const int32_t *q, uint32_t len_pages) {
    if (len_pages == 0) {
        assert_int_equal(node, PD_CNODE_ROOT);
        return;
    }
    int32_t buf[MAXP * 4];
    uint32_t n = pd_cache_node_prefix(m->f->c, node, buf, MAXP * 4);
    assert_int_equal(n, len_pages * m->ps);
    assert_memory_equal(buf, q, n * sizeof(int32_t));
}

static void ref_lock(model *m, const int32_t *q, uint32_t len, int delta) {
    uint64_t clock = pd_cache_clock(m->f->c);
    for (uint32_t p = 1; p <= len; p++) {
        rec *r = ref_find(m, q, p);
        assert_non_null(r);
        if (delta > 0) {
            r->lock++;
        } else {
            assert_true(r->lock > 0);
            r->lock--;
            if (r->lock == 0) {
                if (r->dev != PD_NONE) r->st_dev = clock;
                if (r->host != PD_NONE) r->st_host = clock;
                if (r->snap != PD_NONE && r->mlock == 0) r->st_mamba = clock;
            }
        }
    }
}

/* ---- operations ----------------------------------------------------------- */

/* Sometimes start loading the host part of a held path back to the device:
 * pages dev+1..h->len, none of them already loading. */
static void maybe_start_load(model *m, held *h, const int32_t *q, uint32_t dev) {
    cfx *f = m->f;
    bool busy = false;
    for (uint32_t p = dev + 1; p <= h->len; p++) busy |= ref_find(m, q, p)->loading;
    if (busy || !pd_rng_chance(&m->rng, 2, 3)) return;
    uint32_t dev_out[MAXP], host_out[MAXP], n;
    pd_cache_ticket t;
    h->owner = ++m->next_owner;
    pd_err e = pd_cache_load_begin(f->c, h->node, h->owner, dev_out, host_out, MAXP, &n, &t);
    if (e != PD_OK) {
        assert_err(e, PD_ERR_NOMEM);
        return;
    }
    assert_int_equal(n, h->len - dev);
    for (uint32_t j = 0; j < n; j++) {
        rec *r = ref_find(m, q, dev + 1 + j);
        if (r->host == PENDING) r->host = host_out[j];
        assert_int_equal(r->host, host_out[j]);
        r->loading = true;
        r->load_dev = dev_out[j];
        r->load_ticket = t;
    }
    h->loading = true;
    h->ticket = t;
}

/* Holds a lock on part of what a match found (as an admitted request does),
 * sometimes the snapshot lock too, and sometimes starts a load. */
static void hold_matched(model *m, const int32_t *q, const pd_cache_match_result *res, uint32_t dev,
                         uint32_t host, uint32_t mamba) {
    cfx *f = m->f;
    held *h = &m->held[m->n_held];
    memset(h, 0, sizeof(*h));
    uint32_t which = (uint32_t)pd_rng_below(&m->rng, 3);
    if (which == 0 && mamba > 0) { h->node = res->mamba_node; h->len = mamba; }
    else if (which == 1 && dev > 0) { h->node = res->dev_node; h->len = dev; }
    else { h->node = res->host_node; h->len = host; }
    memcpy(h->tokens, q, h->len * m->ps * sizeof(int32_t));
    assert_ok(pd_cache_lock(f->c, h->node));
    ref_lock(m, q, h->len, +1);
    m->n_held++;
    rec *end = ref_find(m, q, h->len);
    if (end->snap != PD_NONE && pd_rng_chance(&m->rng, 1, 2)) {
        assert_ok(pd_cache_mamba_lock(f->c, h->node));
        end->mlock++;
        h->mamba = true;
    }
    if (h->len > dev && !end->loading && end->dev == PD_NONE) maybe_start_load(m, h, q, dev);
}

static void op_match(model *m) {
    cfx *f = m->f;
    int32_t q[MAXP * 4];
    uint32_t len = make_query(m, q);
    /* Add a partial page, which the match must ignore. */
    uint32_t n_tokens = len * m->ps + (uint32_t)pd_rng_below(&m->rng, m->ps);
    int32_t qq[MAXP * 4 + 4];
    memcpy(qq, q, len * m->ps * sizeof(int32_t));
    for (uint32_t i = len * m->ps; i < n_tokens; i++) qq[i] = 1;

    uint32_t dev = 0, host, mamba = 0;
    while (dev < len) {
        rec *r = ref_find(m, q, dev + 1);
        if (!r || r->dev == PD_NONE) break;
        dev++;
        if (r->snap != PD_NONE) mamba = dev;
    }
    host = dev;
    while (host < len && ref_find(m, q, host + 1)) host++;

    uint32_t pages[MAXP];
    pd_cache_match_result res;
    assert_ok(pd_cache_match(f->c, qq, n_tokens, pages, MAXP, &res));
    assert_int_equal(res.dev_tokens, dev * m->ps);
    assert_int_equal(res.host_tokens, (host - dev) * m->ps);
    assert_int_equal(res.mamba_tokens, mamba * m->ps);
    for (uint32_t p = 0; p < dev; p++) assert_int_equal(pages[p], ref_find(m, q, p + 1)->dev);
    if (mamba) assert_int_equal(res.mamba_slot, ref_find(m, q, mamba)->snap);
    else assert_int_equal(res.mamba_slot, PD_POOL_NONE);
    check_node_is(m, res.dev_node, q, dev);
    check_node_is(m, res.host_node, q, host);
    check_node_is(m, res.mamba_node, q, mamba);
    touch(m, q, host);

    if (m->n_held < PD_ARRAY_LEN(m->held) && host > 0 && pd_rng_chance(&m->rng, 1, 2))
        hold_matched(m, q, &res, dev, host, mamba);
}

/* Fills pages[0..len) as a request would before inserting: the cache's pages
 * for a matched prefix, fresh pages (evicting for room) for the rest. False
 * if there is no room. */
static bool pages_for_insert(model *m, const int32_t *q, uint32_t len, pd_owner owner,
                             uint32_t *pages) {
    cfx *f = m->f;
    uint32_t fresh[MAXP];
    uint32_t reuse = 0;
    if (pd_rng_chance(&m->rng, 1, 2)) {
        /* Use the cache's pages for the matched prefix, as a request does. */
        pd_cache_match_result res;
        assert_ok(pd_cache_match(f->c, q, len * m->ps, pages, MAXP, &res));
        reuse = res.dev_tokens / m->ps;
        uint32_t host = (res.dev_tokens + res.host_tokens) / m->ps;
        touch(m, q, host);
    }
    uint32_t need = len - reuse, taken = 0;
    if (pd_pool_free_count(f->kv) < need) {
        uint32_t short_by = need - pd_pool_free_count(f->kv);
        /* Half the time as the engine does it: the evicted pages come
         * straight to the request (pd_cache_evict_to), not through the pool. */
        if (pd_rng_chance(&m->rng, 1, 2)) {
            assert_ok(pd_cache_evict_to(f->c, short_by, owner, fresh, &taken));
            assert_true(taken <= short_by);
            for (uint32_t i = 0; i < taken; i++)
                assert_int_equal(pd_ledger_state_of(f->l, f->kv_id, fresh[i]), PD_UNIT_REQ);
        } else {
            assert_ok(pd_cache_evict(f->c, short_by, NULL));
        }
    }
    /* Eviction may have taken pages of the reused prefix (not locked). */
    for (uint32_t p = 0; p < reuse; p++) {
        rec *r = ref_find(m, q, p + 1);
        if (!r || r->dev != pages[p]) { reuse = p; break; }
    }
    need = len - reuse;
    assert_true(taken <= need); /* need only grew with the reused prefix's loss */
    if (pd_pool_free_count(f->kv) < need - taken) {
        if (taken) assert_ok(pd_ledger_free(f->l, f->kv_id, fresh, taken, PD_UNIT_REQ, owner));
        return false;
    }
    if (need > taken)
        assert_ok(pd_ledger_alloc(f->l, f->kv_id, need - taken, owner, fresh + taken));
    memcpy(pages + reuse, fresh, need * sizeof(uint32_t));
    return true;
}

static void op_insert(model *m) {
    cfx *f = m->f;
    int32_t q[MAXP * 4];
    uint32_t len = make_query(m, q);
    pd_owner owner = ++m->next_owner;
    uint32_t pages[MAXP], dups[MAXP];
    if (!pages_for_insert(m, q, len, owner, pages)) return;

    uint32_t slot = PD_POOL_NONE;
    if (f->mamba && pd_rng_chance(&m->rng, 2, 3)) {
        if (pd_pool_free_count(f->mamba) == 0) assert_ok(pd_cache_evict_snapshots(f->c, 1, NULL));
        if (pd_pool_free_count(f->mamba) > 0)
            assert_ok(pd_ledger_alloc(f->l, f->mamba_id, 1, owner, &slot));
    }

    /* Prediction. */
    uint32_t expect_final[MAXP], expect_dups[MAXP], n_dups = 0, covered = 0;
    for (uint32_t p = 0; p < len; p++) {
        rec *r = ref_find(m, q, p + 1);
        if (r && r->loading) break;
        if (r && r->dev != PD_NONE) {
            expect_final[p] = r->dev;
            if (pages[p] != r->dev) expect_dups[n_dups++] = pages[p];
        } else {
            expect_final[p] = pages[p];
        }
        covered++;
    }
    rec *end = covered ? ref_find(m, q, covered) : NULL;
    bool expect_taken = slot != PD_POOL_NONE && covered == len && (!end || end->snap == PD_NONE);

    uint32_t orig[MAXP];
    memcpy(orig, pages, len * sizeof(uint32_t));
    pd_cache_insert_result res;
    assert_ok(pd_cache_insert(f->c, q, len * m->ps, pages, owner, slot, dups, &res));
    assert_int_equal(res.covered_tokens, covered * m->ps);
    assert_int_equal(res.dup_pages, n_dups);
    assert_memory_equal(dups, expect_dups, n_dups * sizeof(uint32_t));
    assert_memory_equal(pages, expect_final, covered * sizeof(uint32_t));
    assert_memory_equal(pages + covered, orig + covered, (len - covered) * sizeof(uint32_t));
    assert_true(res.mamba_taken == expect_taken);
    check_node_is(m, res.node, q, covered);

    /* Apply to the model. */
    for (uint32_t p = 0; p < covered; p++) {
        rec *r = ref_find(m, q, p + 1);
        if (!r) r = ref_add(m, q, p + 1);
        if (r->dev == PD_NONE) r->dev = orig[p];
    }
    if (expect_taken) ref_find(m, q, len)->snap = slot;
    touch(m, q, covered);
    if (expect_taken) ref_find(m, q, len)->st_mamba = pd_cache_clock(f->c);

    /* The caller frees what the cache did not take. */
    if (n_dups) assert_ok(pd_ledger_free(f->l, f->kv_id, dups, n_dups, PD_UNIT_REQ, owner));
    if (covered < len)
        assert_ok(
            pd_ledger_free(f->l, f->kv_id, orig + covered, len - covered, PD_UNIT_REQ, owner));
    if (slot != PD_POOL_NONE && !res.mamba_taken)
        assert_ok(pd_ledger_free(f->l, f->mamba_id, &slot, 1, PD_UNIT_REQ, owner));
}

static void finish_load(model *m, held *h, bool done) {
    cfx *f = m->f;
    if (done) assert_ok(pd_cache_load_done(f->c, h->ticket));
    else assert_ok(pd_cache_load_cancel(f->c, h->ticket));
    for (uint32_t p = 1; p <= h->len; p++) {
        rec *r = ref_find(m, h->tokens, p);
        if (!r->loading || r->load_ticket != h->ticket) continue;
        if (done) r->dev = r->load_dev;
        r->loading = false;
        r->load_dev = PD_NONE;
    }
    h->loading = false;
}

static void op_unlock(model *m) {
    if (m->n_held == 0) return;
    cfx *f = m->f;
    uint32_t i = (uint32_t)pd_rng_below(&m->rng, m->n_held);
    held *h = &m->held[i];
    if (h->loading) {
        /* An abort must end the load before its last lock: check that order. */
        if (ref_find(m, h->tokens, h->len)->lock == 1)
            assert_err(pd_cache_unlock(f->c, h->node), PD_ERR_STATE);
        finish_load(m, h, pd_rng_chance(&m->rng, 1, 2));
    }
    if (h->mamba) {
        assert_ok(pd_cache_mamba_unlock(f->c, h->node));
        rec *end = ref_find(m, h->tokens, h->len);
        end->mlock--;
        if (end->mlock == 0 && end->snap != PD_NONE) end->st_mamba = pd_cache_clock(f->c);
    }
    assert_ok(pd_cache_unlock(f->c, h->node));
    ref_lock(m, h->tokens, h->len, -1);
    m->held[i] = m->held[--m->n_held];
}

static void op_load_finish(model *m) {
    for (uint32_t i = 0; i < m->n_held; i++) {
        if (m->held[i].loading) {
            finish_load(m, &m->held[i], pd_rng_chance(&m->rng, 3, 4));
            return;
        }
    }
}

static void op_evict(model *m) {
    cfx *f = m->f;
    uint32_t n = (uint32_t)pd_rng_range(&m->rng, 1, 12), freed = 0;
    switch (pd_rng_below(&m->rng, 4)) {
    case 0:
    case 1:
        assert_ok(pd_cache_evict(f->c, n, &freed));
        break;
    case 2:
        if (f->host) assert_ok(pd_cache_evict_host(f->c, n, &freed));
        break;
    default:
        if (f->mamba) assert_ok(pd_cache_evict_snapshots(f->c, n, &freed));
    }
    m->cascade_len = 0;
}

/* ---- driver --------------------------------------------------------------- */

typedef struct mconfig {
    uint32_t ps, kv, mamba, host;
    bool write_back;
} mconfig;

static void run_config(const mconfig *cfg, uint64_t seed, uint64_t n_ops) {
    model *m = calloc(1, sizeof(*m));
    M = m;
    m->ps = cfg->ps;
    pd_rng_seed(&m->rng, seed);
    m->f = cfx_new_ex(cfg->ps, cfg->kv, cfg->mamba, cfg->host, cfg->write_back, on_evict, NULL);
    m->doc_len = PD_MIN(MAXP * cfg->ps, 48u);
    /* Documents share prefixes of varied length, like system prompts. */
    for (uint32_t i = 0; i < m->doc_len; i++) m->docs[0][i] = (int32_t)pd_rng_below(&m->rng, 4);
    for (int d = 1; d < 6; d++) {
        uint32_t share = (uint32_t)pd_rng_below(&m->rng, m->doc_len);
        for (uint32_t i = 0; i < m->doc_len; i++)
            m->docs[d][i] = i < share ? m->docs[(uint32_t)pd_rng_below(&m->rng, (uint64_t)d)][i]
                                      : (int32_t)pd_rng_below(&m->rng, 4);
    }
    for (m->ops = 0; m->ops < n_ops; m->ops++) {
        uint32_t r = (uint32_t)pd_rng_below(&m->rng, 100);
        if (r < 30) op_match(m);
        else if (r < 62) op_insert(m);
        else if (r < 78) op_unlock(m);
        else if (r < 84) op_load_finish(m);
        else if (r < 99) op_evict(m);
        else { pd_cache_clear(m->f->c); m->cascade_len = 0; }
        compare_all(m);
    }
    /* Orderly end: release every lock, clear, and the node must be clean. */
    while (m->n_held) op_unlock(m);
    pd_cache_clear(m->f->c);
    compare_all(m);
    assert_int_equal(m->n_recs, 0);
    cfx_check(m->f, true);
    assert_int_equal(pd_ledger_count(m->f->l, m->f->kv_id, PD_UNIT_FREE), cfg->kv);
    print_message("config ps=%u kv=%u mamba=%u host=%u wb=%d: %llu ops, %llu evictions judged\n",
                  cfg->ps, cfg->kv, cfg->mamba, cfg->host, cfg->write_back,
                  (unsigned long long)n_ops, (unsigned long long)m->events);
    cfx_free(m->f);
    for (uint32_t i = 0; i < REF_CAP; i++) free(m->recs[i].tokens);
    free(m);
    M = NULL;
}

static void random_operations_agree_with_the_reference_model(void **state) {
    (void)state;
    static const mconfig configs[] = {
        {1, 24, 0, 0, false},  {1, 40, 6, 0, false},  {2, 32, 0, 24, true},
        {4, 20, 4, 16, true},  {2, 48, 8, 32, true},  {1, 16, 3, 12, true},
        {3, 30, 5, 20, false}, {4, 64, 8, 8, true},
        /* The usual 16-token page: the match's chain walk and the inserts'
         * page copy take their constant-size paths. */
        {16, 24, 4, 8, true},
    };
    const char *ops_env = getenv("PD_CACHE_MODEL_OPS");
    uint64_t per = ops_env ? strtoull(ops_env, NULL, 0) : 13000;
    uint64_t seed = test_seed(2026);
    uint64_t total = 0;
    for (size_t i = 0; i < PD_ARRAY_LEN(configs); i++) {
        run_config(&configs[i], seed + i, per);
        total += per;
    }
    print_message("%llu random operations in total\n", (unsigned long long)total);
    if (!ops_env) assert_true(total >= 100000);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(random_operations_agree_with_the_reference_model),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
