/* The HTTP server (src/http/server.c) over real sockets on 127.0.0.1: answers,
 * keep-alive and pipelining; every refusal the server makes itself comes as
 * the project's JSON error and ends the connection; deadlines against
 * slowloris; the per-address and total caps; answers streamed from another
 * thread (chunked, decoded here); back-pressure; a client hanging up
 * mid-stream; stop() with connections open.
 *
 * The client side is raw sockets on purpose: a library client would hide
 * the framing under test. Every read has a 10 s timeout so a bug fails the
 * test instead of hanging it. The only timing the tests rely on are the
 * deliberately short deadlines (300 ms), met or missed by wide margins. */
#define _GNU_SOURCE /* memmem */
#include <arpa/inet.h>
#include <errno.h>
#include <jansson.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "../test_util.h"
#include "pdserve/http.h"
#include "pdserve/http_server.h"

#define READ_TIMEOUT_S 10
#define HELD_MAX 8

/* ---- the server side: a handler with a few routes ------------------------------ */

/* Requests the handler keeps for the test to answer, and the events seen. */
typedef struct held {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pd_http_req *req[HELD_MAX];
    unsigned n, gone, writable;
} held;

static held H = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, {0}, 0, 0, 0};

static void on_watch(pd_http_req *r, pd_http_req_event ev, void *user) {
    (void)r;
    (void)user;
    pthread_mutex_lock(&H.mu);
    if (ev == PD_HTTP_REQ_GONE) H.gone++;
    else H.writable++;
    pthread_cond_broadcast(&H.cv);
    pthread_mutex_unlock(&H.mu);
}

static unsigned held_writable(void) {
    pthread_mutex_lock(&H.mu);
    unsigned n = H.writable;
    pthread_mutex_unlock(&H.mu);
    return n;
}

static void hold(pd_http_req *r) {
    pd_http_req_retain(r);
    pd_http_req_watch(r, on_watch, NULL);
    pthread_mutex_lock(&H.mu);
    assert_true(H.n < HELD_MAX);
    H.req[H.n++] = r;
    pthread_cond_broadcast(&H.cv);
    pthread_mutex_unlock(&H.mu);
}

/* Waits until at least n requests are held (or n GONE events, gone = true). */
static void held_wait(unsigned n, bool gone) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += READ_TIMEOUT_S;
    pthread_mutex_lock(&H.mu);
    while ((gone ? H.gone : H.n) < n)
        if (pthread_cond_timedwait(&H.cv, &H.mu, &until) == ETIMEDOUT) break;
    unsigned got = gone ? H.gone : H.n;
    pthread_mutex_unlock(&H.mu);
    assert_true(got >= n);
}

static void held_release_all(void) {
    pthread_mutex_lock(&H.mu);
    for (unsigned i = 0; i < H.n; i++) pd_http_req_release(H.req[i]);
    H.n = H.gone = H.writable = 0;
    pthread_mutex_unlock(&H.mu);
}

static void respond_echo(pd_http_req *r) {
    size_t len;
    const char *body = pd_http_req_body(r, &len);
    const char *host = pd_http_req_header(r, "HOST");
    json_t *o = json_pack("{s:s, s:s, s:s, s:s%, s:s, s:i}", "method", pd_http_req_method(r),
                          "path", pd_http_req_path(r), "query", pd_http_req_query(r), "body", body,
                          len, "host", host ? host : "", "minor",
                          (int)pd_http_req_version_minor(r));
    char *text = json_dumps(o, JSON_COMPACT);
    assert_ok(pd_http_req_respond_json(r, 200, text, strlen(text)));
    free(text);
    json_decref(o);
}

/* A stream answered from its own thread: five chunks, then the end. */
static void *stream_thread(void *arg) {
    pd_http_req *r = arg;
    assert_ok(pd_http_req_stream_begin(r, 200, "text/plain"));
    char chunk[32];
    for (int i = 0; i < 5; i++) {
        snprintf(chunk, sizeof chunk, "chunk %d;", i);
        assert_ok(pd_http_req_stream_write(r, chunk, strlen(chunk)));
    }
    assert_ok(pd_http_req_stream_end(r));
    assert_err(pd_http_req_stream_write(r, "x", 1), PD_ERR_STATE);
    pd_http_req_release(r);
    return NULL;
}

/* Writes a chunk every 5 ms until the client is gone (at most 10 s). */
static pthread_t forever_thread;
static atomic_int forever_result;

