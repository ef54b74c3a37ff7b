/* Stream feeds (docs/http-api.md#stream-feeds, docs/router.md#stream-feeds)
 * with real nodes: a prefill and a decode node in this process, joined by
 * the loopback transport, and a router in front of them. A stream through
 * the router goes through the decode node's feed: same events as a direct
 * stream, demultiplexed by tag, one error each when the feed drops, the
 * node aborting (and ending idle_clean) when the feed's consumer dies, and
 * clear 4xx for bad input. A worker without /stream_feed keeps the direct
 * path. */
#include <arpa/inet.h>
#include <curl/curl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../router/test_client.h"
#include "../test_util.h"
#include "node_internal.h"
#include "pdserve/node.h"

#define TIMEOUT_MS 30000
#define LOOPS 4 /* the router's upstream loops: one feed each per decode node */

typedef struct pair {
    pd_loopback_mt *lb;
    pd_node *p, *d;
    pd_router *r;
    char p_url[64], d_url[64], p_spec[96];
} pair;

/* write_timeout_ms: the nodes' --http-write-timeout-ms (0: the default). */
static void pair_start_with(pair *s, uint32_t write_timeout_ms) {
    PD_MUST(pd_loopback_mt_create(&s->lb, 16, 512));
    PD_MUST(pd_loopback_mt_start(s->lb));
    pd_node *nodes[2];
    const pd_node_role roles[2] = {PD_NODE_PREFILL, PD_NODE_DECODE};
    for (int k = 0; k < 2; k++) {
        pd_node_config c;
        pd_node_config_default(&c, roles[k]);
        c.port = 0;
        c.bootstrap_port = 8998; /* loopback: a name, nothing listens */
        c.loopback = s->lb;
        c.transfer_backend = "loopback";
        c.max_total_tokens = 131072;
        c.max_new_tokens_limit = 16384;
        if (write_timeout_ms) c.http_write_timeout_ms = write_timeout_ms;
        char msg[512];
        PD_ASSERTF(pd_node_create(&nodes[k], &c, msg, sizeof msg) == PD_OK, "%s", msg);
        PD_ASSERTF(pd_node_start(nodes[k], msg, sizeof msg) == PD_OK, "%s", msg);
    }
    s->p = nodes[0];
    s->d = nodes[1];
    snprintf(s->p_url, sizeof s->p_url, "http://127.0.0.1:%u", pd_node_http_port(s->p));
    snprintf(s->d_url, sizeof s->d_url, "http://127.0.0.1:%u", pd_node_http_port(s->d));
    snprintf(s->p_spec, sizeof s->p_spec, "%s@%u", s->p_url, pd_node_bootstrap_port(s->p));
    pd_router_config cfg;
    tk_config(&cfg);
    cfg.prefill[0] = s->p_spec;
    cfg.decode[0] = s->d_url;
    cfg.prefill_count = cfg.decode_count = 1;
    char msg[256];
    PD_ASSERTF(pd_router_create(&s->r, &cfg, msg, sizeof msg) == PD_OK, "%s: %s", msg, s->p_spec);
    PD_ASSERTF(pd_router_start(s->r, msg, sizeof msg) == PD_OK, "%s", msg);
}

static void pair_start(pair *s) { pair_start_with(s, 0); }

static void pair_stop(pair *s) {
    pd_router_destroy(s->r);
    pd_node_destroy(s->d);
    pd_node_destroy(s->p);
    pd_loopback_mt_destroy(s->lb);
}

/* The decode node's open feeds as the router reports them. */
static int feeds_open(pd_router *r) {
    json_t *info = tk_server_info(r);
    int open = -1;
    json_t *w;
    size_t i;
    json_array_foreach(json_object_get(info, "workers"), i, w) {
        json_t *n = json_object_get(w, "stream_feeds_open");
        if (n) open = (int)json_integer_value(n);
    }
    json_decref(info);
    return open;
}

static bool wait_feeds(pd_router *r, int want, int timeout_ms) {
    uint64_t until = tk_now_ms() + (uint64_t)timeout_ms;
    while (feeds_open(r) != want) {
        if (tk_now_ms() > until) return false;
        tk_sleep_ms(20);
    }
    return true;
}

