/* The colocated engine (pdserve serve): prefill and decode in one engine, no
 * transfer. Its answers equal the request run alone, with prefix sharing,
 * Mamba snapshots and overlap; an abort at any point releases everything. */
#include <stdio.h>
#include <stdlib.h>

#include "../test_util.h"
#include "pdserve/engine.h"
#include "pdserve/synth.h"

#define REQS 12

typedef struct out {
    char rid[16];
    int32_t tokens[64];
    uint32_t n;
    uint32_t terminals;
    pd_terminal_kind kind;
} out;

static out outs[REQS];

static out *find(const char *rid) {
    for (int i = 0; i < REQS; i++)
        if (!strcmp(outs[i].rid, rid)) return &outs[i];
    fail_msg("unknown rid %s", rid);
    return NULL;
}

/* Every sink event names its request by the tag it was submitted with. */
static out *by_tag(uint64_t tag, const char *rid) {
    assert_true(tag < REQS);
    assert_string_equal(outs[tag].rid, rid);
    return &outs[tag];
}

static void on_token(void *self, uint64_t tag, const char *rid, uint64_t room, int32_t t, float lp,
                     uint32_t i) {
    (void)self, (void)room, (void)lp;
    out *o = by_tag(tag, rid);
    assert_int_equal(i, o->n);
    assert_int_equal(o->terminals, 0);
    o->tokens[o->n++] = t;
}

static void on_term(void *self, const pd_terminal_event *ev) {
    (void)self;
    out *o = by_tag(ev->tag, ev->rid);
    o->terminals++;
    o->kind = ev->kind;
}

/* Nothing is inserted into the prefix cache for an aborted or failed request. */
static void on_action(void *ctx, const pd_action_event *ev) {
    (void)ctx;
    if (ev->action == PD_ACT_INSERT)
        assert_true(ev->kind == PD_TERM_NONE || ev->kind == PD_TERM_FINISHED);
}

static const pd_sink_vtable sink_vt = {.token = on_token, .terminal = on_term};

static void check(pd_engine *e) {
    char buf[8192];
    pd_strbuf sb;
    pd_strbuf_init(&sb, buf, sizeof(buf));
    if (pd_engine_check(e, &sb) != PD_OK) fail_msg("%s", buf);
}

static void run_colocated(bool mamba, bool overlap, uint32_t page_size, uint32_t chunk,
                          int abort_at) {
    memset(outs, 0, sizeof(outs));
    pd_synth_config sc = {.page_size = page_size, .kv_pages = 96, .mamba_slots = mamba ? 24 : 0,
                          .layers = 2, .vocab = 61, .eos_token = 60, .batch_max = 8};
    pd_synth *sx;
    assert_ok(pd_synth_create(&sx, &sc));
    pd_engine_config c;
    pd_engine_config_default(&c, PD_ROLE_COLOCATED);
    c.page_size = page_size;
    c.kv_pages = 96;
    c.rows = 4;
    c.mamba_slots = sc.mamba_slots;
    c.chunk_tokens = chunk;
    c.batch_max = 8;
    c.overlap = overlap;
    pd_engine *e;
    char msg[256];
    pd_sink sink = {&sink_vt, NULL};
    pd_err err =
        pd_engine_create(&e, &c, pd_synth_executor(sx), (pd_xfer){0}, sink, msg, sizeof(msg));
    if (err) fail_msg("%s", msg);
    pd_engine_set_action_observer(e, on_action, NULL);
    int32_t prompts[REQS][48];
    uint32_t lens[REQS];
    pd_rng rng;
    pd_rng_seed(&rng, page_size * 100 + chunk);
    for (int i = 0; i < REQS; i++) {
        lens[i] = (uint32_t)pd_rng_range(&rng, 1, 48);
        for (uint32_t k = 0; k < lens[i]; k++)
            prompts[i][k] = (i > 0 && k < lens[i] / 2) ? prompts[0][k % lens[0]]
                                                       : (int32_t)pd_rng_below(&rng, 60);
        snprintf(outs[i].rid, sizeof(outs[i].rid), "c%d", i);
        pd_request_spec s = {.rid = outs[i].rid,
                             .prompt = prompts[i],
                             .prompt_len = lens[i],
                             .max_new_tokens = 1 + (uint32_t)(i % 6),
                             .sampling = {.top_p = 1.0f},
                             .tag = (uint64_t)i};
        assert_ok(pd_engine_submit(e, &s, 0, NULL));
    }
    for (uint64_t t = 1; t < 2000 && !pd_engine_idle(e); t++) {
        if ((int)t == abort_at) {
            /* Not found only if it already ended. */
            pd_err a = pd_engine_abort(e, "c3");
            assert_true(a == PD_OK || (a == PD_ERR_NOTFOUND && find("c3")->terminals == 1));
        }
        pd_engine_step(e, t);
        check(e);
    }
    assert_true(pd_engine_idle(e));
    check(e);
    for (int i = 0; i < REQS; i++) {
        assert_int_equal(outs[i].terminals, 1);
        int32_t ref[16];
        uint32_t n = pd_synth_reference(&sc, mamba, prompts[i], lens[i], 1 + (uint32_t)(i % 6),
                                        NULL, 0, false, &(pd_sampling){.top_p = 1.0f}, ref);
        if (outs[i].kind == PD_TERM_FINISHED) assert_int_equal(outs[i].n, n);
        else assert_int_equal(outs[i].kind, PD_TERM_ABORTED);
        for (uint32_t k = 0; k < outs[i].n; k++) assert_int_equal(outs[i].tokens[k], ref[k]);
    }
    pd_engine_destroy(e);
    pd_synth_destroy(sx);
}

