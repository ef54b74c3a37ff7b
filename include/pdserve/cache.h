/*
 * pd_cache — the prefix cache: a radix tree over token ids with page-aligned
 * edges, holding KV pages, Mamba state snapshots and host-tier copies.
 *
 * Shape. Every node covers a run of whole pages (page_size tokens each) that
 * extends its parent's prefix; siblings differ in their first page. A node
 * may hold, for its pages, device KV pages ("on device"), host pages ("on
 * host") or both, and at its end a Mamba snapshot slot (the recurrent state
 * after its last token). Invariants:
 *
 *   C1  a node on device has every ancestor on device (a device prefix is
 *       usable only from the root down);
 *   C2  a node with neither device nor host pages does not exist;
 *   C3  a snapshot lives only on a device node, at the node's end;
 *   C4  a lock covers the path from its node to the root: a node is locked
 *       exactly when a lock is held on it or on a descendant (its lock_ref,
 *       the locks covering it, is >= the sum of its children's);
 *       mamba_lock > 0 implies the node is locked.
 *
 * Ownership. Every unit the cache holds is CACHE_PROTECTED in the ledger while
 * its node (for KV and host pages) or its snapshot (for Mamba slots) is
 * locked, CACHE_EVICTABLE otherwise; every change goes through the ledger.
 * The cache keeps its own evictable/protected sums per pool, which
 * pd_ledger_check compares with the ledger's counters (pd_cache_sums_get).
 *
 * Recency. Three intrusive LRU lists: unlocked device nodes, unlocked nodes
 * with a host copy, unlocked snapshots. A "touch" (match, insert, or the
 * release of the last lock) moves the touched path to the tail of each list,
 * deepest node first, so a node always sits after its descendants: the head
 * of the device list is the least recently used unlocked device leaf, and
 * eviction takes it in O(1). Recency therefore means "last matched, inserted
 * or released", whichever came last.
 *
 * Host tier. Evicting a device node with write-back on copies its pages to
 * host pages (through the copy callback) instead of dropping them. A match
 * reports how far host-only nodes extend the device prefix; the caller can
 * then start a load: device pages are allocated for those nodes and owned by
 * the requesting request (REQ(owner)) until pd_cache_load_done hands them to
 * the cache or pd_cache_load_cancel frees them. An abort must do one or the
 * other: that is the "host load" a request's retire path releases.
 *
 * Memory. Nodes, page entries, the child hash table and the load tickets are
 * sized at creation from the pool sizes; no operation allocates.
 */
#ifndef PDSERVE_CACHE_H
#define PDSERVE_CACHE_H

#include "pdserve/base.h"
#include "pdserve/ledger.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_cache pd_cache;
typedef uint32_t pd_cnode;           /* node handle */
typedef uint32_t pd_cache_ticket;    /* host load handle */

#define PD_CNODE_ROOT ((pd_cnode)0)
#define PD_CNODE_NONE PD_NONE
#define PD_TICKET_NONE PD_NONE

typedef enum pd_copy_dir { PD_COPY_DEV_TO_HOST, PD_COPY_HOST_TO_DEV } pd_copy_dir;

/* Copies n pages between device and host memory; called synchronously during
 * write-back. May be NULL when the caller has no memory behind the pages. */
typedef void (*pd_cache_copy_fn)(void *ctx, pd_copy_dir dir,
                                 const uint32_t *dev_pages,
                                 const uint32_t *host_pages, uint32_t n);

typedef enum pd_evict_kind {
    PD_EVICT_DEVICE,     /* device pages of a node freed (maybe written back) */
    PD_EVICT_HOST,       /* host copy of a node freed */
    PD_EVICT_SNAPSHOT,   /* a Mamba snapshot freed */
} pd_evict_kind;

typedef struct pd_evict_event {
    pd_evict_kind kind;
    pd_cnode node;
    uint32_t end_tokens;     /* the node's prefix ends here */
    uint32_t pages;          /* pages of the node */
    uint64_t stamp;          /* the node's recency in that list when chosen */
    bool written_back;       /* PD_EVICT_DEVICE: copied to host */
    bool node_deleted;       /* the node (and any host-only subtree) is gone */
} pd_evict_event;

/* Observer of evictions, in the order they happen (tests, metrics). */
typedef void (*pd_cache_evict_fn)(void *ctx, const pd_evict_event *ev);

