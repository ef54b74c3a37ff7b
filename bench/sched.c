/*
 * bench/sched — scheduler overhead: the cost of one engine step, with an
 * executor that costs nothing (results are ready at once, no arithmetic) and
 * the loopback transport, at a fixed number of live requests (closed loop: a
 * request that ends is replaced at once).
 *
 *   sched [--live N[,N...]] [--steps N] [--runs R] [--seed S] [--strict]
 *
 * For each live count it reports the median and p99 microseconds per step of
 * the prefill node and of the decode node, end-to-end requests/s, and the
 * heap allocations of the steady state (the second half of the steps): per
 * engine step, which must be 0, and per request at submit (admission copies
 * the prompt). It also prints the first run's decisions (the engines'
 * counters: batches, tokens computed, tokens found in the prefix cache),
 * which a change that only makes the step cheaper must leave as they were
 * (the workload is seeded: same workload, same line). The counting ledger
 * is the production setting; --strict measures the per-unit owner map that
 * tests and the simulator use, for comparison.
 *
 * The core probe (on unless --no-probe): after each step pair, a fixed block
 * of register-only work is timed (eight independent add-and-shift chains, no
 * memory access). Nothing of ours can change its time; what does is the
 * machine's: on a shared host the physical core's other hardware thread
 * belongs to another tenant, and when it runs, this block takes up to twice
 * as long (docs/engine.md, "Issue 13, twenty-second round"). A step pair is
 * on a quiet core when the probes either side of it read within PROBE_QUIET
 * of the fastest probe of the invocation. The plain medians above are the
 * figures; the probe's block, after them, says how much of each live
 * count's runs the core was quiet, and the step medians of those steps and
 * of the rest, so that a reading carries its machine's state with it.
 * --trace FILE writes every step and its probe as CSV.
 *
 * Allocations are counted by wrapping malloc, calloc, realloc and
 * aligned_alloc at link time (-Wl,--wrap, CMakeLists.txt): every call from
 * pdserve's own code goes through the counters below; calls libc makes
 * internally do not. Calls the loopback transport makes while the engine
 * posts a send are counted apart: the loopback stands in for the network and
 * is not part of the scheduler.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "bench_util.h"
#include "pdserve/engine.h"
#include "pdserve/loopback.h"

/* ---- counting allocations ------------------------------------------------------ */

typedef enum alloc_scope {
    SCOPE_OTHER,
    SCOPE_ENGINE,
    SCOPE_TRANSPORT,
    SCOPE_SUBMIT,
    SCOPE__N
} alloc_scope;

static alloc_scope g_scope = SCOPE_OTHER;
static uint64_t g_allocs[SCOPE__N];

void *__real_malloc(size_t n);
void *__real_calloc(size_t k, size_t n);
void *__real_realloc(void *p, size_t n);
void *__real_aligned_alloc(size_t align, size_t n);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t k, size_t n);
void *__wrap_realloc(void *p, size_t n);
void *__wrap_aligned_alloc(size_t align, size_t n);

void *__wrap_malloc(size_t n) {
    g_allocs[g_scope]++;
    return __real_malloc(n);
}
void *__wrap_calloc(size_t k, size_t n) {
    g_allocs[g_scope]++;
    return __real_calloc(k, n);
}
void *__wrap_realloc(void *p, size_t n) {
    g_allocs[g_scope]++;
    return __real_realloc(p, n);
}
void *__wrap_aligned_alloc(size_t align, size_t n) {
    g_allocs[g_scope]++;
    return __real_aligned_alloc(align, n);
}

/* Each allocator the core calls is counted: one call of each, in a scope of
 * its own, must move that scope's counter by one (a pointer through a
 * volatile, so that the compiler keeps the calls). An allocator the link
 * does not wrap would be invisible to the figures below: buf_fit moved to
 * aligned_alloc before it was wrapped, and 0.03 allocations per request at
 * submit at 1,024 live read 0.00. */
