/*
 * engine.c — what the prefill and decode engines share: creation of the
 * node's pools, ledger and prefix cache; request records with their rid and
 * room indexes and queues; submit validation; the single retire path; room
 * draining; batches in flight; and the checks.
 *
 * The retire path (DESIGN.md section 3) is eng_retire:
 *   1. record the terminal reason if none is recorded (first reason wins);
 *   2. while a forward of the request is in flight, mark the retire pending
 *      and return — the last result calls eng_retire again
 *      (eng_result_after_retire, which drops every such result);
 *   3. tell the transport to abort the room, best effort: an error is
 *      counted, never allowed to skip step 4;
 *   4. release locally (release_retired), each only if its flag says it is
 *      held, clearing the flag: (on success only: insert into the prefix
 *      cache) metadata row, host load, Mamba slots, cache lock, own pages,
 *      row. Units the room may still touch go to QUARANTINE(room) and the
 *      cache lock is kept until the transport reports the room drained;
 *   5. emit the terminal event unless already emitted.
 * The two releases that do not end a request live here too, so that units
 * are given back in this file only: the optimistic requeue
 * (eng_release_for_requeue) and decode's commit (eng_release_at_commit).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_internal.h"

/* ---- names ---------------------------------------------------------------- */

const char *pd_role_name(pd_role role) {
    switch (role) {
    case PD_ROLE_PREFILL: return "prefill";
    case PD_ROLE_DECODE: return "decode";
    case PD_ROLE_COLOCATED: return "colocated";
    }
    return "unknown";
}

const char *pd_terminal_kind_name(pd_terminal_kind k) {
    switch (k) {
    case PD_TERM_NONE: return "none";
    case PD_TERM_FINISHED: return "finished";
    case PD_TERM_ABORTED: return "aborted";
    case PD_TERM_FAILED: return "failed";
    }
    return "unknown";
}

const char *pd_finish_reason_name(pd_finish_reason f) {
    switch (f) {
    case PD_FINISH_NONE: return "none";
    case PD_FINISH_LENGTH: return "length";
    case PD_FINISH_STOP: return "stop";
    case PD_FINISH_TRANSFERRED: return "transferred";
    }
    return "unknown";
}

const char *pd_xfer_status_name(pd_xfer_status st) {
    switch (st) {
    case PD_XFER_NONE: return "none";
    case PD_XFER_BOOTSTRAPPING: return "bootstrapping";
    case PD_XFER_WAITING_FOR_INPUT: return "waiting_for_input";
    case PD_XFER_TRANSFERRING: return "transferring";
    case PD_XFER_SUCCESS: return "success";
    case PD_XFER_FAILED: return "failed";
    }
    return "unknown";
}

const char *pd_action_name(pd_action a) {
    static const char *const names[PD_ACT__COUNT] = {
        [PD_ACT_ACCEPT] = "accept",         [PD_ACT_TERMINAL_REASON] = "terminal-reason",
        [PD_ACT_ROOM_OPEN] = "room-open",   [PD_ACT_LAUNCH] = "launch",
        [PD_ACT_RESULT] = "result",         [PD_ACT_SEND_PAGES] = "send-pages",
        [PD_ACT_SEND_FINAL] = "send-final", [PD_ACT_PARK] = "park",
        [PD_ACT_REQUEUE] = "requeue",       [PD_ACT_INSERT] = "insert",
        [PD_ACT_COMMIT] = "commit",         [PD_ACT_TOKEN] = "token",
        [PD_ACT_ROOM_ABORT] = "room-abort", [PD_ACT_ROOM_CANCEL] = "room-cancel",
        [PD_ACT_RELEASE] = "release",       [PD_ACT_TERMINAL] = "terminal",
        [PD_ACT_ROOM_CLOSE] = "room-close",
    };
    return (unsigned)a < PD_ACT__COUNT ? names[a] : "unknown";
}

void eng_act_report(pd_engine *e, const req *r, pd_action a, bool final, uint32_t n) {
    pd_action_event ev = {.action = a,
                          .req = r->owner,
                          .record = eng_idx(e, r),
                          .rid = r->rid,
                          .room = r->room,
                          .kind = (pd_terminal_kind)r->term,
                          .final = final,
                          .n = n};
    e->obs(e->obs_ctx, &ev);
}

uint64_t pd_room_nonce(uint64_t room) {
    uint64_t n = pd_hash_u64(room ^ 0xA5A5F00DCAFEull);
    return n ? n : 1;
}

static const char *const queue_names[Q__COUNT] = {
    [Q_BOOTSTRAP] = "BOOTSTRAP", [Q_WAITING] = "WAITING",   [Q_LOADING] = "LOADING",
    [Q_PREFILL] = "PREFILL",     [Q_PARKED] = "PARKED",     [Q_TRANSFER] = "TRANSFER",
    [Q_PREALLOC] = "PREALLOC",   [Q_WAIT_XFER] = "WAIT_TRANSFER", [Q_RUNNING] = "RUNNING",
    [Q_RETIRING] = "RETIRING",   [Q_DRAINING] = "DRAINING",
};

void pd_engine_config_default(pd_engine_config *cfg, pd_role role) {
    memset(cfg, 0, sizeof(*cfg));
    cfg->role = role;
    cfg->page_size = 4;
    cfg->kv_pages = 256;
    cfg->rows = 16;
    cfg->meta_rows = 16;
    cfg->requests_max = 64;
    cfg->chunk_tokens = 16;
    cfg->batch_max = 8;
    cfg->new_tokens_max = 256;
    cfg->overlap = true;
    cfg->prefix_cache = true;
    cfg->strict = true;
}

/* ---- records, indexes and queues ----------------------------------------- */

/* The rid and room indexes (pd_index): a live rid maps to its record until
 * the terminal event, a room (not colocated) until the record is freed. */
static uint64_t rid_hash_of(const void *ctx, uint32_t idx) {
    return ((const pd_engine *)ctx)->reqs[idx].rid_hash;
}

static uint64_t room_hash_of(const void *ctx, uint32_t idx) {
    return pd_hash_u64(((const pd_engine *)ctx)->reqs[idx].room);
}

static uint32_t rid_find(const pd_engine *e, const char *rid) {
    pd_index_probe p;
    for (uint32_t i = pd_index_first(&e->rid_ix, pd_hash_str(rid), &p); i != PD_NONE;
         i = pd_index_next(&e->rid_ix, &p))
        if (strcmp(e->reqs[i].rid, rid) == 0) return i;
    return PD_NONE;
}

static uint32_t room_find(const pd_engine *e, uint64_t room) {
    pd_index_probe p;
    for (uint32_t i = pd_index_first(&e->room_ix, pd_hash_u64(room), &p); i != PD_NONE;
         i = pd_index_next(&e->room_ix, &p))
        if (e->reqs[i].room == room) return i;
    return PD_NONE;
}

static void rid_index_remove(pd_engine *e, req *r) {
    pd_index_remove(&e->rid_ix, r->rid_hash, eng_idx(e, r));
}

static req *record_alloc(pd_engine *e) {
    uint32_t idx = e->free_reqs.head;
    if (idx == PD_NONE) return NULL;
    pd_list_remove(&e->free_reqs, eng_qlinks(e), idx);
    req *r = &e->reqs[idx];
    uint32_t gen = eng_gen(r) + 1; /* a free record keeps its last owner */
    memset(r, 0, sizeof(*r));
    r->owner = ((uint64_t)gen << 32) | (uint64_t)(idx + 1);
    r->live = true;
    r->queue = Q_NONE;
    pd_link_init(&r->qlink);
    r->row = r->mamba_run = r->meta_row = PD_NONE;
    r->mamba_track[0] = r->mamba_track[1] = PD_NONE;
    r->final_snap = PD_NONE;
    r->lock_node = PD_CNODE_NONE;
    r->ticket = PD_TICKET_NONE;
    r->pages = e->page_store + (size_t)idx * e->pages_per_req;
    e->reqs_live++;
    return r;
}

static void buf_drop(int32_t **buf, uint32_t *cap) {
    free(*buf);
    *buf = NULL;
    *cap = 0;
}

