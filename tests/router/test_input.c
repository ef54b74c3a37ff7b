/* Bad input at the router: each refusal has its status and the JSON error
 * body (naming the field where one is wrong), nothing reaches the workers,
 * and the router serves normally afterwards. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "../test_util.h"
#include "test_client.h"

#define WAIT_MS 10000

typedef struct bad_case {
    const char *method;
    const char *path;
    const char *body;
    long status;
    const char *message_part;   /* must appear in the error message */
    const char *allow;          /* 405: the Allow header */
} bad_case;

static const bad_case cases[] = {
    {"POST", "/generate", "{\"text\": \"x\"", 400, "malformed JSON", NULL},
    {"POST", "/generate", "", 400, "malformed JSON", NULL},
    {"POST", "/generate", "[1, 2]", 400, "JSON object", NULL},
    {"POST", "/generate", "\"text\"", 400, "malformed JSON", NULL},
    {"POST", "/generate", "{\"text\": \"x\", \"stream\": \"yes\"}", 400, "stream", NULL},
    {"POST", "/generate", "{\"text\": 7}", 400, "text", NULL},
    {"POST", "/generate", "{\"input_ids\": \"1 2\"}", 400, "input_ids", NULL},
    {"POST", "/generate", "{\"text\": \"x\", \"sampling_params\": [1]}", 400,
     "sampling_params", NULL},
    {"POST", "/generate",
     "{\"text\": \"x\", \"sampling_params\": {\"max_new_tokens\": \"8\"}}", 400,
     "sampling_params.max_new_tokens", NULL},
    {"POST", "/generate", "{\"text\": \"x\", \"sampling_params\": {\"temperature\": true}}", 400,
     "sampling_params.temperature", NULL},
    {"POST", "/generate", "{\"text\": \"x\", \"rid\": 12}", 400, "rid", NULL},
    {"POST", "/generate", "{\"text\": \"x\", \"rid\": \"\"}", 400, "rid", NULL},
    {"POST", "/v1/completions", "{\"prompt\": 5}", 400, "prompt", NULL},
    {"POST", "/v1/completions", "{\"prompt\": \"x\", \"max_tokens\": 1.5}", 400, "max_tokens",
     NULL},
    {"POST", "/v1/completions", "{\"prompt\": \"x\", \"stream\": 1}", 400, "stream", NULL},
    {"POST", "/abort_request", "{}", 400, "rid", NULL},
    {"POST", "/abort_request", "{\"rid\": 5}", 400, "rid", NULL},
    {"POST", "/abort_request", "{\"abort_all\": \"yes\"}", 400, "abort_all", NULL},
    {"POST", "/abort_request", "nope", 400, "malformed JSON", NULL},
    {"GET", "/nowhere", NULL, 404, "unknown path", NULL},
    {"POST", "/v1/chat/completions", "{}", 400, "'messages' is required", NULL},
    {"POST", "/v1/chat/completions", "{\"messages\": \"hi\"}", 400, "messages", NULL},
    {"POST", "/v1/chat/completions", "{\"messages\": [], \"stream\": 1}", 400, "stream", NULL},
    {"POST", "/v1/chat/extra", "{}", 404, "unknown path", NULL},
    {"GET", "/generate", NULL, 405, "POST", "POST"},
    {"DELETE", "/v1/completions", NULL, 405, "POST", "POST"},
    {"POST", "/health", "{}", 405, "GET", "GET"},
    {"PUT", "/metrics", "x", 405, "GET", "GET"},
};

