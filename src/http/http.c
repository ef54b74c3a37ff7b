/*
 * http.c — the error body of docs/http-api.md and libmicrohttpd responses.
 * See include/pdserve/http.h for the invariant (an error body is always
 * valid JSON) and who uses what.
 *
 * The message is sanitised after formatting, not the arguments before: the
 * bounded format may cut a character in half, which is as invalid as a
 * client's stray byte and is mended by the same pass.
 */
#include "pdserve/http.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "pdserve/base.h"

const char *pd_http_error_type(unsigned status) {
    switch (status) {
    case 400: return "invalid_request_error";
    case 403: return "permission_error";
    case 404: return "not_found_error";
    case 405: return "method_not_allowed";
    case 409: return "conflict_error";
    case 413: return "request_too_large";
    case 429: return "rate_limit_error";
    case 500: return "internal_error";
    case 502: return "bad_gateway";
    case 503: return "unavailable_error";
    case 504: return "timeout_error";
    default: return status >= 500 ? "internal_error" : "invalid_request_error";
    }
}

char *pd_http_error_body_v(unsigned status, const char *fmt, va_list ap) {
    PD_ASSERT(fmt != NULL);
    char message[PD_HTTP_MESSAGE_MAX + 1];
    if (vsnprintf(message, sizeof message, fmt, ap) < 0) message[0] = '\0';
    /* A byte becomes at most the 3 of U+FFFD, so the sanitised copy is whole. */
    char safe[3 * PD_HTTP_MESSAGE_MAX + 1];
    size_t need = pd_utf8_sanitize(message, strlen(message), safe, sizeof safe);
    PD_ASSERT(need < sizeof safe);
    /* jansson refuses a string that is not UTF-8: without the pass above,
     * a message quoting a client's bytes would leave no body at all. */
    json_t *root = json_pack("{s:{s:s, s:s, s:I}}", "error", "message", safe, "type",
                             pd_http_error_type(status), "code", (json_int_t)status);
    if (!root) return NULL;
    char *text = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return text;
}

char *pd_http_error_body(unsigned status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *body = pd_http_error_body_v(status, fmt, ap);
    va_end(ap);
    return body;
}

/* Every response but a stream: the body copied, Content-Type, and an Allow
 * header when one is given. */
static enum MHD_Result queue(struct MHD_Connection *c, unsigned status, const char *content_type,
                             const char *allow, const char *body, size_t len) {
    PD_ASSERT(c != NULL && content_type != NULL);
    PD_ASSERT(body != NULL || len == 0);
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    if (allow) MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
    enum MHD_Result ret = MHD_queue_response(c, status, resp);
    MHD_destroy_response(resp);
    return ret;
}

enum MHD_Result pd_http_queue_text(struct MHD_Connection *c, unsigned status,
                                   const char *content_type, const char *body, size_t len) {
    return queue(c, status, content_type, NULL, body, len);
}

enum MHD_Result pd_http_queue_json(struct MHD_Connection *c, unsigned status, const char *body,
                                   size_t len) {
    return queue(c, status, "application/json", NULL, body, len);
}

enum MHD_Result pd_http_queue_json_value(struct MHD_Connection *c, unsigned status, json_t *o) {
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!text) return MHD_NO;
    enum MHD_Result ret = queue(c, status, "application/json", NULL, text, strlen(text));
    free(text);
    return ret;
}

enum MHD_Result pd_http_queue_error(struct MHD_Connection *c, unsigned status, const char *allow,
                                    const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *body = pd_http_error_body_v(status, fmt, ap);
    va_end(ap);
    if (!body) return MHD_NO;
    enum MHD_Result ret = queue(c, status, "application/json", allow, body, strlen(body));
    free(body);
    return ret;
}

size_t pd_http_unescape(void *cls, struct MHD_Connection *c, char *s) {
    (void)cls;
    (void)c;
    for (const char *p = s; (p = strchr(p, '%')) != NULL; p++)
        if (p[1] == '0' && p[2] == '0') return strlen(s);
    return MHD_http_unescape(s);
}

typedef struct header_count {
    unsigned content_length, transfer_encoding;
    bool lengths_differ;
    const char *first_length;
} header_count;

static enum MHD_Result count_header(void *cls, enum MHD_ValueKind kind, const char *key,
                                    const char *value) {
    (void)kind;
    header_count *hc = cls;
    if (!strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH)) {
        if (hc->content_length++ == 0) hc->first_length = value;
        else if (strcmp(value ? value : "", hc->first_length ? hc->first_length : ""))
            hc->lengths_differ = true;
    } else if (!strcasecmp(key, MHD_HTTP_HEADER_TRANSFER_ENCODING)) {
        hc->transfer_encoding++;
    }
    return MHD_YES;
}

const char *pd_http_ambiguous(struct MHD_Connection *c, const char *version) {
    header_count hc = {0};
    MHD_get_connection_values(c, MHD_HEADER_KIND, count_header, &hc);
    if (hc.lengths_differ) return "two different Content-Length headers";
    if (hc.transfer_encoding && hc.content_length)
        return "Transfer-Encoding together with Content-Length";
    if (version && !strcmp(version, MHD_HTTP_VERSION_1_1) &&
        !MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_HOST))
        return "an HTTP/1.1 request without a Host header";
    return NULL;
}
