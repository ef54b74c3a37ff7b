/*
 * ledger.c — per-unit ownership states, counters, the three-source check and
 * the attribution report. See include/pdserve/ledger.h for the model.
 *
 * Invariants kept by every successful call:
 *   L1  count[s] == number of units whose state byte is s, per pool
 *   L2  sum over s of count[s] == total, per pool
 *   L3  state byte FREE  <=>  the pool's bitmap says free
 *   L4  strict: owner[i] == PD_OWNER_NONE whenever state[i] is FREE
 * A refused call changes nothing (arrays are validated, or applied and rolled
 * back, before returning).
 */
#include "pdserve/ledger.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pool_internal.h"

typedef struct holder_entry {
    pd_owner owner;
    uint32_t idx;
    uint8_t state;
} holder_entry;

typedef struct lpool {
    pd_pool *pool;
    uint32_t total;
    uint8_t *state;          /* pd_unit_state per unit */
    pd_owner *owner;         /* strict mode only */
    holder_entry *scratch;   /* strict mode only: report grouping */
    uint64_t count[PD_UNIT_STATE__COUNT];
} lpool;

struct pd_ledger {
    bool strict;
    int n_pools;
    lpool pools[PD_LEDGER_POOLS_MAX];
    char err[256];
};

static const char *const state_names[PD_UNIT_STATE__COUNT] = {
    [PD_UNIT_FREE] = "free",
    [PD_UNIT_REQ] = "req",
    [PD_UNIT_CACHE_EVICTABLE] = "cache_evictable",
    [PD_UNIT_CACHE_PROTECTED] = "cache_protected",
    [PD_UNIT_QUARANTINE] = "quarantine",
};

const char *pd_unit_state_name(pd_unit_state st) {
    if ((unsigned)st >= PD_UNIT_STATE__COUNT) return "unknown";
    return state_names[st];
}

pd_err pd_ledger_create(pd_ledger **out, bool strict) {
    if (!out) return PD_ERR_INVALID;
    pd_ledger *l = calloc(1, sizeof(*l));
    if (!l) return PD_ERR_NOMEM;
    l->strict = strict;
    *out = l;
    return PD_OK;
}

void pd_ledger_destroy(pd_ledger *l) {
    if (!l) return;
    for (int i = 0; i < l->n_pools; i++) {
        free(l->pools[i].state);
        free(l->pools[i].owner);
        free(l->pools[i].scratch);
    }
    free(l);
}

bool pd_ledger_strict(const pd_ledger *l) { return l->strict; }

pd_err pd_ledger_add_pool(pd_ledger *l, pd_pool *pool, int *out_id) {
    if (!l || !pool || !out_id) return PD_ERR_INVALID;
    if (l->n_pools >= PD_LEDGER_POOLS_MAX) return PD_ERR_NOMEM;
    uint32_t total = pd_pool_total(pool);
    if (pd_pool_free_count(pool) != total) return PD_ERR_STATE;
    for (int i = 0; i < l->n_pools; i++)
        if (l->pools[i].pool == pool) return PD_ERR_EXISTS;

    lpool *lp = &l->pools[l->n_pools];
    memset(lp, 0, sizeof(*lp));
    lp->pool = pool;
    lp->total = total;
    lp->state = calloc(total, 1);
    if (l->strict) {
        lp->owner = calloc(total, sizeof(pd_owner));
        lp->scratch = calloc(total, sizeof(holder_entry));
    }
    if (!lp->state || (l->strict && (!lp->owner || !lp->scratch))) {
        free(lp->state);
        free(lp->owner);
        free(lp->scratch);
        memset(lp, 0, sizeof(*lp));
        return PD_ERR_NOMEM;
    }
    lp->count[PD_UNIT_FREE] = total;
    *out_id = l->n_pools++;
    return PD_OK;
}

pd_pool *pd_ledger_pool(const pd_ledger *l, int pool_id) {
    PD_ASSERT(pool_id >= 0 && pool_id < l->n_pools);
    return l->pools[pool_id].pool;
}

