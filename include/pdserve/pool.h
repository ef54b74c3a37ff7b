/*
 * pd_pool — a fixed-size allocator of unit indices.
 *
 * One structure serves every resource class of a node (DESIGN.md section 2):
 * KV pages, request rows, Mamba state slots, metadata rows and host pages.
 * A pool hands out indices only; the memory behind an index (a KV page in
 * every attention layer, a Mamba state) belongs to whoever registered it.
 *
 * Representation: a two-level bitmap, bit set = unit free. The summary level
 * has one bit per 64-unit word ("this word has a free unit"), so finding the
 * lowest free unit touches a handful of words, and a cursor remembers the
 * lowest summary word that can be non-zero. Alloc and free are O(1) amortised
 * and never allocate memory: everything is sized at pd_pool_create.
 *
 * Lowest-index-first allocation keeps live units packed at the bottom of the
 * pool, which is what makes bulk allocations come out as long contiguous runs
 * (transfers coalesce runs into single writes). pd_pool_alloc_n additionally
 * looks for one run that fits the whole request before falling back to the
 * lowest free units.
 *
 * Misuse is detected, never silently absorbed: freeing an index outside the
 * pool is PD_ERR_INVALID, freeing a free unit is PD_ERR_STATE. Bulk calls are
 * all-or-nothing: they validate every index before changing anything.
 */
#ifndef PDSERVE_POOL_H
#define PDSERVE_POOL_H

#include "pdserve/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pd_pool_kind {
    PD_POOL_KV = 0,   /* device KV pages, unit_tokens = page_size */
    PD_POOL_ROW,      /* request rows (position -> page table) */
    PD_POOL_MAMBA,    /* Mamba state slots (conv + ssm state of every layer) */
    PD_POOL_META,     /* metadata rows (first token, logprob, nonce, ...) */
    PD_POOL_HOST,     /* host-memory pages of the hierarchical cache */
    PD_POOL_KIND__COUNT
} pd_pool_kind;

const char *pd_pool_kind_name(pd_pool_kind kind);

typedef struct pd_pool pd_pool;

/* Largest pool: indices are uint32 and PD_POOL_NONE is reserved. */
#define PD_POOL_UNITS_MAX (UINT32_C(1) << 30)
#define PD_POOL_NONE PD_NONE

/* unit_tokens is the page size for page pools (KV, HOST) and must be 0 for
 * slot pools. units_total in [1, PD_POOL_UNITS_MAX]. */
pd_err pd_pool_create(pd_pool **out, const char *name, pd_pool_kind kind,
                      uint32_t units_total, uint32_t unit_tokens);
void pd_pool_destroy(pd_pool *pool);

/* One unit, the lowest free index. PD_ERR_NOMEM when none is free. */
pd_err pd_pool_alloc(pd_pool *pool, uint32_t *out_idx);

/* n units into out[0..n), ascending. All or nothing: PD_ERR_NOMEM (and no
 * change) when fewer than n are free. Prefers a single contiguous run. */
pd_err pd_pool_alloc_n(pd_pool *pool, uint32_t n, uint32_t *out);

/* PD_ERR_INVALID for a foreign index, PD_ERR_STATE for a unit already free. */
pd_err pd_pool_free(pd_pool *pool, uint32_t idx);
/* All or nothing; duplicates inside idx[] are a double free (PD_ERR_STATE). */
pd_err pd_pool_free_n(pd_pool *pool, const uint32_t *idx, uint32_t n);

bool pd_pool_is_free(const pd_pool *pool, uint32_t idx);
uint32_t pd_pool_free_count(const pd_pool *pool);
uint32_t pd_pool_total(const pd_pool *pool);
uint32_t pd_pool_unit_tokens(const pd_pool *pool);
pd_pool_kind pd_pool_kind_of(const pd_pool *pool);
const char *pd_pool_name(const pd_pool *pool);

/* Recounts the free bits and the summary level from scratch and compares them
 * with the running counter. PD_OK or PD_ERR_INTERNAL with a message. */
pd_err pd_pool_verify(const pd_pool *pool, char *msg, size_t msg_cap);

/* Number of maximal runs of consecutive indices in idx[0..n) (in the given
 * order): 1 for a perfectly contiguous ascending allocation. */
uint32_t pd_index_runs(const uint32_t *idx, uint32_t n);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_POOL_H */
