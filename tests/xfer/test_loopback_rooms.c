/* The loopback's room lookup: a room id's record is found through a hint
 * slot that other ids share (ids equal modulo 2^20 share one at every table
 * size up to 2^20), trusted only while its record still holds that very id.
 * Each check below fails if the hint is trusted on the slot alone (a record
 * of another id, or one freed and reused by another room). */
#include "../test_util.h"
#include "pdserve/loopback.h"
#include "pdserve/pool.h"

enum { N_PAGES = 4, PAGE_BYTES = 8, STRIDE = 1u << 20 };

typedef struct fixture {
    pd_loopback *lb;
    pd_xfer s, r;
    uint8_t kv[2][N_PAGES][PAGE_BYTES];
    pd_meta_row meta[2][1];
    uint64_t now;
} fixture;

static void fx_init(fixture *f, uint32_t rooms_max) {
    memset(f, 0, sizeof(*f));
    pd_loopback_config lc = {.latency = 1, .rooms_max = rooms_max, .page_size = 4};
    assert_ok(pd_loopback_create(&f->lb, &lc));
    for (int side = 0; side < 2; side++) {
        pd_exec_memory m = {.kv = f->kv[side], .kv_page_bytes = PAGE_BYTES, .kv_pages = N_PAGES};
        pd_loopback_register(f->lb, (pd_lb_side)side, &m, f->meta[side], 1);
    }
    f->s = pd_loopback_endpoint(f->lb, PD_LB_PREFILL);
    f->r = pd_loopback_endpoint(f->lb, PD_LB_DECODE);
}

static void step(fixture *f) { pd_loopback_advance(f->lb, ++f->now); }

static pd_xfer_status st_s(fixture *f, uint64_t room) { return f->s.vt->status(f->s.self, room); }
static pd_xfer_status st_r(fixture *f, uint64_t room) { return f->r.vt->status(f->r.self, room); }

/* Opens room's receiver with destination page dst (one page). */
static void open_r(fixture *f, uint64_t room, uint32_t *dst) {
    pd_xfer_dest d = {
        .prompt_tokens = 4, .pages = dst, .n_pages = 1, .mamba_slot = PD_POOL_NONE, .meta_row = 0};
    assert_ok(f->r.vt->receiver_open(f->r.self, room, NULL, &d));
}

static void ids_sharing_a_hint_see_only_their_own_room(void **state) {
    (void)state;
    fixture *f = malloc(sizeof(*f));
    assert_non_null(f);
    fx_init(f, 4);
    const uint64_t a = 7, b = 7 + STRIDE, c = 7 + 2ull * STRIDE;
    uint32_t dst_a = 1, dst_b = 2;
    open_r(f, a, &dst_a);
    assert_ok(f->s.vt->sender_open(f->s.self, a));
    step(f); /* a's destination reaches its sender */
    assert_int_equal(st_s(f, a), PD_XFER_WAITING_FOR_INPUT);
    /* b shares a's hint slot and is in no record yet. */
    assert_int_equal(st_s(f, b), PD_XFER_NONE);
    assert_int_equal(st_r(f, b), PD_XFER_NONE);
    assert_true(f->r.vt->drained(f->r.self, b));
    open_r(f, b, &dst_b); /* the slot now names b's record */
    assert_int_equal(st_r(f, b), PD_XFER_BOOTSTRAPPING);
    assert_int_equal(st_s(f, b), PD_XFER_NONE); /* b's sender has not opened */
    assert_int_equal(st_s(f, a), PD_XFER_WAITING_FOR_INPUT);
    assert_int_equal(st_s(f, b), PD_XFER_NONE);
    /* A write to a lands in a's destination, not b's. */
    for (uint32_t p = 0; p < N_PAGES; p++) memset(f->kv[0][p], (int)(p + 1), PAGE_BYTES);
    uint32_t src = 3;
    assert_ok(f->s.vt->send_final(f->s.self, a, 0, &src, 1, PD_POOL_NONE, 0));
    for (int i = 0; i < 4; i++) step(f);
    assert_int_equal(st_s(f, a), PD_XFER_SUCCESS);
    assert_int_equal(st_r(f, a), PD_XFER_SUCCESS);
    assert_int_equal(f->kv[1][dst_a][0], 4);
    assert_int_equal(f->kv[1][dst_b][0], 0);
    assert_int_equal(st_r(f, b), PD_XFER_WAITING_FOR_INPUT); /* its destination went out */
    /* a goes; c takes a freed record while the slot may still name it. */
    f->s.vt->close(f->s.self, a);
    f->r.vt->close(f->r.self, a);
    assert_int_equal(st_s(f, a), PD_XFER_NONE);
    uint32_t dst_c = 0;
    open_r(f, c, &dst_c);
    assert_int_equal(st_r(f, c), PD_XFER_BOOTSTRAPPING);
    assert_int_equal(st_r(f, a), PD_XFER_NONE);
    assert_int_equal(st_s(f, a), PD_XFER_NONE);
    assert_true(f->s.vt->drained(f->s.self, a));
    f->s.vt->close(f->s.self, a); /* closing a gone room touches no other */
    assert_int_equal(st_r(f, c), PD_XFER_BOOTSTRAPPING);
    assert_int_equal(st_r(f, b), PD_XFER_WAITING_FOR_INPUT);
    f->r.vt->close(f->r.self, b);
    f->s.vt->cancel(f->s.self, b, NULL);
    f->r.vt->close(f->r.self, c);
    f->s.vt->cancel(f->s.self, c, NULL);
    step(f);
    assert_int_equal(pd_loopback_pending(f->lb), 0);
    pd_loopback_destroy(f->lb);
    free(f);
}

