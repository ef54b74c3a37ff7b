/*
 * HTTP helpers: the error body of docs/http-api.md and MHD responses.
 *
 * A response is always a complete body copied into MHD
 * (MHD_RESPMEM_MUST_COPY), so callers free their buffers right away and no
 * lifetime crosses into libmicrohttpd. Streaming responses are the one
 * exception and live in router.c next to the forward they drain.
 */
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http.h"
#include "pdserve/base.h"

char *pd_http_error_body_v(unsigned status, const char *fmt, va_list ap) {
    char message[512];
    vsnprintf(message, sizeof message, fmt, ap);
    json_t *root = json_pack("{s:{s:s, s:s, s:i}}", "error", "message", message, "type",
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

enum MHD_Result pd_http_queue_text(struct MHD_Connection *c, unsigned status,
                                   const char *content_type, const char *body, size_t len) {
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, content_type);
    enum MHD_Result ret = MHD_queue_response(c, status, resp);
    MHD_destroy_response(resp);
    return ret;
}

enum MHD_Result pd_http_queue_json(struct MHD_Connection *c, unsigned status,
                                   const char *body, size_t len) {
    return pd_http_queue_text(c, status, "application/json", body, len);
}

enum MHD_Result pd_http_queue_error(struct MHD_Connection *c, unsigned status,
                                    const char *allow, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *body = pd_http_error_body_v(status, fmt, ap);
    va_end(ap);
    if (!body) return MHD_NO;
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(strlen(body), body, MHD_RESPMEM_MUST_COPY);
    free(body);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "application/json");
    if (allow) MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, allow);
    enum MHD_Result ret = MHD_queue_response(c, status, resp);
    MHD_destroy_response(resp);
    return ret;
}