/* Makes *buf (of *cap tokens) hold n tokens: kept when it does, else
 * replaced. False, with no buffer left, when out of memory. Cache-line
 * aligned, like the prefix cache's token arena: a 16-token page of the
 * prompt is then one line, where malloc's 16-byte alignment spread three
 * pages in four over two, and the match compares, and the insert copies,
 * the prompt page by page. The capacity is whole lines (aligned_alloc's
 * size must be a multiple of its alignment), the next power of two of them
 * up to most (the engine's limit for the buffer, at most REQ_BUF_KEEP_MAX):
 * a kept buffer is then replaced a few times in its record's life, where one
 * sized to each prompt was replaced whenever a longer one came (0.03
 * allocations per request at submit at 1,024 live in bench/sched). */
static bool buf_fit(int32_t **buf, uint32_t *cap, uint32_t n, uint32_t most) {
    if (*buf && *cap >= n) return true;
    buf_drop(buf, cap);
    enum { LINE_TOKENS = 64 / sizeof(int32_t) };
    uint64_t need = ((uint64_t)PD_MAX(n, 1u) + LINE_TOKENS - 1) / LINE_TOKENS * LINE_TOKENS;
    uint64_t top = ((uint64_t)most + LINE_TOKENS - 1) / LINE_TOKENS * LINE_TOKENS;
    uint64_t tokens = LINE_TOKENS;
    while (tokens < need) tokens *= 2;
    tokens = PD_MIN(tokens, PD_MAX(top, need));
    *buf = aligned_alloc(64, (size_t)tokens * sizeof(int32_t));
    if (!*buf) return false;
    *cap = (uint32_t)PD_MIN(tokens, (uint64_t)UINT32_MAX);
    return true;
}

static void record_free(pd_engine *e, req *r) {
    PD_ASSERT(r->live);
    PD_ASSERT(!r->holds_row && !r->holds_kv && !r->holds_lock && !r->holds_mamba &&
              !r->holds_meta && !r->holds_host && !r->holds_room);
    PD_ASSERT(r->forwards_in_flight == 0 && r->streamed);
    PD_ASSERT(!r->q_pages && !r->q_mamba && !r->q_meta && !r->q_lock);
    q_remove(e, r);
    uint32_t idx = eng_idx(e, r);
    if (r->rid_indexed) rid_index_remove(e, r);
    if (e->cfg.role != PD_ROLE_COLOCATED) pd_index_remove(&e->room_ix, pd_hash_u64(r->room), idx);
    req_buf *b = &e->bufs[idx]; /* kept for the record's next request */
    if (b->prompt_cap > REQ_BUF_KEEP_MAX) buf_drop(&b->prompt, &b->prompt_cap);
    if (b->history_cap > REQ_BUF_KEEP_MAX) buf_drop(&b->history, &b->history_cap);
    r->prompt = NULL;
    r->history = NULL;
    r->live = false;
    pd_list_push_front(&e->free_reqs, eng_qlinks(e), idx);
    e->reqs_live--;
}

/* ---- memory helpers -------------------------------------------------------- */

#define LEDGER_MUST(e, expr)                                                   \
    do {                                                                       \
        pd_err le_ = (expr);                                                   \
        PD_ASSERTF(le_ == PD_OK, "ledger refused (%s): %s", pd_err_name(le_),  \
                   pd_ledger_last_error((e)->ledger));                         \
    } while (0)

/* Pages an allocation can get now: free, or evictable from the cache. */
static uint64_t kv_backing(pd_engine *e) {
    uint64_t avail = pd_pool_free_count(e->kv);
    if (e->cache) avail += pd_cache_dev_evictable(e->cache);
    return avail;
}

uint64_t eng_kv_available(pd_engine *e) {
    uint64_t avail = kv_backing(e);
    return avail > e->reserved ? avail - e->reserved : 0;
}

/* Every reservation, this one included, must stay backed by free or
 * evictable pages. The prefix r just locked is no longer evictable: a
 * request that needs no page of its own (its prompt all cached) can still
 * take away pages an earlier reservation counted on, so the check is
 * backing >= reserved + need, never "available >= need" with available
 * clamped at zero. */
bool eng_reserve_pages(pd_engine *e, req *r, uint32_t need) {
    if (kv_backing(e) < e->reserved + need) {
        if (r->holds_lock) { /* the prefix it matched: not worth holding while it waits */
            PD_MUST(pd_cache_unlock(e->cache, r->lock_node));
            r->holds_lock = r->holds_kv = false;
            r->lock_node = PD_CNODE_NONE;
        }
        return false;
    }
    r->reserved = need;
    e->reserved += need;
    return true;
}

void eng_alloc_pages(pd_engine *e, req *r, uint32_t n) {
    if (n == 0) return;
    PD_ASSERTF(r->reserved >= n, "request %s allocates %u pages beyond its reservation %u",
               r->rid, n, r->reserved);
    PD_ASSERT(r->n_pages + n <= e->pages_per_req);
    uint32_t free_now = pd_pool_free_count(e->kv), taken = 0;
    if (free_now < n && e->cache)
        PD_MUST(pd_cache_evict_to(e->cache, n - free_now, r->owner, r->pages + r->n_pages, &taken));
    /* Within r's reservation, which admission checked against free +
     * evictable pages (eng_reserve_pages): this allocation cannot fail. */
    if (n > taken)
        LEDGER_MUST(e,
                    pd_ledger_alloc(e->ledger, e->kv_id, n - taken, r->owner,
                                    r->pages + r->n_pages + taken));
    r->n_pages += n;
    r->holds_kv = true;
    r->reserved -= n;
    e->reserved -= n;
}

void eng_cache_lock(pd_engine *e, req *r, pd_cnode node) {
    PD_ASSERT(!r->holds_lock);
    PD_MUST(pd_cache_lock(e->cache, node));
    r->lock_node = node;
    r->holds_lock = true;
    r->holds_kv = true;
}

/* What follows an insert of r's pages: duplicates freed, own_from moved,
 * a track slot the cache took forgotten. */
static void cache_insert_done(pd_engine *e, req *r, const pd_cache_insert_result *res,
                              uint32_t snapshot_slot) {
    uint32_t ps = e->cfg.page_size;
    if (res->dup_pages)
        LEDGER_MUST(
            e, pd_ledger_free(e->ledger, e->kv_id, e->dups, res->dup_pages, PD_UNIT_REQ, r->owner));
    uint32_t covered = res->covered_tokens / ps;
    PD_ASSERTF(covered >= r->own_from, "insert covered %u pages, below the %u already cached",
               covered, r->own_from);
    r->own_from = covered;
    /* A track slot the cache took is the cache's now: r forgets it, and its
     * next snapshot allocates a new one. */
    if (res->mamba_taken) {
        int track = r->mamba_track[0] == snapshot_slot ? 0 : 1;
        PD_ASSERTF(snapshot_slot != PD_NONE && r->mamba_track[track] == snapshot_slot,
                   "the cache took Mamba slot %u, not a track slot of %s", snapshot_slot, r->rid);
        r->mamba_track[track] = PD_NONE;
    }
}

/* The insert of eng_cache_insert without the lock move: pages[0, tokens/ps)
 * (+ snapshot) go into the cache, duplicates are freed, own_from follows.
 * Returns the node the insert ended at. The caller reports the insert. */
static pd_cnode cache_insert_pages(pd_engine *e, req *r, uint32_t tokens, uint32_t snapshot_slot) {
    PD_ASSERT(e->cache);
    uint32_t ps = e->cfg.page_size;
    uint32_t n = tokens / ps;
    PD_ASSERT(n <= r->n_pages);
    pd_cache_insert_result res;
    /* From the node r holds locked: the walk from the root to it would only
     * find r's pages there the cache's already (the cache checks and falls
     * back to the root otherwise). */
    pd_cnode start = r->holds_lock ? r->lock_node : PD_CNODE_ROOT;
    PD_MUST(pd_cache_insert_from(e->cache, start, r->prompt, n * ps, r->pages, r->owner,
                                 snapshot_slot, e->dups, &res));
    cache_insert_done(e, r, &res, snapshot_slot);
    return res.node;
}

