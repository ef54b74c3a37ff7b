/*
 * cache.c — the radix prefix cache. The model and its invariants (C1..C4,
 * ownership, recency) are described in include/pdserve/cache.h; this file
 * adds the representation:
 *
 *   nodes    a fixed arena; node 0 is the root (no pages, never evicted).
 *            Free nodes are a pd_list through their sibling link.
 *   entries  one per cached page position: the page's tokens, its device
 *            page, its host page, and the next entry of the same node. A
 *            node's pages are a chain of entries, so a split is a pointer
 *            cut and never copies tokens. Free entries are a chain too, and
 *            a released node's chain goes back onto it whole: entries leave
 *            and return in order, so a chain is almost always a run of
 *            consecutive entries, which the walks bet on (ent_step).
 *   children the base's pd_index keyed by (parent, first page's tokens) ->
 *            child, plus a list of children per node (pd_list through the
 *            sibling link) for iteration. Each node also keeps its hot
 *            child, the one a lookup found last, and a lookup compares its
 *            first page before hashing: a path walked again (an insert after
 *            its match, the next turn of a conversation) hashes nothing.
 *   lists    three LRU lists (device, host, snapshot), pd_lists threaded
 *            through the nodes; see the header for their ordering rule.
 *   locks    path-compressed (issue 13): locks[n] counts the locks taken on
 *            n itself, and lock_ref(n) = locks[n] + the number of n's
 *            children with lock_ref > 0. A node is locked (lock_ref > 0)
 *            exactly when a lock is held on it or below it, as if every lock
 *            counted on every node up to the root, but a lock or unlock
 *            walks up only while a node's lock state changes: it stops at
 *            the first node that was locked already (or stays locked), not
 *            at the root. The locks covering a node, what the inspection
 *            reports as lock_ref, are summed by pd_cache_walk.
 *
 * Sizes: entries_max = kv pages + host pages (every entry holds at least one
 * of them), nodes_max = entries_max + 1, the child index for nodes_max
 * entries. Only the inspection functions (walk) allocate.
 *
 * Ledger transitions inside the cache are asserted: a refusal means the
 * caller handed over a unit it did not own, or the cache's own bookkeeping is
 * broken — both corrupt ownership, so the process stops with the ledger's
 * message rather than continue.
 */
#include "pdserve/cache.h"
#include "pdserve/index.h"
#include "pdserve/list.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

enum { L_DEV = 0, L_HOST = 1, L_MAMBA = 2, L__COUNT = 3 };
enum { R_KV = 0, R_HOST = 1, R_MAMBA = 2, R__COUNT = 3 };

/* What a match or an insert reads of each node on its path comes first, in
 * the node's first 64 bytes; list links, stamps and counts follow. */
typedef struct cnode {
    uint64_t key_hash;
    uint32_t parent;
    uint32_t hot_child; /* a child of this node, or PD_NONE: tried before hashing */
    uint32_t first_ent, n_pages;
    uint32_t end_pages; /* depth in pages at the node's end */
    uint32_t lock_ref;
    uint32_t mamba_slot;
    uint32_t loading; /* ticket index, or PD_NONE */
    bool live, on_dev, on_host;
    bool in_list[L__COUNT];
    uint32_t last_ent;
    uint32_t n_dev_children;
    uint32_t mamba_lock;
    pd_list kids; /* its children, newest first */
    pd_link sib;  /* in its parent's kids, or in the free nodes */
    pd_link lru[L__COUNT];
    uint64_t lstamp[L__COUNT];
} cnode;

/* Two cache lines, the first holding what the walks read (arrays_alloc
 * aligns the arena). */
_Static_assert(sizeof(cnode) % 64 == 0 && offsetof(cnode, last_ent) <= 64,
               "cnode: the walks' fields outgrew the first cache line");

typedef struct ticket {
    bool used;
    pd_owner owner;
    uint32_t node;      /* deepest node being loaded */
    uint32_t n_pages;
} ticket;

struct pd_cache {
    pd_cache_config cfg;
    pd_ledger *ledger;
    int pool_id[R__COUNT];         /* -1 when absent */
    uint32_t page_size;

    cnode *nodes;
    pd_list node_free;
    uint32_t nodes_max, nodes_live;

    int32_t *ent_tokens;           /* entries_max * page_size */
    uint32_t *ent_dev, *ent_host, *ent_next;
    uint32_t entries_max, ent_free, ents_live;

    pd_index children; /* child_key(parent, first page) -> node */

    pd_list lists[L__COUNT];
    ticket *tickets;
    uint32_t loads_max, loads_live;

    uint64_t sum_evict[R__COUNT], sum_prot[R__COUNT];
    uint64_t clock;
    /* Where the last match of a prompt of this class (probe_slot) searched
     * the child index: what pd_cache_match_guess guesses from. Only a hint:
     * any value is safe. */
    uint32_t probe_hint[64];
    pd_cache_stats stats;

    uint32_t *scratch_a, *scratch_b; /* entries_max each */
    uint32_t *stack;                 /* nodes_max */
    uint32_t *locks;                 /* nodes_max: locks taken on each node itself */
    uint32_t *pos_of;                /* nodes_max, pd_cache_verify only */
};

/* ---- small helpers ------------------------------------------------------- */

#define LEDGER_MUST(c, expr)                                                  \
    do {                                                                      \
        pd_err e_ = (expr);                                                   \
        PD_ASSERTF(e_ == PD_OK, "ledger refused (%s): %s", pd_err_name(e_),   \
                   pd_ledger_last_error((c)->ledger));                        \
    } while (0)

static inline cnode *N(pd_cache *c, uint32_t id) {
    PD_ASSERT(id < c->nodes_max);
    return &c->nodes[id];
}

/* The records of list l (an LRU list), and of the sibling lists. */
static inline pd_links lru_links(pd_cache *c, int l) {
    return (pd_links){.base = c->nodes,
                      .stride = sizeof(cnode),
                      .offset = offsetof(cnode, lru) + (size_t)l * sizeof(pd_link)};
}

static inline pd_links sib_links(pd_cache *c) { return PD_LINKS(c->nodes, cnode, sib); }

static inline const int32_t *ent_tok(const pd_cache *c, uint32_t e) {
    return c->ent_tokens + (size_t)e * c->page_size;
}

/* Whether n tokens at a and b are equal. A page matches whole or not at
 * all, so it is compared 8 tokens at a time with one branch per 8 and no
 * early exit inside: two 128-bit compares on x86-64 (SSE2 is part of its
 * base instruction set, so the compare inlines with no run-time check and
 * no call); elsewhere, and for a tail shorter than 8, an OR of XORs. */
static inline bool tokens_eq(const int32_t *a, const int32_t *b, uint32_t n) {
    uint32_t i = 0;
#if defined(__SSE2__)
    if (n == 16) {
        /* The usual page (the realistic trace's and bench/sched's): four
         * compares and no loop, about half the instructions of the loop
         * below, which a walk pays once per node (issue 13). */
        __m128i x0 = _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)(const void *)a),
                                     _mm_loadu_si128((const __m128i *)(const void *)b));
        __m128i x1 = _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)(const void *)(a + 4)),
                                     _mm_loadu_si128((const __m128i *)(const void *)(b + 4)));
        __m128i x2 = _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)(const void *)(a + 8)),
                                     _mm_loadu_si128((const __m128i *)(const void *)(b + 8)));
        __m128i x3 = _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)(const void *)(a + 12)),
                                     _mm_loadu_si128((const __m128i *)(const void *)(b + 12)));
        __m128i all = _mm_and_si128(_mm_and_si128(x0, x1), _mm_and_si128(x2, x3));
        return _mm_movemask_epi8(all) == 0xFFFF;
    }
    for (; i + 8 <= n; i += 8) {
        __m128i lo = _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)(const void *)(a + i)),
                                     _mm_loadu_si128((const __m128i *)(const void *)(b + i)));
        __m128i hi = _mm_cmpeq_epi32(_mm_loadu_si128((const __m128i *)(const void *)(a + i + 4)),
                                     _mm_loadu_si128((const __m128i *)(const void *)(b + i + 4)));
        if (_mm_movemask_epi8(_mm_and_si128(lo, hi)) != 0xFFFF) return false;
    }
#endif
    uint32_t diff = 0;
    for (; i < n; i++) diff |= (uint32_t)a[i] ^ (uint32_t)b[i];
    return diff == 0;
}

static inline bool page_eq(const pd_cache *c, uint32_t e, const int32_t *tokens) {
    return tokens_eq(ent_tok(c, e), tokens, c->page_size);
}

/* The children index's key of (parent, first page). It only spreads the
 * index's slots (a lookup compares parent and page), so it need not be the
 * base's token hash: a page is hashed 64 bits at a time, one multiply per
 * two tokens and one full mix at the end, a quarter of pd_hash_tokens'
 * instructions (issue 13: a match misses the hot child about twice). */
static inline uint64_t child_key_n(uint32_t parent, const int32_t *first_page, uint32_t n) {
    uint32_t i = 0;
    uint64_t h = (0x5EEDull + parent) * 0x9E3779B97F4A7C15ull ^ n;
    for (; i + 2 <= n; i += 2) {
        uint64_t v;
        memcpy(&v, first_page + i, sizeof v);
        h = (h ^ v) * 0xBF58476D1CE4E5B9ull;
        h ^= h >> 31;
    }
    if (i < n) h = (h ^ (uint32_t)first_page[i]) * 0xBF58476D1CE4E5B9ull;
    return pd_hash_u64(h);
}

/* child_key_n with the usual 16-token page a constant, as match_chain does
 * for its walk: the loop unrolls into eight rounds with no counter or exit
 * test, about half the instructions of a key (issue 13: a match that goes
 * on past the cache hashes its next page, and so does the insert at the
 * request's retire). The same key either way. */
static inline uint64_t child_key(const pd_cache *c, uint32_t parent, const int32_t *first_page) {
    if (c->page_size == 16) return child_key_n(parent, first_page, 16);
    return child_key_n(parent, first_page, c->page_size);
}

/* A prompt's slot in probe_hint (tokens holds a page at least): its first
 * page's first and last tokens, hashed. The last as well, since prompts
 * that begin with the same token (a BOS) differ in their system prompts. */
static inline uint32_t probe_slot(const pd_cache *c, const int32_t *tokens) {
    uint64_t k = (uint32_t)tokens[0] | (uint64_t)(uint32_t)tokens[c->page_size - 1] << 32;
    return (uint32_t)pd_hash_u64(k) & 63u;
}

static pd_unit_state lock_state(uint32_t lock) {
    return lock > 0 ? PD_UNIT_CACHE_PROTECTED : PD_UNIT_CACHE_EVICTABLE;
}

static void sums_add(pd_cache *c, int r, pd_unit_state st, int64_t n) {
    if (st == PD_UNIT_CACHE_EVICTABLE)
        c->sum_evict[r] = (uint64_t)((int64_t)c->sum_evict[r] + n);
    else if (st == PD_UNIT_CACHE_PROTECTED)
        c->sum_prot[r] = (uint64_t)((int64_t)c->sum_prot[r] + n);
}

/* Ledger move of n units of resource r, keeping the cache's sums. */
static void units_move(pd_cache *c, int r, const uint32_t *u, uint32_t n,
                       pd_unit_state from, pd_owner from_owner,
                       pd_unit_state to, pd_owner to_owner) {
    if (n == 0 || (from == to && from_owner == to_owner)) return;
    LEDGER_MUST(c, pd_ledger_move(c->ledger, c->pool_id[r], u, n, from,
                                  from_owner, to, to_owner));
    sums_add(c, r, from, -(int64_t)n);
    sums_add(c, r, to, (int64_t)n);
}

static void units_free(pd_cache *c, int r, const uint32_t *u, uint32_t n,
                       pd_unit_state from, pd_owner from_owner) {
    if (n == 0) return;
    LEDGER_MUST(c, pd_ledger_free(c->ledger, c->pool_id[r], u, n, from, from_owner));
    sums_add(c, r, from, -(int64_t)n);
}

