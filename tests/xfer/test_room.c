/* The room core (src/xfer/room.h), without any transport: the status
 * machine, the drained rule on each side, abort and cancel decisions,
 * tombstones, the destination's checks and the room table's eviction. */
#include <stdlib.h>
#include <string.h>

#include "../test_util.h"
#include "pdserve/loopback.h"
#include "pdserve/pool.h"
#include "room.h"

static void status_moves_forward_and_final_sticks(void **state) {
    (void)state;
    xr_half h = {0};
    assert_int_equal(xr_status(&h), PD_XFER_NONE);
    assert_int_equal(xr_open_sender(&h, false), PD_OK);
    assert_int_equal(xr_status(&h), PD_XFER_BOOTSTRAPPING);
    assert_int_equal(xr_open_sender(&h, false), PD_ERR_EXISTS);
    xr_dest_arrived(&h);
    assert_int_equal(h.st, PD_XFER_WAITING_FOR_INPUT);
    xr_set_status(&h, PD_XFER_SUCCESS);
    xr_set_status(&h, PD_XFER_FAILED);
    assert_int_equal(h.st, PD_XFER_SUCCESS);
    xr_half r = {0};
    assert_int_equal(xr_open_receiver(&r), PD_OK);
    xr_data_started(&r);
    assert_int_equal(r.st, PD_XFER_TRANSFERRING);
}

static void news_before_open_keeps_failed(void **state) {
    (void)state;
    xr_half h = {0};
    xr_peer_failed(&h, XR_SENDER); /* the decode aborted before this side opened */
    assert_true(xr_news_for_engine(&h));
    assert_int_equal(xr_status(&h), PD_XFER_NONE);
    assert_int_equal(xr_open_sender(&h, true), PD_OK);
    assert_int_equal(xr_status(&h), PD_XFER_FAILED);
    assert_false(xr_news_for_engine(&h));
}

static void sender_abort_waits_for_writes(void **state) {
    (void)state;
    xr_half h = {0};
    xr_open_sender(&h, true);
    assert_true(xr_sendable(&h));
    h.writes_out = 2;
    assert_false(xr_drained(&h, XR_SENDER, 0));
    assert_int_equal(xr_abort(&h, XR_SENDER), XR_ACT_NOTIFY_LATER);
    assert_false(xr_sendable(&h));
    assert_int_equal(xr_abort(&h, XR_SENDER), XR_ACT_NONE);
    h.writes_out = 0;
    assert_false(xr_drained(&h, XR_SENDER, 0)); /* the abort has not taken effect */
    xr_abort_effective(&h);
    assert_true(h.done);
    assert_true(xr_drained(&h, XR_SENDER, 0));
    xr_half idle = {0};
    xr_open_sender(&idle, true);
    assert_int_equal(xr_abort(&idle, XR_SENDER), XR_ACT_NOTIFY);
    assert_true(xr_drained(&idle, XR_SENDER, 0));
}

static void receiver_drains_only_when_sender_stops(void **state) {
    (void)state;
    xr_half h = {0};
    xr_open_receiver(&h);
    assert_int_equal(xr_abort(&h, XR_RECEIVER), XR_ACT_NONE); /* destination never left */
    assert_true(xr_drained(&h, XR_RECEIVER, 0));
    xr_half r = {0};
    xr_open_receiver(&r);
    r.dest_sent = true;
    assert_false(xr_drained(&r, XR_RECEIVER, 0));
    assert_int_equal(xr_abort(&r, XR_RECEIVER), XR_ACT_NOTIFY);
    assert_int_equal(xr_abort(&r, XR_RECEIVER), XR_ACT_NONE); /* one notice */
    assert_false(xr_drained(&r, XR_RECEIVER, 0));
    xr_peer_failed(&r, XR_RECEIVER); /* lost peer: writes may still land for a while */
    r.settle_until = 100;
    assert_false(xr_drained(&r, XR_RECEIVER, 99));
    assert_true(xr_drained(&r, XR_RECEIVER, 100));
    r.writes_out = 1;
    assert_false(xr_drained(&r, XR_RECEIVER, 100));
}

