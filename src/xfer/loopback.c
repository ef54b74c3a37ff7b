/*
 * loopback.c — the in-process transport fabric (see include/pdserve/loopback.h).
 *
 * Model. Each room has a sender side (prefill) and a receiver side (decode).
 * Everything that crosses the fabric is an operation with a due time: the
 * receiver's destination (the bootstrap handshake), page / state / metadata
 * writes, the completion notice, abort notices and their acknowledgements,
 * and the news that a peer died. Operations run in (due, posting order) in
 * pd_loopback_advance. A programmed HOLD parks the room's operations until
 * the outcome changes; FAIL fails the room when its next operation of that
 * kind runs.
 *
 * Drained. The sender side is drained when no write of the room is pending
 * (writes read the sender's memory when they run) and its own abort has taken
 * effect. The receiver side is drained when no write is pending and the
 * sender can post no more: it completed, aborted, acknowledged the
 * receiver's abort, or was declared dead.
 *
 * Tombstones. A side that ends a room its peer has not opened yet (abort,
 * or cancel() of a room it never opened) leaves news for the peer: the room
 * stays, with the peer's status already FAILED, so the late side fails at
 * open instead of waiting out its timeout. A tombstone never blocks a live
 * room: when the table is full the oldest is evicted.
 *
 * Both halves gone. Once each side has closed the room it opened (a killed
 * side's rooms close with it) or ended it without opening it (cancel), the
 * room goes at once with every operation still queued for it: control ones
 * (the destination, abort notices, acknowledgements, death notices) and ones
 * parked by a HOLD as well as data. Nobody is left to learn anything, and no
 * memory belongs to the room any more — a write still queued then could only
 * hit memory reused by someone else. Until then data is dropped only by the
 * rules above (abort, failure, a side's death), never because one half left.
 */
#include "pdserve/loopback.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define NONE UINT32_MAX

typedef enum op_kind {
    OP_DEST,      /* receiver -> sender: the destination (bootstrap) */
    OP_PAGES,     /* sender -> receiver: KV pages */
    OP_STATE,     /* sender -> receiver: Mamba state */
    OP_META,      /* sender -> receiver: metadata row */
    OP_DONE,      /* completion notice, after all the data */
    OP_S_ABORT,   /* the sender's abort takes effect */
    OP_R_NOTICE,  /* the receiver learns the sender aborted */
    OP_R_ABORT,   /* the sender learns the receiver aborted */
    OP_ACK,       /* the receiver learns the sender stopped */
    OP_DEAD,      /* a side learns its peer died */
} op_kind;

static bool is_data(op_kind k) {
    return k == OP_PAGES || k == OP_STATE || k == OP_META || k == OP_DONE;
}

typedef struct op {
    uint64_t due, seq;
    uint32_t room_idx;
    op_kind kind;
    bool held, live;
    bool cancelled;       /* dropped while queued: counts already released */
    bool notice_late;     /* OP_S_ABORT: the abort reported an error; its notice is retried */
    pd_lb_side side;      /* OP_DEAD: the side that learns */
    uint32_t first_page, n;
    uint32_t *src;        /* OP_PAGES: source pages */
    uint32_t src_slot;    /* OP_STATE / OP_META */
    uint32_t next_free;
} op;

typedef struct room {
    bool used;
    uint64_t id;
    bool open[2], closed[2];
    pd_xfer_status st[2];
    bool s_done;          /* the sender will post nothing more */
    bool s_aborting;      /* an OP_S_ABORT is pending */
    bool r_stopped;       /* the sender acknowledged the receiver's abort */
    bool dest_known;
    uint32_t prompt, cached, n_dest, mamba_slot, meta_row;
    uint32_t *dest_pages;
    pd_lb_outcome boot, xfer;
    uint32_t pending_data, pending_all;
    uint32_t inc[2];         /* each side's incarnation when it opened the room */
    bool cancelled[2];       /* the side ended the room without opening it */
    bool tomb;               /* kept only to tell a side that has not opened it */
    uint64_t tomb_seq;       /* eviction order of tombstones */
    uint64_t last_data_due;  /* writes and the completion notice keep their order */
} room;

typedef struct side_mem {
    bool alive;
    uint32_t inc;            /* incarnation: bumped when the side dies */
    pd_exec_memory mem;
    pd_meta_row *meta;
    uint32_t meta_rows;
    bool abort_error;
} side_mem;

struct pd_loopback {
    pd_loopback_config cfg;
    room *rooms;
    uint32_t *room_ht, ht_mask;
    op *ops;
    uint32_t ops_cap, op_free;
    uint32_t *heap, heap_n;    /* runnable ops, by (due, seq) */
    uint32_t *held, held_n;    /* ops parked by a HOLD outcome, in posting order */
    uint64_t seq, now, tomb_seq;
    side_mem sides[2];
    pd_rng rng;              /* latency jitter */
};

typedef struct endpoint {
    pd_loopback *lb;
    pd_lb_side side;
} endpoint;