void eng_cache_insert(pd_engine *e, req *r, uint32_t tokens, uint32_t snapshot_slot) {
    uint32_t ps = e->cfg.page_size, whole = tokens / ps * ps;
    PD_ASSERT(e->cache && tokens / ps <= r->n_pages);
    eng_act(e, r, PD_ACT_INSERT, false, whole);
    if (r->holds_lock) {
        /* The usual case: the insert starts at the node r holds locked and
         * its lock moves down to the end in the same walk. */
        pd_cache_insert_result res;
        pd_err err = pd_cache_insert_locked(e->cache, r->lock_node, r->prompt, whole, r->pages,
                                            r->owner, snapshot_slot, e->dups, &res);
        PD_ASSERTF(err == PD_OK || err == PD_ERR_INVALID, "insert: %s", pd_err_name(err));
        if (err == PD_OK) {
            cache_insert_done(e, r, &res, snapshot_slot);
            r->lock_node = res.node;
            return;
        }
    }
    pd_cnode node = cache_insert_pages(e, r, tokens, snapshot_slot);
    /* The request's lock moves down to the new node: lock first, then let go
     * of the old one, so the path is never unprotected. */
    if (!r->holds_lock || node != r->lock_node) {
        /* Down the same path (the usual case): one walk between the two
         * nodes instead of two to the root. */
        pd_err err = r->holds_lock ? pd_cache_lock_move(e->cache, r->lock_node, node)
                                   : PD_ERR_INVALID;
        PD_ASSERTF(err == PD_OK || err == PD_ERR_INVALID, "lock move: %s", pd_err_name(err));
        if (err != PD_OK) {
            PD_MUST(pd_cache_lock(e->cache, node));
            if (r->holds_lock) PD_MUST(pd_cache_unlock(e->cache, r->lock_node));
        }
        r->lock_node = node;
        r->holds_lock = true;
        r->holds_kv = true;
    }
}

/* ---- the retire path --------------------------------------------------------- */

void eng_emit_terminal(pd_engine *e, req *r) {
    if (r->streamed) return;
    r->streamed = true;
    PD_ASSERT(r->term != PD_TERM_NONE);
    if (r->term == PD_TERM_FINISHED) e->ctr.finished++;
    else if (r->term == PD_TERM_ABORTED) e->ctr.aborted++;
    else e->ctr.failed++;
    pd_terminal_event ev = {
        .tag = r->tag,
        .rid = r->rid,
        .room = r->room,
        .kind = (pd_terminal_kind)r->term,
        .finish = r->finish,
        .status_code = r->status,
        .message = r->msg,
        .prompt_tokens = r->prompt_len,
        .completion_tokens = r->out_len,
        .cached_tokens = r->cached_tokens,
        .submit_us = r->t_submit,
        .admit_us = r->t_admit,
        .computed_us = r->t_computed,
        .xfer_first_us = r->t_xfer_first,
        .xfer_start_us = r->t_xfer_start,
        .xfer_done_us = r->t_xfer_done,
        .xfer_bytes = r->xfer_bytes,
    };
    eng_act(e, r, PD_ACT_TERMINAL, false, 0);
    e->sink.vt->terminal(e->sink.self, &ev);
    /* The client has its answer: the rid is free for a new request (engine.h),
     * while this record may still drain its room. */
    PD_ASSERT(r->rid_indexed);
    rid_index_remove(e, r);
    r->rid_indexed = false;
}

static void free_or_quarantine(pd_engine *e, req *r, int pool_id, const uint32_t *u,
                               uint32_t n, bool quarantine) {
    if (n == 0) return;
    if (quarantine)
        LEDGER_MUST(e, pd_ledger_move(e->ledger, pool_id, u, n, PD_UNIT_REQ, r->owner,
                                      PD_UNIT_QUARANTINE, r->room));
    else
        LEDGER_MUST(e, pd_ledger_free(e->ledger, pool_id, u, n, PD_UNIT_REQ, r->owner));
}

static uint32_t mamba_slots_of(req *r, uint32_t *out) {
    uint32_t n = 0;
    if (r->mamba_run != PD_NONE) out[n++] = r->mamba_run;
    for (int i = 0; i < 2; i++)
        if (r->mamba_track[i] != PD_NONE) out[n++] = r->mamba_track[i];
    return n;
}

/* Step 4, on success only: the computed prompt goes into the prefix cache,
 * with the snapshot of its end if one was taken there.
 *
 * Two walks of the tree are skipped, neither changing what the cache holds:
 *  - nothing new (every whole page is the cache's already, under r's lock,
 *    and no snapshot to give): no insert;
 *  - not quarantined: r's lock stays where it is instead of moving down to
 *    the inserted node, since release_kv unlocks it right after and nothing
 *    runs in between that could evict the pages just inserted. Quarantined,
 *    the room may still read them: the lock moves down and is kept. */
static void insert_finished_prompt(pd_engine *e, req *r, bool quarantine) {
    if (!e->cache || !r->holds_kv || r->term != PD_TERM_FINISHED) return;
    uint32_t ps = e->cfg.page_size;
    uint32_t whole = (PD_MIN(r->done, r->prompt_len) / ps) * ps;
    uint32_t snap = (r->holds_mamba && whole == r->prompt_len) ? r->final_snap : PD_NONE;
    r->final_snap = PD_NONE;
    bool nothing_new = whole <= r->own_from * ps && snap == PD_NONE && r->holds_lock;
    if (whole == 0 || nothing_new) return;
    if (quarantine) {
        eng_cache_insert(e, r, whole, snap);
    } else {
        eng_act(e, r, PD_ACT_INSERT, false, whole);
        (void)cache_insert_pages(e, r, whole, snap);
    }
}

static void release_meta_row(pd_engine *e, req *r, bool quarantine) {
    if (!r->holds_meta) return;
    free_or_quarantine(e, r, e->meta_id, &r->meta_row, 1, quarantine);
    r->q_meta = quarantine;
    if (!quarantine) r->meta_row = PD_NONE;
    r->holds_meta = false;
}

/* A host-tier load in flight: cancelled at the executor and the cache; its
 * device pages return to the reservation and go with the rest. */
static void cancel_host_load(pd_engine *e, req *r) {
    if (!r->holds_host) return;
    e->exec.vt->load_cancel(e->exec.self, r->load_id);
    PD_MUST(pd_cache_load_cancel(e->cache, r->ticket));
    PD_ASSERT(r->n_pages == r->load_from + r->load_pages);
    r->n_pages = r->load_from;
    r->reserved += r->load_pages;
    e->reserved += r->load_pages;
    r->ticket = PD_TICKET_NONE;
    r->holds_host = false;
}

/* Own pages and the cache lock. Quarantined pages keep the lock: the room
 * may still read the cached prefix they extend. */
static void release_kv(pd_engine *e, req *r, bool quarantine) {
    if (!r->holds_kv) return;
    uint32_t own = r->n_pages - r->own_from;
    free_or_quarantine(e, r, e->kv_id, r->pages + r->own_from, own, quarantine);
    r->q_pages = quarantine && own > 0;
    if (r->holds_lock) {
        if (quarantine) {
            r->q_lock = true;
        } else {
            PD_MUST(pd_cache_unlock(e->cache, r->lock_node));
            r->lock_node = PD_CNODE_NONE;
        }
        r->holds_lock = false;
    }
    if (!r->q_pages) r->n_pages = r->own_from = 0;
    r->holds_kv = false;
}

/* Step 4 after the metadata row, shared with the optimistic requeue: what the
 * request computes with — host load, Mamba slots (before the row, which maps
 * to them), cache lock and own pages, the reservation, the row. */
static void release_compute(pd_engine *e, req *r, bool quarantine) {
    r->pending_chunk = false;
    cancel_host_load(e, r);
    if (r->holds_mamba) {
        uint32_t slots[3];
        uint32_t n = mamba_slots_of(r, slots);
        free_or_quarantine(e, r, e->mamba_id, slots, n, quarantine);
        r->q_mamba = quarantine && n > 0;
        if (!quarantine) r->mamba_run = r->mamba_track[0] = r->mamba_track[1] = PD_NONE;
        r->holds_mamba = false;
    }
    release_kv(e, r, quarantine);
    e->reserved -= r->reserved;
    r->reserved = 0;
    if (r->holds_row) {
        LEDGER_MUST(e, pd_ledger_free(e->ledger, e->row_id, &r->row, 1, PD_UNIT_REQ, r->owner));
        r->row = PD_NONE;
        r->holds_row = false;
    }
}

/* Step 4 of the retire path: everything the flags say r holds. quarantine:
 * the room is not drained, so what it may still touch (pages, Mamba slots,
 * metadata row, and the cache lock) stays out of use until it is. */
static void release_retired(pd_engine *e, req *r, bool quarantine) {
    insert_finished_prompt(e, r, quarantine);
    release_meta_row(e, r, quarantine);
    release_compute(e, r, quarantine);
}

/* Step 3 for a request that never opened its room: its peer's half may be
 * waiting for it; the transport tells the peer (xfer.h, cancel). */
