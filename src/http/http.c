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

#include <jansson.h>

#include "pdserve/base.h"

const char *pd_http_error_type(unsigned status) {
    switch (status) {
    case 400: return "invalid_request_error";
    case 401: return "authentication_error";
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