static endpoint endpoints_of(pd_loopback *lb, pd_lb_side side);

/* ---- rooms ----------------------------------------------------------------- */

static uint32_t room_find(pd_loopback *lb, uint64_t id) {
    for (uint32_t i = (uint32_t)pd_hash_u64(id) & lb->ht_mask;; i = (i + 1) & lb->ht_mask) {
        uint32_t r = lb->room_ht[i];
        if (r == NONE) return NONE;
        if (lb->rooms[r].id == id) return r;
    }
}

static void room_free(pd_loopback *lb, uint32_t r);

/* The oldest tombstone, to make space for a live room; NONE if there is none. */
static uint32_t tomb_victim(const pd_loopback *lb) {
    uint32_t best = NONE;
    for (uint32_t r = 0; r < lb->cfg.rooms_max; r++) {
        const room *rm = &lb->rooms[r];
        if (rm->used && rm->tomb && rm->pending_all == 0 &&
            (best == NONE || rm->tomb_seq < lb->rooms[best].tomb_seq))
            best = r;
    }
    return best;
}

static uint32_t room_get(pd_loopback *lb, uint64_t id) {
    uint32_t r = room_find(lb, id);
    if (r != NONE) return r;
    for (r = 0; r < lb->cfg.rooms_max && lb->rooms[r].used; r++) {}
    if (r == lb->cfg.rooms_max) {
        r = tomb_victim(lb);
        if (r == NONE) return NONE;
        room_free(lb, r);
    }
    room *rm = &lb->rooms[r];
    memset(rm, 0, sizeof(*rm));
    rm->used = true;
    rm->id = id;
    rm->mamba_slot = rm->meta_row = NONE;
    uint32_t i = (uint32_t)pd_hash_u64(id) & lb->ht_mask;
    while (lb->room_ht[i] != NONE) i = (i + 1) & lb->ht_mask;
    lb->room_ht[i] = r;
    return r;
}

/* A side that has not opened the room (nor given it up) would find it FAILED. */
static bool carries_news(const room *rm) {
    for (int s = 0; s < 2; s++)
        if (!rm->open[s] && !rm->cancelled[s] && rm->st[s] == PD_XFER_FAILED) return true;
    return false;
}

/* The side is gone for good: it closed the room it opened (or died with it
 * open, which closes it), or it ended the room without ever opening it. */
static bool half_gone(const room *rm, int side) {
    return rm->open[side] ? rm->closed[side] : rm->cancelled[side];
}

static void drop_ops(pd_loopback *lb, uint32_t r, bool data_only);

static void room_release_if_done(pd_loopback *lb, uint32_t r) {
    room *rm = &lb->rooms[r];
    if (!rm->used) return;
    if (half_gone(rm, PD_LB_PREFILL) && half_gone(rm, PD_LB_DECODE)) {
        /* Both halves are gone: no side is left to learn anything or to be
         * written (neither memory belongs to the room any more), so every
         * queued operation goes with the room — control ones and ones parked
         * by a HOLD included. Kept, a parked handshake would pin the room
         * and keep the transport busy forever. */
        drop_ops(lb, r, false);
        PD_ASSERT(rm->pending_all == 0 && !carries_news(rm));
        room_free(lb, r);
        return;
    }
    if (rm->pending_all) return;
    for (int s = 0; s < 2; s++)
        if (rm->open[s] && !rm->closed[s]) return;
    if (carries_news(rm)) {
        if (!rm->tomb) {
            rm->tomb = true;
            rm->tomb_seq = ++lb->tomb_seq;
        }
        return;
    }
    room_free(lb, r);
}

static void room_free(pd_loopback *lb, uint32_t r) {
    room *rm = &lb->rooms[r];
    PD_ASSERT(rm->used && rm->pending_all == 0);
    uint32_t i = (uint32_t)pd_hash_u64(rm->id) & lb->ht_mask;
    while (lb->room_ht[i] != r) i = (i + 1) & lb->ht_mask;
    lb->room_ht[i] = NONE;
    for (uint32_t j = (i + 1) & lb->ht_mask; lb->room_ht[j] != NONE; j = (j + 1) & lb->ht_mask) {
        uint32_t home = (uint32_t)pd_hash_u64(lb->rooms[lb->room_ht[j]].id) & lb->ht_mask;
        bool movable = (j > i) ? (home <= i || home > j) : (home <= i && home > j);
        if (movable) {
            lb->room_ht[i] = lb->room_ht[j];
            lb->room_ht[j] = NONE;
            i = j;
        }
    }
    free(rm->dest_pages);
    memset(rm, 0, sizeof(*rm));
}

static void set_status(room *rm, int side, pd_xfer_status st) {
    pd_xfer_status cur = rm->st[side];
    if (cur == PD_XFER_SUCCESS || cur == PD_XFER_FAILED) return; /* terminal */
    rm->st[side] = st;
}

/* ---- operations -------------------------------------------------------------- */