static json_t *node_info(const char *base) {
    char url[128];
    snprintf(url, sizeof url, "%s/server_info", base);
    tc_response resp;
    tc_request("GET", url, NULL, 5000, &resp);
    json_t *o = resp.status == 200 ? tc_json(&resp) : NULL;
    tc_free(&resp);
    return o;
}

/* The node has no live request and its engine's check passes. */
static bool wait_idle_clean(const char *base, int timeout_ms) {
    uint64_t until = tk_now_ms() + (uint64_t)timeout_ms;
    for (;;) {
        json_t *o = node_info(base);
        bool clean = json_is_true(json_object_get(o, "idle_clean"));
        json_decref(o);
        if (clean) return true;
        if (tk_now_ms() > until) return false;
        tk_sleep_ms(20);
    }
}

static long long node_counter(const char *base, const char *name) {
    json_t *o = node_info(base);
    long long v = json_integer_value(json_object_get(json_object_get(o, "counters"), name));
    json_decref(o);
    return v;
}

/* A POST on a thread of its own: the two halves of a direct request must
 * run at once. */
typedef struct async_post {
    pthread_t t;
    char url[160];
    const char *body;
    tc_response resp;
} async_post;

static void *async_main(void *arg) {
    async_post *a = arg;
    tc_request("POST", a->url, a->body, TIMEOUT_MS, &a->resp);
    return NULL;
}

static void post_start(async_post *a, const char *base, const char *path, const char *body) {
    snprintf(a->url, sizeof a->url, "%s%s", base, path);
    a->body = body;
    PD_ASSERT(pthread_create(&a->t, NULL, async_main, a) == 0);
}

static void post_join(async_post *a) { pthread_join(a->t, NULL); }

static long long router_counter(pd_router *r, const char *name) {
    json_t *o = tk_server_info(r);
    long long v = json_integer_value(json_object_get(json_object_get(o, "counters"), name));
    json_decref(o);
    return v;
}

/* What a client can compare of two streams of the same greedy generation:
 * the final event's text, output_ids and finish_reason type. Where one
 * event ends and the next begins is the node's timing (tokens that come
 * while an event waits go into the next one), so the events before it are
 * checked for what they promise: each (cumulative) event's output_ids a
 * prefix of the next one's. */
static char *events_digest(const char *body, size_t len) {
    char *last = NULL, *prev_ids = NULL;
    const char *p = body, *end = body + len;
    while (p < end) {
        const char *e = strstr(p, "\n\n");
        if (!e) break;
        if (!strncmp(p, "data: {", 7)) {
            json_t *o = json_loadb(p + 6, (size_t)(e - p - 6), 0, NULL);
            json_t *fin = json_object_get(json_object_get(o, "meta_info"), "finish_reason");
            char *ids = json_dumps(json_object_get(o, "output_ids"), JSON_COMPACT);
            assert_non_null(ids);
            if (prev_ids) { /* "[1,2]" is a prefix of "[1,2,3]" once the ']' is cut */
                size_t k = strlen(prev_ids) - 1;
                bool same = !strcmp(ids, prev_ids); /* the final event, on its own */
                if (!same && (strncmp(prev_ids, ids, k) || ids[k] != ','))
                    fail_msg("event ids %s do not extend %s", ids, prev_ids);
            }
            free(prev_ids);
            prev_ids = ids;
            size_t cap = strlen(ids) + 4096;
            free(last);
            last = malloc(cap);
            snprintf(last, cap, "%s|%s|%s", json_string_value(json_object_get(o, "text")), ids,
                     json_string_value(json_object_get(fin, "type")));
            json_decref(o);
        }
        p = e + 2;
    }
    free(prev_ids);
    return last ? last : strdup("");
}

/* Every event's meta_info.id is rid, exactly one final event, then [DONE]. */
static void assert_own_stream(const tc_response *resp, const char *rid) {
    assert_int_equal(resp->status, 200);
    char why[256] = "";
    size_t tokens = 0;
    json_t *fin = tc_sse_check(resp->body, resp->len, &tokens, why, sizeof why);
    if (!fin) fail_msg("stream of %s: %s", rid, why);
    json_decref(fin);
    const char *p = resp->body;
    while ((p = strstr(p, "\"id\":\""))) {
        p += 6;
        if (strncmp(p, rid, strlen(rid)) || p[strlen(rid)] != '"')
            fail_msg("stream of %s carries an event of %.20s", rid, p);
    }
}

/* ---- the same events as the direct stream ------------------------------------- */

