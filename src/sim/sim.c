/*
 * sim.c — the simulator: a world of two engines, two synthetic executors and
 * the loopback transport, driven by lines of the scenario language.
 *
 * Layout of this file:
 *   world     creation of the nodes, the tick, the checks after every line
 *   lines     the scenario language interpreter (one function per command)
 *   end       the end-of-run verification (exactly once, idle-clean, tokens)
 *   random    the generator of random scenarios (--seed, --seeds)
 *   scenario  file replay (--scenario)
 *   explore   exhaustive exploration of a small configuration (--explore)
 *
 * Time: one tick = the transport advances, each executor runs what is
 * queued (a batch launched in tick t completes in tick t+1 unless held), then
 * each engine steps. Timeouts are counted in ticks.
 */
#include "pdserve/sim.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "pdserve/engine.h"
#include "pdserve/loopback.h"
#include "pdserve/model.h"
#include "pdserve/stream.h"
#include "pdserve/synth.h"
#include "oracle.h"

#define SIDE_P 0
#define SIDE_D 1
#define TAIL_LINES 60
#define DRAIN_TICKS_MAX 20000
#define CHUNKS_TRACKED 32
#define CHECK_TEXT_MAX 16384
#define TRACE_LINE_MAX 512      /* bytes of a trace line, with its NUL */
#define VIOLATION_TEXT_MAX 1024 /* bytes of one violation's text, with its NUL */
#define VIOLATIONS_REPORTED 5   /* the first ones go into the report in full */
/* The failure report: the first violations ("violation: " text "\n"), the
 * scenario heading, the configuration line and the last TAIL_LINES lines. */
#define REPORT_BYTES \
    (VIOLATIONS_REPORTED * (VIOLATION_TEXT_MAX + 16) + 1024 + TAIL_LINES * TRACE_LINE_MAX)

/* ---- configuration --------------------------------------------------------- */

typedef struct sim_cfg {
    uint32_t page_size, chunk, kv_pages, decode_kv_pages, rows, meta_rows, mamba_slots;
    uint32_t host_pages, batch, requests_max, optimistic, new_max;
    uint32_t bootstrap_timeout, transfer_timeout, latency, grace;
    uint32_t vocab, layers;
    uint32_t exec_jitter, xfer_jitter; /* extra ticks a forward / a transport operation may take */
    bool tiny;                         /* the tiny hybrid model instead of the synthetic one */
    uint64_t jitter_seed;
    bool mamba, overlap, prefix_cache;
} sim_cfg;

static void cfg_default(sim_cfg *c) {
    *c = (sim_cfg){
        .page_size = 4, .chunk = 8, .kv_pages = 64, .decode_kv_pages = 64, .rows = 4,
        .meta_rows = 8, .mamba_slots = 0, .host_pages = 0, .batch = 4, .requests_max = 128,
        .optimistic = 0, .new_max = 16, .bootstrap_timeout = 80, .transfer_timeout = 80,
        .latency = 1, .grace = 5, .vocab = 97, .layers = 2,
        .mamba = true, .overlap = true, .prefix_cache = true,
    };
}

static uint32_t cfg_mamba_slots(const sim_cfg *c) {
    return c->mamba ? (c->mamba_slots ? c->mamba_slots : c->rows * 3 + 4) : 0;
}

static void cfg_format(const sim_cfg *c, char *out, size_t cap) {
    snprintf(out, cap,
             "config page_size=%u chunk=%u kv_pages=%u decode_kv_pages=%u rows=%u meta_rows=%u "
             "mamba=%s mamba_slots=%u overlap=%s optimistic=%u prefix_cache=%s host_pages=%u "
             "batch=%u requests_max=%u new_max=%u bootstrap_timeout=%u transfer_timeout=%u "
             "latency=%u grace=%u exec_jitter=%u xfer_jitter=%u jitter_seed=%llu vocab=%u "
             "layers=%u",
             c->page_size, c->chunk, c->kv_pages, c->decode_kv_pages, c->rows, c->meta_rows,
             c->mamba ? "on" : "off", cfg_mamba_slots(c), c->overlap ? "on" : "off", c->optimistic,
             c->prefix_cache ? "on" : "off", c->host_pages, c->batch, c->requests_max, c->new_max,
             c->bootstrap_timeout, c->transfer_timeout, c->latency, c->grace, c->exec_jitter,
             c->xfer_jitter, (unsigned long long)c->jitter_seed, c->vocab, c->layers);
    if (c->tiny) {
        size_t n = strlen(out);
        snprintf(out + n, cap > n ? cap - n : 0, " model=tiny");
    }
}

/* ---- the world ----------------------------------------------------------------- */

typedef struct sreq {
    char rid[40];
    uint64_t room;
    int32_t *prompt;
    uint32_t len, max_new;
    pd_sampling sampling;
    bool ignore_eos;
    bool sent[2], acc[2], lost[2];
    uint32_t terms[2];
    pd_terminal_kind kind[2];
    pd_finish_reason finish[2];
    int status[2];
    int32_t *tokens;
    uint32_t n_tokens;
    uint64_t term_seq[2];        /* when each node's terminal event came (O3) */
    uint64_t owner_p;
    uint32_t chunks;
    uint32_t hold_mask;
    uint64_t chunk_batch[CHUNKS_TRACKED + 1];
    bool boot_held, xfer_held;   /* random generator bookkeeping */
} sreq;

typedef struct node {
    bool alive;
    pd_engine *eng;
    pd_synth *synth;        /* the inner executor: synthetic ... */
    pd_executor model_ex;   /* ... or the tiny model (model_ex.vt != NULL) */
    pd_stream *st;          /* the in-order stream around it */
    pd_meta_row *meta;
    struct sim *sim;
    int side;
} node;

typedef struct sim {
    sim_cfg cfg;
    bool built;
    pd_loopback *lb;
    sim_oracle *oracle;          /* judges every action the engines report */
    node nodes[2];
    uint64_t now;
    sreq *reqs;
    uint32_t n_reqs, cap_reqs;
    uint32_t rejected;
    FILE *trace;
    char *tail[TAIL_LINES];
    uint32_t tail_n, tail_pos;
    uint32_t pending_steps;
    uint32_t violations;
    pd_strbuf report; /* over report_text */
    uint64_t events, steps;
    pd_rng jitter;               /* forward delays (config exec_jitter, jitter_seed) */
    pd_model *model;             /* tiny model weights, shared by both nodes */
    bool hold_all_prefill;       /* explorer: every prefill batch is held at launch */
    bool hold_clear;             /* explorer: no more holds (draining) */
    uint32_t lineno;
    const char *name;
    uint64_t term_seq;           /* terminal events so far, both nodes */
    void (*on_violation)(void *ctx, const char *msg); /* pd_sim_options */
    void *violation_ctx;
    uint32_t last_ended;         /* the request whose terminal event came last (+1; 0: none) */
    char check_text[CHECK_TEXT_MAX]; /* pd_engine_check's report (check_nodes, idle-clean) */
    char report_text[REPORT_BYTES];  /* what a failed run reports (finish_run) */
} sim;

static const char *side_name(int side) { return side == SIDE_P ? "prefill" : "decode"; }

/* An empty world: no node, no request, the report empty. */
static void sim_init(sim *s) {
    memset(s, 0, sizeof(*s));
    pd_strbuf_init(&s->report, s->report_text, sizeof(s->report_text));
}