static bool op_before(const op *a, const op *b) {
    return a->due < b->due || (a->due == b->due && a->seq < b->seq);
}

static void heap_push(pd_loopback *lb, uint32_t o) {
    uint32_t i = lb->heap_n++;
    lb->heap[i] = o;
    while (i > 0) {
        uint32_t p = (i - 1) / 2;
        if (!op_before(&lb->ops[lb->heap[i]], &lb->ops[lb->heap[p]])) break;
        uint32_t t = lb->heap[i];
        lb->heap[i] = lb->heap[p];
        lb->heap[p] = t;
        i = p;
    }
}

static uint32_t heap_pop(pd_loopback *lb) {
    uint32_t top = lb->heap[0];
    lb->heap[0] = lb->heap[--lb->heap_n];
    uint32_t i = 0;
    for (;;) {
        uint32_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < lb->heap_n && op_before(&lb->ops[lb->heap[l]], &lb->ops[lb->heap[m]])) m = l;
        if (r < lb->heap_n && op_before(&lb->ops[lb->heap[r]], &lb->ops[lb->heap[m]])) m = r;
        if (m == i) break;
        uint32_t t = lb->heap[i];
        lb->heap[i] = lb->heap[m];
        lb->heap[m] = t;
        i = m;
    }
    return top;
}

static bool ops_grow(pd_loopback *lb) {
    uint32_t cap = lb->ops_cap ? lb->ops_cap * 2 : 256;
    op *ops = realloc(lb->ops, cap * sizeof(op));
    uint32_t *heap = realloc(lb->heap, cap * sizeof(uint32_t));
    uint32_t *held = realloc(lb->held, cap * sizeof(uint32_t));
    if (ops) lb->ops = ops;
    if (heap) lb->heap = heap;
    if (held) lb->held = held;
    if (!ops || !heap || !held) return false;
    for (uint32_t i = lb->ops_cap; i < cap; i++) {
        lb->ops[i].live = false;
        lb->ops[i].next_free = i + 1 < cap ? i + 1 : NONE;
    }
    lb->op_free = lb->ops_cap;
    lb->ops_cap = cap;
    return true;
}

static op *op_post(pd_loopback *lb, uint32_t r, op_kind kind, uint64_t delay) {
    if (lb->op_free == NONE && !ops_grow(lb)) return NULL;
    uint32_t o = lb->op_free;
    op *p = &lb->ops[o];
    lb->op_free = p->next_free;
    memset(p, 0, sizeof(*p));
    p->live = true;
    if (lb->cfg.jitter) delay += pd_rng_below(&lb->rng, lb->cfg.jitter + 1);
    p->due = lb->now + delay;
    if (is_data(kind)) {
        room *rm = &lb->rooms[r];
        if (p->due < rm->last_data_due) p->due = rm->last_data_due;
        rm->last_data_due = p->due;
    }
    p->seq = ++lb->seq;
    p->room_idx = r;
    p->kind = kind;
    lb->rooms[r].pending_all++;
    if (is_data(kind)) lb->rooms[r].pending_data++;
    heap_push(lb, o);
    return p;
}

static void op_uncount(pd_loopback *lb, op *p) {
    room *rm = &lb->rooms[p->room_idx];
    PD_ASSERT(rm->pending_all > 0);
    rm->pending_all--;
    if (is_data(p->kind)) {
        PD_ASSERT(rm->pending_data > 0);
        rm->pending_data--;
    }
}

/* Frees the op's slot; its room counts must already be released. */
static void op_free_slot(pd_loopback *lb, uint32_t o) {
    op *p = &lb->ops[o];
    free(p->src);
    p->src = NULL;
    p->live = false;
    p->next_free = lb->op_free;
    lb->op_free = o;
}

/* Drops the room's queued operations — only the data ones (they will never
 * touch memory), or all of them when nobody is left to hear or be written.
 * Runnable ones stay in the heap, marked cancelled (pd_loopback_advance frees
 * them); held ones leave lb->held at once. Either way the room's counts drop
 * now, so pd_loopback_pending and the room agree. */
static void drop_ops(pd_loopback *lb, uint32_t r, bool data_only) {
    uint32_t pending_before = lb->rooms[r].pending_all;
    uint32_t dropped = 0;
    for (uint32_t i = 0; i < lb->heap_n; i++) {
        op *p = &lb->ops[lb->heap[i]];
        if (p->room_idx == r && (!data_only || is_data(p->kind)) && !p->cancelled) {
            op_uncount(lb, p);
            p->cancelled = true;
            dropped++;
        }
    }
    uint32_t keep = 0;
    for (uint32_t i = 0; i < lb->held_n; i++) {
        uint32_t o = lb->held[i];
        op *p = &lb->ops[o];
        PD_ASSERT(p->live && p->held && !p->cancelled);
        if (p->room_idx == r && (!data_only || is_data(p->kind))) {
            op_uncount(lb, p);
            op_free_slot(lb, o);
            dropped++;
        } else {
            lb->held[keep++] = o;
        }
    }
    lb->held_n = keep;
    PD_ASSERT(lb->rooms[r].pending_all == pending_before - dropped);
    /* The operation pd_loopback_advance is running (if of this room) is still counted. */
    PD_ASSERT(data_only ? lb->rooms[r].pending_data <= 1 : lb->rooms[r].pending_all <= 1);
}

