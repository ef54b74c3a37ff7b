/* The abort storm: 200 concurrent client requests (half streaming) against
 * two prefill and two decode fakes, half of them aborted at random moments
 * while their workers are generating — half through POST /abort_request,
 * half by closing the connection. Every client that stayed connected gets
 * exactly one complete final answer; every abort reached both workers of
 * its request; afterwards nothing is left in flight anywhere and the router
 * is healthy. PD_TEST_SEED changes the random moments.
 *
 * A request is aborted only once both of its workers have it, within
 * 120 ms; a request lasts TOKENS x 20 ms. On a starved machine the test's
 * own loop may notice a request too late to abort it: such a request must
 * then simply have finished normally, and at least 20 of each kind of
 * abort must have happened for the run to count. */
#include <curl/curl.h>
#include <signal.h>
#include <stdio.h>

#include "../test_util.h"
#include "test_client.h"

#define N 200
#define TOKENS 30
#define WAIT_MS 60000

enum fate { KEEP, ABORT_REQUEST, HANG_UP };

typedef struct client {
    char rid[32];
    bool stream;
    enum fate fate;
    CURL *easy;
    tc_response resp;
    bool done;
    bool closed;
    uint64_t act_at_ms;       /* 0 until both workers have the request */
    bool acted;
    CURL *abort_easy;
    tc_response abort_resp;
    bool abort_done;
    char body[160];
    char abort_body[64];
} client;

static size_t on_body(char *p, size_t size, size_t n, void *ud) {
    tc_response *r = ud;
    size_t k = size * n;
    r->body = realloc(r->body, r->len + k + 1);
    memcpy(r->body + r->len, p, k);
    r->len += k;
    r->body[r->len] = '\0';
    return k;
}

static CURL *make_post(const char *url, const char *body, tc_response *resp, struct curl_slist *h) {
    CURL *e = curl_easy_init();
    PD_ASSERT(e != NULL);
    memset(resp, 0, sizeof *resp);
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(e, CURLOPT_POSTFIELDS, body);
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, (long)WAIT_MS);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, resp);
    return e;
}

static bool got_generate_anywhere(fake_worker **w, const char *rid, int *which) {
    for (int i = 0; i < 2; i++)
        if (fw_got_generate(w[i], rid)) {
            *which = i;
            return true;
        }
    return false;
}

/* What the phases of the storm share. */
typedef struct storm {
    fake_worker *p[2], *d[2];
    pd_router *r;
    pd_rng rng;
    char gen_url[128], abort_url[128];
    struct curl_slist *h;
    CURLM *multi;
    client *cl; /* N of them */
    size_t open_transfers;
} storm;

static void storm_init(storm *s, client *cl) {
    memset(s, 0, sizeof *s);
    for (int i = 0; i < 2; i++) s->p[i] = fw_start("prefill");
    for (int i = 0; i < 2; i++) s->d[i] = fw_start("decode");
    for (int i = 0; i < 2; i++) fw_set(s->d[i], &(fw_behaviour){.tokens = TOKENS, .delay_ms = 20});
    pd_router_config cfg;
    tk_config(&cfg);
    cfg.health_interval_ms = 200;
    cfg.health_timeout_ms = 5000; /* a loaded machine must not flap the workers */
    cfg.abort_timeout_ms = 10000;
    cfg.request_timeout_ms = WAIT_MS;
    s->r = tk_router(s->p, 2, s->d, 2, &cfg);
    pd_rng_seed(&s->rng, test_seed(20240601));

    tk_url(s->r, "/generate", s->gen_url, sizeof s->gen_url);
    tk_url(s->r, "/abort_request", s->abort_url, sizeof s->abort_url);
    s->h = curl_slist_append(NULL, "Content-Type: application/json");
    s->h = curl_slist_append(s->h, "Expect:");
    s->multi = curl_multi_init();
    s->cl = cl;
    memset(cl, 0, sizeof(client) * N);
}

/* Every client posts its request: a quarter kept, the rest aborted one way
 * or the other. */
static void storm_start_clients(storm *s) {
    for (int i = 0; i < N; i++) {
        client *c = &s->cl[i];
        snprintf(c->rid, sizeof c->rid, "storm-%d", i);
        c->stream = i % 2 == 1;
        c->fate = i % 4 < 2 ? KEEP : (i % 8 < 6 ? ABORT_REQUEST : HANG_UP);
        char body[160];
        snprintf(body, sizeof body, "{\"text\": \"storm\", \"rid\": \"storm-%d\", \"stream\": %s}",
                 i, c->stream ? "true" : "false");
        memcpy(c->body, body, sizeof body);
        c->easy = make_post(s->gen_url, c->body, &c->resp, s->h);
        curl_easy_setopt(c->easy, CURLOPT_PRIVATE, (char *)c);
        PD_ASSERT(curl_multi_add_handle(s->multi, c->easy) == CURLM_OK);
    }
    s->open_transfers = N;
}

