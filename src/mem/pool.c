/*
 * pool.c — two-level bitmap unit allocator. See include/pdserve/pool.h for
 * the idea; the invariants kept here are:
 *
 *   I1  bit i of words[] is 1  <=>  unit i is free (bits past `total` are 0)
 *   I2  bit w of sum[]   is 1  <=>  words[w] != 0
 *   I3  free_count == popcount(words[])
 *   I4  sum[s] == 0 for every s < sum_hint
 *   I5  for each hint h: no run of run_n[h] or more free units starts below
 *       run_start[h] (run_n[h] == 0: the hint says nothing)
 *
 * pd_pool_verify recomputes I1..I5 from scratch.
 * The record and the one-unit alloc and free are in pool_internal.h, which
 * the ledger includes to inline them.
 *
 * I5 lets a bulk allocation's search for a run skip what an earlier search
 * already found too short (issue 13: with the pool fragmented by many live
 * requests, the scan from the lowest free word was most of an allocation).
 * Allocations only shorten runs, so it survives them; freeing unit u can
 * lengthen only runs of n that start after u - n, so each hint drops below
 * that. A search for n starts at the highest start of the hints of lengths
 * <= n (a run of n is a run of each of those lengths) and returns the same
 * run as a scan from the start.
 */
#include "pdserve/pool.h"

#include "pool_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* How many bitmap words a bulk allocation may scan looking for one run that
 * fits the whole request, before it settles for the lowest free units.
 * 4096 words cover 262,144 units; the scan costs a few microseconds. */
#define RUN_SCAN_WORDS_MAX 4096u

static const char *const kind_names[PD_POOL_KIND__COUNT] = {
    [PD_POOL_KV] = "kv",       [PD_POOL_ROW] = "row",
    [PD_POOL_MAMBA] = "mamba", [PD_POOL_META] = "meta",
    [PD_POOL_HOST] = "host",
};

const char *pd_pool_kind_name(pd_pool_kind kind) {
    if ((unsigned)kind >= PD_POOL_KIND__COUNT) return "unknown";
    return kind_names[kind];
}

static inline bool kind_is_paged(pd_pool_kind kind) {
    return kind == PD_POOL_KV || kind == PD_POOL_HOST;
}

pd_err pd_pool_create(pd_pool **out, const char *name, pd_pool_kind kind,
                      uint32_t units_total, uint32_t unit_tokens) {
    if (!out || !name) return PD_ERR_INVALID;
    *out = NULL;
    if ((unsigned)kind >= PD_POOL_KIND__COUNT) return PD_ERR_INVALID;
    if (units_total == 0 || units_total > PD_POOL_UNITS_MAX) return PD_ERR_INVALID;
    if (kind_is_paged(kind) ? unit_tokens == 0 : unit_tokens != 0)
        return PD_ERR_INVALID;

    pd_pool *p = calloc(1, sizeof(*p));
    if (!p) return PD_ERR_NOMEM;
    snprintf(p->name, sizeof(p->name), "%s", name);
    p->kind = kind;
    p->total = units_total;
    p->unit_tokens = unit_tokens;
    p->n_words = PD_DIV_CEIL(units_total, 64u);
    p->n_sum = PD_DIV_CEIL(p->n_words, 64u);
    p->words = calloc(p->n_words, sizeof(uint64_t));
    p->sum = calloc(p->n_sum, sizeof(uint64_t));
    if (!p->words || !p->sum) {
        pd_pool_destroy(p);
        return PD_ERR_NOMEM;
    }
    for (uint32_t w = 0; w < p->n_words; w++) {
        uint32_t bits = PD_MIN(64u, units_total - w * 64u);
        p->words[w] = bits == 64 ? ~UINT64_C(0) : (UINT64_C(1) << bits) - 1;
        p->sum[w / 64] |= UINT64_C(1) << (w % 64);
    }
    p->free_count = units_total;
    p->sum_hint = 0;
    for (uint32_t h = 0; h < RUN_HINTS; h++) p->run_n[h] = p->run_start[h] = 0;
    p->run_top = 0;
    *out = p;
    return PD_OK;
}

void pd_pool_destroy(pd_pool *pool) {
    if (!pool) return;
    free(pool->words);
    free(pool->sum);
    free(pool);
}