static void drop_data(pd_loopback *lb, uint32_t r) { drop_ops(lb, r, true); }

static void fail_room(pd_loopback *lb, uint32_t r) {
    room *rm = &lb->rooms[r];
    set_status(rm, PD_LB_PREFILL, PD_XFER_FAILED);
    set_status(rm, PD_LB_DECODE, PD_XFER_FAILED);
    rm->s_done = true;
    drop_data(lb, r);
}

static bool outcome_holds(const room *rm, op_kind k) {
    if (k == OP_DEST) return rm->boot == PD_LB_HOLD;
    if (is_data(k)) return rm->xfer == PD_LB_HOLD;
    return false;
}

/* When abort() reports an error the caller is told, and the transport keeps
 * trying in the background: the notice gets through late, but it gets through — a
 * room whose teardown never completes would quarantine memory forever. */
static uint64_t retry_delay(const pd_loopback *lb) {
    return 4 * lb->cfg.latency + lb->cfg.dead_grace;
}

/* Both sides are the processes that opened the room, alive. */
static bool same_incarnation(const pd_loopback *lb, const room *rm) {
    for (int side = 0; side < 2; side++)
        if (!lb->sides[side].alive || !rm->open[side] || rm->closed[side] ||
            rm->inc[side] != lb->sides[side].inc)
            return false;
    return true;
}

/* The receiver's destination reached the sender: the handshake is over. */
static void run_dest(pd_loopback *lb, const op *p) {
    room *rm = &lb->rooms[p->room_idx];
    if (rm->boot == PD_LB_FAIL) {
        fail_room(lb, p->room_idx);
        return;
    }
    rm->dest_known = true;
    if (rm->open[PD_LB_PREFILL] && rm->st[PD_LB_PREFILL] == PD_XFER_BOOTSTRAPPING)
        set_status(rm, PD_LB_PREFILL, PD_XFER_WAITING_FOR_INPUT);
    if (rm->st[PD_LB_DECODE] == PD_XFER_BOOTSTRAPPING)
        set_status(rm, PD_LB_DECODE, PD_XFER_WAITING_FOR_INPUT);
}

/* Copies a page / state / metadata write from the sender's memory, read now,
 * into the receiver's destination. */
static void copy_write(pd_loopback *lb, const op *p) {
    const room *rm = &lb->rooms[p->room_idx];
    const side_mem *S = &lb->sides[PD_LB_PREFILL];
    side_mem *R = &lb->sides[PD_LB_DECODE];
    if (p->kind == OP_PAGES) {
        size_t bytes = S->mem.kv_page_bytes;
        uint32_t base = rm->cached / lb->cfg.page_size;
        for (uint32_t i = 0; i < p->n; i++) {
            uint32_t dst = rm->dest_pages[p->first_page - base + i];
            memcpy((char *)R->mem.kv + (size_t)dst * bytes,
                   (const char *)S->mem.kv + (size_t)p->src[i] * bytes, bytes);
        }
    } else if (p->kind == OP_STATE) {
        memcpy((char *)R->mem.mamba + (size_t)rm->mamba_slot * R->mem.mamba_slot_bytes,
               (const char *)S->mem.mamba + (size_t)p->src_slot * S->mem.mamba_slot_bytes,
               S->mem.mamba_slot_bytes);
    } else {
        R->meta[rm->meta_row] = S->meta[p->src_slot];
    }
}

static void run_write(pd_loopback *lb, const op *p) {
    room *rm = &lb->rooms[p->room_idx];
    if (rm->xfer == PD_LB_FAIL) {
        fail_room(lb, p->room_idx);
        return;
    }
    if (!same_incarnation(lb, rm)) {
        /* One side died (and maybe came back as a new process whose
         * memory these writes must never touch): the write fails, as
         * with a dead peer's endpoint. */
        fail_room(lb, p->room_idx);
        return;
    }
    if (rm->st[PD_LB_DECODE] == PD_XFER_WAITING_FOR_INPUT)
        set_status(rm, PD_LB_DECODE, PD_XFER_TRANSFERRING);
    copy_write(lb, p);
}

