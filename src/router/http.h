/*
 * HTTP helpers shared by the router's routes: the error body of
 * docs/http-api.md and libmicrohttpd responses built from JSON text.
 *
 * Every refusal the router makes goes through pd_http_queue_error, so the
 * body format ({"error": {"message", "type", "code"}}) and the status-to-type
 * table live in one place. The bodies are built with jansson, never by
 * pasting strings, so a message quoting client input stays valid JSON.
 */
#ifndef PDSERVE_ROUTER_HTTP_H
#define PDSERVE_ROUTER_HTTP_H

#include <stdarg.h>
#include <stdint.h>
#include <sys/types.h>
#include <sys/socket.h>
#include <microhttpd.h>
#include <stddef.h>

/* A malloc'd {"error": {...}} body; NULL only when out of memory. */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
char *pd_http_error_body(unsigned status, const char *fmt, ...);
char *pd_http_error_body_v(unsigned status, const char *fmt, va_list ap);

/* Queues `body` (copied) with the given status and Content-Type. */
enum MHD_Result pd_http_queue_text(struct MHD_Connection *c, unsigned status,
                                   const char *content_type, const char *body, size_t len);
enum MHD_Result pd_http_queue_json(struct MHD_Connection *c, unsigned status,
                                   const char *body, size_t len);

/* Queues the standard error body; `allow` (may be NULL) becomes the Allow
 * header of a 405. */
#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
enum MHD_Result pd_http_queue_error(struct MHD_Connection *c, unsigned status,
                                    const char *allow, const char *fmt, ...);

#endif