static const char *GREEDY = "\"sampling_params\": {\"max_new_tokens\": 12, \"temperature\": 0, "
                            "\"ignore_eos\": true}";

static void a_stream_through_a_feed_has_the_direct_streams_events(void **state) {
    (void)state;
    pair s;
    pair_start(&s);
    assert_true(wait_feeds(s.r, LOOPS, 10000));
    char body[512];
    snprintf(body, sizeof body, "{\"text\": \"the same prompt\", \"stream\": true, %s}", GREEDY);
    tc_response fed[LOOPS]; /* one per loop: each goes through its loop's feed */
    char rurl[128];
    for (int i = 0; i < LOOPS; i++)
        tc_request("POST", tk_url(s.r, "/generate", rurl, sizeof rurl), body, TIMEOUT_MS, &fed[i]);
    /* Direct: the two nodes, by hand, as the router did before feeds. */
    char pbody[768], dbody[768];
    const char *boot = "\"bootstrap_host\": \"127.0.0.1\", \"bootstrap_room\": 4242";
    snprintf(pbody, sizeof pbody,
             "{\"text\": \"the same prompt\", \"rid\": \"direct\", %s, \"bootstrap_port\": %u, %s}",
             boot, pd_node_bootstrap_port(s.p), GREEDY);
    snprintf(dbody, sizeof dbody,
             "{\"text\": \"the same prompt\", \"rid\": \"direct\", \"stream\": true, %s, "
             "\"bootstrap_port\": %u, %s}",
             boot, pd_node_bootstrap_port(s.p), GREEDY);
    async_post pa, da;
    post_start(&da, s.d_url, "/generate", dbody);
    post_start(&pa, s.p_url, "/generate", pbody);
    post_join(&pa);
    post_join(&da);
    tc_response dr = da.resp;
    assert_int_equal(pa.resp.status, 200);
    tc_free(&pa.resp);
    assert_int_equal(router_counter(s.r, "streams_fed"), LOOPS);
    if (dr.status != 200) fail_msg("direct stream: %ld %.*s", dr.status, (int)dr.len, dr.body);
    char *want = events_digest(dr.body, dr.len);
    assert_true(strlen(want) > 0);
    for (int i = 0; i < LOOPS; i++) {
        assert_int_equal(fed[i].status, 200);
        char why[256] = "";
        size_t tokens = 0;
        json_t *fin = tc_sse_check(fed[i].body, fed[i].len, &tokens, why, sizeof why);
        if (!fin) fail_msg("fed stream %d: %s", i, why);
        json_decref(fin);
        char *got = events_digest(fed[i].body, fed[i].len);
        assert_string_equal(got, want);
        free(got);
        tc_free(&fed[i]);
    }
    free(want);
    tc_free(&dr);
    pair_stop(&s);
}

/* ---- many streams over the feeds ------------------------------------------------ */

#define DEMUX 32

static void many_streams_on_feeds_each_get_only_their_own_events(void **state) {
    (void)state;
    pair s;
    pair_start(&s);
    assert_true(wait_feeds(s.r, LOOPS, 10000));
    static async_post a[DEMUX];
    static char bodies[DEMUX][256];
    char base[64];
    snprintf(base, sizeof base, "http://127.0.0.1:%u", (unsigned)pd_router_port(s.r));
    for (int i = 0; i < DEMUX; i++) {
        snprintf(bodies[i], sizeof bodies[i],
                 "{\"text\": \"prompt number %d\", \"rid\": \"demux-%d\", \"stream\": true, "
                 "\"sampling_params\": {\"max_new_tokens\": %d, \"ignore_eos\": true}}",
                 i, i, 8 + i % 8);
        post_start(&a[i], base, "/generate", bodies[i]);
    }
    for (int i = 0; i < DEMUX; i++) {
        post_join(&a[i]);
        char rid[32];
        snprintf(rid, sizeof rid, "demux-%d", i);
        assert_own_stream(&a[i].resp, rid);
        tc_free(&a[i].resp);
    }
    assert_int_equal(router_counter(s.r, "streams_fed"), DEMUX);
    assert_true(wait_idle_clean(s.d_url, 10000));
    pair_stop(&s);
}

