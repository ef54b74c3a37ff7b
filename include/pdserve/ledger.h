/*
 * pd_ledger — who owns every resource unit of a node, at every instant.
 *
 * Each unit of each registered pool is in exactly one state:
 *
 *   FREE                 in the pool's free set
 *   REQ(owner)           held by one request (owner = the engine's request id)
 *   CACHE_EVICTABLE      in the prefix cache, unlocked: eviction may free it
 *   CACHE_PROTECTED      in the prefix cache, locked by some live request
 *   QUARANTINE(room)     no request owns it, but a transfer of `room` may
 *                        still read or write it; freed when the room drains
 *
 * The ledger keeps the count of units per (pool, state) and a state byte per
 * unit. In strict mode it also keeps the owner of every unit, so a transition
 * can check "owned by request A" and a leak report can name the culprit.
 *
 * Every transition is one call that states the unit's expected previous state
 * (and owner): freeing a FREE unit, or releasing A's unit as if it were B's,
 * is refused at the call with PD_ERR_STATE and a message naming the unit,
 * before anything changes. Calls on arrays are all-or-nothing.
 *
 * The ledger also fronts the pools: pd_ledger_alloc / pd_ledger_free change
 * the pool and the ledger together, so the two can only disagree through a
 * bug, which pd_ledger_check then reports. The check compares three sources
 * that are maintained independently:
 *
 *   1. the ledger's counters (and, in a deep check, its per-unit states),
 *   2. each pool's own free count (and, in a deep check, its bitmap),
 *   3. the prefix cache's own evictable / protected sums per pool,
 *
 * and asserts conservation: free + evictable + protected + req + quarantine
 * == total for every pool. Asked for clean idle, it also requires that no unit
 * is REQ or QUARANTINE (hence every row and metadata row is free).
 */
#ifndef PDSERVE_LEDGER_H
#define PDSERVE_LEDGER_H

#include "pdserve/base.h"
#include "pdserve/pool.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pd_unit_state {
    PD_UNIT_FREE = 0,
    PD_UNIT_REQ,
    PD_UNIT_CACHE_EVICTABLE,
    PD_UNIT_CACHE_PROTECTED,
    PD_UNIT_QUARANTINE,
    PD_UNIT_STATE__COUNT
} pd_unit_state;

const char *pd_unit_state_name(pd_unit_state st);

/* REQ: the engine's request id; QUARANTINE: the room; FREE and CACHE states:
 * PD_OWNER_NONE / PD_OWNER_CACHE. */
typedef uint64_t pd_owner;
#define PD_OWNER_NONE ((pd_owner)0)
#define PD_OWNER_CACHE ((pd_owner)0)

#define PD_LEDGER_POOLS_MAX 8

typedef struct pd_ledger pd_ledger;

pd_err pd_ledger_create(pd_ledger **out, bool strict);
/* Does not destroy the registered pools: whoever created them does. */
void pd_ledger_destroy(pd_ledger *l);
bool pd_ledger_strict(const pd_ledger *l);

/* Registers a pool whose units are all FREE. The pool must not be used other
 * than through this ledger from now on. Returns the pool's id in *out_id. */
pd_err pd_ledger_add_pool(pd_ledger *l, pd_pool *pool, int *out_id);
pd_pool *pd_ledger_pool(const pd_ledger *l, int pool_id);
int pd_ledger_pool_count(const pd_ledger *l);

/* The message of the last refused call (empty if none). */
const char *pd_ledger_last_error(const pd_ledger *l);

/* FREE -> REQ(owner) for n units taken from the pool (ascending, contiguous
 * runs preferred). PD_ERR_NOMEM with no change when fewer than n are free. */
pd_err pd_ledger_alloc(pd_ledger *l, int pool_id, uint32_t n, pd_owner owner,
                       uint32_t *out);
/* FREE -> state(owner) for n units; state must not be FREE. The prefix cache
 * uses it to take host pages straight into CACHE_EVICTABLE. */
pd_err pd_ledger_alloc_as(pd_ledger *l, int pool_id, uint32_t n,
                          pd_unit_state state, pd_owner owner, uint32_t *out);

/* from(from_owner) -> FREE, returning the units to the pool. `from` may be
 * REQ, CACHE_EVICTABLE or QUARANTINE; freeing a protected cache unit is a
 * misuse (unlock it first). */
pd_err pd_ledger_free(pd_ledger *l, int pool_id, const uint32_t *idx,
                      uint32_t n, pd_unit_state from, pd_owner from_owner);

/* from(from_owner) -> to(to_owner) for units that stay allocated. Neither
 * side may be FREE: use pd_ledger_alloc / pd_ledger_free for that. */
pd_err pd_ledger_move(pd_ledger *l, int pool_id, const uint32_t *idx,
                      uint32_t n, pd_unit_state from, pd_owner from_owner,
                      pd_unit_state to, pd_owner to_owner);

/* Counters. */
uint64_t pd_ledger_count(const pd_ledger *l, int pool_id, pd_unit_state st);
pd_unit_state pd_ledger_state_of(const pd_ledger *l, int pool_id, uint32_t idx);
/* Strict mode only (PD_OWNER_NONE otherwise). */
pd_owner pd_ledger_owner_of(const pd_ledger *l, int pool_id, uint32_t idx);
/* Units of the pool in state st owned by owner; strict mode only (0 otherwise).
 * O(pool size): for tests and reports, not for the hot path. */
uint64_t pd_ledger_owner_units(const pd_ledger *l, int pool_id,
                               pd_unit_state st, pd_owner owner);

/* ---- checking and attribution ------------------------------------------ */

/* The prefix cache's own view, per pool id. A node without a prefix cache
 * passes NULL, which means "the cache holds nothing". */
typedef struct pd_cache_sums {
    uint64_t evictable[PD_LEDGER_POOLS_MAX];
    uint64_t protected_[PD_LEDGER_POOLS_MAX];
} pd_cache_sums;

/* What an owner is, for the attribution report. The engine supplies it. */
typedef struct pd_owner_desc {
    char rid[64];
    uint64_t room;
    char state[32];     /* lifecycle state, e.g. "PREFILL", "retired" */
    char terminal[32];  /* recorded terminal reason, or "" */
} pd_owner_desc;

/* Fills *out and returns true if the owner is known. */
typedef bool (*pd_owner_describe_fn)(void *ctx, pd_owner owner,
                                     pd_owner_desc *out);

typedef struct pd_check_opts {
    const pd_cache_sums *cache;   /* NULL: cache must hold nothing */
    bool expect_idle;             /* also check the clean-idle invariant */
    bool deep;                    /* recount per-unit states and pool bitmaps */
    pd_owner_describe_fn describe;
    void *describe_ctx;
} pd_check_opts;

/* PD_OK, or PD_ERR_INTERNAL with each violation and then the attribution
 * report (text) appended to *report (which may be NULL). */
pd_err pd_ledger_check(const pd_ledger *l, const pd_check_opts *opts,
                       pd_strbuf *report);

typedef enum pd_report_format { PD_REPORT_TEXT, PD_REPORT_JSON } pd_report_format;

/* Per pool: totals and counts per state. In strict mode, the units held in
 * REQ and QUARANTINE grouped by owner, with index ranges and the owner's
 * description. JSON: {"strict":bool,"pools":[...],"holders":[...]}. */
void pd_ledger_report(const pd_ledger *l, pd_report_format fmt,
                      pd_owner_describe_fn describe, void *describe_ctx,
                      pd_strbuf *out);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_LEDGER_H */