int pd_ledger_pool_count(const pd_ledger *l) { return l->n_pools; }

const char *pd_ledger_last_error(const pd_ledger *l) { return l->err; }

static lpool *get_pool(pd_ledger *l, int pool_id) {
    PD_ASSERTF(pool_id >= 0 && pool_id < l->n_pools, "pool id %d", pool_id);
    return &l->pools[pool_id];
}

static void describe_unit(const pd_ledger *l, const lpool *lp, uint32_t idx,
                          char *buf, size_t cap) {
    pd_unit_state st = (pd_unit_state)lp->state[idx];
    if (l->strict && (st == PD_UNIT_REQ || st == PD_UNIT_QUARANTINE))
        snprintf(buf, cap, "%s(%llu)", pd_unit_state_name(st),
                 (unsigned long long)lp->owner[idx]);
    else
        snprintf(buf, cap, "%s", pd_unit_state_name(st));
}

/* Is unit idx in state `from` owned by `from_owner`? Writes the refusal into
 * l->err otherwise. The owner is only known (and checked) in strict mode. */
static bool expect_unit(pd_ledger *l, const lpool *lp, uint32_t idx,
                        pd_unit_state from, pd_owner from_owner,
                        const char *what) {
    if (idx >= lp->total) {
        snprintf(l->err, sizeof(l->err),
                 "%s: pool %s has no unit %u (it has %u)", what,
                 pd_pool_name(lp->pool), idx, lp->total);
        return false;
    }
    bool ok = lp->state[idx] == from;
    if (ok && l->strict && (from == PD_UNIT_REQ || from == PD_UNIT_QUARANTINE))
        ok = lp->owner[idx] == from_owner;
    if (!ok) {
        char have[64];
        describe_unit(l, lp, idx, have, sizeof(have));
        if (from == PD_UNIT_REQ || from == PD_UNIT_QUARANTINE)
            snprintf(l->err, sizeof(l->err),
                     "%s: pool %s unit %u expected %s(%llu) but is %s", what,
                     pd_pool_name(lp->pool), idx, pd_unit_state_name(from),
                     (unsigned long long)from_owner, have);
        else
            snprintf(l->err, sizeof(l->err),
                     "%s: pool %s unit %u expected %s but is %s", what,
                     pd_pool_name(lp->pool), idx, pd_unit_state_name(from), have);
    }
    return ok;
}

static void set_unit(lpool *lp, bool strict, uint32_t idx, pd_unit_state to,
                     pd_owner to_owner) {
    pd_unit_state from = (pd_unit_state)lp->state[idx];
    PD_ASSERT(lp->count[from] > 0);
    lp->count[from]--;
    lp->count[to]++;
    lp->state[idx] = (uint8_t)to;
    if (strict) lp->owner[idx] = (to == PD_UNIT_FREE) ? PD_OWNER_NONE : to_owner;
}

/* Restores idx[0..n), which a transition had moved from (from, from_owner). */
static void transition_undo(lpool *lp, bool strict, const uint32_t *idx, uint32_t n,
                            pd_unit_state from, pd_owner from_owner) {
    for (uint32_t j = 0; j < n; j++) {
        lp->state[idx[j]] = (uint8_t)from;
        if (strict) lp->owner[idx[j]] = from == PD_UNIT_FREE ? PD_OWNER_NONE : from_owner;
    }
}

/* Applies from -> to on idx[0..n) with validation and rollback. Each unit's
 * state byte is checked and rewritten in turn, so a unit listed twice fails
 * its second check (it is `to` by then) unless from == to; the counters,
 * which every unit moves the same way, change once for the whole array.
 * The counting ledger checks only the state byte, in the loop itself; the
 * strict one checks owners too (expect_unit). */
