/*
 * engine_internal.h — what engine.c (common machinery: requests, queues,
 * the retire path, checks), prefill.c and decode.c share.
 *
 * A request record carries explicit ownership flags — never inferred from a
 * pointer being NULL — and the single retire path releases exactly what the
 * flags say, clearing each flag as it goes. The engine's own check compares
 * the flags with the ledger after every step in strict mode.
 */
#ifndef PDSERVE_ENGINE_INTERNAL_H
#define PDSERVE_ENGINE_INTERNAL_H

#include <stddef.h>
#include <string.h>

#include "pdserve/cache.h"
#include "pdserve/engine.h"
#include "pdserve/index.h"
#include "pdserve/list.h"

/* Queues: a live request is in exactly one. */
enum {
    Q_BOOTSTRAP = 0, /* prefill: meta row + sender opened, handshake pending */
    Q_WAITING,       /* prefill: waiting for admission */
    Q_LOADING,       /* prefill: admitted, host-tier load in flight */
    Q_PREFILL,       /* prefill: admitted, chunks being computed */
    Q_PARKED,        /* prefill: final chunk done, bootstrap still pending */
    Q_TRANSFER,      /* prefill: final send posted */
    Q_PREALLOC,      /* decode: waiting for memory */
    Q_WAIT_XFER,     /* decode: destination sent, waiting for the data */
    Q_RUNNING,       /* decode: generating */
    Q_RETIRING,      /* retire deferred: a forward of the request is in flight */
    Q_DRAINING,      /* retired; units quarantined until the room drains */
    Q__COUNT,
    Q_NONE = 255
};

typedef struct req {
    /* ---- hot: what the decode step reads of each running request for its
     * token (the result, the sink's token event, the finish and retire
     * tests, the next item), in one cache line: records are cache-line
     * aligned (arrays_alloc), and a token reads no other line of its
     * record (it read two before; issue 13) ---- */
    _Alignas(64) bool live;
    uint8_t queue;
    bool pending_chunk; /* launched chunks whose results are not processed */
    bool retire_pending;
    bool ignore_eos;
    uint8_t term;    /* pd_terminal_kind, set once */
    uint8_t n_stop;  /* stop[0, n_stop): at most PD_STOP_TOKENS_MAX */
    bool holds_room; /* transport state of the room */
    pd_owner owner;  /* (generation << 32) | (index + 1): never 0 */
    uint64_t tag;    /* the caller's (pd_request_spec.tag), in every sink event */
    uint64_t room;
    int32_t *history; /* the output tokens, kept when the sampling is penalised */
    uint32_t forwards_in_flight;
    uint32_t prompt_len;
    uint32_t out_len; /* decode: tokens generated (incl. the first) */
    uint32_t max_new;
    int32_t last_token;
    uint32_t n_pages;
    /* ---- warm: the queue walks' links, the page table (a decode request
     * reads it for a new page every page_size tokens), the rest of a fresh
     * item ---- */
    pd_link qlink;   /* in its queue, or (not live) in the free records */
    uint32_t *pages; /* page table: pages[i] holds positions [i*ps, (i+1)*ps) */
    bool bootstrapped;
    uint8_t xst; /* its room's pd_xfer_status, kept here by a watching transport */
    uint32_t mamba_run;
    pd_sampling sampling;
    int32_t stop[PD_STOP_TOKENS_MAX];

    char rid[PD_RID_MAX];
    int32_t *prompt;
    pd_cache_guess guess; /* the match's likely child index slot, worked out at submit */
    char peer[PD_PEER_MAX];
    uint64_t t_submit, t_state;
    /* pd_terminal_event's stage times and transfer size (0: not reached) */
    uint64_t t_admit, t_computed, t_xfer_first, t_xfer_start, t_xfer_done;
    uint64_t xfer_bytes;

    /* ---- ownership flags (DESIGN.md section 3; holds_room above) ---- */
    bool holds_row;
    bool holds_kv;    /* own pages and/or the lock on the matched prefix */
    bool holds_lock;  /*   the lock part of holds_kv: lock_node is locked */
    bool holds_mamba; /* running slot + track slots */
    bool holds_meta;
    bool holds_host; /* a host-tier load in flight (ticket + load id) */

    uint32_t row;
    uint32_t own_from; /* pages[0, own_from) are the cache's, the rest REQ(owner) */
    pd_cnode lock_node;
    uint32_t mamba_track[2];
    uint32_t track_next; /* which track slot the next snapshot goes to */
    uint32_t final_snap; /* track slot holding the prompt-end snapshot, or PD_NONE */
    uint32_t meta_row;
    pd_cache_ticket ticket;
    uint64_t load_id;
    uint32_t load_from, load_pages; /* the loading pages in pages[] */

    /* ---- progress ---- */
    uint32_t cached_tokens; /* prefix reused from this node's cache at admission */
    uint32_t launched;      /* tokens whose forward is launched */
    uint32_t done;          /* tokens whose forward result is processed */
    uint32_t sent_pages;    /* prefill: sequence pages posted to the transport */
    uint32_t peer_cached;   /* prefill: tokens the decode node already has */
    uint32_t attempts;      /* optimistic attempts used */
    uint32_t reserved;      /* pages reserved for future allocation */
    uint64_t rid_hash;      /* pd_hash_str(rid), for the rid index */

    /* ---- drain state (after retire, while the room may still touch memory) ---- */
    bool q_pages, q_mamba, q_meta, q_lock;

    /* ---- terminal ---- */
    pd_finish_reason finish;
    int status;
    char msg[128];
    bool streamed;
    bool opened_room; /* it opened its room (sender or receiver): never cancel it */
    bool rid_indexed; /* in the rid index: until its terminal event is emitted */
} req;