static void wrappers_check(void) {
    void *volatile p;
    /* The scope and the counter through volatiles too: the compiler takes
     * the calls for the C library's, which read and write no global of ours,
     * and would drop the scope's store and fold the count. */
    volatile alloc_scope *scope = &g_scope;
    volatile uint64_t *count = &g_allocs[SCOPE_TRANSPORT];
    alloc_scope was = *scope;
    *scope = SCOPE_TRANSPORT;
    uint64_t n0 = *count;
    p = malloc(64);
    p = realloc(p, 128);
    free(p);
    p = calloc(1, 64);
    free(p);
    p = aligned_alloc(64, 64);
    free(p);
    *scope = was;
    uint64_t seen = *count - n0;
    PD_ASSERTF(seen == 4,
               "the allocation counters saw %llu of 4 calls (malloc, realloc, calloc, "
               "aligned_alloc): the link must wrap each (CMakeLists.txt)",
               (unsigned long long)seen);
    *count = n0;
}

/* The transport as the engine sees it: the loopback's own vtable, but for the
 * calls that hand it a page list (it keeps a copy: the sends on prefill, the
 * destination on decode), which count their allocations as the transport's. */
static pd_xfer g_lb[2];
static pd_xfer_vtable g_vt[2];

static pd_err counted_send_pages(int side, uint64_t room, uint32_t first, const uint32_t *src,
                                 uint32_t n) {
    alloc_scope was = g_scope;
    g_scope = SCOPE_TRANSPORT;
    pd_err err = g_lb[side].vt->send_pages(g_lb[side].self, room, first, src, n);
    g_scope = was;
    return err;
}
static pd_err counted_send_final(int side, uint64_t room, uint32_t first, const uint32_t *src,
                                 uint32_t n, uint32_t mamba_slot, uint32_t meta_row) {
    alloc_scope was = g_scope;
    g_scope = SCOPE_TRANSPORT;
    pd_err err =
        g_lb[side].vt->send_final(g_lb[side].self, room, first, src, n, mamba_slot, meta_row);
    g_scope = was;
    return err;
}
/* Only the prefill side (0) sends; only the decode side (1) opens a receiver. */
static pd_err sp0(void *self, uint64_t room, uint32_t first, const uint32_t *src, uint32_t n) {
    (void)self;
    return counted_send_pages(0, room, first, src, n);
}
static pd_err sf0(void *self, uint64_t room, uint32_t first, const uint32_t *src, uint32_t n,
                  uint32_t mamba_slot, uint32_t meta_row) {
    (void)self;
    return counted_send_final(0, room, first, src, n, mamba_slot, meta_row);
}

static pd_err ro1(void *self, uint64_t room, const char *peer, const pd_xfer_dest *dest) {
    (void)self;
    alloc_scope was = g_scope;
    g_scope = SCOPE_TRANSPORT;
    pd_err err = g_lb[1].vt->receiver_open(g_lb[1].self, room, peer, dest);
    g_scope = was;
    return err;
}

static pd_xfer counted_transport(pd_xfer lb, int side) {
    g_lb[side] = lb;
    g_vt[side] = *lb.vt;
    if (side == 0) {
        g_vt[side].send_pages = sp0;
        g_vt[side].send_final = sf0;
    } else {
        g_vt[side].receiver_open = ro1;
    }
    return (pd_xfer){.vt = &g_vt[side], .self = lb.self};
}

/* ---- a zero-cost executor ---------------------------------------------------- */

typedef struct zexec {
    uint64_t ids[4];
    uint32_t n[4];
    uint64_t reqs[4][256];
    uint32_t head, count;
    uint64_t *kv, *mamba;
    uint32_t kv_pages, mamba_slots, page_size;
} zexec;

static pd_err z_launch(void *self, const pd_batch *b) {
    zexec *z = self;
    if (z->count == 4 || b->n_items > 256) return PD_ERR_NOMEM;
    uint32_t slot = (z->head + z->count) % 4;
    z->ids[slot] = b->id;
    z->n[slot] = b->n_items;
    for (uint32_t i = 0; i < b->n_items; i++) z->reqs[slot][i] = b->items[i].req;
    z->count++;
    return PD_OK;
}

