/*
 * One client request, forwarded: the same body to a prefill and a decode
 * node at once (two libcurl easy handles on one multi handle), the decode
 * node's answer back to the client, and an explicit /abort_request to every
 * half the router stops waiting for.
 *
 * The forward is a task of the router's event loop (loop.h): it never
 * blocks and has no thread; the loop steps it whenever one of its transfers
 * moved, another thread poked it, or a deadline came. It answers through a
 * sink, in the two phases an HTTP response goes out in:
 *
 *   head     sink.head once the client's status is decided: the decode
 *            node's complete answer (FULL), the start of its event stream
 *            (STREAM), a router-made error or abort answer (FULL or
 *            STREAM), or the client hung up (GONE).
 *   stream   the body of a STREAM response goes to sink.data as complete
 *            SSE events only, so whatever goes wrong later the router can
 *            still end the stream cleanly — a final event with a
 *            finish_reason or an error event, then `data: [DONE]` —
 *            exactly once.
 *   end      sink.end, last and once: nothing of the forward runs any more
 *            (no transfer, no abort in flight); the sink may destroy it.
 *
 * Decisions, in order: client gone (the server's rt_fwd_client_gone, or a
 * refused write) → abort both; the decode node answered → its answer (a
 * failure after an /abort_request → the abort answer); the prefill node
 * failed first and the decode node has not answered within 250 ms (a decode
 * node that refused a request fails the prefill half through the room, and
 * its own answer says why) → abort the decode half, the prefill's error; past
 * the request timeout → abort both, 504; asked to abort (router-level
 * /abort_request) → the decode node gets abort_grace_ms to end the answer
 * itself (it normally does: it was told too), then abort both and answer
 * with finish_reason abort. An answer decided together with an
 * /abort_request to a worker is handed to the sink only once that POST is
 * back, so a client that has its answer knows the workers were told.
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

#include "loop.h"
#include "pdserve/base.h"
#include "workers.h"

typedef struct rt_fwd rt_fwd;

typedef enum rt_fwd_api { RT_FWD_GENERATE, RT_FWD_COMPLETIONS, RT_FWD_CHAT } rt_fwd_api;

typedef enum rt_fwd_head_kind {
    RT_FWD_FULL,   /* send status + body */
    RT_FWD_STREAM, /* send status 200, then the event stream from sink.data */
    RT_FWD_GONE,   /* the client hung up: send nothing, close */
} rt_fwd_head_kind;

typedef struct rt_fwd_head {
    rt_fwd_head_kind kind;
    unsigned status;
    const char *content_type;
    const char *body; /* FULL; owned by the forward */
    size_t body_len;
} rt_fwd_head;

/* The forward's answers, on the loop thread. */
typedef struct rt_fwd_sink {
    void (*head)(void *user, const rt_fwd_head *head);
    /* Stream bytes: 0 taken whole, 1 refused whole (the client is behind:
     * call rt_fwd_writable once it caught up), -1 the client is gone. */
    int (*data)(void *user, const char *buf, size_t n);
    void (*end)(void *user);
    void *user;
} rt_fwd_sink;

typedef struct rt_fwd_params {
    rt_fwd_api api;
    const char *rid;
    const char *model;              /* completions: echoed in router-made answers */
    bool stream;
    char *body;                     /* for both workers; ownership moves to the forward */
    size_t body_len;
    const char *prefill_base;       /* "http://host:port" */
    const char *decode_base;
    rt_loop *loop;
    rt_fwd_sink sink;
    uint32_t timeout_ms;
    uint32_t connect_timeout_ms;
    uint32_t abort_timeout_ms;
    uint32_t abort_grace_ms;
    size_t max_response_bytes;
    const char *api_key; /* the workers' --api-key, NULL: none; outlives the forward */
    /* A stream goes through the decode node's feed on this loop when it is
     * open (feed.h): submitted with the feed's id and a tag naming `slot`,
     * its events then come from the feed. NULL: the direct path. */
    struct rt_feed *feed;
    uint32_t slot; /* the router's request slot, unique among live requests */
} rt_fwd_params;

pd_err rt_fwd_create(rt_fwd **out, const rt_fwd_params *p, char *msg, size_t msg_cap);
/* From any thread, once: the loop starts both halves. After it, only the
 * sink's calls and the functions below may touch the forward. */
void rt_fwd_start(rt_fwd *f);
/* From any thread: a router-level /abort_request named this request. */
void rt_fwd_request_abort(rt_fwd *f);
/* From any thread: the server saw the client hang up: the forward aborts
 * both halves and answers nobody. */
void rt_fwd_client_gone(rt_fwd *f);
/* From any thread: the client took its backlog after a refused write. */
void rt_fwd_writable(rt_fwd *f);
/* From any thread: the router is stopping; end now with 503. */
void rt_fwd_request_shutdown(rt_fwd *f);

/* For the stats, once ended (sink.end): the status the client got (499 for a
 * router-made abort answer, RT_STATUS_CLIENT_GONE = 0 for a hang-up),
 * whether a role's half failed (no answer, garbage, 5xx, timed out), how
 * many /abort_request POSTs were sent. */
unsigned rt_fwd_outcome(const rt_fwd *f);
bool rt_fwd_half_failed(const rt_fwd *f, rt_role role);
unsigned rt_fwd_aborts_sent(const rt_fwd *f);

/* Loop thread, from the forward's feed (feed.h): bytes of the next events
 * of its stream (a chunk may end anywhere), and the feed's end (D3). */
void rt_fwd_feed_bytes(rt_fwd *f, const char *buf, size_t n);
void rt_fwd_feed_lost(rt_fwd *f);
/* Whether the stream went through a feed (known once it started). */
bool rt_fwd_fed(const rt_fwd *f);

/* After sink.end, or when it was never started. */
void rt_fwd_destroy(rt_fwd *f);

#endif