static void cancel_room(pd_engine *e, uint64_t room, const char *peer) {
    if (!e->xfer.vt || !e->xfer.vt->cancel || room == 0) return;
    const char *to = e->cfg.role == PD_ROLE_DECODE && peer && peer[0] ? peer : NULL;
    e->xfer.vt->cancel(e->xfer.self, room, to);
    e->ctr.rooms_cancelled++;
}

/* The lines a retire that goes ahead reads or writes beyond the record's
 * first two and the terminal reason's (written just before): the flags and
 * slots (release_retired), the times and counts (the terminal event), the
 * drain flags, the record's kept buffers and its slots in the rid and room
 * indexes (record_free). All are cold by now (the request was admitted many
 * steps ago); asked for at once, they load side by side instead of one after
 * another as the retire reaches each. A retire known in advance asks for
 * them earlier, in stages (decode.c, retire_done). */
PD_PREFETCH_INLINE void retire_prefetch(const pd_engine *e, const req *r) {
    eng_retire_prefetch_record(e, r);
    eng_retire_prefetch_index(e, r);
}

void eng_retire(pd_engine *e, req *r, pd_terminal_kind kind, pd_finish_reason finish,
                int status, const char *msg) {
    if (!r->live || r->queue == Q_DRAINING) return; /* already fully retired */
    eng_terminal_reason(e, r, kind, finish, status, msg);
    if (r->forwards_in_flight > 0) {
        if (!r->retire_pending) {
            r->retire_pending = true;
            e->ctr.retire_deferred++;
            q_move(e, r, Q_RETIRING);
        }
        return;
    }
    retire_prefetch(e, r);
    bool room = r->holds_room;
    if (room && r->term != PD_TERM_FINISHED) {
        eng_act(e, r, PD_ACT_ROOM_ABORT, false, 0);
        pd_err err = e->xfer.vt->abort(e->xfer.self, r->room);
        if (err != PD_OK) e->ctr.xfer_abort_errors++;
    } else if (!r->opened_room && e->cfg.role != PD_ROLE_COLOCATED &&
               r->term != PD_TERM_FINISHED) {
        /* Only a room this request never opened is cancelled: one it opened
         * and closed (decode, at commit) is over for both sides. */
        eng_act(e, r, PD_ACT_ROOM_CANCEL, false, 0);
        cancel_room(e, r->room, r->peer);
    }
    bool quarantine = room && !e->xfer.vt->drained(e->xfer.self, r->room);
    eng_act(e, r, PD_ACT_RELEASE, r->term == PD_TERM_FINISHED, 0);
    release_retired(e, r, quarantine);
    eng_emit_terminal(e, r);
    if (quarantine) {
        q_move(e, r, Q_DRAINING);
        return;
    }
    if (room) {
        eng_act(e, r, PD_ACT_ROOM_CLOSE, false, 0);
        e->xfer.vt->close(e->xfer.self, r->room);
        r->holds_room = false;
    }
    r->meta_row = PD_NONE;
    record_free(e, r);
}

bool eng_result_after_retire_slow(pd_engine *e, req *r) {
    if (r->term == PD_TERM_NONE && !r->retire_pending) return false;
    if (r->forwards_in_flight == 0)
        eng_retire(e, r, (pd_terminal_kind)r->term, r->finish, r->status, r->msg);
    return true;
}

void eng_release_for_requeue(pd_engine *e, req *r) {
    PD_ASSERT(r->forwards_in_flight == 0 && !r->holds_host && r->term == PD_TERM_NONE);
    uint32_t ps = e->cfg.page_size;
    /* Keep what was computed: cache its whole pages, then let go. */
    if (e->cache && r->holds_kv && r->done >= ps)
        eng_cache_insert(e, r, (r->done / ps) * ps, PD_NONE);
    /* Still bootstrapping, so nothing was sent: nothing to quarantine. The
     * metadata row and the room stay for the next attempt. */
    PD_ASSERT(!r->bootstrapped && r->holds_meta && r->holds_room);
    release_compute(e, r, false);
    r->launched = r->done = r->sent_pages = 0;
    r->cached_tokens = 0;
    r->n_pages = r->own_from = 0;
    r->track_next = 0;
    r->final_snap = PD_NONE;
}

void eng_release_at_commit(pd_engine *e, req *r) {
    PD_ASSERT(r->holds_room && r->holds_meta);
    if (!e->xfer.vt->drained(e->xfer.self, r->room)) return;
    eng_act(e, r, PD_ACT_ROOM_CLOSE, false, 0);
    e->xfer.vt->close(e->xfer.self, r->room);
    r->holds_room = false;
    LEDGER_MUST(e, pd_ledger_free(e->ledger, e->meta_id, &r->meta_row, 1, PD_UNIT_REQ, r->owner));
    r->meta_row = PD_NONE;
    r->holds_meta = false;
}

/* Called every step for draining records: frees what the room could touch
 * once the transport says it never will again. */
static void drain_poll(pd_engine *e) {
    uint32_t idx = e->q[Q_DRAINING].head;
    while (idx != PD_NONE) {
        req *r = &e->reqs[idx];
        idx = r->qlink.next;
        if (!e->xfer.vt->drained(e->xfer.self, r->room)) continue;
        if (r->q_pages) {
            LEDGER_MUST(e, pd_ledger_free(e->ledger, e->kv_id, r->pages + r->own_from,
                                          r->n_pages - r->own_from, PD_UNIT_QUARANTINE, r->room));
            r->q_pages = false;
            r->n_pages = r->own_from = 0;
        }
        if (r->q_mamba) {
            uint32_t slots[3];
            uint32_t n = mamba_slots_of(r, slots);
            LEDGER_MUST(e, pd_ledger_free(e->ledger, e->mamba_id, slots, n,
                                          PD_UNIT_QUARANTINE, r->room));
            r->mamba_run = r->mamba_track[0] = r->mamba_track[1] = PD_NONE;
            r->q_mamba = false;
        }
        if (r->q_meta) {
            LEDGER_MUST(e, pd_ledger_free(e->ledger, e->meta_id, &r->meta_row, 1,
                                          PD_UNIT_QUARANTINE, r->room));
            r->meta_row = PD_NONE;
            r->q_meta = false;
        }
        if (r->q_lock) {
            PD_MUST(pd_cache_unlock(e->cache, r->lock_node));
            r->lock_node = PD_CNODE_NONE;
            r->q_lock = false;
        }
        eng_act(e, r, PD_ACT_ROOM_CLOSE, false, 0);
        e->xfer.vt->close(e->xfer.self, r->room);
        r->holds_room = false;
        record_free(e, r);
    }
}

/* ---- batches ------------------------------------------------------------------ */

batch_rec *eng_batch_begin(pd_engine *e) {
    if (e->inflight_n == INFLIGHT_MAX) return NULL;
    batch_rec *b = &e->inflight[(e->inflight_head + e->inflight_n) % INFLIGHT_MAX];
    b->n = 0;
    return b;
}

void eng_batch_launch(pd_engine *e, batch_rec *b) {
    if (b->n == 0) return;
    b->id = ++e->next_batch_id;
    pd_batch batch = {.id = b->id, .items = e->launch_items, .n_items = b->n};
    PD_MUST(e->exec.vt->launch(e->exec.self, &batch));
    e->inflight_n++;
    e->ctr.batches++;
}

bool eng_batch_poll(pd_engine *e,
                    void (*fn)(pd_engine *, req *, const bitem *, const pd_item_result *,
                               const pd_item_top *)) {
    if (e->inflight_n == 0) return false;
    batch_rec *b = &e->inflight[e->inflight_head];
    if (!e->exec.vt->poll(e->exec.self, b->id, e->results, e->result_tops)) return false;
    e->inflight_head = (e->inflight_head + 1) % INFLIGHT_MAX;
    e->inflight_n--;
    enum { AHEAD = 4 };
    for (uint32_t i = 0; i < b->n && i < AHEAD; i++) eng_prefetch(e, b->items[i].idx);
    for (uint32_t i = 0; i < b->n; i++) {
        const bitem *it = &b->items[i];
        if (i + AHEAD < b->n) eng_prefetch(e, b->items[i + AHEAD].idx);
        req *r = &e->reqs[it->idx];
        if (!r->live || eng_gen(r) != it->gen) {
            /* The request was fully retired and its record reused: a delayed
             * result is ignored — no release, no event. */
            e->ctr.late_results_ignored++;
            continue;
        }
        PD_ASSERT(e->results[i].req == r->owner);
        PD_ASSERT(r->forwards_in_flight > 0);
        r->forwards_in_flight--;
        if (r->forwards_in_flight == 0) r->pending_chunk = false;
        eng_act(e, r, PD_ACT_RESULT, it->final, it->n);
        fn(e, r, it, &e->results[i], &e->result_tops[i]);
    }
    return true;
}