static void cancel_tells_once_and_marks_gone(void **state) {
    (void)state;
    xr_half s = {0}, r = {0}, open = {0};
    assert_int_equal(xr_cancel(&s, XR_SENDER), XR_ACT_NOTIFY);
    assert_true(s.done && xr_gone(&s));
    assert_int_equal(xr_cancel(&s, XR_SENDER), XR_ACT_NONE);
    assert_int_equal(xr_open_sender(&s, true), PD_ERR_EXISTS);
    assert_int_equal(xr_cancel(&r, XR_RECEIVER), XR_ACT_NOTIFY);
    xr_open_receiver(&open);
    assert_int_equal(xr_cancel(&open, XR_RECEIVER), XR_ACT_NONE);
    assert_false(xr_gone(&open));
    xr_close(&open);
    assert_true(xr_gone(&open));
    xr_dest d = {0};
    s.early_abort = true;
    assert_true(xr_news_for_peer(&s, &d));
    d.known = true;
    assert_false(xr_news_for_peer(&s, &d));
}

static void destination_checks(void **state) {
    (void)state;
    uint32_t pages[3] = {7, 8, 9};
    pd_xfer_dest ok = {.prompt_tokens = 10,
                       .cached_tokens = 4,
                       .pages = pages,
                       .n_pages = 2,
                       .mamba_slot = PD_POOL_NONE,
                       .meta_row = 0};
    assert_true(xr_dest_valid(&ok, 4));
    pd_xfer_dest bad = ok;
    bad.cached_tokens = 3;
    assert_false(xr_dest_valid(&bad, 4));
    bad = ok;
    bad.n_pages = 3;
    assert_false(xr_dest_valid(&bad, 4));
    assert_false(xr_dest_valid(NULL, 4));
    xr_dest d = {0};
    assert_int_equal(xr_dest_set(&d, &ok), PD_OK);
    assert_true(xr_dest_covers(&d, 4, 1, 2));
    assert_false(xr_dest_covers(&d, 4, 0, 1)); /* page 0 is cached on the decode side */
    assert_false(xr_dest_covers(&d, 4, 2, 2));
    assert_int_equal(xr_dest_page(&d, 4, 2), 8);
    assert_true(xr_final_fits(&d, 4, 2, 1, PD_POOL_NONE));
    assert_false(xr_final_fits(&d, 4, 1, 1, PD_POOL_NONE)); /* does not end the prompt */
    assert_false(xr_final_fits(&d, 4, 2, 1, 5));            /* a Mamba state nobody expects */
    xr_dest_clear(&d);
    assert_false(d.known);
}

/* A destination in the transport's storage: the pages are copied in, the
 * storage is never freed by the room core (a free of it would crash under
 * ASan), and a heap copy it replaces is freed (a leak otherwise). */
static void destination_in_borrowed_storage(void **state) {
    (void)state;
    uint32_t pages[2] = {7, 8}, storage[2] = {0, 0};
    pd_xfer_dest ok = {.prompt_tokens = 10,
                       .cached_tokens = 4,
                       .pages = pages,
                       .n_pages = 2,
                       .mamba_slot = PD_POOL_NONE,
                       .meta_row = 0};
    xr_dest d = {0};
    assert_int_equal(xr_dest_set(&d, &ok), PD_OK);
    xr_dest_set_in(&d, &ok, storage);
    pages[0] = 99; /* the caller's list may change afterwards */
    assert_true(d.known && d.borrowed);
    assert_int_equal(xr_dest_page(&d, 4, 1), 7);
    assert_int_equal(storage[1], 8);
    assert_int_equal(xr_dest_set(&d, &ok), PD_OK); /* back on the heap: nothing to free */
    assert_false(d.borrowed);
    assert_int_equal(xr_dest_page(&d, 4, 1), 99);
    xr_dest_clear(&d);
    xr_dest_set_in(&d, &ok, storage);
    xr_dest_clear(&d);
    assert_false(d.known);
}

