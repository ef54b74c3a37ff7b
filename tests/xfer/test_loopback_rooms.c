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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(ids_sharing_a_hint_see_only_their_own_room),
        cmocka_unit_test(a_crowd_on_one_hint_slot),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