/* Many rooms at once, every one of whose ids shares one hint slot, opened
 * and ended in an interleaved order: each room's status is its own. */
static void a_crowd_on_one_hint_slot(void **state) {
    (void)state;
    enum { ROOMS = 8, ROUNDS = 5 };
    fixture *f = malloc(sizeof(*f));
    assert_non_null(f);
    fx_init(f, ROOMS);
    uint32_t dst[ROOMS];
    for (uint32_t round = 0; round < ROUNDS; round++) {
        uint64_t base = 3 + (uint64_t)round * ROOMS * STRIDE;
        for (uint32_t k = 0; k < ROOMS; k++) {
            dst[k] = k % N_PAGES;
            open_r(f, base + k * STRIDE, &dst[k]);
            if (k % 2 == 0) assert_ok(f->s.vt->sender_open(f->s.self, base + k * STRIDE));
        }
        step(f);
        for (uint32_t k = 0; k < ROOMS; k++) {
            uint64_t id = base + k * STRIDE;
            assert_int_equal(st_s(f, id), k % 2 == 0 ? PD_XFER_WAITING_FOR_INPUT : PD_XFER_NONE);
            assert_int_equal(st_r(f, id), PD_XFER_WAITING_FOR_INPUT);
            if (round > 0) assert_int_equal(st_r(f, id - ROOMS * STRIDE), PD_XFER_NONE);
        }
        for (uint32_t k = ROOMS; k-- > 0;) {
            uint64_t id = base + k * STRIDE;
            if (k % 2 == 0) f->s.vt->close(f->s.self, id);
            else f->s.vt->cancel(f->s.self, id, NULL);
            f->r.vt->close(f->r.self, id);
            assert_int_equal(st_r(f, id), PD_XFER_NONE);
            if (k > 0) assert_int_equal(st_r(f, id - STRIDE), PD_XFER_WAITING_FOR_INPUT);
        }
        step(f);
        assert_int_equal(pd_loopback_pending(f->lb), 0);
    }
    pd_loopback_destroy(f->lb);
    free(f);
}

/* pd_xfer_vtable.watch: each side's watched byte equals status() after
 * every call and every step of the loopback; it is no longer written once
 * the side closed the room (a kill closes the dead side's halves), nor after
 * watch(room, NULL); a room the side has not open is written once. */
enum { UNWRITTEN = 0xEE };

/* fx_init's fixture with a grace for a dead side's peer. */
static fixture *watch_fixture(void) {
    fixture *f = malloc(sizeof(*f));
    assert_non_null(f);
    fx_init(f, 8);
    pd_loopback_destroy(f->lb);
    pd_loopback_config lc = {.latency = 1, .dead_grace = 2, .rooms_max = 8, .page_size = 4};
    assert_ok(pd_loopback_create(&f->lb, &lc));
    for (int side = 0; side < 2; side++) {
        pd_exec_memory m = {.kv = f->kv[side], .kv_page_bytes = PAGE_BYTES, .kv_pages = N_PAGES};
        pd_loopback_register(f->lb, (pd_lb_side)side, &m, f->meta[side], 1);
    }
    f->s = pd_loopback_endpoint(f->lb, PD_LB_PREFILL);
    f->r = pd_loopback_endpoint(f->lb, PD_LB_DECODE);
    assert_non_null(f->s.vt->watch);
    return f;
}

static void watch_fixture_free(fixture *f) {
    step(f);
    assert_int_equal(pd_loopback_pending(f->lb), 0);
    pd_loopback_destroy(f->lb);
    free(f);
}

static void watched_equal(fixture *f, uint64_t room, const uint8_t *ws, const uint8_t *wr) {
    if (ws) assert_int_equal(*ws, st_s(f, room));
    if (wr) assert_int_equal(*wr, st_r(f, room));
}

/* Opens room on both sides, each watched. */
static void open_watched(fixture *f, uint64_t room, uint32_t *dst, uint8_t *ws, uint8_t *wr) {
    open_r(f, room, dst);
    f->r.vt->watch(f->r.self, room, wr);
    assert_ok(f->s.vt->sender_open(f->s.self, room));
    f->s.vt->watch(f->s.self, room, ws);
    watched_equal(f, room, ws, wr);
}

