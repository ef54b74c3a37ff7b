/*
 * room.h — the room core: one node's view of the rooms it takes part in,
 * with the rules of the transport contract (include/pdserve/xfer.h), and no
 * I/O. Every transport drives it: the loopback fabric (src/xfer/loopback.c)
 * and UCX with its TCP bootstrap channel (src/xfer/net.c). They differ only
 * in how news travels between the two nodes (an operation queue in one
 * process, messages on a socket and puts on a UCX endpoint); what a room is,
 * how its status moves, when it is drained, when it outlives close() as a
 * tombstone and what cancel() does are decided here, once.
 *
 * A half is one side's state of one room: the prefill node holds the sender
 * half, the decode node the receiver half. (The loopback, which sees both
 * nodes, keeps both halves of a room in one record.)
 *
 * Status. NONE until this side opens the room, then forward only:
 *   BOOTSTRAPPING -> WAITING_FOR_INPUT -> TRANSFERRING -> SUCCESS
 * with FAILED reachable from anywhere; SUCCESS and FAILED are final. A half
 * not yet opened may already be FAILED: news from the peer (it aborted or
 * cancelled first). Opening it then keeps FAILED, so the engine fails the
 * request at once instead of waiting out its timeout.
 *
 * Drained: no write of the room will touch this node's memory again.
 *   sender:   no write is outstanding (writes read the source until they
 *             complete locally) and its own abort has taken effect;
 *   receiver: no write is known to be on its way, the sender has said it
 *             will write no more (done, aborted, acknowledged our abort,
 *             refused our destination, or never got it), and a settle time
 *             after losing the peer has passed.
 *
 * Tombstones. A half that the engine has closed (or never opened) stays
 * while it still has news to deliver: to the local engine (FAILED before it
 * opened), or to the peer (this side ended the room before the peer's
 * destination arrived: the late destination is answered with an abort). A
 * tombstone never blocks a live room: when the table is full the oldest
 * evictable tombstone goes.
 *
 * Cancel. A side that ends a room it never opened marks its half cancelled
 * and tells the peer once: a sender is done at once (it posted nothing); a
 * receiver's peer may be waiting for a destination that will never come.
 */
#ifndef PD_XFER_ROOM_H
#define PD_XFER_ROOM_H

#include "pdserve/index.h"
#include "pdserve/pool.h"
#include "pdserve/xfer.h"

typedef enum xr_role { XR_SENDER = 0, XR_RECEIVER = 1 } xr_role;

typedef struct xr_half {
    bool open, closed;   /* the engine opened / closed the room on this side */
    bool cancelled;      /* this side ended the room without opening it */
    pd_xfer_status st;   /* written through xr_st only */
    uint8_t *watch;      /* the engine's copy of xr_status (pd_xfer_vtable.watch), or NULL */
    uint32_t writes_out; /* writes of the room that may still touch this node's memory */
    /* sender */
    bool done;        /* posts no more writes */
    bool stopping;    /* its own abort waits for writes in flight to settle */
    bool early_abort; /* ended before the destination came: answer it with an abort */
    /* receiver */
    bool dest_sent;        /* the destination may have reached the sender */
    bool abort_sent;       /* our abort is on its way (or was) */
    bool peer_stopped;     /* the sender will write nothing more */
    uint64_t settle_until; /* not drained before this time (a lost peer's writes) */
} xr_half;

/* The destination: the receiver's own, or what reached the sender. */
typedef struct xr_dest {
    bool known;
    uint32_t prompt, cached, n_pages, mamba_slot, meta_row;
    uint32_t *pages; /* n_pages destination pages for sequence pages from cached / page */
    bool borrowed;   /* pages is the transport's storage (xr_dest_set_in), not the heap's */
} xr_dest;