/* The entry after e in its chain. Entries are taken from the free list in
 * order and a released node's chain goes back onto it whole, so a chain is
 * almost always a run of consecutive entries: the walk goes on at e + 1 at
 * once and the load of ent_next only confirms it through a predicted branch,
 * instead of every step of a long node waiting for the previous step's load.
 * The rare jump is a call so that the compiler cannot turn the branch into a
 * conditional move, which would wait for the load again. */
#if defined(__GNUC__)
#define COLD_CALL __attribute__((noinline, cold))
#else
#define COLD_CALL
#endif

static COLD_CALL uint32_t ent_jump(const pd_cache *c, uint32_t e) { return c->ent_next[e]; }

static inline uint32_t ent_step(const pd_cache *c, uint32_t e) {
    if (c->ent_next[e] != e + 1) return ent_jump(c, e);
    return e + 1;
}

/* The walks over one node's chain count its n_pages entries rather than
 * follow it to its end: the end (PD_NONE) is never e + 1, so every node's
 * last step would take ent_step's rare jump, and a chain of one-page nodes
 * (a system prompt split where prompts ended inside it) is all last steps
 * (issue 13). The chain holds exactly n_pages entries (pd_cache_verify). */

/* Gathers a node's device (or host) pages into buf, in position order. */
static uint32_t node_pages(pd_cache *c, uint32_t id, bool host, uint32_t *buf) {
    const cnode *nd = N(c, id);
    uint32_t n = nd->n_pages, e = nd->first_ent;
    for (uint32_t i = 0; i < n; i++) {
        if (i > 0) e = ent_step(c, e);
        buf[i] = host ? c->ent_host[e] : c->ent_dev[e];
    }
    PD_ASSERT(n == 0 || e == nd->last_ent);
    return n;
}

static void node_set_pages(pd_cache *c, uint32_t id, bool host, const uint32_t *buf) {
    const cnode *nd = N(c, id);
    uint32_t e = nd->first_ent;
    for (uint32_t i = 0; i < nd->n_pages; i++) {
        if (i > 0) e = ent_step(c, e);
        if (host) c->ent_host[e] = buf ? buf[i] : PD_NONE;
        else c->ent_dev[e] = buf ? buf[i] : PD_NONE;
    }
}

/* ---- LRU lists ----------------------------------------------------------- */

static void list_remove(pd_cache *c, int l, uint32_t id) {
    cnode *n = N(c, id);
    PD_ASSERT(n->in_list[l]);
    pd_list_remove(&c->lists[l], lru_links(c, l), id);
    n->in_list[l] = false;
}

static void list_push_tail(pd_cache *c, int l, uint32_t id) {
    cnode *n = N(c, id);
    PD_ASSERT(!n->in_list[l]);
    pd_list_push_back(&c->lists[l], lru_links(c, l), id);
    n->in_list[l] = true;
    n->lstamp[l] = c->clock;
}

static void list_insert_after(pd_cache *c, int l, uint32_t after, uint32_t id) {
    cnode *a = N(c, after), *n = N(c, id);
    PD_ASSERT(a->in_list[l] && !n->in_list[l]);
    pd_list_insert_after(&c->lists[l], lru_links(c, l), after, id);
    n->in_list[l] = true;
    n->lstamp[l] = a->lstamp[l];
}

/* Moves the run first..last of list l (consecutive in it, first nearer the
 * head) to its tail in one relinking: what list_to_tail of each of its nodes
 * in turn does, stamps aside; the links inside the run stay as they are.
 * list_to_tail is the run of one node. */
static inline void run_to_tail(pd_cache *c, int l, uint32_t first, uint32_t last) {
    pd_list *ls = &c->lists[l];
    if (ls->tail == last) return; /* already last: the same as out and back */
    pd_link *f = &c->nodes[first].lru[l], *z = &c->nodes[last].lru[l];
    PD_ASSERT(z->next != PD_NONE && c->nodes[z->next].lru[l].prev == last);
    PD_ASSERT(f->prev != PD_NONE ? c->nodes[f->prev].lru[l].next == first : ls->head == first);
    c->nodes[z->next].lru[l].prev = f->prev;
    if (f->prev != PD_NONE) c->nodes[f->prev].lru[l].next = z->next;
    else ls->head = z->next;
    c->nodes[ls->tail].lru[l].next = first;
    f->prev = ls->tail;
    z->next = PD_NONE;
    ls->tail = last;
}

/* Moves node id to the tail of list l (it is in it) with the current stamp:
 * what list_remove then list_push_tail do, in one relinking (the walks up a
 * path move every node on it, issue 13). Inline into those walks: about
 * 150 calls a step pair at 256 live, each paying a call's overhead before. */
static inline void list_to_tail(pd_cache *c, int l, uint32_t id) {
    PD_ASSERT(N(c, id)->in_list[l]);
    N(c, id)->lstamp[l] = c->clock;
    run_to_tail(c, l, id, id);
}

/* Brings list membership in line with the node's state. */
static void relist(pd_cache *c, uint32_t id) {
    cnode *n = N(c, id);
    bool want[L__COUNT] = {
        [L_DEV] = n->on_dev && n->lock_ref == 0,
        [L_HOST] = n->on_host && n->lock_ref == 0,
        [L_MAMBA] = n->mamba_slot != PD_NONE && n->mamba_lock == 0,
    };
    for (int l = 0; l < L__COUNT; l++) {
        if (want[l] && !n->in_list[l]) list_push_tail(c, l, id);
        else if (!want[l] && n->in_list[l]) list_remove(c, l, id);
    }
}

typedef struct touch_run {
    uint32_t first, last; /* PD_NONE: none yet */
} touch_run;

/* touch_runs' step for node id, in list l: stamped, and its run extended
 * when it follows the run's last node in the list, else the run moved and a
 * new one started at it. */
static inline void touch_in(pd_cache *c, int l, cnode *n, uint32_t id, touch_run *r) {
    n->lstamp[l] = c->clock;
    if (r->first != PD_NONE) {
        if (n->lru[l].prev == r->last) {
            r->last = id;
            return;
        }
        run_to_tail(c, l, r->first, r->last);
    }
    r->first = r->last = id;
}

/* Moves the path node..root to the list tails, deepest first, so that every
 * node stays behind its descendants. The path's snapshot-listed nodes
 * usually lie in the snapshot list already in that order, one after the
 * other (the previous touch of the same prefix put them there: about six a
 * walk at 256 live in bench/sched, the split system prompts' nodes, which
 * stay locked and so in no other list; issue 13), so the walk collects them
 * into runs, consecutive in the list and on the path, and moves a run to
 * the tail in one relinking when the next node does not extend it: the list
 * ends as moving each node in turn would leave it. The device and host
 * lists, where a path has few nodes (its unlocked leaves), move node by
 * node. */
static void touch_runs(pd_cache *c, uint32_t id, bool no_snapshots) {
    touch_run mamba = {PD_NONE, PD_NONE};
    while (id != PD_CNODE_ROOT && id != PD_NONE) {
        cnode *n = N(c, id);
        if (no_snapshots && n->lock_ref > 0) break;
        if (n->in_list[L_DEV]) list_to_tail(c, L_DEV, id);
        if (n->in_list[L_HOST]) list_to_tail(c, L_HOST, id);
        if (n->in_list[L_MAMBA]) touch_in(c, L_MAMBA, n, id, &mamba);
        id = n->parent;
    }
    if (mamba.first != PD_NONE) run_to_tail(c, L_MAMBA, mamba.first, mamba.last);
}

/* touch_runs with its first test inline in the callers (the match, the
 * insert): a walk with nothing to move costs no call. */
static inline void touch_path(pd_cache *c, uint32_t id) {
    /* A locked node's ancestors are locked too (C4), and a locked node is in
     * neither the device nor the host list: with no snapshot in the third
     * list, the walk has nothing left to move from the first locked node. */
    bool no_snapshots = c->lists[L_MAMBA].len == 0;
    if (id == PD_CNODE_ROOT || id == PD_NONE || (no_snapshots && N(c, id)->lock_ref > 0)) return;
    touch_runs(c, id, no_snapshots);
}

/* ---- hash table of children ---------------------------------------------- */

/* The children index's hash of node id (the key it was inserted under). */
static uint64_t child_hash_of(const void *ctx, uint32_t id) {
    return ((const pd_cache *)ctx)->nodes[id].key_hash;
}

static uint32_t ht_find(const pd_cache *c, uint32_t parent, const int32_t *first_page, uint64_t h) {
    pd_index_probe p;
    for (uint32_t id = pd_index_first(&c->children, h, &p); id != PD_NONE;
         id = pd_index_next(&c->children, &p)) {
        const cnode *n = &c->nodes[id];
        if (n->key_hash == h && n->parent == parent && page_eq(c, n->first_ent, first_page))
            return id;
    }
    return PD_NONE;
}

static uint32_t ht_lookup(const pd_cache *c, uint32_t parent, const int32_t *first_page) {
    return ht_find(c, parent, first_page, child_key(c, parent, first_page));
}

/* A parent with this many children or fewer is searched child by child
 * rather than through the table: the root of bench/sched's caches has four
 * (its system prompts), and the hot child missed there three times in four
 * (issue 13); comparing the other three first pages costs less than the
 * page's hash and a probe. */
enum { KIDS_SCAN_MAX = 4 };

/* child_find's search past the hot child, whose result becomes the parent's
 * hot child: the children in turn when they are few, else the table (and
 * *h receives the page's child key; otherwise it is left alone). */
static uint32_t child_find_table(pd_cache *c, uint32_t parent, const int32_t *first_page,
                                 uint64_t *h) {
    cnode *p = N(c, parent);
    if (p->kids.len <= KIDS_SCAN_MAX) {
        for (uint32_t ch = p->kids.head; ch != PD_NONE; ch = c->nodes[ch].sib.next) {
            if (ch == p->hot_child || !page_eq(c, c->nodes[ch].first_ent, first_page)) continue;
            p->hot_child = ch;
            return ch;
        }
        return PD_NONE;
    }
    *h = child_key(c, parent, first_page);
    uint32_t id = ht_find(c, parent, first_page, *h);
    if (id != PD_NONE) p->hot_child = id;
    return id;
}

/* The child of parent whose first page is first_page, or PD_NONE. The
 * parent's hot child (the one found last) is tried first: siblings differ in
 * their first page, so a hit is the child the table would find, without
 * hashing. When the table was searched *h receives the page's child key
 * (for an insert; left alone otherwise). The hot child's compare inlines
 * into the walks; the rest is a call. */
static inline uint32_t child_find(pd_cache *c, uint32_t parent, const int32_t *first_page,
                                  uint64_t *h) {
    uint32_t hot = N(c, parent)->hot_child;
    if (hot != PD_NONE && page_eq(c, c->nodes[hot].first_ent, first_page)) return hot;
    return child_find_table(c, parent, first_page, h);
}

static void ht_insert_hashed(pd_cache *c, uint32_t id, uint64_t h) {
    N(c, id)->key_hash = h;
    pd_index_insert(&c->children, h, id);
}

static void ht_insert(pd_cache *c, uint32_t id) {
    cnode *n = N(c, id);
    ht_insert_hashed(c, id, child_key(c, n->parent, ent_tok(c, n->first_ent)));
}

static void ht_remove(pd_cache *c, uint32_t id) {
    pd_index_remove(&c->children, N(c, id)->key_hash, id);
}

/* ---- node and entry arenas ----------------------------------------------- */

static uint32_t node_alloc(pd_cache *c) {
    uint32_t id = c->node_free.head;
    PD_ASSERTF(id != PD_NONE, "node arena exhausted (%u nodes)", c->nodes_max);
    pd_list_remove(&c->node_free, sib_links(c), id);
    cnode *n = N(c, id);
    memset(n, 0, sizeof(*n));
    n->parent = PD_NONE;
    pd_list_init(&n->kids);
    pd_link_init(&n->sib);
    n->first_ent = n->last_ent = PD_NONE;
    n->mamba_slot = PD_NONE;
    n->loading = PD_NONE;
    n->hot_child = PD_NONE;
    for (int l = 0; l < L__COUNT; l++) pd_link_init(&n->lru[l]);
    n->live = true;
    c->locks[id] = 0;
    c->nodes_live++;
    return id;
}

