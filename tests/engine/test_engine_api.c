/* The engine's public API at its edges: every kind of bad input is refused at
 * submit with its status and a message that names the problem, and leaves no
 * trace; unknown rids abort as "not found"; creation refuses inconsistent
 * configurations; the engine's own check catches a request whose flags and
 * the ledger disagree. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "../test_util.h"
#include "pdserve/engine.h"
#include "pdserve/loopback.h"
#include "pdserve/synth.h"

typedef struct world {
    pd_loopback *lb;
    pd_synth *sx;
    pd_engine *e;
    pd_meta_row meta[8];
    uint32_t terminals;
} world;

static void on_token(void *self, uint64_t tag, const char *rid, uint64_t room, int32_t t, float lp,
                     uint32_t i) {
    (void)self, (void)tag, (void)rid, (void)room, (void)t, (void)lp, (void)i;
}
static void on_term(void *self, const pd_terminal_event *ev) {
    (void)ev;
    ((world *)self)->terminals++;
}
static const pd_sink_vtable sink_vt = {.token = on_token, .terminal = on_term};

static void base_config(pd_engine_config *c, pd_role role) {
    pd_engine_config_default(c, role);
    c->page_size = 4;
    c->kv_pages = 16; /* 64 tokens */
    c->rows = 2;
    c->meta_rows = 8;
    c->requests_max = 3;
    c->new_tokens_max = 32;
}

static world *world_new(pd_role role) {
    world *w = calloc(1, sizeof(*w));
    pd_loopback_config lc = {.latency = 1, .rooms_max = 16, .page_size = 4};
    assert_ok(pd_loopback_create(&w->lb, &lc));
    pd_synth_config sc = {.page_size = 4, .kv_pages = 16, .layers = 1,
                          .vocab = 50, .eos_token = 49, .batch_max = 8};
    assert_ok(pd_synth_create(&w->sx, &sc));
    pd_engine_config c;
    base_config(&c, role);
    c.meta_mem = w->meta;
    char msg[256];
    pd_sink sink = {&sink_vt, w};
    pd_lb_side side = role == PD_ROLE_PREFILL ? PD_LB_PREFILL : PD_LB_DECODE;
    pd_err err = pd_engine_create(&w->e, &c, pd_synth_executor(w->sx),
                                  pd_loopback_endpoint(w->lb, side), sink, msg, sizeof(msg));
    if (err) fail_msg("create: %s", msg);
    return w;
}

static void world_free(world *w) {
    pd_engine_destroy(w->e);
    pd_synth_destroy(w->sx);
    pd_loopback_destroy(w->lb);
    free(w);
}

static void assert_clean(world *w) {
    char buf[4096];
    pd_strbuf sb;
    pd_strbuf_init(&sb, buf, sizeof(buf));
    if (pd_engine_check(w->e, &sb) != PD_OK) fail_msg("%s", buf);
    assert_true(pd_engine_idle(w->e));
}

static int32_t prompt[100];

static pd_request_spec good(void) {
    for (int i = 0; i < 100; i++) prompt[i] = i % 40;
    return (pd_request_spec){.rid = "a", .room = 11, .prompt = prompt, .prompt_len = 10,
                             .max_new_tokens = 4, .sampling = {.top_p = 1.0f}};
}

/* Submit s, expect it refused with err and status, and the message to contain text. */
static void refused(world *w, pd_request_spec s, pd_err err, int status, const char *text) {
    pd_reject why;
    memset(&why, 0, sizeof(why));
    assert_err(pd_engine_submit(w->e, &s, 0, &why), err);
    assert_int_equal(why.status, status);
    if (!strstr(why.message, text)) fail_msg("message '%s' lacks '%s'", why.message, text);
    assert_clean(w); /* never entered a queue */
}

