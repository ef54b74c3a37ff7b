/*
 * pool_internal.h — the pool's record and its one-unit paths, shared by
 * pool.c and the ledger (the same layer, src/mem). Everything else uses
 * include/pdserve/pool.h. The ledger's one-unit alloc and free inline these
 * (issue 13: about 200 k calls of each a bench/sched run, a call into pool.c
 * each); pd_pool_alloc and pd_pool_free are the same functions. The
 * invariants I1..I5 are pool.c's (its header comment).
 */
#ifndef PD_MEM_POOL_INTERNAL_H
#define PD_MEM_POOL_INTERNAL_H

#include "pdserve/pool.h"

/* I5's hints, one per class of run lengths (2-3, 4-7, 8-15, 16 and more): a
 * search for n units resumes where the last search of its class ended, and
 * any hint of a length <= n bounds it too. One hint for every length
 * (issue 13, third round) was taken over by each search of another length:
 * at 1,024 live in bench/sched, with prompts of 1 to 32 pages, most searches
 * rescanned the fragmented pool from its lowest free word. */
#define RUN_HINTS 4u

struct pd_pool {
    char name[32];
    pd_pool_kind kind;
    uint32_t total;
    uint32_t unit_tokens;
    uint32_t free_count;
    uint32_t n_words;
    uint32_t n_sum;
    uint32_t sum_hint;
    uint32_t run_n[RUN_HINTS], run_start[RUN_HINTS]; /* I5 */
    uint32_t run_top; /* >= run_start[h] + run_n[h] for every h: frees from it up change none */
    uint64_t *words;
    uint64_t *sum;
};

static inline bool pool_unit_free(const pd_pool *pool, uint32_t idx) {
    PD_ASSERT(idx < pool->total);
    return (pool->words[idx / 64] >> (idx % 64)) & 1u;
}

static inline void take_bit(pd_pool *p, uint32_t idx) {
    uint32_t w = idx / 64;
    uint64_t m = UINT64_C(1) << (idx % 64);
    PD_ASSERT(p->words[w] & m);
    p->words[w] &= ~m;
    if (p->words[w] == 0) p->sum[w / 64] &= ~(UINT64_C(1) << (w % 64));
    p->free_count--;
}

static inline void give_bit(pd_pool *p, uint32_t idx) {
    uint32_t w = idx / 64;
    uint64_t m = UINT64_C(1) << (idx % 64);
    PD_ASSERT(!(p->words[w] & m));
    p->words[w] |= m;
    p->sum[w / 64] |= UINT64_C(1) << (w % 64);
    if (w / 64 < p->sum_hint) p->sum_hint = w / 64;
    p->free_count++;
}

/* I5 after units from idx_min up were freed: a run of n through a freed
 * unit starts after idx_min - n. */
static inline void run_hint_freed(pd_pool *p, uint32_t idx_min) {
    if (idx_min + 1 >= p->run_top) return;
    for (uint32_t h = 0; h < RUN_HINTS; h++) {
        uint32_t n = p->run_n[h];
        if (idx_min + 1 < p->run_start[h] + n)
            p->run_start[h] = idx_min + 1 > n ? idx_min + 1 - n : 0;
    }
}

/* Lowest word index with a free unit; caller guarantees free_count > 0. */
static inline uint32_t lowest_free_word(pd_pool *p) {
    uint32_t s = p->sum_hint;
    while (s < p->n_sum && p->sum[s] == 0) s++;
    PD_ASSERTF(s < p->n_sum, "pool %s: free_count %u but no free word", p->name, p->free_count);
    p->sum_hint = s;
    return s * 64 + (uint32_t)__builtin_ctzll(p->sum[s]);
}

static inline pd_err pool_alloc_one(pd_pool *pool, uint32_t *out_idx) {
    PD_ASSERT(pool && out_idx);
    if (pool->free_count == 0) return PD_ERR_NOMEM;
    uint32_t w = lowest_free_word(pool);
    uint32_t idx = w * 64 + (uint32_t)__builtin_ctzll(pool->words[w]);
    PD_ASSERT(idx < pool->total);
    take_bit(pool, idx);
    *out_idx = idx;
    return PD_OK;
}

static inline pd_err pool_free_one(pd_pool *pool, uint32_t idx) {
    PD_ASSERT(pool);
    if (idx >= pool->total) return PD_ERR_INVALID;
    if (pool_unit_free(pool, idx)) return PD_ERR_STATE;
    give_bit(pool, idx);
    run_hint_freed(pool, idx);
    return PD_OK;
}

#endif /* PD_MEM_POOL_INTERNAL_H */
