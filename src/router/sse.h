/*
 * sse — the router's reader of a decode node's event stream (text/event-stream),
 * apart from the sockets, so the rules a worker's bytes are judged by are
 * testable (and fuzzed, tests/fuzz/fuzz_sse.c) in isolation.
 *
 * One buffer of SSE_WINDOW bytes:
 *
 *     [0, ready)         complete events, checked, ready for the client
 *     [ready, len)       the start of an event still arriving
 *
 * rt_sse_scan moves `ready` over every complete event (ended by a blank
 * line, "\n\n" or "\r\n\r\n") and classifies it: "data: [DONE]" ends the
 * stream (nothing after it goes out); an event whose data is a JSON object
 * with a finish_reason (SGLang's meta_info or OpenAI's choices[0]) or an
 * "error" is the final answer (final_failed when it is an error or an abort
 * with a 5xx status_code); data that is not a JSON object is garbage, which
 * stops the scan for good.
 */
#ifndef PD_ROUTER_SSE_H
#define PD_ROUTER_SSE_H

#include <stdbool.h>
#include <stddef.h>

#define SSE_WINDOW (256u * 1024u) /* event stream window; one event must fit */

typedef struct rt_sse {
    char *buf; /* SSE_WINDOW bytes, the caller's */
    size_t len, ready, scanned;
    bool saw_final, saw_done, garbage;
    /* The final event is a failure (an error object, or finish_reason abort
     * with a status_code of 500 or more), and where it starts in buf. */
    bool final_failed;
    size_t final_at;
} rt_sse;

void rt_sse_scan(rt_sse *s);

#endif /* PD_ROUTER_SSE_H */