static bool z_poll(void *self, uint64_t id, pd_item_result *res, pd_item_top *tops) {
    (void)tops;
    zexec *z = self;
    PD_ASSERT(z->count > 0 && z->ids[z->head] == id);
    /* What an executor must write: the request, its token and logprob, and
     * how many top logprobs it wrote to tops[i] (none asked). */
    for (uint32_t i = 0; i < z->n[z->head]; i++) {
        res[i].req = z->reqs[z->head][i];
        res[i].token = 7;
        res[i].logprob = -0.5f;
        res[i].n_top = 0;
    }
    z->head = (z->head + 1) % 4;
    z->count--;
    return true;
}

static pd_err z_copy(void *self, uint32_t d, uint32_t s) {
    (void)self, (void)d, (void)s;
    return PD_OK;
}
static void z_wb(void *self, const uint32_t *d, const uint32_t *h, uint32_t n) {
    (void)self, (void)d, (void)h, (void)n;
}
static pd_err z_lb(void *self, uint64_t id, const uint32_t *d, const uint32_t *h, uint32_t n) {
    (void)self, (void)id, (void)d, (void)h, (void)n;
    return PD_OK;
}
static bool z_lp(void *self, uint64_t id) { (void)self, (void)id; return true; }
static void z_lc(void *self, uint64_t id) { (void)self, (void)id; }
static void z_mem(void *self, pd_exec_memory *m) {
    zexec *z = self;
    *m = (pd_exec_memory){.kv = z->kv, .kv_page_bytes = 8, .kv_pages = z->kv_pages,
                          .mamba = z->mamba, .mamba_slot_bytes = 8, .mamba_slots = z->mamba_slots};
}
static void z_info(void *self, pd_model_info *i) {
    zexec *z = self;
    *i = (pd_model_info){.vocab = 32000, .eos_token = -1, .page_size = z->page_size,
                         .has_mamba = z->mamba_slots > 0};
}

static const pd_executor_vtable zvt = {z_launch, z_poll, z_copy, z_wb, z_lb,
                                       z_lp, z_lc, z_mem, z_info};

/* ---- a sink that counts -------------------------------------------------------- */

typedef struct counter {
    uint64_t ended;
} counter;

static void c_token(void *self, uint64_t tag, const char *rid, uint64_t room, int32_t t, float lp,
                    uint32_t i) {
    (void)self, (void)tag, (void)rid, (void)room, (void)t, (void)lp, (void)i;
}
static void c_term(void *self, const pd_terminal_event *ev) {
    (void)ev;
    ((counter *)self)->ended++;
}
static const pd_sink_vtable cvt = {.token = c_token, .terminal = c_term};

/* ---- the core probe ------------------------------------------------------------ */

enum { PROBE_ITERS = 1024 }; /* about 1.5 us on the development machine's quiet core */
#define PROBE_QUIET 1.05     /* within 5 % of the invocation's fastest probe */

static volatile uint64_t g_probe_sink;

/* Nanoseconds for PROBE_ITERS rounds of eight independent add-and-shift
 * chains held in registers: throughput-bound (eight chains keep every ALU
 * busy), so it slows when another hardware thread shares the core, and it
 * touches no memory, so our caches cannot move it. The empty asm keeps the
 * chains in registers and unvectorised. */
static uint64_t core_probe_ns(void) {
    uint64_t a = 1, b = 2, c = 3, d = 4, e = 5, f = 6, g = 7, h = 8;
    uint64_t t0 = bench_now_ns();
    for (uint32_t i = 0; i < PROBE_ITERS; i++) {
        a += a >> 1, b += b >> 1, c += c >> 1, d += d >> 1;
        e += e >> 1, f += f >> 1, g += g >> 1, h += h >> 1;
        __asm__ volatile(""
                         : "+r"(a), "+r"(b), "+r"(c), "+r"(d), "+r"(e), "+r"(f), "+r"(g), "+r"(h));
    }
    uint64_t t1 = bench_now_ns();
    g_probe_sink = a ^ b ^ c ^ d ^ e ^ f ^ g ^ h;
    return t1 - t0;
}

/* A run's steps split by the probe: the share of step pairs on a quiet core
 * and the step medians of each side (0 where a side has none). pr[0] is the
 * probe before the first step, pr[i + 1] the one after step i; a step is on
 * a quiet core when both read within PROBE_QUIET of `best`, the fastest
 * probe of the whole invocation (a run spent entirely beside a busy thread
 * has no quiet step, rather than one judged against its own slow best). */