/* The OpenAI routes' streams go through the feeds too, in their shape. */
static void openai_streams_go_through_the_feeds_too(void **state) {
    (void)state;
    pair s;
    pair_start(&s);
    assert_true(wait_feeds(s.r, LOOPS, 10000));
    static const struct {
        const char *path, *body, *object;
    } cases[] = {
        {"/v1/completions",
         "{\"prompt\": \"hello\", \"max_tokens\": 6, \"stream\": true, \"rid\": \"oa-1\"}",
         "\"object\":\"text_completion\""},
        {"/v1/chat/completions",
         "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 6, "
         "\"stream\": true, \"rid\": \"oa-2\"}",
         "\"object\":\"chat.completion.chunk\""},
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(cases); i++) {
        char url[128];
        tc_response resp;
        tc_request("POST", tk_url(s.r, cases[i].path, url, sizeof url), cases[i].body, TIMEOUT_MS,
                   &resp);
        assert_int_equal(resp.status, 200);
        char why[256] = "";
        size_t tokens = 0;
        json_t *fin = tc_sse_check(resp.body, resp.len, &tokens, why, sizeof why);
        if (!fin) fail_msg("%s: %s", cases[i].path, why);
        json_decref(fin);
        assert_non_null(strstr(resp.body, cases[i].object));
        tc_free(&resp);
    }
    assert_int_equal(router_counter(s.r, "streams_fed"), 2);
    assert_true(wait_idle_clean(s.d_url, 10000));
    pair_stop(&s);
}

/* ---- a feed that drops ------------------------------------------------------------ */

#define LONG_STREAMS 8
static const char *LONG = "\"sampling_params\": {\"max_new_tokens\": 4000, \"ignore_eos\": true}";
/* Long enough that a stream cut for falling behind is cut well before its
 * end, on a loaded machine too. */
static const char *VERY_LONG =
    "\"sampling_params\": {\"max_new_tokens\": 16000, \"ignore_eos\": true}";

/* Reads fd to its end; true when the peer closed it within timeout_ms. */
static bool drain_to_eof(int fd, int timeout_ms) {
    uint64_t until = tk_now_ms() + (uint64_t)timeout_ms;
    char buf[65536];
    while (tk_now_ms() < until) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 100) <= 0) continue;
        ssize_t k = read(fd, buf, sizeof buf);
        if (k <= 0) return true;
    }
    return false;
}

/* The node closes its feeds mid-stream: each client gets one error event
 * and [DONE], both nodes end idle and clean, and the router reopens. */
static void a_feed_closed_by_the_node_ends_each_stream_with_one_error(void **state) {
    (void)state;
    pair s;
    pair_start(&s);
    assert_true(wait_feeds(s.r, LOOPS, 10000));
    static async_post a[LONG_STREAMS];
    static char bodies[LONG_STREAMS][256];
    char base[64];
    snprintf(base, sizeof base, "http://127.0.0.1:%u", (unsigned)pd_router_port(s.r));
    for (int i = 0; i < LONG_STREAMS; i++) {
        snprintf(bodies[i], sizeof bodies[i], "{\"text\": \"long %d\", \"stream\": true, %s}", i,
                 LONG);
        post_start(&a[i], base, "/generate", bodies[i]);
    }
    uint64_t until = tk_now_ms() + 10000;
    while (node_counter(s.d_url, "decode_tokens") < 4 * LONG_STREAMS && tk_now_ms() < until)
        tk_sleep_ms(10);
    node_close_stream_feeds(s.d);
    for (int i = 0; i < LONG_STREAMS; i++) {
        post_join(&a[i]);
        assert_int_equal(a[i].resp.status, 200);
        char why[256] = "";
        size_t tokens = 0;
        json_t *fin = tc_sse_check(a[i].resp.body, a[i].resp.len, &tokens, why, sizeof why);
        if (!fin) fail_msg("stream %d: %s", i, why);
        const char *msg = tc_error_message(fin, 502);
        if (!msg || !strstr(msg, "stream feed closed"))
            fail_msg("stream %d did not end with the feed's error: %.300s", i, a[i].resp.body);
        json_decref(fin);
        tc_free(&a[i].resp);
    }
    assert_true(wait_idle_clean(s.d_url, 10000));
    assert_true(wait_idle_clean(s.p_url, 10000));
    assert_true(node_counter(s.d_url, "aborted") >= LONG_STREAMS);
    assert_true(wait_feeds(s.r, LOOPS, 10000)); /* reopened */
    pair_stop(&s);
}