static void violation(sim *s, const char *fmt, ...) {
    char buf[VIOLATION_TEXT_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    s->violations++;
    if (s->on_violation) s->on_violation(s->violation_ctx, buf);
    if (s->violations <= VIOLATIONS_REPORTED) pd_strbuf_printf(&s->report, "violation: %s\n", buf);
}

static sreq *find_req(sim *s, const char *rid) {
    /* The latest request with this rid (rids may be reused once ended). */
    for (uint32_t i = s->n_reqs; i-- > 0;)
        if (strcmp(s->reqs[i].rid, rid) == 0) return &s->reqs[i];
    return NULL;
}

static sreq *find_by_owner(sim *s, uint64_t owner) {
    for (uint32_t i = s->n_reqs; i-- > 0;)
        if (s->reqs[i].owner_p == owner && s->reqs[i].acc[SIDE_P]) return &s->reqs[i];
    return NULL;
}

/* A request still expects a terminal event from the node. */
static bool live_on(const sreq *r, int side) {
    return r->acc[side] && !r->lost[side] && r->terms[side] == 0;
}

/* ---- callbacks --------------------------------------------------------------- */

/* The request a sink event names: its tag is the request's index in s->reqs
 * (submit_to_nodes), and that request has the event's rid. */
static sreq *req_of_event(sim *s, int side, uint64_t tag, const char *rid, const char *what) {
    if (tag < s->n_reqs && strcmp(s->reqs[tag].rid, rid) == 0) return &s->reqs[tag];
    violation(s, "%s emitted %s for rid %s with tag %llu, which names %s", side_name(side), what,
              rid, (unsigned long long)tag, tag < s->n_reqs ? s->reqs[tag].rid : "no request");
    return NULL;
}

static void on_token(void *self, uint64_t tag, const char *rid, uint64_t room, int32_t token,
                     float lp, uint32_t index) {
    (void)room;
    (void)lp;
    node *n = self;
    sim *s = n->sim;
    sreq *r = req_of_event(s, n->side, tag, rid, "a token");
    if (!r) return;
    if (n->side != SIDE_D) {
        violation(s, "prefill emitted a token for %s", rid);
        return;
    }
    if (r->terms[SIDE_D] > 0) violation(s, "%s: token after the terminal event", rid);
    if (index != r->n_tokens)
        violation(s, "%s: token index %u, expected %u", rid, index, r->n_tokens);
    if (r->n_tokens >= r->max_new) {
        violation(s, "%s: more than max_new_tokens=%u tokens", rid, r->max_new);
        return;
    }
    r->tokens[r->n_tokens++] = token;
}

static void on_terminal(void *self, const pd_terminal_event *ev) {
    node *n = self;
    sim *s = n->sim;
    sreq *r = req_of_event(s, n->side, ev->tag, ev->rid, "a terminal event");
    if (!r) return;
    int side = n->side;
    r->terms[side]++;
    if (r->terms[side] > 1)
        violation(s, "%s: %u terminal events on %s (%s after %s)", r->rid, r->terms[side],
                  side_name(side), pd_terminal_kind_name(ev->kind),
                  pd_terminal_kind_name(r->kind[side]));
    r->kind[side] = ev->kind;
    r->finish[side] = ev->finish;
    r->status[side] = ev->status_code;
    r->term_seq[side] = ++s->term_seq;
    uint32_t client = (uint32_t)(r - s->reqs);
    s->last_ended = client + 1;
    oracle_terminal_seen(s->oracle, side, client, r->rid, ev->kind);
}

static void on_action(void *ctx, const pd_action_event *ev) {
    node *n = ctx;
    oracle_on_action(n->sim->oracle, n->side, ev);
}

static void on_oracle_violation(void *ctx, const char *msg) { violation(ctx, "%s", msg); }

static bool on_oracle_drained(void *ctx, int side, uint64_t room) {
    sim *s = ctx;
    pd_xfer x = pd_loopback_endpoint(s->lb, side == SIDE_P ? PD_LB_PREFILL : PD_LB_DECODE);
    return x.vt->drained(x.self, room);
}

/* The ledger pool of the engine that holds units of this loopback region. */
static int pool_of(pd_ledger *l, pd_lb_region region) {
    static const pd_pool_kind kinds[] = {
        [PD_LB_KV] = PD_POOL_KV, [PD_LB_MAMBA] = PD_POOL_MAMBA, [PD_LB_META] = PD_POOL_META};
    for (int id = 0; id < pd_ledger_pool_count(l); id++)
        if (pd_pool_kind_of(pd_ledger_pool(l, id)) == kinds[region]) return id;
    return -1;
}

/* [X1] What the fabric really does, against who owns what: a write of room R
 * may touch a unit only while that node holds it for R — the request of room
 * R has it, or it is quarantined for R — or, for the prefill's KV source, while
 * its prefix cache holds it (a cached page keeps its bytes until eviction
 * hands it out again). This judges the transport's drained() instead of
 * trusting it, as the oracle's A5 does. */
static void on_touch(void *ctx, pd_lb_side lside, pd_lb_region region, uint32_t unit,
                     uint64_t room) {
    sim *s = ctx;
    int side = lside == PD_LB_PREFILL ? SIDE_P : SIDE_D;
    node *n = &s->nodes[side];
    if (!n->alive || !n->eng) return;
    pd_ledger *l = pd_engine_ledger(n->eng);
    int pool = pool_of(l, region);
    PD_ASSERT(pool >= 0);
    pd_unit_state st = pd_ledger_state_of(l, pool, unit);
    pd_owner owner = pd_ledger_owner_of(l, pool, unit);
    uint64_t held_for = 0;
    if (st == PD_UNIT_QUARANTINE && owner == room) return;
    if (st == PD_UNIT_REQ && oracle_room_of(s->oracle, side, owner, &held_for) && held_for == room)
        return;
    bool cached = st == PD_UNIT_CACHE_EVICTABLE || st == PD_UNIT_CACHE_PROTECTED;
    if (cached && side == SIDE_P && region == PD_LB_KV) return;
    const char *region_name[] = {"KV page", "Mamba slot", "metadata row"};
    char holder[96];
    if (st == PD_UNIT_REQ)
        snprintf(holder, sizeof(holder), "held by the request of room %llu",
                 (unsigned long long)held_for);
    else if (st == PD_UNIT_QUARANTINE)
        snprintf(holder, sizeof(holder), "quarantined for room %llu", (unsigned long long)owner);
    else snprintf(holder, sizeof(holder), "%s", cached ? "in the prefix cache" : "free");
    violation(s, "[X1] a write of room %llu touched %s %s %u, which is %s",
              (unsigned long long)room, side_name(side), region_name[region], unit, holder);
}

static int jitter_delay(sim *s) {
    return s->cfg.exec_jitter ? (int)pd_rng_below(&s->jitter, s->cfg.exec_jitter + 1) : 0;
}

static int on_launch_prefill(void *ctx, uint64_t batch_id, const pd_batch_item *it) {
    sim *s = ctx;
    if (s->hold_all_prefill) return s->hold_clear ? 0 : PD_STREAM_HOLD;
    int delay = jitter_delay(s);
    sreq *r = find_by_owner(s, it->req);
    if (!r) return delay;
    uint32_t k = ++r->chunks;
    if (k <= CHUNKS_TRACKED) r->chunk_batch[k] = batch_id;
    return k <= CHUNKS_TRACKED && (r->hold_mask >> (k - 1)) & 1u ? PD_STREAM_HOLD : delay;
}

static int on_launch_decode(void *ctx, uint64_t batch_id, const pd_batch_item *it) {
    (void)batch_id;
    (void)it;
    return jitter_delay(ctx);
}

static const pd_sink_vtable sink_vt = {.token = on_token, .terminal = on_terminal};

/* ---- building the world ------------------------------------------------------ */

static pd_err node_build(sim *s, int side, char *msg, size_t cap) {
    const sim_cfg *c = &s->cfg;
    node *n = &s->nodes[side];
    n->sim = s;
    n->side = side;
    uint32_t kv = side == SIDE_P ? c->kv_pages : c->decode_kv_pages;
    uint32_t mamba = cfg_mamba_slots(c);
    pd_err err;
    pd_executor inner;
    uint32_t host = side == SIDE_P ? c->host_pages : 0;
    if (c->tiny) {
        err = pd_model_executor_create(&n->model_ex, s->model, c->page_size, kv, mamba, host, 1,
                                       msg, cap);
        if (err) return err;
        inner = n->model_ex;
    } else {
        pd_synth_config sc = {
            .page_size = c->page_size, .kv_pages = kv, .mamba_slots = mamba, .host_pages = host,
            .layers = c->layers, .vocab = c->vocab, .eos_token = (int32_t)c->vocab - 1,
            .batch_max = c->batch,
        };
        err = pd_synth_create(&n->synth, &sc);
        if (err) return pd_errorf(msg, cap, err, "synthetic executor: bad configuration");
        inner = pd_synth_executor(n->synth);
    }
    if ((err = pd_stream_create(&n->st, inner, c->batch)))
        return pd_errorf(msg, cap, err, "stream");
    pd_stream_set_hold_fn(n->st, side == SIDE_P ? on_launch_prefill : on_launch_decode, s);
    n->meta = calloc(c->meta_rows, sizeof(pd_meta_row));
    if (!n->meta) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory for metadata rows");
    pd_engine_config ec;
    pd_engine_config_default(&ec, side == SIDE_P ? PD_ROLE_PREFILL : PD_ROLE_DECODE);
    ec.page_size = c->page_size;
    ec.kv_pages = kv;
    ec.rows = c->rows;
    ec.mamba_slots = mamba;
    ec.meta_rows = c->meta_rows;
    ec.host_pages = side == SIDE_P ? c->host_pages : 0;
    ec.requests_max = c->requests_max;
    ec.chunk_tokens = c->chunk;
    ec.batch_max = c->batch;
    ec.new_tokens_max = c->new_max;
    ec.overlap = c->overlap;
    ec.optimistic_attempts = c->optimistic;
    ec.prefix_cache = c->prefix_cache;
    ec.strict = true;
    ec.bootstrap_timeout_us = c->bootstrap_timeout;
    ec.transfer_timeout_us = c->transfer_timeout;
    ec.meta_mem = n->meta;
    pd_sink sink = {.vt = &sink_vt, .self = n};
    pd_xfer xfer = pd_loopback_endpoint(s->lb, side == SIDE_P ? PD_LB_PREFILL : PD_LB_DECODE);
    err = pd_engine_create(&n->eng, &ec, pd_stream_executor(n->st), xfer, sink, msg, cap);
    if (err) return err;
    pd_engine_set_action_observer(n->eng, on_action, n);
    pd_exec_memory mem;
    pd_executor ex = pd_stream_executor(n->st);
    ex.vt->memory(ex.self, &mem);
    pd_loopback_register(s->lb, side == SIDE_P ? PD_LB_PREFILL : PD_LB_DECODE, &mem, n->meta,
                         c->meta_rows);
    n->alive = true;
    return PD_OK;
}

static void node_destroy(node *n) {
    pd_engine_destroy(n->eng);
    pd_stream_destroy(n->st);
    pd_synth_destroy(n->synth);
    if (n->model_ex.vt) pd_model_executor_destroy(&n->model_ex);
    memset(&n->model_ex, 0, sizeof(n->model_ex));
    n->synth = NULL;
    free(n->meta);
    n->eng = NULL;
    n->st = NULL;
    n->meta = NULL;
    n->alive = false;
}

static pd_err world_build(sim *s, char *msg, size_t cap) {
    if (s->built) return PD_OK;
    const sim_cfg *c = &s->cfg;
    pd_loopback_config lc = {.latency = c->latency, .dead_grace = c->grace,
                             .rooms_max = c->requests_max * 4, .page_size = c->page_size,
                             .jitter = c->xfer_jitter, .jitter_seed = c->jitter_seed ^ 0x5EED};
    pd_rng_seed(&s->jitter, c->jitter_seed);
    pd_err err = pd_loopback_create(&s->lb, &lc);
    if (err) return pd_errorf(msg, cap, err, "transport: bad configuration");
    s->oracle = oracle_create(c->requests_max, on_oracle_violation, on_oracle_drained, s);
    if (!s->oracle) return pd_errorf(msg, cap, PD_ERR_NOMEM, "oracle: out of memory");
    pd_loopback_set_touch_observer(s->lb, on_touch, s);
    if (c->tiny) {
        pd_model_config mc;
        if ((err = pd_model_config_preset(&mc, "tiny", msg, cap))) return err;
        snprintf(mc.layers, sizeof(mc.layers), "%s", c->mamba ? "MAMA" : "AAAA");
        if ((err = pd_model_create_random(&s->model, &mc, 1234, msg, cap))) return err;
        if (s->cfg.vocab > mc.vocab) s->cfg.vocab = mc.vocab;
    }
    for (int side = 0; side < 2; side++)
        if ((err = node_build(s, side, msg, cap))) return err;
    s->built = true;
    return PD_OK;
}

static void sim_free(sim *s) {
    for (int side = 0; side < 2; side++)
        if (s->nodes[side].eng || s->nodes[side].st) node_destroy(&s->nodes[side]);
    pd_loopback_destroy(s->lb);
    oracle_destroy(s->oracle);
    pd_model_destroy(s->model);
    for (uint32_t i = 0; i < s->n_reqs; i++) {
        free(s->reqs[i].prompt);
        free(s->reqs[i].tokens);
    }
    free(s->reqs);
    for (uint32_t i = 0; i < TAIL_LINES; i++) free(s->tail[i]);
}

/* Both engines' checks: ledger, clean idle, flags, prefix cache. */
static void check_nodes(sim *s, const char *after) {
    for (int side = 0; side < 2; side++) {
        node *n = &s->nodes[side];
        if (!n->alive) continue;
        pd_strbuf sb;
        pd_strbuf_init(&sb, s->check_text, sizeof(s->check_text));
        if (pd_engine_check(n->eng, &sb) != PD_OK)
            violation(s, "%s check failed after \"%s\" (tick %llu):\n%s", side_name(side), after,
                      (unsigned long long)s->now, s->check_text);
    }
}

static void tick(sim *s) {
    s->now++;
    s->steps++;
    pd_loopback_advance(s->lb, s->now);
    for (int side = 0; side < 2; side++) {
        if (!s->nodes[side].alive) continue;
        pd_stream_set_now(s->nodes[side].st, s->now);
        pd_stream_run(s->nodes[side].st);
    }
    for (int side = 0; side < 2; side++)
        if (s->nodes[side].alive) pd_engine_step(s->nodes[side].eng, s->now);
}

/* ---- trace --------------------------------------------------------------------- */

static void trace_emit(sim *s, const char *line) {
    /* Written only to the caller's FILE (pd_sim_options.trace), never printed. */
    if (s->trace) {
        fputs(line, s->trace);
        fputc('\n', s->trace);
    }
    free(s->tail[s->tail_pos]);
    s->tail[s->tail_pos] = strdup(line);
    PD_ASSERT(s->tail[s->tail_pos]); /* the simulator's own bookkeeping: small, bounded */
    s->tail_pos = (s->tail_pos + 1) % TAIL_LINES;
    if (s->tail_n < TAIL_LINES) s->tail_n++;
}

static void trace_flush_steps(sim *s) {
    if (s->pending_steps == 0) return;
    char line[32];
    snprintf(line, sizeof(line), "step %u", s->pending_steps);
    s->pending_steps = 0;
    trace_emit(s, line);
}

static void trace_line(sim *s, const char *line) {
    /* Consecutive single steps collapse into one "step N" line. */
    if (strcmp(line, "step 1") == 0) {
        s->pending_steps++;
        return;
    }
    trace_flush_steps(s);
    trace_emit(s, line);
}

static void report_tail(sim *s) {
    trace_flush_steps(s);
    char cfg[480];
    cfg_format(&s->cfg, cfg, sizeof(cfg));
    pd_strbuf_printf(&s->report,
                     "# the run as a scenario (configuration and the last lines):\n"
                     "%s\n",
                     cfg);
    if (s->tail_n == TAIL_LINES)
        pd_strbuf_append(&s->report, "# ... earlier lines omitted (use --trace FILE for all)\n");
    for (uint32_t i = 0; i < s->tail_n; i++) {
        uint32_t k = (s->tail_pos + TAIL_LINES - s->tail_n + i) % TAIL_LINES;
        if (!strncmp(s->tail[k], "config ", 7)) continue;
        pd_strbuf_printf(&s->report, "%s\n", s->tail[k]);
    }
}

/* ---- the scenario language --------------------------------------------------------- */

#define ARGS_MAX 48

typedef struct line_args {
    char *w[ARGS_MAX];
    int n;
} line_args;

static const char *arg(const line_args *a, const char *key) {
    size_t kl = strlen(key);
    for (int i = 1; i < a->n; i++)
        if (strncmp(a->w[i], key, kl) == 0 && a->w[i][kl] == '=') return a->w[i] + kl + 1;
    return NULL;
}

static bool parse_u32(const char *v, uint32_t *out) {
    if (!v || !*v) return false;
    char *end;
    unsigned long x = strtoul(v, &end, 10);
    if (*end || x > UINT32_MAX) return false;
    *out = (uint32_t)x;
    return true;
}

static bool parse_onoff(const char *v, bool *out) {
    if (!v) return false;
    if (!strcmp(v, "on") || !strcmp(v, "1") || !strcmp(v, "true")) *out = true;
    else if (!strcmp(v, "off") || !strcmp(v, "0") || !strcmp(v, "false")) *out = false;
    else return false;
    return true;
}

static pd_err cmd_config(sim *s, const line_args *a, char *msg, size_t cap) {
    if (s->built) return pd_errorf(msg, cap, PD_ERR_STATE, "config must come before anything else");
    sim_cfg *c = &s->cfg;
    for (int i = 1; i < a->n; i++) {
        char key[32];
        const char *eq = strchr(a->w[i], '=');
        if (!eq || (size_t)(eq - a->w[i]) >= sizeof(key))
            return pd_errorf(msg, cap, PD_ERR_PARSE, "config: '%s' is not key=value", a->w[i]);
        memcpy(key, a->w[i], (size_t)(eq - a->w[i]));
        key[eq - a->w[i]] = 0;
        const char *v = eq + 1;
        bool ok = true;
        if (!strcmp(key, "page_size")) ok = parse_u32(v, &c->page_size);
        else if (!strcmp(key, "chunk")) ok = parse_u32(v, &c->chunk);
        else if (!strcmp(key, "kv_pages")) {
            ok = parse_u32(v, &c->kv_pages);
            c->decode_kv_pages = c->kv_pages;
        } else if (!strcmp(key, "decode_kv_pages")) ok = parse_u32(v, &c->decode_kv_pages);
        else if (!strcmp(key, "rows")) ok = parse_u32(v, &c->rows);
        else if (!strcmp(key, "meta_rows")) ok = parse_u32(v, &c->meta_rows);
        else if (!strcmp(key, "mamba")) ok = parse_onoff(v, &c->mamba);
        else if (!strcmp(key, "mamba_slots")) ok = parse_u32(v, &c->mamba_slots);
        else if (!strcmp(key, "overlap")) ok = parse_onoff(v, &c->overlap);
        else if (!strcmp(key, "optimistic")) ok = parse_u32(v, &c->optimistic);
        else if (!strcmp(key, "prefix_cache")) ok = parse_onoff(v, &c->prefix_cache);
        else if (!strcmp(key, "host_pages")) ok = parse_u32(v, &c->host_pages);
        else if (!strcmp(key, "batch")) ok = parse_u32(v, &c->batch);
        else if (!strcmp(key, "requests_max")) ok = parse_u32(v, &c->requests_max);
        else if (!strcmp(key, "new_max")) ok = parse_u32(v, &c->new_max);
        else if (!strcmp(key, "bootstrap_timeout")) ok = parse_u32(v, &c->bootstrap_timeout);
        else if (!strcmp(key, "transfer_timeout")) ok = parse_u32(v, &c->transfer_timeout);
        else if (!strcmp(key, "timeout")) {
            ok = parse_u32(v, &c->bootstrap_timeout);
            c->transfer_timeout = c->bootstrap_timeout;
        } else if (!strcmp(key, "latency")) ok = parse_u32(v, &c->latency);
        else if (!strcmp(key, "grace")) ok = parse_u32(v, &c->grace);
        else if (!strcmp(key, "layers")) ok = parse_u32(v, &c->layers);
        else if (!strcmp(key, "vocab")) ok = parse_u32(v, &c->vocab);
        else if (!strcmp(key, "exec_jitter")) ok = parse_u32(v, &c->exec_jitter);
        else if (!strcmp(key, "model")) {
            ok = !strcmp(v, "tiny") || !strcmp(v, "synth");
            c->tiny = !strcmp(v, "tiny");
        }
        else if (!strcmp(key, "xfer_jitter")) ok = parse_u32(v, &c->xfer_jitter);
        else if (!strcmp(key, "jitter_seed")) {
            uint32_t js;
            ok = parse_u32(v, &js);
            c->jitter_seed = js;
        }
        else return pd_errorf(msg, cap, PD_ERR_PARSE, "config: unknown key '%s'", key);
        if (!ok) return pd_errorf(msg, cap, PD_ERR_PARSE, "config: bad value for %s: '%s'", key, v);
    }
    if (c->page_size == 0 || c->chunk == 0 || c->kv_pages == 0 || c->decode_kv_pages == 0 ||
        c->rows == 0 || c->meta_rows == 0 || c->batch == 0 || c->vocab < 4 || c->layers == 0 ||
        c->requests_max == 0 || c->latency == 0)
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "config: sizes, latency and vocab must be positive");
    if (c->host_pages && !c->prefix_cache)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "config: host_pages needs prefix_cache=on");
    return PD_OK;
}