static void run_op(pd_loopback *lb, op *p) {
    room *rm = &lb->rooms[p->room_idx];
    switch (p->kind) {
    case OP_DEST:
        run_dest(lb, p);
        break;
    case OP_PAGES:
    case OP_STATE:
    case OP_META:
        run_write(lb, p);
        break;
    case OP_DONE:
        if (rm->xfer == PD_LB_FAIL || !same_incarnation(lb, rm)) {
            fail_room(lb, p->room_idx);
            break;
        }
        set_status(rm, PD_LB_PREFILL, PD_XFER_SUCCESS);
        if (lb->sides[PD_LB_DECODE].alive && rm->open[PD_LB_DECODE])
            set_status(rm, PD_LB_DECODE, PD_XFER_SUCCESS);
        rm->s_done = true;
        break;
    case OP_S_ABORT:
        rm->s_aborting = false;
        rm->s_done = true;
        drop_data(lb, p->room_idx);
        op_post(lb, p->room_idx, OP_R_NOTICE, p->notice_late ? retry_delay(lb) : lb->cfg.latency);
        break;
    case OP_R_NOTICE:
        set_status(rm, PD_LB_DECODE, PD_XFER_FAILED);
        break;
    case OP_R_ABORT:
        drop_data(lb, p->room_idx);
        set_status(rm, PD_LB_PREFILL, PD_XFER_FAILED);
        rm->s_done = true;
        op_post(lb, p->room_idx, OP_ACK, lb->cfg.latency);
        break;
    case OP_ACK:
        rm->r_stopped = true;
        break;
    case OP_DEAD:
        set_status(rm, p->side, PD_XFER_FAILED);
        if (p->side == PD_LB_PREFILL) rm->s_done = true;
        else rm->r_stopped = true;
        break;
    }
}

void pd_loopback_advance(pd_loopback *lb, uint64_t now) {
    if (now > lb->now) lb->now = now;
    while (lb->heap_n > 0 && lb->ops[lb->heap[0]].due <= lb->now) {
        uint32_t o = heap_pop(lb);
        op *p = &lb->ops[o];
        if (p->cancelled) {
            op_free_slot(lb, o);
            continue;
        }
        room *rm = &lb->rooms[p->room_idx];
        if (outcome_holds(rm, p->kind)) {
            p->held = true;
            lb->held[lb->held_n++] = o;
            continue;
        }
        uint32_t r = p->room_idx;
        run_op(lb, p); /* may post operations: the ops array can move */
        op_uncount(lb, &lb->ops[o]);
        op_free_slot(lb, o);
        room_release_if_done(lb, r);
    }
}

uint32_t pd_loopback_pending(const pd_loopback *lb) {
    uint32_t n = lb->held_n;
    for (uint32_t i = 0; i < lb->heap_n; i++) n += !lb->ops[lb->heap[i]].cancelled;
    return n;
}

static void unhold_room(pd_loopback *lb, uint32_t r) {
    uint32_t keep = 0;
    for (uint32_t i = 0; i < lb->held_n; i++) {
        uint32_t o = lb->held[i];
        op *p = &lb->ops[o];
        if (p->room_idx == r && !outcome_holds(&lb->rooms[r], p->kind)) {
            p->held = false;
            if (p->due < lb->now) p->due = lb->now;
            heap_push(lb, o);
        } else {
            lb->held[keep++] = o;
        }
    }
    lb->held_n = keep;
}

/* ---- the vtable ---------------------------------------------------------------- */

static pd_err ep_sender_open(void *self, uint64_t room_id) {
    endpoint *ep = self;
    pd_loopback *lb = ep->lb;
    if (!lb->sides[PD_LB_PREFILL].alive) return PD_ERR_IO;
    uint32_t r = room_get(lb, room_id);
    if (r == NONE) return PD_ERR_NOMEM;
    room *rm = &lb->rooms[r];
    if (rm->open[PD_LB_PREFILL]) return PD_ERR_EXISTS;
    rm->open[PD_LB_PREFILL] = true;
    rm->tomb = false;
    rm->inc[PD_LB_PREFILL] = lb->sides[PD_LB_PREFILL].inc;
    if (rm->st[PD_LB_PREFILL] == PD_XFER_NONE)
        rm->st[PD_LB_PREFILL] = rm->dest_known ? PD_XFER_WAITING_FOR_INPUT : PD_XFER_BOOTSTRAPPING;
    return PD_OK;
}

static uint32_t ep_sender_peer_cached(void *self, uint64_t room_id) {
    endpoint *ep = self;
    uint32_t r = room_find(ep->lb, room_id);
    return r == NONE ? 0 : ep->lb->rooms[r].cached;
}

/* Common checks for posting writes. */
static pd_err sendable(pd_loopback *lb, uint64_t room_id, uint32_t first, uint32_t n,
                       uint32_t *out_r) {
    if (!lb->sides[PD_LB_PREFILL].alive) return PD_ERR_IO;
    uint32_t r = room_find(lb, room_id);
    if (r == NONE) return PD_ERR_NOTFOUND;
    room *rm = &lb->rooms[r];
    if (!rm->open[PD_LB_PREFILL] || rm->s_done || rm->s_aborting) return PD_ERR_STATE;
    pd_xfer_status st = rm->st[PD_LB_PREFILL];
    if (st != PD_XFER_WAITING_FOR_INPUT && st != PD_XFER_TRANSFERRING) return PD_ERR_STATE;
    uint32_t base = rm->cached / lb->cfg.page_size;
    if (n > 0 && (first < base || first - base + n > rm->n_dest)) return PD_ERR_INVALID;
    *out_r = r;
    return PD_OK;
}

