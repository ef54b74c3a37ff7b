/*
 * pd_router — the HTTP front door of a disaggregated deployment.
 *
 * A client talks to the router exactly as it would talk to a colocated
 * `serve` node (docs/http-api.md). For every POST /generate or
 * /v1/completions the router picks one healthy prefill node and one healthy
 * decode node, draws a fresh random bootstrap room, adds the prefill node's
 * bootstrap address, the room and a rid to the body and sends the same body
 * to both nodes at once. The prefill node computes the prompt and pushes the
 * KV cache into the room; the decode node waits in the same room, generates
 * and answers. The router returns the decode node's answer — streamed event
 * by event when the client asked for a stream.
 *
 * The promise, whatever the workers do: exactly one complete HTTP response
 * per client request, and every half of a request that the router stops
 * waiting for (client gone, timeout, abort, the other half failed) is told
 * so with POST /abort_request, so no worker keeps computing for nobody.
 *
 * Threads: a fixed set, none per request or connection. The HTTP server
 * (pdserve/http_server.h) runs one event loop, which also validates and
 * pairs generations; four upstream event loops (src/router/loop.c: epoll +
 * libcurl's multi interface) run every request's two halves and aborts,
 * and the admin routes' calls to workers as non-blocking batches
 * (/abort_request's fan-out, /v1/models, SGLang's utility routes); a
 * background thread checks
 * GET /health of every worker. pd_router_start raises RLIMIT_NOFILE's soft
 * limit to the hard one and refuses a connections_max that does not fit.
 * Nothing here prints or exits; errors come back as pd_err with a message
 * in a caller-owned buffer.
 *
 * The pieces, one file each under src/router: policy.c (which worker),
 * workers.c (the worker table: health state and load), health.c (the
 * checker thread), client.c (libcurl settings and the batch: calls to
 * several workers as transfers of a loop), loop.c (an upstream event loop),
 * forward.c (one request's two halves, a task of a loop),
 * stats.c (counters and the latency histogram), router.c (the server and
 * routes). Error bodies and responses come from the http layer (http.h).
 */
#ifndef PDSERVE_ROUTER_H
#define PDSERVE_ROUTER_H

#include <stddef.h>
#include <stdint.h>

#include "pdserve/base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_ROUTER_WORKERS_MAX 64        /* per role */
#define PD_ROUTER_URL_MAX 256           /* bytes, including the NUL */
#define PD_ROUTER_DEFAULT_BOOTSTRAP_PORT 8998

typedef struct pd_router pd_router;

typedef enum pd_router_policy {
    PD_ROUTER_ROUND_ROBIN = 0, /* each role's healthy workers in turn */
    PD_ROUTER_LEAST_LOAD,      /* fewest requests in flight from this router */
    PD_ROUTER_RANDOM,          /* a healthy worker at random */
    PD_ROUTER_POWER_OF_TWO,    /* the less loaded of two healthy workers drawn at random */
} pd_router_policy;

typedef struct pd_router_config {
    const char *host;                 /* listen address (default "127.0.0.1") */
    uint16_t port;                    /* 0 = any free port (see pd_router_port) */
    /* Worker specs: "http://host:port" for both roles; a prefill spec may end
     * in "@N" to give that node's bootstrap port (otherwise bootstrap_port). */
    const char *prefill[PD_ROUTER_WORKERS_MAX];
    size_t prefill_count;
    const char *decode[PD_ROUTER_WORKERS_MAX];
    size_t decode_count;
    uint16_t bootstrap_port;          /* default 8998 */
    pd_router_policy policy;
    uint32_t health_interval_ms;      /* default 1000 */
    uint32_t health_timeout_ms;       /* one /health probe; default 1000 */
    uint32_t unhealthy_after;         /* consecutive failed probes; default 2 */
    uint32_t request_timeout_ms;      /* whole request, both halves; default 600 s */
    uint32_t connect_timeout_ms;      /* TCP connect to a worker; default 5000 */
    uint32_t abort_timeout_ms;        /* one /abort_request to a worker; default 2000 */
    uint32_t abort_grace_ms;          /* after an /abort_request, how long the decode
                                         node gets to end the response itself; default 1000 */
    size_t max_body_bytes;            /* client request bodies; default 1 MiB */
    size_t max_response_bytes;        /* a non-streamed worker answer; default 64 MiB */
    /* Told of every client that hung up before its answer, one line each (a
     * JSON object with its rid, docs/http-api.md), from any of the router's
     * threads (several at once).
     * NULL: nothing is logged; the router prints nothing itself. */
    void (*on_log)(void *ctx, const char *line);
    void *on_log_ctx;
    uint32_t connections_max;         /* client connections = requests in flight; default 1024 */
    /* Of them, from one client address; default 256. */
    uint32_t connections_per_ip;
    /* A client connection silent this long is closed; default 60. */
    uint32_t client_timeout_s;
    /* --api-key, as sgl-router's: clients must send "Authorization: Bearer
     * api_key" on every route but OPTIONS, /health... and /metrics... (401
     * otherwise), and the router sends the same to its workers. NULL or "":
     * none. At most PD_HTTP_API_KEY_MAX - 1 bytes of visible ASCII. */
    const char *api_key;
} pd_router_config;

/* Fills the defaults above (no workers). */
void pd_router_config_default(pd_router_config *cfg);

/* One worker address, parsed. */
typedef struct pd_router_url {
    char base[PD_ROUTER_URL_MAX];     /* "http://host:port", no trailing slash */
    char host[PD_ROUTER_URL_MAX];     /* host as written, IPv6 brackets removed */
    uint16_t port;
    uint16_t bootstrap_port;          /* the "@N" suffix, 0 when absent */
} pd_router_url;

/* Parses "http://host:port[/]" with an optional "@N" suffix (allow_bootstrap).
 * Refuses other schemes, user info, paths, missing or out-of-range ports. */
pd_err pd_router_url_parse(const char *spec, bool allow_bootstrap, pd_router_url *out,
                           char *msg, size_t msg_cap);

/* "round_robin" / "least_load" / "random" / "power_of_two" <-> pd_router_policy. */
const char *pd_router_policy_name(pd_router_policy p);
pd_err pd_router_policy_parse(const char *s, pd_router_policy *out);

/* Validates the configuration and parses the worker specs. */
pd_err pd_router_create(pd_router **out, const pd_router_config *cfg, char *msg, size_t msg_cap);
/* Binds the listening socket, starts the server and the health checker. */
pd_err pd_router_start(pd_router *r, char *msg, size_t msg_cap);
/* The port actually bound (after start). */
uint16_t pd_router_port(const pd_router *r);
/* Ends every request in flight (both halves aborted, the client answered
 * 503), stops the server and the health checker. Idempotent. */
void pd_router_stop(pd_router *r);
/* Stops if needed and frees. NULL is allowed. */
void pd_router_destroy(pd_router *r);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_ROUTER_H */
