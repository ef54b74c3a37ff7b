/* Aborts: a client that hangs up (while waiting for a whole answer or in
 * the middle of a stream) gets both halves aborted; POST /abort_request on
 * the router reaches every worker and reports what they aborted, 404 when
 * nobody had the rid; a worker that does not know the rid yet is ended by
 * the router after the grace period, with an abort answer for the client. */
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>

#include "../test_util.h"
#include "test_client.h"

#define WAIT_MS 10000

static void post(pd_router *r, const char *path, const char *body, tc_response *resp) {
    char url[128];
    tc_request("POST", tk_url(r, path, url, sizeof url), body, WAIT_MS, resp);
}

typedef struct bg {
    pd_router *r;
    const char *path;
    const char *body;
    tc_response resp;
    pthread_t t;
} bg;

static void *bg_main(void *arg) {
    bg *b = arg;
    post(b->r, b->path, b->body, &b->resp);
    return NULL;
}

static void bg_start(bg *b, pd_router *r, const char *path, const char *body) {
    *b = (bg){.r = r, .path = path, .body = body};
    PD_ASSERT(pthread_create(&b->t, NULL, bg_main, b) == 0);
}

static json_int_t disconnects(pd_router *r) {
    json_t *info = tk_server_info(r);
    json_t *counters = json_object_get(info, "counters");
    json_int_t n = json_integer_value(json_object_get(counters, "client_disconnects"));
    json_decref(info);
    return n;
}

