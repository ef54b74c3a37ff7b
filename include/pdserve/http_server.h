/*
 * pd_http_server — the project's own HTTP/1.1 server: one epoll event loop
 * on one thread, requests parsed by llhttp (Node.js's parser) in strict mode.
 * docs/http-server.md says why it exists (libmicrohttpd answers malformed
 * requests with fixed HTML and has no header or body deadline) and gives the
 * limits and their defaults.
 *
 * What it promises:
 *   S1  Every answer the server itself makes (a malformed request, a limit,
 *       a deadline, a full house) is the project's JSON error body
 *       (pd_http_error_body) with Content-Type application/json, followed
 *       by Connection: close and the end of the connection.
 *   S2  Every connection is bounded in time: the header block must arrive
 *       within header_timeout_ms (from accept for the first request, from
 *       its first byte after that), the body within body_timeout_ms of the
 *       headers, a keep-alive connection may sit idle idle_timeout_ms, and a
 *       response that the client does not read for write_timeout_ms ends it.
 *       A request being handled has no deadline: the handler owns its time.
 *   S3  Every connection is bounded in memory: header_bytes_max and
 *       headers_max for the header block, body_bytes_max for the body
 *       (decided from Content-Length before a byte of it is read, and as a
 *       chunked body grows), and the output backlog through the watermark.
 *   S4  Requests of one connection are answered in the order they came:
 *       the next pipelined request is parsed only once the response to the
 *       one before it has ended.
 *
 * Handlers and handles. on_request runs on the loop thread with a
 * pd_http_req, and must not block: it either answers at once
 * (pd_http_req_respond and friends) or takes a reference
 * (pd_http_req_retain) and answers later from any thread. A handle owns a
 * copy of the request (method, path, query, headers, body), so every getter
 * is safe from any thread while a reference is held. Answering functions may
 * be called from any thread; they queue bytes and wake the loop. Once the
 * client is gone (hang-up, deadline, server stopped) they return
 * PD_ERR_STATE and do nothing: the handle stays valid, whatever happened to
 * the connection, until its last reference is released.
 */
#ifndef PDSERVE_HTTP_SERVER_H
#define PDSERVE_HTTP_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pdserve/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_http_server pd_http_server;
typedef struct pd_http_req pd_http_req;

/* Called on the loop thread for each complete, valid request. `r` is
 * borrowed for the duration of the call; retain it to answer later. */
typedef void (*pd_http_on_request)(pd_http_req *r, void *user);

typedef struct pd_http_server_config {
    const char *host;                /* numeric or name, IPv4 or IPv6; default "127.0.0.1" */
    uint16_t port;                   /* 0: an ephemeral port (pd_http_server_port says which) */
    uint32_t connections_max;        /* open client connections (1024) */
    uint32_t connections_per_ip_max; /* of them from one address (256) */
    uint32_t header_bytes_max;       /* request line + headers (16 KiB); 431 over */
    uint32_t headers_max;            /* header fields (100); 431 over */
    uint64_t body_bytes_max;         /* body after chunked decoding (1 MiB); 413 over */
    uint32_t header_timeout_ms;      /* 10 s; 408 */
    uint32_t body_timeout_ms;        /* 30 s; 408 */
    uint32_t idle_timeout_ms;        /* between keep-alive requests (60 s); closed silently */
    uint32_t write_timeout_ms;       /* no byte of a response taken for this long (30 s) */
    uint32_t linger_ms;              /* reading what the client still sends after a final
                                        answer, so the answer is not lost to a reset (2 s) */
    uint32_t stop_grace_ms;          /* how long stop lets answers in flight finish (5 s) */
    uint64_t output_watermark_bytes; /* stream_write refuses over this backlog (1 MiB) */
    pd_http_on_request on_request;
    void *user;
} pd_http_server_config;

void pd_http_server_config_default(pd_http_server_config *c);

/* Binds, listens and starts the loop thread. Fails (PD_ERR_IO, message in
 * msg) when the address is in use or cannot be resolved; PD_ERR_INVALID for a
 * configuration without on_request or with a zero limit. */
pd_err pd_http_server_start(pd_http_server **out, const pd_http_server_config *c, char *msg,
                            size_t msg_cap);
/* The port it listens on (the ephemeral one when the config said 0). */
uint16_t pd_http_server_port(const pd_http_server *s);
/* Stops accepting, closes idle connections, lets answers in flight end for
 * up to stop_grace_ms, cuts the rest (their handles see GONE), joins the
 * thread and frees the server. Handles still referenced stay valid. Never
 * from the loop thread (a handler or a watch callback). NULL is a no-op. */
