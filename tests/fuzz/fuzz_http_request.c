/* Bytes from a client, through one connection's request parsing exactly as
 * the server's loop runs it (src/http/reqparse.c), without a socket. The
 * first byte says how the rest arrives: in reads of that many bytes (0: all
 * at once), so requests split anywhere are covered. Each request is taken
 * (path decoding, the handle's copy of everything) and released; a refusal's
 * answer is built and must carry a JSON error body with the project's shape.
 * The limits are small so the fuzzer reaches them. */
#include <jansson.h>
#include <string.h>

#include "../../src/http/server_internal.h"
#include "fuzz.h"
#include "pdserve/http.h"

/* A refusal's answer: a status the server uses, and the JSON error shape. */
static void check_refusal(const http_reqparse *p) {
    unsigned st = p->err_status;
    PD_ASSERT(st == 400 || st == 413 || st == 431 || st == 503 || st == 505);
    size_t len = 0;
    char *resp = http_error_response(st, p->err_msg, &len);
    PD_ASSERT(resp != NULL && len > 0);
    const char *body = strstr(resp, "\r\n\r\n");
    PD_ASSERT(body != NULL);
    json_t *o = json_loads(body + 4, 0, NULL);
    PD_ASSERT(o != NULL);
    json_t *e = json_object_get(o, "error");
    PD_ASSERT(json_integer_value(json_object_get(e, "code")) == (json_int_t)st);
    PD_ASSERT(json_is_string(json_object_get(e, "message")));
    json_decref(o);
    free(resp);
}

/* A request as a handler sees it. False when the connection would end. */
static bool check_request(http_reqparse *p) {
    pd_http_req *r = http_reqparse_take(p);
    if (!r) return false;
    const char *path = pd_http_req_path(r);
    PD_ASSERT(path[0] == '/' && pd_http_req_method(r) != NULL);
    PD_ASSERT(strlen(path) <= strlen(r->head));
    size_t len;
    const char *body = pd_http_req_body(r, &len);
    PD_ASSERT(body[len] == '\0' && len <= p->lim.body_bytes_max);
    PD_ASSERT(pd_http_req_version_minor(r) <= 1);
    (void)pd_http_req_header(r, "host");
    bool more = r->keep_alive;
    pd_http_req_release(r);
    return more;
}

/* Feeds what has arrived as the loop does; false once the connection ends. */
static bool feed_arrived(http_reqparse *p, const char *in, size_t arrived, size_t *off) {
    for (;;) {
        http_feed ev;
        size_t took = http_reqparse_feed(p, in + *off, arrived - *off, &ev);
        PD_ASSERT(took <= arrived - *off);
        *off += took;
        PD_ASSERT(p->header_seen <= p->lim.header_bytes_max);
        if (ev == HTTP_FEED_MORE) return true;
        if (ev == HTTP_FEED_ERROR) {
            check_refusal(p);
            return false;
        }
        if (ev == HTTP_FEED_DONE && !check_request(p)) return false;
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    http_limits lim = {.header_bytes_max = 512, .headers_max = 16, .body_bytes_max = 2048};
    http_reqparse p;
    if (http_reqparse_init(&p, &lim) != PD_OK) return 0;
    const char *in = (const char *)data + 1;
    size_t len = size - 1, step = data[0] ? data[0] : len, arrived = 0, off = 0;
    while (arrived < len) {
        arrived = PD_MIN(len, arrived + step);
        if (!feed_arrived(&p, in, arrived, &off)) break;
    }
    http_reqparse_free(&p);
    return 0;
}
