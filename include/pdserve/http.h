/*
 * pd_http — the HTTP helpers shared by the node and the router: the error
 * body of docs/http-api.md and libmicrohttpd responses.
 *
 * Every refusal either server makes goes through pd_http_queue_error (or
 * pd_http_error_body where the body travels some other way, such as the last
 * event of a stream), so the body format ({"error": {"message", "type",
 * "code"}}) and the status-to-type table live in one place and the two
 * servers cannot drift apart.
 *
 * Invariant: an error body is always valid JSON. The message is formatted
 * into a bounded buffer, made valid UTF-8 (every byte that is not part of a
 * character becomes U+FFFD: a message may quote a client's path or a cut of
 * it) and escaped by jansson, never pasted into a string; so a body is
 * missing only when memory ran out.
 *
 * A response is always a complete body copied into libmicrohttpd, so callers
 * free their buffers right away and no lifetime crosses into it. Streaming
 * responses are the one exception and stay with the code that produces them.
 *
 * This layer sits above base and below node and router; it knows nothing of
 * either.
 */
#ifndef PDSERVE_HTTP_H
#define PDSERVE_HTTP_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/socket.h>
#include <jansson.h>
#include <microhttpd.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The message of an error body keeps at most this many bytes of its
 * formatted text (before U+FFFD replacements). */
#define PD_HTTP_MESSAGE_MAX 511u

/* The OpenAI-style error "type" for an HTTP status. */
const char *pd_http_error_type(unsigned status);

/* A malloc'd {"error": {...}} body (valid JSON whatever the bytes fmt
 * formats); NULL only when out of memory. */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
char *pd_http_error_body(unsigned status, const char *fmt, ...);
char *pd_http_error_body_v(unsigned status, const char *fmt, va_list ap);

/* Queues `body` (copied) with the given status and Content-Type. */
enum MHD_Result pd_http_queue_text(struct MHD_Connection *c, unsigned status,
                                   const char *content_type, const char *body, size_t len);
enum MHD_Result pd_http_queue_json(struct MHD_Connection *c, unsigned status, const char *body,
                                   size_t len);
/* Queues `o` as compact JSON and releases it (it may be NULL, as a failed
 * json_pack returns); MHD_NO when there is nothing to send. */
enum MHD_Result pd_http_queue_json_value(struct MHD_Connection *c, unsigned status, json_t *o);

/* Queues the standard error body; `allow` (may be NULL) becomes the Allow
 * header of a 405. */
#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
enum MHD_Result pd_http_queue_error(struct MHD_Connection *c, unsigned status,
                                    const char *allow, const char *fmt, ...);

/* libmicrohttpd's URL unescaping (MHD_OPTION_UNESCAPE_CALLBACK) for both
 * servers, with one difference: a string that holds a percent-encoded NUL
 * ("%00") is left as it came, undecoded. Decoded, the NUL would end the C
 * string a handler sees, and "/generate%00anything" would be served as
 * "/generate"; left alone, it matches no route. Returns the new length. */
size_t pd_http_unescape(void *cls, struct MHD_Connection *c, char *s);

/* A request whose framing two HTTP implementations could read differently —
 * the way one request is smuggled inside another behind a proxy: two
 * different Content-Length headers, Transfer-Encoding together with
 * Content-Length, or HTTP/1.1 without Host. NULL if none, else what is wrong,
 * for a 400. Both servers ask on the first call for a request. */
const char *pd_http_ambiguous(struct MHD_Connection *c, const char *version);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_HTTP_H */
