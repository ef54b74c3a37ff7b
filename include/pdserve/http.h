/*
 * pd_http — the error body of docs/http-api.md, shared by the HTTP server
 * (pdserve/http_server.h), the node and the router.
 *
 * Every refusal goes through pd_http_error_body (pd_http_req_respond_error
 * wraps it; a stream's last event uses it directly), so the body format
 * ({"error": {"message", "type", "code"}}) and the status-to-type table live
 * in one place and nothing can drift apart.
 *
 * Invariant: an error body is always valid JSON. The message is formatted
 * into a bounded buffer, made valid UTF-8 (every byte that is not part of a
 * character becomes U+FFFD: a message may quote a client's path or a cut of
 * it) and escaped by jansson, never pasted into a string; so a body is
 * missing only when memory ran out.
 *
 * This layer sits above base and below node and router; it knows nothing of
 * either.
 */
#ifndef PDSERVE_HTTP_H
#define PDSERVE_HTTP_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

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

/* ---- the API key (--api-key; src/http/auth.c) ------------------------------
 * Like SGLang's: every request needs "Authorization: Bearer KEY" except
 * OPTIONS and the paths that start with /health or /metrics. The check
 * takes the same time whatever the token (hashed, then compared in
 * constant time). pd_http_req_authorize (http_server.h) answers the 401. */

/* Keys are 1 to PD_HTTP_API_KEY_MAX - 1 bytes of visible ASCII. */
#define PD_HTTP_API_KEY_MAX 256u
bool pd_http_api_key_valid(const char *key);
/* True when a request needs no key: OPTIONS, /health..., /metrics... */
bool pd_http_api_key_exempt(const char *method, const char *path);
/* True when an Authorization header value ("Bearer TOKEN", the scheme in any
 * case; NULL when absent) carries api_key (non-empty). */
bool pd_http_bearer_matches(const char *authorization, const char *api_key);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_HTTP_H */