static void colocated_answers_equal_requests_run_alone(void **state) {
    (void)state;
    run_colocated(false, false, 4, 8, -1);
    run_colocated(true, true, 4, 8, -1);
    run_colocated(true, true, 1, 3, -1);
    run_colocated(true, false, 2, 5, -1);
}

static void colocated_abort_at_every_moment_releases_everything(void **state) {
    (void)state;
    for (int t = 1; t < 40; t += 3) run_colocated(true, true, 4, 8, t);
}

/* Runs one request (rid, the first len tokens of p) to its end; it finishes. */
static void run_one(pd_engine *e, const char *rid, const int32_t *p, uint32_t len) {
    memset(outs, 0, sizeof(outs));
    snprintf(outs[0].rid, sizeof(outs[0].rid), "%s", rid);
    pd_request_spec s = {.rid = outs[0].rid,
                         .prompt = p,
                         .prompt_len = len,
                         .max_new_tokens = 2,
                         .sampling = {.top_p = 1.0f}};
    assert_ok(pd_engine_submit(e, &s, 0, NULL));
    for (uint64_t t = 1; t < 100 && !pd_engine_idle(e); t++) {
        pd_engine_step(e, t);
        check(e);
    }
    assert_true(pd_engine_idle(e));
    assert_int_equal(outs[0].terminals, 1);
    assert_int_equal(outs[0].kind, PD_TERM_FINISHED);
}

/* KV pages the prefix cache holds (all unlocked once the engine is idle). */
static uint64_t cached_pages(pd_engine *e) {
    pd_ledger *l = pd_engine_ledger(e);
    assert_int_equal(pd_ledger_count(l, 0, PD_UNIT_CACHE_PROTECTED), 0);
    return pd_ledger_count(l, 0, PD_UNIT_CACHE_EVICTABLE);
}

/* A colocated engine over the synthetic model sc, with sc's pages, two rows,
 * requests_max records (0: the default) and chunks of `chunk` tokens. */
static pd_engine *small_engine(const pd_synth_config *sc, uint32_t requests_max, uint32_t chunk,
                               pd_synth **sx) {
    assert_ok(pd_synth_create(sx, sc));
    pd_engine_config c;
    pd_engine_config_default(&c, PD_ROLE_COLOCATED);
    c.page_size = sc->page_size;
    c.kv_pages = sc->kv_pages;
    c.rows = 2;
    if (requests_max) c.requests_max = requests_max;
    c.chunk_tokens = chunk;
    pd_engine *e;
    char msg[256];
    pd_sink sink = {&sink_vt, NULL};
    if (pd_engine_create(&e, &c, pd_synth_executor(*sx), (pd_xfer){0}, sink, msg, sizeof(msg)))
        fail_msg("%s", msg);
    return e;
}