static void node_release(pd_cache *c, uint32_t id) {
    cnode *n = N(c, id);
    PD_ASSERT(n->live && id != PD_CNODE_ROOT);
    /* Give the entries back: the chain goes onto the free list whole and in
     * order, so the next node to take them gets them in the same order. */
    PD_ASSERT(n->first_ent != PD_NONE && c->ent_next[n->last_ent] == PD_NONE);
    c->ent_next[n->last_ent] = c->ent_free;
    c->ent_free = n->first_ent;
    PD_ASSERT(c->ents_live >= n->n_pages);
    c->ents_live -= n->n_pages;
    n->live = false;
    pd_list_push_front(&c->node_free, sib_links(c), id);
    c->nodes_live--;
}

static uint32_t entry_alloc(pd_cache *c, const int32_t *tokens) {
    uint32_t e = c->ent_free;
    PD_ASSERTF(e != PD_NONE, "entry arena exhausted (%u entries)", c->entries_max);
    c->ent_free = c->ent_next[e];
    c->ent_next[e] = PD_NONE;
    c->ent_dev[e] = c->ent_host[e] = PD_NONE;
    int32_t *dst = c->ent_tokens + (size_t)e * c->page_size;
    /* The usual 16-token page as a copy of constant size, which the
     * compiler inlines (four 16-byte moves) instead of calling memcpy: an
     * insert copies every new page (issue 13). */
    if (c->page_size == 16) memcpy(dst, tokens, 16 * sizeof(int32_t));
    else memcpy(dst, tokens, c->page_size * sizeof(int32_t));
    c->ents_live++;
    return e;
}

static void child_link(pd_cache *c, uint32_t parent, uint32_t id) {
    cnode *p = N(c, parent), *n = N(c, id);
    n->parent = parent;
    pd_list_push_front(&p->kids, sib_links(c), id);
    if (n->on_dev) p->n_dev_children++;
}

static void child_unlink(pd_cache *c, uint32_t id) {
    cnode *n = N(c, id), *p = N(c, n->parent);
    pd_list_remove(&p->kids, sib_links(c), id);
    if (p->hot_child == id) p->hot_child = PD_NONE;
    if (n->on_dev) {
        PD_ASSERT(p->n_dev_children > 0);
        p->n_dev_children--;
    }
}

/* Splits node id after k pages: a new node P takes the first k pages and
 * takes id's place under its parent; id keeps the rest (and its identity,
 * its snapshot and its children), so handles held by requests stay valid. */
static uint32_t split(pd_cache *c, uint32_t id, uint32_t k) {
    cnode *n = N(c, id);
    PD_ASSERT(k >= 1 && k < n->n_pages);
    uint32_t pid = node_alloc(c);
    cnode *p = N(c, pid);
    n = N(c, id);

    uint32_t e = n->first_ent;
    for (uint32_t i = 1; i < k; i++) e = c->ent_next[e];
    p->first_ent = n->first_ent;
    p->last_ent = e;
    n->first_ent = c->ent_next[e];
    c->ent_next[e] = PD_NONE;
    p->n_pages = k;
    n->n_pages -= k;
    p->end_pages = n->end_pages - n->n_pages;

    p->on_dev = n->on_dev;
    p->on_host = n->on_host;
    p->loading = n->loading;
    /* No lock is taken on P itself; its one child, id, is locked or not. */
    p->lock_ref = n->lock_ref > 0 ? 1 : 0;
    c->locks[pid] = 0;
    for (int l = 0; l < L__COUNT; l++) p->lstamp[l] = n->lstamp[l];

    /* P takes id's key in the child table (same parent, same first page). */
    ht_remove(c, id);
    p->key_hash = n->key_hash;
    p->parent = n->parent;
    pd_index_insert(&c->children, p->key_hash, pid);

    /* Among its parent's children, P takes id's place; id is P's one child. */
    pd_list *siblings = &N(c, n->parent)->kids;
    pd_list_insert_after(siblings, sib_links(c), n->sib.prev, pid);
    pd_list_remove(siblings, sib_links(c), id);
    if (N(c, p->parent)->hot_child == id) N(c, p->parent)->hot_child = pid;
    p->hot_child = id;
    n->parent = pid;
    pd_list_push_back(&p->kids, sib_links(c), id);
    p->n_dev_children = n->on_dev ? 1 : 0;
    ht_insert(c, id);

    /* Right after id in every list id is in: behind its descendant. */
    for (int l = 0; l < L__COUNT; l++)
        if (l != L_MAMBA && n->in_list[l]) list_insert_after(c, l, id, pid);
    return pid;
}

/* A match is usually the first to read its prompt, and the cache's pages are
 * cold too: the walk prefetches both this many pages ahead (the entry as if
 * the chain were a run, which it almost always is; a wrong guess costs only
 * a useless prefetch). Measured on bench/radix's realistic trace: about 5 %
 * less CPU per request than no prefetch, 8 pages ahead about half of that. */
enum { PREFETCH_PAGES = 32 };

/* Number of leading pages of node id equal to tokens[0..avail pages), where
 * avail >= 1 and the first page is known equal: id is what child_find
 * returned for it, and child_find compares that page before it returns a
 * child (the hot one or the table's). Comparing it again cost a walk down a
 * chain of one-page nodes (a system prompt split wherever prompts ended
 * inside it) a second compare per node (issue 13). With dev non-NULL the
 * device page of each matching position is written to dev[k] on the way (a
 * match on a device node wants them: one walk, not two). */
static uint32_t match_pages(pd_cache *c, uint32_t id, const int32_t *tokens, uint32_t avail,
                            uint32_t *dev) {
    const cnode *nd = N(c, id);
    uint32_t k = 0, lim = PD_MIN(avail, nd->n_pages);
    for (uint32_t e = nd->first_ent; k < lim; k++) {
        if (k > 0) e = ent_step(c, e);
        if (k + PREFETCH_PAGES < avail) {
            __builtin_prefetch(tokens + (size_t)(k + PREFETCH_PAGES) * c->page_size);
            if (e + PREFETCH_PAGES < c->entries_max)
                __builtin_prefetch(ent_tok(c, e + PREFETCH_PAGES));
        }
        if (k > 0 && !page_eq(c, e, tokens + (size_t)k * c->page_size)) break;
        if (dev) dev[k] = c->ent_dev[e];
    }
    return k;
}

/* Like match_pages (the first page known equal) for a device node being
 * inserted over: each matching
 * position's caller page that differs from the cache's is a duplicate,
 * written to dup_out, and the cache's page replaces it in pages[]. */
static uint32_t match_dups(pd_cache *c, uint32_t id, const int32_t *tokens, uint32_t avail,
                           uint32_t *pages, uint32_t *dup_out, uint32_t *dup_pages) {
    const cnode *nd = N(c, id);
    uint32_t k = 0, lim = PD_MIN(avail, nd->n_pages);
    for (uint32_t e = nd->first_ent; k < lim; k++) {
        if (k > 0) e = ent_step(c, e);
        if (k > 0 && !page_eq(c, e, tokens + (size_t)k * c->page_size)) break;
        uint32_t mine = c->ent_dev[e];
        if (pages[k] != mine) {
            dup_out[(*dup_pages)++] = pages[k];
            pages[k] = mine;
        }
    }
    return k;
}

/* ---- create / destroy ---------------------------------------------------- */

/* The pools cfg names exist and are of the right kinds; the page size and
 * entries_max (kv pages + host pages) they imply. */
static pd_err config_check(const pd_cache_config *cfg, uint32_t *page_size,
                           uint64_t *entries) {
    pd_ledger *l = cfg->ledger;
    int npools = pd_ledger_pool_count(l);
    if (cfg->kv_pool < 0 || cfg->kv_pool >= npools) return PD_ERR_INVALID;
    if (cfg->mamba_pool >= npools || cfg->host_pool >= npools) return PD_ERR_INVALID;
    pd_pool *kv = pd_ledger_pool(l, cfg->kv_pool);
    if (pd_pool_kind_of(kv) != PD_POOL_KV) return PD_ERR_INVALID;
    *page_size = pd_pool_unit_tokens(kv);
    *entries = pd_pool_total(kv);
    if (cfg->host_pool >= 0) {
        pd_pool *hp = pd_ledger_pool(l, cfg->host_pool);
        if (pd_pool_kind_of(hp) != PD_POOL_HOST || pd_pool_unit_tokens(hp) != *page_size)
            return PD_ERR_INVALID;
        *entries += pd_pool_total(hp);
    }
    if (cfg->mamba_pool >= 0 &&
        pd_pool_kind_of(pd_ledger_pool(l, cfg->mamba_pool)) != PD_POOL_MAMBA)
        return PD_ERR_INVALID;
    if (*entries + 1 >= UINT32_MAX / 4) return PD_ERR_INVALID;
    return PD_OK;
}

/* Every array, sized once from entries_max and nodes_max; false if any
 * allocation failed (pd_cache_destroy frees the rest). */
static bool arrays_alloc(pd_cache *c) {
    /* Cache-line aligned, so that each node's first 64 bytes (what a walk
     * reads) are one line: calloc's 16-byte alignment split them in two. */
    size_t nodes_bytes = (size_t)c->nodes_max * sizeof(cnode);
    c->nodes = aligned_alloc(64, nodes_bytes);
    if (c->nodes) memset(c->nodes, 0, nodes_bytes);
    /* The token arena too: a 16-token page is then exactly one line, where
     * calloc's 16-byte alignment spread three pages in four over two, so a
     * compare read two cold lines and an insert's copy dirtied two. */
    size_t tok_bytes = (size_t)c->entries_max * c->page_size * sizeof(int32_t);
    tok_bytes = (tok_bytes + 63) & ~(size_t)63; /* aligned_alloc's size: a multiple */
    c->ent_tokens = aligned_alloc(64, tok_bytes);
    if (c->ent_tokens) memset(c->ent_tokens, 0, tok_bytes);
    c->ent_dev = calloc(c->entries_max, sizeof(uint32_t));
    c->ent_host = calloc(c->entries_max, sizeof(uint32_t));
    c->ent_next = calloc(c->entries_max, sizeof(uint32_t));
    c->tickets = calloc(c->loads_max, sizeof(ticket));
    c->scratch_a = calloc(c->entries_max, sizeof(uint32_t));
    c->scratch_b = calloc(c->entries_max, sizeof(uint32_t));
    c->stack = calloc(c->nodes_max, sizeof(uint32_t));
    c->locks = calloc(c->nodes_max, sizeof(uint32_t));
    c->pos_of = calloc(c->nodes_max, sizeof(uint32_t));
    return c->pos_of && c->nodes && c->ent_tokens && c->ent_dev && c->ent_host && c->ent_next &&
        c->tickets && c->scratch_a && c->scratch_b && c->stack && c->locks;
}

/* An empty cache: the hash table empty, every entry and node on its free
 * chain, the lists empty, and the root alone. */
static void empty_init(pd_cache *c) {
    for (uint32_t e = 0; e < c->entries_max; e++)
        c->ent_next[e] = e + 1 < c->entries_max ? e + 1 : PD_NONE;
    c->ent_free = 0;
    pd_list_init(&c->node_free);
    for (uint32_t i = 1; i < c->nodes_max; i++) pd_list_push_back(&c->node_free, sib_links(c), i);
    for (int li = 0; li < L__COUNT; li++) pd_list_init(&c->lists[li]);

    cnode *root = &c->nodes[PD_CNODE_ROOT];
    root->parent = PD_NONE;
    pd_list_init(&root->kids);
    pd_link_init(&root->sib);
    root->first_ent = root->last_ent = PD_NONE;
    root->hot_child = PD_NONE;
    root->mamba_slot = PD_NONE;
    root->loading = PD_NONE;
    for (int li = 0; li < L__COUNT; li++) pd_link_init(&root->lru[li]);
    root->live = true;
    root->on_dev = true; /* the empty prefix is always usable */
}