static int parse_at(const line_args *a) {
    const char *at = arg(a, "at");
    if (!at || !strcmp(at, "both")) return 3;
    if (!strcmp(at, "prefill")) return 1;
    if (!strcmp(at, "decode")) return 2;
    return -1;
}

static void prompt_for(sim *s, const char *rid, int32_t *out, uint32_t len) {
    uint64_t seed = 0xC0FFEE;
    for (const char *p = rid; *p; p++) seed = seed * 131 + (unsigned char)*p;
    for (uint32_t i = 0; i < len; i++)
        out[i] = (int32_t)(pd_hash_u64(seed + i) % (s->cfg.vocab - 1));
}

static void sreq_free(sreq *r) {
    free(r->prompt);
    free(r->tokens);
}

/* prefix=RID:K: the prompt starts with the first K tokens of RID's (at most
 * as many as either prompt has). */
static pd_err copy_prefix(sim *s, const char *pre, int32_t *prompt, uint32_t len, char *msg,
                          size_t cap) {
    char src[40];
    const char *colon = strchr(pre, ':');
    uint32_t k;
    if (!colon || (size_t)(colon - pre) >= sizeof(src) || !parse_u32(colon + 1, &k))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "submit: prefix=RID:K");
    memcpy(src, pre, (size_t)(colon - pre));
    src[colon - pre] = 0;
    sreq *from = find_req(s, src);
    if (!from) return pd_errorf(msg, cap, PD_ERR_NOTFOUND, "submit: prefix source %s unknown", src);
    k = PD_MIN(PD_MIN(k, from->len), len);
    memcpy(prompt, from->prompt, k * sizeof(int32_t));
    return PD_OK;
}

/* The client's request a submit line describes, not sent yet: its room (the
 * live original's when dup is set), its prompt and sampling. On an error
 * nothing is left allocated. */
static pd_err sreq_make(sim *s, const line_args *a, uint32_t len, uint32_t max_new, const sreq *dup,
                        sreq *out, char *msg, size_t cap) {
    const char *rid = a->w[1];
    sreq tmp;
    memset(&tmp, 0, sizeof(tmp));
    snprintf(tmp.rid, sizeof(tmp.rid), "%s", rid);
    /* The raw FNV-1a, as always: rooms (and the sampling seeds drawn from
     * them) stay what every seed and scenario was run with. */
    tmp.room = pd_hash_u64(pd_hash_fnv1a(rid) ^ ((uint64_t)s->n_reqs << 40)) | 1;
    if (dup) tmp.room = dup->room; /* the same request submitted twice */
    tmp.len = len;
    tmp.max_new = max_new;
    tmp.prompt = malloc((len + 1) * sizeof(int32_t));
    tmp.tokens = malloc((max_new + 1) * sizeof(int32_t));
    if (!tmp.prompt || !tmp.tokens) {
        sreq_free(&tmp);
        return pd_errorf(msg, cap, PD_ERR_NOMEM, "submit: out of memory for %u tokens", len);
    }
    prompt_for(s, rid, tmp.prompt, len);
    const char *pre = arg(a, "prefix");
    pd_err err = pre ? copy_prefix(s, pre, tmp.prompt, len, msg, cap) : PD_OK;
    if (err) {
        sreq_free(&tmp);
        return err;
    }
    const char *temp = arg(a, "temp");
    tmp.sampling.top_p = 1.0f;
    if (temp) tmp.sampling.temperature = (float)atof(temp);
    tmp.sampling.seed = pd_hash_u64(tmp.room);
    tmp.ignore_eos = arg(a, "ignore_eos") != NULL;
    *out = tmp;
    return PD_OK;
}

/* Sends r to the live nodes `at` names (bit 0 prefill, bit 1 decode),
 * recording where it went and was accepted. A duplicate of a live rid (dup:
 * the original) goes only where the original is live, and must be refused
 * there with 409. True if a node accepted it. */
static bool submit_to_nodes(sim *s, sreq *r, int at, const sreq *dup) {
    pd_request_spec spec = {
        .rid = r->rid,
        .room = r->room,
        .prompt = r->prompt,
        .prompt_len = r->len,
        .max_new_tokens = r->max_new,
        .sampling = r->sampling,
        .ignore_eos = r->ignore_eos,
        .peer = "loopback",
        .tag = s->n_reqs, /* r's index once cmd_submit appends it (a refused one's is unused) */
    };
    bool accepted_any = false;
    for (int side = 0; side < 2; side++) {
        if (!(at & (1 << side))) continue;
        /* A duplicate goes where the original is still live, and must be refused there. */
        if (dup && !live_on(dup, side)) continue;
        node *n = &s->nodes[side];
        if (!n->alive) continue; /* the node is down: the client's request never gets there */
        r->sent[side] = true;
        pd_reject why;
        pd_err err = pd_engine_submit(n->eng, &spec, s->now, &why);
        r->acc[side] = err == PD_OK;
        accepted_any |= r->acc[side];
        if (dup && (r->acc[side] || why.status != 409))
            violation(s, "%s: duplicate of a live rid answered %s on %s, expected 409", r->rid,
                      r->acc[side] ? "accepted" : "a different status", side_name(side));
        if (!dup && !r->acc[side] && why.status == 409)
            violation(s, "%s: refused on %s as a duplicate (%s), but no request with that rid "
                         "is live there", r->rid, side_name(side), why.message);
        if (side == SIDE_P && r->acc[side]) r->owner_p = pd_engine_request_id(n->eng, r->rid);
    }
    return accepted_any;
}

static pd_err reqs_append(sim *s, const sreq *r, char *msg, size_t cap) {
    if (s->n_reqs == s->cap_reqs) {
        uint32_t grown_cap = s->cap_reqs ? s->cap_reqs * 2 : 64;
        sreq *grown = realloc(s->reqs, grown_cap * sizeof(sreq));
        if (!grown) return pd_errorf(msg, cap, PD_ERR_NOMEM, "submit: out of memory for requests");
        s->reqs = grown;
        s->cap_reqs = grown_cap;
    }
    s->reqs[s->n_reqs++] = *r;
    return PD_OK;
}