/* Takes in the transfers that ended: a client's request or its abort. */
static void storm_reap(storm *s) {
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(s->multi, &left))) {
        if (m->msg != CURLMSG_DONE) continue;
        client *c = NULL;
        curl_easy_getinfo(m->easy_handle, CURLINFO_PRIVATE, (char **)&c);
        if (m->easy_handle == c->easy) {
            c->done = true;
            c->resp.curl_code = m->data.result;
            curl_easy_getinfo(c->easy, CURLINFO_RESPONSE_CODE, &c->resp.status);
        } else {
            c->abort_done = true;
            curl_easy_getinfo(c->abort_easy, CURLINFO_RESPONSE_CODE, &c->abort_resp.status);
        }
        curl_multi_remove_handle(s->multi, m->easy_handle);
        s->open_transfers--;
    }
}

/* Clients whose moment has come hang up or post /abort_request. */
static void storm_act(storm *s, uint64_t now) {
    for (int i = 0; i < N; i++) {
        client *c = &s->cl[i];
        if (c->fate == KEEP || c->acted || c->done) continue;
        int wp, wd;
        if (c->act_at_ms == 0) {
            /* A random moment while both halves are being worked on. */
            if (got_generate_anywhere(s->p, c->rid, &wp) &&
                got_generate_anywhere(s->d, c->rid, &wd))
                c->act_at_ms = now + pd_rng_below(&s->rng, 120);
            continue;
        }
        if (now < c->act_at_ms) continue;
        c->acted = true;
        if (c->fate == HANG_UP) {
            curl_multi_remove_handle(s->multi, c->easy);
            curl_easy_cleanup(c->easy); /* closes the connection */
            c->easy = NULL;
            c->closed = true;
            s->open_transfers--;
        } else {
            char ab[64];
            snprintf(ab, sizeof ab, "{\"rid\": \"storm-%d\"}", i);
            memcpy(c->abort_body, ab, sizeof ab); /* kept alive for curl */
            c->abort_easy = make_post(s->abort_url, c->abort_body, &c->abort_resp, s->h);
            curl_easy_setopt(c->abort_easy, CURLOPT_PRIVATE, (char *)c);
            PD_ASSERT(curl_multi_add_handle(s->multi, c->abort_easy) == CURLM_OK);
            s->open_transfers++;
        }
    }
}

/* Drives the transfers until none is open or WAIT_MS has passed. */
static void storm_run(storm *s) {
    uint64_t deadline = tk_now_ms() + WAIT_MS;
    while (s->open_transfers > 0 && tk_now_ms() < deadline) {
        int running;
        curl_multi_perform(s->multi, &running);
        storm_reap(s);
        storm_act(s, tk_now_ms());
        curl_multi_poll(s->multi, NULL, 0, 10, NULL);
    }
}

/* A client that stayed connected got exactly one complete final answer:
 * "length" if kept; if aborted, whatever the abort found. */
static void check_answer(const client *c, size_t *aborted_answers) {
    if (!c->done || c->resp.curl_code != CURLE_OK || c->resp.status != 200)
        fail_msg("%s: transfer %d, status %ld: %s", c->rid, c->resp.curl_code, c->resp.status,
                 c->resp.body ? c->resp.body : "");
    json_t *final;
    size_t tokens = 0;
    if (c->stream) {
        char why[256] = "";
        final = tc_sse_check(c->resp.body, c->resp.len, &tokens, why, sizeof why);
        if (!final) fail_msg("%s: %s: %s", c->rid, why, c->resp.body);
    } else {
        final = json_loadb(c->resp.body, c->resp.len, 0, NULL);
        if (!final) fail_msg("%s: not JSON: %s", c->rid, c->resp.body);
    }
    json_t *fr = json_object_get(json_object_get(final, "meta_info"), "finish_reason");
    const char *type = json_string_value(json_object_get(fr, "type"));
    if (!type) fail_msg("%s: no finish_reason: %s", c->rid, c->resp.body);
    if (c->fate == KEEP) {
        assert_string_equal(type, "length");
        if (c->stream) assert_int_equal(tokens, TOKENS);
    } else {
        if (!strcmp(type, "abort")) (*aborted_answers)++;
        /* 404 only when the request had already ended: too late to abort. */
        if (c->fate == ABORT_REQUEST && c->abort_resp.status != 200 &&
            !(c->abort_resp.status == 404 && !strcmp(type, "length")))
            fail_msg("%s: /abort_request answered %ld: %s; answer %s", c->rid,
                     c->abort_resp.status, c->abort_resp.body ? c->abort_resp.body : "",
                     c->resp.body);
    }
    json_decref(final);
}