typedef struct probe_split {
    double quiet_share, p_quiet, d_quiet, p_busy, d_busy;
} probe_split;

static probe_split probe_split_of(const uint64_t *pr, const double *tp, const double *td,
                                  uint32_t steps, uint64_t best) {
    double *q[2] = {malloc(steps * sizeof(double)), malloc(steps * sizeof(double))};
    double *o[2] = {malloc(steps * sizeof(double)), malloc(steps * sizeof(double))};
    PD_ASSERT(q[0] && q[1] && o[0] && o[1]);
    size_t nq = 0, no = 0;
    for (uint32_t i = 0; i < steps; i++) {
        if ((double)PD_MAX(pr[i], pr[i + 1]) <= PROBE_QUIET * (double)best) {
            q[0][nq] = tp[i], q[1][nq++] = td[i];
        } else {
            o[0][no] = tp[i], o[1][no++] = td[i];
        }
    }
    probe_split ps = {.quiet_share = (double)nq / steps,
                      .p_quiet = bench_median(q[0], nq),
                      .d_quiet = bench_median(q[1], nq),
                      .p_busy = bench_median(o[0], no),
                      .d_busy = bench_median(o[1], no)};
    for (int k = 0; k < 2; k++) free(q[k]), free(o[k]);
    return ps;
}

/* Each run's steps in order and its probes, kept until every run is done. */
typedef struct trace {
    double *tp, *td; /* steps each */
    uint64_t *pr;    /* steps + 1 */
} trace;

/* ---- the benchmark ------------------------------------------------------------- */

typedef struct figures {
    double p_med, p_p99, d_med, d_p99, req_s;
    /* steady state (the second half of the steps): heap allocations per
     * engine step (both nodes), the transport's per step while the engine
     * posted sends, and per request submitted (to both nodes) */
    double allocs_step, allocs_xfer_step, allocs_submit_req;
    pd_engine_counters ctr[2]; /* each node's, after the last step */
} figures;

#define PAGE_TOKENS 16u
#define PROMPT_MAX 512u
#define NEW_MAX 32u

/* A prefill and a decode engine (side 0 and 1) over one loopback. */
typedef struct engines {
    zexec zx[2];
    pd_meta_row *meta[2];
    counter cnt[2];
    pd_loopback *lb;
    pd_engine *eng[2];
} engines;

static void side_open(engines *en, int side, uint32_t live, uint32_t pages, bool strict) {
    zexec *z = &en->zx[side];
    *z = (zexec){.kv_pages = pages, .mamba_slots = live * 4 + 8, .page_size = PAGE_TOKENS};
    z->kv = calloc(pages, 8);
    z->mamba = calloc(z->mamba_slots, 8);
    en->meta[side] = calloc(live * 2 + 8, sizeof(pd_meta_row));
    pd_engine_config c;
    pd_engine_config_default(&c, side == 0 ? PD_ROLE_PREFILL : PD_ROLE_DECODE);
    c.page_size = PAGE_TOKENS;
    c.kv_pages = pages;
    c.rows = live + 8;
    c.mamba_slots = z->mamba_slots;
    c.meta_rows = live * 2 + 8;
    c.requests_max = live * 2 + 16;
    c.chunk_tokens = 2048;
    c.batch_max = 256;
    c.prompt_tokens_max = PROMPT_MAX;
    c.new_tokens_max = NEW_MAX;
    c.strict = strict;
    c.meta_mem = en->meta[side];
    char msg[256];
    pd_executor ex = {.vt = &zvt, .self = z};
    pd_sink sk = {.vt = &cvt, .self = &en->cnt[side]};
    pd_lb_side lb_side = side == 0 ? PD_LB_PREFILL : PD_LB_DECODE;
    pd_xfer xf = counted_transport(pd_loopback_endpoint(en->lb, lb_side), side);
    pd_err err = pd_engine_create(&en->eng[side], &c, ex, xf, sk, msg, sizeof(msg));
    PD_ASSERTF(err == PD_OK, "%s", msg);
    pd_exec_memory m;
    z_mem(z, &m);
    pd_loopback_register(en->lb, lb_side, &m, en->meta[side], c.meta_rows);
}

