/* pd_engine_flush_cache, SGLang's /flush_cache at the engine: a flush gives
 * every unit of the prefix cache (device pages, host copies, Mamba
 * snapshots) back to its pool through the ledger, so the engine is
 * idle-clean afterwards and a prompt served before is computed again; while
 * a request is live the flush is refused and changes nothing. */
#include <stdio.h>
#include <stdlib.h>

#include "../test_util.h"
#include "pdserve/engine.h"
#include "pdserve/pool.h"
#include "pdserve/synth.h"

#define TAGS 8
#define PROMPT_LEN 40

typedef struct fixture {
    pd_synth *sx;
    pd_engine *e;
    uint32_t terminals[TAGS];
    uint32_t cached[TAGS];
    pd_terminal_kind kind[TAGS];
} fixture;

static void on_token(void *self, uint64_t tag, const char *rid, uint64_t room, int32_t t, float lp,
                     uint32_t i) {
    (void)self, (void)tag, (void)rid, (void)room, (void)t, (void)lp, (void)i;
}

static void on_term(void *self, const pd_terminal_event *ev) {
    fixture *f = self;
    assert_true(ev->tag < TAGS);
    f->terminals[ev->tag]++;
    f->cached[ev->tag] = ev->cached_tokens;
    f->kind[ev->tag] = ev->kind;
}

static const pd_sink_vtable sink_vt = {.token = on_token, .terminal = on_term};

/* A colocated engine whose KV pool holds about two prompts, with a host
 * tier and Mamba snapshots, so that serving three prompts writes one back
 * to the host; prefix_cache false: no cache at all. */
static fixture *fixture_new(bool prefix_cache) {
    fixture *f = calloc(1, sizeof(*f));
    assert_non_null(f);
    pd_synth_config sc = {.page_size = 4,
                          .kv_pages = 24,
                          .mamba_slots = 12,
                          .host_pages = 32,
                          .layers = 2,
                          .vocab = 61,
                          .eos_token = -1,
                          .batch_max = 4};
    assert_ok(pd_synth_create(&f->sx, &sc));
    pd_engine_config c;
    pd_engine_config_default(&c, PD_ROLE_COLOCATED);
    c.page_size = 4;
    c.kv_pages = 24;
    c.mamba_slots = 12;
    c.host_pages = prefix_cache ? 32 : 0;
    c.rows = 4;
    c.chunk_tokens = 16;
    c.batch_max = 4;
    c.prefix_cache = prefix_cache;
    c.strict = true;
    char msg[256];
    pd_sink sink = {&sink_vt, f};
    if (pd_engine_create(&f->e, &c, pd_synth_executor(f->sx), (pd_xfer){0}, sink, msg,
                         sizeof(msg)) != PD_OK)
        fail_msg("%s", msg);
    return f;
}

static void fixture_free(fixture *f) {
    pd_engine_destroy(f->e);
    pd_synth_destroy(f->sx);
    free(f);
}

static void check(pd_engine *e) {
    char buf[8192];
    pd_strbuf sb;
    pd_strbuf_init(&sb, buf, sizeof(buf));
    if (pd_engine_check(e, &sb) != PD_OK) fail_msg("%s", buf);
}

static void prompt_of(int which, int32_t *out) {
    for (int k = 0; k < PROMPT_LEN; k++) out[k] = (int32_t)((which * 17 + k * 7) % 60);
}

static void submit(fixture *f, int which, uint64_t tag, uint32_t max_new) {
    int32_t prompt[PROMPT_LEN];
    prompt_of(which, prompt);
    char rid[16];
    snprintf(rid, sizeof(rid), "r%llu", (unsigned long long)tag);
    pd_request_spec s = {.rid = rid,
                         .prompt = prompt,
                         .prompt_len = PROMPT_LEN,
                         .max_new_tokens = max_new,
                         .sampling = {.top_p = 1.0f},
                         .ignore_eos = true,
                         .tag = tag};
    assert_ok(pd_engine_submit(f->e, &s, 0, NULL));
}

static void run_idle(fixture *f) {
    for (uint64_t t = 1; t < 5000 && !pd_engine_idle(f->e); t++) {
        pd_engine_step(f->e, t);
        check(f->e);
    }
    assert_true(pd_engine_idle(f->e));
    check(f->e);
}

/* Prompt `which`, alone, to its end; returns its cached_tokens. */
static uint32_t serve(fixture *f, int which, uint64_t tag) {
    submit(f, which, tag, 2);
    run_idle(f);
    assert_int_equal(f->terminals[tag], 1);
    assert_int_equal(f->kind[tag], PD_TERM_FINISHED);
    return f->cached[tag];
}

/* Units of a pool kind in one ledger state (0 when the engine has no such pool). */
static uint64_t units(pd_engine *e, pd_pool_kind kind, pd_unit_state st) {
    pd_ledger *l = pd_engine_ledger(e);
    for (int p = 0; p < pd_ledger_pool_count(l); p++)
        if (pd_pool_kind_of(pd_ledger_pool(l, p)) == kind) return pd_ledger_count(l, p, st);
    return 0;
}

