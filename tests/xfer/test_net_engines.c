/* The real engines over the real transport: a prefill engine and a decode
 * engine, each with the synthetic executor (its tokens depend on every KV
 * value and the Mamba state being exactly where the page tables say), talk
 * through two pd_net nodes on 127.0.0.1. The test thread plays both
 * scheduler threads. Requests with shared prefixes (prefix cache on both
 * sides, so cached prefixes and partial sends happen), chunked prefill with
 * overlap, and aborts on either side at arbitrary moments; then every
 * finished request's tokens must equal the request run alone, every request
 * has exactly one terminal event per node, and both engines end idle and
 * clean — which needs drained() to have become true for every room. */
#include "net_fixture.h"
#include "pdserve/engine.h"
#include "pdserve/synth.h"

#define REQS 40
#define VOCAB 64
#define PAGE 4

typedef struct out {
    int32_t tokens[16];
    uint32_t n_tokens;
    uint32_t terms[2];
    pd_terminal_kind kind[2];
} out;

typedef struct side {
    int idx;
    pd_synth *sx;
    pd_engine *e;
    pd_net *net;
    pd_exec_alloc alloc; /* net's: the executor's memory and the meta rows */
    pd_meta_row *meta;
    out *outs;
} side;

static int rid_index(const char *rid) { return atoi(rid + 1); }

static void on_token(void *self, uint64_t tag, const char *rid, uint64_t room, int32_t t, float lp,
                     uint32_t i) {
    (void)tag, (void)room, (void)lp;
    side *s = self;
    out *o = &s->outs[rid_index(rid)];
    assert_int_equal(i, o->n_tokens);
    assert_true(o->n_tokens < 16);
    o->tokens[o->n_tokens++] = t;
}

static void on_term(void *self, const pd_terminal_event *ev) {
    side *s = self;
    out *o = &s->outs[rid_index(ev->rid)];
    o->terms[s->idx]++;
    o->kind[s->idx] = ev->kind;
}

/* Nothing is inserted into the prefix cache for an aborted or failed request. */
static void on_action(void *ctx, const pd_action_event *ev) {
    (void)ctx;
    if (ev->action == PD_ACT_INSERT)
        assert_true(ev->kind == PD_TERM_NONE || ev->kind == PD_TERM_FINISHED);
}

static const pd_sink_vtable sink_vt = {.token = on_token, .terminal = on_term};

static pd_synth_config synth_config(void) {
    return (pd_synth_config){.page_size = PAGE, .kv_pages = 160, .mamba_slots = 8 * 3 + 4,
                             .layers = 3, .vocab = VOCAB, .eos_token = VOCAB - 1, .batch_max = 8};
}

/* no_timeouts: no engine timeouts and no orphan expiry, so a half that
 * nobody tells would wait forever. */
static void side_open(side *s, int idx, out *outs, bool no_timeouts) {
    s->idx = idx;
    s->outs = outs;
    pair_opts o = pair_defaults();
    o.page_size = PAGE;
    pd_net_config nc = node_config(&o, idx == 0 ? PD_NET_PREFILL : PD_NET_DECODE);
    /* A prefill request aborted before its engine opened the room never
     * tells the transport; the decode half's destination is an orphan until
     * orphan_ms (or the decode engine's transfer timeout). Short here. */
    nc.orphan_ms = no_timeouts ? 600000 : 1500;
    char msg[256];
    if (pd_net_create(&s->net, &nc, msg, sizeof(msg))) fail_msg("%s", msg);
    /* As a node does it: the memory a hand-off moves comes from the transport. */
    s->alloc = pd_net_allocator(s->net);
    s->meta = s->alloc.alloc(s->alloc.self, 16 * sizeof(pd_meta_row));
    assert_non_null(s->meta);
    pd_synth_config sc = synth_config();
    sc.alloc = &s->alloc;
    assert_ok(pd_synth_create(&s->sx, &sc));
    pd_executor ex = pd_synth_executor(s->sx);
    pd_exec_memory mem;
    ex.vt->memory(ex.self, &mem);
    if (pd_net_register(s->net, &mem, s->meta, 16, msg, sizeof(msg))) fail_msg("%s", msg);
    assert_int_equal(stats_of(s->net).regions_own_memory, 3);
    if (pd_net_start(s->net, msg, sizeof(msg))) fail_msg("%s", msg);
    pd_engine_config ec;
    pd_engine_config_default(&ec, idx == 0 ? PD_ROLE_PREFILL : PD_ROLE_DECODE);
    ec.page_size = PAGE;
    ec.kv_pages = sc.kv_pages;
    ec.rows = 8;
    ec.mamba_slots = sc.mamba_slots;
    ec.meta_rows = 16;
    ec.requests_max = REQS + 8;
    ec.chunk_tokens = 8;
    ec.batch_max = 8;
    ec.new_tokens_max = 16;
    /* Generous for a loaded machine, short enough that a request whose
     * other half was aborted alone ends within the test. */
    ec.bootstrap_timeout_us = 8u * 1000000u;
    ec.transfer_timeout_us = 8u * 1000000u;
    if (no_timeouts) ec.bootstrap_timeout_us = ec.transfer_timeout_us = 0;
    ec.meta_mem = s->meta;
    pd_sink sink = {&sink_vt, s};
    if (pd_engine_create(&s->e, &ec, ex, pd_net_endpoint(s->net), sink, msg, sizeof(msg)))
        fail_msg("%s", msg);
    pd_engine_set_action_observer(s->e, on_action, NULL);
}