static void engines_open(engines *en, uint32_t live, bool strict) {
    uint32_t pages = live * ((PROMPT_MAX + NEW_MAX) / PAGE_TOKENS + 2) + 64;
    en->cnt[0] = en->cnt[1] = (counter){0};
    pd_loopback_config lc = {.latency = 1, .dead_grace = 10, .rooms_max = live * 4 + 64,
                             .page_size = PAGE_TOKENS};
    PD_MUST(pd_loopback_create(&en->lb, &lc));
    for (int side = 0; side < 2; side++) side_open(en, side, live, pages, strict);
}

static void engines_close(engines *en) {
    for (int side = 0; side < 2; side++) {
        pd_engine_destroy(en->eng[side]);
        free(en->zx[side].kv);
        free(en->zx[side].mamba);
        free(en->meta[side]);
    }
    pd_loopback_destroy(en->lb);
}

/* The request stream: random prompts that start with one of a handful of
 * shared system prompts, so the caches do real work. */
typedef struct requests {
    pd_rng rng;
    int32_t sys_prompts[4][256];
    int32_t prompt[PROMPT_MAX];
    uint64_t submitted, room;
} requests;

static void requests_init(requests *rq, uint64_t seed) {
    pd_rng_seed(&rq->rng, seed);
    for (int k = 0; k < 4; k++)
        for (int i = 0; i < 256; i++)
            rq->sys_prompts[k][i] = (int32_t)pd_rng_below(&rq->rng, 32000);
    rq->submitted = 0;
    rq->room = 1;
}

/* Submits new requests to both engines until `live` are in flight. */
static void top_up(engines *en, requests *rq, uint32_t live, uint64_t now) {
    while (rq->submitted - en->cnt[1].ended < live) {
        uint32_t len = (uint32_t)pd_rng_range(&rq->rng, 64, PROMPT_MAX);
        uint32_t shared = (uint32_t)PD_MIN(len - 1, 256u);
        memcpy(rq->prompt, rq->sys_prompts[pd_rng_below(&rq->rng, 4)], shared * sizeof(int32_t));
        for (uint32_t i = shared; i < len; i++)
            rq->prompt[i] = (int32_t)pd_rng_below(&rq->rng, 32000);
        char rid[32];
        snprintf(rid, sizeof(rid), "q%llu", (unsigned long long)rq->submitted);
        pd_request_spec s = {.rid = rid, .room = rq->room++, .prompt = rq->prompt,
                             .prompt_len = len,
                             .max_new_tokens = (uint32_t)pd_rng_range(&rq->rng, 4, NEW_MAX),
                             .sampling = {.top_p = 1.0f}};
        PD_MUST(pd_engine_submit(en->eng[0], &s, now, NULL));
        PD_MUST(pd_engine_submit(en->eng[1], &s, now, NULL));
        rq->submitted++;
    }
}

/* One run; with tr, each step pair is followed by the core probe, and the
 * steps' times (in order) and the probes are kept in *tr. */