static inline pd_err transition(pd_ledger *l, lpool *lp, const uint32_t *idx, uint32_t n,
                                pd_unit_state from, pd_owner from_owner, pd_unit_state to,
                                pd_owner to_owner, const char *what) {
    uint8_t *state = lp->state;
    uint32_t i = 0;
    if (!l->strict) {
        for (; i < n; i++) {
            uint32_t u = idx[i];
            if (u >= lp->total || state[u] != (uint8_t)from) break;
            state[u] = (uint8_t)to;
        }
    } else {
        for (; i < n; i++) {
            uint32_t u = idx[i];
            if (!expect_unit(l, lp, u, from, from_owner, what)) break;
            state[u] = (uint8_t)to;
            lp->owner[u] = to == PD_UNIT_FREE ? PD_OWNER_NONE : to_owner;
        }
    }
    if (i < n) {
        if (!l->strict) (void)expect_unit(l, lp, idx[i], from, from_owner, what); /* the message */
        transition_undo(lp, l->strict, idx, i, from, from_owner);
        return PD_ERR_STATE;
    }
    PD_ASSERT(lp->count[from] >= n);
    lp->count[from] -= n;
    lp->count[to] += n;
    return PD_OK;
}

/* The counting ledger's one-unit transition of unit u (a row, a slot, a
 * page: most calls): transition's check, write and counter moves without
 * its loop. False, with nothing changed, when u is not in state from; the
 * caller then runs transition itself for the refusal and its message. */
static inline bool transition_one(lpool *lp, uint32_t u, pd_unit_state from, pd_unit_state to) {
    if (u >= lp->total || lp->state[u] != (uint8_t)from) return false;
    PD_ASSERT(lp->count[from] > 0);
    lp->state[u] = (uint8_t)to;
    lp->count[from]--;
    lp->count[to]++;
    return true;
}

pd_err pd_ledger_alloc(pd_ledger *l, int pool_id, uint32_t n, pd_owner owner, uint32_t *out) {
    if (n == 1 && !l->strict) {
        /* FREE -> REQ of one unit: the pool's single-unit path and
         * transition_one; anything unusual goes the general way. */
        lpool *lp = get_pool(l, pool_id);
        if (pool_alloc_one(lp->pool, out) != PD_OK)
            return pd_ledger_alloc_as(l, pool_id, n, PD_UNIT_REQ, owner, out);
        if (transition_one(lp, *out, PD_UNIT_FREE, PD_UNIT_REQ)) return PD_OK;
        /* The two sources disagree, as in pd_ledger_alloc_as: the message,
         * the pool's unit back. */
        (void)transition(l, lp, out, 1, PD_UNIT_FREE, PD_OWNER_NONE, PD_UNIT_REQ, owner, "alloc");
        PD_MUST(pd_pool_free(lp->pool, *out));
        return PD_ERR_INTERNAL;
    }
    return pd_ledger_alloc_as(l, pool_id, n, PD_UNIT_REQ, owner, out);
}

pd_err pd_ledger_alloc_as(pd_ledger *l, int pool_id, uint32_t n,
                          pd_unit_state state, pd_owner owner, uint32_t *out) {
    lpool *lp = get_pool(l, pool_id);
    if (state == PD_UNIT_FREE || (unsigned)state >= PD_UNIT_STATE__COUNT) {
        snprintf(l->err, sizeof(l->err), "alloc: pool %s: cannot allocate as %s",
                 pd_pool_name(lp->pool), pd_unit_state_name(state));
        return PD_ERR_STATE;
    }
    if (n == 0) return PD_OK;
    /* One unit (a row, a slot, a page of decode growth: most calls) takes
     * the pool's single-unit path, which picks the unit alloc_n would. */
    pd_err err = n == 1 ? pd_pool_alloc(lp->pool, out) : pd_pool_alloc_n(lp->pool, n, out);
    if (err != PD_OK) {
        snprintf(l->err, sizeof(l->err), "alloc: pool %s has %u free, %u asked",
                 pd_pool_name(lp->pool), pd_pool_free_count(lp->pool), n);
        return err;
    }
    err = transition(l, lp, out, n, PD_UNIT_FREE, PD_OWNER_NONE, state, owner, "alloc");
    if (err != PD_OK) {
        /* The pool handed out a unit the ledger does not think is free: the
         * two sources disagree. transition undid its part; undo the pool's. */
        PD_MUST(pd_pool_free_n(lp->pool, out, n));
        return PD_ERR_INTERNAL;
    }
    return PD_OK;
}

