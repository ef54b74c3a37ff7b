/* Forwarding end to end against fake workers: both halves get the client's
 * body plus the bootstrap fields, rooms are fresh, the client gets the
 * decode node's answer (status and body, streamed event by event), and the
 * policies spread requests as they promise. */
#include <curl/curl.h>
#include <pthread.h>
#include <signal.h>

#include "../test_util.h"
#include "test_client.h"

#define TIMEOUT_MS 15000

static void post(pd_router *r, const char *path, const char *body, tc_response *resp) {
    char url[128];
    tc_request("POST", tk_url(r, path, url, sizeof url), body, TIMEOUT_MS, resp);
}

/* A client rid is kept; the per-node bootstrap port overrides the default. */
static void client_rid_and_node_port_are_kept(fake_worker *p, fake_worker *d) {
    pd_router_config cfg;
    char spec[96];
    snprintf(spec, sizeof spec, "%s@7777", fw_url(p));
    tk_config(&cfg);
    cfg.prefill[0] = spec;
    cfg.prefill_count = 1;
    cfg.decode[0] = fw_url(d);
    cfg.decode_count = 1;
    char msg[256];
    pd_router *r;
    PD_MUST(pd_router_create(&r, &cfg, msg, sizeof msg));
    PD_MUST(pd_router_start(r, msg, sizeof msg));
    tc_response resp;
    post(r, "/generate", "{\"input_ids\": [1, 2, 3], \"rid\": \"client-rid-1\"}", &resp);
    assert_int_equal(resp.status, 200);
    json_t *pb = fw_generate_body(p, 3);
    assert_string_equal(json_string_value(json_object_get(pb, "rid")), "client-rid-1");
    assert_int_equal(json_integer_value(json_object_get(pb, "bootstrap_port")), 7777);
    assert_true(fw_got_generate(d, "client-rid-1"));
    json_t *got = tc_json(&resp);
    assert_string_equal(json_string_value(json_object_get(json_object_get(got, "meta_info"), "id")),
                        "client-rid-1");
    json_decref(got);
    json_decref(pb);
    tc_free(&resp);
    pd_router_destroy(r);
}

static void both_halves_get_the_body_with_bootstrap_fields(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router_config cfg;
    tk_config(&cfg);
    cfg.bootstrap_port = 9123;
    pd_router *r = tk_router(&p, 1, &d, 1, &cfg);

    const char *body = "{\"text\": \"Hello\", \"sampling_params\": {\"max_new_tokens\": 4, "
                       "\"temperature\": 0.5}, \"extra\": [1, 2, {\"x\": null}]}";
    uint64_t rooms[3] = {0};
    char rids[3][160];
    for (int k = 0; k < 3; k++) {
        tc_response resp;
        post(r, "/generate", body, &resp);
        assert_int_equal(resp.status, 200);
        json_t *got = tc_json(&resp);
        assert_non_null(got);
        /* The decode node's answer: 4 tokens, finish length. */
        assert_string_equal(json_string_value(json_object_get(got, "text")), "t0 t1 t2 t3 ");
        json_t *meta = json_object_get(got, "meta_info");
        json_t *finish = json_object_get(meta, "finish_reason");
        assert_string_equal(json_string_value(json_object_get(finish, "type")), "length");
        json_t *pb = fw_generate_body(p, (size_t)k), *db = fw_generate_body(d, (size_t)k);
        assert_non_null(pb);
        assert_non_null(db);
        assert_true(json_equal(pb, db)); /* byte for byte the same request */
        assert_string_equal(json_string_value(json_object_get(pb, "bootstrap_host")), "127.0.0.1");
        assert_int_equal(json_integer_value(json_object_get(pb, "bootstrap_port")), 9123);
        json_t *room = json_object_get(pb, "bootstrap_room");
        assert_true(json_is_integer(room));
        rooms[k] = (uint64_t)json_integer_value(room);
        assert_true(rooms[k] != 0);
        const char *rid = json_string_value(json_object_get(pb, "rid"));
        assert_non_null(rid);
        assert_true(strlen(rid) > 0);
        snprintf(rids[k], sizeof rids[k], "%s", rid);
        /* Everything the client sent is there, unchanged. */
        json_t *sent = json_loads(body, 0, NULL);
        json_object_del(pb, "bootstrap_host");
        json_object_del(pb, "bootstrap_port");
        json_object_del(pb, "bootstrap_room");
        json_object_del(pb, "rid");
        assert_true(json_equal(sent, pb));
        json_decref(sent);
        json_decref(pb);
        json_decref(db);
        json_decref(got);
        tc_free(&resp);
    }
    assert_true(rooms[0] != rooms[1] && rooms[1] != rooms[2] && rooms[0] != rooms[2]);
    assert_true(strcmp(rids[0], rids[1]) && strcmp(rids[1], rids[2]));
    pd_router_destroy(r);

    client_rid_and_node_port_are_kept(p, d);
    fw_stop(p);
    fw_stop(d);
}