/* n steps, each side's watched byte checked after each (NULL: not). */
static void steps_watched(fixture *f, uint64_t room, int n, const uint8_t *ws, const uint8_t *wr) {
    for (int i = 0; i < n; i++) {
        step(f);
        watched_equal(f, room, ws, wr);
    }
}

static void close_both(fixture *f, uint64_t room) {
    f->s.vt->close(f->s.self, room);
    f->r.vt->close(f->r.self, room);
}

static void watched_status_follows_a_room_to_its_end(void **state) {
    (void)state;
    fixture *f = watch_fixture();
    uint8_t ws = UNWRITTEN, wr = UNWRITTEN;
    f->s.vt->watch(f->s.self, 1, &ws); /* not open anywhere: NONE, not kept */
    assert_int_equal(ws, PD_XFER_NONE);
    uint32_t dst = 2, src = 1;
    open_r(f, 1, &dst);
    f->r.vt->watch(f->r.self, 1, &wr);
    assert_int_equal(wr, PD_XFER_BOOTSTRAPPING);
    ws = UNWRITTEN;
    assert_ok(f->s.vt->sender_open(f->s.self, 1));
    assert_int_equal(ws, UNWRITTEN); /* the earlier watch was not kept */
    f->s.vt->watch(f->s.self, 1, &ws);
    watched_equal(f, 1, &ws, &wr);
    step(f); /* the destination reaches the sender */
    assert_int_equal(ws, PD_XFER_WAITING_FOR_INPUT);
    watched_equal(f, 1, &ws, &wr);
    assert_ok(f->s.vt->send_final(f->s.self, 1, 0, &src, 1, PD_POOL_NONE, 0));
    watched_equal(f, 1, &ws, &wr);
    steps_watched(f, 1, 4, &ws, &wr);
    assert_int_equal(ws, PD_XFER_SUCCESS);
    assert_int_equal(wr, PD_XFER_SUCCESS);
    close_both(f, 1);
    watch_fixture_free(f);
}

static void a_watched_receiver_learns_the_abort(void **state) {
    (void)state;
    fixture *f = watch_fixture();
    uint32_t dst = 2;
    /* The sender aborts: the receiver's byte turns FAILED by itself. */
    uint8_t ws = UNWRITTEN, wr = UNWRITTEN;
    open_watched(f, 2, &dst, &ws, &wr);
    step(f);
    (void)f->s.vt->abort(f->s.self, 2);
    watched_equal(f, 2, &ws, &wr);
    steps_watched(f, 2, 3, &ws, &wr);
    assert_int_equal(wr, PD_XFER_FAILED);
    close_both(f, 2);
    /* watch(room, NULL) ends it: the byte stays as it was left. */
    open_watched(f, 3, &dst, &ws, &wr);
    step(f);
    f->r.vt->watch(f->r.self, 3, NULL);
    wr = UNWRITTEN;
    (void)f->s.vt->abort(f->s.self, 3);
    for (int i = 0; i < 3; i++) step(f);
    assert_int_equal(st_r(f, 3), PD_XFER_FAILED);
    assert_int_equal(wr, UNWRITTEN);
    close_both(f, 3);
    watch_fixture_free(f);
}

static void a_closed_half_is_no_longer_written(void **state) {
    (void)state;
    fixture *f = watch_fixture();
    uint32_t dst = 2;
    /* The sender aborts and closes while bootstrapping: the destination
     * still reaches its closed half, which moves on, but its byte is not
     * written; the receiver's turns FAILED. */
    uint8_t ws = UNWRITTEN, wr = UNWRITTEN;
    open_watched(f, 5, &dst, &ws, &wr);
    assert_int_equal(ws, PD_XFER_BOOTSTRAPPING);
    (void)f->s.vt->abort(f->s.self, 5);
    assert_true(f->s.vt->drained(f->s.self, 5));
    f->s.vt->close(f->s.self, 5);
    ws = UNWRITTEN;
    steps_watched(f, 5, 3, NULL, &wr);
    assert_int_equal(ws, UNWRITTEN);
    assert_int_equal(wr, PD_XFER_FAILED);
    f->r.vt->close(f->r.self, 5);
    /* The prefill side dies: its halves close (its byte is no longer
     * written), the decode side's turns FAILED after the grace. */
    open_watched(f, 4, &dst, &ws, &wr);
    step(f);
    watched_equal(f, 4, &ws, &wr);
    pd_loopback_kill(f->lb, PD_LB_PREFILL);
    ws = UNWRITTEN;
    steps_watched(f, 4, 4, NULL, &wr);
    assert_int_equal(wr, PD_XFER_FAILED);
    assert_int_equal(ws, UNWRITTEN);
    f->r.vt->close(f->r.self, 4);
    watch_fixture_free(f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(ids_sharing_a_hint_see_only_their_own_room),
        cmocka_unit_test(a_crowd_on_one_hint_slot),
        cmocka_unit_test(watched_status_follows_a_room_to_its_end),
        cmocka_unit_test(a_watched_receiver_learns_the_abort),
        cmocka_unit_test(a_closed_half_is_no_longer_written),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