/* The pool refused units the ledger had as `from` (err): they go back to
 * that state and the call fails as an internal disagreement. */
static pd_err free_refused(pd_ledger *l, lpool *lp, const uint32_t *idx, uint32_t n,
                           pd_unit_state from, pd_owner from_owner, pd_err err) {
    for (uint32_t i = 0; i < n; i++) set_unit(lp, l->strict, idx[i], from, from_owner);
    snprintf(l->err, sizeof(l->err),
             "free: pool %s refused the units (%s) although the ledger "
             "had them as %s",
             pd_pool_name(lp->pool), pd_err_name(err), pd_unit_state_name(from));
    return PD_ERR_INTERNAL;
}

pd_err pd_ledger_free(pd_ledger *l, int pool_id, const uint32_t *idx, uint32_t n,
                      pd_unit_state from, pd_owner from_owner) {
    lpool *lp = get_pool(l, pool_id);
    bool from_ok = from == PD_UNIT_REQ || from == PD_UNIT_CACHE_EVICTABLE ||
        from == PD_UNIT_QUARANTINE;
    if (n == 1 && from_ok && !l->strict && transition_one(lp, idx[0], from, PD_UNIT_FREE)) {
        /* One unit (a row, a slot, a page: most calls): transition_one and
         * the pool's single-unit path, which leaves the pool as free_n
         * would; a unit not in state `from` goes the general way. */
        pd_err err = pool_free_one(lp->pool, idx[0]);
        return err == PD_OK ? PD_OK : free_refused(l, lp, idx, 1, from, from_owner, err);
    }
    if (n == 0) return PD_OK;
    if (!from_ok) {
        snprintf(l->err, sizeof(l->err), "free: pool %s: cannot free from %s",
                 pd_pool_name(lp->pool), pd_unit_state_name(from));
        return PD_ERR_STATE;
    }
    pd_err err = transition(l, lp, idx, n, from, from_owner, PD_UNIT_FREE,
                            PD_OWNER_NONE, "free");
    if (err != PD_OK) return err;
    /* One unit (a row, a slot, a page: most calls) takes the pool's
     * single-unit path, which leaves the pool as free_n would. */
    err = n == 1 ? pd_pool_free(lp->pool, idx[0]) : pd_pool_free_n(lp->pool, idx, n);
    return err == PD_OK ? PD_OK : free_refused(l, lp, idx, n, from, from_owner, err);
}

pd_err pd_ledger_move(pd_ledger *l, int pool_id, const uint32_t *idx,
                      uint32_t n, pd_unit_state from, pd_owner from_owner,
                      pd_unit_state to, pd_owner to_owner) {
    lpool *lp = get_pool(l, pool_id);
    if (from == PD_UNIT_FREE || to == PD_UNIT_FREE ||
        (unsigned)from >= PD_UNIT_STATE__COUNT ||
        (unsigned)to >= PD_UNIT_STATE__COUNT) {
        snprintf(l->err, sizeof(l->err),
                 "move: pool %s: %s -> %s is not a move (use alloc/free)",
                 pd_pool_name(lp->pool), pd_unit_state_name(from),
                 pd_unit_state_name(to));
        return PD_ERR_STATE;
    }
    return transition(l, lp, idx, n, from, from_owner, to, to_owner, "move");
}

uint64_t pd_ledger_count(const pd_ledger *l, int pool_id, pd_unit_state st) {
    PD_ASSERT(pool_id >= 0 && pool_id < l->n_pools);
    PD_ASSERT((unsigned)st < PD_UNIT_STATE__COUNT);
    return l->pools[pool_id].count[st];
}