/* ---- create / destroy ---------------------------------------------------------- */

static void cache_write_back(void *ctx, pd_copy_dir dir, const uint32_t *dev,
                             const uint32_t *host, uint32_t n) {
    pd_engine *e = ctx;
    PD_ASSERT(dir == PD_COPY_DEV_TO_HOST);
    e->exec.vt->write_back(e->exec.self, dev, host, n);
}

/* The configuration on its own: a known role, positive sizes, what the role
 * requires. */
static pd_err config_check(const pd_engine_config *cfg, char *msg, size_t msg_cap) {
    if (cfg->role != PD_ROLE_PREFILL && cfg->role != PD_ROLE_DECODE &&
        cfg->role != PD_ROLE_COLOCATED)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "unknown role %d", (int)cfg->role);
    if (cfg->page_size == 0 || cfg->kv_pages == 0 || cfg->rows == 0 || cfg->meta_rows == 0 ||
        cfg->requests_max == 0 || cfg->chunk_tokens == 0 || cfg->batch_max == 0 ||
        cfg->new_tokens_max == 0)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID,
                         "page size, pools, requests_max, chunk, batch and new_tokens_max "
                         "must be positive");
    if (!cfg->meta_mem && cfg->role != PD_ROLE_COLOCATED)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "meta_mem is required");
    if (cfg->host_pages && !cfg->prefix_cache)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "a host tier needs the prefix cache");
    if (cfg->requests_max > (1u << 24))
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "requests_max above 16M");
    return PD_OK;
}

/* The executor serves this configuration: same page size, memory for every
 * pool, Mamba layers exactly when there are Mamba slots. Fills *info. */
static pd_err exec_check(const pd_engine_config *cfg, pd_executor exec, pd_model_info *info,
                         char *msg, size_t msg_cap) {
    exec.vt->info(exec.self, info);
    pd_exec_memory mem;
    exec.vt->memory(exec.self, &mem);
    if (info->page_size != cfg->page_size)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "executor page size %u, engine %u",
                         info->page_size, cfg->page_size);
    if (mem.kv_pages < cfg->kv_pages || mem.mamba_slots < cfg->mamba_slots ||
        mem.host_pages < cfg->host_pages)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID,
                         "executor memory (%u pages, %u slots, %u host pages) "
                         "smaller than the pools",
                         mem.kv_pages, mem.mamba_slots, mem.host_pages);
    if (info->has_mamba != (cfg->mamba_slots > 0))
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID,
                         "the model %s Mamba layers but mamba_slots is %u",
                         info->has_mamba ? "has" : "has no", cfg->mamba_slots);
    return PD_OK;
}

/* The ledger, its pools (kv, row, then mamba, meta and host when
 * configured, in that order: their ids are the ledger's) and the prefix
 * cache over them. */
static pd_err pools_create(pd_engine *e) {
    const pd_engine_config *cfg = &e->cfg;
    pd_err err = pd_ledger_create(&e->ledger, cfg->strict);
    if (!err) err = pd_pool_create(&e->kv, "kv", PD_POOL_KV, cfg->kv_pages, cfg->page_size);
    if (!err) err = pd_ledger_add_pool(e->ledger, e->kv, &e->kv_id);
    if (!err) err = pd_pool_create(&e->row, "row", PD_POOL_ROW, cfg->rows, 0);
    if (!err) err = pd_ledger_add_pool(e->ledger, e->row, &e->row_id);
    if (!err && cfg->mamba_slots)
        err = pd_pool_create(&e->mamba, "mamba", PD_POOL_MAMBA, cfg->mamba_slots, 0);
    if (!err && cfg->mamba_slots) err = pd_ledger_add_pool(e->ledger, e->mamba, &e->mamba_id);
    if (!err) err = pd_pool_create(&e->meta, "meta", PD_POOL_META, cfg->meta_rows, 0);
    if (!err) err = pd_ledger_add_pool(e->ledger, e->meta, &e->meta_id);
    if (!err && cfg->host_pages)
        err = pd_pool_create(&e->host, "host", PD_POOL_HOST, cfg->host_pages, cfg->page_size);
    if (!err && cfg->host_pages) err = pd_ledger_add_pool(e->ledger, e->host, &e->host_id);
    if (!err && cfg->prefix_cache) {
        pd_cache_config cc = {
            .ledger = e->ledger, .kv_pool = e->kv_id, .mamba_pool = e->mamba_id,
            .host_pool = e->host_id, .write_back = cfg->host_pages > 0,
            .copy = cache_write_back, .copy_ctx = e,
        };
        err = pd_cache_create(&e->cache, &cc);
    }
    return err;
}

/* Every per-request array, sized once from requests_max, pages_per_req and
 * batch_max. */
static pd_err arrays_alloc(pd_engine *e) {
    const pd_engine_config *cfg = &e->cfg;
    pd_err err = pd_index_init(&e->rid_ix, cfg->requests_max, rid_hash_of, e);
    if (!err) err = pd_index_init(&e->room_ix, cfg->requests_max, room_hash_of, e);
    if (err) return err;
    /* Cache-line aligned: the hot fields of a record share one line. */
    e->reqs = aligned_alloc(_Alignof(req), cfg->requests_max * sizeof(req));
    if (e->reqs) memset(e->reqs, 0, cfg->requests_max * sizeof(req));
    e->bufs = calloc(cfg->requests_max, sizeof(req_buf));
    e->page_store = calloc((size_t)cfg->requests_max * e->pages_per_req, sizeof(uint32_t));
    e->scratch = calloc(e->pages_per_req, sizeof(uint32_t));
    e->dups = calloc(e->pages_per_req, sizeof(uint32_t));
    e->launch_buf = calloc(2 * (size_t)cfg->batch_max, sizeof(pd_batch_item));
    e->launch_items = e->launch_buf;
    e->kept_grow = calloc(cfg->batch_max, sizeof(uint32_t));
    e->kept_gap = calloc(cfg->batch_max, sizeof(uint32_t));
    e->results = calloc(cfg->batch_max, sizeof(pd_item_result));
    e->result_tops = calloc(cfg->batch_max, sizeof(pd_item_top));
    e->done = calloc(cfg->batch_max, sizeof(pd_owner));
    for (int i = 0; i < INFLIGHT_MAX; i++)
        e->inflight[i].items = calloc(cfg->batch_max, sizeof(bitem));
    if (!e->reqs || !e->bufs || !e->page_store || !e->scratch || !e->dups || !e->launch_items ||
        !e->results || !e->result_tops || !e->done || !e->kept_grow || !e->kept_gap ||
        !e->inflight[0].items || !e->inflight[1].items)
        return PD_ERR_NOMEM;
    return PD_OK;
}

/* No request yet: both indexes empty, every record on the free list, every
 * queue empty, the metadata rows zeroed. */
static void records_init(pd_engine *e) {
    const pd_engine_config *cfg = &e->cfg;
    pd_list_init(&e->free_reqs);
    for (uint32_t i = 0; i < cfg->requests_max; i++) {
        e->reqs[i].queue = Q_NONE;
        pd_list_push_back(&e->free_reqs, eng_qlinks(e), i);
    }
    for (int q = 0; q < Q__COUNT; q++) pd_list_init(&e->q[q]);
    if (cfg->meta_mem) memset(cfg->meta_mem, 0, (size_t)cfg->meta_rows * sizeof(pd_meta_row));
}