pd_err pd_cache_create(pd_cache **out, const pd_cache_config *cfg) {
    if (!out || !cfg || !cfg->ledger) return PD_ERR_INVALID;
    *out = NULL;
    uint32_t page_size;
    uint64_t entries;
    pd_err err = config_check(cfg, &page_size, &entries);
    if (err) return err;

    pd_cache *c = calloc(1, sizeof(*c));
    if (!c) return PD_ERR_NOMEM;
    c->cfg = *cfg;
    c->ledger = cfg->ledger;
    c->pool_id[R_KV] = cfg->kv_pool;
    c->pool_id[R_HOST] = cfg->host_pool;
    c->pool_id[R_MAMBA] = cfg->mamba_pool;
    c->page_size = page_size;
    c->entries_max = (uint32_t)entries;
    c->nodes_max = (uint32_t)entries + 1;
    c->loads_max = cfg->loads_max ? cfg->loads_max : 64;
    if (!arrays_alloc(c) || pd_index_init(&c->children, c->nodes_max, child_hash_of, c) != PD_OK) {
        pd_cache_destroy(c);
        return PD_ERR_NOMEM;
    }
    empty_init(c);
    *out = c;
    return PD_OK;
}

void pd_cache_destroy(pd_cache *c) {
    if (!c) return;
    free(c->nodes);
    free(c->ent_tokens);
    free(c->ent_dev);
    free(c->ent_host);
    free(c->ent_next);
    pd_index_free(&c->children);
    free(c->tickets);
    free(c->scratch_a);
    free(c->scratch_b);
    free(c->stack);
    free(c->locks);
    free(c->pos_of);
    free(c);
}

uint64_t pd_cache_clock(const pd_cache *c) { return c->clock; }

/* ---- match ---------------------------------------------------------------- */

/* The match's walk down a chain of one-page device nodes, each its parent's
 * hot child (a system prompt split wherever prompts ended inside it: most of
 * a match's nodes, issue 13). Such a node is matched whole by the compare of
 * its one page; the walk records its device page and snapshot as the general
 * step would and stops, leaving *node and the returned position where it
 * got to, at the first node that is not one (another child, several pages,
 * host only, a page that differs), which the general step then takes. Only
 * called while every node from the root to *node is on device (so are the
 * chain's, C1). */
static inline uint32_t match_chain_ps(pd_cache *c, const int32_t *tokens, uint32_t q_pages,
                                      uint32_t *pages, uint32_t pos, uint32_t *node,
                                      pd_cache_match_result *m, uint32_t ps) {
    uint32_t at = *node;
    const cnode *cur = N(c, at);
    const int32_t *q = tokens + (size_t)pos * ps;
    for (; pos < q_pages; pos++, q += ps) {
        uint32_t hot = cur->hot_child;
        if (hot == PD_NONE) break;
        const cnode *ch = N(c, hot);
        if (ch->n_pages != 1 || !ch->on_dev || !tokens_eq(ent_tok(c, ch->first_ent), q, ps)) break;
        pages[pos] = c->ent_dev[ch->first_ent];
        if (ch->mamba_slot != PD_NONE) {
            m->mamba_node = hot;
            m->mamba_slot = ch->mamba_slot;
            m->mamba_tokens = ch->end_pages * ps;
        }
        at = hot;
        cur = ch; /* its hot child is the next step's: one bounds check a node */
    }
    if (at != *node) m->dev_node = at;
    *node = at;
    return pos;
}

/* match_chain_ps with the page size a constant when it is the usual 16
 * tokens (the compare and the steps through tokens then take no variable). */
static uint32_t match_chain(pd_cache *c, const int32_t *tokens, uint32_t q_pages, uint32_t *pages,
                            uint32_t pos, uint32_t *node, pd_cache_match_result *m) {
    if (c->page_size == 16) return match_chain_ps(c, tokens, q_pages, pages, pos, node, m, 16);
    return match_chain_ps(c, tokens, q_pages, pages, pos, node, m, c->page_size);
}

pd_err pd_cache_match(pd_cache *c, const int32_t *tokens, uint32_t n_tokens,
                      uint32_t *pages, uint32_t pages_cap, pd_cache_match_result *out) {
    if (!c || !out || (n_tokens > 0 && !tokens)) return PD_ERR_INVALID;
    uint32_t q_pages = n_tokens / c->page_size;
    if (q_pages > 0 && (!pages || pages_cap < q_pages)) return PD_ERR_INVALID;
    c->clock++;

    pd_cache_match_result m = {
        .dev_node = PD_CNODE_ROOT, .host_node = PD_CNODE_ROOT,
        .mamba_node = PD_CNODE_ROOT, .mamba_slot = PD_POOL_NONE,
    };
    uint32_t node = PD_CNODE_ROOT, pos = 0, dev_pages = 0;
    while (pos < q_pages) {
        if (pos == dev_pages) { /* all on device so far: the chain may go on */
            pos = dev_pages = match_chain(c, tokens, q_pages, pages, pos, &node, &m);
            if (pos >= q_pages) break;
        }
        const int32_t *q = tokens + (size_t)pos * c->page_size;
        uint64_t h = 0;
        uint32_t child = child_find(c, node, q, &h);
        if (h != 0) c->probe_hint[probe_slot(c, tokens)] = node; /* the table was searched */
        if (child == PD_NONE) break;
        /* The node is read through one pointer: N()'s bounds check, kept in
         * release builds, is otherwise repeated after every store. */
        const cnode *ch = N(c, child);
        bool on_dev = ch->on_dev; /* a split keeps it */
        /* A one-page node (a split system prompt is a chain of them) is
         * matched whole by child_find's compare of its first page. */
        uint32_t k = 1;
        if (ch->n_pages == 1) {
            if (on_dev) pages[pos] = c->ent_dev[ch->first_ent];
        } else {
            k = match_pages(c, child, q, q_pages - pos, on_dev ? pages + pos : NULL);
        }
        PD_ASSERT(k >= 1);
        bool diverged = k < ch->n_pages;
        if (diverged) {
            child = split(c, child, k);
            ch = N(c, child);
        }
        if (on_dev) {
            PD_ASSERT(pos == dev_pages); /* C1: no device node below host-only */
            dev_pages += k;
            m.dev_node = child;
            if (ch->mamba_slot != PD_NONE) {
                m.mamba_node = child;
                m.mamba_slot = ch->mamba_slot;
                m.mamba_tokens = ch->end_pages * c->page_size;
            }
        } else {
            m.host_node = child;
        }
        pos += k;
        node = child;
        if (diverged) break;
    }
    m.dev_tokens = dev_pages * c->page_size;
    if (m.host_node == PD_CNODE_ROOT) m.host_node = m.dev_node;
    m.host_tokens = pos * c->page_size - m.dev_tokens;
    touch_path(c, node);
    *out = m;
    return PD_OK;
}

/* The child key a search under parent for first_page will look up in the
 * index, or 0 when it will not look there: a parent that is gone, or with
 * so few children that child_find scans them. */
static uint64_t searched_key(const pd_cache *c, uint32_t parent, const int32_t *first_page) {
    const cnode *p = &c->nodes[parent];
    if (!p->live || p->kids.len <= KIDS_SCAN_MAX) return 0;
    return child_key(c, parent, first_page);
}

void pd_cache_match_guess(const pd_cache *c, const int32_t *tokens, uint32_t n_tokens,
                          pd_cache_guess *out) {
    if (!out) return;
    out->key = 0;
    if (!c || !tokens || n_tokens < c->page_size) return;
    uint32_t p = c->probe_hint[probe_slot(c, tokens)];
    if (p >= c->nodes_max) return;
    uint32_t at = c->nodes[p].end_pages * c->page_size;
    if (at + c->page_size <= n_tokens) out->key = searched_key(c, p, tokens + at);
}

void pd_cache_guess_prefetch(const pd_cache *c, pd_cache_guess g) {
    if (c && g.key != 0) pd_index_prefetch(&c->children, g.key);
}

void pd_cache_prefetch(const pd_cache *c, pd_cnode node) {
    if (!c || node >= c->nodes_max) return;
    __builtin_prefetch(&c->nodes[node]);
}

void pd_cache_prefetch_child(const pd_cache *c, pd_cnode parent, const int32_t *first_page) {
    if (!c || !first_page || parent >= c->nodes_max) return;
    uint64_t h = searched_key(c, parent, first_page);
    if (h != 0) pd_index_prefetch(&c->children, h);
}

/* ---- locks ----------------------------------------------------------------- */

/* Node id's lock state just changed (its lock_ref crossed 0): its device
 * pages are appended to scratch_a[*n_dev..] and its host pages to
 * scratch_b[*n_host..], for one ledger move per pool over the whole path
 * (path_units_move) instead of one per node; its list membership follows. */
static void node_lock_changed(pd_cache *c, uint32_t id, uint32_t *n_dev, uint32_t *n_host) {
    cnode *n = N(c, id);
    if (n->on_dev) *n_dev += node_pages(c, id, false, c->scratch_a + *n_dev);
    if (n->on_host) *n_host += node_pages(c, id, true, c->scratch_b + *n_host);
    PD_ASSERT(*n_dev <= c->entries_max && *n_host <= c->entries_max);
    relist(c, id);
}

static void path_units_move(pd_cache *c, uint32_t n_dev, uint32_t n_host, pd_unit_state from,
                            pd_unit_state to) {
    units_move(c, R_KV, c->scratch_a, n_dev, from, PD_OWNER_CACHE, to, PD_OWNER_CACHE);
    units_move(c, R_HOST, c->scratch_b, n_host, from, PD_OWNER_CACHE, to, PD_OWNER_CACHE);
}

/* One more locked child (or, at the node locked, one more lock on it) for id
 * and up: every node that was unlocked becomes locked and its parent gains a
 * locked child, until a node that was locked already. */
static void lock_up(pd_cache *c, uint32_t id, uint32_t *n_dev, uint32_t *n_host) {
    for (;;) {
        cnode *n = N(c, id);
        if (n->lock_ref++ > 0 || id == PD_CNODE_ROOT) return;
        node_lock_changed(c, id, n_dev, n_host);
        id = n->parent;
    }
}

pd_err pd_cache_lock(pd_cache *c, pd_cnode node) {
    if (!c || node >= c->nodes_max || !N(c, node)->live) return PD_ERR_NOTFOUND;
    c->clock++;
    uint32_t n_dev = 0, n_host = 0;
    c->locks[node]++;
    lock_up(c, node, &n_dev, &n_host);
    path_units_move(c, n_dev, n_host, PD_UNIT_CACHE_EVICTABLE, PD_UNIT_CACHE_PROTECTED);
    PD_ASSERT(N(c, PD_CNODE_ROOT)->lock_ref > 0);
    return PD_OK;
}

pd_err pd_cache_unlock(pd_cache *c, pd_cnode node) {
    if (!c || node >= c->nodes_max || !N(c, node)->live) return PD_ERR_NOTFOUND;
    if (c->locks[node] == 0) return PD_ERR_STATE; /* no lock taken on this node */
    /* Validate first, all or nothing: the nodes this unlock leaves unlocked
     * are those from node up whose lock_ref is 1 (the first one above 1
     * stays locked, and so does every ancestor of it). None may hold a
     * locked snapshot or a load in flight. */
    for (uint32_t id = node; id != PD_CNODE_ROOT; id = N(c, id)->parent) {
        const cnode *n = N(c, id);
        PD_ASSERT(n->lock_ref > 0);
        if (n->lock_ref >= 2) break;
        if (n->mamba_lock > 0 || n->loading != PD_NONE) return PD_ERR_STATE;
    }
    c->clock++;
    c->locks[node]--;
    uint32_t n_dev = 0, n_host = 0;
    for (uint32_t id = node;; id = N(c, id)->parent) {
        cnode *n = N(c, id);
        PD_ASSERT(n->lock_ref > 0);
        if (--n->lock_ref > 0 || id == PD_CNODE_ROOT) break;
        node_lock_changed(c, id, &n_dev, &n_host);
        /* Releasing the last lock counts as a use: the node joins the tail. */
        for (int l = 0; l < L__COUNT; l++)
            if (n->in_list[l]) list_to_tail(c, l, id);
    }
    path_units_move(c, n_dev, n_host, PD_UNIT_CACHE_PROTECTED, PD_UNIT_CACHE_EVICTABLE);
    return PD_OK;
}

