/*
 * rt_feed — one stream feed: a long-lived GET /stream_feed to a decode node,
 * run on one upstream loop, that carries the events of many streaming
 * requests (docs/router.md#stream-feeds, docs/http-api.md#stream-feeds).
 * Without it the router holds one upstream connection per stream for the
 * stream's whole life; with it, one per (loop, decode node).
 *
 * A request sent through a feed is submitted with "stream_feed": the
 * feed's id (the node's X-Stream-Feed header) and "stream_feed_tag":
 * "<slot>.<seq>", the router's request slot and a number this feed never
 * gave before. The node answers the submit 202 and writes each event of the
 * request to the feed as a frame, "id: <tag>\n" followed by the event
 * (`data: ...\n\n`). The feed splits frames on that line and the blank line
 * that ends the event, never parsing the JSON, and hands each event's bytes
 * to the forward whose slot and seq the tag names (rt_fwd_feed_bytes).
 *
 * Invariants:
 *   D1  Only the loop thread touches a feed after rt_feed_start, except the
 *       atomic `open` (read by /server_info) and the stop handshake.
 *   D2  slots[i].fwd is the forward attached under slot i with slots[i].seq,
 *       or NULL. A frame whose tag does not name an attached forward (one that
 *       ended: its request was aborted, its trailing events still come) is
 *       dropped: a tag is never reused, so it cannot reach a later request.
 *   D3  When the feed's transfer ends (the node closed it, died, or sent a
 *       frame that breaks the format) every attached forward is told once
 *       (rt_fwd_feed_lost) and detached; the feed reopens after a pause.
 *   D4  A worker that answers /stream_feed 404 or 405 (SGLang) has no
 *       feeds; it is asked again only after RT_FEED_RETRY_UNSUPPORTED_MS.
 *       Any other answer but 200 with an id (a busy node's 503) is retried
 *       after RT_FEED_RETRY_MS. Meanwhile its streams take the direct path.
 */
#ifndef PD_ROUTER_FEED_H
#define PD_ROUTER_FEED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "loop.h"
#include "pdserve/base.h"

#define RT_FEED_RETRY_MS 1000u                     /* after a feed dropped */
#define RT_FEED_RETRY_UNSUPPORTED_MS (30u * 1000u) /* after a 404 (D4) */
#define RT_FEED_ID_MAX 64u
#define RT_FEED_TAG_MAX 48u

typedef struct rt_feed rt_feed;
struct rt_fwd;

typedef struct rt_feed_params {
    rt_loop *loop;
    const char *base;    /* the decode node's "http://host:port"; outlives the feed */
    const char *api_key; /* outlives the feed; NULL or "": none */
    uint32_t connect_timeout_ms;
    uint32_t slots; /* the router's request slots: a tag names one of them */
} rt_feed_params;

pd_err rt_feed_create(rt_feed **out, const rt_feed_params *p, char *msg, size_t msg_cap);
/* Any thread, once: the loop opens the feed (and reopens it, D3). */
void rt_feed_start(rt_feed *fd);
/* Any thread but the loop's: the loop closes the feed, then it is freed.
 * Every forward must have detached. NULL is a no-op. */
void rt_feed_destroy(rt_feed *fd);
/* Any thread: open (an id known, frames flowing). */
bool rt_feed_is_open(const rt_feed *fd);

/* Loop thread: attaches f under slot when the feed is open; fills the id
 * and the tag the submit must carry. False: take the direct path. */
bool rt_feed_attach(rt_feed *fd, uint32_t slot, struct rt_fwd *f, char *id, char *tag);
/* Loop thread: f takes no more events (D2); a no-op when not attached. */
void rt_feed_detach(rt_feed *fd, uint32_t slot, const struct rt_fwd *f);

#endif /* PD_ROUTER_FEED_H */