/* What a transport must do after an engine call. */
typedef enum xr_act {
    XR_ACT_NONE = 0,     /* nothing to send */
    XR_ACT_NOTIFY,       /* tell the peer now */
    XR_ACT_NOTIFY_LATER, /* tell the peer once the writes in flight have settled */
} xr_act;

/* ---- the status and the half's rules ---- */

static inline bool xr_is_final(pd_xfer_status st);
/* Moves the status forward; a final status never changes. */
static inline void xr_set_status(xr_half *h, pd_xfer_status st);
/* The status the engine sees: NONE until it opened the room. */
static inline pd_xfer_status xr_status(const xr_half *h);
/* The engine's copy of xr_status kept at slot (NULL: none) while the half is
 * open; xr_close ends it. */
static inline void xr_watch(xr_half *h, uint8_t *slot);

/* Opens the half for the engine. PD_ERR_EXISTS if it was opened or ended
 * here before. A half already FAILED (news from the peer) stays FAILED. */
static inline pd_err xr_open_sender(xr_half *h, bool dest_known);
/* The half was never opened nor ended here (xr_open_* would succeed). */
static inline bool xr_can_open(const xr_half *h);
static inline pd_err xr_open_receiver(xr_half *h);
/* The destination reached the sender (either half: a half bootstrapping
 * moves to WAITING_FOR_INPUT). */
static inline void xr_dest_arrived(xr_half *h);
/* The receiver learnt that writes started. */
static inline void xr_data_started(xr_half *h);

/* The engine's abort. Sender: stops posting; NOTIFY if nothing is in
 * flight (the abort takes effect now), NOTIFY_LATER if writes must settle
 * first (then call xr_abort_effective). Receiver: NOTIFY once; a
 * destination that never left needs no notice (the sender can never write). */
xr_act xr_abort(xr_half *h, xr_role role);
/* The sender's abort took effect: nothing it posted is in flight any more. */
static inline void xr_abort_effective(xr_half *h);
/* The sender will post nothing more: completed, or the peer stopped it. */
static inline void xr_sender_done(xr_half *h);
/* The receiver learnt the sender will write nothing more. */
static inline void xr_peer_stopped(xr_half *h);
/* The peer failed the room (its abort, its refusal, its death). */
static inline void xr_peer_failed(xr_half *h, xr_role role);

static inline bool xr_drained(const xr_half *h, xr_role role, uint64_t now);

/* The engine closes the half it opened (only once drained). */
static inline void xr_close(xr_half *h);
/* cancel() of a room this side never opened: NOTIFY if the peer must be
 * told, NONE if the half was open or cancelled already. */
xr_act xr_cancel(xr_half *h, xr_role role);

/* The engine is done with the half: closed, or ended without opening. */
static inline bool xr_gone(const xr_half *h);
/* A half not opened (nor ended) here that the local engine would find FAILED. */
static inline bool xr_news_for_engine(const xr_half *h);
/* A sender half that must stay to answer the peer's late destination. */
static inline bool xr_news_for_peer(const xr_half *h, const xr_dest *d);

/* ---- the destination ---- */

/* Checks a destination against the page size: a non-empty prompt, a cached
 * prefix that is a page multiple within it, and one page per uncached page. */
static inline bool xr_dest_valid(const pd_xfer_dest *dest, uint32_t page_size);
/* Copies a valid destination in. PD_ERR_NOMEM leaves d unchanged. */
pd_err xr_dest_set(xr_dest *d, const pd_xfer_dest *dest);
/* Copies a valid destination into the caller's storage of at least
 * dest->n_pages pages, which must outlive d (no allocation; d never frees it). */
void xr_dest_set_in(xr_dest *d, const pd_xfer_dest *dest, uint32_t *storage);
/* Forgets the destination, freeing its pages unless they were borrowed. */
void xr_dest_clear(xr_dest *d);
/* Checks writes of sequence pages [first, first + n) against the destination. */
static inline bool xr_dest_covers(const xr_dest *d, uint32_t page_size, uint32_t first, uint32_t n);
/* The final send's pages end the prompt, and its Mamba state matches. */
static inline bool xr_final_fits(const xr_dest *d, uint32_t page_size, uint32_t first, uint32_t n,
                                 uint32_t mamba_slot);