/* A lock taken on from moves to to, from or a node below it: what
 * pd_cache_lock(to) then pd_cache_unlock(from) would do. from and its
 * ancestors stay locked throughout (no lock state of theirs changes, so
 * neither their units nor their list places do); only nodes below from may
 * become locked, and the walk up from to stops at the first node locked
 * already, from at the latest. Both calls advance the clock. created: to was
 * just created holding the lock (insert_new_node), its parent not told yet. */
static void lock_moved_down(pd_cache *c, uint32_t from, uint32_t to, bool created) {
    c->clock += 2;
    uint32_t n_dev = 0, n_host = 0;
    if (created) {
        PD_ASSERT(to != from && c->locks[to] == 1 && N(c, to)->lock_ref == 1);
        lock_up(c, N(c, to)->parent, &n_dev, &n_host);
    } else {
        c->locks[to]++;
        lock_up(c, to, &n_dev, &n_host);
    }
    PD_ASSERT(c->locks[from] > 0);
    c->locks[from]--;
    cnode *f = N(c, from);
    /* from keeps a locked child on the path to to (or, to == from, the lock
     * just added): the lock taken from it leaves it locked. */
    PD_ASSERT(f->lock_ref >= 2);
    f->lock_ref--;
    path_units_move(c, n_dev, n_host, PD_UNIT_CACHE_EVICTABLE, PD_UNIT_CACHE_PROTECTED);
}

pd_err pd_cache_lock_move(pd_cache *c, pd_cnode from, pd_cnode to) {
    if (!c || from >= c->nodes_max || to >= c->nodes_max || !N(c, from)->live || !N(c, to)->live)
        return PD_ERR_NOTFOUND;
    if (c->locks[from] == 0) return PD_ERR_STATE;
    /* to must be from or below it: walk up from to while deeper than from. */
    uint32_t end = N(c, from)->end_pages, id = to;
    while (id != PD_CNODE_ROOT && N(c, id)->end_pages > end) id = N(c, id)->parent;
    if (id != from) return PD_ERR_INVALID;
    lock_moved_down(c, from, to, false);
    return PD_OK;
}

static pd_err mamba_lock_change(pd_cache *c, pd_cnode node, int delta) {
    if (!c || node >= c->nodes_max || !N(c, node)->live || node == PD_CNODE_ROOT)
        return PD_ERR_NOTFOUND;
    cnode *n = N(c, node);
    if (n->mamba_slot == PD_NONE) return PD_ERR_NOTFOUND;
    if (delta > 0 && n->lock_ref == 0) return PD_ERR_STATE;
    if (delta < 0 && n->mamba_lock == 0) return PD_ERR_STATE;
    c->clock++;
    uint32_t old = n->mamba_lock;
    n->mamba_lock = (uint32_t)((int64_t)n->mamba_lock + delta);
    pd_unit_state from = lock_state(old), to = lock_state(n->mamba_lock);
    units_move(c, R_MAMBA, &n->mamba_slot, 1, from, PD_OWNER_CACHE, to, PD_OWNER_CACHE);
    relist(c, node);
    return PD_OK;
}

pd_err pd_cache_mamba_touch(pd_cache *c, pd_cnode node) {
    if (!c || node >= c->nodes_max || !N(c, node)->live || node == PD_CNODE_ROOT)
        return PD_ERR_NOTFOUND;
    cnode *n = N(c, node);
    if (n->mamba_slot == PD_NONE) return PD_ERR_NOTFOUND;
    if (n->lock_ref == 0) return PD_ERR_STATE;
    c->clock += 2;
    /* Unlocked by others, the snapshot leaves its list at the lock and joins
     * its tail at the unlock, stamped then; locked, only the clock moves. */
    if (n->mamba_lock == 0) list_to_tail(c, L_MAMBA, node);
    return PD_OK;
}

pd_err pd_cache_mamba_lock(pd_cache *c, pd_cnode node) {
    return mamba_lock_change(c, node, +1);
}

pd_err pd_cache_mamba_unlock(pd_cache *c, pd_cnode node) {
    return mamba_lock_change(c, node, -1);
}

/* ---- insert ---------------------------------------------------------------- */

/* Free nodes and entries were last written when their node was evicted,
 * long ago: start loading what the next insert writes first (the next free
 * node, the tokens of the next free entries, which a released chain gives
 * back in order) while the caller goes on. */
enum { PREFETCH_FREE_ENTRIES = 16 };
PD_PREFETCH_INLINE void prefetch_free(const pd_cache *c) {
    uint32_t id = c->node_free.head, e = c->ent_free;
    if (id != PD_NONE) {
        __builtin_prefetch(&c->nodes[id], 1);
        __builtin_prefetch((const char *)&c->nodes[id] + 64, 1);
    }
    for (uint32_t i = 0; e != PD_NONE && i < PREFETCH_FREE_ENTRIES && e + i < c->entries_max; i++)
        __builtin_prefetch(ent_tok(c, e + i), 1);
    /* The free chain itself (each entry_alloc reads the next link) and the
     * page slots the insert writes: a run, one line for sixteen entries. */
    if (e != PD_NONE) {
        __builtin_prefetch(&c->ent_next[e], 1);
        __builtin_prefetch(&c->ent_dev[e], 1);
        __builtin_prefetch(&c->ent_host[e], 1);
    }
}

/* The rest of the prompt, pages [pos, n_pages), is new: one child of parent
 * holding the caller's pages, which move from the request to the cache.
 * locked: the caller's lock is moving onto it (insert_walk's move_lock): it
 * is created holding that lock, its units go straight to CACHE_PROTECTED
 * and it never enters the device list; its parent learns of its locked
 * child when the lock move ends (lock_moved_down). */
static uint32_t insert_new_node(pd_cache *c, uint32_t parent, const int32_t *tokens,
                                const uint32_t *pages, uint32_t pos, uint32_t n_pages,
                                pd_owner owner, uint64_t h, bool locked) {
    uint32_t id = node_alloc(c);
    cnode *n = N(c, id);
    uint32_t prev = PD_NONE;
    for (uint32_t i = pos; i < n_pages; i++) {
        uint32_t e = entry_alloc(c, tokens + (size_t)i * c->page_size);
        c->ent_dev[e] = pages[i];
        if (prev == PD_NONE) n->first_ent = e;
        else c->ent_next[prev] = e;
        prev = e;
    }
    n->last_ent = prev;
    n->n_pages = n_pages - pos;
    n->end_pages = n_pages;
    n->on_dev = true;
    n->lock_ref = c->locks[id] = locked ? 1 : 0;
    /* The stamp it would have had from the device list it skips (unread
     * while it is locked; pd_cache_walk reports it): bit for bit the state
     * of an insert then a lock move. */
    n->lstamp[L_DEV] = c->clock;
    units_move(c, R_KV, pages + pos, n->n_pages, PD_UNIT_REQ, owner, lock_state(n->lock_ref),
               PD_OWNER_CACHE);
    child_link(c, parent, id);
    ht_insert_hashed(c, id, h); /* h: the child key of its first page under parent */
    relist(c, id);
    prefetch_free(c);
    return id;
}

/* The caller's k pages for child, a host-only cached node of exactly k
 * pages: the freshly computed pages become the node's device copy (its
 * parent is on device: C1 holds). A device node's duplicates were swapped by
 * match_dups. */
static void insert_adopt(pd_cache *c, uint32_t parent, uint32_t child, const uint32_t *pages,
                         uint32_t k, pd_owner owner) {
    cnode *ch = N(c, child);
    PD_ASSERT(ch->n_pages == k && !ch->on_dev && ch->loading == PD_NONE);
    PD_ASSERT(N(c, parent)->on_dev);
    units_move(c, R_KV, pages, k, PD_UNIT_REQ, owner, lock_state(ch->lock_ref), PD_OWNER_CACHE);
    node_set_pages(c, child, false, pages);
    ch->on_dev = true;
    N(c, parent)->n_dev_children++;
    relist(c, child);
}

/* Whether the insert of tokens[0..n_pages) may start below the root, at
 * start: a live device node the caller holds locked, ending within the
 * insert, whose own device pages are the caller's at its positions (the
 * caller's pages above it are then the cache's too, by the contract of
 * pd_cache_insert_from). */
static bool insert_start_ok(pd_cache *c, uint32_t start, const uint32_t *pages, uint32_t n_pages) {
    if (start == PD_CNODE_ROOT || start >= c->nodes_max) return false;
    const cnode *n = &c->nodes[start];
    if (!n->live || !n->on_dev || n->lock_ref == 0 || n->end_pages > n_pages) return false;
    uint32_t first = n->end_pages - n->n_pages, e = n->first_ent;
    for (uint32_t i = 0; i < n->n_pages; i++) {
        if (i > 0) e = ent_step(c, e);
        if (c->ent_dev[e] != pages[first + i]) return false;
    }
    return true;
}

/* The insert's walk from node (ending at page pos) down to n_pages. With
 * move_lock, a lock taken on the starting node moves to the node the insert
 * ends at if that is below it (pd_cache_insert_locked). */
static pd_err insert_walk(pd_cache *c, uint32_t node, uint32_t pos, const int32_t *tokens,
                          uint32_t n_pages, uint32_t *pages, pd_owner owner, uint32_t mamba_slot,
                          uint32_t *dup_out, bool move_lock, pd_cache_insert_result *res) {
    pd_cache_insert_result r = {.node = PD_CNODE_ROOT};
    uint32_t from = node;
    bool created_locked = false;
    while (pos < n_pages) {
        const int32_t *q = tokens + (size_t)pos * c->page_size;
        uint64_t h = 0;
        uint32_t child = child_find(c, node, q, &h);
        if (child == PD_NONE) {
            if (h == 0) h = child_key(c, node, q); /* not hashed by the search (or 0: the same) */
            node = insert_new_node(c, node, tokens, pages, pos, n_pages, owner, h, move_lock);
            created_locked = move_lock;
            pos = n_pages;
            break;
        }
        /* On device (never loading), the duplicates are swapped during the
         * compare; the first k positions are the split child's exactly. */
        bool on_dev = N(c, child)->on_dev;
        uint32_t k = on_dev
            ? match_dups(c, child, q, n_pages - pos, pages + pos, dup_out, &r.dup_pages)
            : match_pages(c, child, q, n_pages - pos, NULL);
        PD_ASSERT(k >= 1);
        if (k < N(c, child)->n_pages) child = split(c, child, k);
        if (on_dev) {
            pos += k;
            node = child;
            continue;
        }
        if (N(c, child)->loading != PD_NONE) break; /* a host load owns these positions */
        insert_adopt(c, node, child, pages + pos, k, owner);
        pos += k;
        node = child;
    }
    r.node = node;
    r.covered_tokens = pos * c->page_size;
    if (mamba_slot != PD_POOL_NONE && pos == n_pages && node != PD_CNODE_ROOT &&
        N(c, node)->mamba_slot == PD_NONE) {
        cnode *n = N(c, node);
        PD_ASSERT(n->mamba_lock == 0);
        units_move(c, R_MAMBA, &mamba_slot, 1, PD_UNIT_REQ, owner,
                   PD_UNIT_CACHE_EVICTABLE, PD_OWNER_CACHE);
        n->mamba_slot = mamba_slot;
        relist(c, node);
        r.mamba_taken = true;
    }
    touch_path(c, node);
    if (move_lock && node != from) lock_moved_down(c, from, node, created_locked);
    *res = r;
    return PD_OK;
}

