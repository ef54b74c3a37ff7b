/*
 * The router as an HTTP client of its workers: the settings every libcurl
 * handle gets, and a fan-out POST that sends one body to several workers at
 * once and waits for all of them (bounded by a timeout).
 *
 * The fan-out is what aborts use: a client that hangs up costs one
 * /abort_request to each half, a router-level /abort_request one to every
 * worker, all in parallel so a dead worker costs one timeout, not one per
 * worker. It blocks the calling thread, which is always one of the
 * router's admin threads (router.c), never an event loop. A forward's own
 * aborts do not come here: they are transfers on its loop (forward.c).
 */
#ifndef PDSERVE_ROUTER_CLIENT_H
#define PDSERVE_ROUTER_CLIENT_H

#include <curl/curl.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pdserve/base.h"

/* curl_global_init, once per process; safe to call from any thread. */
pd_err rt_client_global_init(char *msg, size_t msg_cap);

/* No signals, no proxy from the environment, HTTP/1.1, the connect timeout,
 * the process's pool of kept-alive connections to the workers, and
 * "Authorization: Bearer api_key" unless api_key is NULL or "". */
void rt_client_setup(CURL *easy, uint32_t connect_timeout_ms, const char *api_key);

/* Kept-alive worker connections the pool holds at most, idle or busy. */
#define RT_POOL_CONNECTIONS_MAX 4096
/* A multi handle that leaves the shared pool alone (curl_multi_init prunes
 * it to 4 connections per transfer of its own). */
CURLM *rt_client_multi(void);

typedef struct rt_post {
    char url[320];     /* full URL, path included */
    long status;       /* HTTP status, 0 when the worker did not answer */
    long long aborted; /* the answer's integer "aborted" field, -1 if absent */
    char message[256]; /* the answer's "error"."message", "" if absent */
} rt_post;

/* POSTs `body` (JSON) to every posts[i].url at once and fills status and
 * aborted. Returns when all have answered or failed; each is limited to
 * timeout_ms. n <= 2 * PD_ROUTER_WORKERS_MAX. */
void rt_fanout_post(rt_post *posts, size_t n, const char *body, uint32_t timeout_ms,
                    uint32_t connect_timeout_ms, const char *api_key);

/* GET url (blocking, this thread); the answer's first bytes (up to 1 KiB)
 * into body[0, cap). Returns the HTTP status, 0 when there was none. */
long rt_get(const char *url, uint32_t timeout_ms, uint32_t connect_timeout_ms, const char *api_key,
            char *body, size_t cap);

/* A worker's whole answer, to relay: the status (0 when there was none),
 * the body (malloc'd and NUL-terminated, NULL when empty) and whether it was
 * cut at the cap (a cut answer is never relayed). */
typedef struct rt_fetched {
    long status;
    char *body;
    size_t len;
    bool cut;
} rt_fetched;

/* GET url, or POST body (JSON) when body is not NULL; blocking, this
 * thread. Keeps at most cap bytes of the answer; the caller frees
 * out->body. */
void rt_fetch(const char *url, const char *body, size_t body_len, uint32_t timeout_ms,
              uint32_t connect_timeout_ms, const char *api_key, size_t cap, rt_fetched *out);

/* Milliseconds of CLOCK_MONOTONIC. */
uint64_t rt_now_ms(void);

#endif