pd_err pd_pool_alloc(pd_pool *pool, uint32_t *out_idx) { return pool_alloc_one(pool, out_idx); }

/* The first word in [from, end) with a free unit (I2: its summary bit is
 * set), or end. Words with no free unit are skipped 64 at a time, so a
 * nearly full pool costs a run search little. */
static uint32_t next_free_word(const pd_pool *p, uint32_t from, uint32_t end) {
    if (from >= end) return end;
    uint32_t s = from / 64;
    uint64_t bits = p->sum[s] & (~UINT64_C(0) << (from % 64));
    while (bits == 0) {
        if (++s >= p->n_sum || s * 64 >= end) return end;
        bits = p->sum[s];
    }
    uint32_t w = s * 64 + (uint32_t)__builtin_ctzll(bits);
    return PD_MIN(w, end);
}

/* Bits i of the result: units i .. i+n-1 of word x are all free (n <= 64).
 * log2(n) shift-and rounds instead of a walk over the word's runs. */
static inline uint64_t runs_within(uint64_t x, uint32_t n) {
    uint32_t len = 1;
    while (len < n && x != 0) {
        uint32_t s = PD_MIN(len, n - len);
        x &= x >> s;
        len += s;
    }
    return x;
}

/* First run of at least n free units, scanning a bounded number of words from
 * the lowest free word. Returns the run's first index or PD_POOL_NONE. Per
 * word with a free unit, in this order (lowest start first): the run carried
 * in from the word before (only an adjacent one) continued by the word's low
 * free units; a run of n inside the word; the word's high free units carried
 * on to the next word. Not found, *none_below receives how far no run of n
 * starts. The words with a free unit come straight off the summary bits (I2),
 * one summary word held at a time; a run of n inside a word needs units i and
 * i + n - 1 both free, so a word without such a pair skips runs_within. */
static uint32_t find_run_from(const pd_pool *p, uint32_t n, uint32_t w_first, uint32_t w_end,
                              uint32_t *none_below) {
    uint32_t run_start = 0, run_len = 0, w_prev = w_first;
    uint32_t s = w_first / 64;
    uint64_t bits = w_first < w_end ? p->sum[s] & (~UINT64_C(0) << (w_first % 64)) : 0;
    for (;;) {
        while (bits == 0 && ++s < p->n_sum && s * 64 < w_end) bits = p->sum[s];
        if (bits == 0) break;
        uint32_t w = s * 64 + (uint32_t)__builtin_ctzll(bits);
        if (w >= w_end) break;
        bits &= bits - 1;
        uint64_t x = p->words[w];
        PD_ASSERT(x != 0);
        if (w != w_prev + 1) run_len = 0; /* a word with no free unit lay between */
        w_prev = w;
        if (x == ~UINT64_C(0)) {
            if (run_len == 0) run_start = w * 64;
            run_len += 64;
            if (run_len >= n) return run_start;
            continue;
        }
        /* Only isolated free units, neither at an end (n >= 2): no run of n
         * touches this word, nor passes through it. Most of the words a
         * search visits in a fragmented pool; the general steps below come
         * to the same and cost five times as much. */
        if (((x & (x >> 1)) | (x & 1u) | (x >> 63)) == 0) {
            run_len = 0;
            continue;
        }
        uint32_t low = (uint32_t)__builtin_ctzll(~x); /* free units from bit 0 up */
        if (run_len > 0 && run_len + low >= n) return run_start;
        uint64_t inside = n <= 64 && (x & (x >> (n - 1))) != 0 ? runs_within(x, n) : 0;
        if (inside != 0) return w * 64 + (uint32_t)__builtin_ctzll(inside);
        run_len = (uint32_t)__builtin_clzll(~x); /* free units from bit 63 down */
        run_start = w * 64 + 64 - run_len;
    }
    /* Not found: no run of n starts below the run still open at the end. */
    *none_below = w_end == p->n_words ? p->total : run_len > 0 ? run_start : w_end * 64;
    return PD_POOL_NONE;
}

/* The hint of runs of n units (n >= 2): its class of lengths. */
static inline uint32_t run_hint_of(uint32_t n) {
    uint32_t h = 31u - (uint32_t)__builtin_clz(n) - 1u; /* 2-3: 0, 4-7: 1, ... */
    return PD_MIN(h, RUN_HINTS - 1);
}