/* The destination of sequence page `page` (which xr_dest_covers). */
static inline uint32_t xr_dest_page(const xr_dest *d, uint32_t page_size, uint32_t page);
/* A sender half that may post writes now. */
static inline bool xr_sendable(const xr_half *h);

/* ---- the room table ----
 * Records of a transport's own type, each starting with an xr_slot, in one
 * array sized at creation, found by room id through a pd_index. */
typedef struct xr_slot {
    uint64_t id;
    uint32_t gen; /* bumped when the slot is freed */
    bool used;
    uint64_t tomb_order; /* 0: not a tombstone; else when it became one */
} xr_slot;

typedef struct xr_table {
    char *recs;
    size_t stride;
    uint32_t max;
    pd_index ix;
    uint32_t *free_slots, n_free;
    uint64_t tomb_seq;
    /* A tombstone the transport can drop now (nothing of it is in flight). */
    bool (*evictable)(void *ctx, uint32_t r);
    /* Frees the transport's part of record r and calls xr_remove. */
    void (*evict)(void *ctx, uint32_t r);
    void *ctx;
} xr_table;

pd_err xr_table_init(xr_table *t, uint32_t max, size_t stride,
                     bool (*evictable)(void *ctx, uint32_t r), void (*evict)(void *ctx, uint32_t r),
                     void *ctx);
void xr_table_free(xr_table *t);

static inline xr_slot *xr_at(const xr_table *t, uint32_t r) {
    return (xr_slot *)(t->recs + (size_t)r * t->stride);
}

/* The record of room id, or PD_NONE. */
uint32_t xr_find(const xr_table *t, uint64_t id);
/* A record for room id (not present), zeroed after its xr_slot, evicting
 * the oldest evictable tombstone when the table is full; PD_NONE if none is. */
uint32_t xr_add(xr_table *t, uint64_t id);
/* Frees the record (its generation moves on). The caller frees what the
 * record points to first. */
void xr_remove(xr_table *t, uint32_t r);
/* Marks the record a tombstone (once; the order is kept) or a live room again. */
void xr_set_tomb(xr_table *t, uint32_t r, bool tomb);
uint32_t xr_used(const xr_table *t);

/* ---- the half's rules and the destination's checks, inline ----
 * A transport asks these on every call about a room (status polls, drained
 * checks, each send): defined here so that the loopback and net.c inline
 * them instead of calling into room.c (issue 13). */

static inline bool xr_is_final(pd_xfer_status st) {
    return st == PD_XFER_SUCCESS || st == PD_XFER_FAILED;
}

static inline pd_xfer_status xr_status(const xr_half *h) { return h->open ? h->st : PD_XFER_NONE; }

/* Every change of the status: the engine's copy follows it. */
static inline void xr_st(xr_half *h, pd_xfer_status st) {
    h->st = st;
    if (h->watch) *h->watch = (uint8_t)xr_status(h);
}

static inline void xr_watch(xr_half *h, uint8_t *slot) {
    bool keep = slot && h->open && !h->closed;
    h->watch = keep ? slot : NULL;
    if (slot) *slot = (uint8_t)xr_status(h);
}

static inline void xr_set_status(xr_half *h, pd_xfer_status st) {
    if (xr_is_final(h->st)) return;
    PD_ASSERT(st >= h->st || st == PD_XFER_FAILED);
    xr_st(h, st);
}

static inline bool xr_can_open(const xr_half *h) { return !h->open && !h->closed && !h->cancelled; }