static void bad_requests_are_refused_with_a_reason(void **state) {
    (void)state;
    world *w = world_new(PD_ROLE_DECODE);
    pd_request_spec s;
    s = good(); s.rid = ""; refused(w, s, PD_ERR_INVALID, 400, "rid is empty");
    s = good(); s.rid = "bad\nrid"; refused(w, s, PD_ERR_INVALID, 400, "control character");
    char longrid[100];
    memset(longrid, 'x', 99);
    longrid[99] = 0;
    s = good(); s.rid = longrid; refused(w, s, PD_ERR_INVALID, 400, "rid longer than");
    s = good(); s.room = 0; refused(w, s, PD_ERR_INVALID, 400, "unknown room");
    s = good(); s.prompt_len = 0; refused(w, s, PD_ERR_INVALID, 400, "empty prompt");
    s = good(); s.max_new_tokens = 0;
    refused(w, s, PD_ERR_INVALID, 400, "max_new_tokens must be at least 1");
    s = good(); s.max_new_tokens = 33; refused(w, s, PD_ERR_INVALID, 400, "above the limit 32");
    s = good(); s.sampling.temperature = -0.5f; refused(w, s, PD_ERR_INVALID, 400, "temperature");
    s = good(); s.sampling.temperature = NAN; refused(w, s, PD_ERR_INVALID, 400, "temperature");
    s = good(); s.sampling.temperature = INFINITY;
    refused(w, s, PD_ERR_INVALID, 400, "temperature");
    s = good(); s.sampling.top_p = 0.0f; refused(w, s, PD_ERR_INVALID, 400, "top_p");
    s = good(); s.sampling.top_p = 1.5f; refused(w, s, PD_ERR_INVALID, 400, "top_p");
    int32_t stops[9] = {1};
    s = good(); s.stop_tokens = stops; s.n_stop_tokens = 9;
    refused(w, s, PD_ERR_INVALID, 400, "stop tokens");
    stops[0] = 77;
    s = good(); s.stop_tokens = stops; s.n_stop_tokens = 1;
    refused(w, s, PD_ERR_INVALID, 400, "stop token 77");
    s = good(); prompt[3] = 50; refused(w, s, PD_ERR_INVALID, 400, "prompt token 50 at position 3");
    s = good(); prompt[3] = -1; refused(w, s, PD_ERR_INVALID, 400, "prompt token -1");
    /* 62 prompt + 4 new tokens need KV for 65 positions (the last token is
     * never fed back): more than the decode node's 64. 61 + 4 would fit. */
    s = good(); s.prompt_len = 62; refused(w, s, PD_ERR_TOOBIG, 413, "does not fit");
    pd_engine_counters c;
    pd_engine_counters_get(w->e, &c);
    assert_int_equal(c.rejected, 17);
    assert_int_equal(c.submitted, 0);
    assert_int_equal(w->terminals, 0);
    world_free(w);
}

static void duplicates_and_capacity_are_refused(void **state) {
    (void)state;
    world *w = world_new(PD_ROLE_PREFILL);
    pd_request_spec s = good();
    assert_ok(pd_engine_submit(w->e, &s, 0, NULL));
    pd_reject why;
    assert_err(pd_engine_submit(w->e, &s, 0, &why), PD_ERR_EXISTS);
    assert_int_equal(why.status, 409);
    assert_non_null(strstr(why.message, "rid 'a' is already live"));
    s.rid = "b"; /* same room */
    assert_err(pd_engine_submit(w->e, &s, 0, &why), PD_ERR_EXISTS);
    assert_non_null(strstr(why.message, "room 11 is already live"));
    s.room = 12;
    assert_ok(pd_engine_submit(w->e, &s, 0, NULL));
    s.rid = "c";
    s.room = 13;
    assert_ok(pd_engine_submit(w->e, &s, 0, NULL));
    s.rid = "d";
    s.room = 14;
    assert_err(pd_engine_submit(w->e, &s, 0, &why), PD_ERR_NOMEM);
    assert_int_equal(why.status, 429);
    /* A prefill node only needs the prompt to fit. */
    assert_int_equal(pd_engine_abort_all(w->e), 3);
    assert_int_equal(w->terminals, 3);
    for (int i = 0; i < 10; i++) pd_engine_step(w->e, (uint64_t)i);
    pd_loopback_advance(w->lb, 100);
    for (int i = 0; i < 10; i++) pd_engine_step(w->e, 100 + (uint64_t)i);
    assert_clean(w);
    world_free(w);
}