/* The lowest-starting run of n free units among the RUN_SCAN_WORDS_MAX words
 * from the lowest free word, or PD_POOL_NONE; the scan starts at the word of
 * the highest start below which a hint of a length <= n says no run of n
 * starts (I5). The search's outcome becomes its class's hint. */
static uint32_t find_run(pd_pool *p, uint32_t n) {
    PD_ASSERT(n >= 2);
    uint32_t w0 = lowest_free_word(p);
    uint32_t w_end = PD_MIN(p->n_words, w0 + RUN_SCAN_WORDS_MAX);
    uint32_t bound = 0;
    for (uint32_t h = 0; h < RUN_HINTS; h++)
        if (p->run_n[h] != 0 && p->run_n[h] <= n) bound = PD_MAX(bound, p->run_start[h]);
    if (bound >= p->total) return PD_POOL_NONE;
    uint32_t w_first = PD_MAX(bound / 64, w0); /* find_run_from steps to a free word */
    uint32_t none_below = 0;
    uint32_t start = find_run_from(p, n, w_first, w_end, &none_below);
    uint32_t h = run_hint_of(n);
    p->run_n[h] = n;
    /* Found, start is the lowest start of a run of n: none below it. */
    p->run_start[h] = start != PD_POOL_NONE ? start : none_below;
    p->run_top = PD_MAX(p->run_top, p->run_start[h] + n);
    return start;
}

/* Takes units [start, start + n), all free: a word's share at a time. */
static void take_run(pd_pool *p, uint32_t start, uint32_t n, uint32_t *out) {
    for (uint32_t i = 0; i < n; i++) out[i] = start + i;
    uint32_t end = start + n;
    while (start < end) {
        uint32_t w = start / 64, b = start % 64, k = PD_MIN(64 - b, end - start);
        uint64_t m = (k == 64 ? ~UINT64_C(0) : ((UINT64_C(1) << k) - 1)) << b;
        PD_ASSERT((p->words[w] & m) == m);
        p->words[w] &= ~m;
        if (p->words[w] == 0) p->sum[w / 64] &= ~(UINT64_C(1) << (w % 64));
        start += k;
    }
    p->free_count -= n;
}

/* Takes the n lowest free units (free_count >= n), in increasing order. */
static void take_lowest(pd_pool *p, uint32_t n, uint32_t *out) {
    uint32_t got = 0, w = lowest_free_word(p);
    for (;;) {
        uint64_t x = p->words[w];
        while (x != 0 && got < n) {
            out[got++] = w * 64 + (uint32_t)__builtin_ctzll(x);
            x &= x - 1;
        }
        p->words[w] = x;
        if (x == 0) p->sum[w / 64] &= ~(UINT64_C(1) << (w % 64));
        if (got == n) break;
        w = next_free_word(p, w + 1, p->n_words);
        PD_ASSERT(w < p->n_words);
    }
    p->free_count -= n;
}

pd_err pd_pool_alloc_n(pd_pool *pool, uint32_t n, uint32_t *out) {
    PD_ASSERT(pool);
    if (n == 0) return PD_OK;
    PD_ASSERT(out);
    if (pool->free_count < n) return PD_ERR_NOMEM;
    uint32_t start = n > 1 ? find_run(pool, n) : PD_POOL_NONE;
    if (start != PD_POOL_NONE) take_run(pool, start, n, out);
    else take_lowest(pool, n, out);
    return PD_OK;
}

pd_err pd_pool_free(pd_pool *pool, uint32_t idx) { return pool_free_one(pool, idx); }

/* Why freeing idx[0..n) is refused, the pool unchanged: the first unit out
 * of range or free decides (INVALID, STATE), then a unit listed twice
 * (STATE). */
static pd_err free_refusal(const pd_pool *pool, const uint32_t *idx, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        if (idx[i] >= pool->total) return PD_ERR_INVALID;
        if (pd_pool_is_free(pool, idx[i])) return PD_ERR_STATE;
    }
    return PD_ERR_STATE;
}

/* One pass that checks and frees each unit in turn (a unit listed twice is
 * free by its second turn); a refusal undoes this call's frees and then
 * names the reason as a check of the whole array first would. */