/* Every abort reached both workers of its request. A hang-up that came
 * after the decode node had finished may have found the answer already
 * sent (nothing to abort then); any other must have reached both. Returns
 * the number of hang-ups of the second kind. */
static size_t check_aborts_delivered(storm *s) {
    size_t hangups_mid_request = 0;
    for (int i = 0; i < N; i++) {
        client *c = &s->cl[i];
        if (c->fate == KEEP) continue;
        int wp = -1, wd = -1;
        assert_true(got_generate_anywhere(s->p, c->rid, &wp));
        assert_true(got_generate_anywhere(s->d, c->rid, &wd));
        if (c->fate == HANG_UP && fw_got_completed(s->d[wd], c->rid)) continue;
        hangups_mid_request += c->fate == HANG_UP;
        if (!fw_wait_got_abort(s->p[wp], c->rid, 20000))
            fail_msg("%s: prefill never got the abort", c->rid);
        if (!fw_wait_got_abort(s->d[wd], c->rid, 20000))
            fail_msg("%s: decode never got the abort", c->rid);
    }
    return hangups_mid_request;
}

/* Nothing left anywhere; the router is healthy and serves. */
static void check_settled(storm *s, size_t hangups_mid_request, size_t hangups) {
    for (int i = 0; i < 2; i++) {
        assert_true(fw_wait_live_count(s->p[i], 0, 20000));
        assert_true(fw_wait_live_count(s->d[i], 0, 20000));
    }
    assert_true(tk_wait_idle(s->r, 20000));
    json_t *info = tk_server_info(s->r);
    json_t *ws = json_object_get(info, "workers"), *w;
    size_t k;
    json_array_foreach(ws, k, w) {
        assert_int_equal(json_integer_value(json_object_get(w, "in_flight")), 0);
        assert_true(json_is_true(json_object_get(w, "healthy")));
    }
    json_t *counters = json_object_get(info, "counters");
    json_int_t gone = json_integer_value(json_object_get(counters, "client_disconnects"));
    if (gone < (json_int_t)hangups_mid_request || gone > (json_int_t)hangups)
        fail_msg("client_disconnects %lld, want %zu..%zu", (long long)gone, hangups_mid_request,
                 hangups);
    json_decref(info);
    tc_response resp;
    tc_request("POST", s->gen_url, "{\"text\": \"after\"}", 10000, &resp);
    assert_int_equal(resp.status, 200);
    tc_free(&resp);
}

static void storm_free(storm *s) {
    for (int i = 0; i < N; i++) {
        client *c = &s->cl[i];
        if (c->easy) curl_easy_cleanup(c->easy);
        if (c->abort_easy) curl_easy_cleanup(c->abort_easy);
        tc_free(&c->resp);
        tc_free(&c->abort_resp);
    }
    curl_multi_cleanup(s->multi);
    curl_slist_free_all(s->h);
    pd_router_destroy(s->r);
    for (int i = 0; i < 2; i++) {
        fw_stop(s->p[i]);
        fw_stop(s->d[i]);
    }
}

static void abort_storm_every_client_answered_once_every_abort_delivered(void **state) {
    (void)state;
    static client cl[N];
    storm s;
    storm_init(&s, cl);
    storm_start_clients(&s);
    storm_run(&s);
    assert_int_equal(s.open_transfers, 0);

    size_t aborted_answers = 0, acted[3] = {0};
    for (int i = 0; i < N; i++) {
        client *c = &cl[i];
        if (c->fate != KEEP && !c->acted) c->fate = KEEP; /* finished before its moment */
        if (c->acted) acted[c->fate]++;
        if (c->closed) continue;
        check_answer(c, &aborted_answers);
    }
    /* Most aborts land while the request is generating (it lasts TOKENS x
     * 20 ms, the abort comes within 120 ms of its start); timing decides
     * which, so only "some" is asserted. */
    print_message("storm: %zu hang-ups, %zu /abort_request "
                  "(%zu of them ended a generating request)\n",
                  acted[HANG_UP], acted[ABORT_REQUEST], aborted_answers);
    assert_true(acted[HANG_UP] >= 20 && acted[ABORT_REQUEST] >= 20);
    assert_true(aborted_answers > 0);
    size_t hangups_mid_request = check_aborts_delivered(&s);
    check_settled(&s, hangups_mid_request, acted[HANG_UP]);
    storm_free(&s);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(abort_storm_every_client_answered_once_every_abort_delivered),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
