/* The router's reader of a decode node's event stream (src/router/sse.c),
 * driven the way the forward drives it: the first byte sets the size of the
 * chunks the "network" delivers, each chunk is appended to the window (after
 * the client took the complete events, when it would not fit), then
 * scanned. Checks what the client may rely on: only whole events go out
 * (every piece handed to the client ends with a blank line), nothing goes
 * out after [DONE] or after garbage, and the window's marks stay in order. */
#include <stdlib.h>
#include <string.h>

#include "../../src/router/sse.h"
#include "fuzz.h"
#include "pdserve/base.h"

static void check_marks(const rt_sse *s) {
    PD_ASSERT(s->ready <= s->len && s->len <= SSE_WINDOW);
    PD_ASSERT(s->scanned <= s->len && s->ready <= s->scanned);
    if (s->saw_done) PD_ASSERT(s->len == s->ready);
}

/* The client takes every complete event, as rt_fwd_stream_read does. */
static void consume(rt_sse *s) {
    if (s->ready == 0) return;
    const char *end = s->buf + s->ready;
    PD_ASSERT(s->ready >= 2 && end[-1] == '\n');
    PD_ASSERT(end[-2] == '\n' || (s->ready >= 4 && !memcmp(end - 4, "\r\n\r\n", 4)));
    memmove(s->buf, s->buf + s->ready, s->len - s->ready);
    s->len -= s->ready;
    s->scanned -= s->ready;
    s->ready = 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    size_t chunk = 1 + (size_t)data[0] * 64;
    rt_sse s = {.buf = malloc(SSE_WINDOW)};
    if (!s.buf) return 0;
    for (size_t off = 1; off < size && !s.saw_done && !s.garbage;) {
        size_t n = PD_MIN(chunk, size - off);
        if (n > SSE_WINDOW - s.len) {
            rt_sse_scan(&s);
            consume(&s);
            if (n > SSE_WINDOW - s.len) break; /* one event larger than the window */
        }
        memcpy(s.buf + s.len, data + off, n);
        s.len += n;
        off += n;
        rt_sse_scan(&s);
        check_marks(&s);
        consume(&s);
    }
    check_marks(&s);
    free(s.buf);
    return 0;
}
