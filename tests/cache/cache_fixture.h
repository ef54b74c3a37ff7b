/*
 * A node's memory layer for cache tests: pools, a strict ledger and a prefix
 * cache wired together, plus a fake device/host memory so that write-back and
 * loads can be checked for moving the right data.
 */
#ifndef PDSERVE_TEST_CACHE_FIXTURE_H
#define PDSERVE_TEST_CACHE_FIXTURE_H

#include <stdio.h>
#include <stdlib.h>

#include "../test_util.h"
#include "pdserve/cache.h"

typedef struct cfx {
    pd_ledger *l;
    pd_pool *kv, *mamba, *host;
    int kv_id, mamba_id, host_id;
    pd_cache *c;
    uint32_t ps;
    uint64_t *dev_mem, *host_mem;   /* one word of "content" per page */
    uint32_t copies_to_host, copies_to_dev;
} cfx;

static inline void cfx_copy(void *ctx, pd_copy_dir dir, const uint32_t *dev,
                            const uint32_t *host, uint32_t n) {
    cfx *f = ctx;
    for (uint32_t i = 0; i < n; i++) {
        if (dir == PD_COPY_DEV_TO_HOST) {
            f->host_mem[host[i]] = f->dev_mem[dev[i]];
            f->copies_to_host++;
        } else {
            f->dev_mem[dev[i]] = f->host_mem[host[i]];
            f->copies_to_dev++;
        }
    }
}

static inline cfx *cfx_new_ex(uint32_t ps, uint32_t kv_pages, uint32_t mamba_slots,
                              uint32_t host_pages, bool write_back,
                              pd_cache_evict_fn on_evict, void *ev_ctx) {
    cfx *f = calloc(1, sizeof(*f));
    f->ps = ps;
    assert_ok(pd_ledger_create(&f->l, true));
    assert_ok(pd_pool_create(&f->kv, "kv", PD_POOL_KV, kv_pages, ps));
    assert_ok(pd_ledger_add_pool(f->l, f->kv, &f->kv_id));
    f->mamba_id = f->host_id = -1;
    if (mamba_slots) {
        assert_ok(pd_pool_create(&f->mamba, "mamba", PD_POOL_MAMBA, mamba_slots, 0));
        assert_ok(pd_ledger_add_pool(f->l, f->mamba, &f->mamba_id));
    }
    if (host_pages) {
        assert_ok(pd_pool_create(&f->host, "host", PD_POOL_HOST, host_pages, ps));
        assert_ok(pd_ledger_add_pool(f->l, f->host, &f->host_id));
    }
    f->dev_mem = calloc(kv_pages, sizeof(uint64_t));
    f->host_mem = calloc(host_pages + 1, sizeof(uint64_t));
    pd_cache_config cfg = {
        .ledger = f->l, .kv_pool = f->kv_id, .mamba_pool = f->mamba_id,
        .host_pool = f->host_id, .write_back = write_back, .loads_max = 8,
        .copy = cfx_copy, .copy_ctx = f, .on_evict = on_evict, .on_evict_ctx = ev_ctx,
    };
    assert_ok(pd_cache_create(&f->c, &cfg));
    return f;
}

static inline cfx *cfx_new(uint32_t ps, uint32_t kv_pages, uint32_t mamba_slots,
                           uint32_t host_pages) {
    return cfx_new_ex(ps, kv_pages, mamba_slots, host_pages, host_pages > 0, NULL, NULL);
}

/* Ledger check against the cache's sums, cache verify: both must pass. */
static inline void cfx_check(cfx *f, bool idle) {
    char buf[8192];
    pd_strbuf sb;
    pd_strbuf_init(&sb, buf, sizeof(buf));
    pd_cache_sums sums = {0};
    pd_cache_sums_get(f->c, &sums);
    pd_check_opts o = {.cache = &sums, .expect_idle = idle, .deep = true};
    if (pd_ledger_check(f->l, &o, &sb) != PD_OK) fail_msg("ledger check:\n%s", buf);
    /* Admission's shortcut to the device pool's evictable pages agrees with
     * the ledger's own count of them. */
    assert_int_equal(pd_cache_dev_evictable(f->c),
                     pd_ledger_count(f->l, f->kv_id, PD_UNIT_CACHE_EVICTABLE));
    char msg[256];
    if (pd_cache_verify(f->c, msg, sizeof(msg)) != PD_OK) fail_msg("cache verify: %s", msg);
}

static inline void cfx_free(cfx *f) {
    pd_cache_destroy(f->c);
    pd_ledger_destroy(f->l);
    pd_pool_destroy(f->kv);
    pd_pool_destroy(f->mamba);
    pd_pool_destroy(f->host);
    free(f->dev_mem);
    free(f->host_mem);
    free(f);
}

/* Allocates n_pages device pages for owner and gives each a content word
 * derived from the tokens it holds (what a forward pass would write). */
static inline void cfx_compute(cfx *f, pd_owner owner, const int32_t *tokens,
                               uint32_t first_page, uint32_t n_pages, uint32_t *pages) {
    assert_ok(pd_ledger_alloc(f->l, f->kv_id, n_pages, owner, pages));
    for (uint32_t i = 0; i < n_pages; i++)
        f->dev_mem[pages[i]] = pd_hash_tokens(tokens, (size_t)(first_page + i + 1) * f->ps, 0);
}

/* Inserts tokens[0..n_pages*ps) computed fresh by owner; frees duplicates. */
static inline pd_cache_insert_result cfx_insert(cfx *f, pd_owner owner, const int32_t *tokens,
                                                uint32_t n_pages, uint32_t mamba_slot) {
    uint32_t *pages = calloc(n_pages + 1, sizeof(uint32_t));
    uint32_t *dups = calloc(n_pages + 1, sizeof(uint32_t));
    cfx_compute(f, owner, tokens, 0, n_pages, pages);
    pd_cache_insert_result r;
    assert_ok(pd_cache_insert(f->c, tokens, n_pages * f->ps, pages, owner, mamba_slot, dups, &r));
    if (r.dup_pages)
        assert_ok(pd_ledger_free(f->l, f->kv_id, dups, r.dup_pages, PD_UNIT_REQ, owner));
    free(pages);
    free(dups);
    return r;
}

#endif
