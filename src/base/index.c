/*
 * index.c — pd_index (include/pdserve/index.h).
 */
#include "pdserve/index.h"

#include <stdlib.h>

pd_err pd_index_init(pd_index *ix, uint32_t max_entries, pd_index_hash_fn hash_of,
                     const void *ctx) {
    *ix = (pd_index){0};
    if (max_entries == 0 || max_entries > (UINT32_MAX >> 2) || !hash_of) return PD_ERR_INVALID;
    uint32_t cap = 16;
    while (cap < 2 * max_entries) cap *= 2;
    ix->slots = malloc((size_t)cap * sizeof(uint32_t));
    if (!ix->slots) return PD_ERR_NOMEM;
    ix->mask = cap - 1;
    ix->max = max_entries;
    ix->hash_of = hash_of;
    ix->ctx = ctx;
    pd_index_clear(ix);
    return PD_OK;
}

void pd_index_free(pd_index *ix) {
    free(ix->slots);
    *ix = (pd_index){0};
}

void pd_index_clear(pd_index *ix) {
    for (uint32_t i = 0; ix->slots && i <= ix->mask; i++) ix->slots[i] = PD_NONE;
    ix->n = 0;
}

void pd_index_insert(pd_index *ix, uint64_t h, uint32_t value) {
    PD_ASSERT(value != PD_NONE);
    PD_ASSERTF(ix->n < ix->max, "index full (%u entries)", ix->max);
    uint32_t i = (uint32_t)h & ix->mask;
    while (ix->slots[i] != PD_NONE) i = (i + 1) & ix->mask;
    ix->slots[i] = value;
    ix->n++;
}

void pd_index_remove(pd_index *ix, uint64_t h, uint32_t value) {
    uint32_t hole = (uint32_t)h & ix->mask;
    while (ix->slots[hole] != value) {
        PD_ASSERTF(ix->slots[hole] != PD_NONE, "value %u not in the index", value);
        hole = (hole + 1) & ix->mask;
    }
    ix->slots[hole] = PD_NONE;
    ix->n--;
    /* Backward shift: an entry after the hole may move into it unless its
     * home lies in the cyclic interval (hole, j]. */
    for (uint32_t j = (hole + 1) & ix->mask; ix->slots[j] != PD_NONE; j = (j + 1) & ix->mask) {
        uint32_t home = (uint32_t)ix->hash_of(ix->ctx, ix->slots[j]) & ix->mask;
        if (((j - home) & ix->mask) >= ((j - hole) & ix->mask)) {
            ix->slots[hole] = ix->slots[j];
            ix->slots[j] = PD_NONE;
            hole = j;
        }
    }
}