/* The hot part of a record is one cache line, the warm part starts the next. */
_Static_assert(offsetof(req, qlink) == 64, "req: the hot fields outgrew a cache line");
_Static_assert(offsetof(req, mamba_run) < 128, "req: the warm fields outgrew a cache line");
_Static_assert(PD_STOP_TOKENS_MAX <= UINT8_MAX, "req: n_stop is one byte");

/* One item of a batch in flight. */
typedef struct bitem {
    uint32_t idx, gen;
    uint32_t start, n;
    bool final;             /* the request's last prompt chunk (prefill) */
    bool decode;            /* one generated token (decode, colocated) */
    uint32_t snapshot_slot; /* track slot written at the chunk end, or PD_NONE */
} bitem;

typedef struct batch_rec {
    uint64_t id;
    uint32_t n;
    bitem *items;           /* batch_max */
} batch_rec;

#define INFLIGHT_MAX 2

/* A record's prompt and history storage: kept when the record is freed and
 * taken by the record's next request when large enough, so that neither the
 * retire (free) nor the submit (malloc) touches the heap in a steady state
 * (issue 13). A buffer above REQ_BUF_KEEP_MAX tokens is freed at retire. */
typedef struct req_buf {
    int32_t *prompt, *history;
    uint32_t prompt_cap, history_cap; /* tokens; 0 with no buffer */
} req_buf;
enum { REQ_BUF_KEEP_MAX = 8192 };

struct pd_engine {
    pd_engine_config cfg;
    pd_executor exec;
    pd_xfer xfer;
    bool xfer_watch; /* the transport keeps each open room's status in its record (xst) */
    pd_sink sink;
    pd_model_info info;

    pd_ledger *ledger;
    pd_pool *kv, *row, *mamba, *meta, *host;
    int kv_id, row_id, mamba_id, meta_id, host_id;
    pd_cache *cache;
    uint32_t tracks;          /* track slots per request: 0, 1 or 2 */

    req *reqs;
    req_buf *bufs; /* per record, kept across its requests */
    uint32_t reqs_live;
    pd_list free_reqs;        /* records not live, the last freed first */
    pd_index rid_ix, room_ix; /* live rid -> record; room -> record (not colocated) */
    pd_list q[Q__COUNT];
    uint32_t pages_per_req;
    uint32_t *page_store;
    uint32_t *scratch, *dups;
    uint64_t reserved;        /* sum of req.reserved */

    batch_rec inflight[INFLIGHT_MAX];
    uint32_t inflight_head, inflight_n;
    uint64_t next_batch_id;
    /* The launched batch's items. The decode role moves it within
     * launch_buf (2 x batch_max items, launch_items <= launch_buf + batch_max)
     * so that the kept items are compacted from whichever side moves fewer
     * (decode.c); every other user reads it as an array of batch_max. */
    pd_batch_item *launch_items, *launch_buf;
    /* Decode role: the next batch's record and launch_items hold its first
     * items, those of the last batch's requests still running (decode.c). */
    bool kept_ready;
    /* Decode role: which of those kept items need a page for their next
     * position, in item order (kept_grow_n of them, at most batch_max). */
    uint32_t *kept_grow, kept_grow_n;
    /* Decode role: the last batch's items not kept, in item order. */
    uint32_t *kept_gap, kept_gap_n;
    pd_item_result *results;
    pd_item_top *result_tops; /* results[i]'s top logprobs, when it has any */
    /* Decode role: the requests whose last token the poll streamed (their
     * owners; the terminal reason recorded), retired after it (decode.c). */
    pd_owner *done;
    uint32_t done_n;