static pd_err cmd_submit(sim *s, const line_args *a, char *msg, size_t cap) {
    if (a->n < 3)
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "usage: submit RID len=N [max_new=N] [prefix=RID:K] [temp=F] [at=...]");
    const char *rid = a->w[1];
    if (strlen(rid) >= 40) return pd_errorf(msg, cap, PD_ERR_PARSE, "rid too long");
    uint32_t len, max_new = 4;
    if (!parse_u32(arg(a, "len"), &len) || len > (1u << 20))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "submit: len=N is required");
    if (arg(a, "max_new") && !parse_u32(arg(a, "max_new"), &max_new))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "submit: bad max_new");
    int at = parse_at(a);
    if (at < 0)
        return pd_errorf(msg, cap, PD_ERR_PARSE, "submit: at= must be prefill, decode or both");

    sreq *prev = find_req(s, rid);
    const sreq *dup = prev && (live_on(prev, SIDE_P) || live_on(prev, SIDE_D)) ? prev : NULL;
    sreq r;
    pd_err err = sreq_make(s, a, len, max_new, dup, &r, msg, cap);
    if (err) return err;
    oracle_expect_client(s->oracle, s->n_reqs);
    bool accepted_any = submit_to_nodes(s, &r, at, dup);
    if (dup) {
        s->rejected++;
        sreq_free(&r);
        return PD_OK;
    }
    if (!accepted_any) s->rejected++;
    if ((err = reqs_append(s, &r, msg, cap))) sreq_free(&r);
    return err;
}

static sreq *need_req(sim *s, const line_args *a, char *msg, size_t cap) {
    if (a->n < 2) {
        pd_errorf(msg, cap, PD_ERR_PARSE, "%s: a rid is required", a->w[0]);
        return NULL;
    }
    sreq *r = find_req(s, a->w[1]);
    if (!r) pd_errorf(msg, cap, PD_ERR_NOTFOUND, "%s: unknown rid %s", a->w[0], a->w[1]);
    return r;
}

static pd_err cmd_outcome(sim *s, const line_args *a, bool boot, char *msg, size_t cap) {
    sreq *r = need_req(s, a, msg, cap);
    if (!r) return PD_ERR_NOTFOUND;
    if (a->n < 3)
        return pd_errorf(msg, cap, PD_ERR_PARSE, "%s RID ok|fail|%s", a->w[0],
                         boot ? "hold" : "hang");
    const char *o = a->w[2];
    pd_lb_outcome oc;
    if (!strcmp(o, "ok")) oc = PD_LB_OK;
    else if (!strcmp(o, "fail")) oc = PD_LB_FAIL;
    else if (!strcmp(o, boot ? "hold" : "hang")) oc = PD_LB_HOLD;
    else return pd_errorf(msg, cap, PD_ERR_PARSE, "%s: unknown outcome '%s'", a->w[0], o);
    if (boot) pd_loopback_set_bootstrap(s->lb, r->room, oc);
    else pd_loopback_set_transfer(s->lb, r->room, oc);
    return PD_OK;
}

static pd_err cmd_hold(sim *s, const line_args *a, bool hold, char *msg, size_t cap) {
    if (a->n == 2 && !strcmp(a->w[1], "loads")) {
        if (s->nodes[SIDE_P].alive) pd_stream_hold_loads(s->nodes[SIDE_P].st, hold);
        return PD_OK;
    }
    sreq *r = need_req(s, a, msg, cap);
    if (!r) return PD_ERR_NOTFOUND;
    uint32_t k;
    if (!parse_u32(arg(a, "chunk"), &k) || k == 0 || k > CHUNKS_TRACKED)
        return pd_errorf(msg, cap, PD_ERR_PARSE, "%s: chunk=K with 1 <= K <= %d", a->w[0],
                         CHUNKS_TRACKED);
    if (hold) r->hold_mask |= 1u << (k - 1);
    else r->hold_mask &= ~(1u << (k - 1));
    if (k <= r->chunks && s->nodes[SIDE_P].alive)
        pd_stream_hold(s->nodes[SIDE_P].st, r->chunk_batch[k], hold);
    return PD_OK;
}

static pd_err cmd_abort(sim *s, const line_args *a, char *msg, size_t cap) {
    if (a->n < 2)
        return pd_errorf(msg, cap, PD_ERR_PARSE, "abort RID|all [at=prefill|decode|both]");
    int at = parse_at(a);
    if (at < 0)
        return pd_errorf(msg, cap, PD_ERR_PARSE, "abort: at= must be prefill, decode or both");
    bool all = !strcmp(a->w[1], "all");
    sreq *r = all ? NULL : need_req(s, a, msg, cap);
    if (!all && !r) return PD_ERR_NOTFOUND;
    for (int side = 0; side < 2; side++) {
        if (!(at & (1 << side)) || !s->nodes[side].alive) continue;
        if (all) {
            pd_engine_abort_all(s->nodes[side].eng);
            continue;
        }
        bool expected_live = live_on(r, side);
        uint32_t client = (uint32_t)(r - s->reqs);
        pd_terminal_kind before = oracle_reason(s->oracle, side, client);
        pd_err err = pd_engine_abort(s->nodes[side].eng, r->rid);
        if (err == PD_OK) oracle_abort_accepted(s->oracle, side, client, r->rid, before);
        if (err == PD_OK && !expected_live)
            violation(s, "%s: abort on %s accepted but the request had ended there", r->rid,
                      side_name(side));
        if (err == PD_ERR_NOTFOUND && expected_live)
            violation(s, "%s: abort on %s says not found but no terminal event was seen", r->rid,
                      side_name(side));
    }
    return PD_OK;
}

static pd_err cmd_fault(sim *s, const line_args *a, char *msg, size_t cap) {
    bool on;
    if (a->n < 3 || !parse_onoff(a->w[2], &on))
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "fault sender-abort-error|receiver-abort-error on|off");
    if (!strcmp(a->w[1], "sender-abort-error"))
        pd_loopback_set_abort_error(s->lb, PD_LB_PREFILL, on);
    else if (!strcmp(a->w[1], "receiver-abort-error"))
        pd_loopback_set_abort_error(s->lb, PD_LB_DECODE, on);
    else return pd_errorf(msg, cap, PD_ERR_PARSE, "fault: unknown fault '%s'", a->w[1]);
    return PD_OK;
}

static pd_err cmd_kill(sim *s, const line_args *a, bool kill, char *msg, size_t cap) {
    if (a->n < 2 || (strcmp(a->w[1], "decode") && strcmp(a->w[1], "prefill")))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "%s decode|prefill", a->w[0]);
    int side = !strcmp(a->w[1], "decode") ? SIDE_D : SIDE_P;
    node *n = &s->nodes[side];
    if (kill) {
        if (!n->alive)
            return pd_errorf(msg, cap, PD_ERR_STATE, "kill: %s is already dead", a->w[1]);
        pd_loopback_kill(s->lb, side == SIDE_P ? PD_LB_PREFILL : PD_LB_DECODE);
        for (uint32_t i = 0; i < s->n_reqs; i++)
            if (live_on(&s->reqs[i], side)) s->reqs[i].lost[side] = true;
        oracle_node_lost(s->oracle, side);
        node_destroy(n);
        return PD_OK;
    }
    if (n->alive) return pd_errorf(msg, cap, PD_ERR_STATE, "restart: %s is alive", a->w[1]);
    pd_loopback_restart(s->lb, side == SIDE_P ? PD_LB_PREFILL : PD_LB_DECODE);
    return node_build(s, side, msg, cap);
}

static bool all_idle(sim *s) {
    if (!s->built) return true; /* a scenario with no request never built its world */
    for (int side = 0; side < 2; side++) {
        node *n = &s->nodes[side];
        if (!n->alive) continue;
        if (!pd_engine_idle(n->eng) || pd_stream_queued(n->st) > 0) return false;
    }
    return pd_loopback_pending(s->lb) == 0;
}

static pd_err cmd_drain(sim *s, char *msg, size_t cap) {
    for (uint32_t t = 0; t < DRAIN_TICKS_MAX; t++) {
        if (all_idle(s)) return PD_OK;
        tick(s);
        check_nodes(s, "drain");
        if (s->violations) return PD_ERR_INTERNAL;
    }
    if (s->nodes[SIDE_P].alive && pd_stream_blocked(s->nodes[SIDE_P].st))
        return pd_errorf(msg, cap, PD_ERR_STATE,
                         "drain: a held forward result blocks the executor (release it first)");
    char state[512] = "";
    size_t k = 0;
    for (int side = 0; side < 2; side++) {
        if (!s->nodes[side].alive) continue;
        pd_engine_counters c;
        pd_engine_counters_get(s->nodes[side].eng, &c);
        k += (size_t)snprintf(
            state + k, sizeof(state) - k,
            " %s: bootstrap %u waiting %u loading %u running %u parked %u transfer %u "
            "prealloc %u wait_transfer %u draining %u in-flight %u queued-work %u;",
            side_name(side), c.queued_bootstrap, c.queued_waiting, c.loading, c.running, c.parked,
            c.transferring, c.prealloc, c.wait_transfer, c.draining, c.forwards_in_flight,
            pd_stream_queued(s->nodes[side].st));
        if (k >= sizeof(state)) break;
    }
    return pd_errorf(msg, cap, PD_ERR_STATE, "drain: still busy after %d ticks:%s transport ops %u",
                     DRAIN_TICKS_MAX, state, pd_loopback_pending(s->lb));
}

/* O3: the client sees the outcome of the node that ended first. A prefill
 * half that finished (handed off) is not an end the client sees; one that
 * was aborted or failed before the decode half ended is. */
static bool prefill_ended_first(const sreq *r) {
    if (!r->acc[SIDE_P] || r->lost[SIDE_P] || r->terms[SIDE_P] == 0) return false;
    if (r->kind[SIDE_P] == PD_TERM_FINISHED) return false;
    if (!r->acc[SIDE_D]) return false;
    return r->terms[SIDE_D] == 0 || r->term_seq[SIDE_P] < r->term_seq[SIDE_D];
}

static const char *outcome_name(const sreq *r, int side_or_client) {
    if (side_or_client < 0) {
        if (prefill_ended_first(r)) return pd_terminal_kind_name(r->kind[SIDE_P]);
        if (r->acc[SIDE_D] && !r->lost[SIDE_D])
            return r->terms[SIDE_D] ? pd_terminal_kind_name(r->kind[SIDE_D]) : "none";
        if (r->lost[SIDE_D]) return "failed"; /* the node died under it */
        if (r->acc[SIDE_P])
            return r->terms[SIDE_P] ? pd_terminal_kind_name(r->kind[SIDE_P]) : "none";
        return "rejected";
    }
    if (!r->acc[side_or_client]) return "rejected";
    if (r->lost[side_or_client]) return "failed";
    return r->terms[side_or_client] ? pd_terminal_kind_name(r->kind[side_or_client]) : "none";
}

/* The tiny model's answer for r run alone: one whole-prompt forward on a
 * fresh executor, then one token per step. */