/* A raw GET /stream_feed to the node: the fd, its id in id_out. */
static int feed_open_raw(pd_node *n, char *id_out, size_t cap) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(pd_node_http_port(n))};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    PD_ASSERT(connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    const char *req = "GET /stream_feed HTTP/1.1\r\nHost: node\r\n\r\n";
    PD_ASSERT(write(fd, req, strlen(req)) == (ssize_t)strlen(req));
    char head[2048] = "";
    size_t len = 0;
    while (len + 1 < sizeof head && !strstr(head, "\r\n\r\n")) {
        ssize_t k = read(fd, head + len, 1); /* the head only: frames come later */
        PD_ASSERT(k == 1);
        head[++len] = '\0';
    }
    assert_non_null(strstr(head, " 200 "));
    const char *v = strstr(head, "X-Stream-Feed: ");
    assert_non_null(v);
    v += 15;
    size_t n_id = strcspn(v, "\r\n");
    PD_ASSERT(n_id < cap);
    memcpy(id_out, v, n_id);
    id_out[n_id] = '\0';
    return fd;
}

/* The feed's consumer dies mid-stream (a router killed): the node aborts
 * the requests on it and ends idle and clean. */
static void a_feed_whose_consumer_dies_aborts_its_requests(void **state) {
    (void)state;
    pair s;
    pair_start(&s);
    char id[64];
    int fd = feed_open_raw(s.d, id, sizeof id);
    char pbody[512], dbody[640];
    const char *boot = "\"bootstrap_host\": \"127.0.0.1\", \"bootstrap_room\": 777";
    snprintf(pbody, sizeof pbody,
             "{\"text\": \"x\", \"rid\": \"dies\", %s, \"bootstrap_port\": %u, %s}", boot,
             pd_node_bootstrap_port(s.p), LONG);
    snprintf(
        dbody, sizeof dbody,
        "{\"text\": \"x\", \"rid\": \"dies\", %s, \"bootstrap_port\": %u, %s, \"stream\": true, "
        "\"stream_feed\": \"%s\", \"stream_feed_tag\": \"t-1\"}",
        boot, pd_node_bootstrap_port(s.p), LONG, id);
    async_post pa, da;
    post_start(&da, s.d_url, "/generate", dbody);
    post_start(&pa, s.p_url, "/generate", pbody);
    post_join(&da);
    assert_int_equal(da.resp.status, 202);
    json_t *acc = tc_json(&da.resp);
    assert_string_equal(json_string_value(json_object_get(acc, "rid")), "dies");
    assert_string_equal(json_string_value(json_object_get(acc, "stream_feed")), id);
    json_decref(acc);
    assert_true(tc_raw_read_until(fd, "id: t-1\ndata: {", 10000));
    long long aborted = node_counter(s.d_url, "aborted");
    close(fd);
    post_join(&pa);
    assert_true(wait_idle_clean(s.d_url, 10000));
    assert_true(wait_idle_clean(s.p_url, 10000));
    assert_int_equal(node_counter(s.d_url, "aborted"), aborted + 1);
    tc_free(&da.resp);
    tc_free(&pa.resp);
    pair_stop(&s);
}

/* A feed whose consumer stops reading: the node's output for it stays
 * bounded (back-pressure, then the write deadline closes the feed) and its
 * requests are aborted; the node ends idle and clean. */
static void a_feed_nobody_reads_is_closed_and_its_requests_aborted(void **state) {
    (void)state;
    pair s;
    pair_start_with(&s, 1500);
    char id[64];
    int fd = feed_open_raw(s.d, id, sizeof id); /* never read again */
    static async_post pa[4], da[4];
    static char pb[4][512], db[4][640];
    for (int i = 0; i < 4; i++) {
        const char *fmt =
            "{\"text\": \"slow reader %d\", \"rid\": \"slow-%d\", \"bootstrap_host\": "
            "\"127.0.0.1\", \"bootstrap_room\": %d, \"bootstrap_port\": %u, %s%s}";
        char feed[128];
        snprintf(feed, sizeof feed, ", \"stream\": true, \"stream_feed\": \"%s\"", id);
        snprintf(pb[i], sizeof pb[i], fmt, i, i, 500 + i, pd_node_bootstrap_port(s.p), VERY_LONG,
                 "");
        snprintf(db[i], sizeof db[i], fmt, i, i, 500 + i, pd_node_bootstrap_port(s.p), VERY_LONG,
                 feed);
        post_start(&da[i], s.d_url, "/generate", db[i]);
        post_start(&pa[i], s.p_url, "/generate", pb[i]);
    }
    for (int i = 0; i < 4; i++) {
        post_join(&da[i]);
        post_join(&pa[i]);
        assert_int_equal(da[i].resp.status, 202);
        tc_free(&da[i].resp);
        tc_free(&pa[i].resp);
    }
    assert_true(wait_idle_clean(s.d_url, 60000));
    assert_true(wait_idle_clean(s.p_url, 10000));
    assert_int_equal(node_counter(s.d_url, "aborted"), 4); /* none ran to its end */
    assert_true(drain_to_eof(fd, 20000));                  /* the node closed the feed */
    close(fd);
    pair_stop(&s);
}