static void assert_every_unit_free(pd_engine *e) {
    pd_ledger *l = pd_engine_ledger(e);
    for (int p = 0; p < pd_ledger_pool_count(l); p++) {
        pd_pool *pool = pd_ledger_pool(l, p);
        if (pd_pool_free_count(pool) != pd_pool_total(pool))
            fail_msg("pool %s: %u of %u units free after the flush", pd_pool_name(pool),
                     pd_pool_free_count(pool), pd_pool_total(pool));
    }
}

static void flush_frees_every_cached_unit_on_device_and_host(void **state) {
    (void)state;
    fixture *f = fixture_new(true);
    assert_int_equal(serve(f, 0, 0), 0);
    assert_int_equal(serve(f, 1, 1), 0);
    assert_int_equal(serve(f, 2, 2), 0); /* evicts prompt 0, written back to the host */
    assert_true(serve(f, 2, 3) > 0);     /* served again: from the cache */
    assert_true(units(f->e, PD_POOL_KV, PD_UNIT_CACHE_EVICTABLE) > 0);
    assert_true(units(f->e, PD_POOL_HOST, PD_UNIT_CACHE_EVICTABLE) > 0);
    assert_true(units(f->e, PD_POOL_MAMBA, PD_UNIT_CACHE_EVICTABLE) > 0);
    uint64_t kv = units(f->e, PD_POOL_KV, PD_UNIT_CACHE_EVICTABLE);
    uint64_t host = units(f->e, PD_POOL_HOST, PD_UNIT_CACHE_EVICTABLE);

    pd_cache_flush out;
    char msg[256];
    assert_ok(pd_engine_flush_cache(f->e, &out, msg, sizeof(msg)));
    assert_int_equal(out.kv_pages, kv);
    assert_int_equal(out.host_pages, host);
    assert_true(out.mamba_slots > 0);
    assert_non_null(strstr(msg, "flushed the prefix cache"));
    check(f->e);
    assert_every_unit_free(f->e);

    /* The same prompt is computed from scratch, and caching works again. */
    assert_int_equal(serve(f, 2, 4), 0);
    assert_true(serve(f, 2, 5) > 0);
    fixture_free(f);
}

static void flush_is_refused_while_a_request_holds_cached_units(void **state) {
    (void)state;
    fixture *f = fixture_new(true);
    assert_int_equal(serve(f, 0, 0), 0);
    submit(f, 0, 1, 30); /* matches prompt 0's cached prefix and locks it */
    for (uint64_t t = 1; t < 50 && units(f->e, PD_POOL_KV, PD_UNIT_CACHE_PROTECTED) == 0; t++)
        pd_engine_step(f->e, t);
    uint64_t locked = units(f->e, PD_POOL_KV, PD_UNIT_CACHE_PROTECTED);
    uint64_t evictable = units(f->e, PD_POOL_KV, PD_UNIT_CACHE_EVICTABLE);
    assert_true(locked > 0);
    assert_false(pd_engine_idle(f->e));

    pd_cache_flush out = {.kv_pages = 99};
    char msg[256];
    assert_err(pd_engine_flush_cache(f->e, &out, msg, sizeof(msg)), PD_ERR_STATE);
    if (!strstr(msg, "1 requests live (1 of them holding cached units)")) fail_msg("%s", msg);
    assert_int_equal(out.kv_pages, 0);
    assert_int_equal(units(f->e, PD_POOL_KV, PD_UNIT_CACHE_PROTECTED), locked);
    assert_int_equal(units(f->e, PD_POOL_KV, PD_UNIT_CACHE_EVICTABLE), evictable);
    check(f->e);

    assert_ok(pd_engine_abort(f->e, "r1"));
    run_idle(f);
    assert_int_equal(f->kind[1], PD_TERM_ABORTED);
    assert_ok(pd_engine_flush_cache(f->e, &out, msg, sizeof(msg)));
    assert_true(out.kv_pages >= locked);
    check(f->e);
    assert_every_unit_free(f->e);
    fixture_free(f);
}

static void flush_without_a_prefix_cache_has_nothing_to_do(void **state) {
    (void)state;
    fixture *f = fixture_new(false);
    assert_int_equal(serve(f, 0, 0), 0);
    pd_cache_flush out;
    char msg[256];
    assert_ok(pd_engine_flush_cache(f->e, &out, msg, sizeof(msg)));
    assert_int_equal(out.kv_pages + out.host_pages + out.mamba_slots, 0);
    assert_non_null(strstr(msg, "no prefix cache"));
    check(f->e);
    fixture_free(f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(flush_frees_every_cached_unit_on_device_and_host),
        cmocka_unit_test(flush_is_refused_while_a_request_holds_cached_units),
        cmocka_unit_test(flush_without_a_prefix_cache_has_nothing_to_do),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
