/*
 * room.c — the room core (src/xfer/room.h): the half's abort and cancel,
 * the destination's copies and the room table (the half's other rules and
 * the destination's checks are inline in room.h). No I/O, no clock, no
 * locks: the transport that drives it supplies time and serialises calls.
 */
#include "room.h"

#include <stdlib.h>
#include <string.h>

/* ---- the half ------------------------------------------------------------ */

xr_act xr_abort(xr_half *h, xr_role role) {
    if (role == XR_SENDER) {
        if (h->done || h->stopping) return XR_ACT_NONE;
        if (h->writes_out == 0) {
            h->done = true;
            return XR_ACT_NOTIFY;
        }
        h->stopping = true;
        return XR_ACT_NOTIFY_LATER;
    }
    if (h->peer_stopped) return XR_ACT_NONE;
    if (!h->dest_sent) {
        h->peer_stopped = true; /* the sender never learnt where to write */
        return XR_ACT_NONE;
    }
    if (h->abort_sent) return XR_ACT_NONE;
    h->abort_sent = true;
    return XR_ACT_NOTIFY;
}

xr_act xr_cancel(xr_half *h, xr_role role) {
    if (h->open || h->cancelled) return XR_ACT_NONE;
    h->cancelled = true;
    if (role == XR_SENDER) {
        if (h->done) return XR_ACT_NONE;
        h->done = true; /* it never posted anything */
        return XR_ACT_NOTIFY;
    }
    return h->peer_stopped ? XR_ACT_NONE : XR_ACT_NOTIFY;
}

/* ---- the destination ---------------------------------------------------- */

/* Points d at pages (holding dest's page list already), freeing what it owned. */
static void dest_fill(xr_dest *d, const pd_xfer_dest *dest, uint32_t *pages, bool borrowed) {
    if (!d->borrowed) free(d->pages);
    *d = (xr_dest){
        .known = true,
        .prompt = dest->prompt_tokens,
        .cached = dest->cached_tokens,
        .n_pages = dest->n_pages,
        .mamba_slot = dest->mamba_slot,
        .meta_row = dest->meta_row,
        .pages = pages,
        .borrowed = borrowed,
    };
}

pd_err xr_dest_set(xr_dest *d, const pd_xfer_dest *dest) {
    uint32_t *pages = malloc(((size_t)dest->n_pages + 1) * sizeof(uint32_t));
    if (!pages) return PD_ERR_NOMEM;
    if (dest->n_pages) memcpy(pages, dest->pages, dest->n_pages * sizeof(uint32_t));
    dest_fill(d, dest, pages, false);
    return PD_OK;
}

void xr_dest_set_in(xr_dest *d, const pd_xfer_dest *dest, uint32_t *storage) {
    PD_ASSERT(storage || dest->n_pages == 0);
    if (dest->n_pages) memmove(storage, dest->pages, dest->n_pages * sizeof(uint32_t));
    dest_fill(d, dest, storage, true);
}

void xr_dest_clear(xr_dest *d) {
    if (!d->borrowed) free(d->pages);
    memset(d, 0, sizeof(*d));
}

/* ---- the room table ----------------------------------------------------- */

/* The index's hash of record r: its room id's. */
static uint64_t slot_hash_of(const void *ctx, uint32_t r) { return pd_hash_u64(xr_at(ctx, r)->id); }

pd_err xr_table_init(xr_table *t, uint32_t max, size_t stride,
                     bool (*evictable)(void *ctx, uint32_t r), void (*evict)(void *ctx, uint32_t r),
                     void *ctx) {
    memset(t, 0, sizeof(*t));
    if (max == 0 || stride < sizeof(xr_slot)) return PD_ERR_INVALID;
    t->stride = stride;
    t->max = max;
    t->evictable = evictable;
    t->evict = evict;
    t->ctx = ctx;
    t->recs = calloc(max, stride);
    t->free_slots = malloc(max * sizeof(uint32_t));
    if (!t->recs || !t->free_slots || pd_index_init(&t->ix, max, slot_hash_of, t) != PD_OK) {
        xr_table_free(t);
        return PD_ERR_NOMEM;
    }
    for (uint32_t i = 0; i < max; i++) t->free_slots[i] = max - 1 - i;
    t->n_free = max;
    return PD_OK;
}

void xr_table_free(xr_table *t) {
    free(t->recs);
    free(t->free_slots);
    pd_index_free(&t->ix);
    memset(t, 0, sizeof(*t));
}

uint32_t xr_find(const xr_table *t, uint64_t id) {
    pd_index_probe p;
    for (uint32_t r = pd_index_first(&t->ix, pd_hash_u64(id), &p); r != PD_NONE;
         r = pd_index_next(&t->ix, &p))
        if (xr_at(t, r)->id == id) return r;
    return PD_NONE;
}

/* The oldest tombstone the transport can drop; PD_NONE if there is none. */
static uint32_t tomb_victim(const xr_table *t) {
    uint32_t best = PD_NONE;
    uint64_t best_order = UINT64_MAX;
    for (uint32_t r = 0; r < t->max; r++) {
        const xr_slot *s = xr_at(t, r);
        if (!s->used || s->tomb_order == 0 || s->tomb_order >= best_order) continue;
        if (t->evictable && !t->evictable(t->ctx, r)) continue;
        best = r;
        best_order = s->tomb_order;
    }
    return best;
}

uint32_t xr_add(xr_table *t, uint64_t id) {
    PD_ASSERT(xr_find(t, id) == PD_NONE);
    if (t->n_free == 0) {
        uint32_t v = tomb_victim(t);
        if (v == PD_NONE) return PD_NONE;
        t->evict(t->ctx, v);
        PD_ASSERT(t->n_free > 0 && !xr_at(t, v)->used);
    }
    uint32_t r = t->free_slots[--t->n_free];
    xr_slot *s = xr_at(t, r);
    uint32_t gen = s->gen;
    memset(s, 0, t->stride);
    *s = (xr_slot){.id = id, .gen = gen, .used = true};
    pd_index_insert(&t->ix, pd_hash_u64(id), r);
    return r;
}

void xr_remove(xr_table *t, uint32_t r) {
    xr_slot *s = xr_at(t, r);
    PD_ASSERT(s->used);
    pd_index_remove(&t->ix, pd_hash_u64(s->id), r);
    s->used = false;
    s->tomb_order = 0;
    s->gen++;
    t->free_slots[t->n_free++] = r;
}

void xr_set_tomb(xr_table *t, uint32_t r, bool tomb) {
    xr_slot *s = xr_at(t, r);
    if (!tomb) s->tomb_order = 0;
    else if (s->tomb_order == 0) s->tomb_order = ++t->tomb_seq;
}

uint32_t xr_used(const xr_table *t) { return t->max - t->n_free; }