typedef struct pd_cache_config {
    pd_ledger *ledger;
    int kv_pool;          /* required; its unit_tokens is the page size */
    int mamba_pool;       /* -1: no snapshots (attention-only model) */
    int host_pool;        /* -1: no host tier; same page size as kv */
    bool write_back;      /* device eviction writes to host when possible */
    uint32_t loads_max;   /* concurrent host loads (tickets); 0 = 64 */
    pd_cache_copy_fn copy;
    void *copy_ctx;
    pd_cache_evict_fn on_evict;
    void *on_evict_ctx;
} pd_cache_config;

pd_err pd_cache_create(pd_cache **out, const pd_cache_config *cfg);
/* Frees the cache's own memory. Units it still holds stay allocated in the
 * ledger: call pd_cache_clear first for an orderly shutdown. */
void pd_cache_destroy(pd_cache *c);

typedef struct pd_cache_match_result {
    uint32_t dev_tokens;     /* prefix whose KV is on device (page multiple) */
    pd_cnode dev_node;       /* node ending at dev_tokens (ROOT when 0) */
    uint32_t host_tokens;    /* further tokens available on host only */
    pd_cnode host_node;      /* node ending at dev_tokens + host_tokens */
    uint32_t mamba_tokens;   /* deepest snapshot point <= dev_tokens, or 0 */
    pd_cnode mamba_node;     /* node ending there (ROOT when none) */
    uint32_t mamba_slot;     /* its snapshot slot, or PD_POOL_NONE */
} pd_cache_match_result;

/* Longest cached prefix of tokens[0..n_tokens) (whole pages only). Writes the
 * device pages of [0, dev_tokens) to pages[] (pages_cap must be at least
 * n_tokens / page_size). Splits nodes so that dev_node and host_node end
 * exactly at the match; touches the matched path. A hybrid caller resumes
 * from mamba_tokens / mamba_node, never beyond. */
pd_err pd_cache_match(pd_cache *c, const int32_t *tokens, uint32_t n_tokens,
                      uint32_t *pages, uint32_t pages_cap, pd_cache_match_result *out);

/* Lock / unlock the path from node to the root (protects it from eviction).
 * Unlocking a node on which no lock was taken (a lock held below it does not
 * count: it is not this one), or releasing the last lock of a node whose
 * snapshot is still locked, is PD_ERR_STATE. Both cost the nodes whose lock
 * state changes, not the path to the root. */
pd_err pd_cache_lock(pd_cache *c, pd_cnode node);
/* Starts loading node's record: a hint for a walk that will start there
 * soon (no effect on the cache). */
void pd_cache_prefetch(const pd_cache *c, pd_cnode node);
/* The child index slot a match of tokens will most likely search: the one
 * under the node where the last match of a prompt with the same first and
 * page_size-th tokens searched it, at this prompt's page there. Worked out
 * while the caller has the prompt at hand (the engine at submit, when it
 * copies it in) and kept; asked for later, one request ahead of the match,
 * by pd_cache_guess_prefetch, which reads nothing the guess read (a guess
 * made at admission waited on a cold prompt and node, issue 13). Neither
 * changes the cache; a guess that went stale since only asks for a useless
 * line. key 0: no guess. */
typedef struct pd_cache_guess {
    uint64_t key;
} pd_cache_guess;
void pd_cache_match_guess(const pd_cache *c, const int32_t *tokens, uint32_t n_tokens,
                          pd_cache_guess *out);
void pd_cache_guess_prefetch(const pd_cache *c, pd_cache_guess g);
/* Starts loading the child index's slot where a search for parent's child
 * starting with first_page (page_size tokens) will look, when it will look
 * there (parent with many children); the caller has node and page loaded or
 * on their way (pd_cache_prefetch). */
void pd_cache_prefetch_child(const pd_cache *c, pd_cnode parent, const int32_t *first_page);
pd_err pd_cache_unlock(pd_cache *c, pd_cnode node);
/* Moves one lock from a node to the node `to` below it on the same path (or
 * to itself): the same as pd_cache_lock(to) then pd_cache_unlock(from) —
 * the same locks, units, lists and clock — but it walks only the nodes
 * between the two, not up to the root. A lock must have been taken on from
 * (else PD_ERR_STATE); to must be from or a descendant of it, else
 * PD_ERR_INVALID and nothing changes. */