pd_err pd_engine_create(pd_engine **out, const pd_engine_config *cfg_in,
                        pd_executor exec, pd_xfer xfer, pd_sink sink,
                        char *msg, size_t msg_cap) {
    if (!out || !cfg_in) return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "no config");
    *out = NULL;
    pd_engine_config cfg = *cfg_in;
    if (!exec.vt || !sink.vt || (!xfer.vt && cfg.role != PD_ROLE_COLOCATED))
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID,
                         "executor, sink and (except colocated) transport are required");
    pd_err err = config_check(&cfg, msg, msg_cap);
    if (err) return err;
    uint64_t pool_tokens = (uint64_t)cfg.kv_pages * cfg.page_size;
    if (cfg.prompt_tokens_max == 0 || cfg.prompt_tokens_max > pool_tokens)
        cfg.prompt_tokens_max = (uint32_t)PD_MIN(pool_tokens, 1u << 20);
    pd_model_info info;
    if ((err = exec_check(&cfg, exec, &info, msg, msg_cap))) return err;

    pd_engine *e = calloc(1, sizeof(*e));
    if (!e) return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    e->cfg = cfg;
    e->exec = exec;
    e->xfer = xfer;
    e->xfer_watch = xfer.vt && xfer.vt->watch; /* a colocated engine has no transport */
    e->sink = sink;
    e->info = info;
    pd_exec_memory mem;
    exec.vt->memory(exec.self, &mem);
    e->xfer_page_bytes = mem.kv_page_bytes;
    e->xfer_state_bytes = (cfg.mamba_slots ? mem.mamba_slot_bytes : 0) + sizeof(pd_meta_row);
    e->mamba_id = e->host_id = -1;
    err = pools_create(e);
    e->tracks = (cfg.mamba_slots && cfg.prefix_cache && cfg.role != PD_ROLE_DECODE)
                    ? (cfg.overlap ? 2 : 1) : 0;
    uint32_t max_tokens =
        cfg.prompt_tokens_max + (cfg.role != PD_ROLE_PREFILL ? cfg.new_tokens_max : 0);
    e->pages_per_req = PD_DIV_CEIL(max_tokens, cfg.page_size) + 1;
    if (!err) err = arrays_alloc(e);
    if (err) {
        pd_engine_destroy(e);
        return pd_errorf(msg, msg_cap, err, "engine creation failed (%s)", pd_err_name(err));
    }
    records_init(e);
    *out = e;
    return PD_OK;
}

void pd_engine_destroy(pd_engine *e) {
    if (!e) return;
    /* The transport outlives the engine: it must not write into the records
     * of rooms still open (a node shut down without draining them). */
    if (e->reqs && e->xfer_watch)
        for (uint32_t i = 0; i < e->cfg.requests_max; i++)
            if (e->reqs[i].live && e->reqs[i].holds_room)
                e->xfer.vt->watch(e->xfer.self, e->reqs[i].room, NULL);
    if (e->bufs)
        for (uint32_t i = 0; i < e->cfg.requests_max; i++) {
            req_buf *b = &e->bufs[i]; /* a live record's prompt and history too */
            free(b->prompt);
            free(b->history);
        }
    pd_cache_destroy(e->cache);
    pd_ledger_destroy(e->ledger);
    pd_pool_destroy(e->kv);
    pd_pool_destroy(e->row);
    pd_pool_destroy(e->mamba);
    pd_pool_destroy(e->meta);
    pd_pool_destroy(e->host);
    free(e->reqs);
    free(e->bufs);
    pd_index_free(&e->rid_ix);
    pd_index_free(&e->room_ix);
    free(e->page_store);
    free(e->scratch);
    free(e->dups);
    free(e->launch_buf);
    free(e->kept_grow);
    free(e->kept_gap);
    free(e->results);
    free(e->result_tops);
    free(e->done);
    for (int i = 0; i < INFLIGHT_MAX; i++) free(e->inflight[i].items);
    free(e);
}

/* ---- submit / abort / step --------------------------------------------------- */

static pd_err reject(pd_engine *e, pd_reject *why, pd_err err, int status, const char *fmt, ...) {
    e->ctr.rejected++;
    if (why) {
        why->status = status;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(why->message, sizeof(why->message), fmt, ap);
        va_end(ap);
    }
    return err;
}

static pd_err submit(pd_engine *e, const pd_request_spec *s, uint64_t now_us, pd_reject *why);

void pd_engine_cancel_room(pd_engine *e, uint64_t room, const char *peer) {
    if (e->cfg.role == PD_ROLE_COLOCATED || room == 0 || room_find(e, room) != PD_NONE) return;
    cancel_room(e, room, peer);
}

pd_err pd_engine_submit(pd_engine *e, const pd_request_spec *s, uint64_t now_us, pd_reject *why) {
    pd_err err = submit(e, s, now_us, why);
    /* A refused half leaves its peer's half waiting: cancel the room, unless
     * the refusal was for a room that is live here (a duplicate must not end
     * the request that holds it). */
    if (err != PD_OK && s) pd_engine_cancel_room(e, s->room, s->peer);
    return err;
}

/* The request on its own (400 if not): a printable rid, a room, a prompt and
 * stop tokens inside the vocabulary, sampling parameters in range. */
static pd_err spec_check(pd_engine *e, const pd_request_spec *s, pd_reject *why) {
    if (!s->rid || !s->rid[0]) return reject(e, why, PD_ERR_INVALID, 400, "rid is empty");
    size_t rid_len = strnlen(s->rid, PD_RID_MAX);
    if (rid_len >= PD_RID_MAX)
        return reject(e, why, PD_ERR_INVALID, 400, "rid longer than %d bytes", PD_RID_MAX - 1);
    for (size_t i = 0; i < rid_len; i++)
        if ((unsigned char)s->rid[i] < 0x20 || s->rid[i] == 0x7f)
            return reject(e, why, PD_ERR_INVALID, 400, "rid contains a control character");
    if (s->room == 0 && e->cfg.role != PD_ROLE_COLOCATED)
        return reject(e, why, PD_ERR_INVALID, 400,
                      "unknown room 0 (a bootstrap room is required)");
    if (s->prompt_len == 0 || !s->prompt)
        return reject(e, why, PD_ERR_INVALID, 400, "empty prompt");
    if (s->max_new_tokens < 1)
        return reject(e, why, PD_ERR_INVALID, 400, "max_new_tokens must be at least 1");
    if (s->max_new_tokens > e->cfg.new_tokens_max)
        return reject(e, why, PD_ERR_INVALID, 400, "max_new_tokens %u above the limit %u",
                      s->max_new_tokens, e->cfg.new_tokens_max);
    float t = s->sampling.temperature, p = s->sampling.top_p;
    if (!(t >= 0.0f) || isinf(t))
        return reject(e, why, PD_ERR_INVALID, 400, "temperature must be a finite number >= 0");
    if (!(p > 0.0f && p <= 1.0f))
        return reject(e, why, PD_ERR_INVALID, 400, "top_p must be in (0, 1]");
    if (!pd_sampling_valid(&s->sampling))
        return reject(e, why, PD_ERR_INVALID, 400,
                      "min_p must be in [0, 1], repetition_penalty >= 0, frequency_penalty and "
                      "presence_penalty in [-2, 2], top_logprobs at most %d",
                      PD_TOP_LOGPROBS_MAX);
    if (s->n_stop_tokens > PD_STOP_TOKENS_MAX || (s->n_stop_tokens && !s->stop_tokens))
        return reject(e, why, PD_ERR_INVALID, 400, "at most %d stop tokens", PD_STOP_TOKENS_MAX);
    for (uint32_t i = 0; i < s->n_stop_tokens; i++)
        if (s->stop_tokens[i] < 0 || (uint32_t)s->stop_tokens[i] >= e->info.vocab)
            return reject(e, why, PD_ERR_INVALID, 400, "stop token %d outside the vocabulary",
                          s->stop_tokens[i]);
    for (uint32_t i = 0; i < s->prompt_len; i++)
        if (s->prompt[i] < 0 || (uint32_t)s->prompt[i] >= e->info.vocab)
            return reject(e, why, PD_ERR_INVALID, 400,
                          "prompt token %d at position %u outside the vocabulary (size %u)",
                          s->prompt[i], i, e->info.vocab);
    return PD_OK;
}

/* The request against this node: it fits the KV pool (413), and its rid and
 * room are not live here (409). */