static uint32_t tiny_reference(sim *s, const sreq *r, int32_t *out) {
    const sim_cfg *c = &s->cfg;
    uint32_t ps = c->page_size;
    uint32_t pages = PD_DIV_CEIL(r->len + r->max_new, ps) + 1;
    pd_executor ex;
    char msg[256];
    pd_err err = pd_model_executor_create(&ex, s->model, ps, pages, c->mamba ? 1 : 0, 0, 1, msg,
                                          sizeof(msg));
    PD_ASSERTF(err == PD_OK, "%s", msg);
    uint32_t *pt = malloc(pages * sizeof(uint32_t));
    PD_ASSERT(pt);
    for (uint32_t i = 0; i < pages; i++) pt[i] = i;
    int32_t eos = pd_model_config_get(s->model)->eos_token;
    pd_batch_item it = {
        .req = 1, .tokens = r->prompt, .n_tokens = r->len, .start_pos = 0, .pages = pt,
        .n_pages = pages, .mamba_slot = c->mamba ? 0 : PD_POOL_NONE,
        .snapshot_slot = PD_POOL_NONE, .sample = true, .sampling = r->sampling,
    };
    uint32_t n = 0;
    for (;;) {
        pd_item_result res;
        pd_item_top top; /* the reference compares tokens only */
        err = pd_model_forward(&ex, &it, 1, &res, &top, NULL, msg, sizeof(msg));
        PD_ASSERTF(err == PD_OK, "%s", msg);
        out[n++] = res.token;
        if (n >= r->max_new || (!r->ignore_eos && eos >= 0 && res.token == eos)) break;
        it.tokens = &out[n - 1];
        it.n_tokens = 1;
        it.start_pos = r->len + n - 1;
        it.sample_index = n;
    }
    free(pt);
    pd_model_executor_destroy(&ex);
    return n;
}

static bool tokens_match_reference(sim *s, const sreq *r, bool *prefix_only) {
    sim_cfg *c = &s->cfg;
    pd_synth_config sc = {.page_size = c->page_size, .layers = c->layers, .vocab = c->vocab,
                          .eos_token = (int32_t)c->vocab - 1};
    int32_t *ref = malloc((r->max_new + 1) * sizeof(int32_t));
    PD_ASSERT(ref);
    uint32_t n = c->tiny ? tiny_reference(s, r, ref)
                         : pd_synth_reference(&sc, c->mamba, r->prompt, r->len, r->max_new, NULL, 0,
                                              r->ignore_eos, &r->sampling, ref);
    bool finished = r->terms[SIDE_D] == 1 && r->kind[SIDE_D] == PD_TERM_FINISHED;
    *prefix_only = !finished;
    bool ok = finished ? r->n_tokens == n : r->n_tokens <= n;
    for (uint32_t i = 0; ok && i < r->n_tokens; i++) ok = r->tokens[i] == ref[i];
    free(ref);
    return ok;
}

/* expect idle-clean: nothing in flight anywhere, and both engines' checks
 * pass (the ledger's clean idle included). */
static pd_err expect_idle_clean(sim *s, char *msg, size_t cap) {
    if (!all_idle(s))
        return pd_errorf(msg, cap, PD_ERR_STATE, "expect idle-clean: a node is not idle");
    for (int side = 0; side < 2; side++) {
        if (!s->nodes[side].alive) continue;
        pd_strbuf sb;
        pd_strbuf_init(&sb, s->check_text, sizeof(s->check_text));
        if (pd_engine_check(s->nodes[side].eng, &sb) != PD_OK)
            return pd_errorf(msg, cap, PD_ERR_STATE, "expect idle-clean: %s is not clean:\n%s",
                             side_name(side), s->check_text);
    }
    return PD_OK;
}

/* The engine counter a scenario names; false if it names none. */
static bool counter_value(const pd_engine_counters *c, const char *name, uint64_t *v) {
    if (!strcmp(name, "requeued")) *v = c->requeued;
    else if (!strcmp(name, "xfer_abort_errors")) *v = c->xfer_abort_errors;
    else if (!strcmp(name, "rooms_cancelled")) *v = c->rooms_cancelled;
    else if (!strcmp(name, "retire_deferred")) *v = c->retire_deferred;
    else if (!strcmp(name, "late_results_ignored")) *v = c->late_results_ignored;
    else if (!strcmp(name, "rejected")) *v = c->rejected;
    else if (!strcmp(name, "finished")) *v = c->finished;
    else if (!strcmp(name, "aborted")) *v = c->aborted;
    else if (!strcmp(name, "failed")) *v = c->failed;
    else if (!strcmp(name, "draining")) *v = c->draining;
    else if (!strcmp(name, "loading")) *v = c->loading;
    else if (!strcmp(name, "cached_tokens")) *v = c->cached_tokens;
    else if (!strcmp(name, "transferring")) *v = c->transferring;
    else if (!strcmp(name, "parked")) *v = c->parked;
    else return false;
    return true;
}

/* expect counter prefill|decode NAME=N | NAME>N ... */
static pd_err expect_counter(sim *s, const line_args *a, char *msg, size_t cap) {
    if (a->n < 4) return pd_errorf(msg, cap, PD_ERR_PARSE, "expect counter prefill|decode NAME=N");
    int side = !strcmp(a->w[2], "prefill") ? SIDE_P : !strcmp(a->w[2], "decode") ? SIDE_D : -1;
    if (side < 0 || !s->nodes[side].alive)
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "expect counter: node must be a live prefill or decode");
    pd_engine_counters c;
    pd_engine_counters_get(s->nodes[side].eng, &c);
    for (int i = 3; i < a->n; i++) {
        char name[40];
        const char *op = strpbrk(a->w[i], "=>");
        uint32_t want;
        if (!op || (size_t)(op - a->w[i]) >= sizeof(name) || !parse_u32(op + 1, &want))
            return pd_errorf(msg, cap, PD_ERR_PARSE, "expect counter: NAME=N or NAME>N");
        memcpy(name, a->w[i], (size_t)(op - a->w[i]));
        name[op - a->w[i]] = 0;
        uint64_t v;
        if (!counter_value(&c, name, &v))
            return pd_errorf(msg, cap, PD_ERR_PARSE, "expect counter: unknown counter '%s'", name);
        bool ok = *op == '=' ? v == want : v > want;
        if (!ok)
            return pd_errorf(msg, cap, PD_ERR_STATE, "expect counter %s %s: it is %llu", a->w[2],
                             a->w[i], (unsigned long long)v);
    }
    return PD_OK;
}

/* expect RID live|gone: still a record on the node (retire pending or
 * draining), or not; on node `which`, or on both (-1). */
static pd_err expect_record(sim *s, const sreq *r, int which, const char *w, char *msg,
                            size_t cap) {
    for (int side = 0; side < 2; side++) {
        if (which >= 0 && side != which) continue;
        if (!s->nodes[side].alive) continue;
        bool live = pd_engine_request_id(s->nodes[side].eng, r->rid) != 0;
        if (live != !strcmp(w, "live"))
            return pd_errorf(msg, cap, PD_ERR_STATE, "expect %s %s: it is %s on %s", r->rid, w,
                             live ? "live" : "gone", side_name(side));
    }
    return PD_OK;
}

/* expect RID streamed=1: exactly one terminal event on every node that
 * accepted the request and did not die under it. */
static pd_err expect_streamed_once(const sreq *r, int which, char *msg, size_t cap) {
    for (int side = 0; side < 2; side++) {
        if (which >= 0 && side != which) continue;
        if (r->acc[side] && !r->lost[side] && r->terms[side] != 1)
            return pd_errorf(msg, cap, PD_ERR_STATE,
                             "expect %s streamed=1: %u terminal events on %s", r->rid,
                             r->terms[side], side_name(side));
    }
    return PD_OK;
}

/* expect RID tokens=N | tokens=reference (v: what follows "tokens="). */
static pd_err expect_tokens(sim *s, const sreq *r, const char *v, char *msg, size_t cap) {
    if (!strcmp(v, "reference")) {
        bool prefix;
        if (!tokens_match_reference(s, r, &prefix))
            return pd_errorf(msg, cap, PD_ERR_STATE,
                             "expect %s tokens=reference: %u tokens differ from the request "
                             "run alone",
                             r->rid, r->n_tokens);
        return PD_OK;
    }
    uint32_t want;
    if (!parse_u32(v, &want))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "expect: tokens=N|reference");
    if (r->n_tokens != want)
        return pd_errorf(msg, cap, PD_ERR_STATE, "expect %s tokens=%u: got %u", r->rid, want,
                         r->n_tokens);
    return PD_OK;
}

/* One condition w of expect RID ..., judged on node `which` (-1: the
 * client's view, or both nodes). */
static pd_err expect_condition(sim *s, sreq *r, int which, const char *w, char *msg, size_t cap) {
    if (!strcmp(w, "live") || !strcmp(w, "gone")) return expect_record(s, r, which, w, msg, cap);
    if (!strcmp(w, "uncached")) {
        if (oracle_cached_after_term(s->oracle, (uint32_t)(r - s->reqs)))
            return pd_errorf(msg, cap, PD_ERR_STATE,
                             "expect %s uncached: it was inserted after its terminal reason",
                             r->rid);
        return PD_OK;
    }
    if (!strncmp(w, "terminal=", 9)) {
        const char *got = outcome_name(r, which);
        if (strcmp(got, w + 9))
            return pd_errorf(msg, cap, PD_ERR_STATE, "expect %s terminal=%s: got %s%s%s", r->rid,
                             w + 9, got, which >= 0 ? " on " : "",
                             which >= 0 ? side_name(which) : "");
        return PD_OK;
    }
    if (!strcmp(w, "streamed=1")) return expect_streamed_once(r, which, msg, cap);
    int side = which >= 0 ? which : SIDE_D; /* finish= and status=: decode's by default */
    if (!strncmp(w, "finish=", 7)) {
        const char *got = pd_finish_reason_name(r->finish[side]);
        if (strcmp(got, w + 7))
            return pd_errorf(msg, cap, PD_ERR_STATE, "expect %s finish=%s: got %s", r->rid, w + 7,
                             got);
        return PD_OK;
    }
    if (!strncmp(w, "status=", 7)) {
        uint32_t want;
        if (!parse_u32(w + 7, &want)) return pd_errorf(msg, cap, PD_ERR_PARSE, "expect: status=N");
        if ((uint32_t)r->status[side] != want)
            return pd_errorf(msg, cap, PD_ERR_STATE, "expect %s status=%u: got %d", r->rid, want,
                             r->status[side]);
        return PD_OK;
    }
    if (!strncmp(w, "tokens=", 7)) return expect_tokens(s, r, w + 7, msg, cap);
    return pd_errorf(msg, cap, PD_ERR_PARSE, "expect: unknown condition '%s'", w);
}

static pd_err cmd_expect(sim *s, const line_args *a, char *msg, size_t cap) {
    if (a->n < 2) return pd_errorf(msg, cap, PD_ERR_PARSE, "expect RID ... | expect idle-clean");
    if (!strcmp(a->w[1], "idle-clean")) return expect_idle_clean(s, msg, cap);
    if (!strcmp(a->w[1], "counter")) return expect_counter(s, a, msg, cap);
    sreq *r = need_req(s, a, msg, cap);
    if (!r) return PD_ERR_NOTFOUND;
    const char *node_s = arg(a, "node");
    int which = -1;
    if (node_s) {
        if (!strcmp(node_s, "prefill")) which = SIDE_P;
        else if (!strcmp(node_s, "decode")) which = SIDE_D;
        else return pd_errorf(msg, cap, PD_ERR_PARSE, "expect: node= must be prefill or decode");
    }
    for (int i = 2; i < a->n; i++) {
        if (!strncmp(a->w[i], "node=", 5)) continue;
        pd_err err = expect_condition(s, r, which, a->w[i], msg, cap);
        if (err) return err;
    }
    return PD_OK;
}

/* Splits a line into words; false if it has more than ARGS_MAX. */
static bool split_line(char *line, line_args *a) {
    a->n = 0;
    char *hash = strchr(line, '#');
    if (hash) *hash = 0;
    char *p = line;
    while (*p) {
        while (*p && isspace((unsigned char)*p)) p++;
        if (!*p) break;
        if (a->n == ARGS_MAX) return false;
        a->w[a->n++] = p;
        while (*p && !isspace((unsigned char)*p)) p++;
        if (*p) *p++ = 0;
    }
    return true;
}