static inline pd_err xr_open_sender(xr_half *h, bool dest_known) {
    if (!xr_can_open(h)) return PD_ERR_EXISTS;
    h->open = true;
    if (h->st == PD_XFER_NONE)
        xr_st(h, dest_known ? PD_XFER_WAITING_FOR_INPUT : PD_XFER_BOOTSTRAPPING);
    return PD_OK;
}

static inline pd_err xr_open_receiver(xr_half *h) {
    if (!xr_can_open(h)) return PD_ERR_EXISTS;
    h->open = true;
    if (h->st == PD_XFER_NONE) xr_st(h, PD_XFER_BOOTSTRAPPING);
    return PD_OK;
}

static inline void xr_dest_arrived(xr_half *h) {
    if (h->st == PD_XFER_BOOTSTRAPPING) xr_st(h, PD_XFER_WAITING_FOR_INPUT);
}

static inline void xr_data_started(xr_half *h) {
    if (h->st == PD_XFER_BOOTSTRAPPING || h->st == PD_XFER_WAITING_FOR_INPUT)
        xr_st(h, PD_XFER_TRANSFERRING);
}

static inline void xr_abort_effective(xr_half *h) {
    h->stopping = false;
    h->done = true;
}

static inline void xr_sender_done(xr_half *h) { h->done = true; }

static inline void xr_peer_stopped(xr_half *h) { h->peer_stopped = true; }

static inline void xr_peer_failed(xr_half *h, xr_role role) {
    xr_set_status(h, PD_XFER_FAILED);
    if (role == XR_SENDER) h->done = true;
    else h->peer_stopped = true;
}

static inline bool xr_drained(const xr_half *h, xr_role role, uint64_t now) {
    if (h->writes_out > 0) return false;
    if (role == XR_SENDER) return !h->stopping;
    return h->peer_stopped && now >= h->settle_until;
}

static inline void xr_close(xr_half *h) {
    if (h->open) h->closed = true;
    h->watch = NULL;
}

static inline bool xr_gone(const xr_half *h) { return h->open ? h->closed : h->cancelled; }

static inline bool xr_news_for_engine(const xr_half *h) {
    return !h->open && !h->cancelled && h->st == PD_XFER_FAILED;
}

static inline bool xr_news_for_peer(const xr_half *h, const xr_dest *d) {
    return h->early_abort && !d->known;
}

static inline bool xr_sendable(const xr_half *h) {
    if (!h->open || h->closed || h->done || h->stopping) return false;
    return h->st == PD_XFER_WAITING_FOR_INPUT || h->st == PD_XFER_TRANSFERRING;
}

static inline bool xr_dest_valid(const pd_xfer_dest *dest, uint32_t ps) {
    return dest && ps > 0 && dest->prompt_tokens > 0 && dest->cached_tokens % ps == 0 &&
        dest->cached_tokens <= dest->prompt_tokens &&
        dest->n_pages == PD_DIV_CEIL(dest->prompt_tokens, ps) - dest->cached_tokens / ps &&
        (dest->n_pages == 0 || dest->pages);
}

static inline bool xr_dest_covers(const xr_dest *d, uint32_t ps, uint32_t first, uint32_t n) {
    if (n == 0) return true;
    uint32_t base = d->cached / ps;
    return first >= base && first - base <= d->n_pages && n <= d->n_pages - (first - base);
}

static inline bool xr_final_fits(const xr_dest *d, uint32_t ps, uint32_t first, uint32_t n,
                                 uint32_t mamba_slot) {
    if ((mamba_slot == PD_POOL_NONE) != (d->mamba_slot == PD_POOL_NONE)) return false;
    return d->prompt <= d->cached || first + n == PD_DIV_CEIL(d->prompt, ps);
}

static inline uint32_t xr_dest_page(const xr_dest *d, uint32_t ps, uint32_t page) {
    uint32_t i = page - d->cached / ps;
    PD_ASSERT(i < d->n_pages);
    return d->pages[i];
}

#endif /* PD_XFER_ROOM_H */