pd_err pd_cache_insert_from(pd_cache *c, pd_cnode start, const int32_t *tokens, uint32_t n_tokens,
                            uint32_t *pages, pd_owner owner, uint32_t mamba_slot, uint32_t *dup_out,
                            pd_cache_insert_result *res) {
    if (!c || !res || n_tokens % c->page_size != 0) return PD_ERR_INVALID;
    if (n_tokens > 0 && (!tokens || !pages || !dup_out)) return PD_ERR_INVALID;
    if (mamba_slot != PD_POOL_NONE && c->pool_id[R_MAMBA] < 0) return PD_ERR_INVALID;
    uint32_t n_pages = n_tokens / c->page_size;
    c->clock++;
    uint32_t pos = 0;
    if (n_pages > 0 && insert_start_ok(c, start, pages, n_pages)) pos = N(c, start)->end_pages;
    else start = PD_CNODE_ROOT;
    return insert_walk(c, start, pos, tokens, n_pages, pages, owner, mamba_slot, dup_out, false,
                       res);
}

pd_err pd_cache_insert_locked(pd_cache *c, pd_cnode start, const int32_t *tokens, uint32_t n_tokens,
                              uint32_t *pages, pd_owner owner, uint32_t mamba_slot,
                              uint32_t *dup_out, pd_cache_insert_result *res) {
    if (!c || !res || n_tokens % c->page_size != 0 || n_tokens == 0) return PD_ERR_INVALID;
    if (!tokens || !pages || !dup_out) return PD_ERR_INVALID;
    if (mamba_slot != PD_POOL_NONE && c->pool_id[R_MAMBA] < 0) return PD_ERR_INVALID;
    uint32_t n_pages = n_tokens / c->page_size;
    /* The walk must start at start (so that it ends at start or below) and a
     * lock must have been taken there; otherwise nothing changes. */
    if (!insert_start_ok(c, start, pages, n_pages) || c->locks[start] == 0) return PD_ERR_INVALID;
    c->clock++;
    return insert_walk(c, start, N(c, start)->end_pages, tokens, n_pages, pages, owner, mamba_slot,
                       dup_out, true, res);
}

pd_err pd_cache_insert(pd_cache *c, const int32_t *tokens, uint32_t n_tokens, uint32_t *pages,
                       pd_owner owner, uint32_t mamba_slot, uint32_t *dup_out,
                       pd_cache_insert_result *res) {
    return pd_cache_insert_from(c, PD_CNODE_ROOT, tokens, n_tokens, pages, owner, mamba_slot,
                                dup_out, res);
}

/* ---- eviction -------------------------------------------------------------- */

static void emit(pd_cache *c, pd_evict_kind kind, uint32_t id, uint64_t stamp,
                 bool written_back, bool deleted) {
    if (!c->cfg.on_evict) return;
    pd_evict_event ev = {
        .kind = kind, .node = id, .end_tokens = N(c, id)->end_pages * c->page_size,
        .pages = N(c, id)->n_pages, .stamp = stamp,
        .written_back = written_back, .node_deleted = deleted,
    };
    c->cfg.on_evict(c->cfg.on_evict_ctx, &ev);
}

static void free_snapshot(pd_cache *c, uint32_t id) {
    cnode *n = N(c, id);
    PD_ASSERT(n->mamba_slot != PD_NONE && n->mamba_lock == 0);
    units_free(c, R_MAMBA, &n->mamba_slot, 1, PD_UNIT_CACHE_EVICTABLE, PD_OWNER_CACHE);
    n->mamba_slot = PD_NONE;
    relist(c, id);
}

static void free_host_copy(pd_cache *c, uint32_t id) {
    cnode *n = N(c, id);
    PD_ASSERT(n->on_host && n->lock_ref == 0 && n->loading == PD_NONE);
    uint32_t k = node_pages(c, id, true, c->scratch_a);
    units_free(c, R_HOST, c->scratch_a, k, PD_UNIT_CACHE_EVICTABLE, PD_OWNER_CACHE);
    node_set_pages(c, id, true, NULL);
    n->on_host = false;
    relist(c, id);
}

/* Removes a node that holds nothing any more (C2) and has no children. */
static void delete_node(pd_cache *c, uint32_t id) {
    cnode *n = N(c, id);
    PD_ASSERT(!n->on_dev && !n->on_host && n->kids.len == 0 && n->lock_ref == 0);
    PD_ASSERT(n->mamba_slot == PD_NONE && n->loading == PD_NONE);
    for (int l = 0; l < L__COUNT; l++) PD_ASSERT(!n->in_list[l]);
    ht_remove(c, id);
    child_unlink(c, id);
    node_release(c, id);
}

/* Deletes the host-only subtree below id (id itself included), children
 * first. Every node in it is unlocked because id is. */
static void delete_subtree(pd_cache *c, uint32_t id) {
    uint32_t sp = 0;
    c->stack[sp++] = id;
    while (sp > 0) {
        uint32_t top = c->stack[sp - 1];
        cnode *n = N(c, top);
        if (n->kids.head != PD_NONE) {
            PD_ASSERT(sp < c->nodes_max);
            c->stack[sp++] = n->kids.head;
            continue;
        }
        sp--;
        if (n->on_host) {
            uint64_t stamp = n->lstamp[L_HOST];
            free_host_copy(c, top);
            emit(c, PD_EVICT_HOST, top, stamp, false, true);
        }
        delete_node(c, top);
    }
}

static uint32_t first_eligible(pd_cache *c, int l) {
    for (uint32_t id = c->lists[l].head; id != PD_NONE; id = N(c, id)->lru[l].next) {
        cnode *n = N(c, id);
        if (l == L_DEV && n->n_dev_children == 0) return id;
        if (l == L_HOST && (n->on_dev || n->kids.len == 0)) return id;
        if (l == L_MAMBA) return id;
    }
    return PD_NONE;
}

static uint32_t evict_host_pages(pd_cache *c, uint32_t need) {
    uint32_t freed = 0;
    while (freed < need) {
        uint32_t id = first_eligible(c, L_HOST);
        if (id == PD_NONE) break;
        cnode *n = N(c, id);
        uint64_t stamp = n->lstamp[L_HOST];
        freed += n->n_pages;
        free_host_copy(c, id);
        bool deleted = !n->on_dev;
        emit(c, PD_EVICT_HOST, id, stamp, false, deleted);
        if (deleted) delete_node(c, id);
    }
    return freed;
}

/* Evicts the device copy of one unlocked device leaf. Returns pages freed. */
/* The cold lines an eviction of node id reads apart from the node itself:
 * its entries' pages, its slot in the child index, its neighbours in its
 * parent's children and in the lists, all known from the node's own lines;
 * loaded together instead of one after another as each step needs one. */
PD_PREFETCH_INLINE void prefetch_victim(const pd_cache *c, const cnode *n) {
    __builtin_prefetch(&c->ent_dev[n->first_ent]);
    __builtin_prefetch(&c->ent_next[n->first_ent]);
    __builtin_prefetch(&c->children.slots[n->key_hash & c->children.mask]);
    if (n->sib.prev != PD_NONE) __builtin_prefetch((const char *)&c->nodes[n->sib.prev] + 64);
    if (n->sib.next != PD_NONE) __builtin_prefetch((const char *)&c->nodes[n->sib.next] + 64);
    if (n->lru[L_DEV].next != PD_NONE) __builtin_prefetch(&c->nodes[n->lru[L_DEV].next]);
}

/* Where an eviction hands its first pages, instead of freeing them: up to
 * want pages move from the cache (evictable) to REQ(owner) and are written
 * to out[got..]. */
typedef struct evict_take {
    pd_owner owner;
    uint32_t *out;
    uint32_t want, got;
} evict_take;

static uint32_t evict_device_node(pd_cache *c, uint32_t id, evict_take *t) {
    cnode *n = N(c, id);
    PD_ASSERT(n->on_dev && n->lock_ref == 0 && n->n_dev_children == 0);
    PD_ASSERT(n->loading == PD_NONE && id != PD_CNODE_ROOT);
    prefetch_victim(c, n);
    uint64_t stamp = n->lstamp[L_DEV];
    if (n->mamba_slot != PD_NONE) free_snapshot(c, id); /* C3 */

    bool written_back = false;
    int hp = c->pool_id[R_HOST];
    if (c->cfg.write_back && hp >= 0 && !n->on_host) {
        pd_pool *host = pd_ledger_pool(c->ledger, hp);
        if (pd_pool_free_count(host) < n->n_pages && pd_pool_total(host) >= n->n_pages)
            evict_host_pages(c, n->n_pages - pd_pool_free_count(host));
        if (pd_pool_free_count(host) >= n->n_pages) {
            uint32_t *hpages = c->scratch_b;
            LEDGER_MUST(c, pd_ledger_alloc_as(c->ledger, hp, n->n_pages,
                                              PD_UNIT_CACHE_EVICTABLE,
                                              PD_OWNER_CACHE, hpages));
            sums_add(c, R_HOST, PD_UNIT_CACHE_EVICTABLE, n->n_pages);
            uint32_t k = node_pages(c, id, false, c->scratch_a);
            if (c->cfg.copy) c->cfg.copy(c->cfg.copy_ctx, PD_COPY_DEV_TO_HOST,
                                         c->scratch_a, hpages, k);
            node_set_pages(c, id, true, hpages);
            n->on_host = true;
            written_back = true;
            c->stats.written_back_pages += k;
        }
    }
    uint32_t k = node_pages(c, id, false, c->scratch_a), give = 0;
    if (t && t->got < t->want) {
        give = PD_MIN(k, t->want - t->got);
        units_move(c, R_KV, c->scratch_a, give, PD_UNIT_CACHE_EVICTABLE, PD_OWNER_CACHE,
                   PD_UNIT_REQ, t->owner);
        memcpy(t->out + t->got, c->scratch_a, give * sizeof(uint32_t));
        t->got += give;
    }
    units_free(c, R_KV, c->scratch_a + give, k - give, PD_UNIT_CACHE_EVICTABLE, PD_OWNER_CACHE);
    /* A node without a host copy is deleted below and its entries freed
     * (entry_alloc clears them when they are taken again): only a node that
     * stays, host-only, forgets its device pages entry by entry. */
    if (n->on_host) node_set_pages(c, id, false, NULL);
    n->on_dev = false;
    PD_ASSERT(N(c, n->parent)->n_dev_children > 0);
    N(c, n->parent)->n_dev_children--;
    relist(c, id);
    c->stats.evicted_dev_pages += k;
    emit(c, PD_EVICT_DEVICE, id, stamp, written_back, !n->on_host);
    if (!n->on_host) delete_subtree(c, id);
    return k;
}

static uint32_t evict_pages(pd_cache *c, uint32_t pages_needed, evict_take *t) {
    c->clock++;
    uint32_t freed = 0;
    while (freed < pages_needed) {
        uint32_t id = first_eligible(c, L_DEV);
        if (id == PD_NONE) break;
        freed += evict_device_node(c, id, t);
    }
    /* The least recently used nodes are cold by definition, and the next
     * call evicts the list's head (usually a leaf): a pipeline one call
     * ahead — the lines of the head's own eviction (its node came in with
     * the previous call's prefetch), and the node lines of the one after. */
    uint32_t next = c->lists[L_DEV].head;
    if (next != PD_NONE) {
        const cnode *n = &c->nodes[next];
        prefetch_victim(c, n);
        uint32_t after = n->lru[L_DEV].next;
        if (after != PD_NONE) __builtin_prefetch((const char *)&c->nodes[after] + 64);
    }
    /* The nodes deleted here went to the front of the free lists, so the
     * lines the last insert's prefetch_free asked for are no longer the
     * next insert's: ask for the new head's (the evicted node's own line
     * and its entries' tokens, cold since they were least recently used). */
    if (freed > 0) prefetch_free(c);
    return freed;
}