static pd_err post_pages(pd_loopback *lb, uint32_t r, uint32_t first, const uint32_t *src,
                         uint32_t n) {
    if (n == 0) return PD_OK;
    uint32_t *copy = malloc(n * sizeof(uint32_t));
    if (!copy) return PD_ERR_NOMEM;
    memcpy(copy, src, n * sizeof(uint32_t));
    op *p = op_post(lb, r, OP_PAGES, lb->cfg.latency);
    if (!p) {
        free(copy);
        return PD_ERR_NOMEM;
    }
    p->first_page = first;
    p->n = n;
    p->src = copy;
    return PD_OK;
}

static pd_err ep_send_pages(void *self, uint64_t room_id, uint32_t first, const uint32_t *src,
                            uint32_t n) {
    endpoint *ep = self;
    uint32_t r;
    pd_err err = sendable(ep->lb, room_id, first, n, &r);
    if (err) return err;
    err = post_pages(ep->lb, r, first, src, n);
    if (!err) set_status(&ep->lb->rooms[r], PD_LB_PREFILL, PD_XFER_TRANSFERRING);
    return err;
}

static pd_err ep_send_final(void *self, uint64_t room_id, uint32_t first, const uint32_t *src,
                            uint32_t n, uint32_t mamba_slot, uint32_t meta_row) {
    endpoint *ep = self;
    pd_loopback *lb = ep->lb;
    uint32_t r;
    pd_err err = sendable(lb, room_id, first, n, &r);
    if (err) return err;
    room *rm = &lb->rooms[r];
    if ((mamba_slot == PD_POOL_NONE) != (rm->mamba_slot == PD_POOL_NONE)) return PD_ERR_INVALID;
    if (meta_row >= lb->sides[PD_LB_PREFILL].meta_rows) return PD_ERR_INVALID;
    if (first + n != PD_DIV_CEIL(rm->prompt, lb->cfg.page_size) && rm->prompt > rm->cached)
        return PD_ERR_INVALID;
    if ((err = post_pages(lb, r, first, src, n))) return err;
    if (mamba_slot != PD_POOL_NONE) {
        op *p = op_post(lb, r, OP_STATE, lb->cfg.latency);
        if (!p) return PD_ERR_NOMEM;
        p->src_slot = mamba_slot;
    }
    op *p = op_post(lb, r, OP_META, lb->cfg.latency);
    if (!p) return PD_ERR_NOMEM;
    p->src_slot = meta_row;
    if (!op_post(lb, r, OP_DONE, lb->cfg.latency)) return PD_ERR_NOMEM;
    set_status(rm, PD_LB_PREFILL, PD_XFER_TRANSFERRING);
    return PD_OK;
}

static pd_err ep_receiver_open(void *self, uint64_t room_id, const char *peer,
                               const pd_xfer_dest *dest) {
    (void)peer;
    endpoint *ep = self;
    pd_loopback *lb = ep->lb;
    if (!lb->sides[PD_LB_DECODE].alive) return PD_ERR_IO;
    if (!dest || dest->prompt_tokens == 0 || dest->cached_tokens % lb->cfg.page_size ||
        dest->cached_tokens > dest->prompt_tokens ||
        dest->n_pages != PD_DIV_CEIL(dest->prompt_tokens, lb->cfg.page_size) -
                             dest->cached_tokens / lb->cfg.page_size)
        return PD_ERR_INVALID;
    uint32_t r = room_get(lb, room_id);
    if (r == NONE) return PD_ERR_NOMEM;
    room *rm = &lb->rooms[r];
    if (rm->open[PD_LB_DECODE]) return PD_ERR_EXISTS;
    uint32_t *pages = malloc((dest->n_pages + 1) * sizeof(uint32_t));
    if (!pages) return PD_ERR_NOMEM;
    memcpy(pages, dest->pages, dest->n_pages * sizeof(uint32_t));
    free(rm->dest_pages);
    rm->dest_pages = pages;
    rm->n_dest = dest->n_pages;
    rm->prompt = dest->prompt_tokens;
    rm->cached = dest->cached_tokens;
    rm->mamba_slot = dest->mamba_slot;
    rm->meta_row = dest->meta_row;
    rm->open[PD_LB_DECODE] = true;
    rm->tomb = false;
    rm->inc[PD_LB_DECODE] = lb->sides[PD_LB_DECODE].inc;
    if (rm->st[PD_LB_DECODE] == PD_XFER_NONE) rm->st[PD_LB_DECODE] = PD_XFER_BOOTSTRAPPING;
    if (!op_post(lb, r, OP_DEST, lb->cfg.latency)) return PD_ERR_NOMEM;
    return PD_OK;
}

static pd_xfer_status ep_status(void *self, uint64_t room_id) {
    endpoint *ep = self;
    uint32_t r = room_find(ep->lb, room_id);
    if (r == NONE || !ep->lb->rooms[r].open[ep->side]) return PD_XFER_NONE;
    return ep->lb->rooms[r].st[ep->side];
}