/* A POST /generate from a client that never reads, with a small receive
 * buffer so the router's output to it stays blocked for good once its
 * watermark is reached (the kernel takes no more). */
static int post_never_read(uint16_t port, const char *body) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    int small = 4096;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    PD_ASSERT(connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    char req[1024];
    int n = snprintf(req, sizeof req,
                     "POST /generate HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\n\r\n%s",
                     strlen(body), body);
    PD_ASSERT(write(fd, req, (size_t)n) == n);
    return fd;
}

/* A client of a fed stream that stops reading cannot stall the feed: the
 * streams beside it on the same feeds end normally, and it is cut (both
 * halves aborted) once it is further behind than the router buffers. */
static void a_slow_client_does_not_stall_the_streams_on_its_feed(void **state) {
    (void)state;
    pair s;
    pair_start(&s);
    assert_true(wait_feeds(s.r, LOOPS, 10000));
    char body[256];
    snprintf(body, sizeof body, "{\"text\": \"slow\", \"rid\": \"slow-1\", \"stream\": true, %s}",
             VERY_LONG);
    int fd = post_never_read(pd_router_port(s.r), body);
    async_post a[LOOPS]; /* one per loop: one of them shares the slow one's feed */
    char base[64];
    snprintf(base, sizeof base, "http://127.0.0.1:%u", (unsigned)pd_router_port(s.r));
    static char bodies[LOOPS][256];
    for (int i = 0; i < LOOPS; i++) {
        snprintf(bodies[i], sizeof bodies[i],
                 "{\"text\": \"beside %d\", \"rid\": \"beside-%d\", \"stream\": true, "
                 "\"sampling_params\": {\"max_new_tokens\": 300, \"ignore_eos\": true}}",
                 i, i);
        post_start(&a[i], base, "/generate", bodies[i]);
    }
    for (int i = 0; i < LOOPS; i++) {
        post_join(&a[i]);
        char rid[32];
        snprintf(rid, sizeof rid, "beside-%d", i);
        assert_own_stream(&a[i].resp, rid);
        assert_non_null(strstr(a[i].resp.body, "\"length\""));
        tc_free(&a[i].resp);
    }
    assert_true(wait_idle_clean(s.d_url, 60000));
    assert_true(wait_idle_clean(s.p_url, 10000));
    assert_int_equal(node_counter(s.d_url, "aborted"), 1);
    close(fd);
    pair_stop(&s);
}

/* A client that hangs up mid-stream: both nodes are told, both end idle
 * and clean, the decode node's request aborted. */
static void a_client_hang_up_on_a_fed_stream_aborts_both_halves(void **state) {
    (void)state;
    pair s;
    pair_start(&s);
    assert_true(wait_feeds(s.r, LOOPS, 10000));
    char body[256];
    snprintf(body, sizeof body, "{\"text\": \"bye\", \"rid\": \"gone-1\", \"stream\": true, %s}",
             LONG);
    int fd = tc_raw_post(pd_router_port(s.r), "/generate", body);
    assert_true(tc_raw_read_until(fd, "data: {", 10000));
    close(fd);
    assert_true(wait_idle_clean(s.d_url, 10000));
    assert_true(wait_idle_clean(s.p_url, 10000));
    assert_int_equal(node_counter(s.d_url, "aborted"), 1);
    assert_true(tk_wait_idle(s.r, 10000));
    assert_int_equal(router_counter(s.r, "streams_fed"), 1);
    assert_int_equal(router_counter(s.r, "client_disconnects"), 1);
    pair_stop(&s);
}