pd_err pd_cache_evict(pd_cache *c, uint32_t pages_needed, uint32_t *pages_freed) {
    if (!c) return PD_ERR_INVALID;
    uint32_t freed = evict_pages(c, pages_needed, NULL);
    if (pages_freed) *pages_freed = freed;
    return PD_OK;
}

pd_err pd_cache_evict_to(pd_cache *c, uint32_t pages_needed, pd_owner owner, uint32_t *out,
                         uint32_t *taken) {
    /* Owner 0 is no request's (PD_OWNER_NONE, which PD_OWNER_CACHE equals). */
    if (!c || !taken || (pages_needed > 0 && !out) || owner == PD_OWNER_NONE) return PD_ERR_INVALID;
    evict_take t = {.owner = owner, .out = out, .want = pages_needed};
    evict_pages(c, pages_needed, &t);
    *taken = t.got;
    return PD_OK;
}

pd_err pd_cache_evict_host(pd_cache *c, uint32_t host_pages_needed,
                           uint32_t *pages_freed) {
    if (!c) return PD_ERR_INVALID;
    c->clock++;
    uint32_t freed = evict_host_pages(c, host_pages_needed);
    if (pages_freed) *pages_freed = freed;
    return PD_OK;
}

pd_err pd_cache_evict_snapshots(pd_cache *c, uint32_t slots_needed,
                                uint32_t *slots_freed) {
    if (!c) return PD_ERR_INVALID;
    c->clock++;
    uint32_t freed = 0;
    while (freed < slots_needed) {
        uint32_t id = first_eligible(c, L_MAMBA);
        if (id == PD_NONE) break;
        uint64_t stamp = N(c, id)->lstamp[L_MAMBA];
        free_snapshot(c, id);
        emit(c, PD_EVICT_SNAPSHOT, id, stamp, false, false);
        freed++;
    }
    /* An admission evicts one snapshot a call, the list's head, least
     * recently used and so cold: the next call's node lines start loading
     * now (its slot and links, the line the unlink writes). */
    uint32_t next = c->lists[L_MAMBA].head;
    if (next != PD_NONE) {
        __builtin_prefetch(&c->nodes[next]);
        __builtin_prefetch((const char *)&c->nodes[next] + 64, 1);
    }
    if (slots_freed) *slots_freed = freed;
    return PD_OK;
}

void pd_cache_clear(pd_cache *c) {
    pd_cache_evict_snapshots(c, UINT32_MAX, NULL);
    pd_cache_evict(c, UINT32_MAX, NULL);
    pd_cache_evict_host(c, UINT32_MAX, NULL);
}

/* ---- host loads ------------------------------------------------------------ */

pd_err pd_cache_load_begin(pd_cache *c, pd_cnode host_node, pd_owner owner,
                           uint32_t *dev_out, uint32_t *host_out, uint32_t cap,
                           uint32_t *n_pages, pd_cache_ticket *ticket_out) {
    if (!c || !n_pages || !ticket_out) return PD_ERR_INVALID;
    if (host_node >= c->nodes_max || !N(c, host_node)->live || host_node == PD_CNODE_ROOT)
        return PD_ERR_NOTFOUND;
    if (N(c, host_node)->on_dev) return PD_ERR_STATE;
    if (N(c, host_node)->lock_ref == 0) return PD_ERR_STATE;
    /* The host-only run from host_node up to the first device ancestor. */
    uint32_t total = 0, depth = 0;
    uint32_t id = host_node;
    for (; !N(c, id)->on_dev; id = N(c, id)->parent) {
        if (N(c, id)->loading != PD_NONE) return PD_ERR_STATE;
        PD_ASSERT(N(c, id)->on_host);
        total += N(c, id)->n_pages;
        c->stack[depth++] = id;
    }
    if (total > cap || !dev_out || !host_out) return PD_ERR_INVALID;
    uint32_t t = 0;
    while (t < c->loads_max && c->tickets[t].used) t++;
    if (t == c->loads_max) return PD_ERR_NOMEM;

    c->clock++;
    pd_pool *kv = pd_ledger_pool(c->ledger, c->pool_id[R_KV]);
    while (pd_pool_free_count(kv) < total) {
        uint32_t v = first_eligible(c, L_DEV);
        if (v == PD_NONE) break;
        evict_device_node(c, v, NULL); /* never the locked path being loaded */
    }
    if (pd_pool_free_count(kv) < total) return PD_ERR_NOMEM;
    /* stack holds the path deepest-first; eviction cannot have touched it
     * (it is locked), but the stack buffer may have been reused: rebuild. */
    depth = 0;
    for (id = host_node; !N(c, id)->on_dev; id = N(c, id)->parent) c->stack[depth++] = id;

    LEDGER_MUST(c, pd_ledger_alloc(c->ledger, c->pool_id[R_KV], total, owner, dev_out));
    uint32_t pos = 0;
    for (uint32_t d = depth; d-- > 0;) {
        uint32_t nid = c->stack[d];
        node_set_pages(c, nid, false, dev_out + pos);
        node_pages(c, nid, true, host_out + pos);
        N(c, nid)->loading = t;
        pos += N(c, nid)->n_pages;
    }
    PD_ASSERT(pos == total);
    c->tickets[t] = (ticket){.used = true, .owner = owner, .node = host_node, .n_pages = total};
    c->loads_live++;
    *n_pages = total;
    *ticket_out = t;
    return PD_OK;
}

static pd_err ticket_end(pd_cache *c, pd_cache_ticket t, bool done) {
    if (!c || t >= c->loads_max || !c->tickets[t].used) return PD_ERR_NOTFOUND;
    ticket *tk = &c->tickets[t];
    c->clock++;
    uint32_t moved = 0;
    for (uint32_t id = tk->node; id != PD_CNODE_ROOT && N(c, id)->loading == t;
         id = N(c, id)->parent) {
        cnode *n = N(c, id);
        uint32_t k = node_pages(c, id, false, c->scratch_a);
        if (done) {
            units_move(c, R_KV, c->scratch_a, k, PD_UNIT_REQ, tk->owner,
                       lock_state(n->lock_ref), PD_OWNER_CACHE);
            n->on_dev = true;
            N(c, n->parent)->n_dev_children++;
        } else {
            LEDGER_MUST(c, pd_ledger_free(c->ledger, c->pool_id[R_KV], c->scratch_a,
                                          k, PD_UNIT_REQ, tk->owner));
            node_set_pages(c, id, false, NULL);
        }
        n->loading = PD_NONE;
        relist(c, id);
        moved += k;
    }
    PD_ASSERT(moved == tk->n_pages);
    if (done) c->stats.loaded_pages += moved;
    tk->used = false;
    c->loads_live--;
    return PD_OK;
}

pd_err pd_cache_load_done(pd_cache *c, pd_cache_ticket t) { return ticket_end(c, t, true); }
pd_err pd_cache_load_cancel(pd_cache *c, pd_cache_ticket t) { return ticket_end(c, t, false); }
uint32_t pd_cache_loads_in_flight(const pd_cache *c) { return c->loads_live; }

/* ---- sums, stats, inspection ---------------------------------------------- */

void pd_cache_sums_get(const pd_cache *c, pd_cache_sums *sums) {
    for (int r = 0; r < R__COUNT; r++) {
        int pid = c->pool_id[r];
        if (pid < 0) continue;
        sums->evictable[pid] += c->sum_evict[r];
        sums->protected_[pid] += c->sum_prot[r];
    }
}

uint64_t pd_cache_dev_evictable(const pd_cache *c) { return c->sum_evict[R_KV]; }

void pd_cache_stats_get(const pd_cache *c, pd_cache_stats *out) {
    pd_cache_stats s = c->stats;
    s.nodes = c->nodes_live;
    s.dev_pages = c->sum_evict[R_KV] + c->sum_prot[R_KV];
    s.host_pages = c->sum_evict[R_HOST] + c->sum_prot[R_HOST];
    s.snapshots = c->sum_evict[R_MAMBA] + c->sum_prot[R_MAMBA];
    *out = s;
}

uint32_t pd_cache_node_prefix(const pd_cache *c, pd_cnode node, int32_t *buf,
                              uint32_t cap) {
    if (!c || node >= c->nodes_max || !c->nodes[node].live) return 0;
    uint32_t len = c->nodes[node].end_pages * c->page_size;
    if (len > cap) return 0;
    for (uint32_t id = node; id != PD_CNODE_ROOT; id = c->nodes[id].parent) {
        const cnode *n = &c->nodes[id];
        uint32_t pos = (n->end_pages - n->n_pages) * c->page_size;
        for (uint32_t e = n->first_ent; e != PD_NONE; e = c->ent_next[e]) {
            memcpy(buf + pos, ent_tok(c, e), c->page_size * sizeof(int32_t));
            pos += c->page_size;
        }
    }
    return len;
}

/* cover[id] = the locks covering node id: those taken on it or below it
 * (what lock_ref counted before it was path-compressed). */
static void covering_locks(const pd_cache *c, uint32_t *cover) {
    memset(cover, 0, (size_t)c->nodes_max * sizeof(uint32_t));
    for (uint32_t id = 0; id < c->nodes_max; id++) {
        if (!c->nodes[id].live || c->locks[id] == 0) continue;
        for (uint32_t up = id; up != PD_NONE; up = c->nodes[up].parent) cover[up] += c->locks[id];
    }
}

void pd_cache_walk(pd_cache *c, void (*fn)(void *ctx, const pd_cnode_info *),
                   void *ctx) {
    size_t max_tokens = (size_t)c->entries_max * c->page_size + 1;
    int32_t *prefix = malloc(max_tokens * sizeof(int32_t));
    uint32_t *dev = malloc(((size_t)c->entries_max + 1) * sizeof(uint32_t));
    uint32_t *host = malloc(((size_t)c->entries_max + 1) * sizeof(uint32_t));
    uint32_t *cover = malloc((size_t)c->nodes_max * sizeof(uint32_t));
    PD_ASSERT(prefix && dev && host && cover);
    covering_locks(c, cover);
    /* Iterative pre-order DFS; a node's prefix is rebuilt from its entries
     * into prefix[] at its depth (parents are visited first). */
    uint32_t sp = 0;
    for (uint32_t ch = N(c, PD_CNODE_ROOT)->kids.head; ch != PD_NONE; ch = N(c, ch)->sib.next)
        c->stack[sp++] = ch;
    while (sp > 0) {
        uint32_t id = c->stack[--sp];
        cnode *n = N(c, id);
        uint32_t start = (n->end_pages - n->n_pages) * c->page_size;
        uint32_t i = 0;
        for (uint32_t e = n->first_ent; e != PD_NONE; e = c->ent_next[e], i++) {
            memcpy(prefix + start + (size_t)i * c->page_size, ent_tok(c, e),
                   c->page_size * sizeof(int32_t));
            dev[i] = c->ent_dev[e];
            host[i] = c->ent_host[e];
        }
        pd_cnode_info info = {
            .node = id,
            .parent = n->parent,
            .end_tokens = n->end_pages * c->page_size,
            .pages = n->n_pages,
            .on_dev = n->on_dev,
            .on_host = n->on_host,
            .loading = n->loading != PD_NONE,
            .lock_ref = cover[id],
            .locks = c->locks[id],
            .mamba_lock = n->mamba_lock,
            .mamba_slot = n->mamba_slot == PD_NONE ? PD_POOL_NONE : n->mamba_slot,
            .stamp_dev = n->lstamp[L_DEV],
            .stamp_host = n->lstamp[L_HOST],
            .stamp_mamba = n->lstamp[L_MAMBA],
            .prefix = prefix,
            .dev_pages = (n->on_dev || n->loading != PD_NONE) ? dev : NULL,
            .host_pages = n->on_host ? host : NULL,
        };
        fn(ctx, &info);
        for (uint32_t ch = n->kids.head; ch != PD_NONE; ch = N(c, ch)->sib.next)
            c->stack[sp++] = ch;
    }
    free(prefix);
    free(dev);
    free(host);
    free(cover);
}