static void client_gets_the_decode_status_and_body(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    /* A decode-side refusal comes back as is. */
    fw_set(d, &(fw_behaviour){.generate_status = 409});
    tc_response resp;
    post(r, "/generate", "{\"text\": \"x\"}", &resp);
    assert_int_equal(resp.status, 409);
    json_t *o = tc_json(&resp);
    assert_string_equal(tc_error_message(o, 409), "fake worker error");
    json_decref(o);
    tc_free(&resp);
    /* Completions go to /v1/completions on both nodes, answer passed through. */
    fw_set(d, &(fw_behaviour){.tokens = 2});
    post(r, "/v1/completions", "{\"prompt\": \"Hi\", \"max_tokens\": 2, \"model\": \"m\"}", &resp);
    assert_int_equal(resp.status, 200);
    assert_non_null(strstr(resp.content_type, "application/json"));
    o = tc_json(&resp);
    json_t *choice = json_array_get(json_object_get(o, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(choice, "text")), "t0 t1 ");
    assert_string_equal(json_string_value(json_object_get(choice, "finish_reason")), "length");
    json_decref(o);
    tc_free(&resp);
    assert_int_equal(fw_generate_count(p), 2);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

static void streaming_passes_every_event_in_order_then_done(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    fw_set(d, &(fw_behaviour){.tokens = 12, .delay_ms = 5});
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    for (int api = 0; api < 2; api++) {
        tc_response resp;
        if (api == 0) post(r, "/generate", "{\"text\": \"Hello\", \"stream\": true}", &resp);
        else post(r, "/v1/completions", "{\"prompt\": \"Hello\", \"stream\": true}", &resp);
        assert_int_equal(resp.status, 200);
        assert_non_null(strstr(resp.content_type, "text/event-stream"));
        size_t tokens = 0;
        char why[256] = "";
        json_t *final = tc_sse_check(resp.body, resp.len, &tokens, why, sizeof why);
        if (!final) fail_msg("%s", why);
        assert_int_equal(tokens, 12);
        /* In order: token k is event k. */
        const char *at = resp.body;
        for (int k = 0; k < 12; k++) {
            char needle[32];
            snprintf(needle, sizeof needle, "\"t%d \"", k);
            const char *hit = strstr(at, needle);
            assert_non_null(hit);
            at = hit;
        }
        json_t *fr;
        if (api == 0) {
            json_t *meta = json_object_get(final, "meta_info");
            fr = json_object_get(json_object_get(meta, "finish_reason"), "type");
        } else {
            json_t *choice = json_array_get(json_object_get(final, "choices"), 0);
            fr = json_object_get(choice, "finish_reason");
        }
        assert_string_equal(json_string_value(fr), "length");
        json_decref(final);
        tc_free(&resp);
    }
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

/* A client that reads slowly: the router's event window fills, the decode
 * transfer is paused and resumed, and still every event arrives in order. */
typedef struct slow_reader {
    tc_response resp;
    bool slept;
} slow_reader;

static size_t slow_write(char *ptr, size_t size, size_t n, void *ud) {
    slow_reader *s = ud;
    if (!s->slept) {
        s->slept = true;
        tk_sleep_ms(1500);
    }
    size_t k = size * n;
    s->resp.body = realloc(s->resp.body, s->resp.len + k + 1);
    memcpy(s->resp.body + s->resp.len, ptr, k);
    s->resp.len += k;
    s->resp.body[s->resp.len] = '\0';
    return k;
}

static void slow_reader_gets_every_event(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    enum { TOKENS = 3000 };
    fw_set(d, &(fw_behaviour){.tokens = TOKENS, .pad_bytes = 1000}); /* ~3 MB of events */
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    char url[128];
    slow_reader sr = {0};
    CURL *e = curl_easy_init();
    curl_easy_setopt(e, CURLOPT_URL, tk_url(r, "/generate", url, sizeof url));
    curl_easy_setopt(e, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(e, CURLOPT_POSTFIELDS, "{\"text\": \"x\", \"stream\": true}");
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, slow_write);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, &sr);
    curl_easy_setopt(e, CURLOPT_BUFFERSIZE, 16384L);
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, 60000L);
    assert_int_equal(curl_easy_perform(e), CURLE_OK);
    curl_easy_cleanup(e);
    size_t tokens;
    char why[256] = "";
    json_t *final = tc_sse_check(sr.resp.body, sr.resp.len, &tokens, why, sizeof why);
    if (!final) fail_msg("%s", why);
    if (tokens != TOKENS) {
        char *text = json_dumps(final, JSON_COMPACT);
        fail_msg("%zu tokens, then %.300s", tokens, text);
    }
    json_decref(final);
    const char *at = sr.resp.body;
    for (int k = 0; k < TOKENS; k += 7) {
        char needle[32];
        snprintf(needle, sizeof needle, "\"t%d x", k);
        const char *hit = strstr(at, needle);
        if (!hit) fail_msg("token %d missing or out of order", k);
        at = hit;
    }
    tc_free(&sr.resp);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

static void round_robin_alternates_across_two_by_two(void **state) {
    (void)state;
    fake_worker *p[2] = {fw_start("prefill"), fw_start("prefill")};
    fake_worker *d[2] = {fw_start("decode"), fw_start("decode")};
    pd_router *r = tk_router(p, 2, d, 2, NULL);
    enum { N = 8 };
    size_t prev[4] = {0};
    int last_p = -1, last_d = -1;
    for (int k = 0; k < N; k++) {
        tc_response resp;
        post(r, "/generate", "{\"text\": \"x\"}", &resp);
        assert_int_equal(resp.status, 200);
        tc_free(&resp);
        /* Who got request k: the one whose count grew. */
        size_t now[4] = {fw_generate_count(p[0]), fw_generate_count(p[1]), fw_generate_count(d[0]),
                         fw_generate_count(d[1])};
        assert_int_equal(now[0] + now[1], (size_t)k + 1);
        assert_int_equal(now[2] + now[3], (size_t)k + 1);
        int gp = now[0] > prev[0] ? 0 : 1, gd = now[2] > prev[2] ? 0 : 1;
        if (k > 0) {
            assert_int_not_equal(gp, last_p);
            assert_int_not_equal(gd, last_d);
        }
        last_p = gp;
        last_d = gd;
        memcpy(prev, now, sizeof prev);
    }
    assert_int_equal(fw_generate_count(p[0]), N / 2);
    assert_int_equal(fw_generate_count(p[1]), N / 2);
    assert_int_equal(fw_generate_count(d[0]), N / 2);
    assert_int_equal(fw_generate_count(d[1]), N / 2);
    pd_router_destroy(r);
    for (int i = 0; i < 2; i++) {
        fw_stop(p[i]);
        fw_stop(d[i]);
    }
}

/* A request in a thread, for the load tests. */
typedef struct bg {
    pd_router *r;
    const char *body;
    tc_response resp;
    pthread_t t;
} bg;

static void *bg_main(void *arg) {
    bg *b = arg;
    post(b->r, "/generate", b->body, &b->resp);
    return NULL;
}

static void least_load_picks_the_worker_with_fewer_in_flight(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill");
    fake_worker *d[2] = {fw_start("decode"), fw_start("decode")};
    pd_router_config cfg;
    tk_config(&cfg);
    cfg.policy = PD_ROUTER_LEAST_LOAD;
    pd_router *r = tk_router(&p, 1, d, 2, &cfg);
    /* One long request occupies the first decode node... */
    fw_set(d[0], &(fw_behaviour){.hang = true});
    bg slow = {.r = r, .body = "{\"text\": \"slow\", \"rid\": \"slow-1\"}"};
    pthread_create(&slow.t, NULL, bg_main, &slow);
    assert_true(fw_wait_got_generate(d[0], "slow-1", TIMEOUT_MS));
    /* ...so every next request goes to the idle one (round robin would
     * alternate). */
    for (int k = 0; k < 4; k++) {
        tc_response resp;
        post(r, "/generate", "{\"text\": \"x\"}", &resp);
        assert_int_equal(resp.status, 200);
        tc_free(&resp);
    }
    assert_int_equal(fw_generate_count(d[0]), 1);
    assert_int_equal(fw_generate_count(d[1]), 4);
    json_t *info = tk_server_info(r);
    json_t *w1 = json_array_get(json_object_get(info, "workers"), 1); /* d[0] */
    assert_int_equal(json_integer_value(json_object_get(w1, "in_flight")), 1);
    json_decref(info);
    /* Release the slow one. */
    tc_response ab;
    char url[128];
    tc_request("POST", tk_url(r, "/abort_request", url, sizeof url), "{\"rid\": \"slow-1\"}",
               TIMEOUT_MS, &ab);
    assert_int_equal(ab.status, 200);
    tc_free(&ab);
    pthread_join(slow.t, NULL);
    assert_int_equal(slow.resp.status, 200);
    tc_free(&slow.resp);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d[0]);
    fw_stop(d[1]);
}

