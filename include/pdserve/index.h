/*
 * pd_index — the one hash index of the code base: open addressing from a
 * 64-bit hash to a uint32 value, which is a slot in an array the caller owns
 * (requests, radix nodes, rooms). The caller keeps the records and their
 * keys; the index keeps, per entry, the value and the low 32 bits of its
 * hash (the tag). So a lookup compares tags before it touches a record, and
 * a removal moves entries back over the hole (backward-shift deletion, no
 * tombstone slots) without asking the caller for any hash.
 *
 * Capacity is fixed at creation: a power of two at least twice the most
 * entries the caller will ever insert, so a probe always ends at an empty
 * slot. Inserting past that maximum is a bug (asserted), not an error: every
 * caller sizes its records and its index together.
 *
 * Lookup is a cursor over the candidates whose tag matches, in probe order:
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

typedef struct pd_index_entry {
    uint32_t tag;   /* low 32 bits of the hash; its home slot is tag & mask */
    uint32_t value; /* PD_NONE: empty */
} pd_index_entry;

typedef struct pd_index {
    pd_index_entry *slots;
    uint32_t mask;
    uint32_t n, max; /* entries now; the most ever allowed */
} pd_index;

typedef struct pd_index_probe {
    uint32_t i, tag;
} pd_index_probe;

/* An index for at most max_entries entries (>= 1). PD_ERR_NOMEM if the
 * table cannot be allocated; *ix is then empty and pd_index_free is safe. */
pd_err pd_index_init(pd_index *ix, uint32_t max_entries);
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
    for (;;) {
        const pd_index_entry *e = &ix->slots[p->i];
        if (e->value == PD_NONE) return PD_NONE;
        p->i = (p->i + 1) & ix->mask;
        if (e->tag == p->tag) return e->value;
    }
}

/* Starts a probe for hash h and returns its first candidate. */
static inline uint32_t pd_index_first(const pd_index *ix, uint64_t h, pd_index_probe *p) {
    p->tag = (uint32_t)h;
    p->i = p->tag & ix->mask;
    return pd_index_next(ix, p);
}

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_INDEX_H */
