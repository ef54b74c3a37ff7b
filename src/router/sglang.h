/*
 * SGLang's native utility endpoints on the router (docs/http-api.md):
 * /get_model_info, /get_server_info, /tokenize and /detokenize are relayed
 * to one healthy worker; /flush_cache goes to every worker. /health_generate
 * is a real generation and takes the router's generate path (router.c).
 *
 * The calls to workers are a batch on an upstream loop (client.h): no
 * thread waits for a worker. These functions only say where to ask and
 * judge the answers; none keeps state between requests.
 */
#ifndef PDSERVE_ROUTER_SGLANG_H
#define PDSERVE_ROUTER_SGLANG_H

#include <stdbool.h>
#include <stddef.h>

#include "client.h"
#include "workers.h"

/* What the client gets: a worker's JSON answer relayed as it is (body), or,
 * when body is NULL, a router-made error with status and message. */
typedef struct rt_sgl_answer {
    unsigned status;
    char *body; /* malloc'd; the caller frees it */
    size_t len;
    char message[512];
} rt_sgl_answer;

/* The URL `path` is relayed to: on the first healthy decode worker, or,
 * unless decode_only, on a healthy prefill worker when no decode worker is
 * healthy. False, with out a 503, when there is none. */
bool rt_sgl_relay_url(rt_workers *t, bool decode_only, const char *path, char *url, size_t cap,
                      rt_sgl_answer *out);

/* The relayed answer: the worker's own (its body taken from c), or 502
 * when it did not answer, or its answer is not JSON or was cut at
 * max_response_bytes. */
void rt_sgl_relay_verdict(rt_call *c, size_t max_response_bytes, rt_sgl_answer *out);

/* POST /flush_cache goes to every worker at once: calls[i] is worker i's
 * (t->count of them). */
void rt_sgl_flush_calls(const rt_workers *t, rt_call *calls);

/* 200 with each worker's status when all flushed, else the first
 * failure's status (502 for no answer), naming the worker and quoting its
 * message. */
void rt_sgl_flush_verdict(const rt_workers *t, const rt_call *calls, rt_sgl_answer *out);

#endif