static void side_check_clean(side *s) {
    char buf[4096];
    pd_strbuf sb;
    pd_strbuf_init(&sb, buf, sizeof(buf));
    if (pd_engine_check(s->e, &sb) != PD_OK) fail_msg("%s", buf);
    assert_true(pd_engine_idle(s->e));
}

static void side_close(side *s) {
    pd_engine_destroy(s->e);
    pd_synth_destroy(s->sx);
    s->alloc.free(s->alloc.self, s->meta);
    pd_net_destroy(s->net); /* after everyone holding its memory */
}

/* Fails with both engines' reports, after `what`. */
static void fail_with_reports(side *pre, side *dec, const char *what) {
    static char buf[16384];
    pd_strbuf sb;
    pd_strbuf_init(&sb, buf, sizeof(buf));
    pd_engine_report(pre->e, PD_REPORT_TEXT, &sb);
    pd_strbuf_append(&sb, "\n---- decode ----\n");
    pd_engine_report(dec->e, PD_REPORT_TEXT, &sb);
    fail_msg("%s:\n%s", what, buf);
}

/* The requests of engines_hand_off_over_the_network and when each is aborted. */
typedef struct workload {
    int32_t prompts[REQS][80];
    uint32_t lens[REQS], max_new[REQS];
    char rids[REQS][8];
    int abort_at[REQS];   /* step at which the request is aborted; -1: never */
    int abort_side[REQS]; /* 0 prefill, 1 decode, 2 both */
} workload;

static void workload_make(workload *wl) {
    pd_rng rng;
    pd_rng_seed(&rng, test_seed(11));
    int32_t base[48];
    for (int i = 0; i < 48; i++) base[i] = (int32_t)pd_rng_below(&rng, VOCAB - 1);
    for (int k = 0; k < REQS; k++) {
        wl->lens[k] = 3 + (uint32_t)pd_rng_below(&rng, 60);
        uint32_t shared = 0;
        if (pd_rng_chance(&rng, 1, 2))
            shared = PD_MIN(wl->lens[k], 4 * (uint32_t)pd_rng_below(&rng, 12));
        for (uint32_t i = 0; i < wl->lens[k]; i++)
            wl->prompts[k][i] = i < shared ? base[i] : (int32_t)pd_rng_below(&rng, VOCAB - 1);
        wl->max_new[k] = 1 + (uint32_t)pd_rng_below(&rng, 8);
        snprintf(wl->rids[k], sizeof(wl->rids[k]), "r%d", k);
        wl->abort_at[k] = pd_rng_chance(&rng, 1, 4) ? (int)pd_rng_below(&rng, 60) : -1;
        /* Mostly both halves, as the router does; sometimes one alone. */
        wl->abort_side[k] = pd_rng_chance(&rng, 1, 2) ? 2 : (int)pd_rng_below(&rng, 2);
    }
}

/* Submits the requests a few per step, aborts them at their steps, and
 * steps both engines until both are idle. */
static void workload_run(side *pre, side *dec, const workload *wl, const char *peer) {
    int submitted = 0;
    uint64_t t0 = t_now_ms();
    for (int step = 0;; step++) {
        uint64_t now_us = (t_now_ms() - t0) * 1000u + (uint64_t)step; /* strictly increasing */
        /* Requests arrive a few per step, at both nodes (as the router sends them). */
        for (int j = 0; j < 3 && submitted < REQS; j++, submitted++) {
            int k = submitted;
            pd_request_spec spec = {.rid = wl->rids[k], .room = 0xBEEF0000u + (uint64_t)k,
                                    .prompt = wl->prompts[k], .prompt_len = wl->lens[k],
                                    .max_new_tokens = wl->max_new[k],
                                    .sampling = {.top_p = 1.0f}, .peer = peer};
            pd_reject why;
            assert_ok(pd_engine_submit(pre->e, &spec, now_us, &why));
            assert_ok(pd_engine_submit(dec->e, &spec, now_us, &why));
        }
        for (int k = 0; k < submitted; k++) {
            if (wl->abort_at[k] != step) continue;
            if (wl->abort_side[k] != 1) pd_engine_abort(pre->e, wl->rids[k]);
            if (wl->abort_side[k] != 0) pd_engine_abort(dec->e, wl->rids[k]);
        }
        pd_engine_step(pre->e, now_us);
        pd_engine_step(dec->e, now_us);
        if (submitted == REQS && step > 60 && pd_engine_idle(pre->e) && pd_engine_idle(dec->e))
            break;
        if (t_now_ms() - t0 > DEADLINE_MS)
            fail_with_reports(pre, dec, "engines did not become idle");
        t_sleep_ms(1);
    }
}