static figures run(uint32_t live, uint32_t steps, bool strict, uint64_t seed, trace *tr) {
    engines en;
    engines_open(&en, live, strict);
    static requests rq;
    requests_init(&rq, seed);
    double *tp = malloc(steps * sizeof(double)), *td = malloc(steps * sizeof(double));
    PD_ASSERT(tp && td);
    if (tr) tr->pr[0] = core_probe_ns();
    uint64_t a0[SCOPE__N] = {0}, submitted0 = 0;
    uint32_t steady_from = steps / 2;
    uint64_t t_start = bench_now_ns();
    for (uint32_t step = 0; step < steps; step++) {
        uint64_t now = step + 1;
        if (step == steady_from) {
            memcpy(a0, g_allocs, sizeof(a0));
            submitted0 = rq.submitted;
        }
        g_scope = SCOPE_SUBMIT;
        top_up(&en, &rq, live, now);
        g_scope = SCOPE_OTHER;
        pd_loopback_advance(en.lb, now);
        g_scope = SCOPE_ENGINE;
        uint64_t t0 = bench_now_ns();
        pd_engine_step(en.eng[0], now);
        uint64_t t1 = bench_now_ns();
        pd_engine_step(en.eng[1], now);
        uint64_t t2 = bench_now_ns();
        g_scope = SCOPE_OTHER;
        tp[step] = (double)(t1 - t0) / 1e3;
        td[step] = (double)(t2 - t1) / 1e3;
        if (tr) tr->pr[step + 1] = core_probe_ns();
    }
    double secs = (double)(bench_now_ns() - t_start) / 1e9;
    double steady_steps = (double)(steps - steady_from);
    uint64_t steady_reqs = rq.submitted - submitted0;
    if (tr) { /* in step order: the medians below sort tp and td */
        memcpy(tr->tp, tp, steps * sizeof(double));
        memcpy(tr->td, td, steps * sizeof(double));
    }
    figures f = {
        .p_med = bench_median(tp, steps), .d_med = bench_median(td, steps),
        .p_p99 = bench_percentile(tp, steps, 99), .d_p99 = bench_percentile(td, steps, 99),
        .req_s = (double)en.cnt[1].ended / secs,
        .allocs_step = (double)(g_allocs[SCOPE_ENGINE] - a0[SCOPE_ENGINE]) / steady_steps,
        .allocs_xfer_step =
            (double)(g_allocs[SCOPE_TRANSPORT] - a0[SCOPE_TRANSPORT]) / steady_steps,
        .allocs_submit_req = steady_reqs
            ? (double)(g_allocs[SCOPE_SUBMIT] - a0[SCOPE_SUBMIT]) / (double)steady_reqs
            : 0.0,
    };
    for (int side = 0; side < 2; side++) pd_engine_counters_get(en.eng[side], &f.ctr[side]);
    engines_close(&en);
    free(tp);
    free(td);
    return f;
}

/* The probe's block, after every run: the fastest probe of the invocation,
 * then per live count the median over runs of the quiet share and of each
 * side's step medians (over the runs that had steps on that side). */
static double median_nonzero(const double *v, size_t n) {
    double *w = malloc(n * sizeof(double));
    PD_ASSERT(w);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (v[i] > 0) w[k++] = v[i];
    double m = bench_median(w, k);
    free(w);
    return m;
}

/* "prefill P us, decode D us" over the runs with steps on that side, or
 * "no steps" when no run had any. */
static void side_text(char *buf, size_t cap, const double *p, const double *d, size_t runs) {
    double mp = median_nonzero(p, runs), md = median_nonzero(d, runs);
    if (mp > 0) snprintf(buf, cap, "prefill %.2f us, decode %.2f us", mp, md);
    else snprintf(buf, cap, "no steps");
}

static void probe_print(trace *tr, const uint32_t *lives, uint32_t n_lives, int runs,
                        uint32_t steps) {
    uint64_t best = UINT64_MAX;
    for (size_t t = 0; t < (size_t)n_lives * (size_t)runs; t++)
        for (uint32_t i = 0; i <= steps; i++) best = PD_MIN(best, tr[t].pr[i]);
    printf("core probe: %u rounds of register-only work after each step pair, fastest %.2f us; "
           "a step is on a quiet core when the probes either side read within %.0f %% of "
           "that\n",
           (unsigned)PROBE_ITERS, (double)best / 1e3, 100.0 * (PROBE_QUIET - 1.0));
    double *v[5];
    for (int k = 0; k < 5; k++) v[k] = malloc(sizeof(double) * (size_t)runs);
    for (uint32_t li = 0; li < n_lives; li++) {
        for (int r = 0; r < runs; r++) {
            trace *t = &tr[(size_t)li * (size_t)runs + (size_t)r];
            probe_split ps = probe_split_of(t->pr, t->tp, t->td, steps, best);
            v[0][r] = ps.quiet_share, v[1][r] = ps.p_quiet, v[2][r] = ps.d_quiet;
            v[3][r] = ps.p_busy, v[4][r] = ps.d_busy;
        }
        char there[80], elsewhere[80];
        side_text(there, sizeof(there), v[1], v[2], (size_t)runs);
        side_text(elsewhere, sizeof(elsewhere), v[3], v[4], (size_t)runs);
        printf("live %4u: quiet core in %.0f %% of steps | there: %s | elsewhere: %s\n", lives[li],
               100.0 * bench_median(v[0], (size_t)runs), there, elsewhere);
    }
    for (int k = 0; k < 5; k++) free(v[k]);
}

