/* Health checks: a worker whose /health fails (error status or silence) is
 * taken out after two failed probes and brought back after one good one;
 * requests only go to healthy workers; with no healthy pair the router
 * answers 503 and its own /health says so. */
#include <signal.h>

#include "../test_util.h"
#include "test_client.h"

#define WAIT_MS 10000

static long get_status(pd_router *r, const char *path, json_t **body) {
    char url[128];
    tc_response resp;
    tc_request("GET", tk_url(r, path, url, sizeof url), NULL, WAIT_MS, &resp);
    if (body) *body = tc_json(&resp);
    long s = resp.status;
    tc_free(&resp);
    return s;
}

static long generate(pd_router *r, json_t **body) {
    char url[128];
    tc_response resp;
    tc_request("POST", tk_url(r, "/generate", url, sizeof url), "{\"text\": \"x\"}", WAIT_MS,
               &resp);
    if (body) *body = tc_json(&resp);
    long s = resp.status;
    tc_free(&resp);
    return s;
}

static json_t *worker_info(pd_router *r, const char *url) {
    json_t *info = tk_server_info(r);
    json_t *ws = json_object_get(info, "workers"), *w, *hit = NULL;
    size_t i;
    json_array_foreach(ws, i, w) {
        if (!strcmp(json_string_value(json_object_get(w, "url")), url)) hit = json_incref(w);
    }
    json_decref(info);
    return hit;
}

static void failing_worker_leaves_after_two_probes_and_returns_after_one(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill");
    fake_worker *d[2] = {fw_start("decode"), fw_start("decode")};
    pd_router *r = tk_router(&p, 1, d, 2, NULL);
    assert_true(fw_wait_health_count(d[1], 2, WAIT_MS)); /* the checker runs */

    fw_set(d[1], &(fw_behaviour){.health_status = 503});
    assert_true(tk_wait_health(r, fw_url(d[1]), false, WAIT_MS));
    json_t *w = worker_info(r, fw_url(d[1]));
    assert_true(json_integer_value(json_object_get(w, "consecutive_probe_failures")) >= 2);
    json_decref(w);
    /* Out: every request goes to the other decode node. */
    size_t before = fw_generate_count(d[1]);
    for (int k = 0; k < 4; k++) assert_int_equal(generate(r, NULL), 200);
    assert_int_equal(fw_generate_count(d[1]), before);
    assert_int_equal(fw_generate_count(d[0]), 4);
    /* One good probe brings it back, and it gets requests again. */
    fw_set(d[1], &(fw_behaviour){0});
    assert_true(tk_wait_health(r, fw_url(d[1]), true, WAIT_MS));
    for (int k = 0; k < 4; k++) assert_int_equal(generate(r, NULL), 200);
    assert_true(fw_generate_count(d[1]) >= 1);
    /* The metric says the same. */
    char url[128];
    tc_response m;
    tc_request("GET", tk_url(r, "/metrics", url, sizeof url), NULL, WAIT_MS, &m);
    assert_int_equal(m.status, 200);
    char line[256];
    snprintf(line, sizeof line, "pdserve_router_worker_healthy{worker=\"%s\",role=\"decode\"} 1",
             fw_url(d[1]));
    assert_non_null(strstr(m.body, line));
    assert_non_null(strstr(m.body, "pdserve_router_request_latency_seconds_bucket{le=\"+Inf\"} 8"));
    tc_free(&m);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d[0]);
    fw_stop(d[1]);
}

static void silent_worker_is_taken_out_by_the_probe_timeout(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    fw_set(p, &(fw_behaviour){.health_hang = true});
    assert_true(tk_wait_health(r, fw_url(p), false, WAIT_MS));
    fw_set(p, &(fw_behaviour){0});
    assert_true(tk_wait_health(r, fw_url(p), true, WAIT_MS));
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

static void no_healthy_pair_means_503_and_router_health_says_so(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    assert_int_equal(get_status(r, "/health", NULL), 200);
    fw_set(d, &(fw_behaviour){.health_status = 500});
    assert_true(tk_wait_health(r, fw_url(d), false, WAIT_MS));
    json_t *body = NULL;
    assert_int_equal(generate(r, &body), 503);
    assert_non_null(tc_error_message(body, 503));
    assert_string_equal(json_string_value(json_object_get(json_object_get(body, "error"), "type")),
                        "unavailable_error");
    json_decref(body);
    assert_int_equal(fw_generate_count(d), 0);
    assert_int_equal(fw_generate_count(p), 0); /* nothing half-sent */
    assert_int_equal(get_status(r, "/health", &body), 503);
    assert_non_null(tc_error_message(body, 503));
    json_decref(body);
    json_t *info = tk_server_info(r);
    assert_true(json_is_false(json_object_get(info, "healthy_pair")));
    json_decref(info);
    /* Streaming requests get the same refusal, as JSON. */
    char url[128];
    tc_response resp;
    tc_request("POST", tk_url(r, "/generate", url, sizeof url),
               "{\"text\": \"x\", \"stream\": true}", WAIT_MS, &resp);
    assert_int_equal(resp.status, 503);
    tc_free(&resp);
    fw_set(d, &(fw_behaviour){0});
    assert_true(tk_wait_health(r, fw_url(d), true, WAIT_MS));
    assert_int_equal(get_status(r, "/health", &body), 200);
    assert_string_equal(json_string_value(json_object_get(body, "status")), "ok");
    json_decref(body);
    assert_int_equal(generate(r, NULL), 200);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(failing_worker_leaves_after_two_probes_and_returns_after_one),
        cmocka_unit_test(silent_worker_is_taken_out_by_the_probe_timeout),
        cmocka_unit_test(no_healthy_pair_means_503_and_router_health_says_so),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