pd_unit_state pd_ledger_state_of(const pd_ledger *l, int pool_id, uint32_t idx) {
    PD_ASSERT(pool_id >= 0 && pool_id < l->n_pools);
    PD_ASSERT(idx < l->pools[pool_id].total);
    return (pd_unit_state)l->pools[pool_id].state[idx];
}

pd_owner pd_ledger_owner_of(const pd_ledger *l, int pool_id, uint32_t idx) {
    PD_ASSERT(pool_id >= 0 && pool_id < l->n_pools);
    PD_ASSERT(idx < l->pools[pool_id].total);
    return l->strict ? l->pools[pool_id].owner[idx] : PD_OWNER_NONE;
}

uint64_t pd_ledger_owner_units(const pd_ledger *l, int pool_id,
                               pd_unit_state st, pd_owner owner) {
    PD_ASSERT(pool_id >= 0 && pool_id < l->n_pools);
    if (!l->strict) return 0;
    const lpool *lp = &l->pools[pool_id];
    uint64_t n = 0;
    for (uint32_t i = 0; i < lp->total; i++)
        if (lp->state[i] == st && lp->owner[i] == owner) n++;
    return n;
}

/* ---- check -------------------------------------------------------------- */

/* L2 and the three sources: the ledger's counters against the pool's own
 * free count and the prefix cache's own sums. */
static pd_err check_sources(const lpool *lp, int pid, const pd_check_opts *opts,
                            pd_strbuf *report) {
    pd_err result = PD_OK;
    const char *name = pd_pool_name(lp->pool);
    uint64_t sum = 0;
    for (int s = 0; s < PD_UNIT_STATE__COUNT; s++) sum += lp->count[s];
    if (sum != lp->total)
        result = pd_violation(report,
                           "pool %s: conservation: free %llu + evictable %llu + "
                           "protected %llu + req %llu + quarantine %llu = %llu != "
                           "total %u",
                           name,
                           (unsigned long long)lp->count[PD_UNIT_FREE],
                           (unsigned long long)lp->count[PD_UNIT_CACHE_EVICTABLE],
                           (unsigned long long)lp->count[PD_UNIT_CACHE_PROTECTED],
                           (unsigned long long)lp->count[PD_UNIT_REQ],
                           (unsigned long long)lp->count[PD_UNIT_QUARANTINE],
                           (unsigned long long)sum, lp->total);

    /* Source 2: the pool's own free count. */
    uint32_t pool_free = pd_pool_free_count(lp->pool);
    if (pool_free != lp->count[PD_UNIT_FREE])
        result = pd_violation(report,
                           "pool %s: ledger counts %llu free, the pool %u",
                           name, (unsigned long long)lp->count[PD_UNIT_FREE],
                           pool_free);

    /* Source 3: the prefix cache's own sums. */
    uint64_t c_evict = opts->cache ? opts->cache->evictable[pid] : 0;
    uint64_t c_prot = opts->cache ? opts->cache->protected_[pid] : 0;
    if (c_evict != lp->count[PD_UNIT_CACHE_EVICTABLE])
        result = pd_violation(report,
                           "pool %s: ledger counts %llu cache-evictable, the "
                           "prefix cache %llu",
                           name,
                           (unsigned long long)lp->count[PD_UNIT_CACHE_EVICTABLE],
                           (unsigned long long)c_evict);
    if (c_prot != lp->count[PD_UNIT_CACHE_PROTECTED])
        result = pd_violation(report,
                           "pool %s: ledger counts %llu cache-protected, the "
                           "prefix cache %llu",
                           name,
                           (unsigned long long)lp->count[PD_UNIT_CACHE_PROTECTED],
                           (unsigned long long)c_prot);
    return result;
}

/* The deep check, unit by unit: L1 (a recount of the state bytes), L3 (state
 * FREE against the pool's bitmap), L4 (no owner on a free unit), and the
 * pool's own I1-I4. */