typedef struct pool_client {
    pd_router *r;
    int requests, ok;
} pool_client;

static void *pool_client_main(void *arg) {
    pool_client *c = arg;
    for (int i = 0; i < c->requests; i++) {
        tc_response resp;
        post(c->r, "/generate", i % 2 ? "{\"text\": \"x\", \"stream\": true}" : "{\"text\": \"x\"}",
             &resp);
        c->ok += resp.status == 200;
        tc_free(&resp);
    }
    return NULL;
}

/* Issue 11, finding 7: the router opened a new TCP connection per half per
 * request (22,781 sockets in TIME_WAIT after 30 s at 683 req/s). Connections
 * to the workers are pooled now: 8 clients at once, 10 requests each, plain
 * and streamed, reach each worker over a few more connections than there
 * are requests in flight. Without the pool it took one per request (81);
 * with the pool but curl's default per-multi bound, concurrent requests
 * pruned each other's idle connections. */
static void worker_connections_are_reused(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    enum { CLIENTS = 8, EACH = 10 };
    pool_client c[CLIENTS];
    pthread_t t[CLIENTS];
    for (int i = 0; i < CLIENTS; i++) {
        c[i] = (pool_client){.r = r, .requests = EACH};
        assert_int_equal(pthread_create(&t[i], NULL, pool_client_main, &c[i]), 0);
    }
    for (int i = 0; i < CLIENTS; i++) {
        pthread_join(t[i], NULL);
        assert_int_equal(c[i].ok, EACH);
    }
    /* A bound well under one per request: on a loaded machine a connection
     * comes back to the pool just after another request asked for one more
     * often (17 to the decode seen once under make test's load, against a
     * bound of 16 that had held until then). */
    size_t cp = fw_connection_count(p), cd = fw_connection_count(d);
    if (cp > 3 * CLIENTS || cd > 3 * CLIENTS)
        fail_msg("%d requests took %zu connections to the prefill, %zu to the decode",
                 CLIENTS * EACH, cp, cd);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(both_halves_get_the_body_with_bootstrap_fields),
        cmocka_unit_test(worker_connections_are_reused),
        cmocka_unit_test(client_gets_the_decode_status_and_body),
        cmocka_unit_test(streaming_passes_every_event_in_order_then_done),
        cmocka_unit_test(slow_reader_gets_every_event),
        cmocka_unit_test(round_robin_alternates_across_two_by_two),
        cmocka_unit_test(least_load_picks_the_worker_with_fewer_in_flight),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