void pd_http_server_stop(pd_http_server *s);

/* ---- the request: read from any thread while holding a reference -------- */

void pd_http_req_retain(pd_http_req *r);
void pd_http_req_release(pd_http_req *r);

const char *pd_http_req_method(const pd_http_req *r); /* "GET", "POST", ... */
/* The path, percent-decoded (a path holding %00 never gets here), without
 * the query. */
const char *pd_http_req_path(const pd_http_req *r);
/* What followed '?', as sent (not decoded); "" when nothing did. */
const char *pd_http_req_query(const pd_http_req *r);
/* The first header of that name (ASCII case-insensitive), or NULL. */
const char *pd_http_req_header(const pd_http_req *r, const char *name);
/* The body, NUL-terminated (the NUL is not counted); "" when there is none. */
const char *pd_http_req_body(const pd_http_req *r, size_t *len);
/* 0 for HTTP/1.0, 1 for HTTP/1.1. */
unsigned pd_http_req_version_minor(const pd_http_req *r);
/* The client's address, numeric ("127.0.0.1", "::1"). */
const char *pd_http_req_client(const pd_http_req *r);

/* ---- answering: from any thread ------------------------------------------
 * Each returns PD_OK when queued; PD_ERR_STATE when the client is gone or
 * the call is out of order (a second answer, a write before stream_begin);
 * PD_ERR_INVALID for a status outside 200..599 or a header that would break
 * the framing; PD_ERR_NOMEM when memory ran out. */

/* Adds a header to the answer still to begin (Allow for a 405, say); at
 * most 1 KiB of them in all. */
pd_err pd_http_req_add_header(pd_http_req *r, const char *name, const char *value);
/* A complete answer with Content-Length. content_type may be NULL. */
pd_err pd_http_req_respond(pd_http_req *r, unsigned status, const char *content_type,
                           const void *body, size_t len);
pd_err pd_http_req_respond_json(pd_http_req *r, unsigned status, const char *json, size_t len);
/* The project's error body (pd_http_error_body) with that status. */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
pd_err
pd_http_req_respond_error(pd_http_req *r, unsigned status, const char *fmt, ...);

/* A streamed answer: chunked for HTTP/1.1, delimited by the end of the
 * connection for HTTP/1.0. stream_write of zero bytes does nothing.
 * stream_write returns PD_ERR_NOMEM, queueing nothing, while the
 * connection's unsent output is at or over output_watermark_bytes: keep the
 * chunk and retry after PD_HTTP_REQ_WRITABLE (or give up and end). */
pd_err pd_http_req_stream_begin(pd_http_req *r, unsigned status, const char *content_type);
pd_err pd_http_req_stream_write(pd_http_req *r, const void *data, size_t len);
pd_err pd_http_req_stream_end(pd_http_req *r);

/* The API key check of a server started with one (pdserve/http.h): true
 * when r may go on (api_key NULL or empty, an exempt route, or the right
 * Bearer token); otherwise answers 401 with WWW-Authenticate: Bearer and
 * returns false. On the loop thread, before anything else looks at r. */
bool pd_http_req_authorize(pd_http_req *r, const char *api_key);

/* ---- what happens to the client ------------------------------------------ */

typedef enum pd_http_req_event {
    PD_HTTP_REQ_GONE,     /* the connection ended before the answer did */
    PD_HTTP_REQ_WRITABLE, /* after a refused stream_write: the backlog fell under half */
} pd_http_req_event;

typedef void (*pd_http_req_watch_fn)(pd_http_req *r, pd_http_req_event ev, void *user);

/* Sets the callback for the events above. It runs on the loop thread, must
 * not block, and may call any answering function (GONE: they return
 * PD_ERR_STATE). If the client is already gone when it is set, it runs at
 * once, on the calling thread. fn NULL clears it, and returns only once no
 * callback runs any more (unless called from inside one): after it, the
 * callback's user data may be freed. */
void pd_http_req_watch(pd_http_req *r, pd_http_req_watch_fn fn, void *user);
/* True once the connection ended before the answer did (poll-able). */
bool pd_http_req_gone(pd_http_req *r);
/* Bytes of this connection's answer not yet taken by the kernel. */
uint64_t pd_http_req_backlog_bytes(pd_http_req *r);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_HTTP_SERVER_H */