static void abort_of_unknown_or_ended_rid_is_not_found(void **state) {
    (void)state;
    world *w = world_new(PD_ROLE_PREFILL);
    assert_err(pd_engine_abort(w->e, "nobody"), PD_ERR_NOTFOUND);
    assert_err(pd_engine_abort(w->e, NULL), PD_ERR_NOTFOUND);
    pd_request_spec s = good();
    assert_ok(pd_engine_submit(w->e, &s, 0, NULL));
    assert_ok(pd_engine_abort(w->e, "a"));
    assert_int_equal(w->terminals, 1);
    assert_err(pd_engine_abort(w->e, "a"), PD_ERR_NOTFOUND);
    assert_int_equal(w->terminals, 1);
    assert_int_equal(pd_engine_abort_all(w->e), 0);
    assert_clean(w);
    world_free(w);
}

/* pd_engine_create for a prefill engine on sx; msg gets the reason of a refusal. */
static pd_err create_prefill(pd_engine **e, const pd_engine_config *c, pd_synth *sx,
                             pd_loopback *lb, char *msg, size_t msg_cap) {
    pd_sink sink = {&sink_vt, NULL};
    return pd_engine_create(e, c, pd_synth_executor(sx), pd_loopback_endpoint(lb, PD_LB_PREFILL),
                            sink, msg, msg_cap);
}

static void create_refuses_inconsistent_configurations(void **state) {
    (void)state;
    pd_loopback *lb;
    pd_loopback_config lc = {.latency = 1, .rooms_max = 4, .page_size = 4};
    assert_ok(pd_loopback_create(&lb, &lc));
    pd_synth *sx;
    pd_synth_config sc = {.page_size = 4, .kv_pages = 16, .layers = 1,
                          .vocab = 50, .eos_token = -1, .batch_max = 8};
    assert_ok(pd_synth_create(&sx, &sc));
    pd_meta_row meta[4];
    pd_engine *e = NULL;
    char msg[256];
    pd_engine_config c;
    base_config(&c, PD_ROLE_PREFILL);
    c.meta_mem = meta;
    c.meta_rows = 4;
    c.kv_pages = 32; /* the executor has 16 */
    assert_err(create_prefill(&e, &c, sx, lb, msg, sizeof(msg)), PD_ERR_INVALID);
    assert_non_null(strstr(msg, "smaller than the pools"));
    base_config(&c, PD_ROLE_PREFILL);
    c.meta_mem = meta;
    c.meta_rows = 4;
    c.page_size = 8;
    assert_err(create_prefill(&e, &c, sx, lb, msg, sizeof(msg)), PD_ERR_INVALID);
    assert_non_null(strstr(msg, "page size"));
    base_config(&c, PD_ROLE_PREFILL);
    c.meta_mem = meta;
    c.meta_rows = 4;
    c.mamba_slots = 4; /* the executor has no Mamba state */
    assert_err(create_prefill(&e, &c, sx, lb, msg, sizeof(msg)), PD_ERR_INVALID);
    pd_synth *hybrid;
    sc.mamba_slots = 4;
    assert_ok(pd_synth_create(&hybrid, &sc));
    base_config(&c, PD_ROLE_PREFILL);
    c.meta_mem = meta;
    c.meta_rows = 4; /* and mamba_slots = 0 for a model with Mamba layers */
    assert_err(create_prefill(&e, &c, hybrid, lb, msg, sizeof(msg)), PD_ERR_INVALID);
    assert_non_null(strstr(msg, "has Mamba layers but mamba_slots is 0"));
    pd_synth_destroy(hybrid);
    base_config(&c, PD_ROLE_PREFILL);
    c.meta_mem = NULL;
    assert_err(create_prefill(&e, &c, sx, lb, msg, sizeof(msg)), PD_ERR_INVALID);
    base_config(&c, PD_ROLE_PREFILL);
    c.meta_mem = meta;
    c.host_pages = 8;
    c.prefix_cache = false;
    assert_err(create_prefill(&e, &c, sx, lb, msg, sizeof(msg)), PD_ERR_INVALID);
    assert_null(e);
    pd_synth_destroy(sx);
    pd_loopback_destroy(lb);
}