pd_err pd_pool_free_n(pd_pool *pool, const uint32_t *idx, uint32_t n) {
    PD_ASSERT(pool);
    if (n == 0) return PD_OK;
    PD_ASSERT(idx);
    uint32_t u_min = UINT32_MAX;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t u = idx[i];
        if (u >= pool->total || ((pool->words[u / 64] >> (u % 64)) & 1u)) {
            for (uint32_t j = 0; j < i; j++) take_bit(pool, idx[j]);
            return free_refusal(pool, idx, n);
        }
        give_bit(pool, u);
        u_min = PD_MIN(u_min, u);
    }
    run_hint_freed(pool, u_min);
    return PD_OK;
}

bool pd_pool_is_free(const pd_pool *pool, uint32_t idx) { return pool_unit_free(pool, idx); }

uint32_t pd_pool_free_count(const pd_pool *pool) { return pool->free_count; }
uint32_t pd_pool_total(const pd_pool *pool) { return pool->total; }
uint32_t pd_pool_unit_tokens(const pd_pool *pool) { return pool->unit_tokens; }
pd_pool_kind pd_pool_kind_of(const pd_pool *pool) { return pool->kind; }
const char *pd_pool_name(const pd_pool *pool) { return pool->name; }

/* I5 for hint h: every run of free units that starts below run_start[h] is
 * shorter than run_n[h] (words with no free unit are stepped over whole). */
static pd_err verify_run_hint(const pd_pool *pool, uint32_t h, char *msg, size_t msg_cap) {
    uint32_t n = pool->run_n[h], hint_start = pool->run_start[h], start = 0, len = 0;
    if (n == 0) return PD_OK;
    uint64_t end = PD_MIN((uint64_t)pool->total, (uint64_t)hint_start + n);
    for (uint32_t i = 0; i < end; i++) {
        if (i % 64 == 0 && pool->words[i / 64] == 0) {
            len = 0;
            i += 63;
            continue;
        }
        if (!((pool->words[i / 64] >> (i % 64)) & 1u)) {
            len = 0;
            continue;
        }
        if (len++ == 0) start = i;
        if (len >= n && start < hint_start)
            return pd_errorf(msg, msg_cap, PD_ERR_INTERNAL,
                             "pool %s: a run of %u free units at %u, below the run hint %u",
                             pool->name, n, start, hint_start);
    }
    return PD_OK;
}

pd_err pd_pool_verify(const pd_pool *pool, char *msg, size_t msg_cap) {
    uint64_t count = 0;
    for (uint32_t w = 0; w < pool->n_words; w++) {
        uint64_t x = pool->words[w];
        uint32_t valid = PD_MIN(64u, pool->total - w * 64u);
        if (valid < 64 && (x >> valid) != 0)
            return pd_errorf(msg, msg_cap, PD_ERR_INTERNAL,
                             "pool %s: free bits past the end in word %u",
                             pool->name, w);
        count += (uint64_t)__builtin_popcountll(x);
        bool sum_bit = (pool->sum[w / 64] >> (w % 64)) & 1u;
        if (sum_bit != (x != 0))
            return pd_errorf(msg, msg_cap, PD_ERR_INTERNAL,
                             "pool %s: summary bit of word %u is %d, word is %s",
                             pool->name, w, (int)sum_bit, x ? "non-zero" : "zero");
    }
    for (uint32_t s = 0; s < pool->sum_hint && s < pool->n_sum; s++) {
        if (pool->sum[s] != 0)
            return pd_errorf(msg, msg_cap, PD_ERR_INTERNAL,
                             "pool %s: summary word %u below the hint %u is non-zero",
                             pool->name, s, pool->sum_hint);
    }
    if (count != pool->free_count)
        return pd_errorf(msg, msg_cap, PD_ERR_INTERNAL,
                         "pool %s: counter says %u free, bitmap says %llu",
                         pool->name, pool->free_count, (unsigned long long)count);
    for (uint32_t h = 0; h < RUN_HINTS; h++) {
        pd_err err = verify_run_hint(pool, h, msg, msg_cap);
        if (err != PD_OK) return err;
    }
    return PD_OK;
}

uint32_t pd_index_runs(const uint32_t *idx, uint32_t n) {
    if (n == 0) return 0;
    uint32_t runs = 1;
    for (uint32_t i = 1; i < n; i++)
        if (idx[i] != idx[i - 1] + 1) runs++;
    return runs;
}
