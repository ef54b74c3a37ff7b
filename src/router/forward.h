/*
 * One client request, forwarded: the same body to a prefill and a decode
 * node at once (two libcurl easy handles on one multi handle), the decode
 * node's answer back to the client, and an explicit /abort_request to every
 * half the router stops waiting for.
 *
 * The forward is driven by the client connection's own thread, in two
 * phases that mirror how an HTTP response goes out:
 *
 *   head     rt_fwd_head_wait runs both transfers until the client's status
 *            is decided: the decode node's complete answer (FULL), the
 *            start of its event stream (STREAM), a router-made error or
 *            abort answer (FULL or STREAM), or the client hung up (GONE).
 *   stream   rt_fwd_stream_read is the body of a STREAM response: it keeps
 *            driving the transfers and hands out complete SSE events only,
 *            so whatever goes wrong later the router can still end the
 *            stream cleanly — a final event with a finish_reason or an
 *            error event, then `data: [DONE]` — exactly once.
 *
 * While it waits it polls the client's socket too: a hang-up (recv with
 * MSG_PEEK reads end-of-file) ends the forward at once. Decisions, in
 * order: client gone → abort both; the decode node answered → its answer
 * (a failure after an /abort_request → the abort answer); the prefill node
 * failed first and the decode node has not answered within 250 ms (a decode
 * node that refused a request fails the prefill half through the room, and
 * its own answer says why) → abort the decode half, the prefill's error; past
 * the request timeout → abort both, 504; asked to abort (router-level
 * /abort_request) → the decode node gets abort_grace_ms to end the answer
 * itself (it normally does: it was told too), then abort both and answer
 * with finish_reason abort.
 *
 * Memory is bounded: a buffered answer by max_response_bytes, the event
 * stream by a fixed window (the decode transfer is paused while the client
 * is slower than the worker), the prefill node's answer by a small cap.
 */
#ifndef PDSERVE_ROUTER_FORWARD_H
#define PDSERVE_ROUTER_FORWARD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pdserve/base.h"
#include "workers.h"

typedef struct rt_fwd rt_fwd;

typedef enum rt_fwd_api { RT_FWD_GENERATE, RT_FWD_COMPLETIONS, RT_FWD_CHAT } rt_fwd_api;

typedef struct rt_fwd_params {
    rt_fwd_api api;
    const char *rid;
    const char *model;              /* completions: echoed in router-made answers */
    bool stream;
    char *body;                     /* for both workers; ownership moves to the forward */
    size_t body_len;
    const char *prefill_base;       /* "http://host:port" */
    const char *decode_base;
    int client_fd;                  /* the client's socket to watch, -1 = none */
    uint32_t timeout_ms;
    uint32_t connect_timeout_ms;
    uint32_t abort_timeout_ms;
    uint32_t abort_grace_ms;
    size_t max_response_bytes;
    const char *api_key; /* the workers' --api-key, NULL: none; outlives the forward */
} rt_fwd_params;

typedef enum rt_fwd_head_kind {
    RT_FWD_FULL,   /* send status + body */
    RT_FWD_STREAM, /* send status 200 + event stream read with rt_fwd_stream_read */
    RT_FWD_GONE,   /* the client hung up: send nothing, close */
} rt_fwd_head_kind;

typedef struct rt_fwd_head {
    rt_fwd_head_kind kind;
    unsigned status;
    const char *content_type;
    const char *body;               /* FULL; owned by the forward */
    size_t body_len;
} rt_fwd_head;

pd_err rt_fwd_create(rt_fwd **out, const rt_fwd_params *p, char *msg, size_t msg_cap);
/* Starts both halves and runs until the response's head is decided. */
void rt_fwd_head_wait(rt_fwd *f, rt_fwd_head *head);
/* The next bytes of a STREAM body: > 0 bytes written to buf, 0 at the end
 * of the stream, -1 when the client hung up. Blocks until one of those. */
long rt_fwd_stream_read(rt_fwd *f, char *buf, size_t max);
/* From any thread: a router-level /abort_request named this request. */
void rt_fwd_request_abort(rt_fwd *f);
/* From any thread: the router is stopping; end now with 503. */
/* The HTTP server saw the client hang up (any thread): like a hang-up seen
 * on client_fd, the forward aborts both halves and answers nobody. */
void rt_fwd_client_gone(rt_fwd *f);
void rt_fwd_request_shutdown(rt_fwd *f);
/* The client's exchange is over (answered, failed or gone): abort and close
 * whatever still runs. Idempotent. */
void rt_fwd_close(rt_fwd *f);

/* For the stats, after rt_fwd_close: the status the client got (499 for a
 * router-made abort answer, RT_STATUS_CLIENT_GONE = 0 for a hang-up),
 * whether a role's half failed (no answer, garbage, 5xx, timed out), how
 * many /abort_request POSTs were sent. */
unsigned rt_fwd_outcome(const rt_fwd *f);
bool rt_fwd_half_failed(const rt_fwd *f, rt_role role);
unsigned rt_fwd_aborts_sent(const rt_fwd *f);

void rt_fwd_destroy(rt_fwd *f);

#endif
