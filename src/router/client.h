/*
 * The router as an HTTP client of its workers: the settings every libcurl
 * handle gets, and the batch: several calls to workers run as non-blocking
 * transfers on an upstream loop (loop.h) and answered together when all are
 * back or their deadline passed.
 *
 * The batch is what the admin routes use: a router-level /abort_request
 * costs one call to every worker, all in parallel so a dead worker costs
 * one timeout, not one per worker; /flush_cache likewise; /v1/models and
 * SGLang's utility routes are a batch of one. No thread blocks on any of
 * them (issue 13). A forward's own aborts do not come here: they are
 * transfers the forward owns (forward.c).
 */
#ifndef PDSERVE_ROUTER_CLIENT_H
#define PDSERVE_ROUTER_CLIENT_H

#include <curl/curl.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pdserve/base.h"
#include "pdserve/router.h"

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

/* One call of a batch: the URL to ask, and once the batch is done, the
 * answer: its HTTP status (0 when there was none) and its body (malloc'd,
 * NUL-terminated, NULL when empty), cut at the batch's cap (`cut`: a cut
 * answer is never relayed). */
typedef struct rt_call {
    char url[PD_ROUTER_URL_MAX + 320];
    long status;
    char *body;
    size_t len;
    bool cut;
} rt_call;

/* The answer's integer "aborted" field, -1 if absent. */
long long rt_call_aborted(const rt_call *c);
/* The answer's "error"."message" into buf ("" if absent). */
void rt_call_message(const rt_call *c, char *buf, size_t cap);

/* Runs on the loop thread once every call has its answer (or failed, or
 * the batch's deadline passed): calls[i].status, body, len, cut are
 * filled. A body the callback wants to keep it takes (sets calls[i].body
 * to NULL); the batch frees the others when the callback returns. */
typedef void (*rt_batch_done)(void *user, rt_call *calls, size_t n);

/* A batch: the calls of one admin route (a router-level /abort_request to
 * every worker, /flush_cache to every worker, a relayed /v1/models) run as
 * transfers of one upstream loop, a task there, so no thread waits for a
 * worker. Calls [0, first_stage) run at once, in parallel; then, when all
 * of them are back, calls [first_stage, n) (n for a single stage: the
 * abort's decode-before-prefill order). Each transfer is limited to
 * timeout_ms (libcurl's own timeout), each stage also by a backstop
 * deadline. */
typedef struct rt_batch_params {
    struct rt_loop *loop;
    const rt_call *calls; /* their urls are copied */
    size_t n, first_stage;
    const char *body; /* JSON to POST (copied), or NULL for a GET */
    size_t body_len;
    uint32_t timeout_ms, connect_timeout_ms;
    const char *api_key; /* must outlive the batch ("" or NULL: none) */
    size_t cap;          /* answer bytes kept per call */
    rt_batch_done done;
    void *user;
} rt_batch_params;

/* Any thread: starts the batch on p->loop. On an error nothing started
 * and done will not be called. n <= 2 * PD_ROUTER_WORKERS_MAX. */
pd_err rt_batch_start(const rt_batch_params *p, char *msg, size_t msg_cap);

/* Milliseconds of CLOCK_MONOTONIC. */
uint64_t rt_now_ms(void);

#endif