/* --trace: one CSV line a step; false (with the reason on stderr) if the
 * file cannot be written. The probe of a line is the one after its step;
 * step -1 holds the probe before the first. */
static bool trace_write(const char *path, const trace *tr, const uint32_t *lives, uint32_t n_lives,
                        int runs, uint32_t steps) {
    FILE *f = fopen(path, "w");
    if (!f) {
        fprintf(stderr, "sched: --trace %s: %s\n", path, strerror(errno));
        return false;
    }
    fprintf(f, "live,run,step,prefill_us,decode_us,probe_ns\n");
    for (uint32_t li = 0; li < n_lives; li++)
        for (int r = 0; r < runs; r++) {
            const trace *t = &tr[(size_t)li * (size_t)runs + (size_t)r];
            fprintf(f, "%u,%d,-1,,,%llu\n", lives[li], r + 1, (unsigned long long)t->pr[0]);
            for (uint32_t i = 0; i < steps; i++)
                fprintf(f, "%u,%d,%u,%.3f,%.3f,%llu\n", lives[li], r + 1, i, t->tp[i], t->td[i],
                        (unsigned long long)t->pr[i + 1]);
        }
    bool ok = !ferror(f);
    if (fclose(f) != 0) ok = false;
    if (!ok) fprintf(stderr, "sched: --trace %s: write failed\n", path);
    return ok;
}

typedef struct opts {
    uint32_t lives[8], n_lives, steps;
    int runs;
    uint64_t seed;
    bool strict, probe;
    const char *trace_path; /* --trace: every step's times and probes, CSV */
} opts;

/* -1: go on; else the exit status (usage printed). */
static int parse_args(int argc, char **argv, opts *o) {
    *o = (opts){.lives = {64, 256, 1024},
                .n_lives = 3,
                .steps = 2000,
                .runs = 3,
                .seed = 42,
                .probe = true};
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--live") && i + 1 < argc) {
            o->n_lives = 0;
            for (char *t = strtok(argv[++i], ","); t && o->n_lives < 8; t = strtok(NULL, ","))
                o->lives[o->n_lives++] = (uint32_t)strtoul(t, NULL, 0);
        } else if (!strcmp(argv[i], "--steps") && i + 1 < argc) {
            o->steps = (uint32_t)strtoul(argv[++i], NULL, 0);
        } else if (!strcmp(argv[i], "--runs") && i + 1 < argc) {
            o->runs = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--seed") && i + 1 < argc) {
            o->seed = strtoull(argv[++i], NULL, 0);
        } else if (!strcmp(argv[i], "--strict")) {
            o->strict = true;
        } else if (!strcmp(argv[i], "--no-probe")) {
            o->probe = false;
        } else if (!strcmp(argv[i], "--trace") && i + 1 < argc) {
            o->trace_path = argv[++i];
        } else {
            fprintf(stderr,
                    "usage: sched [--live N[,N...]] [--steps N] [--runs R] [--seed S] [--strict]\n"
                    "             [--no-probe] [--trace FILE]\n"
                    "  Scheduler step cost with a zero-cost executor at N live requests\n"
                    "  (default 64,256,1024), median of R runs (default 3). Run r draws its\n"
                    "  requests from seed S + r (default 42); the decisions printed are run\n"
                    "  1's. --strict: the strict ledger instead of the counting one.\n"
                    "  The core probe times about 1.5 us of register-only work after each\n"
                    "  step pair: on a shared host it slows when another tenant runs on\n"
                    "  this core's other hardware thread. Its block, after the figures,\n"
                    "  gives per live count the share of steps on a quiet core (probes\n"
                    "  either side within 5 %% of the fastest of the whole invocation) and\n"
                    "  the step medians of those steps and of the rest. --no-probe:\n"
                    "  without it. --trace FILE: every step of every run as CSV (live, run,\n"
                    "  step, prefill us, decode us, the probe after it in ns).\n");
            return strcmp(argv[i], "--help") ? 2 : 0;
        }
    }
    if (o->runs < 1 || o->steps < 10 || o->n_lives == 0) {
        fprintf(stderr, "sched: runs >= 1, steps >= 10, at least one live count\n");
        return 2;
    }
    if (o->trace_path && !o->probe) {
        fprintf(stderr, "sched: --trace records the probe; it cannot go with --no-probe\n");
        return 2;
    }
    return -1;
}

