/*
 * bench/radix_impl.h — the prefix cache operations bench/radix replays,
 * behind a table of functions, so that one run can alternate two
 * implementations: the tree's (src/cache/cache.c) and the baseline kept in
 * bench/radix_v0.c. RADIX_IMPL_DEFINE(name, label) defines the table for
 * whichever pd_cache_* functions are in scope where it is expanded (the
 * baseline's file renames them); the handle travels as void *.
 */
#ifndef PDSERVE_BENCH_RADIX_IMPL_H
#define PDSERVE_BENCH_RADIX_IMPL_H

#include "pdserve/cache.h"

typedef struct radix_impl {
    const char *label;
    pd_err (*create)(void **out, const pd_cache_config *cfg);
    void (*destroy)(void *c);
    pd_err (*match)(void *c, const int32_t *tokens, uint32_t n_tokens, uint32_t *pages,
                    uint32_t pages_cap, pd_cache_match_result *out);
    pd_err (*lock)(void *c, pd_cnode node);
    pd_err (*unlock)(void *c, pd_cnode node);
    /* pd_cache_insert_from (start: the node the request holds locked); the
     * baseline, which has no such call, walks from the root. */
    pd_err (*insert)(void *c, pd_cnode start, const int32_t *tokens, uint32_t n_tokens,
                     uint32_t *pages, pd_owner owner, uint32_t mamba_slot, uint32_t *dup_out,
                     pd_cache_insert_result *res);
    pd_err (*evict)(void *c, uint32_t pages_needed, uint32_t *pages_freed);
    pd_err (*evict_snapshots)(void *c, uint32_t slots_needed, uint32_t *slots_freed);
    pd_err (*load_begin)(void *c, pd_cnode host_node, pd_owner owner, uint32_t *dev_out,
                         uint32_t *host_out, uint32_t cap, uint32_t *n_pages,
                         pd_cache_ticket *ticket);
    pd_err (*load_done)(void *c, pd_cache_ticket ticket);
    void (*clear)(void *c);
    void (*sums_get)(const void *c, pd_cache_sums *sums);
    void (*stats_get)(const void *c, pd_cache_stats *out);
} radix_impl;

extern const radix_impl radix_impl_v0;
extern const radix_impl radix_impl_new;

/* The insert a table calls: the tree's pd_cache_insert_from unless the file
 * expanding RADIX_IMPL_DEFINE defines another first. */
#ifndef RADIX_INSERT_FROM
#define RADIX_INSERT_FROM pd_cache_insert_from
#endif

#define RADIX_IMPL_DEFINE(name, label_text)                                                      \
    static pd_err name##_create(void **out, const pd_cache_config *cfg) {                        \
        pd_cache *c = NULL;                                                                      \
        pd_err err = pd_cache_create(&c, cfg);                                                   \
        *out = c;                                                                                \
        return err;                                                                              \
    }                                                                                            \
    static void name##_destroy(void *c) { pd_cache_destroy(c); }                                 \
    static pd_err name##_match(void *c, const int32_t *t, uint32_t n, uint32_t *p, uint32_t cap, \
                               pd_cache_match_result *out) {                                     \
        return pd_cache_match(c, t, n, p, cap, out);                                             \
    }                                                                                            \
    static pd_err name##_lock(void *c, pd_cnode node) { return pd_cache_lock(c, node); }         \
    static pd_err name##_unlock(void *c, pd_cnode node) { return pd_cache_unlock(c, node); }     \
    static pd_err name##_insert(void *c, pd_cnode start, const int32_t *t, uint32_t n,           \
                                uint32_t *p, pd_owner owner, uint32_t slot, uint32_t *dup,       \
                                pd_cache_insert_result *res) {                                   \
        return RADIX_INSERT_FROM(c, start, t, n, p, owner, slot, dup, res);                      \
    }                                                                                            \
    static pd_err name##_evict(void *c, uint32_t need, uint32_t *freed) {                        \
        return pd_cache_evict(c, need, freed);                                                   \
    }                                                                                            \
    static pd_err name##_evict_snapshots(void *c, uint32_t need, uint32_t *freed) {              \
        return pd_cache_evict_snapshots(c, need, freed);                                         \
    }                                                                                            \
    static pd_err name##_load_begin(void *c, pd_cnode node, pd_owner owner, uint32_t *dev,       \
                                    uint32_t *host, uint32_t cap, uint32_t *n,                   \
                                    pd_cache_ticket *tk) {                                       \
        return pd_cache_load_begin(c, node, owner, dev, host, cap, n, tk);                       \
    }                                                                                            \
    static pd_err name##_load_done(void *c, pd_cache_ticket tk) {                                \
        return pd_cache_load_done(c, tk);                                                        \
    }                                                                                            \
    static void name##_clear(void *c) { pd_cache_clear(c); }                                     \
    static void name##_sums_get(const void *c, pd_cache_sums *s) { pd_cache_sums_get(c, s); }    \
    static void name##_stats_get(const void *c, pd_cache_stats *s) { pd_cache_stats_get(c, s); } \
    const radix_impl name = {                                                                    \
        .label = label_text,                                                                     \
        .create = name##_create,                                                                 \
        .destroy = name##_destroy,                                                               \
        .match = name##_match,                                                                   \
        .lock = name##_lock,                                                                     \
        .unlock = name##_unlock,                                                                 \
        .insert = name##_insert,                                                                 \
        .evict = name##_evict,                                                                   \
        .evict_snapshots = name##_evict_snapshots,                                               \
        .load_begin = name##_load_begin,                                                         \
        .load_done = name##_load_done,                                                           \
        .clear = name##_clear,                                                                   \
        .sums_get = name##_sums_get,                                                             \
        .stats_get = name##_stats_get,                                                           \
    };

#endif /* PDSERVE_BENCH_RADIX_IMPL_H */