    uint64_t now;
    uint64_t next_load_id;
    /* What a transfer moves: one KV page; a room's Mamba state and meta row. */
    uint64_t xfer_page_bytes, xfer_state_bytes;
    pd_engine_counters ctr;
    pd_action_observer obs;
    void *obs_ctx;
};

/* Reports an action on r's behalf to the observer, if any. Inline, so the
 * scheduler step pays one branch per action when nobody observes (the
 * servers); the simulator's oracle observes every one. */
void eng_act_report(pd_engine *e, const req *r, pd_action a, bool final, uint32_t n);
static inline void eng_act(pd_engine *e, const req *r, pd_action a, bool final, uint32_t n) {
    if (e->obs) eng_act_report(e, r, a, final, n);
}

/* ---- engine.c: shared machinery ---- */
static inline req *eng_req(pd_engine *e, uint32_t idx) {
    PD_ASSERT(idx < e->cfg.requests_max);
    return &e->reqs[idx];
}
/* Starts loading record idx's hot line: walks over hundreds of records (the
 * decode batch and its results) would otherwise wait for each in turn. */
PD_PREFETCH_INLINE void eng_prefetch(const pd_engine *e, uint32_t idx) {
    __builtin_prefetch(&e->reqs[idx]);
}
/* A queue walk's next record (idx, PD_NONE: none): its links, its room and
 * the room's watched status, both lines, loading while the walk handles this
 * one. */
PD_PREFETCH_INLINE void eng_prefetch_walk(const pd_engine *e, uint32_t idx) {
    if (idx == PD_NONE) return;
    __builtin_prefetch(&e->reqs[idx]);
    __builtin_prefetch((const char *)&e->reqs[idx] + 64);
}
static inline uint32_t eng_idx(pd_engine *e, const req *r) { return (uint32_t)(r - e->reqs); }
/* The status of r's room (r holds it). A transport that watches keeps it in
 * the record, on the line the queue walks read anyway: no call, and none of
 * the transport's own lines (its room table) per request and step. Debug
 * builds ask the transport too, at every read. */
static inline pd_xfer_status eng_room_status(pd_engine *e, const req *r) {
    if (!e->xfer_watch) return e->xfer.vt->status(e->xfer.self, r->room);
#ifndef NDEBUG
    PD_ASSERTF(r->xst == (uint8_t)e->xfer.vt->status(e->xfer.self, r->room),
               "request %s: the watched room status %s is not the transport's %s", r->rid,
               pd_xfer_status_name((pd_xfer_status)r->xst),
               pd_xfer_status_name(e->xfer.vt->status(e->xfer.self, r->room)));
#endif
    return (pd_xfer_status)r->xst;
}
/* After r opened its room: the transport keeps its status in r->xst. */
static inline void eng_room_watch(pd_engine *e, req *r) {
    if (e->xfer_watch) e->xfer.vt->watch(e->xfer.self, r->room, &r->xst);
}
/* A record's generation (bumped each time it is taken): its owner's high half. */
static inline uint32_t eng_gen(const req *r) { return (uint32_t)(r->owner >> 32); }
/* The queues' (and the free records') links: pd_list over e->reqs. */
static inline pd_links eng_qlinks(pd_engine *e) { return PD_LINKS(e->reqs, req, qlink); }
/* Inline: a request changes queues a few times a node, from every file. */
static inline void q_push(pd_engine *e, req *r, uint8_t queue) {
    PD_ASSERT(r->queue == Q_NONE && queue < Q__COUNT);
    pd_list_push_back(&e->q[queue], eng_qlinks(e), eng_idx(e, r));
    r->queue = queue;
}

static inline void q_remove(pd_engine *e, req *r) {
    if (r->queue == Q_NONE) return;
    pd_list_remove(&e->q[r->queue], eng_qlinks(e), eng_idx(e, r));
    r->queue = Q_NONE;
}