static void engine_check_catches_flags_disagreeing_with_the_ledger(void **state) {
    (void)state;
    world *w = world_new(PD_ROLE_PREFILL);
    pd_request_spec s = good();
    assert_ok(pd_engine_submit(w->e, &s, 0, NULL));
    pd_engine_step(w->e, 1); /* takes a metadata row, opens the room */
    char buf[8192];
    pd_strbuf sb;
    pd_strbuf_init(&sb, buf, sizeof(buf));
    assert_ok(pd_engine_check(w->e, &sb));
    /* A bug takes a page on the request's behalf behind its flags' back. */
    uint64_t owner = pd_engine_request_id(w->e, "a");
    assert_true(owner != 0);
    uint32_t page;
    assert_ok(pd_ledger_alloc(pd_engine_ledger(w->e), 0, 1, owner, &page));
    pd_strbuf_reset(&sb);
    assert_err(pd_engine_check(w->e, &sb), PD_ERR_INTERNAL);
    if (!strstr(buf, "request a (BOOTSTRAP) holds 1 kv units, its flags say 0"))
        fail_msg("%s", buf);
    assert_non_null(strstr(buf, "rid=a"));
    assert_ok(pd_ledger_free(pd_engine_ledger(w->e), 0, &page, 1, PD_UNIT_REQ, owner));
    pd_strbuf_reset(&sb);
    assert_ok(pd_engine_check(w->e, &sb));
    /* JSON report names the request. */
    pd_strbuf_reset(&sb);
    pd_engine_report(w->e, PD_REPORT_JSON, &sb);
    assert_non_null(strstr(buf, "\"rid\":\"a\""));
    world_free(w);
}

/* A decode-side transport that reports every room done before the prefill
 * side wrote anything: the loopback's decode endpoint but for status. */
typedef struct early_xfer {
    pd_xfer inner;
    pd_xfer_vtable vt;
} early_xfer;

static pd_xfer_status early_status(void *self, uint64_t room) {
    (void)self, (void)room;
    return PD_XFER_SUCCESS;
}
static pd_err early_ro(void *self, uint64_t room, const char *peer, const pd_xfer_dest *d) {
    early_xfer *x = self;
    return x->inner.vt->receiver_open(x->inner.self, room, peer, d);
}
static pd_err early_abort(void *self, uint64_t room) {
    early_xfer *x = self;
    return x->inner.vt->abort(x->inner.self, room);
}
static bool early_drained(void *self, uint64_t room) {
    early_xfer *x = self;
    return x->inner.vt->drained(x->inner.self, room);
}
static void early_close(void *self, uint64_t room) {
    early_xfer *x = self;
    x->inner.vt->close(x->inner.self, room);
}

typedef struct last_term {
    uint32_t n, tokens;
    pd_terminal_kind kind;
    int status;
    char message[160];
} last_term;

static void lt_token(void *self, uint64_t tag, const char *rid, uint64_t room, int32_t t, float lp,
                     uint32_t i) {
    (void)tag, (void)rid, (void)room, (void)t, (void)lp, (void)i;
    ((last_term *)self)->tokens++;
}
static void lt_term(void *self, const pd_terminal_event *ev) {
    last_term *lt = self;
    lt->n++;
    lt->kind = ev->kind;
    lt->status = ev->status_code;
    snprintf(lt->message, sizeof(lt->message), "%s", ev->message ? ev->message : "");
}
static const pd_sink_vtable lt_vt = {.token = lt_token, .terminal = lt_term};

/* A metadata row left from an earlier use that carries this room's nonce
 * (a retried room landing on the same row) is not this transfer's: the
 * decode node clears each row's nonce when it takes the row, so a transport
 * that reports success without the row written fails the request as context
 * corruption instead of generating from the stale row. */