static pd_err ep_abort(void *self, uint64_t room_id) {
    endpoint *ep = self;
    pd_loopback *lb = ep->lb;
    uint32_t r = room_find(lb, room_id);
    if (r == NONE) return PD_OK;
    room *rm = &lb->rooms[r];
    bool error = lb->sides[ep->side].abort_error;
    if (ep->side == PD_LB_PREFILL) {
        if (rm->s_done || rm->s_aborting) return error ? PD_ERR_IO : PD_OK;
        if (rm->pending_data == 0) {
            /* Nothing posted is still running: the abort takes effect now. */
            rm->s_done = true;
            uint64_t delay = error ? retry_delay(lb) : lb->cfg.latency;
            if (!op_post(lb, r, OP_R_NOTICE, delay)) return PD_ERR_NOMEM;
            return error ? PD_ERR_IO : PD_OK;
        }
        /* Writes already posted may still run until the abort takes effect. */
        rm->s_aborting = true;
        op *p = op_post(lb, r, OP_S_ABORT, lb->cfg.latency);
        if (!p) return PD_ERR_NOMEM;
        p->notice_late = error;
    } else {
        if (rm->r_stopped) return error ? PD_ERR_IO : PD_OK;
        uint64_t delay = error ? retry_delay(lb) : lb->cfg.latency;
        if (!op_post(lb, r, OP_R_ABORT, delay)) return PD_ERR_NOMEM;
    }
    return error ? PD_ERR_IO : PD_OK;
}

static bool ep_drained(void *self, uint64_t room_id) {
    endpoint *ep = self;
    pd_loopback *lb = ep->lb;
    uint32_t r = room_find(lb, room_id);
    if (r == NONE) return true;
    room *rm = &lb->rooms[r];
    if (rm->pending_data > 0) return false;
    if (ep->side == PD_LB_PREFILL) return !rm->s_aborting;
    /* Receiver: nothing more can come once the sender is done or stopped. */
    return rm->s_done || rm->r_stopped || !lb->sides[PD_LB_PREFILL].alive;
}

static void ep_close(void *self, uint64_t room_id) {
    endpoint *ep = self;
    uint32_t r = room_find(ep->lb, room_id);
    if (r == NONE) return;
    ep->lb->rooms[r].closed[ep->side] = true;
    room_release_if_done(ep->lb, r);
}

static void ep_cancel(void *self, uint64_t room_id, const char *peer) {
    (void)peer;
    endpoint *ep = self;
    pd_loopback *lb = ep->lb;
    if (!lb->sides[ep->side].alive) return;
    uint32_t r = room_get(lb, room_id);
    if (r == NONE) return; /* no slot even for a tombstone: the peer's timeout decides */
    room *rm = &lb->rooms[r];
    if (rm->open[ep->side] || rm->cancelled[ep->side]) return;
    rm->cancelled[ep->side] = true;
    if (ep->side == PD_LB_PREFILL) {
        /* Nothing was ever posted: the sender is done now. */
        if (!rm->s_done) {
            rm->s_done = true;
            op_post(lb, r, OP_R_NOTICE, lb->cfg.latency);
        }
    } else if (!rm->r_stopped) {
        op_post(lb, r, OP_R_ABORT, lb->cfg.latency);
    }
    room_release_if_done(lb, r);
}

static const pd_xfer_vtable loopback_vt = {
    .sender_open = ep_sender_open,
    .sender_peer_cached = ep_sender_peer_cached,
    .send_pages = ep_send_pages,
    .send_final = ep_send_final,
    .receiver_open = ep_receiver_open,
    .status = ep_status,
    .abort = ep_abort,
    .drained = ep_drained,
    .close = ep_close,
    .cancel = ep_cancel,
};

/* ---- lifecycle and controls ---------------------------------------------------- */

struct lb_with_eps {
    pd_loopback lb;
    endpoint eps[2];
};

pd_err pd_loopback_create(pd_loopback **out, const pd_loopback_config *cfg) {
    if (!out || !cfg || cfg->rooms_max == 0 || cfg->page_size == 0) return PD_ERR_INVALID;
    struct lb_with_eps *w = calloc(1, sizeof(*w));
    if (!w) return PD_ERR_NOMEM;
    pd_loopback *lb = &w->lb;
    lb->cfg = *cfg;
    pd_rng_seed(&lb->rng, cfg->jitter_seed);
    uint32_t cap = 16;
    while (cap < 2 * cfg->rooms_max) cap *= 2;
    lb->ht_mask = cap - 1;
    lb->rooms = calloc(cfg->rooms_max, sizeof(room));
    lb->room_ht = malloc(cap * sizeof(uint32_t));
    lb->op_free = NONE;
    if (!lb->rooms || !lb->room_ht || !ops_grow(lb)) {
        pd_loopback_destroy(lb);
        return PD_ERR_NOMEM;
    }
    memset(lb->room_ht, 0xFF, cap * sizeof(uint32_t));
    for (int s = 0; s < 2; s++) {
        w->eps[s].lb = lb;
        w->eps[s].side = (pd_lb_side)s;
        lb->sides[s].alive = true;
    }
    *out = lb;
    return PD_OK;
}