static pd_err admission_check(pd_engine *e, const pd_request_spec *s, pd_reject *why) {
    /* A generating node holds KV for positions [0, prompt + max_new - 1): the
     * last sampled token is never fed back (decode.c, prealloc). */
    bool generates = e->cfg.role != PD_ROLE_PREFILL;
    uint32_t new_kv = generates ? s->max_new_tokens - 1 : 0;
    uint64_t need_tokens = (uint64_t)s->prompt_len + new_kv;
    uint64_t pool_tokens = (uint64_t)e->cfg.kv_pages * e->cfg.page_size;
    if (s->prompt_len > e->cfg.prompt_tokens_max || need_tokens > pool_tokens)
        return reject(e, why, PD_ERR_TOOBIG, 413,
                      "prompt of %u tokens (+%u generated, KV for %llu positions) does not fit: "
                      "limit %u prompt tokens, KV pool %llu tokens",
                      s->prompt_len, generates ? s->max_new_tokens : 0,
                      (unsigned long long)need_tokens, e->cfg.prompt_tokens_max,
                      (unsigned long long)pool_tokens);
    if (rid_find(e, s->rid) != PD_NONE)
        return reject(e, why, PD_ERR_EXISTS, 409, "rid '%s' is already live", s->rid);
    if (e->cfg.role != PD_ROLE_COLOCATED && room_find(e, s->room) != PD_NONE)
        return reject(e, why, PD_ERR_EXISTS, 409, "room %llu is already live",
                      (unsigned long long)s->room);
    return PD_OK;
}

static pd_err submit(pd_engine *e, const pd_request_spec *s, uint64_t now_us, pd_reject *why) {
    e->now = now_us;
    if (!s) return reject(e, why, PD_ERR_INVALID, 400, "no request");
    pd_err err = spec_check(e, s, why);
    if (!err) err = admission_check(e, s, why);
    if (err) return err;
    uint32_t idx = e->free_reqs.head; /* the record record_alloc takes */
    if (idx == PD_NONE)
        return reject(e, why, PD_ERR_NOMEM, 429, "too many live requests (%u)",
                      e->cfg.requests_max);
    /* The prompt's copy, and (the penalties read the tokens generated so
     * far) room for all of them, taken here so that no step allocates: the
     * record's kept buffers when large enough. */
    req_buf *b = &e->bufs[idx];
    bool penalized = pd_sampling_penalized(&s->sampling) && e->cfg.role != PD_ROLE_PREFILL;
    uint32_t keep = REQ_BUF_KEEP_MAX;
    if (!buf_fit(&b->prompt, &b->prompt_cap, s->prompt_len,
                 PD_MIN(e->cfg.prompt_tokens_max, keep)) ||
        (penalized &&
         !buf_fit(&b->history, &b->history_cap, s->max_new_tokens,
                  PD_MIN(e->cfg.new_tokens_max, keep))))
        return reject(e, why, PD_ERR_NOMEM, 429, "out of memory for the prompt");
    int32_t *prompt = b->prompt, *history = penalized ? b->history : NULL;
    req *r = record_alloc(e);
    PD_ASSERT(r == &e->reqs[idx]);
    memcpy(r->rid, s->rid, strlen(s->rid) + 1); /* spec_check: shorter than PD_RID_MAX */
    r->room = s->room;
    r->tag = s->tag;
    memcpy(prompt, s->prompt, (size_t)s->prompt_len * sizeof(int32_t));
    r->prompt = prompt;
    r->prompt_len = s->prompt_len;
    /* Where its match will likely search the child index, while the prompt
     * is in hand: the admission one request before asks for the slot with
     * no load of its own to wait on (the match covers all but the last
     * token on a prefill node, decode.c and prefill.c). */
    r->guess = (pd_cache_guess){0};
    if (e->cache)
        pd_cache_match_guess(e->cache, prompt,
                             e->cfg.role == PD_ROLE_DECODE ? s->prompt_len : s->prompt_len - 1,
                             &r->guess);
    r->history = history;
    r->max_new = s->max_new_tokens;
    r->sampling = s->sampling;
    r->n_stop = (uint8_t)s->n_stop_tokens; /* spec_check: at most PD_STOP_TOKENS_MAX */
    if (r->n_stop) memcpy(r->stop, s->stop_tokens, r->n_stop * sizeof(int32_t));
    r->ignore_eos = s->ignore_eos;
    if (s->peer) snprintf(r->peer, sizeof(r->peer), "%s", s->peer);
    r->t_submit = now_us;
    r->bootstrapped = e->cfg.role == PD_ROLE_COLOCATED; /* nothing to hand over */
    r->rid_hash = pd_hash_str(r->rid);
    pd_index_insert(&e->rid_ix, r->rid_hash, idx);
    r->rid_indexed = true;
    if (e->cfg.role != PD_ROLE_COLOCATED) pd_index_insert(&e->room_ix, pd_hash_u64(r->room), idx);
    static const uint8_t first_queue[] = {
        [PD_ROLE_PREFILL] = Q_BOOTSTRAP, [PD_ROLE_DECODE] = Q_PREALLOC,
        [PD_ROLE_COLOCATED] = Q_WAITING,
    };
    q_push(e, r, first_queue[e->cfg.role]);
    r->t_state = now_us;
    e->ctr.submitted++;
    eng_act(e, r, PD_ACT_ACCEPT, false, 0);
    return PD_OK;
}

pd_err pd_engine_abort(pd_engine *e, const char *rid) {
    if (!rid) return PD_ERR_NOTFOUND;
    uint32_t idx = rid_find(e, rid);
    if (idx == PD_NONE) return PD_ERR_NOTFOUND;
    req *r = &e->reqs[idx];
    if (r->streamed) return PD_ERR_NOTFOUND; /* already ended; only draining */
    eng_retire(e, r, PD_TERM_ABORTED, PD_FINISH_NONE, 499, "aborted by request");
    return PD_OK;
}

uint32_t pd_engine_abort_all(pd_engine *e) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < e->cfg.requests_max; i++) {
        req *r = &e->reqs[i];
        if (!r->live || r->streamed) continue;
        eng_retire(e, r, PD_TERM_ABORTED, PD_FINISH_NONE, 499, "aborted (abort all)");
        n++;
    }
    return n;
}

/* ---- flushing the prefix cache --------------------------------------------------- */

/* Live requests with a reference into the cache: the lock on a matched or
 * inserted prefix (kept while a room drains), or a host-tier load. */
static uint32_t requests_holding_cache(const pd_engine *e) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < e->cfg.requests_max; i++) {
        const req *r = &e->reqs[i];
        if (r->live && (r->holds_lock || r->q_lock || r->holds_host)) n++;
    }
    return n;
}

pd_err pd_engine_flush_cache(pd_engine *e, pd_cache_flush *out, char *msg, size_t msg_cap) {
    PD_ASSERT(e != NULL);
    pd_cache_flush freed = {0};
    if (out) *out = freed;
    if (!e->cache) return pd_errorf(msg, msg_cap, PD_OK, "this node has no prefix cache");
    if (!pd_engine_idle(e))
        return pd_errorf(msg, msg_cap, PD_ERR_STATE,
                         "the cache is flushed only when the node is idle: %u requests live "
                         "(%u of them holding cached units), %u forwards in flight",
                         e->reqs_live, requests_holding_cache(e), e->inflight_n);
    pd_cache_stats before, after;
    pd_cache_stats_get(e->cache, &before);
    /* Idle: nothing is locked and no load is in flight, so clearing leaves
     * nothing behind. Device nodes may be written back to the host tier on
     * the way out; the host pass that follows frees those copies too. */
    pd_cache_clear(e->cache);
    pd_cache_stats_get(e->cache, &after);
    PD_ASSERTF(after.nodes == 0 && after.dev_pages == 0 && after.host_pages == 0 &&
                   after.snapshots == 0,
               "an idle cache kept %u nodes after a flush", after.nodes);
    for (int p = 0; p < pd_ledger_pool_count(e->ledger); p++)
        PD_ASSERT(pd_ledger_count(e->ledger, p, PD_UNIT_CACHE_EVICTABLE) == 0 &&
                  pd_ledger_count(e->ledger, p, PD_UNIT_CACHE_PROTECTED) == 0);
    freed = (pd_cache_flush){.kv_pages = before.dev_pages,
                             .host_pages = before.host_pages,
                             .mamba_slots = before.snapshots};
    if (out) *out = freed;
    return pd_errorf(msg, msg_cap, PD_OK,
                     "flushed the prefix cache: %llu KV pages, %llu host pages and %llu Mamba "
                     "snapshots freed",
                     (unsigned long long)freed.kv_pages, (unsigned long long)freed.host_pages,
                     (unsigned long long)freed.mamba_slots);
}

void pd_engine_step(pd_engine *e, uint64_t now_us) {
    e->now = now_us;
    if (e->cfg.role == PD_ROLE_DECODE) decode_step(e);
    else prefill_step(e); /* prefill and colocated */
    drain_poll(e);
}

