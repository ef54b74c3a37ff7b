/* Worker failures map to the right answer, and the half that is still
 * running is told to stop: the prefill node's error aborts the decode half;
 * a refused connection or garbage is 502; silence past the request timeout
 * is 504 with both halves aborted; a stream that breaks still ends with one
 * final event and [DONE]. */
#include <signal.h>

#include "../test_util.h"
#include "test_client.h"

#define WAIT_MS 10000

static void post(pd_router *r, const char *path, const char *body, tc_response *resp) {
    char url[128];
    tc_request("POST", tk_url(r, path, url, sizeof url), body, WAIT_MS, resp);
}

static void expect_error(tc_response *resp, long status) {
    assert_int_equal(resp->status, status);
    json_t *o = tc_json(resp);
    if (!tc_error_message(o, status)) fail_msg("not a %ld error body: %s", status, resp->body);
    json_decref(o);
}

/* A streamed answer must end with exactly one error event of `code`. */
static void expect_error_event(tc_response *resp, long code) {
    assert_int_equal(resp->status, 200);
    size_t tokens;
    char why[256] = "";
    json_t *final = tc_sse_check(resp->body, resp->len, &tokens, why, sizeof why);
    if (!final) fail_msg("%s in: %s", why, resp->body);
    if (!tc_error_message(final, code))
        fail_msg("final event is not a %ld error: %s", code, resp->body);
    json_decref(final);
}