pd_err pd_cache_lock_move(pd_cache *c, pd_cnode from, pd_cnode to);
/* Lock / unlock the snapshot at node; the node must be locked. */
pd_err pd_cache_mamba_lock(pd_cache *c, pd_cnode node);
pd_err pd_cache_mamba_unlock(pd_cache *c, pd_cnode node);
/* What pd_cache_mamba_lock then pd_cache_mamba_unlock do — the same clock,
 * list place and stamp — without the two ledger moves that cancel out: for
 * a caller that reads the snapshot synchronously (nothing can evict it
 * before the read ends) and holds the node locked. The same errors. */
pd_err pd_cache_mamba_touch(pd_cache *c, pd_cnode node);

typedef struct pd_cache_insert_result {
    pd_cnode node;           /* node ending at covered_tokens */
    uint32_t covered_tokens; /* prefix now held by the cache (<= n_tokens) */
    uint32_t dup_pages;      /* caller pages replaced by existing ones */
    bool mamba_taken;        /* the cache took ownership of mamba_slot */
} pd_cache_insert_result;

/* Inserts the computed prefix tokens[0..n_tokens) (a page multiple) whose
 * device pages are pages[0..n_tokens/page_size), owned by REQ(owner) except
 * where they already are the cache's own pages (from an earlier match).
 *
 * pages[] is in/out: on return pages[i] for every covered page is the cache's
 * page for that position; a caller page that duplicated an existing cached
 * page is replaced and written to dup_out[] (capacity n_tokens/page_size) —
 * the caller frees those. Caller pages past covered_tokens (the insert stops
 * at a node whose host load is in flight) stay the caller's.
 *
 * mamba_slot (REQ(owner), or PD_POOL_NONE) is the snapshot after the last
 * token; the cache takes it if the whole prefix is covered and the node has
 * none yet (mamba_taken), otherwise it stays the caller's to free. */
pd_err pd_cache_insert(pd_cache *c, const int32_t *tokens, uint32_t n_tokens,
                       uint32_t *pages, pd_owner owner, uint32_t mamba_slot,
                       uint32_t *dup_out, pd_cache_insert_result *res);

/* pd_cache_insert starting at start, a node the caller holds locked whose
 * prefix is tokens[0..end) and whose device pages are the caller's
 * pages[0..end) (the caller got them from its match or an earlier insert):
 * the walk from the root down to start, which would find every page there
 * already the cache's, is skipped. The result — nodes, pages, duplicates,
 * lists, clock — is pd_cache_insert's. When start is the root, is not a
 * locked device node ending within n_tokens, or its own device pages are
 * not pages[] at its positions, the insert walks from the root. */
pd_err pd_cache_insert_from(pd_cache *c, pd_cnode start, const int32_t *tokens, uint32_t n_tokens,
                            uint32_t *pages, pd_owner owner, uint32_t mamba_slot, uint32_t *dup_out,
                            pd_cache_insert_result *res);

/* pd_cache_insert_from, then the lock the caller took on start moved down
 * to the node the insert ended at if that is below start
 * (pd_cache_lock_move(start, res->node)):
 * the same nodes, pages, units, lists and clock, in one walk. The node the
 * insert creates is created holding the lock (its pages go straight to
 * CACHE_PROTECTED instead of through the device list and back). PD_ERR_INVALID,
 * and nothing changes, unless start is a valid start of pd_cache_insert_from
 * (not the root, a device node ending within n_tokens > 0 whose pages are
 * pages[] at its positions) with a lock taken on it: the caller then inserts
 * and moves its lock apart. */
pd_err pd_cache_insert_locked(pd_cache *c, pd_cnode start, const int32_t *tokens, uint32_t n_tokens,
                              uint32_t *pages, pd_owner owner, uint32_t mamba_slot,
                              uint32_t *dup_out, pd_cache_insert_result *res);

/* Frees least recently used unlocked device leaves until at least
 * pages_needed device pages were freed or nothing evictable is left.
 * *pages_freed (may be NULL) receives the count. */
pd_err pd_cache_evict(pd_cache *c, uint32_t pages_needed, uint32_t *pages_freed);
/* pd_cache_evict for an allocation: the first pages_needed device pages the
 * evictions release are not freed but move to REQ(owner), written to
 * out[0, *taken); any beyond them are freed. *taken < pages_needed only when
 * nothing evictable is left. Saves the pool a free and an allocation of the
 * same pages. */