static void client_hangup_while_waiting_aborts_both_halves(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    fw_set(p, &(fw_behaviour){.hang = true});
    fw_set(d, &(fw_behaviour){.hang = true});
    int fd = tc_raw_post(pd_router_port(r), "/generate", "{\"text\": \"x\", \"rid\": \"gone-1\"}");
    assert_true(fw_wait_got_generate(p, "gone-1", WAIT_MS));
    assert_true(fw_wait_got_generate(d, "gone-1", WAIT_MS));
    close(fd);
    assert_true(fw_wait_got_abort(p, "gone-1", WAIT_MS));
    assert_true(fw_wait_got_abort(d, "gone-1", WAIT_MS));
    assert_true(fw_wait_live_count(p, 0, WAIT_MS));
    assert_true(fw_wait_live_count(d, 0, WAIT_MS));
    assert_true(tk_wait_idle(r, WAIT_MS));
    assert_int_equal(disconnects(r), 1);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

static void client_hangup_mid_stream_aborts_both_halves(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    fw_set(d, &(fw_behaviour){.tokens = 10000, .delay_ms = 10});
    int fd = tc_raw_post(pd_router_port(r), "/generate",
                         "{\"text\": \"x\", \"rid\": \"gone-2\", \"stream\": true}");
    assert_true(tc_raw_read_until(fd, "\"t2 \"", WAIT_MS)); /* tokens are flowing */
    close(fd);
    assert_true(fw_wait_got_abort(p, "gone-2", WAIT_MS));
    assert_true(fw_wait_got_abort(d, "gone-2", WAIT_MS));
    assert_true(fw_wait_live_count(d, 0, WAIT_MS));
    assert_true(tk_wait_idle(r, WAIT_MS));
    assert_int_equal(disconnects(r), 1);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

/* An abort by rid reaches every worker; both halves of the request end. */
static void abort_by_rid(pd_router *r, fake_worker **p, fake_worker **d) {
    bg a;
    bg_start(&a, r, "/generate", "{\"text\": \"x\", \"rid\": \"ab-1\"}");
    assert_true(fw_wait_generate_count(p[0], 1, WAIT_MS));
    assert_true(fw_wait_generate_count(d[0], 1, WAIT_MS));
    tc_response resp;
    post(r, "/abort_request", "{\"rid\": \"ab-1\"}", &resp);
    assert_int_equal(resp.status, 200);
    json_t *o = tc_json(&resp);
    assert_int_equal(json_integer_value(json_object_get(o, "aborted")), 2); /* both halves */
    assert_int_equal(json_integer_value(json_object_get(o, "requests")), 1);
    assert_int_equal(json_array_size(json_object_get(o, "workers")), 4);
    json_decref(o);
    tc_free(&resp);
    for (int i = 0; i < 2; i++) {
        assert_true(fw_got_abort(p[i], "ab-1"));
        assert_true(fw_got_abort(d[i], "ab-1"));
    }
    /* The client's own answer ends with finish_reason abort. */
    pthread_join(a.t, NULL);
    assert_int_equal(a.resp.status, 200);
    o = tc_json(&a.resp);
    json_t *fr = json_object_get(json_object_get(o, "meta_info"), "finish_reason");
    assert_string_equal(json_string_value(json_object_get(fr, "type")), "abort");
    json_decref(o);
    tc_free(&a.resp);
}

/* Found by tests/chaos: about one abort in eight came back as a 500. The
 * abort reached the prefill node first, its room failed, and its 500 (or the
 * decode node's transfer failure it caused) became the client's answer. Now
 * the router aborts decode nodes before prefill nodes, and once an abort was
 * asked for, a prefill failure does not decide the answer: the client gets
 * finish_reason abort. Here the prefill answers 500 the moment it is
 * aborted, and the decode node only ends when aborted. */
static void an_abort_is_answered_as_an_abort_even_if_the_prefill_fails(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    fw_set(p, &(fw_behaviour){.delay_ms = 20000, .fail_on_abort = true});
    fw_set(d, &(fw_behaviour){.hang = true});
    for (int i = 0; i < 5; i++) {
        char rid[32], body[96], ab[64];
        snprintf(rid, sizeof rid, "race-%d", i);
        snprintf(body, sizeof body, "{\"text\": \"x\", \"rid\": \"%s\"}", rid);
        snprintf(ab, sizeof ab, "{\"rid\": \"%s\"}", rid);
        bg a;
        bg_start(&a, r, "/generate", body);
        assert_true(fw_wait_got_generate(p, rid, WAIT_MS));
        assert_true(fw_wait_got_generate(d, rid, WAIT_MS));
        tc_response resp;
        post(r, "/abort_request", ab, &resp);
        assert_int_equal(resp.status, 200);
        tc_free(&resp);
        pthread_join(a.t, NULL);
        if (a.resp.status != 200) fail_msg("%s: answered %ld: %s", rid, a.resp.status, a.resp.body);
        json_t *o = tc_json(&a.resp);
        json_t *fr = json_object_get(json_object_get(o, "meta_info"), "finish_reason");
        assert_string_equal(json_string_value(json_object_get(fr, "type")), "abort");
        json_decref(o);
        tc_free(&a.resp);
    }
    assert_true(tk_wait_idle(r, WAIT_MS));
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

/* An /abort_request that reaches the decode node before the request does
 * (404 there) fails the room; the decode node then answers 500 ("transfer
 * failed"). That failure is the abort's doing: the client gets the abort
 * answer, not a 500. */
static void an_abort_before_the_decode_node_has_the_request_is_an_abort(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    fw_set(p, &(fw_behaviour){.delay_ms = 20000, .fail_on_abort = true});
    fw_set(d, &(fw_behaviour){.generate_status = 500, .delay_ms = 300, .deaf = true});
    bg a;
    bg_start(&a, r, "/generate", "{\"text\": \"x\", \"rid\": \"early\"}");
    assert_true(fw_wait_got_generate(d, "early", WAIT_MS));
    tc_response resp;
    post(r, "/abort_request", "{\"rid\": \"early\"}", &resp);
    tc_free(&resp);
    pthread_join(a.t, NULL);
    if (a.resp.status != 200) fail_msg("answered %ld: %s", a.resp.status, a.resp.body);
    json_t *o = tc_json(&a.resp);
    json_t *fr = json_object_get(json_object_get(o, "meta_info"), "finish_reason");
    assert_string_equal(json_string_value(json_object_get(fr, "type")), "abort");
    json_decref(o);
    tc_free(&a.resp);
    assert_true(tk_wait_idle(r, WAIT_MS));
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

/* The same race on a stream: tokens went out, then the abort reached the
 * prefill node first and the decode node's final event is an abort with
 * status 500 ("transfer failed"). The client asked for the abort: its
 * stream ends with finish_reason abort, status 499, after the tokens it
 * already had. Found by pdserve bench (abort-all bursts through pdserve
 * run): about one stream in two hundred came back "aborted with status
 * 500". Both an abort by rid and abort_all. */
static void a_stream_whose_room_fails_after_an_abort_ends_as_an_abort(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    fw_set(p, &(fw_behaviour){.delay_ms = 20000, .fail_on_abort = true});
    fw_set(d, &(fw_behaviour){.tokens = 1000, .delay_ms = 20, .abort_status = 500});
    for (int all = 0; all < 2; all++) {
        char rid[32], body[128], ab[64];
        snprintf(rid, sizeof rid, "fails-%d", all);
        snprintf(body, sizeof body, "{\"text\": \"x\", \"rid\": \"%s\", \"stream\": true}", rid);
        snprintf(ab, sizeof ab, all ? "{\"abort_all\": true}" : "{\"rid\": \"%s\"}", rid);
        bg a;
        bg_start(&a, r, "/generate", body);
        assert_true(fw_wait_got_generate(d, rid, WAIT_MS));
        tk_sleep_ms(150); /* a few token events */
        tc_response resp;
        post(r, "/abort_request", ab, &resp);
        assert_int_equal(resp.status, 200);
        tc_free(&resp);
        pthread_join(a.t, NULL);
        assert_int_equal(a.resp.status, 200);
        size_t tokens = 0;
        char why[256] = "";
        json_t *final = tc_sse_check(a.resp.body, a.resp.len, &tokens, why, sizeof why);
        if (!final) fail_msg("%s: %s", why, a.resp.body);
        assert_true(tokens >= 1);
        json_t *fr = json_object_get(json_object_get(final, "meta_info"), "finish_reason");
        assert_string_equal(json_string_value(json_object_get(fr, "type")), "abort");
        if (json_integer_value(json_object_get(fr, "status_code")) != 499)
            fail_msg("%s: %s", rid, a.resp.body);
        json_decref(final);
        tc_free(&a.resp);
    }
    assert_true(tk_wait_idle(r, WAIT_MS));
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

/* Nobody has it: 404 with the error body, every worker was asked. */
static void abort_of_an_unknown_rid(pd_router *r, fake_worker **d) {
    tc_response resp;
    post(r, "/abort_request", "{\"rid\": \"nobody\"}", &resp);
    assert_int_equal(resp.status, 404);
    json_t *o = tc_json(&resp);
    assert_non_null(tc_error_message(o, 404));
    json_decref(o);
    tc_free(&resp);
    for (int i = 0; i < 2; i++) assert_true(fw_got_abort(d[i], "nobody"));
}

/* abort_all: two live requests (four halves), then none. */
static void abort_all(pd_router *r, fake_worker **p, fake_worker **d) {
    tc_response resp;
    bg b[2];
    bg_start(&b[0], r, "/generate", "{\"text\": \"x\", \"rid\": \"all-1\"}");
    bg_start(&b[1], r, "/v1/completions", "{\"prompt\": \"x\", \"rid\": \"all-2\"}");
    assert_true(fw_wait_live_count(p[0], 1, WAIT_MS) && fw_wait_live_count(p[1], 1, WAIT_MS));
    assert_true(fw_wait_live_count(d[0], 1, WAIT_MS) && fw_wait_live_count(d[1], 1, WAIT_MS));
    post(r, "/abort_request", "{\"abort_all\": true}", &resp);
    assert_int_equal(resp.status, 200);
    json_t *o = tc_json(&resp);
    if (json_integer_value(json_object_get(o, "aborted")) != 4) fail_msg("%s", resp.body);
    assert_int_equal(json_integer_value(json_object_get(o, "requests")), 2);
    json_decref(o);
    tc_free(&resp);
    for (int i = 0; i < 2; i++) {
        pthread_join(b[i].t, NULL);
        assert_int_equal(b[i].resp.status, 200);
        tc_free(&b[i].resp);
    }
    post(r, "/abort_request", "{\"abort_all\": true}", &resp);
    assert_int_equal(resp.status, 200);
    o = tc_json(&resp);
    assert_int_equal(json_integer_value(json_object_get(o, "aborted")), 0);
    json_decref(o);
    tc_free(&resp);
}

static void abort_request_reaches_every_worker_and_counts(void **state) {
    (void)state;
    fake_worker *p[2] = {fw_start("prefill"), fw_start("prefill")};
    fake_worker *d[2] = {fw_start("decode"), fw_start("decode")};
    pd_router *r = tk_router(p, 2, d, 2, NULL);
    for (int i = 0; i < 2; i++) {
        fw_set(p[i], &(fw_behaviour){.hang = true});
        fw_set(d[i], &(fw_behaviour){.hang = true});
    }
    abort_by_rid(r, p, d);
    abort_of_an_unknown_rid(r, d);
    abort_all(r, p, d);
    pd_router_destroy(r);
    for (int i = 0; i < 2; i++) {
        fw_stop(p[i]);
        fw_stop(d[i]);
    }
}

static void abort_the_worker_missed_is_ended_by_the_router(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    /* The decode node answers every abort "unknown rid", as if the abort
     * overtook the request: the router must end it itself. */
    fw_set(d, &(fw_behaviour){.hang = true, .deaf = true});
    for (int stream = 0; stream < 2; stream++) {
        const char *rid = stream ? "deaf-2" : "deaf-1";
        char body[128];
        snprintf(body, sizeof body, "{\"text\": \"x\", \"rid\": \"%s\", \"stream\": %s}", rid,
                 stream ? "true" : "false");
        bg a;
        bg_start(&a, r, "/generate", body);
        assert_true(fw_wait_got_generate(d, rid, WAIT_MS));
        char ab[128];
        snprintf(ab, sizeof ab, "{\"rid\": \"%s\"}", rid);
        tc_response resp;
        post(r, "/abort_request", ab, &resp);
        assert_int_equal(resp.status, 200); /* the router had it */
        json_t *o = tc_json(&resp);
        assert_int_equal(json_integer_value(json_object_get(o, "requests")), 1);
        json_decref(o);
        tc_free(&resp);
        pthread_join(a.t, NULL);
        assert_int_equal(a.resp.status, 200);
        json_t *final;
        if (stream) {
            size_t tokens;
            char why[256] = "";
            final = tc_sse_check(a.resp.body, a.resp.len, &tokens, why, sizeof why);
            if (!final) fail_msg("%s: %s", why, a.resp.body);
        } else {
            final = tc_json(&a.resp);
        }
        json_t *fr = json_object_get(json_object_get(final, "meta_info"), "finish_reason");
        assert_string_equal(json_string_value(json_object_get(fr, "type")), "abort");
        assert_int_equal(json_integer_value(json_object_get(fr, "status_code")), 499);
        json_decref(final);
        tc_free(&a.resp);
        assert_true(fw_wait_live_count(d, 0, WAIT_MS)); /* the connection was closed */
    }
    /* Completions get the completions shape. */
    bg c;
    bg_start(&c, r, "/v1/completions",
             "{\"prompt\": \"x\", \"rid\": \"deaf-3\", \"model\": \"mm\"}");
    assert_true(fw_wait_got_generate(d, "deaf-3", WAIT_MS));
    tc_response resp;
    post(r, "/abort_request", "{\"rid\": \"deaf-3\"}", &resp);
    tc_free(&resp);
    pthread_join(c.t, NULL);
    json_t *o = tc_json(&c.resp);
    assert_string_equal(json_string_value(json_object_get(o, "model")), "mm");
    json_t *choice = json_array_get(json_object_get(o, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(choice, "finish_reason")), "abort");
    json_decref(o);
    tc_free(&c.resp);
    json_t *info = tk_server_info(r);
    json_t *responses = json_object_get(json_object_get(info, "counters"), "responses");
    assert_int_equal(json_integer_value(json_object_get(responses, "499")), 3);
    json_decref(info);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

static void stopping_the_router_ends_requests_in_flight(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    fw_set(p, &(fw_behaviour){.hang = true});
    fw_set(d, &(fw_behaviour){.hang = true});
    static const char *bodies[3] = {"{\"text\": \"x\", \"rid\": \"stop-0\"}",
                                    "{\"text\": \"x\", \"rid\": \"stop-1\", \"stream\": true}",
                                    "{\"prompt\": \"x\", \"rid\": \"stop-2\"}"};
    bg b[3];
    for (int i = 0; i < 3; i++)
        bg_start(&b[i], r, i == 2 ? "/v1/completions" : "/generate", bodies[i]);
    assert_true(fw_wait_live_count(d, 3, WAIT_MS));
    pd_router_destroy(r); /* returns: nothing waits for the hung workers */
    /* (every client was answered before the sockets closed) */
    for (int i = 0; i < 3; i++) {
        pthread_join(b[i].t, NULL);
        char rid[16];
        snprintf(rid, sizeof rid, "stop-%d", i);
        assert_true(fw_got_abort(p, rid));
        assert_true(fw_got_abort(d, rid));
        /* The client got a 503: an error body, or for the stream whose
         * head had gone out, an error event then [DONE]. */
        json_t *o = tc_json(&b[i].resp);
        if (b[i].resp.status == 503) {
            assert_non_null(tc_error_message(o, 503));
        } else {
            assert_int_equal(b[i].resp.status, 200);
            size_t tokens;
            char why[256] = "";
            json_t *final = tc_sse_check(b[i].resp.body, b[i].resp.len, &tokens, why, sizeof why);
            if (!final || !tc_error_message(final, 503))
                fail_msg("stop-%d: %s: %s", i, why, b[i].resp.body);
            json_decref(final);
        }
        json_decref(o);
        tc_free(&b[i].resp);
    }
    assert_true(fw_wait_live_count(d, 0, WAIT_MS));
    fw_stop(p);
    fw_stop(d);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(client_hangup_while_waiting_aborts_both_halves),
        cmocka_unit_test(client_hangup_mid_stream_aborts_both_halves),
        cmocka_unit_test(a_stream_whose_room_fails_after_an_abort_ends_as_an_abort),
        cmocka_unit_test(abort_request_reaches_every_worker_and_counts),
        cmocka_unit_test(an_abort_is_answered_as_an_abort_even_if_the_prefill_fails),
        cmocka_unit_test(an_abort_before_the_decode_node_has_the_request_is_an_abort),
        cmocka_unit_test(abort_the_worker_missed_is_ended_by_the_router),
        cmocka_unit_test(stopping_the_router_ends_requests_in_flight),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