static void prefill_error_aborts_the_decode_half(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    fw_set(p, &(fw_behaviour){.generate_status = 500, .delay_ms = 50});
    fw_set(d, &(fw_behaviour){.hang = true});
    tc_response resp;
    post(r, "/generate", "{\"text\": \"x\", \"rid\": \"pf-1\"}", &resp);
    expect_error(&resp, 500);
    json_t *o = tc_json(&resp);
    assert_string_equal(tc_error_message(o, 500), "fake worker error"); /* the node's own body */
    json_decref(o);
    tc_free(&resp);
    assert_true(fw_wait_got_abort(d, "pf-1", WAIT_MS));
    assert_true(fw_wait_live_count(d, 0, WAIT_MS));

    /* Streaming: the decode node already streams when the prefill node
     * fails; the stream ends with the prefill node's error, then [DONE]. */
    fw_set(p, &(fw_behaviour){.generate_status = 500, .delay_ms = 150});
    fw_set(d, &(fw_behaviour){.tokens = 1000, .delay_ms = 10});
    post(r, "/generate", "{\"text\": \"x\", \"rid\": \"pf-2\", \"stream\": true}", &resp);
    expect_error_event(&resp, 500);
    assert_non_null(strstr(resp.body, "\"t0 \"")); /* tokens before the failure went out */
    tc_free(&resp);
    assert_true(fw_wait_got_abort(d, "pf-2", WAIT_MS));
    assert_false(fw_got_abort(p, "pf-2")); /* the failed half is not aborted */
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

/* A decode node that refuses a request (413: it cannot fit) cancels the
 * room, which fails the prefill half first; the client must get the real
 * reason, the decode node's, not the prefill's 500 (e2e_request_log saw the
 * 500 under load). */
static void a_decode_refusal_beats_the_prefill_failure_it_caused(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    fw_set(p, &(fw_behaviour){.generate_status = 500});
    fw_set(d, &(fw_behaviour){.generate_status = 413, .delay_ms = 100});
    for (int i = 0; i < 3; i++) {
        tc_response resp;
        post(r, "/generate", "{\"text\": \"x\"}", &resp);
        expect_error(&resp, 413);
        tc_free(&resp);
    }
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

/* Issue 10, finding 11: a worker's status 999 was passed on to the client.
 * A status outside 100..599 is not HTTP: 502, naming it. */
static void a_status_that_is_not_http_is_502(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    fw_set(d, &(fw_behaviour){.generate_status = 999});
    tc_response resp;
    post(r, "/generate", "{\"text\": \"x\", \"rid\": \"bogus-1\"}", &resp);
    expect_error(&resp, 502);
    assert_non_null(strstr(resp.body, "999, which is not an HTTP status"));
    tc_free(&resp);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

static void refused_connection_is_502_and_the_other_half_is_aborted(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    char dead[64];
    snprintf(dead, sizeof dead, "http://127.0.0.1:%u", (unsigned)free_port());
    pd_router_config cfg;
    tk_config(&cfg);
    cfg.health_interval_ms = 3600000; /* keep the dead node "healthy": test the request path */
    cfg.prefill[0] = fw_url(p);
    cfg.decode[0] = dead;
    cfg.prefill_count = cfg.decode_count = 1;
    pd_router *r = NULL;
    char msg[256];
    PD_MUST(pd_router_create(&r, &cfg, msg, sizeof msg));
    PD_MUST(pd_router_start(r, msg, sizeof msg));
    fw_set(p, &(fw_behaviour){.hang = true});
    tc_response resp;
    post(r, "/generate", "{\"text\": \"x\", \"rid\": \"refused-1\"}", &resp);
    expect_error(&resp, 502);
    tc_free(&resp);
    assert_true(fw_wait_got_abort(p, "refused-1", WAIT_MS));
    pd_router_destroy(r);

    /* The prefill side refused: same answer, the decode half aborted. */
    cfg.prefill[0] = dead;
    cfg.decode[0] = fw_url(d);
    PD_MUST(pd_router_create(&r, &cfg, msg, sizeof msg));
    PD_MUST(pd_router_start(r, msg, sizeof msg));
    fw_set(d, &(fw_behaviour){.hang = true});
    post(r, "/generate", "{\"text\": \"x\", \"rid\": \"refused-2\"}", &resp);
    expect_error(&resp, 502);
    tc_free(&resp);
    assert_true(fw_wait_got_abort(d, "refused-2", WAIT_MS));
    json_t *info = tk_server_info(r);
    json_t *w0 = json_array_get(json_object_get(info, "workers"), 0);
    assert_int_equal(json_integer_value(json_object_get(w0, "failures")), 1);
    assert_int_equal(json_integer_value(json_object_get(w0, "in_flight")), 0);
    json_decref(info);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

static void garbage_and_closed_connections_are_502(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    raw_server *junk = raw_start("NOT HTTP AT ALL\r\n\r\n");
    pd_router_config cfg;
    tk_config(&cfg);
    cfg.health_interval_ms = 3600000;
    cfg.prefill[0] = fw_url(p);
    cfg.decode[0] = raw_url(junk);
    cfg.prefill_count = cfg.decode_count = 1;
    pd_router *r = NULL;
    char msg[256];
    PD_MUST(pd_router_create(&r, &cfg, msg, sizeof msg));
    PD_MUST(pd_router_start(r, msg, sizeof msg));
    tc_response resp;
    post(r, "/generate", "{\"text\": \"x\"}", &resp);
    expect_error(&resp, 502);
    tc_free(&resp);
    pd_router_destroy(r);

    r = tk_router(&p, 1, &d, 1, NULL);
    /* HTTP 200 with a body that is not JSON. */
    fw_set(d, &(fw_behaviour){.garbage = true});
    post(r, "/generate", "{\"text\": \"x\"}", &resp);
    expect_error(&resp, 502);
    tc_free(&resp);
    /* An event that is not JSON. */
    post(r, "/generate", "{\"text\": \"x\", \"stream\": true}", &resp);
    expect_error_event(&resp, 502);
    tc_free(&resp);
    /* One event larger than the router's event window (256 KiB). */
    fw_set(d, &(fw_behaviour){.tokens = 3, .pad_bytes = 300000});
    post(r, "/generate", "{\"text\": \"x\", \"stream\": true, \"rid\": \"huge-1\"}", &resp);
    expect_error_event(&resp, 502);
    tc_free(&resp);
    assert_true(fw_wait_got_abort(d, "huge-1", WAIT_MS));
    /* The decode node closes the connection without a word. */
    fw_set(d, &(fw_behaviour){.close = true});
    post(r, "/generate", "{\"text\": \"x\"}", &resp);
    expect_error(&resp, 502);
    tc_free(&resp);
    /* A stream that stops after its final event but before [DONE] still
     * ends properly for the client. */
    fw_set(d, &(fw_behaviour){.no_done = true, .tokens = 3});
    post(r, "/generate", "{\"text\": \"x\", \"stream\": true}", &resp);
    assert_int_equal(resp.status, 200);
    size_t tokens;
    char why[256] = "";
    json_t *final = tc_sse_check(resp.body, resp.len, &tokens, why, sizeof why);
    if (!final) fail_msg("%s", why);
    assert_int_equal(tokens, 3);
    json_decref(final);
    tc_free(&resp);
    /* The router is still fine. */
    fw_set(d, &(fw_behaviour){0});
    post(r, "/generate", "{\"text\": \"x\"}", &resp);
    assert_int_equal(resp.status, 200);
    tc_free(&resp);
    pd_router_destroy(r);
    raw_stop(junk);
    fw_stop(p);
    fw_stop(d);
}

static void hang_past_the_timeout_is_504_with_both_halves_aborted(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router_config cfg;
    tk_config(&cfg);
    cfg.request_timeout_ms = 400;
    pd_router *r = tk_router(&p, 1, &d, 1, &cfg);
    fw_set(p, &(fw_behaviour){.hang = true});
    fw_set(d, &(fw_behaviour){.hang = true});
    tc_response resp;
    post(r, "/generate", "{\"text\": \"x\", \"rid\": \"slow-1\"}", &resp);
    expect_error(&resp, 504);
    tc_free(&resp);
    assert_true(fw_wait_got_abort(p, "slow-1", WAIT_MS));
    assert_true(fw_wait_got_abort(d, "slow-1", WAIT_MS));

    /* Streaming: a stream that outlives the request timeout. */
    fw_set(p, &(fw_behaviour){0});
    fw_set(d, &(fw_behaviour){.tokens = 1000, .delay_ms = 50});
    post(r, "/generate", "{\"text\": \"x\", \"rid\": \"slow-2\", \"stream\": true}", &resp);
    expect_error_event(&resp, 504);
    tc_free(&resp);
    assert_true(fw_wait_got_abort(p, "slow-2", WAIT_MS));
    assert_true(fw_wait_got_abort(d, "slow-2", WAIT_MS));
    assert_true(fw_wait_live_count(d, 0, WAIT_MS));
    pd_router_destroy(r);

    /* A worker that accepts the connection and never says a word. */
    raw_server *mute = raw_start(NULL);
    tk_config(&cfg);
    cfg.request_timeout_ms = 400;
    cfg.health_interval_ms = 3600000;
    cfg.prefill[0] = fw_url(p);
    cfg.decode[0] = raw_url(mute);
    cfg.prefill_count = cfg.decode_count = 1;
    char msg[256];
    PD_MUST(pd_router_create(&r, &cfg, msg, sizeof msg));
    PD_MUST(pd_router_start(r, msg, sizeof msg));
    post(r, "/v1/completions", "{\"prompt\": \"x\", \"rid\": \"slow-3\"}", &resp);
    expect_error(&resp, 504);
    tc_free(&resp);
    json_t *info = tk_server_info(r);
    json_t *counters = json_object_get(info, "counters");
    json_t *responses = json_object_get(counters, "responses");
    assert_int_equal(json_integer_value(json_object_get(responses, "504")), 1);
    json_decref(info);
    pd_router_destroy(r);
    raw_stop(mute);
    fw_stop(p);
    fw_stop(d);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(prefill_error_aborts_the_decode_half),
        cmocka_unit_test(a_status_that_is_not_http_is_502),
        cmocka_unit_test(a_decode_refusal_beats_the_prefill_failure_it_caused),
        cmocka_unit_test(refused_connection_is_502_and_the_other_half_is_aborted),
        cmocka_unit_test(garbage_and_closed_connections_are_502),
        cmocka_unit_test(hang_past_the_timeout_is_504_with_both_halves_aborted),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