bool pd_engine_idle(const pd_engine *e) { return e->reqs_live == 0 && e->inflight_n == 0; }

/* ---- checks and reports ------------------------------------------------------ */

static bool describe(void *ctx, pd_owner owner, pd_owner_desc *d) {
    pd_engine *e = ctx;
    uint64_t lo = owner & 0xFFFFFFFFull;
    if (lo == 0 || lo > e->cfg.requests_max) return false;
    req *r = &e->reqs[lo - 1];
    if (!r->live || eng_gen(r) != (uint32_t)(owner >> 32)) {
        snprintf(d->rid, sizeof(d->rid), "(retired record #%llu)", (unsigned long long)(lo - 1));
        snprintf(d->state, sizeof(d->state), "gone");
        return true;
    }
    snprintf(d->rid, sizeof(d->rid), "%s", r->rid);
    d->room = r->room;
    snprintf(d->state, sizeof(d->state), "%s",
             r->queue < Q__COUNT ? queue_names[r->queue] : "none");
    snprintf(d->terminal, sizeof(d->terminal), "%s",
             r->term ? pd_terminal_kind_name((pd_terminal_kind)r->term) : "");
    return true;
}

/* Tallies the units of one pool by holder: req_units[i] held by record i
 * (REQ, owner of the record's current generation), q_units[i] quarantined
 * for the room record i drains. A unit with neither is a violation. */
static pd_err tally_units(pd_engine *e, int pool_id, uint32_t *req_units, uint32_t *q_units,
                          pd_strbuf *report) {
    pd_err result = PD_OK;
    pd_pool *p = pd_ledger_pool(e->ledger, pool_id);
    uint32_t total = pd_pool_total(p);
    for (uint32_t u = 0; u < total; u++) {
        pd_unit_state st = pd_ledger_state_of(e->ledger, pool_id, u);
        pd_owner o = pd_ledger_owner_of(e->ledger, pool_id, u);
        if (st == PD_UNIT_REQ) {
            uint64_t lo = o & 0xFFFFFFFFull;
            req *r = (lo && lo <= e->cfg.requests_max) ? &e->reqs[lo - 1] : NULL;
            if (!r || !r->live || eng_gen(r) != (uint32_t)(o >> 32)) {
                result = pd_violation(report,
                                      "pool %s unit %u held by a request that no longer exists "
                                      "(owner %llu)",
                                      pd_pool_name(p), u, (unsigned long long)o);
                continue;
            }
            req_units[lo - 1]++;
        } else if (st == PD_UNIT_QUARANTINE) {
            uint32_t idx = room_find(e, o);
            if (idx == PD_NONE || e->reqs[idx].queue != Q_DRAINING) {
                result = pd_violation(report,
                                      "pool %s unit %u quarantined for room %llu that nothing "
                                      "drains",
                                      pd_pool_name(p), u, (unsigned long long)o);
                continue;
            }
            q_units[idx]++;
        }
    }
    return result;
}

/* What r's flags say it holds of one pool: *want as REQ, *want_q in
 * quarantine. */
static void flags_say(pd_engine *e, req *r, int pool_id, uint32_t *want, uint32_t *want_q) {
    uint32_t slots[3];
    *want = *want_q = 0;
    if (pool_id == e->kv_id) {
        *want = r->holds_kv ? r->n_pages - r->own_from : 0;
        *want_q = r->q_pages ? r->n_pages - r->own_from : 0;
    } else if (pool_id == e->row_id) {
        *want = r->holds_row;
    } else if (pool_id == e->mamba_id) {
        uint32_t n = mamba_slots_of(r, slots);
        *want = r->holds_mamba ? n : 0;
        *want_q = r->q_mamba ? n : 0;
    } else {
        *want = r->holds_meta;
        *want_q = r->q_meta;
    }
}

/* Every live record holds exactly the units its flags say (strict mode). */
static pd_err check_requests(pd_engine *e, pd_strbuf *report) {
    pd_err result = PD_OK;
    int pools[4] = {e->kv_id, e->row_id, e->mamba_id, e->meta_id};
    for (int k = 0; k < 4; k++) {
        if (pools[k] < 0) continue;
        pd_pool *p = pd_ledger_pool(e->ledger, pools[k]);
        /* Tally per record into scratch-like counters kept on the stack of
         * this call: requests_max is small enough to walk per pool. */
        uint32_t *req_units = calloc(e->cfg.requests_max, sizeof(uint32_t));
        uint32_t *q_units = calloc(e->cfg.requests_max, sizeof(uint32_t));
        PD_ASSERT(req_units && q_units);
        pd_err err = tally_units(e, pools[k], req_units, q_units, report);
        if (err) result = err;
        for (uint32_t i = 0; i < e->cfg.requests_max; i++) {
            req *r = &e->reqs[i];
            if (!r->live) continue;
            uint32_t want, want_q;
            flags_say(e, r, pools[k], &want, &want_q);
            if (req_units[i] != want)
                result = pd_violation(report, "request %s (%s) holds %u %s units, its flags say %u",
                                      r->rid, queue_names[r->queue < Q__COUNT ? r->queue : 0],
                                      req_units[i], pd_pool_name(p), want);
            if (q_units[i] != want_q)
                result = pd_violation(report,
                                      "room %llu of %s has %u %s units quarantined, "
                                      "its flags say %u",
                                      (unsigned long long)r->room, r->rid, q_units[i],
                                      pd_pool_name(p), want_q);
        }
        free(req_units);
        free(q_units);
    }
    uint64_t reserved = 0;
    for (uint32_t i = 0; i < e->cfg.requests_max; i++)
        if (e->reqs[i].live) reserved += e->reqs[i].reserved;
    if (reserved != e->reserved)
        result = pd_violation(report, "reservations: records sum to %llu, engine counts %llu",
                                  (unsigned long long)reserved, (unsigned long long)e->reserved);
    return result;
}

pd_err pd_engine_check(pd_engine *e, pd_strbuf *report) {
    pd_cache_sums sums = {0};
    if (e->cache) pd_cache_sums_get(e->cache, &sums);
    pd_check_opts o = {
        .cache = &sums, .expect_idle = pd_engine_idle(e), .deep = e->cfg.strict,
        .describe = describe, .describe_ctx = e,
    };
    pd_err result = PD_OK;
    if (e->cfg.strict) result = check_requests(e, report);
    if (e->cache && e->cfg.strict) {
        char msg[256];
        if (pd_cache_verify(e->cache, msg, sizeof(msg)) != PD_OK)
            result = pd_violation(report, "prefix cache: %s", msg);
    }
    if (result != PD_OK && report) {
        /* Engine-level violations first, then the ledger's own view. */
        pd_err l = pd_ledger_check(e->ledger, &o, report);
        if (l == PD_OK) {
            pd_strbuf_append(report, "attribution:\n");
            pd_ledger_report(e->ledger, PD_REPORT_TEXT, describe, e, report);
        }
        return result;
    }
    return pd_ledger_check(e->ledger, &o, report);
}

void pd_engine_report(pd_engine *e, pd_report_format fmt, pd_strbuf *out) {
    pd_ledger_report(e->ledger, fmt, describe, e, out);
}

void pd_engine_counters_get(const pd_engine *e, pd_engine_counters *out) {
    *out = e->ctr;
    out->queued_bootstrap = e->q[Q_BOOTSTRAP].len;
    out->queued_waiting = e->q[Q_WAITING].len;
    out->loading = e->q[Q_LOADING].len;
    out->running = e->q[Q_PREFILL].len + e->q[Q_RUNNING].len;
    out->parked = e->q[Q_PARKED].len;
    out->transferring = e->q[Q_TRANSFER].len;
    out->draining = e->q[Q_DRAINING].len;
    out->prealloc = e->q[Q_PREALLOC].len;
    out->wait_transfer = e->q[Q_WAIT_XFER].len;
    out->forwards_in_flight = e->inflight_n;
}

pd_ledger *pd_engine_ledger(pd_engine *e) { return e->ledger; }
const pd_engine_config *pd_engine_config_of(const pd_engine *e) { return &e->cfg; }

void pd_engine_set_action_observer(pd_engine *e, pd_action_observer fn, void *ctx) {
    e->obs = fn;
    e->obs_ctx = ctx;
}

uint64_t pd_engine_request_id(const pd_engine *e, const char *rid) {
    uint32_t idx = rid_find(e, rid);
    return idx == PD_NONE ? 0 : e->reqs[idx].owner;
}