void pd_loopback_destroy(pd_loopback *lb) {
    if (!lb) return;
    for (uint32_t i = 0; i < lb->ops_cap; i++)
        if (lb->ops[i].live) free(lb->ops[i].src);
    for (uint32_t r = 0; r < lb->cfg.rooms_max && lb->rooms; r++) free(lb->rooms[r].dest_pages);
    free(lb->rooms);
    free(lb->room_ht);
    free(lb->ops);
    free(lb->heap);
    free(lb->held);
    free((struct lb_with_eps *)lb);
}

static endpoint endpoints_of(pd_loopback *lb, pd_lb_side side) {
    return ((struct lb_with_eps *)lb)->eps[side];
}

pd_xfer pd_loopback_endpoint(pd_loopback *lb, pd_lb_side side) {
    (void)endpoints_of;
    return (pd_xfer){.vt = &loopback_vt, .self = &((struct lb_with_eps *)lb)->eps[side]};
}

void pd_loopback_register(pd_loopback *lb, pd_lb_side side, const pd_exec_memory *mem,
                          pd_meta_row *meta, uint32_t meta_rows) {
    side_mem *s = &lb->sides[side];
    s->mem = *mem;
    s->meta = meta;
    s->meta_rows = meta_rows;
}

/* A room that only ever carried a programmed outcome, now back to the
 * default, is no different from no room: forget it. A test that releases a
 * hold after both halves are gone (and the room with them) must not leave a
 * blank room pinning a slot forever. */
static void room_forget_if_blank(pd_loopback *lb, uint32_t r) {
    const room *rm = &lb->rooms[r];
    for (int s = 0; s < 2; s++)
        if (rm->open[s] || rm->cancelled[s] || rm->st[s] != PD_XFER_NONE) return;
    if (rm->pending_all || rm->tomb || rm->dest_known || rm->s_done || rm->s_aborting ||
        rm->r_stopped || rm->boot != PD_LB_OK || rm->xfer != PD_LB_OK)
        return;
    room_free(lb, r);
}

static void set_outcome(pd_loopback *lb, uint64_t room_id, bool boot, pd_lb_outcome o) {
    uint32_t r = room_find(lb, room_id);
    if (r == NONE && o == PD_LB_OK) return; /* the default: nothing to remember */
    if (r == NONE) r = room_get(lb, room_id);
    if (r == NONE) return;
    if (boot) lb->rooms[r].boot = o;
    else lb->rooms[r].xfer = o;
    unhold_room(lb, r);
    room_forget_if_blank(lb, r);
}

void pd_loopback_set_bootstrap(pd_loopback *lb, uint64_t room_id, pd_lb_outcome o) {
    set_outcome(lb, room_id, true, o);
}

void pd_loopback_set_transfer(pd_loopback *lb, uint64_t room_id, pd_lb_outcome o) {
    set_outcome(lb, room_id, false, o);
}

void pd_loopback_set_abort_error(pd_loopback *lb, pd_lb_side side, bool on) {
    lb->sides[side].abort_error = on;
}

void pd_loopback_kill(pd_loopback *lb, pd_lb_side side) {
    lb->sides[side].alive = false;
    lb->sides[side].inc++;
    lb->sides[side].abort_error = false;
    pd_lb_side peer = side == PD_LB_PREFILL ? PD_LB_DECODE : PD_LB_PREFILL;
    for (uint32_t r = 0; r < lb->cfg.rooms_max; r++) {
        room *rm = &lb->rooms[r];
        if (!rm->used || !rm->open[side] || rm->closed[side]) continue;
        /* Its memory is gone: nothing may touch it, nothing more comes from it. */
        drop_data(lb, r);
        rm->closed[side] = true;
        if (side == PD_LB_PREFILL) rm->s_done = true;
        if (rm->open[peer] && !rm->closed[peer]) {
            op *p = op_post(lb, r, OP_DEAD, lb->cfg.dead_grace);
            if (p) p->side = peer;
        }
        /* The peer's half may be gone already: then the room goes now. */
        room_release_if_done(lb, r);
    }
}

void pd_loopback_restart(pd_loopback *lb, pd_lb_side side) {
    lb->sides[side].alive = true;
    memset(&lb->sides[side].mem, 0, sizeof(pd_exec_memory));
    lb->sides[side].meta = NULL;
    lb->sides[side].meta_rows = 0;
}

pd_xfer_status pd_loopback_status(pd_loopback *lb, pd_lb_side side, uint64_t room_id) {
    uint32_t r = room_find(lb, room_id);
    return r == NONE ? PD_XFER_NONE : lb->rooms[r].st[side];
}