/* ---- workers without feeds, bad input ------------------------------------------- */

static void a_worker_without_stream_feed_keeps_the_direct_path(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    pd_router *r = tk_router(&p, 1, &d, 1, NULL);
    char url[128];
    tc_response resp;
    tc_request("POST", tk_url(r, "/generate", url, sizeof url),
               "{\"text\": \"hi\", \"rid\": \"plain-1\", \"stream\": true}", TIMEOUT_MS, &resp);
    assert_own_stream(&resp, "plain-1");
    tc_free(&resp);
    assert_int_equal(feeds_open(r), 0);
    assert_int_equal(router_counter(r, "streams_fed"), 0);
    json_t *b = fw_generate_body(d, 0);
    assert_null(json_object_get(b, "stream_feed"));
    json_decref(b);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

static void expect_error(const char *base, const char *method, const char *path, const char *body,
                         long status, const char *needle) {
    char url[256];
    snprintf(url, sizeof url, "%s%s", base, path);
    tc_response resp;
    tc_request(method, url, body, TIMEOUT_MS, &resp);
    json_t *o = tc_json(&resp);
    const char *msg = tc_error_message(o, status);
    if (resp.status != status || !msg || !strstr(msg, needle))
        fail_msg("%s %s: %ld %.*s (wanted %ld naming '%s')", method, path, resp.status,
                 (int)resp.len, resp.body, status, needle);
    json_decref(o);
    tc_free(&resp);
}

static void bad_feed_input_gets_a_clear_4xx(void **state) {
    (void)state;
    pair s;
    pair_start(&s);
    expect_error(s.d_url, "POST", "/stream_feed", "{}", 405, "GET");
    expect_error(s.d_url, "GET", "/stream_feed?x=1", NULL, 400, "no query");
    char body[512];
    const char *fmt = "{\"text\": \"x\", \"bootstrap_host\": \"127.0.0.1\", \"bootstrap_room\": 9, "
                      "\"bootstrap_port\": %u, %s}";
    snprintf(body, sizeof body, fmt, pd_node_bootstrap_port(s.p),
             "\"stream\": true, \"stream_feed\": \"9999.77\"");
    expect_error(s.d_url, "POST", "/generate", body, 400, "unknown stream_feed '9999.77'");
    snprintf(body, sizeof body, fmt, pd_node_bootstrap_port(s.p),
             "\"stream\": true, \"stream_feed\": 5");
    expect_error(s.d_url, "POST", "/generate", body, 400, "'stream_feed' must be a string");
    snprintf(body, sizeof body, fmt, pd_node_bootstrap_port(s.p), "\"stream_feed\": \"0.1\"");
    expect_error(s.d_url, "POST", "/generate", body, 400, "needs \"stream\": true");
    char id[64];
    int fd = feed_open_raw(s.d, id, sizeof id);
    char more[160];
    snprintf(more, sizeof more,
             "\"stream\": true, \"stream_feed\": \"%s\", "
             "\"stream_feed_tag\": \"a b\"",
             id);
    snprintf(body, sizeof body, fmt, pd_node_bootstrap_port(s.p), more);
    expect_error(s.d_url, "POST", "/generate", body, 400, "stream_feed_tag");
    close(fd);
    assert_true(wait_idle_clean(s.d_url, 10000));
    pair_stop(&s);
}

int main(void) {
    curl_global_init(CURL_GLOBAL_DEFAULT);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(a_stream_through_a_feed_has_the_direct_streams_events),
        cmocka_unit_test(many_streams_on_feeds_each_get_only_their_own_events),
        cmocka_unit_test(openai_streams_go_through_the_feeds_too),
        cmocka_unit_test(a_feed_closed_by_the_node_ends_each_stream_with_one_error),
        cmocka_unit_test(a_feed_whose_consumer_dies_aborts_its_requests),
        cmocka_unit_test(a_client_hang_up_on_a_fed_stream_aborts_both_halves),
        cmocka_unit_test(a_feed_nobody_reads_is_closed_and_its_requests_aborted),
        cmocka_unit_test(a_slow_client_does_not_stall_the_streams_on_its_feed),
        cmocka_unit_test(a_worker_without_stream_feed_keeps_the_direct_path),
        cmocka_unit_test(bad_feed_input_gets_a_clear_4xx),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    curl_global_cleanup();
    return rc;
}