static inline void q_move(pd_engine *e, req *r, uint8_t queue) {
    q_remove(e, r);
    q_push(e, r, queue);
    r->t_state = e->now;
}

/* Step 1 of the retire path alone: records kind (and finish, status, msg)
 * as r's terminal reason unless one is recorded; the first one wins. Inline:
 * every retire starts with it. */
static inline void eng_terminal_reason(pd_engine *e, req *r, pd_terminal_kind kind,
                                       pd_finish_reason finish, int status, const char *msg) {
    if (r->term != PD_TERM_NONE) return;
    PD_ASSERT(kind != PD_TERM_NONE);
    r->term = (uint8_t)kind;
    r->finish = finish;
    r->status = status;
    /* snprintf's cut, without a format parse on every retire */
    size_t len = msg ? strnlen(msg, sizeof(r->msg) - 1) : 0;
    if (len) memcpy(r->msg, msg, len);
    r->msg[len] = '\0';
    eng_act(e, r, PD_ACT_TERMINAL_REASON, false, 0);
}

/* The single retire path. kind is recorded if no terminal reason is yet;
 * the first one wins. Idempotent; defers while a forward is in flight. */
void eng_retire(pd_engine *e, req *r, pd_terminal_kind kind, pd_finish_reason finish, int status,
                const char *msg);
/* Step 2's other half, for the result of a forward of r: if r has a
 * terminal reason (its retire pending), the result must be dropped — nothing
 * of it is cached, sent or streamed — and the last one in flight completes
 * the retire. Returns true if the caller must drop the result. */
bool eng_result_after_retire_slow(pd_engine *e, req *r);
static inline bool eng_result_after_retire(pd_engine *e, req *r) {
    /* Inline: every result of every step asks, and almost always no. */
    if (r->term == PD_TERM_NONE && !r->retire_pending) return false;
    return eng_result_after_retire_slow(e, r);
}
/* Releases memory without ending the request (optimistic requeue): caches the
 * computed prefix, frees the rest; keeps the meta row and the room. */
void eng_release_for_requeue(pd_engine *e, req *r);
/* Decode, at commit: once the transport says the room is drained (nothing
 * will write here again), closes it and frees the metadata row; otherwise
 * both stay until the retire path. The request keeps the rest to generate. */
void eng_release_at_commit(pd_engine *e, req *r);

/* Memory helpers. */
/* Appends n pages to r->pages out of r's reservation: cannot fail. */
void eng_alloc_pages(pd_engine *e, req *r, uint32_t n);
uint64_t eng_kv_available(pd_engine *e); /* free + evictable - reserved */
/* Admission: reserves `need` pages for r if free + evictable - reserved
 * covers them; otherwise drops the cache lock r took for its prefix match
 * and returns false (r stays queued). */
bool eng_reserve_pages(pd_engine *e, req *r, uint32_t need);
/* One unit of a slot pool (row, metadata row, Mamba slot), a Mamba slot
 * after evicting a snapshot if none is free. Inline: three or four a request
 * and node. */
static inline pd_err eng_alloc_slot(pd_engine *e, int pool_id, pd_owner owner, uint32_t *out) {
    if (pool_id == e->mamba_id && e->cache && pd_pool_free_count(e->mamba) == 0)
        PD_MUST(pd_cache_evict_snapshots(e->cache, 1, NULL));
    return pd_ledger_alloc(e->ledger, pool_id, 1, owner, out);
}
void eng_cache_lock(pd_engine *e, req *r, pd_cnode node);
/* Inserts pages[0, tokens/ps) (+ snapshot, a track slot of r or PD_NONE) into
 * the cache, moves r's lock to the new node, frees duplicates. If the cache
 * takes the snapshot, r's track slot forgets it (the slot is the cache's). */
void eng_cache_insert(pd_engine *e, req *r, uint32_t tokens, uint32_t snapshot_slot);

void eng_emit_terminal(pd_engine *e, req *r);
/* A retire known in advance (decode.c, retire_done) starts its loads in
 * three stages, each once the one before has come in: the record's lines
 * (its terminal fields, ownership flags and slots, times, kept buffers);
 * what they point to (the rid and room index slots, the page table, the
 * first prompt page past the cached prefix, the node it holds locked); the
 * child index slot where the insert of its finished prompt looks first. */