/* Executes one line; records it in the trace; checks both nodes after it. */
static pd_err exec_line(sim *s, const char *text, char *msg, size_t cap) {
    char line[TRACE_LINE_MAX];
    if (strlen(text) >= sizeof(line))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "line longer than %zu bytes", sizeof(line) - 1);
    snprintf(line, sizeof(line), "%s", text);
    line_args a;
    if (!split_line(line, &a))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "more than %d words on a line", ARGS_MAX);
    if (a.n == 0) return PD_OK;
    msg[0] = 0;
    const char *c = a.w[0];
    if (!strcmp(c, "config")) {
        pd_err err = cmd_config(s, &a, msg, cap);
        if (!err) {
            char cfgline[480];
            cfg_format(&s->cfg, cfgline, sizeof(cfgline));
            (void)cfgline;
        }
        return err;
    }
    pd_err err = world_build(s, msg, cap);
    if (err) return err;
    char canon[TRACE_LINE_MAX];
    snprintf(canon, sizeof(canon), "%s", text);
    char *hash = strchr(canon, '#');
    if (hash) *hash = 0;
    size_t cl = strlen(canon);
    while (cl > 0 && isspace((unsigned char)canon[cl - 1])) canon[--cl] = 0;
    if (!strcmp(c, "step")) {
        uint32_t n = 1;
        if (a.n > 1 && !parse_u32(a.w[1], &n)) return pd_errorf(msg, cap, PD_ERR_PARSE, "step N");
        for (uint32_t i = 0; i < n; i++) {
            trace_line(s, "step 1");
            s->events++;
            tick(s);
            check_nodes(s, "step");
            if (s->violations) return PD_ERR_INTERNAL;
        }
        return PD_OK;
    }
    trace_line(s, canon);
    s->events++;
    if (!strcmp(c, "submit")) err = cmd_submit(s, &a, msg, cap);
    else if (!strcmp(c, "bootstrap")) err = cmd_outcome(s, &a, true, msg, cap);
    else if (!strcmp(c, "xfer")) err = cmd_outcome(s, &a, false, msg, cap);
    else if (!strcmp(c, "hold")) err = cmd_hold(s, &a, true, msg, cap);
    else if (!strcmp(c, "release")) err = cmd_hold(s, &a, false, msg, cap);
    else if (!strcmp(c, "abort")) err = cmd_abort(s, &a, msg, cap);
    else if (!strcmp(c, "fault")) err = cmd_fault(s, &a, msg, cap);
    else if (!strcmp(c, "kill")) err = cmd_kill(s, &a, true, msg, cap);
    else if (!strcmp(c, "restart")) err = cmd_kill(s, &a, false, msg, cap);
    else if (!strcmp(c, "drain")) err = cmd_drain(s, msg, cap);
    else if (!strcmp(c, "expect")) err = cmd_expect(s, &a, msg, cap);
    else err = pd_errorf(msg, cap, PD_ERR_PARSE, "unknown command '%s'", c);
    if (err) return err;
    check_nodes(s, canon);
    return s->violations ? PD_ERR_INTERNAL : PD_OK;
}

/* ---- end of run -------------------------------------------------------------------- */

static void verify_end(sim *s) {
    for (uint32_t i = 0; i < s->n_reqs; i++) {
        sreq *r = &s->reqs[i];
        for (int side = 0; side < 2; side++) {
            if (!r->acc[side] || r->lost[side]) continue;
            if (r->terms[side] != 1)
                violation(s, "%s: %u terminal events on %s at the end, expected exactly 1", r->rid,
                          r->terms[side], side_name(side));
        }
        if (r->acc[SIDE_D] && !r->lost[SIDE_D]) {
            bool prefix;
            if (!tokens_match_reference(s, r, &prefix))
                violation(s, "%s: %s tokens differ from the same request run alone (%u tokens, %s)",
                          r->rid, prefix ? "streamed" : "the finished request's", r->n_tokens,
                          pd_terminal_kind_name(r->kind[SIDE_D]));
        }
    }
    if (!all_idle(s)) violation(s, "the run ends with work pending (end a scenario with drain)");
    check_nodes(s, "the end");
}

static void fill_result(sim *s, pd_sim_result *res) {
    memset(res, 0, sizeof(*res));
    for (uint32_t i = 0; i < s->n_reqs; i++) {
        const char *o = outcome_name(&s->reqs[i], -1);
        res->requests++;
        if (!strcmp(o, "finished")) res->finished++;
        else if (!strcmp(o, "aborted")) res->aborted++;
        else if (!strcmp(o, "failed")) res->failed++;
        else if (!strcmp(o, "rejected")) res->rejected++;
    }
    res->rejected += s->rejected - PD_MIN(s->rejected, res->rejected);
    res->violations = s->violations;
    res->steps = s->steps;
    res->events = s->events;
    cfg_format(&s->cfg, res->config, sizeof(res->config));
}

/* ---- random scenarios ------------------------------------------------------------------ */

pd_err pd_sim_parse_faults(const char *list, uint32_t *out, char *msg, size_t cap) {
    static const struct { const char *name; uint32_t bit; } names[] = {
        {"abort", PD_FAULT_ABORT}, {"bootstrap", PD_FAULT_BOOTSTRAP}, {"hold", PD_FAULT_HOLD},
        {"xfer", PD_FAULT_XFER}, {"abort-error", PD_FAULT_ABORT_ERROR}, {"kill", PD_FAULT_KILL},
        {"dup", PD_FAULT_DUP}, {"oversize", PD_FAULT_OVERSIZE}, {"reuse", PD_FAULT_REUSE},
    };
    *out = 0;
    if (!list || !strcmp(list, "all")) {
        *out = PD_FAULT_ALL;
        return PD_OK;
    }
    if (!strcmp(list, "none")) return PD_OK;
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", list);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        size_t i = 0;
        while (i < PD_ARRAY_LEN(names) && strcmp(names[i].name, tok)) i++;
        if (i == PD_ARRAY_LEN(names))
            return pd_errorf(msg, cap, PD_ERR_PARSE,
                             "unknown fault '%s' (known: abort, bootstrap, hold, xfer, "
                             "abort-error, kill, dup, oversize, reuse, all, none)", tok);
        *out |= names[i].bit;
    }
    return PD_OK;
}

static void vary_config(sim_cfg *c, pd_rng *rng) {
    static const uint32_t pss[] = {1, 2, 4, 8};
    c->page_size = pss[pd_rng_below(rng, 4)];
    c->chunk = (uint32_t)pd_rng_range(rng, 1, 4) * c->page_size;
    if (pd_rng_chance(rng, 1, 4))
        c->chunk = (uint32_t)pd_rng_range(rng, 1, 12); /* not page-aligned */
    c->rows = (uint32_t)pd_rng_range(rng, 1, 6);
    /* Mostly enough metadata rows for the rows; sometimes starved. */
    c->meta_rows = pd_rng_chance(rng, 1, 8) ? (uint32_t)pd_rng_range(rng, 1, 2)
                                            : c->rows + (uint32_t)pd_rng_range(rng, 0, c->rows + 2);
    c->batch = (uint32_t)pd_rng_range(rng, 1, 6);
    c->mamba = pd_rng_chance(rng, 1, 2);
    c->mamba_slots = 0;
    if (c->mamba && pd_rng_chance(rng, 1, 3))
        c->mamba_slots = c->rows * 3 + (uint32_t)pd_rng_below(rng, 3);
    c->overlap = pd_rng_chance(rng, 2, 3);
    c->optimistic = pd_rng_chance(rng, 1, 3) ? (uint32_t)pd_rng_range(rng, 1, 2) : 0;
    c->prefix_cache = pd_rng_chance(rng, 3, 4);
    /* Pools from starvation (one long request at a time) to roomy. */
    uint32_t tokens = (uint32_t)pd_rng_range(rng, 48, 320);
    c->kv_pages = PD_DIV_CEIL(tokens, c->page_size);
    c->decode_kv_pages = PD_DIV_CEIL((uint32_t)pd_rng_range(rng, 48, 320), c->page_size);
    c->host_pages = (c->prefix_cache && pd_rng_chance(rng, 1, 4)) ? c->kv_pages : 0;
    c->latency = (uint32_t)pd_rng_range(rng, 1, 3);
    c->grace = (uint32_t)pd_rng_range(rng, 1, 8);
    c->exec_jitter = (uint32_t)pd_rng_below(rng, 4);
    c->xfer_jitter = (uint32_t)pd_rng_below(rng, 8);
    c->jitter_seed = (uint32_t)pd_rng_next(rng);
    c->bootstrap_timeout = c->transfer_timeout =
        100 + 30 * (c->latency + c->xfer_jitter + c->exec_jitter);
}

typedef struct gen {
    sim *s;
    pd_rng rng;
    uint32_t faults;
    uint32_t submitted, target;
    uint32_t kills, dead_ticks[2];
    uint32_t reused;
    char line[256];
} gen;

static pd_err gen_exec(gen *g, char *msg, size_t cap) { return exec_line(g->s, g->line, msg, cap); }

static sreq *random_live(gen *g) {
    uint32_t live = 0;
    for (uint32_t i = 0; i < g->s->n_reqs; i++)
        live += live_on(&g->s->reqs[i], SIDE_P) || live_on(&g->s->reqs[i], SIDE_D);
    if (live == 0) return NULL;
    uint32_t k = (uint32_t)pd_rng_below(&g->rng, live);
    for (uint32_t i = 0; i < g->s->n_reqs; i++) {
        sreq *r = &g->s->reqs[i];
        if (!(live_on(r, SIDE_P) || live_on(r, SIDE_D))) continue;
        if (k-- == 0) return r;
    }
    return NULL;
}

static pd_err gen_submit(gen *g, char *msg, size_t cap) {
    sim *s = g->s;
    sim_cfg *c = &s->cfg;
    pd_rng *rng = &g->rng;
    uint32_t pool_tokens = PD_MIN(c->kv_pages, c->decode_kv_pages) * c->page_size;
    uint32_t max_new = (uint32_t)pd_rng_range(rng, 1, 8);
    uint32_t len_max = PD_MIN(96u, pool_tokens > max_new + 1 ? pool_tokens - max_new : 1);
    uint32_t len = (uint32_t)pd_rng_range(rng, 1, PD_MAX(1u, len_max));
    char rid[24];
    if ((g->faults & PD_FAULT_DUP) && pd_rng_chance(rng, 1, 20)) {
        sreq *live = random_live(g);
        if (live) {
            snprintf(g->line, sizeof(g->line), "submit %s len=%u max_new=%u", live->rid, len,
                     max_new);
            return gen_exec(g, msg, cap);
        }
    }
    snprintf(rid, sizeof(rid), "r%u", ++g->submitted);
    if ((g->faults & PD_FAULT_OVERSIZE) && pd_rng_chance(rng, 1, 20))
        len = c->kv_pages * c->page_size + (uint32_t)pd_rng_range(rng, 1, 9);
    int n = snprintf(g->line, sizeof(g->line), "submit %s len=%u max_new=%u", rid, len, max_new);
    if (g->submitted > 1 && pd_rng_chance(rng, 1, 2)) {
        uint32_t from = (uint32_t)pd_rng_range(rng, 1, g->submitted - 1);
        n += snprintf(g->line + n, sizeof(g->line) - (size_t)n, " prefix=r%u:%u", from,
                      (uint32_t)pd_rng_range(rng, 1, len));
    }
    if (pd_rng_chance(rng, 1, 4))
        n += snprintf(g->line + n, sizeof(g->line) - (size_t)n, " temp=0.8");
    uint32_t where = (uint32_t)pd_rng_below(rng, 40);
    if (where == 0) snprintf(g->line + n, sizeof(g->line) - (size_t)n, " at=prefill");
    else if (where == 1) snprintf(g->line + n, sizeof(g->line) - (size_t)n, " at=decode");
    pd_err err = gen_exec(g, msg, cap);
    if (err) return err;
    sreq *r = find_req(s, rid);
    if (!r) return PD_OK;
    if (g->faults & PD_FAULT_BOOTSTRAP) {
        uint32_t b = (uint32_t)pd_rng_below(rng, 10);
        if (b == 0 || b == 1) {
            snprintf(g->line, sizeof(g->line), "bootstrap %s %s", rid, b == 0 ? "fail" : "hold");
            r->boot_held = b == 1;
            if ((err = gen_exec(g, msg, cap))) return err;
        }
    }
    if (g->faults & PD_FAULT_XFER) {
        uint32_t x = (uint32_t)pd_rng_below(rng, 12);
        if (x == 0 || x == 1) {
            snprintf(g->line, sizeof(g->line), "xfer %s %s", rid, x == 0 ? "fail" : "hang");
            r->xfer_held = x == 1;
            if ((err = gen_exec(g, msg, cap))) return err;
        }
    }
    if ((g->faults & PD_FAULT_HOLD) && pd_rng_chance(rng, 1, 5)) {
        snprintf(g->line, sizeof(g->line), "hold %s chunk=%u", rid,
                 (uint32_t)pd_rng_range(rng, 1, 3));
        if ((err = gen_exec(g, msg, cap))) return err;
    }
    return PD_OK;
}

