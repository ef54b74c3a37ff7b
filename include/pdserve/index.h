/*
 * pd_index — the one hash index of the code base: open addressing from a
 * 64-bit hash to a uint32 value, which is a slot in an array the caller owns
 * (requests, radix nodes, rooms). The caller keeps the records and their
 * keys; the index keeps only the values, four bytes a slot, so a table for
 * a large radix tree stays as small as the hand-written ones it replaced
 * (eight-byte slots with a hash tag cost the prefix cache 4-6 % of its
 * speed at 65,536 pages: the table no longer fitted in L2). A removal moves
 * later entries back over the hole (backward-shift deletion, no tombstone
 * slots); to know where an entry belongs it asks the caller for the hash of
 * that entry's record (hash_of), the only call through a pointer, and only
 * on removal.
 *
 * Capacity is fixed at creation: a power of two at least twice the most
 * entries the caller will ever insert, so a probe always ends at an empty
 * slot. Inserting past that maximum is a bug (asserted), not an error: every
 * caller sizes its records and its index together.
 *
 * Lookup is a cursor over the candidates, in probe order; the caller
 * compares keys:
 *
 *     pd_index_probe p;
 *     for (uint32_t v = pd_index_first(ix, h, &p); v != PD_NONE;
 *          v = pd_index_next(ix, &p))
 *         if (records[v].key == key) return v;
 */
#ifndef PDSERVE_INDEX_H
#define PDSERVE_INDEX_H

#include "pdserve/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The hash the caller inserted `value` under (it must not change while the
 * value is in the index). */
typedef uint64_t (*pd_index_hash_fn)(const void *ctx, uint32_t value);

typedef struct pd_index {
    uint32_t *slots; /* values; PD_NONE: empty */
    uint32_t mask;
    uint32_t n, max; /* entries now; the most ever allowed */
    pd_index_hash_fn hash_of;
    const void *ctx;
} pd_index;

typedef struct pd_index_probe {
    uint32_t i;
} pd_index_probe;

/* An index for at most max_entries entries (>= 1). PD_ERR_NOMEM if the
 * table cannot be allocated; *ix is then empty and pd_index_free is safe. */
pd_err pd_index_init(pd_index *ix, uint32_t max_entries, pd_index_hash_fn hash_of, const void *ctx);
void pd_index_free(pd_index *ix);
/* Forgets every entry. */
void pd_index_clear(pd_index *ix);

/* Adds value under hash h. Duplicates are the caller's business (a lookup
 * first); more than max entries is asserted. */
void pd_index_insert(pd_index *ix, uint64_t h, uint32_t value);
/* Removes value, which must be present under hash h (asserted). */
void pd_index_remove(pd_index *ix, uint64_t h, uint32_t value);

/* The next candidate of the probe, or PD_NONE once an empty slot ends it. */
static inline uint32_t pd_index_next(const pd_index *ix, pd_index_probe *p) {
    uint32_t v = ix->slots[p->i];
    if (v != PD_NONE) p->i = (p->i + 1) & ix->mask;
    return v;
}

/* Starts loading the slot that a probe, insert or remove for hash h starts
 * at, for a caller that knows it will need it well before it does. */
PD_PREFETCH_INLINE void pd_index_prefetch(const pd_index *ix, uint64_t h) {
    __builtin_prefetch(&ix->slots[(uint32_t)h & ix->mask]);
}

/* Starts a probe for hash h and returns its first candidate. */
static inline uint32_t pd_index_first(const pd_index *ix, uint64_t h, pd_index_probe *p) {
    p->i = (uint32_t)h & ix->mask;
    return pd_index_next(ix, p);
}

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_INDEX_H */