static void bad_requests_get_their_status_and_error_body(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    char url[256];
    for (size_t i = 0; i < PD_ARRAY_LEN(cases); i++) {
        const bad_case *c = &cases[i];
        tc_response resp;
        tc_request(c->method, tk_url(r, c->path, url, sizeof url), c->body, WAIT_MS, &resp);
        if (resp.status != c->status)
            fail_msg("case %zu (%s %s %s): status %ld, want %ld: %s", i, c->method, c->path,
                     c->body ? c->body : "", resp.status, c->status, resp.body);
        json_t *o = tc_json(&resp);
        const char *m = tc_error_message(o, c->status);
        if (!m || !strstr(m, c->message_part))
            fail_msg("case %zu: error body '%s' lacks '%s'", i, resp.body, c->message_part);
        if (c->allow) assert_string_equal(resp.allow, c->allow);
        assert_non_null(strstr(resp.content_type, "application/json"));
        json_decref(o);
        tc_free(&resp);
    }
    assert_int_equal(fw_generate_count(p), 0);
    assert_int_equal(fw_generate_count(d), 0);
    /* Still healthy and serving. */
    tc_response resp;
    tc_request("GET", tk_url(r, "/health", url, sizeof url), NULL, WAIT_MS, &resp);
    assert_int_equal(resp.status, 200);
    tc_free(&resp);
    tc_request("POST", tk_url(r, "/generate", url, sizeof url), "{\"text\": \"ok\"}", WAIT_MS,
               &resp);
    assert_int_equal(resp.status, 200);
    tc_free(&resp);
    json_t *info = tk_server_info(r);
    json_t *counters = json_object_get(info, "counters");
    json_t *responses = json_object_get(counters, "responses");
    /* The 400s above on the generation routes (generate, completions, chat). */
    assert_int_equal(json_integer_value(json_object_get(responses, "400")), 18);
    assert_int_equal(json_integer_value(json_object_get(responses, "200")), 1);
    assert_int_equal(json_integer_value(json_object_get(counters, "in_flight")), 0);
    json_decref(info);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

/* POSTs `chunks` chunks of `chunk_len` bytes (a JSON object padded with
 * spaces) with Transfer-Encoding: chunked; returns the answer's status. */
static long chunked_post_status(uint16_t port, const char *path, int chunks, size_t chunk_len) {
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    PD_ASSERT(connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    char head[256];
    int n = snprintf(head, sizeof head,
                     "POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
                     "Content-Type: application/json\r\nConnection: close\r\n\r\n", path);
    PD_ASSERT(send(fd, head, (size_t)n, MSG_NOSIGNAL) == n);
    char *chunk = malloc(chunk_len + 32);
    for (int i = 0; i < chunks; i++) {
        size_t k = (size_t)snprintf(chunk, 32, "%zx\r\n", chunk_len);
        memset(chunk + k, ' ', chunk_len);
        if (i == 0) memcpy(chunk + k, "{\"text\": \"x\"}", 13 < chunk_len ? 13 : 0);
        memcpy(chunk + k + chunk_len, "\r\n", 2);
        (void)!send(fd, chunk, k + chunk_len + 2, MSG_NOSIGNAL); /* may fail once refused */
    }
    (void)!send(fd, "0\r\n\r\n", 5, MSG_NOSIGNAL);
    free(chunk);
    char buf[512] = "";
    size_t len = 0;
    uint64_t until = tk_now_ms() + WAIT_MS;
    while (len < 12 && tk_now_ms() < until) {
        ssize_t r = recv(fd, buf + len, sizeof buf - 1 - len, 0);
        if (r <= 0) break;
        len += (size_t)r;
    }
    close(fd);
    buf[len] = '\0';
    long status = 0;
    if (sscanf(buf, "HTTP/1.%*d %ld", &status) != 1) return 0;
    return status;
}

/* Sends raw bytes (trickled one byte per trickle_ms when nonzero) and reads
 * the answer until the router closes; returns the status, and the body
 * parsed as JSON in *body (NULL if it is not JSON). */
static long raw_answer(uint16_t port, const char *bytes, size_t len, unsigned trickle_ms,
                       json_t **body) {
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    PD_ASSERT(connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    struct timeval tv = {.tv_sec = 10};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    for (size_t off = 0; off < len;) {
        size_t n = trickle_ms ? 1 : len - off;
        if (send(fd, bytes + off, n, MSG_NOSIGNAL) != (ssize_t)n) break; /* cut off */
        off += n;
        if (trickle_ms) nanosleep(&(struct timespec){0, (long)trickle_ms * 1000000L}, NULL);
    }
    static char buf[65536];
    size_t got = 0;
    for (ssize_t r; got < sizeof buf - 1 && (r = recv(fd, buf + got, sizeof buf - 1 - got, 0)) > 0;)
        got += (size_t)r;
    close(fd);
    buf[got] = '\0';
    long status = 0;
    if (sscanf(buf, "HTTP/1.%*d %ld", &status) != 1) status = 0;
    const char *b = strstr(buf, "\r\n\r\n");
    *body = b ? json_loads(b + 4, 0, NULL) : NULL;
    return status;
}

/* Issue 10, finding 8: libmicrohttpd answered these itself, with HTML; each
 * gets the JSON error shape now, from the router's own server. */
static void malformed_framing_gets_a_json_error(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    static char big[40000];
    int n = snprintf(big, sizeof big, "GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ");
    memset(big + n, 'a', sizeof big - (size_t)n - 5);
    memcpy(big + sizeof big - 5, "\r\n\r\n", 5);
    const struct {
        const char *what, *bytes;
        long status;
    } framing[] = {
        {"header block over the limit", big, 431},
        {"bad Content-Length",
         "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 12abc\r\n\r\n{}", 400},
        {"bad chunked encoding",
         "POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n",
         400},
        {"HTTP/0.9", "GET /health\r\n\r\n", 505},
        {"HTTP/2.0 request line", "GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505},
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(framing); i++) {
        json_t *o;
        size_t len = framing[i].bytes == big ? sizeof big : strlen(framing[i].bytes);
        long st = raw_answer(pd_router_port(r), framing[i].bytes, len, 0, &o);
        if (st != framing[i].status || !tc_error_message(o, st))
            fail_msg("%s: status %ld (want %ld), JSON error body %s", framing[i].what, st,
                     framing[i].status, o ? "present" : "missing");
        json_decref(o);
    }
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

/* Issue 10, finding 3: a request trickled at one byte per interval was never
 * cut (the idle timeout restarts with every byte). The header block now has
 * a deadline of client_timeout_s from its first byte: 408, JSON, closed. */
static void slowloris_is_cut_at_the_header_deadline(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router_config cfg;
    tk_config(&cfg);
    cfg.client_timeout_s = 1;
    pd_router *r = tk_router(&p, 1, &d, 1, &cfg);
    static const char slow[] = "POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: "
                               "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n\r\n";
    json_t *o;
    uint64_t t0 = tk_now_ms();
    long st = raw_answer(pd_router_port(r), slow, sizeof slow - 1, 100, &o); /* ~7 s to send */
    uint64_t took = tk_now_ms() - t0;
    assert_int_equal(st, 408);
    assert_non_null(tc_error_message(o, 408));
    assert_true(took < 5000); /* cut at the deadline, not when the trickle ended */
    json_decref(o);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

static void oversized_bodies_get_413(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router_config cfg;
    tk_config(&cfg);
    cfg.max_body_bytes = 1000;
    pd_router *r = tk_router(&p, 1, &d, 1, &cfg);
    char url[128];
    size_t n = 5000;
    char *big = malloc(n + 64);
    int k = snprintf(big, n + 64, "{\"text\": \"");
    memset(big + k, 'a', n);
    strcpy(big + k + n, "\"}");
    tc_response resp;
    tc_request("POST", tk_url(r, "/generate", url, sizeof url), big, WAIT_MS, &resp);
    assert_int_equal(resp.status, 413);
    json_t *o = tc_json(&resp);
    assert_non_null(tc_error_message(o, 413));
    assert_string_equal(json_string_value(json_object_get(json_object_get(o, "error"), "type")),
                        "request_too_large");
    json_decref(o);
    tc_free(&resp);
    /* Without a declared length (a chunked upload) the limit holds too. */
    assert_int_equal(chunked_post_status(pd_router_port(r), "/generate", 6, 500), 413);
    assert_int_equal(chunked_post_status(pd_router_port(r), "/generate", 1, 14), 200);
    /* Just under the limit is fine. */
    big[k + 900] = '\0';
    strcat(big, "\"}");
    tc_request("POST", tk_url(r, "/generate", url, sizeof url), big, WAIT_MS, &resp);
    assert_int_equal(resp.status, 200);
    tc_free(&resp);
    free(big);
    tc_request("GET", tk_url(r, "/health", url, sizeof url), NULL, WAIT_MS, &resp);
    assert_int_equal(resp.status, 200);
    tc_free(&resp);
    assert_int_equal(fw_generate_count(d), 2);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

static void duplicate_live_rid_is_a_conflict(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    fw_set(d, &(fw_behaviour){.hang = true});
    int fd = tc_raw_post(pd_router_port(r), "/generate", "{\"text\": \"x\", \"rid\": \"twin\"}");
    assert_true(fw_wait_got_generate(d, "twin", WAIT_MS));
    char url[128];
    tc_response resp;
    tc_request("POST", tk_url(r, "/generate", url, sizeof url),
               "{\"text\": \"y\", \"rid\": \"twin\"}", WAIT_MS, &resp);
    assert_int_equal(resp.status, 409);
    json_t *o = tc_json(&resp);
    assert_non_null(tc_error_message(o, 409));
    json_decref(o);
    tc_free(&resp);
    assert_int_equal(fw_generate_count(d), 1);
    close(fd);
    assert_true(fw_wait_got_abort(d, "twin", WAIT_MS));
    assert_true(tk_wait_idle(r, WAIT_MS));
    /* Once the first one is gone the rid is free again. */
    fw_set(d, &(fw_behaviour){0});
    tc_request("POST", tk_url(r, "/generate", url, sizeof url),
               "{\"text\": \"y\", \"rid\": \"twin\"}", WAIT_MS, &resp);
    assert_int_equal(resp.status, 200);
    tc_free(&resp);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

/* POSTs body to path and expects a 400 whose message names the rid limit. */
static void expect_rid_refused(pd_router *r, const char *path, const char *body) {
    char url[128], limit[64];
    snprintf(limit, sizeof limit, "at most %d bytes", PD_RID_MAX - 1);
    tc_response resp;
    tc_request("POST", tk_url(r, path, url, sizeof url), body, WAIT_MS, &resp);
    if (resp.status != 400) fail_msg("%s: status %ld, want 400: %s", path, resp.status, resp.body);
    json_t *o = tc_json(&resp);
    const char *m = tc_error_message(o, 400);
    if (!m || !strstr(m, "rid") || !strstr(m, limit))
        fail_msg("%s: error body '%s' does not name the rid limit ('%s')", path, resp.body, limit);
    json_decref(o);
    tc_free(&resp);
}

/* The nodes refuse rids of PD_RID_MAX bytes or more (base.h); the router
 * holds the same limit, so such a rid is refused at the door with a 400
 * naming it, and neither half of the request is ever sent. */
static void rid_over_the_nodes_limit_is_refused_before_forwarding(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    static const size_t too_long[] = {PD_RID_MAX, PD_RID_MAX + 1, 100, 128, 129};
    char rid[256], body[512];
    for (size_t i = 0; i < PD_ARRAY_LEN(too_long); i++) {
        memset(rid, 'r', too_long[i]);
        rid[too_long[i]] = '\0';
        snprintf(body, sizeof body, "{\"text\": \"x\", \"rid\": \"%s\"}", rid);
        expect_rid_refused(r, "/generate", body);
        snprintf(body, sizeof body, "{\"prompt\": \"x\", \"rid\": \"%s\"}", rid);
        expect_rid_refused(r, "/v1/completions", body);
        snprintf(body, sizeof body, "{\"rid\": \"%s\"}", rid);
        expect_rid_refused(r, "/abort_request", body);
    }
    assert_int_equal(fw_generate_count(p), 0);
    assert_int_equal(fw_generate_count(d), 0);
    assert_int_equal(fw_abort_count(p), 0);
    assert_int_equal(fw_abort_count(d), 0);
    /* One byte less is a rid the nodes take: forwarded whole. */
    memset(rid, 'r', PD_RID_MAX - 1);
    rid[PD_RID_MAX - 1] = '\0';
    snprintf(body, sizeof body, "{\"text\": \"x\", \"rid\": \"%s\"}", rid);
    char url[128];
    tc_response resp;
    tc_request("POST", tk_url(r, "/generate", url, sizeof url), body, WAIT_MS, &resp);
    assert_int_equal(resp.status, 200);
    tc_free(&resp);
    assert_true(fw_got_generate(p, rid));
    assert_true(fw_got_generate(d, rid));
    assert_int_equal(fw_generate_count(d), 1);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

/* An error message that quotes client bytes which are not UTF-8 (a
 * percent-escaped path, or a long path the message cuts inside a character)
 * still comes with the JSON error body, the bad bytes shown as U+FFFD:
 * a body built from the raw bytes would not be JSON at all. */
static void error_quoting_invalid_utf8_still_has_a_json_body(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    char long_path[256] = "/";
    memset(long_path + 1, 'a', 198);
    snprintf(long_path + 199, sizeof long_path - 199, "%%C3%%A9"); /* cut after 0xC3 */
    const char *paths[] = {"/bad%FF%FEbytes", long_path};
    for (size_t i = 0; i < PD_ARRAY_LEN(paths); i++) {
        char url[512];
        tc_response resp;
        tc_request("GET", tk_url(r, paths[i], url, sizeof url), NULL, WAIT_MS, &resp);
        if (resp.status != 404) fail_msg("%s: status %ld, want 404", paths[i], resp.status);
        json_t *o = tc_json(&resp);
        const char *m = tc_error_message(o, 404);
        if (!m || !strstr(m, "unknown path") || !strstr(m, "\xef\xbf\xbd"))
            fail_msg("%s: error body '%s' lacks the path with U+FFFD", paths[i],
                     resp.body ? resp.body : "(none)");
        json_decref(o);
        tc_free(&resp);
    }
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

static int silent_connection(pd_router *r) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons(pd_router_port(r)),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    struct timeval tv = {.tv_sec = 10};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    return fd;
}

/* Issue 10, finding 3: 1,024 silent sockets locked every client out, for as
 * long as they stayed open. Now one address holds at most
 * connections_per_ip, and a silent connection is closed after
 * client_timeout_s; the router serves a request throughout. */
static void silent_clients_cannot_hold_the_router(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router_config cfg;
    tk_config(&cfg);
    cfg.connections_per_ip = 3;
    cfg.client_timeout_s = 1;
    pd_router *r = tk_router(&p, 1, &d, 1, &cfg);
    int fds[3];
    for (int i = 0; i < 3; i++) fds[i] = silent_connection(r);
    char byte;
    uint64_t t0 = tk_now_ms();
    assert_true(recv(fds[2], &byte, 1, 0) <= 0); /* over the per-address cap: closed */
    assert_true(recv(fds[0], &byte, 1, 0) <= 0); /* silent for the timeout: closed */
    uint64_t waited = tk_now_ms() - t0;
    assert_true(waited >= 500 && waited < 8000);
    for (int i = 0; i < 3; i++) close(fds[i]);
    /* The router lets go of the closed ones as it notices them. */
    tc_response resp = {0};
    char url[128];
    for (uint64_t until = tk_now_ms() + 5000; resp.status != 200 && tk_now_ms() < until;) {
        tc_free(&resp);
        tc_request("POST", tk_url(r, "/generate", url, sizeof url), "{\"text\": \"x\"}", WAIT_MS,
                   &resp);
    }
    assert_int_equal(resp.status, 200);
    tc_free(&resp);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(bad_requests_get_their_status_and_error_body),
        cmocka_unit_test(oversized_bodies_get_413),
        cmocka_unit_test(duplicate_live_rid_is_a_conflict),
        cmocka_unit_test(rid_over_the_nodes_limit_is_refused_before_forwarding),
        cmocka_unit_test(error_quoting_invalid_utf8_still_has_a_json_body),
        cmocka_unit_test(silent_clients_cannot_hold_the_router),
        cmocka_unit_test(malformed_framing_gets_a_json_error),
        cmocka_unit_test(slowloris_is_cut_at_the_header_deadline),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