static pd_err check_units(const pd_ledger *l, const lpool *lp, pd_strbuf *report) {
    pd_err result = PD_OK;
    const char *name = pd_pool_name(lp->pool);
    uint64_t recount[PD_UNIT_STATE__COUNT] = {0};
    for (uint32_t i = 0; i < lp->total; i++) {
        uint8_t st = lp->state[i];
        if (st >= PD_UNIT_STATE__COUNT) {
            result = pd_violation(report, "pool %s unit %u: bad state %u",
                               name, i, st);
            continue;
        }
        recount[st]++;
        bool bitmap_free = pd_pool_is_free(lp->pool, i);
        if (bitmap_free != (st == PD_UNIT_FREE))
            result = pd_violation(report,
                               "pool %s unit %u: ledger says %s, the pool "
                               "bitmap says %s",
                               name, i, state_names[st],
                               bitmap_free ? "free" : "allocated");
        if (l->strict && st == PD_UNIT_FREE &&
            lp->owner[i] != PD_OWNER_NONE)
            result = pd_violation(report, "pool %s unit %u: free but owned by %llu",
                               name, i, (unsigned long long)lp->owner[i]);
    }
    for (int s = 0; s < PD_UNIT_STATE__COUNT; s++)
        if (recount[s] != lp->count[s])
            result = pd_violation(report,
                               "pool %s: %s counter %llu, per-unit states %llu",
                               name, state_names[s],
                               (unsigned long long)lp->count[s],
                               (unsigned long long)recount[s]);
    char msg[160];
    if (pd_pool_verify(lp->pool, msg, sizeof(msg)) != PD_OK)
        result = pd_violation(report, "%s", msg);
    return result;
}

/* Idle: nothing held by requests or in quarantine, every row free. */
static pd_err check_idle(const lpool *lp, pd_strbuf *report) {
    pd_err result = PD_OK;
    const char *name = pd_pool_name(lp->pool);
    pd_pool_kind kind = pd_pool_kind_of(lp->pool);
    if (lp->count[PD_UNIT_REQ] != 0)
        result = pd_violation(report, "pool %s: idle but %llu units held by "
                                   "requests",
                           name, (unsigned long long)lp->count[PD_UNIT_REQ]);
    if (lp->count[PD_UNIT_QUARANTINE] != 0)
        result = pd_violation(report,
                           "pool %s: idle but %llu units in quarantine", name,
                           (unsigned long long)lp->count[PD_UNIT_QUARANTINE]);
    if ((kind == PD_POOL_ROW || kind == PD_POOL_META) &&
        lp->count[PD_UNIT_FREE] != lp->total)
        result = pd_violation(report, "pool %s: idle but %llu of %u rows in use",
                           name,
                           (unsigned long long)(lp->total -
                                                lp->count[PD_UNIT_FREE]),
                           lp->total);
    return result;
}

pd_err pd_ledger_check(const pd_ledger *l, const pd_check_opts *opts,
                       pd_strbuf *report) {
    static const pd_check_opts defaults = {0};
    if (!opts) opts = &defaults;
    pd_err result = PD_OK;

    for (int pid = 0; pid < l->n_pools; pid++) {
        const lpool *lp = &l->pools[pid];
        pd_err err = check_sources(lp, pid, opts, report);
        if (err) result = err;
        if (opts->deep && (err = check_units(l, lp, report))) result = err;
        if (opts->expect_idle && (err = check_idle(lp, report))) result = err;
    }

    if (result != PD_OK && report) {
        pd_strbuf_append(report, "attribution:\n");
        pd_ledger_report(l, PD_REPORT_TEXT, opts->describe, opts->describe_ctx,
                         report);
    }
    return result;
}

/* ---- attribution report ------------------------------------------------- */

static int holder_cmp(const void *a, const void *b) {
    const holder_entry *x = a, *y = b;
    if (x->state != y->state) return x->state < y->state ? -1 : 1;
    if (x->owner != y->owner) return x->owner < y->owner ? -1 : 1;
    if (x->idx != y->idx) return x->idx < y->idx ? -1 : 1;
    return 0;
}