typedef struct rec {
    xr_slot slot;
    bool busy;
} rec;

static bool rec_evictable(void *ctx, uint32_t r) { return !((rec *)xr_at(ctx, r))->busy; }

static void rec_evict(void *ctx, uint32_t r) { xr_remove(ctx, r); }

static void table_evicts_oldest_idle_tombstone_only(void **state) {
    (void)state;
    xr_table t;
    assert_int_equal(xr_table_init(&t, 3, sizeof(rec), rec_evictable, rec_evict, &t), PD_OK);
    uint32_t a = xr_add(&t, 10), b = xr_add(&t, 20), c = xr_add(&t, 30);
    assert_int_equal(xr_find(&t, 20), b);
    assert_int_equal(xr_add(&t, 40), PD_NONE); /* full, and no tombstone */
    xr_set_tomb(&t, b, true);
    xr_set_tomb(&t, a, true);
    ((rec *)xr_at(&t, b))->busy = true;
    uint32_t gen_a = xr_at(&t, a)->gen;
    uint32_t d = xr_add(&t, 40); /* b is older but busy: a goes */
    assert_int_equal(d, a);
    assert_int_equal(xr_find(&t, 10), PD_NONE);
    assert_int_not_equal(xr_at(&t, d)->gen, gen_a);
    assert_int_equal(xr_at(&t, d)->tomb_order, 0);
    xr_set_tomb(&t, c, true);
    xr_set_tomb(&t, c, false); /* opened again: live */
    assert_int_equal(xr_add(&t, 50), PD_NONE);
    assert_int_equal(xr_used(&t), 3);
    xr_table_free(&t);
}

/* The loopback's fixed operation pool: rooms whose two halves are gone drop
 * their queued operations, which wait in the heap until their due time. A
 * pool full of them must make way for a live room's control operation (an
 * assertion before) and for its destination (PD_ERR_NOMEM before). */
static void loopback_pool_full_of_dropped_operations_makes_way(void **state) {
    (void)state;
    pd_loopback *lb;
    pd_loopback_config lc = {.latency = 5, .rooms_max = 1, .page_size = 4, .ops_max = 1};
    assert_int_equal(pd_loopback_create(&lb, &lc), PD_OK); /* 8 control + 1 data slots */
    pd_xfer s = pd_loopback_endpoint(lb, PD_LB_PREFILL), r = pd_loopback_endpoint(lb, PD_LB_DECODE);
    uint32_t pages[1] = {0};
    pd_xfer_dest d = {.prompt_tokens = 4,
                      .pages = pages,
                      .n_pages = 1,
                      .mamba_slot = PD_POOL_NONE,
                      .meta_row = 0};
    for (uint64_t room = 1; room <= 40; room++) { /* no advance: nothing comes due */
        assert_int_equal(r.vt->receiver_open(r.self, room, NULL, &d), PD_OK); /* DEST */
        assert_int_equal(r.vt->abort(r.self, room), PD_OK);                   /* R_ABORT */
        r.vt->close(r.self, room);
        s.vt->cancel(s.self, room, NULL); /* both halves gone: the room and its ops go */
        assert_int_equal(pd_loopback_pending(lb), 0);
    }
    pd_loopback_advance(lb, 1000);
    assert_int_equal(pd_loopback_pending(lb), 0);
    pd_loopback_destroy(lb);
}

/* A loopback whose one room slot is reused by rooms of growing size, each
 * sending its pages in two writes, some sent twice: every write lands the
 * source page the sender named when it posted (the caller's list may change
 * at once), from the room's storage or, for pages sent again, a heap copy. */
enum { LB_PAGES = 16, LB_PAGE_BYTES = 8 };