/* A finished request's retire inserts only what the cache lacks (and skips
 * the insert when that is nothing), and leaves no lock behind either way. */
static void finished_request_caches_only_new_pages_and_keeps_no_lock(void **state) {
    (void)state;
    memset(outs, 0, sizeof(outs));
    pd_synth_config sc = {
        .page_size = 4, .kv_pages = 32, .layers = 1, .vocab = 61, .eos_token = 60, .batch_max = 4};
    pd_synth *sx;
    pd_engine *e = small_engine(&sc, 0, 64, &sx);
    char msg[256];
    int32_t p[16];
    for (int i = 0; i < 16; i++) p[i] = 1 + i;
    run_one(e, "a", p, 12); /* three whole pages, all new */
    assert_int_equal(cached_pages(e), 3);
    run_one(e, "b", p, 9); /* two whole pages, both cached: nothing new */
    assert_int_equal(cached_pages(e), 3);
    run_one(e, "c", p, 16); /* four whole pages, the fourth new */
    assert_int_equal(cached_pages(e), 4);
    pd_cache_flush f;
    assert_ok(pd_engine_flush_cache(e, &f, msg, sizeof(msg)));
    assert_int_equal(f.kv_pages, 4);
    pd_engine_destroy(e);
    pd_synth_destroy(sx);
}

/* One record serves every request (requests_max 1): its prompt and history
 * buffers, kept from one request to the next (engine.c, buf_fit), are
 * reused when large enough and replaced when not, and each answer equals
 * the request run alone, penalised ones (which read the history) too. */
static void a_records_kept_buffers_serve_its_next_requests(void **state) {
    (void)state;
    pd_synth_config sc = {
        .page_size = 4, .kv_pages = 64, .layers = 1, .vocab = 61, .eos_token = 60, .batch_max = 4};
    pd_synth *sx;
    pd_engine *e = small_engine(&sc, 1, 16, &sx);
    static const uint32_t lens[] = {5, 40, 3, 41, 40, 7};
    static const uint32_t news[] = {2, 12, 3, 16, 1, 20};
    pd_sampling plain = {.top_p = 1.0f};
    pd_sampling pen = {.top_p = 1.0f, .repetition_penalty = 1.5f, .frequency_penalty = 0.7f};
    for (int i = 0; i < 6; i++) {
        memset(outs, 0, sizeof(outs));
        snprintf(outs[0].rid, sizeof(outs[0].rid), "k%d", i);
        int32_t p[48];
        for (uint32_t k = 0; k < lens[i]; k++) p[k] = (int32_t)((k * 13 + (uint32_t)i * 7) % 60);
        const pd_sampling *sm = i % 3 == 0 ? &plain : &pen;
        pd_request_spec s = {.rid = outs[0].rid,
                             .prompt = p,
                             .prompt_len = lens[i],
                             .max_new_tokens = news[i],
                             .ignore_eos = true,
                             .sampling = *sm};
        assert_ok(pd_engine_submit(e, &s, 0, NULL));
        for (uint64_t t = 1; t < 200 && !pd_engine_idle(e); t++) {
            pd_engine_step(e, t);
            check(e);
        }
        assert_true(pd_engine_idle(e));
        assert_int_equal(outs[0].terminals, 1);
        int32_t ref[32];
        uint32_t n = pd_synth_reference(&sc, false, p, lens[i], news[i], NULL, 0, true, sm, ref);
        assert_int_equal(outs[0].n, n);
        for (uint32_t k = 0; k < n; k++) assert_int_equal(outs[0].tokens[k], ref[k]);
    }
    pd_engine_destroy(e);
    pd_synth_destroy(sx);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(colocated_answers_equal_requests_run_alone),
        cmocka_unit_test(colocated_abort_at_every_moment_releases_everything),
        cmocka_unit_test(finished_request_caches_only_new_pages_and_keeps_no_lock),
        cmocka_unit_test(a_records_kept_buffers_serve_its_next_requests),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