pd_err pd_cache_evict_to(pd_cache *c, uint32_t pages_needed, pd_owner owner, uint32_t *out,
                         uint32_t *taken);
/* Frees host copies (least recently used first) until host_pages_needed. */
pd_err pd_cache_evict_host(pd_cache *c, uint32_t host_pages_needed,
                           uint32_t *pages_freed);
/* Frees unlocked snapshots (least recently used first), leaving KV in place. */
pd_err pd_cache_evict_snapshots(pd_cache *c, uint32_t slots_needed,
                                uint32_t *slots_freed);

/* Begins loading the host-only nodes between the device prefix and
 * host_node back to the device (host_node must be locked by the caller and
 * none of those nodes already loading). Device pages are allocated (evicting
 * if needed) and owned by REQ(owner). The copy pairs are written to dev_out[]
 * and host_out[] (capacity cap), *n_pages receives their count. */
pd_err pd_cache_load_begin(pd_cache *c, pd_cnode host_node, pd_owner owner,
                           uint32_t *dev_out, uint32_t *host_out, uint32_t cap,
                           uint32_t *n_pages, pd_cache_ticket *ticket);
/* The copy finished: the device pages become the nodes' (cache-owned). */
pd_err pd_cache_load_done(pd_cache *c, pd_cache_ticket ticket);
/* Abandon the load: its device pages are freed, the nodes stay host-only. */
pd_err pd_cache_load_cancel(pd_cache *c, pd_cache_ticket ticket);
uint32_t pd_cache_loads_in_flight(const pd_cache *c);

/* Evicts everything unlocked (device, host, snapshots). */
void pd_cache_clear(pd_cache *c);

/* The cache's own sums, added into the per-pool-id slots of *sums. */
void pd_cache_sums_get(const pd_cache *c, pd_cache_sums *sums);
/* Device pages the cache holds unlocked (what eviction could free now): its
 * sums' evictable count for the device pool, without filling a
 * pd_cache_sums (admission asks once per request). */
uint64_t pd_cache_dev_evictable(const pd_cache *c);

typedef struct pd_cache_stats {
    uint32_t nodes;          /* live nodes, root excluded */
    uint64_t dev_pages;      /* device pages held */
    uint64_t host_pages;     /* host pages held */
    uint64_t snapshots;      /* Mamba slots held */
    uint64_t evicted_dev_pages;
    uint64_t written_back_pages;
    uint64_t loaded_pages;
} pd_cache_stats;
void pd_cache_stats_get(const pd_cache *c, pd_cache_stats *out);

/* The logical clock: advances once per mutating call; stamps are its values. */
uint64_t pd_cache_clock(const pd_cache *c);

/* ---- inspection (tests, debugging) ------------------------------------- */

typedef struct pd_cnode_info {
    pd_cnode node;
    pd_cnode parent;
    uint32_t end_tokens;       /* prefix length at the node's end */
    uint32_t pages;
    bool on_dev, on_host, loading;
    uint32_t lock_ref; /* locks covering it: taken on it or below it */
    uint32_t locks;    /* locks taken on the node itself */
    uint32_t mamba_lock;
    uint32_t mamba_slot;       /* PD_POOL_NONE if none */
    uint64_t stamp_dev, stamp_host, stamp_mamba;
    const int32_t *prefix;     /* tokens[0..end_tokens), valid during the call */
    const uint32_t *dev_pages; /* [pages], valid during the call; NULL if !on_dev && !loading */
    const uint32_t *host_pages;/* [pages], valid during the call; NULL if !on_host */
} pd_cnode_info;

/* Writes the prefix a node ends at (tokens[0..end_tokens)) into buf and
 * returns its length, or 0 if cap is too small or the node is not live.
 * Read-only: may be called from an eviction observer. */
uint32_t pd_cache_node_prefix(const pd_cache *c, pd_cnode node, int32_t *buf,
                              uint32_t cap);

/* Calls fn for every node except the root, parents before children. */
void pd_cache_walk(pd_cache *c, void (*fn)(void *ctx, const pd_cnode_info *),
                   void *ctx);

/* Recomputes every structural invariant and sum from scratch (C1..C4, list
 * membership and order, hash table, ledger states of every unit held).
 * PD_OK or PD_ERR_INTERNAL with the first problem in msg. O(cache size). */
pd_err pd_cache_verify(pd_cache *c, char *msg, size_t msg_cap);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_CACHE_H */