#define VFAIL(...) return pd_errorf(msg, msg_cap, PD_ERR_INTERNAL, __VA_ARGS__)

static pd_err verify_units(pd_cache *c, int r, const uint32_t *u, uint32_t n,
                           pd_unit_state want, pd_owner owner, uint32_t id,
                           char *msg, size_t msg_cap) {
    for (uint32_t i = 0; i < n; i++) {
        if (u[i] == PD_NONE)
            VFAIL("node %u: %s unit missing at page %u", id,
                  r == R_KV         ? "kv"
                      : r == R_HOST ? "host"
                                    : "mamba",
                  i);
        pd_unit_state st = pd_ledger_state_of(c->ledger, c->pool_id[r], u[i]);
        if (st != want)
            VFAIL("node %u: %s unit %u is %s in the ledger, expected %s", id,
                  r == R_KV ? "kv" : r == R_HOST ? "host" : "mamba", u[i],
                  pd_unit_state_name(st), pd_unit_state_name(want));
        if (want == PD_UNIT_REQ && pd_ledger_strict(c->ledger) &&
            pd_ledger_owner_of(c->ledger, c->pool_id[r], u[i]) != owner)
            VFAIL("node %u: loading unit %u not owned by the ticket's owner", id, u[i]);
    }
    return PD_OK;
}

/* What pd_cache_verify recounts while it walks the tree, to hold against
 * the recorded counters and sums afterwards. */
typedef struct verify_tally {
    uint64_t ev[R__COUNT], pr[R__COUNT]; /* units evictable / protected */
    uint32_t nodes, ents;                /* reachable below the root */
    uint32_t in_list[L__COUNT];          /* nodes flagged in each list */
} verify_tally;

/* Node id's children: their parent links, the recorded child counts, C4 in
 * its compressed form (lock_ref is the locks taken on the node plus its
 * locked children); each child is pushed on the walk's stack. */
static pd_err verify_children(pd_cache *c, uint32_t id, uint32_t *sp, char *msg,
                              size_t msg_cap) {
    cnode *n = N(c, id);
    uint32_t kids = 0, dev_kids = 0, prev = PD_NONE;
    uint64_t kids_locked = 0;
    for (uint32_t ch = n->kids.head; ch != PD_NONE; prev = ch, ch = N(c, ch)->sib.next) {
        cnode *k = N(c, ch);
        if (k->parent != id) VFAIL("node %u: child %u has parent %u", id, ch, k->parent);
        if (k->sib.prev != prev) VFAIL("node %u: sibling list broken at child %u", id, ch);
        kids++;
        dev_kids += k->on_dev;
        kids_locked += k->lock_ref > 0;
        if (*sp >= c->nodes_max) VFAIL("cycle below node %u", id);
        c->stack[(*sp)++] = ch;
    }
    if (kids != n->kids.len || prev != n->kids.tail)
        VFAIL("node %u: %u children counted, %u recorded", id, kids, n->kids.len);
    if (dev_kids != n->n_dev_children)
        VFAIL("node %u: %u device children counted, %u recorded", id, dev_kids,
              n->n_dev_children);
    if (n->lock_ref != c->locks[id] + kids_locked)
        VFAIL("node %u: lock_ref %u, but %u locks on it and %llu locked children (C4)", id,
              n->lock_ref, c->locks[id], (unsigned long long)kids_locked);
    uint32_t hot = n->hot_child;
    if (hot != PD_NONE &&
        (hot >= c->nodes_max || !c->nodes[hot].live || c->nodes[hot].parent != id ||
         hot == PD_CNODE_ROOT))
        VFAIL("node %u: hot child %u is not one of its children", id, hot);
    return PD_OK;
}

/* One node below the root: C1-C4, its depth, its entry chain, its slot in
 * the child table and its list flags. */
static pd_err verify_shape(pd_cache *c, uint32_t id, verify_tally *t, char *msg,
                           size_t msg_cap) {
    cnode *n = N(c, id);
    cnode *p = N(c, n->parent);
    if (n->on_dev && !p->on_dev) VFAIL("node %u on device under a host-only parent (C1)", id);
    if (!n->on_dev && !n->on_host) VFAIL("node %u holds nothing (C2)", id);
    if (n->mamba_slot != PD_NONE && !n->on_dev)
        VFAIL("node %u: snapshot on a host-only node (C3)", id);
    if (n->mamba_lock > 0 && n->lock_ref == 0)
        VFAIL("node %u: snapshot locked, node not (C4)", id);
    if (n->loading != PD_NONE && (n->on_dev || !n->on_host || n->lock_ref == 0))
        VFAIL("node %u: loading but on_dev=%d on_host=%d lock_ref=%u", id, n->on_dev,
              n->on_host, n->lock_ref);
    if (n->end_pages != p->end_pages + n->n_pages && n->parent != PD_CNODE_ROOT)
        VFAIL("node %u: ends at page %u, parent at %u, has %u", id, n->end_pages,
              p->end_pages, n->n_pages);
    if (n->parent == PD_CNODE_ROOT && n->end_pages != n->n_pages)
        VFAIL("node %u: top-level node ends at page %u with %u pages", id, n->end_pages,
              n->n_pages);
    uint32_t cnt = 0, last = PD_NONE;
    for (uint32_t e = n->first_ent; e != PD_NONE; last = e, e = c->ent_next[e])
        if (++cnt > c->entries_max) VFAIL("node %u: entry chain loops", id);
    if (last != n->last_ent)
        VFAIL("node %u: chain ends at entry %u, last_ent %u", id, last, n->last_ent);
    if (cnt != n->n_pages || cnt == 0)
        VFAIL("node %u: %u entries for %u pages", id, cnt, n->n_pages);
    t->ents += cnt;
    if (ht_lookup(c, n->parent, ent_tok(c, n->first_ent)) != id)
        VFAIL("node %u: child table lookup does not find it", id);
    bool want[L__COUNT] = {n->on_dev && n->lock_ref == 0, n->on_host && n->lock_ref == 0,
                           n->mamba_slot != PD_NONE && n->mamba_lock == 0};
    for (int l = 0; l < L__COUNT; l++) {
        if (want[l] != n->in_list[l])
            VFAIL("node %u: list %d membership %d, expected %d", id, l, n->in_list[l],
                  want[l]);
        t->in_list[l] += n->in_list[l];
    }
    return PD_OK;
}

/* The units node id holds, against the ledger: device pages (or the pages a
 * load is filling, still the loader's), host pages, the snapshot slot. */
static pd_err verify_node_units(pd_cache *c, uint32_t id, verify_tally *t, char *msg,
                                size_t msg_cap) {
    cnode *n = N(c, id);
    pd_err err;
    uint32_t k;
    if (n->on_dev || n->loading != PD_NONE) {
        k = node_pages(c, id, false, c->scratch_a);
        pd_unit_state want_st = n->loading != PD_NONE ? PD_UNIT_REQ : lock_state(n->lock_ref);
        pd_owner own = n->loading != PD_NONE ? c->tickets[n->loading].owner : PD_OWNER_CACHE;
        err = verify_units(c, R_KV, c->scratch_a, k, want_st, own, id, msg, msg_cap);
        if (err) return err;
        if (n->on_dev) (n->lock_ref ? t->pr : t->ev)[R_KV] += k;
    }
    if (n->on_host) {
        k = node_pages(c, id, true, c->scratch_a);
        err = verify_units(c, R_HOST, c->scratch_a, k, lock_state(n->lock_ref), 0, id, msg,
                           msg_cap);
        if (err) return err;
        (n->lock_ref ? t->pr : t->ev)[R_HOST] += k;
    }
    if (n->mamba_slot != PD_NONE) {
        err = verify_units(c, R_MAMBA, &n->mamba_slot, 1, lock_state(n->mamba_lock), 0, id,
                           msg, msg_cap);
        if (err) return err;
        (n->mamba_lock ? t->pr : t->ev)[R_MAMBA] += 1;
    }
    return PD_OK;
}

/* Lists: integrity, stamps non-decreasing, device list keeps every node
 * behind its descendants (a node's parent in the list comes later). */
static pd_err verify_lists(pd_cache *c, const uint32_t *in_list_n, char *msg,
                           size_t msg_cap) {
    for (int l = 0; l < L__COUNT; l++) {
        uint32_t len = 0, prev = PD_NONE;
        uint64_t last_stamp = 0;
        for (uint32_t id = c->lists[l].head; id != PD_NONE; id = N(c, id)->lru[l].next) {
            cnode *n = N(c, id);
            if (!n->in_list[l] || n->lru[l].prev != prev) VFAIL("list %d broken at node %u", l, id);
            if (n->lstamp[l] < last_stamp) VFAIL("list %d: stamps decrease at node %u", l, id);
            last_stamp = n->lstamp[l];
            c->stack[len] = id;
            if (++len > c->nodes_max) VFAIL("list %d loops", l);
            prev = id;
        }
        if (prev != c->lists[l].tail || len != c->lists[l].len || len != in_list_n[l])
            VFAIL("list %d: length %u, recorded %u, flagged %u", l, len, c->lists[l].len,
                  in_list_n[l]);
        if (l == L_DEV) {
            for (uint32_t i = 0; i < len; i++) c->pos_of[c->stack[i]] = i;
            for (uint32_t i = 0; i < len; i++) {
                uint32_t par = N(c, c->stack[i])->parent;
                if (par == PD_CNODE_ROOT || !N(c, par)->in_list[L_DEV]) continue;
                if (c->pos_of[par] < i)
                    VFAIL("device list: node %u comes after its parent %u", c->stack[i], par);
            }
        }
    }
    return PD_OK;
}

pd_err pd_cache_verify(pd_cache *c, char *msg, size_t msg_cap) {
    verify_tally seen;
    memset(&seen, 0, sizeof(seen));
    pd_err err;
    if (((uintptr_t)c->ent_tokens & 63) != 0 || ((uintptr_t)c->nodes & 63) != 0)
        VFAIL("node or token arena not aligned to a cache line");
    uint32_t sp = 0;
    c->stack[sp++] = PD_CNODE_ROOT;
    while (sp > 0) {
        uint32_t id = c->stack[--sp];
        if (!N(c, id)->live) VFAIL("node %u reachable but not live", id);
        if ((err = verify_children(c, id, &sp, msg, msg_cap))) return err;
        if (id == PD_CNODE_ROOT) continue;
        seen.nodes++;
        if ((err = verify_shape(c, id, &seen, msg, msg_cap))) return err;
        if ((err = verify_node_units(c, id, &seen, msg, msg_cap))) return err;
    }
    if (seen.nodes != c->nodes_live)
        VFAIL("%u nodes reachable, %u live", seen.nodes, c->nodes_live);
    if (seen.ents != c->ents_live) VFAIL("%u entries reachable, %u live", seen.ents, c->ents_live);
    for (int r = 0; r < R__COUNT; r++)
        if (seen.ev[r] != c->sum_evict[r] || seen.pr[r] != c->sum_prot[r])
            VFAIL("resource %d: recount evictable %llu protected %llu, sums %llu %llu", r,
                  (unsigned long long)seen.ev[r], (unsigned long long)seen.pr[r],
                  (unsigned long long)c->sum_evict[r], (unsigned long long)c->sum_prot[r]);
    if ((err = verify_lists(c, seen.in_list, msg, msg_cap))) return err;
    uint32_t tickets = 0;
    for (uint32_t t = 0; t < c->loads_max; t++) {
        if (!c->tickets[t].used) continue;
        tickets++;
        if (N(c, c->tickets[t].node)->loading != t) VFAIL("ticket %u: node not loading", t);
    }
    if (tickets != c->loads_live) VFAIL("%u tickets used, %u recorded", tickets, c->loads_live);
    return PD_OK;
}