static void a_stale_meta_row_with_the_rooms_nonce_fails_it(void **state) {
    (void)state;
    pd_loopback *lb;
    pd_loopback_config lc = {.latency = 1, .rooms_max = 16, .page_size = 4};
    assert_ok(pd_loopback_create(&lb, &lc));
    pd_synth *sx;
    pd_synth_config sc = {
        .page_size = 4, .kv_pages = 16, .layers = 1, .vocab = 50, .eos_token = 49, .batch_max = 8};
    assert_ok(pd_synth_create(&sx, &sc));
    pd_request_spec s = good();
    pd_meta_row meta[8];
    early_xfer x = {.inner = pd_loopback_endpoint(lb, PD_LB_DECODE)};
    x.vt = (pd_xfer_vtable){.receiver_open = early_ro,
                            .status = early_status,
                            .abort = early_abort,
                            .drained = early_drained,
                            .close = early_close};
    pd_engine_config c;
    base_config(&c, PD_ROLE_DECODE);
    c.meta_mem = meta;
    last_term lt = {0};
    pd_engine *e;
    char msg[256];
    pd_err err = pd_engine_create(&e, &c, pd_synth_executor(sx), (pd_xfer){&x.vt, &x},
                                  (pd_sink){&lt_vt, &lt}, msg, sizeof(msg));
    if (err) fail_msg("create: %s", msg);
    for (int i = 0; i < 8; i++) /* create cleared them */
        meta[i] = (pd_meta_row){
            .nonce = pd_room_nonce(s.room), .first_token = 5, .prompt_tokens = s.prompt_len};
    assert_ok(pd_engine_submit(e, &s, 0, NULL));
    for (uint64_t t = 1; t <= 4 && lt.n == 0; t++) pd_engine_step(e, t);
    assert_int_equal(lt.n, 1);
    assert_int_equal(lt.tokens, 0);
    assert_int_equal(lt.kind, PD_TERM_FAILED);
    assert_int_equal(lt.status, 500);
    if (!strstr(lt.message, "context corruption")) fail_msg("message '%s'", lt.message);
    char buf[4096];
    pd_strbuf sb;
    pd_strbuf_init(&sb, buf, sizeof(buf));
    if (pd_engine_check(e, &sb) != PD_OK) fail_msg("%s", buf);
    pd_engine_destroy(e);
    pd_synth_destroy(sx);
    pd_loopback_destroy(lb);
}

/* A decode engine destroyed with its room open (a node shut down without
 * draining): the loopback watched the room's status into the engine's
 * record, and must not write it after the engine is gone. The sender's
 * abort reaching the receiver's half afterwards changes that half's status;
 * were the record still watched, ASan would report the write into freed
 * memory. */
static void an_engine_destroyed_with_its_room_open_is_not_written_after(void **state) {
    (void)state;
    world *w = world_new(PD_ROLE_DECODE);
    pd_request_spec s = good();
    assert_ok(pd_engine_submit(w->e, &s, 0, NULL));
    pd_engine_step(w->e, 1); /* preallocates and opens the room, watched */
    pd_xfer snd = pd_loopback_endpoint(w->lb, PD_LB_PREFILL);
    assert_int_equal(pd_loopback_status(w->lb, PD_LB_DECODE, s.room), PD_XFER_BOOTSTRAPPING);
    pd_engine_destroy(w->e);
    w->e = NULL;
    assert_ok(snd.vt->sender_open(snd.self, s.room));
    pd_loopback_advance(w->lb, 2); /* the destination reaches the sender */
    (void)snd.vt->abort(snd.self, s.room);
    for (uint64_t t = 3; t < 8; t++) pd_loopback_advance(w->lb, t);
    assert_int_equal(pd_loopback_status(w->lb, PD_LB_DECODE, s.room), PD_XFER_FAILED);
    world_free(w);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(bad_requests_are_refused_with_a_reason),
        cmocka_unit_test(duplicates_and_capacity_are_refused),
        cmocka_unit_test(abort_of_unknown_or_ended_rid_is_not_found),
        cmocka_unit_test(create_refuses_inconsistent_configurations),
        cmocka_unit_test(engine_check_catches_flags_disagreeing_with_the_ledger),
        cmocka_unit_test(a_stale_meta_row_with_the_rooms_nonce_fails_it),
        cmocka_unit_test(an_engine_destroyed_with_its_room_open_is_not_written_after),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