static void *forever(void *arg) {
    pd_http_req *r = arg;
    pd_err err = pd_http_req_stream_begin(r, 200, "text/plain");
    for (int i = 0; i < 2000 && err == PD_OK; i++) {
        err = pd_http_req_stream_write(r, "chunk;", 6);
        struct timespec ts = {.tv_nsec = 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    atomic_store(&forever_result, (int)err);
    pd_http_req_release(r);
    return NULL;
}

static void on_request(pd_http_req *r, void *user) {
    (void)user;
    const char *path = pd_http_req_path(r);
    if (!strcmp(path, "/hold")) {
        hold(r);
    } else if (!strcmp(path, "/stream")) {
        pthread_t t;
        pd_http_req_retain(r);
        assert_int_equal(pthread_create(&t, NULL, stream_thread, r), 0);
        pthread_detach(t);
    } else if (!strcmp(path, "/forever")) {
        pd_http_req_retain(r);
        pd_http_req_watch(r, on_watch, NULL);
        assert_int_equal(pthread_create(&forever_thread, NULL, forever, r), 0);
    } else if (!strcmp(path, "/empty")) {
        assert_ok(pd_http_req_respond(r, 204, NULL, NULL, 0));
    } else if (!strncmp(path, "/echo", 5) || !strcmp(path, "/a b/c")) {
        respond_echo(r);
    } else {
        assert_ok(pd_http_req_add_header(r, "X-Test", "yes"));
        assert_ok(pd_http_req_respond_error(r, 404, "unknown path %s", path));
    }
}

static pd_http_server_config test_config(void) {
    pd_http_server_config c;
    pd_http_server_config_default(&c);
    c.port = 0;
    c.on_request = on_request;
    return c;
}

static pd_http_server *start(const pd_http_server_config *c) {
    pd_http_server *s = NULL;
    char msg[256] = "";
    pd_err err = pd_http_server_start(&s, c, msg, sizeof msg);
    if (err != PD_OK) fail_msg("start: %s", msg);
    assert_true(pd_http_server_port(s) != 0);
    return s;
}

/* ---- the client side ---------------------------------------------------------------- */

typedef struct client {
    int fd;
    char *buf;
    size_t len, cap;
} client;

typedef struct response {
    int status;
    char head[8192]; /* the header block, NUL-terminated */
    char *body;
    size_t body_len;
    bool chunked;
} response;

static int connect_from(const char *from, uint16_t port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct timeval tv = {.tv_sec = READ_TIMEOUT_S};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    struct sockaddr_in a = {.sin_family = AF_INET};
    if (from) {
        inet_pton(AF_INET, from, &a.sin_addr);
        assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    }
    a.sin_port = htons(port);
    inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
    assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
    return fd;
}

static client dial(const pd_http_server *s) {
    return (client){.fd = connect_from(NULL, pd_http_server_port(s))};
}

static void hang_up(client *c) {
    if (c->fd >= 0) close(c->fd);
    free(c->buf);
    *c = (client){.fd = -1};
}

static void send_bytes(client *c, const char *p, size_t n) {
    while (n > 0) {
        ssize_t w = send(c->fd, p, n, MSG_NOSIGNAL);
        assert_true(w > 0);
        p += w;
        n -= (size_t)w;
    }
}

static void send_str(client *c, const char *s) { send_bytes(c, s, strlen(s)); }

/* Reads more into the buffer: bytes read, 0 at the end (or a reset). */
static ssize_t fill(client *c) {
    if (c->cap - c->len < 4096) {
        c->cap = c->cap ? c->cap * 2 : 65536;
        c->buf = realloc(c->buf, c->cap);
        assert_non_null(c->buf);
    }
    ssize_t n = recv(c->fd, c->buf + c->len, c->cap - c->len - 1, 0);
    if (n < 0 && errno == ECONNRESET) n = 0;
    if (n < 0) fail_msg("recv: %s (timed out?)", strerror(errno));
    c->len += (size_t)n;
    c->buf[c->len] = '\0';
    return n;
}

static bool need(client *c, size_t n) {
    while (c->len < n)
        if (fill(c) == 0) return false;
    return true;
}

static void take(client *c, size_t n, char *out) {
    if (out) memcpy(out, c->buf, n);
    memmove(c->buf, c->buf + n, c->len - n);
    c->len -= n;
}

static char *find_crlf(client *c, const char *what) {
    for (;;) {
        if (c->buf) {
            c->buf[c->len] = '\0';
            char *e = memmem(c->buf, c->len, what, strlen(what));
            if (e) return e;
        }
        if (fill(c) == 0) return NULL;
    }
}

/* The value of a header in a response head, or NULL (copied into out). */
static const char *head_value(const response *r, const char *name, char *out, size_t cap) {
    size_t n = strlen(name);
    for (const char *l = strstr(r->head, "\r\n"); l && l[2]; l = strstr(l + 2, "\r\n")) {
        if (strncasecmp(l + 2, name, n) || l[2 + n] != ':') continue;
        const char *v = l + 3 + n;
        while (*v == ' ') v++;
        size_t len = strcspn(v, "\r");
        snprintf(out, cap, "%.*s", (int)len, v);
        return out;
    }
    return NULL;
}

static bool read_chunked(client *c, response *r) {
    for (;;) {
        char *e = find_crlf(c, "\r\n");
        if (!e) return false;
        size_t size = strtoul(c->buf, NULL, 16);
        take(c, (size_t)(e - c->buf) + 2, NULL);
        if (!need(c, size + 2)) return false;
        r->body = realloc(r->body, r->body_len + size + 1);
        take(c, size, r->body + r->body_len);
        r->body_len += size;
        r->body[r->body_len] = '\0';
        assert_memory_equal(c->buf, "\r\n", 2);
        take(c, 2, NULL);
        if (size == 0) return true;
    }
}

/* Reads one response (interim 1xx ones included). False at the end of the
 * connection before a whole one. */
static bool read_response(client *c, response *r) {
    free(r->body);
    *r = (response){0};
    r->body = calloc(1, 1);
    char *e = find_crlf(c, "\r\n\r\n");
    if (!e) return false;
    size_t head_len = (size_t)(e - c->buf) + 4;
    assert_true(head_len < sizeof r->head);
    take(c, head_len, r->head);
    r->head[head_len] = '\0';
    assert_int_equal(sscanf(r->head, "HTTP/1.1 %d", &r->status), 1);
    char v[64];
    if (r->status < 200 || r->status == 204) return true;
    if (head_value(r, "Transfer-Encoding", v, sizeof v)) {
        r->chunked = true;
        return read_chunked(c, r);
    }
    if (head_value(r, "Content-Length", v, sizeof v)) {
        r->body_len = strtoul(v, NULL, 10);
    } else { /* delimited by the end of the connection */
        while (fill(c) > 0) continue;
        r->body_len = c->len;
    }
    if (!need(c, r->body_len)) return false;
    r->body = realloc(r->body, r->body_len + 1);
    take(c, r->body_len, r->body);
    r->body[r->body_len] = '\0';
    return true;
}

static void response_free(response *r) {
    free(r->body);
    r->body = NULL;
}

/* True when the server ends the connection (nothing more to read). */
static bool ends(client *c) {
    size_t before = c->len;
    while (fill(c) > 0) continue;
    return c->len == before;
}

/* The project's error shape, with the status and a part of the message. */
static void assert_error(const response *r, int status, const char *part) {
    char v[64];
    assert_int_equal(r->status, status);
    assert_non_null(head_value(r, "Content-Type", v, sizeof v));
    assert_string_equal(v, "application/json");
    json_t *o = json_loads(r->body, 0, NULL);
    if (!o) fail_msg("not JSON: %s", r->body);
    json_t *e = json_object_get(o, "error");
    assert_string_equal(json_string_value(json_object_get(e, "type")),
                        pd_http_error_type((unsigned)status));
    assert_int_equal(json_integer_value(json_object_get(e, "code")), status);
    const char *m = json_string_value(json_object_get(e, "message"));
    if (!m || !strstr(m, part)) fail_msg("message '%s' lacks '%s'", m ? m : "", part);
    json_decref(o);
}

/* The server's own refusals also say Connection: close and end it. */
static void assert_refusal(client *c, int status, const char *part) {
    response r = {0};
    if (!read_response(c, &r)) fail_msg("no response (want %d %s)", status, part);
    assert_error(&r, status, part);
    char v[64];
    assert_non_null(head_value(&r, "Connection", v, sizeof v));
    assert_string_equal(v, "close");
    assert_true(ends(c));
    response_free(&r);
}

static json_t *echo_of(const response *r) {
    assert_int_equal(r->status, 200);
    json_t *o = json_loads(r->body, 0, NULL);
    if (!o) fail_msg("not JSON: %s", r->body);
    return o;
}

static const char *field(json_t *o, const char *name) {
    return json_string_value(json_object_get(o, name));
}

/* ---- answers, keep-alive, pipelining ------------------------------------------------ */

static void a_request_gets_its_answer(void **state) {
    (void)state;
    pd_http_server_config cfg = test_config();
    pd_http_server *s = start(&cfg);
    client c = dial(s);
    send_str(&c, "POST /echo?x=1&y=%20 HTTP/1.1\r\nHost: here\r\nContent-Length: 5\r\n\r\nhello");
    response r = {0};
    assert_true(read_response(&c, &r));
    char v[64];
    assert_string_equal(head_value(&r, "Content-Type", v, sizeof v), "application/json");
    assert_non_null(head_value(&r, "Date", v, sizeof v));
    json_t *o = echo_of(&r);
    assert_string_equal(field(o, "method"), "POST");
    assert_string_equal(field(o, "path"), "/echo");
    assert_string_equal(field(o, "query"), "x=1&y=%20");
    assert_string_equal(field(o, "body"), "hello");
    assert_string_equal(field(o, "host"), "here");
    json_decref(o);
    /* The path is percent-decoded; a stray '%' stays as it is. */
    send_str(&c,
             "GET /a%20b%2fc HTTP/1.1\r\nHost: h\r\n\r\nGET /echo%zz HTTP/1.1\r\nHost: h\r\n\r\n");
    assert_true(read_response(&c, &r));
    o = echo_of(&r);
    assert_string_equal(field(o, "path"), "/a b/c");
    json_decref(o);
    assert_true(read_response(&c, &r));
    o = echo_of(&r);
    assert_string_equal(field(o, "path"), "/echo%zz");
    json_decref(o);
    /* Unknown path: the handler's error, with its extra header. */
    send_str(&c, "GET /nowhere HTTP/1.1\r\nHost: h\r\n\r\n");
    assert_true(read_response(&c, &r));
    assert_error(&r, 404, "unknown path /nowhere");
    assert_string_equal(head_value(&r, "X-Test", v, sizeof v), "yes");
    response_free(&r);
    hang_up(&c);
    pd_http_server_stop(s);
}

static void keep_alive_and_pipelining_answer_in_order(void **state) {
    (void)state;
    pd_http_server_config cfg = test_config();
    pd_http_server *s = start(&cfg);
    client c = dial(s);
    response r = {0};
    for (int i = 0; i < 2; i++) { /* two in turn on one connection */
        send_str(&c, "GET /echo HTTP/1.1\r\nHost: h\r\n\r\n");
        assert_true(read_response(&c, &r));
        assert_int_equal(r.status, 200);
    }
    /* Five in one write, bodies chunked and not, a 204 among them. */
    send_str(&c,
             "POST /echo1 HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\n\r\na"
             "POST /echo2 HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
             "2;ext=1\r\nbc\r\n0\r\nTrailer-X: 1\r\n\r\n"
             "GET /empty HTTP/1.1\r\nHost: h\r\n\r\n"
             "HEAD /echo4 HTTP/1.1\r\nHost: h\r\n\r\n"
             "GET /echo5 HTTP/1.1\r\nHost: h\r\n\r\n");
    const char *paths[] = {"/echo1", "/echo2", NULL, NULL, "/echo5"};
    const char *bodies[] = {"a", "bc", NULL, NULL, ""};
    for (int i = 0; i < 5; i++) {
        if (i == 3) { /* HEAD: the head alone, with the length a GET would have */
            char *e = find_crlf(&c, "\r\n\r\n");
            assert_non_null(e);
            assert_int_equal(strncmp(c.buf, "HTTP/1.1 200", 12), 0);
            take(&c, (size_t)(e - c.buf) + 4, NULL);
            continue;
        }
        assert_true(read_response(&c, &r));
        if (!paths[i]) {
            assert_int_equal(r.status, 204);
            continue;
        }
        json_t *o = echo_of(&r);
        assert_string_equal(field(o, "path"), paths[i]);
        assert_string_equal(field(o, "body"), bodies[i]);
        json_decref(o);
    }
    response_free(&r);
    hang_up(&c);
    pd_http_server_stop(s);
}

static void http10_is_served_and_closed_unless_kept_alive(void **state) {
    (void)state;
    pd_http_server_config cfg = test_config();
    pd_http_server *s = start(&cfg);
    client c = dial(s);
    response r = {0};
    char v[64];
    send_str(&c, "GET /echo HTTP/1.0\r\nConnection: keep-alive\r\n\r\n");
    assert_true(read_response(&c, &r));
    assert_string_equal(head_value(&r, "Connection", v, sizeof v), "keep-alive");
    json_t *o = echo_of(&r);
    assert_int_equal(json_integer_value(json_object_get(o, "minor")), 0);
    json_decref(o);
    send_str(&c, "GET /echo HTTP/1.0\r\n\r\n");
    assert_true(read_response(&c, &r));
    assert_string_equal(head_value(&r, "Connection", v, sizeof v), "close");
    assert_true(ends(&c));
    hang_up(&c);
    /* Expect: 100-continue gets the interim answer before the body is sent. */
    c = dial(s);
    send_str(&c,
             "POST /echo HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\n"
             "Content-Length: 2\r\n\r\n");
    assert_true(read_response(&c, &r));
    assert_int_equal(r.status, 100);
    send_str(&c, "ok");
    assert_true(read_response(&c, &r));
    o = echo_of(&r);
    assert_string_equal(field(o, "body"), "ok");
    json_decref(o);
    response_free(&r);
    hang_up(&c);
    pd_http_server_stop(s);
}

/* ---- refusals ------------------------------------------------------------------------ */

typedef struct refusal {
    const char *request;
    size_t len; /* 0: strlen */
    int status;
    const char *part;
} refusal;

#define RAW(s) s, sizeof(s) - 1

static const refusal refusals[] = {
    {"GET / HTTP/1.1\r\nHost: h\r\nBad Header\r\n\r\n", 0, 400, "malformed request"},
    {"GET / HTTP/1.1\r\nHost: h\nX: y\r\n\r\n", 0, 400, "malformed request"},
    {"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 3x\r\n\r\nabc", 0, 400,
     "Invalid character in Content-Length"},
    {"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 99999999999999999999999\r\n\r\n", 0, 400,
     "Content-Length overflow"},
    {"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 0, 400,
     "malformed request"},
    {"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: gzip\r\n\r\nab", 0, 400,
     "Transfer-Encoding"},
    {"GET /\r\n\r\n", 0, 505, "HTTP/0.9"},
    {"GET / HTTP/2.0\r\n\r\n", 0, 505, "HTTP/2.0"},
    {"GET / HTTP/1.2\r\nHost: h\r\n\r\n", 0, 505, "unsupported HTTP version"},
    {"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nContent-Length: 1\r\n\r\na", 0, 400,
     "two Content-Length"},
    {"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\nContent-Length: 1\r\n\r\n", 0,
     400, "Transfer-Encoding together with Content-Length"},
    {"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", 0,
     400, "Transfer-Encoding together with Content-Length"},
    {"POST / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 0, 400,
     "Transfer-Encoding in an HTTP/1.0 request"},
    {"GET / HTTP/1.1\r\n\r\n", 0, 400, "without Host"},
    {"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 0, 400, "two Host"},
    {"GET /generate%00x HTTP/1.1\r\nHost: h\r\n\r\n", 0, 400, "%00"},
    {RAW("GET /generate\0x HTTP/1.1\r\nHost: h\r\n\r\n"), 400, "malformed request"},
    {"GET http://h/x HTTP/1.1\r\nHost: h\r\n\r\n", 0, 400, "must be a path"},
    {"BREW / HTTP/1.1\r\nHost: h\r\n\r\n", 0, 400, "malformed request"},
    {"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1025\r\n\r\n", 0, 413, "1025 bytes"},
    {"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n800\r\n", 0, 413,
     "over the limit of 1024"},
};

static void every_refusal_is_json_and_ends_the_connection(void **state) {
    (void)state;
    pd_http_server_config cfg = test_config();
    cfg.body_bytes_max = 1024;
    pd_http_server *s = start(&cfg);
    for (size_t i = 0; i < PD_ARRAY_LEN(refusals); i++) {
        const refusal *f = &refusals[i];
        client c = dial(s);
        send_bytes(&c, f->request, f->len ? f->len : strlen(f->request));
        if (f->status == 413 && strstr(f->request, "chunked")) { /* the body grows over */
            char kb[1024];
            memset(kb, 'x', sizeof kb);
            send_bytes(&c, kb, sizeof kb);
            send_bytes(&c, kb, sizeof kb);
        }
        print_message("refusal %zu: %d %s\n", i, f->status, f->part);
        assert_refusal(&c, f->status, f->part);
        hang_up(&c);
    }
    pd_http_server_stop(s);
}

static void header_block_over_its_limits_is_431(void **state) {
    (void)state;
    pd_http_server_config cfg = test_config();
    cfg.header_bytes_max = 1024;
    cfg.headers_max = 8;
    pd_http_server *s = start(&cfg);
    client c = dial(s);
    char big[2048];
    memset(big, 'a', sizeof big);
    send_str(&c, "GET / HTTP/1.1\r\nHost: h\r\nX-Big: ");
    send_bytes(&c, big, sizeof big); /* never ends its line */
    assert_refusal(&c, 431, "over the limit of 1024 bytes");
    hang_up(&c);
    c = dial(s);
    for (int i = 0; i < 9; i++) send_str(&c, i == 0 ? "GET / HTTP/1.1\r\nH0: v\r\n" : "Hn: v\r\n");
    send_str(&c, "\r\n");
    assert_refusal(&c, 431, "more than 8 header fields");
    hang_up(&c);
    /* Exactly at the limits is fine. */
    c = dial(s);
    char req[1024];
    int n = snprintf(req, sizeof req, "GET /echo HTTP/1.1\r\nHost: h\r\nX: ");
    memset(req + n, 'v', sizeof req - (size_t)n - 4);
    memcpy(req + sizeof req - 4, "\r\n\r\n", 4);
    send_bytes(&c, req, sizeof req);
    response r = {0};
    assert_true(read_response(&c, &r));
    assert_int_equal(r.status, 200);
    response_free(&r);
    hang_up(&c);
    pd_http_server_stop(s);
}

/* ---- deadlines ------------------------------------------------------------------------- */

/* Sends one byte of `bytes` every 50 ms until the server has something to
 * say (true) or 5 s have passed (false). */
static bool trickle(client *c, const char *bytes) {
    size_t n = strlen(bytes);
    for (int i = 0; i < 100; i++) {
        struct pollfd p = {.fd = c->fd, .events = POLLIN};
        if (poll(&p, 1, 50) > 0) return true;
        send(c->fd, bytes + (size_t)i % n, 1, MSG_NOSIGNAL);
    }
    return false;
}

static void slowloris_gets_408_at_the_deadlines(void **state) {
    (void)state;
    pd_http_server_config cfg = test_config();
    cfg.header_timeout_ms = cfg.body_timeout_ms = 300;
    pd_http_server *s = start(&cfg);
    client c = dial(s);
    send_str(&c, "GET /echo HTTP/1.1\r\nHost: h\r\nX-Slow: ");
    assert_true(trickle(&c, "abcdefgh"));
    assert_refusal(&c, 408, "header did not arrive within 300 ms");
    hang_up(&c);
    c = dial(s);
    send_str(&c, "POST /echo HTTP/1.1\r\nHost: h\r\nContent-Length: 1000\r\n\r\n");
    assert_true(trickle(&c, "body"));
    assert_refusal(&c, 408, "body did not arrive within 300 ms");
    hang_up(&c);
    /* A connection that never says a word is closed without an answer. */
    c = dial(s);
    assert_true(ends(&c));
    assert_int_equal(c.len, 0);
    hang_up(&c);
    pd_http_server_stop(s);
}

static void an_idle_keep_alive_connection_is_closed(void **state) {
    (void)state;
    pd_http_server_config cfg = test_config();
    cfg.idle_timeout_ms = 300;
    pd_http_server *s = start(&cfg);
    client c = dial(s);
    send_str(&c, "GET /echo HTTP/1.1\r\nHost: h\r\n\r\n");
    response r = {0};
    assert_true(read_response(&c, &r));
    assert_int_equal(r.status, 200);
    assert_true(ends(&c)); /* within the 10 s read timeout, after 300 ms */
    assert_int_equal(c.len, 0);
    response_free(&r);
    hang_up(&c);
    pd_http_server_stop(s);
}

/* ---- caps ---------------------------------------------------------------------------------- */

static void served(client *c) {
    send_str(c, "GET /echo HTTP/1.1\r\nHost: h\r\n\r\n");
    response r = {0};
    assert_true(read_response(c, &r));
    assert_int_equal(r.status, 200);
    response_free(&r);
}

static void caps_refuse_the_newcomer_with_503(void **state) {
    (void)state;
    pd_http_server_config cfg = test_config();
    cfg.connections_max = 3;
    cfg.connections_per_ip_max = 2;
    pd_http_server *s = start(&cfg);
    uint16_t port = pd_http_server_port(s);
    client a = dial(s), b = dial(s);
    served(&a);
    served(&b);
    client x = dial(s);
    assert_refusal(&x, 503, "too many connections from 127.0.0.1 (2)");
    hang_up(&x);
    client d = {.fd = connect_from("127.0.0.2", port)};
    served(&d);
    client y = {.fd = connect_from("127.0.0.3", port)};
    assert_refusal(&y, 503, "too many connections (3)");
    hang_up(&y);
    /* A place freed is a place taken: once the server has seen a go. */
    hang_up(&a);
    bool ok = false;
    for (int i = 0; i < 200 && !ok; i++) {
        client n = dial(s);
        send_str(&n, "GET /echo HTTP/1.1\r\nHost: h\r\n\r\n");
        response r = {0};
        assert_true(read_response(&n, &r));
        ok = r.status == 200;
        response_free(&r);
        hang_up(&n);
        struct timespec ts = {.tv_nsec = 20 * 1000 * 1000};
        if (!ok) nanosleep(&ts, NULL);
    }
    assert_true(ok);
    hang_up(&b);
    hang_up(&d);
    pd_http_server_stop(s);
}

/* ---- answers from other threads ---------------------------------------------------------- */

static void a_stream_from_another_thread_is_chunked(void **state) {
    (void)state;
    pd_http_server_config cfg = test_config();
    pd_http_server *s = start(&cfg);
    client c = dial(s);
    send_str(&c, "GET /stream HTTP/1.1\r\nHost: h\r\n\r\n");
    response r = {0};
    assert_true(read_response(&c, &r));
    assert_int_equal(r.status, 200);
    assert_true(r.chunked);
    assert_string_equal(r.body, "chunk 0;chunk 1;chunk 2;chunk 3;chunk 4;");
    served(&c); /* the connection lives on after a stream */
    hang_up(&c);
    /* HTTP/1.0 has no chunks: the end of the connection ends the body. */
    c = dial(s);
    send_str(&c, "GET /stream HTTP/1.0\r\n\r\n");
    assert_true(read_response(&c, &r));
    assert_false(r.chunked);
    char v[64];
    assert_string_equal(head_value(&r, "Connection", v, sizeof v), "close");
    assert_string_equal(r.body, "chunk 0;chunk 1;chunk 2;chunk 3;chunk 4;");
    response_free(&r);
    hang_up(&c);
    pd_http_server_stop(s);
}

static void a_client_hanging_up_mid_stream_is_gone(void **state) {
    (void)state;
    pd_http_server_config cfg = test_config();
    pd_http_server *s = start(&cfg);
    client c = dial(s);
    send_str(&c, "GET /forever HTTP/1.1\r\nHost: h\r\n\r\n");
    assert_non_null(find_crlf(&c, "chunk;"));
    hang_up(&c);
    held_wait(1, true); /* the watch saw GONE */
    assert_int_equal(pthread_join(forever_thread, NULL), 0);
    assert_int_equal(atomic_load(&forever_result), PD_ERR_STATE);
    held_release_all();
    pd_http_server_stop(s);
}

static atomic_int slow_entered, slow_left;

static void slow_watch(pd_http_req *r, pd_http_req_event ev, void *user) {
    (void)r, (void)user;
    if (ev != PD_HTTP_REQ_GONE) return;
    atomic_store(&slow_entered, 1);
    nanosleep(&(struct timespec){0, 300 * 1000000L}, NULL);
    atomic_store(&slow_left, 1);
}

/* Clearing a watch while its callback runs on the loop thread waits for
 * the callback to return: the caller may then free what the callback uses
 * (the router frees its per-request state right after). */
static void clearing_a_watch_waits_for_its_callback(void **state) {
    (void)state;
    pd_http_server_config cfg = test_config();
    pd_http_server *s = start(&cfg);
    client c = dial(s);
    send_str(&c, "GET /hold HTTP/1.1\r\nHost: h\r\n\r\n");
    held_wait(1, false);
    pd_http_req *r = H.req[0];
    atomic_store(&slow_entered, 0);
    atomic_store(&slow_left, 0);
    pd_http_req_watch(r, slow_watch, NULL);
    hang_up(&c);
    for (int i = 0; i < 10000 && !atomic_load(&slow_entered); i++)
        nanosleep(&(struct timespec){0, 1000000L}, NULL);
    assert_true(atomic_load(&slow_entered));
    pd_http_req_watch(r, NULL, NULL);
    assert_true(atomic_load(&slow_left));
    held_release_all();
    pd_http_server_stop(s);
}

/* Reads what has arrived, without waiting for it. */
static void read_available(client *c) {
    struct pollfd p = {.fd = c->fd, .events = POLLIN};
    if (poll(&p, 1, 10) > 0) fill(c);
}

static void stream_writes_are_refused_over_the_watermark(void **state) {
    (void)state;
    pd_http_server_config cfg = test_config();
    cfg.output_watermark_bytes = 64 * 1024;
    pd_http_server *s = start(&cfg);
    client c = dial(s);
    int small = 4096;
    setsockopt(c.fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    send_str(&c, "GET /hold HTTP/1.1\r\nHost: h\r\n\r\n");
    held_wait(1, false);
    pd_http_req *r = H.req[0];
    assert_ok(pd_http_req_stream_begin(r, 200, "application/octet-stream"));
    static char chunk[16 * 1024];
    memset(chunk, 'z', sizeof chunk);
    size_t sent = 0;
    pd_err err = PD_OK;
    /* The client reads nothing: the queue fills faster than the loop empties it. */
    for (int i = 0; i < 4096 && err == PD_OK; i++) {
        err = pd_http_req_stream_write(r, chunk, sizeof chunk);
        if (err == PD_OK) sent += sizeof chunk;
    }
    assert_err(err, PD_ERR_NOMEM);
    /* Reading drains it: WRITABLE comes, and writing works again. */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (t1 = t0; held_writable() == 0 && t1.tv_sec - t0.tv_sec < READ_TIMEOUT_S;)
        read_available(&c), clock_gettime(CLOCK_MONOTONIC, &t1);
    assert_int_equal(held_writable(), 1);
    assert_ok(pd_http_req_stream_write(r, chunk, 10));
    assert_ok(pd_http_req_stream_end(r));
    response resp = {0};
    assert_true(read_response(&c, &resp));
    assert_int_equal(resp.body_len, sent + 10);
    response_free(&resp);
    hang_up(&c);
    held_release_all();
    pd_http_server_stop(s);
}

static void a_client_that_stops_reading_is_cut_at_the_write_deadline(void **state) {
    (void)state;
    pd_http_server_config cfg = test_config();
    cfg.output_watermark_bytes = 64 * 1024;
    cfg.write_timeout_ms = 300;
    pd_http_server *s = start(&cfg);
    client c = dial(s);
    int small = 4096;
    setsockopt(c.fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
    send_str(&c, "GET /hold HTTP/1.1\r\nHost: h\r\n\r\n");
    held_wait(1, false);
    pd_http_req *r = H.req[0];
    assert_ok(pd_http_req_stream_begin(r, 200, NULL));
    /* Write on (waiting a moment whenever the backlog is full) until the
     * kernel's buffers are full too, nothing moves, and the deadline cuts. */
    static char chunk[16 * 1024];
    pd_err err = PD_OK;
    struct timespec t0, t1, ms = {.tv_nsec = 1000 * 1000};
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (t1 = t0; err != PD_ERR_STATE && t1.tv_sec - t0.tv_sec < READ_TIMEOUT_S;) {
        err = pd_http_req_stream_write(r, chunk, sizeof chunk);
        if (err == PD_ERR_NOMEM) nanosleep(&ms, NULL);
        clock_gettime(CLOCK_MONOTONIC, &t1);
    }
    assert_err(err, PD_ERR_STATE);
    held_wait(1, true); /* nothing taken for 300 ms: the connection is cut */
    assert_true(pd_http_req_gone(r));
    assert_err(pd_http_req_stream_write(r, chunk, 1), PD_ERR_STATE);
    hang_up(&c);
    held_release_all();
    pd_http_server_stop(s);
}

/* ---- stopping ---------------------------------------------------------------------------- */

static void *answer_later(void *arg) {
    pd_http_req *r = arg;
    struct timespec ts = {.tv_nsec = 100 * 1000 * 1000};
    nanosleep(&ts, NULL);
    assert_ok(pd_http_req_respond(r, 200, "text/plain", "bye", 3));
    return NULL;
}

static void stop_finishes_or_cuts_what_is_open(void **state) {
    (void)state;
    pd_http_server_config cfg = test_config();
    cfg.stop_grace_ms = 1000;
    pd_http_server *s = start(&cfg);
    client idle = dial(s), part = dial(s), a = dial(s), b = dial(s);
    send_str(&part, "GET /echo HT");
    send_str(&a, "GET /hold HTTP/1.1\r\nHost: h\r\n\r\n");
    held_wait(1, false);
    send_str(&b, "GET /hold HTTP/1.1\r\nHost: h\r\n\r\n");
    held_wait(2, false);
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, answer_later, H.req[0]), 0);
    pd_http_server_stop(s); /* a is answered within the grace, b is cut at its end */
    assert_int_equal(pthread_join(t, NULL), 0);
    assert_int_equal(H.gone, 1);
    assert_false(pd_http_req_gone(H.req[0]));
    assert_true(pd_http_req_gone(H.req[1]));
    assert_err(pd_http_req_respond(H.req[1], 200, NULL, "late", 4), PD_ERR_STATE);
    response r = {0};
    assert_true(read_response(&a, &r));
    assert_string_equal(r.body, "bye");
    char v[64];
    assert_string_equal(head_value(&r, "Connection", v, sizeof v), "close");
    response_free(&r);
    client *all[] = {&idle, &part, &a, &b};
    for (size_t i = 0; i < PD_ARRAY_LEN(all); i++) {
        assert_true(ends(all[i]));
        hang_up(all[i]);
    }
    held_release_all();
}

/* ---- starting ---------------------------------------------------------------------------- */

static void a_port_in_use_is_refused(void **state) {
    (void)state;
    pd_http_server_config cfg = test_config();
    pd_http_server *s = start(&cfg), *t = NULL;
    cfg.port = pd_http_server_port(s);
    char msg[256] = "";
    assert_err(pd_http_server_start(&t, &cfg, msg, sizeof msg), PD_ERR_IO);
    assert_null(t);
    assert_non_null(strstr(msg, "in use"));
    cfg.on_request = NULL;
    assert_err(pd_http_server_start(&t, &cfg, msg, sizeof msg), PD_ERR_INVALID);
    pd_http_server_stop(s);
}

static void ipv6_loopback_is_served(void **state) {
    (void)state;
    pd_http_server_config cfg = test_config();
    cfg.host = "::1";
    pd_http_server *s = NULL;
    char msg[256];
    if (pd_http_server_start(&s, &cfg, msg, sizeof msg) != PD_OK) {
        print_message("no IPv6 loopback here (%s)\n", msg);
        skip();
    }
    client c = {.fd = socket(AF_INET6, SOCK_STREAM, 0)};
    struct timeval tv = {.tv_sec = READ_TIMEOUT_S};
    setsockopt(c.fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons(pd_http_server_port(s))};
    inet_pton(AF_INET6, "::1", &a.sin6_addr);
    assert_int_equal(connect(c.fd, (struct sockaddr *)&a, sizeof a), 0);
    send_str(&c, "GET /echo HTTP/1.1\r\nHost: [::1]\r\n\r\n");
    response r = {0};
    assert_true(read_response(&c, &r));
    assert_int_equal(r.status, 200);
    response_free(&r);
    hang_up(&c);
    pd_http_server_stop(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(a_request_gets_its_answer),
        cmocka_unit_test(keep_alive_and_pipelining_answer_in_order),
        cmocka_unit_test(http10_is_served_and_closed_unless_kept_alive),
        cmocka_unit_test(every_refusal_is_json_and_ends_the_connection),
        cmocka_unit_test(header_block_over_its_limits_is_431),
        cmocka_unit_test(slowloris_gets_408_at_the_deadlines),
        cmocka_unit_test(an_idle_keep_alive_connection_is_closed),
        cmocka_unit_test(caps_refuse_the_newcomer_with_503),
        cmocka_unit_test(a_stream_from_another_thread_is_chunked),
        cmocka_unit_test(a_client_hanging_up_mid_stream_is_gone),
        cmocka_unit_test(clearing_a_watch_waits_for_its_callback),
        cmocka_unit_test(stream_writes_are_refused_over_the_watermark),
        cmocka_unit_test(a_client_that_stops_reading_is_cut_at_the_write_deadline),
        cmocka_unit_test(stop_finishes_or_cuts_what_is_open),
        cmocka_unit_test(a_port_in_use_is_refused),
        cmocka_unit_test(ipv6_loopback_is_served),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
