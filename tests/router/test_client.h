/*
 * Client side of the router tests: one-shot HTTP requests with libcurl, a
 * raw-socket POST for tests that hang up on purpose, an SSE checker, and a
 * fixture that starts a router in front of fake workers.
 */
#ifndef PDSERVE_TEST_ROUTER_CLIENT_H
#define PDSERVE_TEST_ROUTER_CLIENT_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "fake_worker.h"
#include "pdserve/router.h"

typedef struct tc_response {
    long status;              /* 0 when no HTTP answer */
    int curl_code;
    char *body;
    size_t len;
    char content_type[128];
    char allow[64];
} tc_response;

/* method "GET" or "POST" (or any other); body NULL for none. */
void tc_request(const char *method, const char *url, const char *body, long timeout_ms,
                tc_response *out);
void tc_free(tc_response *r);
/* The body parsed; NULL when it is not JSON. New reference. */
json_t *tc_json(const tc_response *r);
/* The message of a standard error body, NULL when the body is not one with
 * the given status as "code". */
const char *tc_error_message(json_t *body, long status);

/* A streamed body must be: events, exactly one of them final (finish_reason
 * not null, or an error object), that one last but for `data: [DONE]`,
 * nothing after. Returns the final event (new reference) or NULL with
 * `why`; *token_events counts the events before the final one. */
json_t *tc_sse_check(const char *body, size_t len, size_t *token_events, char *why, size_t cap);

/* Connects to 127.0.0.1:port and sends a POST with `body`; returns the fd. */
int tc_raw_post(uint16_t port, const char *path, const char *body);
/* Reads until `needle` appeared or the timeout; true when it did. */
bool tc_raw_read_until(int fd, const char *needle, int timeout_ms);

/* Defaults for tests: port 0, health probes every 50 ms (300 ms limit),
 * request timeout 20 s, abort timeout 2 s, grace 500 ms. */
void tk_config(pd_router_config *cfg);
/* Starts a router in front of the workers; cfg NULL = tk_config. */
pd_router *tk_router(fake_worker **prefill, size_t np, fake_worker **decode, size_t nd,
                     const pd_router_config *cfg);
/* "http://127.0.0.1:PORT/path" in buf. */
const char *tk_url(pd_router *r, const char *path, char *buf, size_t cap);
json_t *tk_server_info(pd_router *r);
/* Polls /server_info until the worker at url has this health. */
bool tk_wait_health(pd_router *r, const char *url, bool healthy, int timeout_ms);
/* Polls until the router has no request in flight. */
bool tk_wait_idle(pd_router *r, int timeout_ms);

uint64_t tk_now_ms(void);
void tk_sleep_ms(int ms);

#endif
