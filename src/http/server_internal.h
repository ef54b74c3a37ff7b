/*
 * The HTTP server's insides, shared by its three files and by the fuzz
 * target (tests/fuzz/fuzz_http_request.c):
 *
 *   reqparse.c  bytes -> a request or a refusal (llhttp and our checks), no I/O
 *   request.c   the request handle: getters, answers serialised to bytes,
 *               the reference count and the cross-thread contract
 *   server.c    the event loop: sockets, deadlines, caps, the output queue
 *
 * The parse step is a pure function of the bytes fed to it, so the fuzz
 * target drives exactly what a connection runs, without a socket.
 */
#ifndef PD_HTTP_SERVER_INTERNAL_H
#define PD_HTTP_SERVER_INTERNAL_H

#include <llhttp.h>
#include <pthread.h>
#include <stdatomic.h>

#include "pdserve/http_server.h"

/* ---- a growable byte buffer (the output queue, a body) ----------------- */

typedef struct http_buf {
    char *data;
    size_t len, cap;
} http_buf;

/* Appends n bytes; false (buffer unchanged) when memory ran out. */
bool http_buf_append(http_buf *b, const void *p, size_t n);
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
bool http_buf_printf(http_buf *b, const char *fmt, ...);
/* Drops the first n bytes. */
void http_buf_consume(http_buf *b, size_t n);
void http_buf_free(http_buf *b);

/* ---- the parse step ------------------------------------------------------ */

typedef struct http_limits {
    uint32_t header_bytes_max;
    uint32_t headers_max;
    uint64_t body_bytes_max;
} http_limits;

typedef enum http_feed {
    HTTP_FEED_MORE,    /* every byte given was taken; the request needs more */
    HTTP_FEED_HEADERS, /* the header block is complete and valid; a body may follow */
    HTTP_FEED_DONE,    /* a whole request: http_reqparse_take it */
    HTTP_FEED_ERROR,   /* refused: err_status and err_msg; the connection must close */
} http_feed;

/* A header field as offsets into the head arena: name\0value\0. */
typedef struct http_header {
    uint32_t name, value;
} http_header;

#define HTTP_ERR_MSG_MAX 256

typedef struct http_reqparse {
    llhttp_t ll;
    http_limits lim;
    /* The request being read. The head arena holds the target, then each
     * header's name and value, each NUL-terminated; it is sized so that a
     * header block within header_bytes_max always fits (asserted). */
    char *head;
    uint32_t head_len, head_cap;
    uint32_t target_len;
    http_header *headers;
    uint32_t headers_n;
    uint32_t mark;        /* where the header name being read starts */
    uint32_t header_seen; /* raw bytes of this request's header block so far */
    http_buf body;
    uint64_t body_seen; /* body-phase bytes: the body, chunk extensions, trailers */
    uint8_t content_lengths, transfer_encodings, hosts;
    bool in_body;         /* the header block is complete */
    bool paused;          /* llhttp was paused at the last event; resume first */
    bool expect_continue; /* the client waits for 100 Continue before its body */
    bool keep_alive;      /* decided at the end of the request */
    bool failed;
    unsigned err_status;
    char err_msg[HTTP_ERR_MSG_MAX];
} http_reqparse;

pd_err http_reqparse_init(http_reqparse *p, const http_limits *lim);
void http_reqparse_free(http_reqparse *p);
/* Feeds up to len bytes; returns how many were taken and sets *ev. Call it
 * again (with what is left, even nothing) after HEADERS; after DONE, call
 * http_reqparse_take, then feed the rest. Nothing after ERROR. */
size_t http_reqparse_feed(http_reqparse *p, const char *data, size_t len, http_feed *ev);
/* True once a byte of the next request has been taken. */
bool http_reqparse_started(const http_reqparse *p);
/* After DONE: the request as a new handle (one reference, the caller's),
 * owning a copy of everything; NULL when memory ran out. The parser is ready
 * for the next request. */
pd_http_req *http_reqparse_take(http_reqparse *p);

/* ---- the handle ---------------------------------------------------------- */

struct http_loop;

#define HTTP_EXTRA_HEADERS_MAX 1024u

struct pd_http_req {
    /* Immutable once on_request runs: read from any thread. */
    const char *method;
    const char *path, *query;
    const char *head; /* the arena, as in http_reqparse */
    const http_header *headers;
    uint32_t headers_n;
    char *body;
    size_t body_len;
    uint8_t version_minor;
    bool head_only;  /* HEAD: the answer has no body */
    bool keep_alive; /* the client allows another request on this connection */
    char client[64];

    atomic_uint refs;
    pthread_mutex_t mu;
    /* Under mu. loop and conn are set while the connection waits for this
     * answer (attached); the loop clears them when the answer ended or the
     * connection did, and only the loop thread changes them. */
    struct http_loop *loop;
    uint32_t conn;
    http_buf pending;    /* answer bytes the loop has not taken yet */
    uint64_t out_unsent; /* the connection's unsent bytes, as the loop last saw */
    uint64_t watermark;  /* output_watermark_bytes */
    bool begun, ended;   /* the head was queued; the answer is complete */
    bool chunked;        /* a stream in chunked encoding (HTTP/1.1) */
    bool close_after;    /* Connection: close; the connection ends after this answer */
    bool gone;           /* the connection ended before the answer */
    bool queued;         /* on the loop's ready list */
    bool congested;      /* a stream_write was refused; WRITABLE is owed */
    char extra[HTTP_EXTRA_HEADERS_MAX];
    size_t extra_len;
    pd_http_req_watch_fn watch;
    void *watch_user;
    uint32_t calling;         /* watch callbacks running now (on the loop thread) */
    pthread_t calling_thread; /* the thread running them */
    pthread_cond_t called;    /* signalled when calling drops to 0 */
    pd_http_req *ready_next;  /* the loop's ready list (under the loop's lock) */
};

/* The loop's side of the contract (server.c): put an attached handle on the
 * ready list and wake the loop. Called with r->mu held, r->loop set. */
void http_loop_post(struct http_loop *loop, pd_http_req *r);

/* The loop's half of the handle (request.c), all on the loop thread:
 * attach when dispatching (close_after: the server is stopping); detach when
 * the answer ended or the connection did (the watch sees GONE if the answer
 * had not ended); take moves pending bytes to out (the connection's queue;
 * NULL: the handle is detached, only clear `queued`) and returns 1, or 0 when
 * detached, or -1 when out of memory; set_unsent reports the connection's
 * unsent bytes (and owes WRITABLE); close_after marks the answer's head. */
void http_req_attach(pd_http_req *r, struct http_loop *loop, uint32_t conn, uint64_t watermark,
                     bool close_after);
void http_req_detach(pd_http_req *r);
int http_req_take(pd_http_req *r, http_buf *out, bool *ended, bool *close_after);
void http_req_set_unsent(pd_http_req *r, uint64_t unsent);
void http_req_close_after(pd_http_req *r);

/* An answer the server makes itself: the JSON error body with Connection:
 * close, NUL-terminated (*len does not count the NUL). NULL when memory ran
 * out. */
char *http_error_response(unsigned status, const char *message, size_t *len);
/* The reason phrase of a status ("Not Found"). */
const char *http_status_reason(unsigned status);

#endif