/* Exactly one terminal event per node for every request; every finished
 * request has the tokens of the request run alone; at least half finish. */
static void check_outcomes(const out *outs, const workload *wl) {
    int finished = 0;
    pd_synth_config sc = synth_config();
    for (int k = 0; k < REQS; k++) {
        const out *o = &outs[k];
        /* Exactly one terminal event on each node. */
        assert_int_equal(o->terms[0], 1);
        assert_int_equal(o->terms[1], 1);
        if (wl->abort_at[k] < 0) {
            /* Untouched requests finish, with the tokens of the request run alone. */
            if (o->kind[1] != PD_TERM_FINISHED)
                fail_msg("request %d ended %d on decode", k, o->kind[1]);
            assert_int_equal(o->kind[0], PD_TERM_FINISHED);
        }
        if (o->kind[1] == PD_TERM_FINISHED) {
            int32_t ref[16];
            pd_sampling smp = {.top_p = 1.0f};
            uint32_t n = pd_synth_reference(&sc, true, wl->prompts[k], wl->lens[k], wl->max_new[k],
                                            NULL, 0, false, &smp, ref);
            assert_int_equal(o->n_tokens, n);
            assert_memory_equal(o->tokens, ref, n * sizeof(int32_t));
            finished++;
        }
    }
    assert_true(finished >= REQS / 2);
}

static void engines_hand_off_over_the_network(void **state) {
    (void)state;
    static out outs[REQS];
    memset(outs, 0, sizeof(outs));
    side pre = {0}, dec = {0};
    side_open(&pre, 0, outs, false);
    side_open(&dec, 1, outs, false);
    char peer[64];
    snprintf(peer, sizeof(peer), "127.0.0.1:%u", pd_net_bootstrap_port(pre.net));

    static workload wl;
    workload_make(&wl);
    workload_run(&pre, &dec, &wl, peer);
    check_outcomes(outs, &wl);
    side_check_clean(&pre);
    side_check_clean(&dec);
    WAIT_FOR(pd_net_rooms_live(pre.net) == 0 && pd_net_rooms_live(dec.net) == 0);
    pd_net_stats ps = stats_of(pre.net), ds = stats_of(dec.net);
    assert_int_equal(ps.bad_messages + ds.bad_messages, 0);
    assert_int_equal(ps.peers_connected, 1);
    side_close(&dec);
    side_close(&pre);
}

/* Steps both engines until both are idle; fails with their reports if that
 * does not happen within the deadline. */
static void run_until_idle(side *pre, side *dec, uint64_t t0, uint64_t *step) {
    for (;; (*step)++) {
        uint64_t now_us = (t_now_ms() - t0) * 1000u + *step;
        pd_engine_step(pre->e, now_us);
        pd_engine_step(dec->e, now_us);
        if (pd_engine_idle(pre->e) && pd_engine_idle(dec->e)) return;
        if (t_now_ms() - t0 > DEADLINE_MS)
            fail_with_reports(pre, dec, "a half was left waiting for its peer");
        t_sleep_ms(1);
    }
}

/* r3: the decode node refuses its half (the rid is live there with
 * another room); the prefill half must not wait for it. */
static void refused_decode_half_ends_its_prefill_half(side *pre, side *dec, pd_request_spec spec,
                                                      uint64_t t0, uint64_t *step,
                                                      const out *outs) {
    pd_reject why;
    pd_request_spec other = spec;
    other.rid = "r3", other.room = 0x5EED00FFu;
    /* r3's own pair, to keep decode's r3 live */
    assert_ok(pd_engine_submit(pre->e, &other, *step, &why));
    assert_ok(pd_engine_submit(dec->e, &other, *step, &why));
    spec.rid = "r4", spec.room = 0x5EED0004u;
    assert_ok(pd_engine_submit(pre->e, &spec, *step, &why));
    spec.rid = "r3"; /* same rid as the live one, the room of r4's prefill half */
    assert_err(pd_engine_submit(dec->e, &spec, *step, &why), PD_ERR_EXISTS);
    assert_int_equal(why.status, 409);
    run_until_idle(pre, dec, t0, step);
    assert_int_equal(outs[3].kind[0], PD_TERM_FINISHED); /* the live pair is untouched */
    assert_int_equal(outs[3].kind[1], PD_TERM_FINISHED);
    assert_int_equal(outs[4].kind[0], PD_TERM_FAILED);
    assert_int_equal(outs[4].terms[1], 0);
}