/* Index ranges "3-10, 15" of a sorted group; at most ranges_max ranges. */
static void append_ranges(pd_strbuf *out, const holder_entry *e, size_t n,
                          bool json) {
    const size_t ranges_max = 32;
    size_t printed = 0;
    size_t i = 0;
    while (i < n) {
        size_t j = i;
        while (j + 1 < n && e[j + 1].idx == e[j].idx + 1) j++;
        if (printed == ranges_max) {
            if (!json) pd_strbuf_append(out, ", ...");
            break;
        }
        if (json)
            pd_strbuf_printf(out, "%s[%u,%u]", printed ? "," : "", e[i].idx, e[j].idx);
        else if (i == j)
            pd_strbuf_printf(out, "%s%u", printed ? ", " : "", e[i].idx);
        else
            pd_strbuf_printf(out, "%s%u-%u", printed ? ", " : "", e[i].idx, e[j].idx);
        printed++;
        i = j + 1;
    }
}

static void append_owner(pd_strbuf *out, pd_report_format fmt, pd_unit_state st,
                         pd_owner owner, pd_owner_describe_fn describe, void *ctx) {
    pd_owner_desc d;
    memset(&d, 0, sizeof(d));
    bool known = st == PD_UNIT_REQ && describe && describe(ctx, owner, &d);
    if (fmt == PD_REPORT_JSON) {
        pd_strbuf_printf(out, "\"state\":\"%s\",\"owner\":%llu", state_names[st],
                         (unsigned long long)owner);
        if (st == PD_UNIT_QUARANTINE)
            pd_strbuf_printf(out, ",\"room\":%llu", (unsigned long long)owner);
        if (known) {
            pd_strbuf_append(out, ",\"rid\":");
            pd_strbuf_json_string(out, d.rid);
            pd_strbuf_printf(out, ",\"room\":%llu,\"lifecycle\":", (unsigned long long)d.room);
            pd_strbuf_json_string(out, d.state);
            pd_strbuf_append(out, ",\"terminal\":");
            pd_strbuf_json_string(out, d.terminal);
        }
        return;
    }
    if (st == PD_UNIT_QUARANTINE) {
        pd_strbuf_printf(out, "QUARANTINE room %llu", (unsigned long long)owner);
    } else if (known) {
        pd_strbuf_printf(out, "REQ owner %llu (rid=%s room=%llu state=%s terminal=%s)",
                         (unsigned long long)owner, d.rid, (unsigned long long)d.room,
                         d.state, d.terminal[0] ? d.terminal : "none");
    } else {
        pd_strbuf_printf(out, "REQ owner %llu (unknown request)",
                         (unsigned long long)owner);
    }
}

/* Each pool's counters, one line (text) or one object (JSON) a pool. */
static void report_counts(const pd_ledger *l, bool json, pd_strbuf *out) {
    for (int pid = 0; pid < l->n_pools; pid++) {
        const lpool *lp = &l->pools[pid];
        if (json) {
            pd_strbuf_append(out, pid ? "," : "");
            pd_strbuf_append(out, "{\"name\":");
            pd_strbuf_json_string(out, pd_pool_name(lp->pool));
            pd_strbuf_printf(out, ",\"kind\":\"%s\",\"total\":%u",
                             pd_pool_kind_name(pd_pool_kind_of(lp->pool)), lp->total);
            for (int s = 0; s < PD_UNIT_STATE__COUNT; s++)
                pd_strbuf_printf(out, ",\"%s\":%llu", state_names[s],
                                 (unsigned long long)lp->count[s]);
            pd_strbuf_append(out, "}");
        } else {
            pd_strbuf_printf(out, "pool %s (%s, %u units):", pd_pool_name(lp->pool),
                             pd_pool_kind_name(pd_pool_kind_of(lp->pool)), lp->total);
            for (int s = 0; s < PD_UNIT_STATE__COUNT; s++)
                pd_strbuf_printf(out, " %s %llu", state_names[s],
                                 (unsigned long long)lp->count[s]);
            pd_strbuf_append(out, "\n");
        }
    }
}

/* Each pool's held units (REQ, QUARANTINE) into its scratch, sorted by
 * (state, owner, idx); n[pid] says how many. */