/* Aborts at the worst moments the oracle can name: between a final chunk's
 * launch and its result (prefill), and after commit while generating
 * (decode). */
static pd_err gen_worst_aborts(gen *g, char *msg, size_t cap) {
    sim *s = g->s;
    for (uint32_t i = 0; i < s->n_reqs; i++) {
        sreq *r = &s->reqs[i];
        const char *at = NULL;
        if (oracle_final_in_flight(s->oracle, i) && pd_rng_chance(&g->rng, 1, 10))
            at = pd_rng_chance(&g->rng, 1, 2) ? "" : " at=prefill";
        else if (oracle_running(s->oracle, i) && pd_rng_chance(&g->rng, 1, 40))
            at = " at=decode";
        if (!at) continue;
        snprintf(g->line, sizeof(g->line), "abort %s%s", r->rid, at);
        pd_err err = gen_exec(g, msg, cap);
        if (err) return err;
    }
    return PD_OK;
}

/* A rid reused right after its terminal event, while its room may still
 * drain: a new request (new room) that must be accepted. */
static pd_err gen_reuse(gen *g, char *msg, size_t cap) {
    sim *s = g->s;
    if (!s->last_ended || g->reused >= 8 || !pd_rng_chance(&g->rng, 1, 4)) return PD_OK;
    sreq *r = &s->reqs[s->last_ended - 1];
    s->last_ended = 0;
    /* Lines name requests by rid, so the old one must have nothing left for
     * a later line to release. */
    if (live_on(r, SIDE_P) || live_on(r, SIDE_D) || find_req(s, r->rid) != r || r->hold_mask ||
        r->boot_held || r->xfer_held)
        return PD_OK;
    snprintf(g->line, sizeof(g->line), "submit %s len=%u max_new=%u", r->rid, r->len, r->max_new);
    g->reused++;
    return gen_exec(g, msg, cap);
}

/* Node death and restart, either node, at most twice a run. */
static pd_err gen_kills(gen *g, char *msg, size_t cap) {
    sim *s = g->s;
    for (int side = 0; side < 2; side++) {
        if (s->nodes[side].alive || ++g->dead_ticks[side] <= 12) continue;
        snprintf(g->line, sizeof(g->line), "restart %s", side_name(side));
        g->dead_ticks[side] = 0;
        return gen_exec(g, msg, cap);
    }
    if (g->kills >= 2 || !s->nodes[SIDE_P].alive || !s->nodes[SIDE_D].alive ||
        !pd_rng_chance(&g->rng, 1, 250))
        return PD_OK;
    g->kills++;
    snprintf(g->line, sizeof(g->line), "kill %s",
             side_name(pd_rng_chance(&g->rng, 1, 3) ? SIDE_P : SIDE_D));
    return gen_exec(g, msg, cap);
}

static pd_err gen_faults(gen *g, char *msg, size_t cap) {
    sim *s = g->s;
    pd_rng *rng = &g->rng;
    pd_err err = PD_OK;
    if ((g->faults & PD_FAULT_ABORT) && pd_rng_chance(rng, 1, 30)) {
        sreq *r = random_live(g);
        /* Prefer a request with a forward held back: the worst moment. */
        for (uint32_t i = 0; i < s->n_reqs && pd_rng_chance(rng, 1, 2); i++)
            if (s->reqs[i].hold_mask &&
                (live_on(&s->reqs[i], SIDE_P) || live_on(&s->reqs[i], SIDE_D))) {
                r = &s->reqs[i];
                break;
            }
        if (r) {
            static const char *const ats[] = {"", " at=prefill", " at=decode"};
            uint32_t k = (uint32_t)pd_rng_below(rng, 5);
            snprintf(g->line, sizeof(g->line), "abort %s%s", r->rid, ats[k < 3 ? 0 : k - 2]);
            if ((err = gen_exec(g, msg, cap))) return err;
        }
    }
    if ((g->faults & PD_FAULT_ABORT) && pd_rng_chance(rng, 1, 1500)) {
        snprintf(g->line, sizeof(g->line), "abort all");
        if ((err = gen_exec(g, msg, cap))) return err;
    }
    if ((g->faults & PD_FAULT_ABORT) && (err = gen_worst_aborts(g, msg, cap))) return err;
    if ((g->faults & PD_FAULT_REUSE) && (err = gen_reuse(g, msg, cap))) return err;
    for (uint32_t i = 0; i < s->n_reqs; i++) {
        sreq *r = &s->reqs[i];
        if (r->boot_held && pd_rng_chance(rng, 1, 8)) {
            snprintf(g->line, sizeof(g->line), "bootstrap %s %s", r->rid,
                     pd_rng_chance(rng, 3, 4) ? "ok" : "fail");
            r->boot_held = false;
            if ((err = gen_exec(g, msg, cap))) return err;
        }
        if (r->xfer_held && pd_rng_chance(rng, 1, 10)) {
            snprintf(g->line, sizeof(g->line), "xfer %s %s", r->rid,
                     pd_rng_chance(rng, 3, 4) ? "ok" : "fail");
            r->xfer_held = false;
            if ((err = gen_exec(g, msg, cap))) return err;
        }
        if (r->hold_mask && pd_rng_chance(rng, 1, 5)) {
            uint32_t k = (uint32_t)__builtin_ctz(r->hold_mask) + 1;
            snprintf(g->line, sizeof(g->line), "release %s chunk=%u", r->rid, k);
            if ((err = gen_exec(g, msg, cap))) return err;
        }
    }
    if ((g->faults & PD_FAULT_ABORT_ERROR) && pd_rng_chance(rng, 1, 30)) {
        snprintf(g->line, sizeof(g->line), "fault %s-abort-error %s",
                 pd_rng_chance(rng, 1, 2) ? "sender" : "receiver",
                 pd_rng_chance(rng, 1, 2) ? "on" : "off");
        if ((err = gen_exec(g, msg, cap))) return err;
    }
    if (g->faults & PD_FAULT_KILL) return gen_kills(g, msg, cap);
    return PD_OK;
}

/* Everything that was held or broken is let go so the run can end. */
static pd_err gen_wind_down(gen *g, char *msg, size_t cap) {
    sim *s = g->s;
    pd_err err;
    const char *lines[] = {"fault sender-abort-error off", "fault receiver-abort-error off"};
    for (size_t i = 0; i < 2; i++) {
        snprintf(g->line, sizeof(g->line), "%s", lines[i]);
        if ((err = gen_exec(g, msg, cap))) return err;
    }
    for (int side = 0; side < 2; side++) {
        if (s->nodes[side].alive) continue;
        snprintf(g->line, sizeof(g->line), "restart %s", side_name(side));
        if ((err = gen_exec(g, msg, cap))) return err;
    }
    for (uint32_t i = 0; i < s->n_reqs; i++) {
        sreq *r = &s->reqs[i];
        if (r->boot_held) {
            snprintf(g->line, sizeof(g->line), "bootstrap %s ok", r->rid);
            r->boot_held = false;
            if ((err = gen_exec(g, msg, cap))) return err;
        }
        if (r->xfer_held) {
            snprintf(g->line, sizeof(g->line), "xfer %s ok", r->rid);
            r->xfer_held = false;
            if ((err = gen_exec(g, msg, cap))) return err;
        }
        /* Lines name the latest request with a rid; an older one (the rid was
         * reused) cannot be released by name, which gen_reuse prevents. */
        PD_ASSERT(!r->hold_mask || find_req(s, r->rid) == r);
        while (r->hold_mask) {
            uint32_t k = (uint32_t)__builtin_ctz(r->hold_mask) + 1;
            snprintf(g->line, sizeof(g->line), "release %s chunk=%u", r->rid, k);
            if ((err = gen_exec(g, msg, cap))) return err;
        }
    }
    snprintf(g->line, sizeof(g->line), "drain");
    return gen_exec(g, msg, cap);
}

static pd_err finish_run(sim *s, pd_err err, const char *msg, pd_sim_result *res,
                         pd_strbuf *report) {
    if (!err && !s->violations) verify_end(s);
    if (err && !s->violations) {
        violation(s, "%s", msg[0] ? msg : pd_err_name(err));
    }
    trace_flush_steps(s);
    if (res) fill_result(s, res);
    if (s->violations) {
        report_tail(s);
        if (report) pd_strbuf_append(report, s->report.data);
        if (report && s->report.truncated)
            pd_strbuf_printf(report, "# (the report above is cut at %d bytes)\n", REPORT_BYTES);
        return PD_ERR_INTERNAL;
    }
    return PD_OK;
}

/* The configuration a random run uses: the defaults, varied by the seed in
 * a swarm, then the --config overrides. */
static pd_err seed_config(const pd_sim_options *o, sim *s, char *msg, size_t cap) {
    cfg_default(&s->cfg);
    if (o->vary) {
        /* Its own generator: the same seed gives the same scenario whether the
         * configuration is derived here or passed back in with --config. */
        pd_rng crng;
        pd_rng_seed(&crng, o->seed ^ 0xC0F1C0F1ull);
        vary_config(&s->cfg, &crng);
    }
    return o->config ? exec_line(s, o->config, msg, cap) : PD_OK;
}

pd_err pd_sim_seed_config(const pd_sim_options *o, char *out, size_t out_cap) {
    sim s;
    sim_init(&s);
    char msg[256] = "";
    pd_err err = seed_config(o, &s, msg, sizeof(msg));
    if (err) snprintf(out, out_cap, "%s", msg);
    else cfg_format(&s.cfg, out, out_cap);
    sim_free(&s);
    return err;
}

pd_err pd_sim_random(const pd_sim_options *o, pd_sim_result *res, pd_strbuf *report) {
    sim s;
    sim_init(&s);
    s.trace = o->trace;
    s.on_violation = o->on_violation;
    s.violation_ctx = o->violation_ctx;
    gen g = {.s = &s, .faults = o->faults, .target = o->requests ? o->requests : 50};
    pd_rng_seed(&g.rng, o->seed);
    char msg[512] = "";
    pd_err err = seed_config(o, &s, msg, sizeof(msg));
    char cfgline[480];
    cfg_format(&s.cfg, cfgline, sizeof(cfgline));
    if (!err) {
        char head[64];
        snprintf(head, sizeof(head), "# pdserve sim --seed %llu", (unsigned long long)o->seed);
        trace_line(&s, head);
        trace_line(&s, cfgline);
        err = world_build(&s, msg, sizeof(msg));
    }
    while (!err && g.submitted < g.target) {
        uint32_t live = 0;
        for (uint32_t i = 0; i < s.n_reqs; i++)
            live += live_on(&s.reqs[i], SIDE_P) || live_on(&s.reqs[i], SIDE_D);
        /* Arrivals keep a few requests per row in flight: busy, not swamped. */
        if (live < 2 || (live < 3 * s.cfg.rows && pd_rng_chance(&g.rng, 1, 3)))
            err = gen_submit(&g, msg, sizeof(msg));
        if (!err) err = gen_faults(&g, msg, sizeof(msg));
        if (!err) {
            snprintf(g.line, sizeof(g.line), "step 1");
            err = gen_exec(&g, msg, sizeof(msg));
        }
    }
    if (!err) err = gen_wind_down(&g, msg, sizeof(msg));
    err = finish_run(&s, err, msg, res, report);
    if (res) res->seed = o->seed;
    if (err && report) {
        char line[128];
        snprintf(line, sizeof(line), "seed %llu: %u violation(s)\n", (unsigned long long)o->seed,
                 s.violations);
        pd_strbuf_append(report, line);
    }
    sim_free(&s);
    return err;
}