/* One terminal per half that was submitted (r4's decode half never was);
 * the rooms that were cancelled; both engines clean. */
static void check_every_half_ended_once(side *pre, side *dec, const out *outs) {
    for (int k = 0; k < 5; k++) assert_int_equal(outs[k].terms[0], 1);
    for (int k = 0; k < 4; k++) assert_int_equal(outs[k].terms[1], 1);
    pd_engine_counters pc, dc;
    pd_engine_counters_get(pre->e, &pc);
    pd_engine_counters_get(dec->e, &dc);
    assert_int_equal(pc.rooms_cancelled, 1); /* r1 */
    /* r0 and r4's refusal; r2 if its destination had not left */
    assert_true(dc.rooms_cancelled >= 2);
    side_check_clean(pre);
    side_check_clean(dec);
    pd_net_stats ps = stats_of(pre->net), ds = stats_of(dec->net);
    assert_int_equal(ps.bad_messages + ds.bad_messages, 0);
}

/* One half ends before it opened its room — aborted while queued, or
 * refused at submit — and there are no timeouts: the other half ends only
 * because the transport told it (xfer.h, cancel). Without that it would
 * wait forever and the test would hit its deadline. */
static void a_half_that_never_opened_ends_its_peer(void **state) {
    (void)state;
    static out outs[8];
    memset(outs, 0, sizeof(outs));
    side pre = {0}, dec = {0};
    side_open(&pre, 0, outs, true);
    side_open(&dec, 1, outs, true);
    char peer[64];
    snprintf(peer, sizeof(peer), "127.0.0.1:%u", pd_net_bootstrap_port(pre.net));
    int32_t prompt[20];
    for (int i = 0; i < 20; i++) prompt[i] = (int32_t)(i * 7 % (VOCAB - 1));
    pd_request_spec spec = {.prompt = prompt, .prompt_len = 20, .max_new_tokens = 4,
                            .sampling = {.top_p = 1.0f}, .peer = peer};
    pd_reject why;
    uint64_t t0 = t_now_ms(), step = 1;

    /* r0: the prefill half is waiting for its destination; the decode half
     * is aborted while it waits for memory, before it opens the room. */
    spec.rid = "r0", spec.room = 0x5EED0000u;
    assert_ok(pd_engine_submit(pre.e, &spec, step, &why));
    pd_engine_step(pre.e, step++);
    assert_ok(pd_engine_submit(dec.e, &spec, step, &why));
    assert_ok(pd_engine_abort(dec.e, "r0"));
    run_until_idle(&pre, &dec, t0, &step);
    assert_int_equal(outs[0].kind[1], PD_TERM_ABORTED);
    assert_int_equal(outs[0].kind[0], PD_TERM_FAILED);

    /* r1: the prefill half is aborted before it opens the room; the decode
     * half comes later and sends its destination. */
    spec.rid = "r1", spec.room = 0x5EED0001u;
    assert_ok(pd_engine_submit(pre.e, &spec, step, &why));
    assert_ok(pd_engine_abort(pre.e, "r1"));
    pd_engine_step(pre.e, step++);
    assert_ok(pd_engine_submit(dec.e, &spec, step, &why));
    run_until_idle(&pre, &dec, t0, &step);
    assert_int_equal(outs[1].kind[0], PD_TERM_ABORTED);
    assert_int_equal(outs[1].kind[1], PD_TERM_FAILED);

    /* r2: the decode half opens its room and is aborted at once (its
     * destination may not have left yet), the prefill half comes later. */
    spec.rid = "r2", spec.room = 0x5EED0002u;
    assert_ok(pd_engine_submit(dec.e, &spec, step, &why));
    pd_engine_step(dec.e, step++);
    assert_ok(pd_engine_abort(dec.e, "r2"));
    pd_engine_step(dec.e, step++);
    assert_ok(pd_engine_submit(pre.e, &spec, step, &why));
    run_until_idle(&pre, &dec, t0, &step);
    assert_int_equal(outs[2].kind[1], PD_TERM_ABORTED);
    assert_int_equal(outs[2].kind[0], PD_TERM_FAILED);

    refused_decode_half_ends_its_prefill_half(&pre, &dec, spec, t0, &step, outs);
    check_every_half_ended_once(&pre, &dec, outs);
    /* Every tombstone did its job (each late half came) and went. */
    WAIT_FOR(pd_net_rooms_live(dec.net) == 0 && pd_net_rooms_live(pre.net) == 0);
    side_close(&dec);
    side_close(&pre);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(engines_hand_off_over_the_network),
        cmocka_unit_test(a_half_that_never_opened_ends_its_peer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