int main(int argc, char **argv) {
    opts o;
    int status = parse_args(argc, argv, &o);
    if (status >= 0) return status;
    wrappers_check();
    uint32_t *lives = o.lives, n_lives = o.n_lives, steps = o.steps;
    int runs = o.runs;
    bool strict = o.strict;
    printf("zero-cost executor, loopback transport, page 16, prompts 64..512 "
           "(shared system prompts), %u steps per run, %s ledger, median of %d runs, "
           "%s build\n",
           steps, strict ? "strict" : "counting", runs, pd_build_kind());
    enum { NV = 8 };
    double *v[NV];
    for (int k = 0; k < NV; k++) v[k] = malloc(sizeof(double) * (size_t)runs);
    size_t n_tr = o.probe ? (size_t)n_lives * (size_t)runs : 0;
    trace *tr = calloc(n_tr ? n_tr : 1, sizeof(trace));
    PD_ASSERT(tr);
    for (size_t t = 0; t < n_tr; t++) {
        tr[t].tp = malloc(steps * sizeof(double));
        tr[t].td = malloc(steps * sizeof(double));
        tr[t].pr = malloc((steps + 1) * sizeof(uint64_t));
        PD_ASSERT(tr[t].tp && tr[t].td && tr[t].pr);
    }
    for (uint32_t li = 0; li < n_lives; li++) {
        pd_engine_counters first[2] = {0};
        for (int r = 0; r < runs; r++) {
            trace *t = n_tr ? &tr[(size_t)li * (size_t)runs + (size_t)r] : NULL;
            figures f = run(lives[li], steps, strict, o.seed + (uint64_t)r, t);
            if (r == 0) memcpy(first, f.ctr, sizeof(first));
            v[0][r] = f.p_med;
            v[1][r] = f.p_p99;
            v[2][r] = f.d_med;
            v[3][r] = f.d_p99;
            v[4][r] = f.req_s;
            v[5][r] = f.allocs_step;
            v[6][r] = f.allocs_xfer_step;
            v[7][r] = f.allocs_submit_req;
        }
        printf("live %4u: prefill step median %.2f us p99 %.2f us | "
               "decode step median %.2f us p99 %.2f us | %.0f requests/s\n",
               lives[li], bench_median(v[0], (size_t)runs), bench_median(v[1], (size_t)runs),
               bench_median(v[2], (size_t)runs), bench_median(v[3], (size_t)runs),
               bench_median(v[4], (size_t)runs));
        printf("           steady-state allocations: %.2f per engine step | "
               "%.2f per request at submit | loopback transport %.2f per step\n",
               bench_median(v[5], (size_t)runs), bench_median(v[7], (size_t)runs),
               bench_median(v[6], (size_t)runs));
        printf("           decisions of run 1: prefill %llu batches, %llu tokens computed, %llu "
               "cached | decode %llu batches, %llu tokens, %llu cached | %llu finished\n",
               (unsigned long long)first[0].batches, (unsigned long long)first[0].prefill_tokens,
               (unsigned long long)first[0].cached_tokens, (unsigned long long)first[1].batches,
               (unsigned long long)first[1].decode_tokens,
               (unsigned long long)first[1].cached_tokens, (unsigned long long)first[1].finished);
    }
    if (n_tr) probe_print(tr, lives, n_lives, runs, steps);
    if (o.trace_path && !trace_write(o.trace_path, tr, lives, n_lives, runs, steps)) status = 1;
    for (size_t t = 0; t < n_tr; t++) free(tr[t].tp), free(tr[t].td), free(tr[t].pr);
    free(tr);
    for (int k = 0; k < NV; k++) free(v[k]);
    return status < 0 ? 0 : status;
}
