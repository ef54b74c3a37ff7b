/*
 * SGLang's native utility endpoints on the router (docs/http-api.md):
 * /get_model_info, /get_server_info, /tokenize and /detokenize are relayed
 * to one healthy worker; /flush_cache goes to every worker. /health_generate
 * is a real generation and takes the router's generate path (router.c).
 *
 * Each runs on one of the router's admin threads (router.c), blocking it for at
 * most the worker timeout; none keeps state between requests.
 */
#ifndef PDSERVE_ROUTER_SGLANG_H
#define PDSERVE_ROUTER_SGLANG_H

#include <stdbool.h>
#include <stddef.h>

#include "workers.h"

/* What the client gets: a worker's JSON answer relayed as it is (body), or,
 * when body is NULL, a router-made error with status and message. */
typedef struct rt_sgl_answer {
    unsigned status;
    char *body; /* malloc'd; the caller frees it */
    size_t len;
    char message[512];
} rt_sgl_answer;

/* `method` `path` (body: POST's, or NULL) on the first healthy decode
 * worker, or, unless decode_only, on a healthy prefill worker when no
 * decode worker is healthy. 503 when there is none; 502 when it does not
 * answer, or its answer is not JSON or over cfg->max_response_bytes. */
void rt_sgl_relay(rt_workers *t, const pd_router_config *cfg, bool decode_only, const char *path,
                  const char *body, size_t body_len, rt_sgl_answer *out);

/* POST /flush_cache to every worker at once: 200 with each worker's status
 * when all flushed, else the first failure's status (502 for no answer),
 * naming the worker and quoting its message. */
void rt_sgl_flush(rt_workers *t, const pd_router_config *cfg, rt_sgl_answer *out);

#endif