static void lb_room(pd_loopback *lb, uint64_t room, uint32_t n, bool resend, uint64_t *now) {
    pd_xfer s = pd_loopback_endpoint(lb, PD_LB_PREFILL), r = pd_loopback_endpoint(lb, PD_LB_DECODE);
    uint32_t dst[LB_PAGES], src[LB_PAGES];
    for (uint32_t i = 0; i < n; i++) {
        dst[i] = LB_PAGES - 1 - i;
        src[i] = (i + (uint32_t)room) % LB_PAGES;
    }
    pd_xfer_dest d = {.prompt_tokens = n * 4,
                      .pages = dst,
                      .n_pages = n,
                      .mamba_slot = PD_POOL_NONE,
                      .meta_row = 0};
    assert_int_equal(s.vt->sender_open(s.self, room), PD_OK);
    assert_int_equal(r.vt->receiver_open(r.self, room, NULL, &d), PD_OK);
    pd_loopback_advance(lb, ++*now);
    uint32_t half = n / 2, list[LB_PAGES];
    memcpy(list, src, sizeof(list));
    assert_int_equal(s.vt->send_pages(s.self, room, 0, list, half), PD_OK);
    if (resend) assert_int_equal(s.vt->send_pages(s.self, room, 0, list, half), PD_OK);
    memset(list, 0xff, sizeof(list)); /* the sender's list is gone */
    memcpy(list, src + half, (n - half) * sizeof(uint32_t));
    assert_int_equal(s.vt->send_final(s.self, room, half, list, n - half, PD_POOL_NONE, 0), PD_OK);
    memset(list, 0xff, sizeof(list));
    for (int i = 0; i < 4; i++) pd_loopback_advance(lb, ++*now);
    assert_int_equal(s.vt->status(s.self, room), PD_XFER_SUCCESS);
    assert_int_equal(r.vt->status(r.self, room), PD_XFER_SUCCESS);
    s.vt->close(s.self, room);
    r.vt->close(r.self, room);
}

static void loopback_room_storage_reused_and_resends_copied(void **state) {
    (void)state;
    pd_loopback *lb;
    pd_loopback_config lc = {.latency = 1, .rooms_max = 1, .page_size = 4};
    assert_int_equal(pd_loopback_create(&lb, &lc), PD_OK);
    static uint8_t kv[2][LB_PAGES][LB_PAGE_BYTES];
    pd_meta_row meta[2][1];
    memset(meta, 0, sizeof(meta));
    for (int side = 0; side < 2; side++) {
        pd_exec_memory m = {.kv = kv[side], .kv_page_bytes = LB_PAGE_BYTES, .kv_pages = LB_PAGES};
        pd_loopback_register(lb, (pd_lb_side)side, &m, meta[side], 1);
    }
    for (uint32_t p = 0; p < LB_PAGES; p++) memset(kv[0][p], (int)(p + 1), LB_PAGE_BYTES);
    uint64_t now = 0;
    const uint32_t sizes[] = {2, 4, 16, 3, 16};
    for (uint64_t room = 1; room <= 5; room++) {
        uint32_t n = sizes[room - 1];
        memset(kv[1], 0, sizeof(kv[1]));
        lb_room(lb, room, n, room % 2 == 0, &now);
        for (uint32_t i = 0; i < n; i++) /* destination page of sequence page i */
            assert_int_equal(kv[1][LB_PAGES - 1 - i][0], (i + room) % LB_PAGES + 1);
    }
    assert_int_equal(pd_loopback_pending(lb), 0);
    pd_loopback_destroy(lb);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(status_moves_forward_and_final_sticks),
        cmocka_unit_test(news_before_open_keeps_failed),
        cmocka_unit_test(sender_abort_waits_for_writes),
        cmocka_unit_test(receiver_drains_only_when_sender_stops),
        cmocka_unit_test(cancel_tells_once_and_marks_gone),
        cmocka_unit_test(destination_checks),
        cmocka_unit_test(table_evicts_oldest_idle_tombstone_only),
        cmocka_unit_test(loopback_pool_full_of_dropped_operations_makes_way),
        cmocka_unit_test(destination_in_borrowed_storage),
        cmocka_unit_test(loopback_room_storage_reused_and_resends_copied),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