/* ---- scenario replay -------------------------------------------------------------------- */

pd_err pd_sim_scenario(const char *text, const char *name, const char *config_extra, FILE *trace,
                       pd_sim_result *res, pd_strbuf *report) {
    sim s;
    sim_init(&s);
    cfg_default(&s.cfg);
    s.trace = trace;
    s.name = name;
    char msg[1024] = "";
    pd_err err = PD_OK;
    const char *p = text;
    uint32_t lineno = 0;
    while (*p && !err) {
        const char *nl = strchr(p, '\n');
        size_t n = nl ? (size_t)(nl - p) : strlen(p);
        char line[512];
        lineno++;
        if (n >= sizeof(line)) {
            err = pd_errorf(msg, sizeof(msg), PD_ERR_PARSE, "line too long");
        } else {
            memcpy(line, p, n);
            line[n] = 0;
            /* The extra configuration goes in just before the world is built. */
            line_args peek;
            char tmp[512];
            snprintf(tmp, sizeof(tmp), "%s", line);
            if (config_extra && !s.built && split_line(tmp, &peek) && peek.n > 0 &&
                strcmp(peek.w[0], "config") != 0)
                err = exec_line(&s, config_extra, msg, sizeof(msg));
            if (!err) err = exec_line(&s, line, msg, sizeof(msg));
        }
        if (err) {
            /* Prefix the message with where it happened. */
            char tmp[sizeof(msg)];
            snprintf(tmp, sizeof(tmp), "%s", msg[0] ? msg : pd_err_name(err));
            int k = snprintf(msg, sizeof(msg), "%s:%u: ", name ? name : "scenario", lineno);
            if (k > 0 && (size_t)k < sizeof(msg)) {
                size_t room = sizeof(msg) - (size_t)k;
                size_t tl = strnlen(tmp, room - 1);
                memcpy(msg + k, tmp, tl);
                msg[(size_t)k + tl] = 0;
            }
        }
        p = nl ? nl + 1 : p + n;
    }
    /* The end-of-run checks apply to every scenario, as to every random run:
     * one that ends with work pending fails (end it with drain). */
    err = finish_run(&s, err, msg, res, report);
    sim_free(&s);
    return err;
}

/* ---- exhaustive exploration --------------------------------------------------------------- */

enum {
    EV_RESULT, EV_BOOT_OK, EV_BOOT_FAIL, EV_XFER_OK, EV_XFER_FAIL, EV_ABORT, EV_ABORT_DECODE,
    EV__COUNT
};

typedef struct xchoice {
    uint8_t ev, req;
} xchoice;

typedef struct xstate {
    bool boot_decided[2], xfer_decided[2];
    bool boot_fail_used, xfer_fail_used, abort_used, decode_abort_used;
} xstate;

static uint32_t enabled_events(sim *s, const xstate *x, xchoice *out) {
    uint32_t n = 0;
    node *P = &s->nodes[SIDE_P];
    if (pd_stream_blocked(P->st)) out[n++] = (xchoice){EV_RESULT, 0};
    for (uint8_t i = 0; i < 2; i++) {
        sreq *r = &s->reqs[i];
        bool live = live_on(r, SIDE_P) || live_on(r, SIDE_D);
        if (!x->boot_decided[i] && live) {
            out[n++] = (xchoice){EV_BOOT_OK, i};
            if (!x->boot_fail_used) out[n++] = (xchoice){EV_BOOT_FAIL, i};
        }
        pd_xfer_status st = pd_loopback_status(s->lb, PD_LB_PREFILL, r->room);
        if (!x->xfer_decided[i] && live && st == PD_XFER_TRANSFERRING) {
            out[n++] = (xchoice){EV_XFER_OK, i};
            if (!x->xfer_fail_used) out[n++] = (xchoice){EV_XFER_FAIL, i};
        }
        if (!x->abort_used && live) out[n++] = (xchoice){EV_ABORT, i};
        /* A decode abort after commit, while the request generates. */
        if (!x->decode_abort_used && oracle_running(s->oracle, i))
            out[n++] = (xchoice){EV_ABORT_DECODE, i};
    }
    return n;
}

static pd_err apply_choice(sim *s, xstate *x, xchoice c, char *msg, size_t cap) {
    char line[64];
    const char *rid = s->reqs[c.req].rid;
    switch (c.ev) {
    case EV_RESULT: {
        uint64_t b = pd_stream_head_batch(s->nodes[SIDE_P].st);
        pd_stream_hold(s->nodes[SIDE_P].st, b, false);
        trace_line(s, "# release the next prefill result");
        return PD_OK;
    }
    case EV_BOOT_OK:
    case EV_BOOT_FAIL:
        x->boot_decided[c.req] = true;
        if (c.ev == EV_BOOT_FAIL) x->boot_fail_used = true;
        snprintf(line, sizeof(line), "bootstrap %s %s", rid, c.ev == EV_BOOT_OK ? "ok" : "fail");
        break;
    case EV_XFER_OK:
    case EV_XFER_FAIL:
        x->xfer_decided[c.req] = true;
        if (c.ev == EV_XFER_FAIL) x->xfer_fail_used = true;
        snprintf(line, sizeof(line), "xfer %s %s", rid, c.ev == EV_XFER_OK ? "ok" : "fail");
        break;
    case EV_ABORT_DECODE:
        x->decode_abort_used = true;
        snprintf(line, sizeof(line), "abort %s at=decode", rid);
        break;
    default:
        x->abort_used = true;
        snprintf(line, sizeof(line), "abort %s", rid);
        break;
    }
    return exec_line(s, line, msg, cap);
}

/* Runs one schedule: follows prefix[0..n_prefix) and then always the first
 * enabled choice, recording the choice counts it saw into counts[]. */
/* The configurations explored, one after the other: plain; optimistic
 * (prefill starts before the handshake completes and retries once); and
 * with every transport abort reporting an error. */
static const struct {
    const char *config, *fault;
} explore_configs[] = {
    {"config page_size=4 chunk=4 kv_pages=48 rows=4 mamba=on overlap=on optimistic=0 "
     "prefix_cache=on batch=2 timeout=40 latency=1", NULL},
    {"config page_size=4 chunk=4 kv_pages=48 rows=4 mamba=on overlap=on optimistic=1 "
     "prefix_cache=on batch=2 timeout=40 latency=1", NULL},
    {"config page_size=4 chunk=4 kv_pages=48 rows=4 mamba=on overlap=on optimistic=0 "
     "prefix_cache=on batch=2 timeout=40 latency=1", "abort-error"},
};

static pd_err explore_one(uint32_t config, const uint32_t *prefix, uint32_t n_prefix,
                          uint32_t *choices, uint32_t *counts, uint32_t *depth, pd_strbuf *report) {
    sim s;
    sim_init(&s);
    cfg_default(&s.cfg);
    char msg[512] = "";
    bool abort_error = explore_configs[config].fault != NULL;
    const char *const setup[] = {
        explore_configs[config].config,
        "submit r1 len=10 max_new=5", "submit r2 len=10 max_new=2", /* chunks 4+4+2 and 2+4+4 */
        "bootstrap r1 hold", "bootstrap r2 hold", "xfer r1 hang", "xfer r2 hang",
        abort_error ? "fault sender-abort-error on" : "",
        abort_error ? "fault receiver-abort-error on" : "",
    };
    s.hold_all_prefill = true;
    pd_err err = PD_OK;
    for (size_t i = 0; i < PD_ARRAY_LEN(setup) && !err; i++)
        err = exec_line(&s, setup[i], msg, sizeof(msg));
    xstate x;
    memset(&x, 0, sizeof(x));
    uint32_t d = 0;
    while (!err) {
        for (int t = 0; t < 3 && !err; t++) err = exec_line(&s, "step 1", msg, sizeof(msg));
        if (err) break;
        xchoice ev[16];
        uint32_t n = enabled_events(&s, &x, ev);
        if (n == 0) break;
        uint32_t pick = d < n_prefix ? prefix[d] : 0;
        PD_ASSERT(pick < n && d < 256);
        choices[d] = pick;
        counts[d] = n;
        d++;
        err = apply_choice(&s, &x, ev[pick], msg, sizeof(msg));
    }
    if (!err) {
        /* Let everything go and finish. */
        s.hold_clear = true;
        if (abort_error) err = exec_line(&s, "fault sender-abort-error off", msg, sizeof(msg));
        if (!err && abort_error)
            err = exec_line(&s, "fault receiver-abort-error off", msg, sizeof(msg));
        while (pd_stream_blocked(s.nodes[SIDE_P].st))
            pd_stream_hold(s.nodes[SIDE_P].st, pd_stream_head_batch(s.nodes[SIDE_P].st), false);
        for (uint8_t i = 0; i < 2 && !err; i++) {
            char line[64];
            if (!x.boot_decided[i]) {
                snprintf(line, sizeof(line), "bootstrap %s ok", s.reqs[i].rid);
                err = exec_line(&s, line, msg, sizeof(msg));
            }
            if (!err && !x.xfer_decided[i]) {
                snprintf(line, sizeof(line), "xfer %s ok", s.reqs[i].rid);
                err = exec_line(&s, line, msg, sizeof(msg));
            }
        }
        if (!err) err = exec_line(&s, "drain", msg, sizeof(msg));
    }
    *depth = d;
    err = finish_run(&s, err, msg, NULL, report);
    sim_free(&s);
    return err;
}

/* Depth-first over every schedule of one configuration. */
static pd_err explore_config(uint32_t config, uint64_t limit, pd_sim_explore_result *res,
                             pd_strbuf *report) {
    enum { DEPTH_MAX = 256 };
    uint32_t prefix[DEPTH_MAX], choices[DEPTH_MAX], counts[DEPTH_MAX];
    uint32_t n_prefix = 0;
    for (;;) {
        uint32_t depth = 0;
        pd_err err = explore_one(config, prefix, n_prefix, choices, counts, &depth, report);
        res->schedules++;
        if (depth > res->max_choices) res->max_choices = depth;
        if (err) {
            res->violations++;
            return err; /* the report holds the failing schedule */
        }
        /* Next schedule: the deepest choice that still has an alternative. */
        memcpy(prefix, choices, depth * sizeof(uint32_t));
        int d = (int)depth - 1;
        while (d >= 0 && prefix[d] + 1 >= counts[d]) d--;
        if (d < 0) break;
        prefix[d]++;
        n_prefix = (uint32_t)d + 1;
        if (limit && res->schedules >= limit) break;
    }
    return PD_OK;
}

pd_err pd_sim_explore(uint64_t limit, pd_sim_explore_result *res, pd_strbuf *report) {
    memset(res, 0, sizeof(*res));
    for (uint32_t c = 0; c < PD_ARRAY_LEN(explore_configs); c++) {
        if (limit && res->schedules >= limit) break;
        pd_err err = explore_config(c, limit, res, report);
        if (err) return err;
    }
    return PD_OK;
}