PD_PREFETCH_INLINE void eng_retire_prefetch_record(const pd_engine *e, const req *r) {
    const char *p = (const char *)r;
    __builtin_prefetch(p + offsetof(req, qlink), 1);
    __builtin_prefetch(p + offsetof(req, rid));
    __builtin_prefetch(p + offsetof(req, prompt));
    __builtin_prefetch(p + offsetof(req, t_submit));
    __builtin_prefetch(p + offsetof(req, holds_row), 1);
    __builtin_prefetch(p + offsetof(req, cached_tokens), 1);
    __builtin_prefetch(p + offsetof(req, streamed), 1);
    __builtin_prefetch(&e->bufs[r - e->reqs]);
}

/* The record's slots in the room and rid indexes (record_free). */
PD_PREFETCH_INLINE void eng_retire_prefetch_index(const pd_engine *e, const req *r) {
    if (e->cfg.role != PD_ROLE_COLOCATED) pd_index_prefetch(&e->room_ix, pd_hash_u64(r->room));
    pd_index_prefetch(&e->rid_ix, r->rid_hash);
}

PD_PREFETCH_INLINE void eng_retire_prefetch_deps(const pd_engine *e, const req *r) {
    eng_retire_prefetch_index(e, r);
    __builtin_prefetch(r->pages + r->own_from);
    const int32_t *page = r->prompt + (size_t)r->own_from * e->cfg.page_size;
    __builtin_prefetch(page);
    __builtin_prefetch((const char *)page + 63);
    if (r->holds_lock && e->cache) pd_cache_prefetch(e->cache, r->lock_node);
}

PD_PREFETCH_INLINE void eng_retire_prefetch_insert(const pd_engine *e, const req *r) {
    uint32_t ps = e->cfg.page_size;
    if (!e->cache || !r->holds_lock || (r->own_from + 1) * ps > r->prompt_len) return;
    pd_cache_prefetch_child(e->cache, r->lock_node, r->prompt + (size_t)r->own_from * ps);
}

/* Batches. */
batch_rec *eng_batch_begin(pd_engine *e); /* NULL when INFLIGHT_MAX are in flight */
/* Inline: a decode step adds one item per running request. */
static inline void eng_batch_add(pd_engine *e, batch_rec *b, req *r, const int32_t *tokens,
                                 uint32_t start, uint32_t n, bool sample, uint32_t sample_index,
                                 uint32_t snapshot_slot, bool final, bool decode) {
    PD_ASSERT(b->n < e->cfg.batch_max);
    pd_batch_item *it = &e->launch_items[b->n];
    *it = (pd_batch_item){
        .req = r->owner,
        .tokens = tokens,
        .n_tokens = n,
        .start_pos = start,
        .pages = r->pages,
        .n_pages = r->n_pages,
        .mamba_slot = e->mamba ? r->mamba_run : PD_POOL_NONE,
        .snapshot_slot = snapshot_slot == PD_NONE ? PD_POOL_NONE : snapshot_slot,
        .sample = sample,
        .sampling = r->sampling,
        .sample_index = sample_index,
        .history = r->history,
    };
    PD_ASSERT((uint64_t)r->n_pages * e->cfg.page_size >= (uint64_t)start + n);
    b->items[b->n] = (bitem){.idx = eng_idx(e, r),
                             .gen = eng_gen(r),
                             .start = start,
                             .n = n,
                             .final = final,
                             .decode = decode,
                             .snapshot_slot = snapshot_slot};
    b->n++;
    r->forwards_in_flight++;
    r->pending_chunk = true;
    eng_act(e, r, PD_ACT_LAUNCH, final, n);
}
void eng_batch_launch(pd_engine *e, batch_rec *b);
/* Polls the oldest batch; if complete, calls fn(e, r, item, result) for every
 * item whose request is still the same record (live, same generation), then
 * pops it. Returns true if a batch completed. */
bool eng_batch_poll(pd_engine *e,
                    void (*fn)(pd_engine *, req *, const bitem *, const pd_item_result *,
                               const pd_item_top *));

/* ---- prefill.c / decode.c ---- */
void prefill_step(pd_engine *e);   /* prefill and colocated */
void decode_step(pd_engine *e);
/* Shared with the colocated engine: the running requests' next tokens, a
 * generated token (streams it, finishes the request if it is the last), and
 * a decode item's result. */
void decode_add_items(pd_engine *e, batch_rec *b);
void decode_emit_token(pd_engine *e, req *r, const pd_item_result *res, const pd_item_top *top);
void decode_on_result(pd_engine *e, req *r, const bitem *it, const pd_item_result *res,
                      const pd_item_top *top);

#endif
