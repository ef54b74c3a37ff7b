/*
 * pd_node — a running pdserve server: one engine (prefill, decode or
 * colocated) driven by real threads, the tiny model as its executor, a
 * transport, and the HTTP API of docs/http-api.md.
 *
 * Threads:
 *   - HTTP (pd_http_server, docs/http-server.md): one event-loop thread owns
 *     the sockets, reads requests within their deadlines and writes answers;
 *     one responder thread parses each request, hands it to the scheduler
 *     through a bounded command queue and turns its outputs into the answer
 *     (whole, or streamed as they come). Neither ever waits for the other
 *     or for the scheduler;
 *   - the scheduler: the only thread that touches the engine; it drains the
 *     command queue, steps the engine, and delivers tokens and terminal
 *     events to the requests' calls, waking the responder;
 *   - the executor worker: runs forwards in launch order, so batch N+1
 *     computes while the scheduler processes batch N's result (overlap);
 *   - the transport's progress thread (loopback fabric or UCX).
 * The engine itself stays single-threaded and sans-I/O.
 */
#ifndef PDSERVE_NODE_H
#define PDSERVE_NODE_H

#include "pdserve/base.h"
#include "pdserve/loopback_mt.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pd_node_role { PD_NODE_PREFILL, PD_NODE_DECODE, PD_NODE_SERVE } pd_node_role;

const char *pd_node_role_name(pd_node_role r);

/* Strict mode: receives the report of a failed ownership check, on the
 * scheduler thread; the report is valid during the call only. The node
 * prints nothing itself: where a report goes is its caller's choice. */
typedef void (*pd_node_violation_fn)(void *ctx, pd_node_role role, const char *report);

/* A request's log line (one JSON object, no newline; docs/http-api.md),
 * on the scheduler thread; valid during the call only. */
typedef void (*pd_node_log_fn)(void *ctx, const char *line);

typedef struct pd_node_config {
    pd_node_role role;
    /* HTTP */
    const char *host;      /* listen address (default "127.0.0.1") */
    uint16_t port;         /* 0: any free port */
    size_t max_body_bytes; /* default 1 MiB; 413 over */
    /* Deadlines of a client connection (408 for a header block or a body
     * that does not arrive in time; docs/http-api.md). */
    uint32_t http_header_timeout_ms; /* the request line and headers (default 10000) */
    uint32_t http_body_timeout_ms;   /* the body, from the end of the headers (default 30000) */
    uint32_t http_idle_timeout_ms;   /* keep-alive between requests (default 60000) */
    uint32_t http_write_timeout_ms;  /* no byte of an answer taken by the client (default 30000) */
    bool enable_metrics;             /* GET /metrics */
    /* /generate streams send only what is new in each event, not SGLang's
     * default, the whole output so far; the final event is complete either way */
    bool incremental_streaming_output;
    const char *served_model_name; /* "model" in /v1/completions (default "pdserve-tiny") */
    /* model */
    const char *model_dir;          /* NULL: built-in config with dummy weights */
    const char *chat_template_path; /* --chat-template FILE: instead of the model's */
    const char *model_preset;       /* "tiny" (default) or "small" */
    const char *layers;             /* layer pattern override, e.g. "MAMA" */
    uint64_t seed;                  /* dummy weights seed */
    uint32_t threads;               /* executor threads (default 1) */
    /* engine */
    uint32_t page_size;               /* default 16 */
    uint32_t max_total_tokens;        /* KV pool in tokens (default 65536) */
    uint32_t max_running_requests;    /* rows (default 64) */
    uint32_t max_queued_requests;     /* live requests in all (default 1024) */
    uint32_t chunked_prefill_size;    /* default 512 */
    uint32_t max_prompt_tokens;       /* default 8192 */
    uint32_t max_new_tokens_limit;    /* default 4096 */
    uint32_t host_cache_tokens;       /* host tier in tokens (default 0: off) */
    uint32_t optimistic_attempts;
    bool disable_overlap, disable_prefix_cache, strict;
    pd_node_violation_fn on_violation; /* strict: the first reports (the count goes on in
                                          /server_info and /metrics); NULL: none */
    void *on_violation_ctx;
    /* The request log: a line for every request that ends (or that submit
     * refuses) when log_requests, else only for those whose client hung up.
     * NULL on_log: none; the node prints nothing itself. */
    bool log_requests;
    pd_node_log_fn on_log;
    void *on_log_ctx;
    uint64_t bootstrap_timeout_ms;    /* default 30000 */
    uint64_t transfer_timeout_ms;     /* default 60000 */
    /* transport (prefill / decode) */
    const char *transfer_backend;     /* "loopback" (needs `loopback`) or "ucx" */
    pd_loopback_mt *loopback;         /* the in-process fabric shared with the peer node */
    /* prefill: where the bootstrap channel listens; NULL: `host`. Beyond
     * loopback it needs a token or insecure_bootstrap (pd_node_create refuses). */
    const char *bootstrap_host;
    uint16_t bootstrap_port;          /* prefill: default 8998; 0: any free port */
    const char *bootstrap_token;
    /* prefill, ucx: threads that copy a hand-off's puts of 4 MiB or more into
     * a decode node's shared memory on this host (pd_net_config.copy_threads;
     * 0: the transport's default, 2). */
    uint32_t transfer_copy_threads;
    /* decode: "host:port,host:port,..." of the prefill bootstrap channels a
     * request may name; a request naming any other is refused with 403 and
     * never contacted. NULL: any (a request decides where this node
     * connects, so set it wherever clients can reach the decode node). */
    const char *prefill_peers;
    /* prefill: listen beyond loopback without a token. */
    bool insecure_bootstrap;
    /* The longest prompt + max_new_tokens a request may ask for (SGLang's
     * --context-length); longer is a 400 naming it, a default max_new_tokens
     * is cut to fit. 0: no limit but the two above. */
    uint32_t context_length;
    /* Every request but OPTIONS, /health... and /metrics... must carry
     * "Authorization: Bearer api_key" (SGLang's --api-key), else 401. NULL
     * or "": none. */
    const char *api_key;
} pd_node_config;

void pd_node_config_default(pd_node_config *c, pd_node_role role);

typedef struct pd_node pd_node;

/* Loads the model, creates the engine, the executor and the transport.
 * Nothing runs yet. msg names the problem on failure. */
pd_err pd_node_create(pd_node **out, const pd_node_config *cfg, char *msg, size_t msg_cap);
/* Starts the threads and the HTTP server. */
pd_err pd_node_start(pd_node *n, char *msg, size_t msg_cap);
uint16_t pd_node_http_port(const pd_node *n);
uint16_t pd_node_bootstrap_port(const pd_node *n);
/* Stops accepting, aborts what is live, stops the threads, frees everything. */
void pd_node_destroy(pd_node *n);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_NODE_H */