static void collect_holders(const pd_ledger *l, size_t *n) {
    for (int pid = 0; pid < l->n_pools; pid++) {
        const lpool *lp = &l->pools[pid];
        for (uint32_t i = 0; i < lp->total; i++) {
            uint8_t st = lp->state[i];
            if (st == PD_UNIT_REQ || st == PD_UNIT_QUARANTINE) {
                lp->scratch[n[pid]].owner = lp->owner[i];
                lp->scratch[n[pid]].idx = i;
                lp->scratch[n[pid]].state = st;
                n[pid]++;
            }
        }
        qsort(lp->scratch, n[pid], sizeof(holder_entry), holder_cmp);
    }
}

/* What (st, owner) holds in every pool: the run of its entries at the head of
 * each pool's sorted scratch, consumed (cur[] advances past it). */
static void append_holdings(const pd_ledger *l, pd_unit_state st, pd_owner owner,
                            const size_t *n, size_t *cur, bool json, pd_strbuf *out) {
    bool first_pool = true;
    for (int pid = 0; pid < l->n_pools; pid++) {
        const lpool *lp = &l->pools[pid];
        size_t i = cur[pid], j = i;
        while (j < n[pid] && lp->scratch[j].state == st &&
               lp->scratch[j].owner == owner)
            j++;
        if (j == i) continue;
        if (json) {
            pd_strbuf_append(out, first_pool ? "" : ",");
            pd_strbuf_json_string(out, pd_pool_name(lp->pool));
            pd_strbuf_printf(out, ":{\"units\":%zu,\"ranges\":[", j - i);
            append_ranges(out, &lp->scratch[i], j - i, true);
            pd_strbuf_append(out, "]}");
        } else {
            pd_strbuf_printf(out, "%s %s %zu [", first_pool ? "" : ";",
                             pd_pool_name(lp->pool), j - i);
            append_ranges(out, &lp->scratch[i], j - i, false);
            pd_strbuf_append(out, "]");
        }
        first_pool = false;
        cur[pid] = j;
    }
}

void pd_ledger_report(const pd_ledger *l, pd_report_format fmt,
                      pd_owner_describe_fn describe, void *describe_ctx,
                      pd_strbuf *out) {
    bool json = fmt == PD_REPORT_JSON;
    if (json) pd_strbuf_printf(out, "{\"strict\":%s,\"pools\":[", l->strict ? "true" : "false");
    report_counts(l, json, out);
    if (json) pd_strbuf_append(out, "],\"holders\":[");
    if (!l->strict) {
        if (json)
            pd_strbuf_append(out, "]}");
        else
            pd_strbuf_append(out, "  (strict mode off: owners are not tracked)\n");
        return;
    }
    /* Sort each pool's holders by (state, owner, idx), then merge the pools
     * so that each owner is reported once with everything it holds. */
    size_t n[PD_LEDGER_POOLS_MAX] = {0}, cur[PD_LEDGER_POOLS_MAX] = {0};
    collect_holders(l, n);
    bool first_holder = true;
    for (;;) {
        const holder_entry *min = NULL;
        for (int pid = 0; pid < l->n_pools; pid++) {
            if (cur[pid] == n[pid]) continue;
            const holder_entry *e = &l->pools[pid].scratch[cur[pid]];
            if (!min || e->state < min->state ||
                (e->state == min->state && e->owner < min->owner))
                min = e;
        }
        if (!min) break;
        pd_unit_state st = (pd_unit_state)min->state;
        pd_owner owner = min->owner;
        pd_strbuf_append(out, json ? (first_holder ? "{" : ",{") : "  ");
        append_owner(out, fmt, st, owner, describe, describe_ctx);
        pd_strbuf_append(out, json ? ",\"pools\":{" : " holds");
        append_holdings(l, st, owner, n, cur, json, out);
        pd_strbuf_append(out, json ? "}}" : "\n");
        first_holder = false;
    }
    if (json) pd_strbuf_append(out, "]}");
}
