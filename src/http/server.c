/*
 * server.c — the event loop: one thread, one epoll set, level-triggered,
 * holding the listening socket, an eventfd for cross-thread wake-ups and
 * every client connection in a fixed table sized at start.
 *
 * A connection moves through phases, and each phase has at most one
 * deadline, kept on the list of its kind:
 *
 *   IDLE      keep-alive, no byte of the next request yet   idle_timeout_ms
 *   HEADERS   reading a header block                        header_timeout_ms (408)
 *   BODY      reading a body                                body_timeout_ms (408)
 *   HANDLING  a handle is attached; the handler owns time   none
 *   CLOSING   a final answer is queued, being written       none (write deadline)
 *   LINGER    written and shut for writing; reading what    linger_ms
 *             the client still sends until it closes
 *
 * Every deadline of a kind has the same duration and starts when it is set,
 * so a list kept in the order deadlines were set is sorted by deadline: the
 * head is the next to expire, setting is a push to the tail, and all of it
 * is O(1) (the trick of libev's and nginx's same-timeout lists). The write
 * deadline (write_timeout_ms after the last byte the kernel took, while
 * output is unsent) has a list of its own, since it runs alongside phases.
 *
 * Invariants:
 *   L1  A connection is on at most one phase list, the one of its phase; on
 *       the write list exactly while it has unsent output.
 *   L2  A used slot is counted (in the per-address index, in `live`) unless
 *       it is rejecting: over a cap it holds one of HTTP_REJECT_SLOTS spare
 *       slots just long enough to say 503.
 *   L3  conn.req is set exactly in HANDLING; the handle is attached to this
 *       loop and slot (request.c's H1).
 *   L4  Epoll events carry (generation << 32 | slot): an event for a slot
 *       closed and reused within one batch is recognised and dropped.
 *
 * Close-after-answer ends in a lingering close: shut for writing, then read
 * and drop until the client closes or linger_ms passes. Closing with unread
 * input would make the kernel send a reset, which can destroy the answer
 * (a 413 sent while the client is still sending its body) before the client
 * reads it.
 *
 * More loops later: each would own a table, an epoll set and an eventfd,
 * and accept from the one listening socket (EPOLLEXCLUSIVE); the per-address
 * counts would then move to a table shared under a lock.
 */
#define _GNU_SOURCE /* accept4 */
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "pdserve/index.h"
#include "pdserve/list.h"
#include "server_internal.h"

#define HTTP_INBUF_BYTES 16384u  /* one read; pipelined bytes wait here */
#define HTTP_REJECT_SLOTS 64u    /* spare slots to say 503 in */
#define HTTP_ACCEPT_BATCH 64     /* accepts per wake-up, for fairness */
#define HTTP_EVENTS_MAX 128      /* epoll events per wait */
#define HTTP_ACCEPT_PAUSE_MS 100 /* out of descriptors: stop accepting this long */

#define TAG_LISTEN UINT64_MAX
#define TAG_WAKE (UINT64_MAX - 1)

typedef enum conn_phase {
    PH_FREE,
    PH_IDLE,
    PH_HEADERS,
    PH_BODY,
    PH_HANDLING,
    PH_CLOSING,
    PH_LINGER
} conn_phase;

/* The phase lists; PH_HANDLING and PH_CLOSING have none. */
enum { T_IDLE, T_HEADER, T_BODY, T_LINGER, T_COUNT, T_NONE = T_COUNT };

typedef struct conn {
    int fd;
    uint32_t gen;
    conn_phase phase;
    uint8_t timer; /* T_*: the list it is on */
    bool rejecting, read_eof, on_write_list;
    uint32_t events; /* what epoll watches now */
    uint8_t ip[16];  /* IPv4 as ::ffff:a.b.c.d */
    char client[64];
    pd_link timer_link, write_link, free_link;
    uint64_t deadline_ms, write_deadline_ms;
    http_reqparse parse;
    char *in;
    uint32_t in_len;
    http_buf out;
    size_t out_off; /* out.data[out_off..len) is unsent */
    pd_http_req *req;
} conn;

typedef struct http_loop {
    const pd_http_server_config *cfg;
    int epfd, wakefd, listenfd;
    pthread_t thread;
    pthread_t tid; /* the loop thread, as it sees itself */
    conn *conns;
    uint32_t slots;
    pd_list free_slots, timers[T_COUNT], writes;
    pd_index by_ip;
    uint32_t live, rejecting;
    pthread_mutex_t mu; /* the ready list */
    pd_http_req *ready_head, *ready_tail;
    atomic_bool stop_requested;
    bool stopping;
    uint64_t stop_deadline_ms, accept_resume_ms;
} http_loop;

struct pd_http_server {
    pd_http_server_config cfg;
    char host[256];
    uint16_t port;
    http_loop loop;
};

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static uint32_t slot_of(const http_loop *l, const conn *c) { return (uint32_t)(c - l->conns); }
static pd_links timer_links(http_loop *l) { return PD_LINKS(l->conns, conn, timer_link); }
static pd_links write_links(http_loop *l) { return PD_LINKS(l->conns, conn, write_link); }
static size_t unsent(const conn *c) { return c->out.len - c->out_off; }

/* ---- deadlines ------------------------------------------------------------------- */

static uint32_t timer_ms(const http_loop *l, int kind) {
    switch (kind) {
    case T_IDLE: return l->cfg->idle_timeout_ms;
    case T_HEADER: return l->cfg->header_timeout_ms;
    case T_BODY: return l->cfg->body_timeout_ms;
    default: return l->cfg->linger_ms;
    }
}

static void timer_clear(http_loop *l, conn *c) {
    if (c->timer == T_NONE) return;
    pd_list_remove(&l->timers[c->timer], timer_links(l), slot_of(l, c));
    c->timer = T_NONE;
}

/* L1: pushing to the tail keeps the list sorted (one duration per list). */
static void timer_set(http_loop *l, conn *c, int kind) {
    timer_clear(l, c);
    c->timer = (uint8_t)kind;
    c->deadline_ms = now_ms() + timer_ms(l, kind);
    pd_list_push_back(&l->timers[kind], timer_links(l), slot_of(l, c));
}

static void write_timer_update(http_loop *l, conn *c, bool progress) {
    bool want = unsent(c) > 0;
    if (c->on_write_list && (!want || progress)) {
        pd_list_remove(&l->writes, write_links(l), slot_of(l, c));
        c->on_write_list = false;
    }
    if (want && !c->on_write_list) {
        c->write_deadline_ms = now_ms() + l->cfg->write_timeout_ms;
        pd_list_push_back(&l->writes, write_links(l), slot_of(l, c));
        c->on_write_list = true;
    }
}

static void enter(http_loop *l, conn *c, conn_phase ph) {
    c->phase = ph;
    switch (ph) {
    case PH_IDLE: timer_set(l, c, T_IDLE); break;
    case PH_HEADERS: timer_set(l, c, T_HEADER); break;
    case PH_BODY: timer_set(l, c, T_BODY); break;
    case PH_LINGER: timer_set(l, c, T_LINGER); break;
    default: timer_clear(l, c); break;
    }
}

/* ---- the per-address index ------------------------------------------------------- */

static uint64_t ip_hash(const uint8_t ip[16]) {
    uint64_t a, b;
    memcpy(&a, ip, 8);
    memcpy(&b, ip + 8, 8);
    return pd_hash_u64(a ^ pd_hash_u64(b));
}

static uint64_t slot_ip_hash(const void *ctx, uint32_t slot) {
    const http_loop *l = ctx;
    return ip_hash(l->conns[slot].ip);
}

static uint32_t ip_count(const http_loop *l, const uint8_t ip[16]) {
    uint32_t n = 0;
    pd_index_probe p;
    for (uint32_t v = pd_index_first(&l->by_ip, ip_hash(ip), &p); v != PD_NONE;
         v = pd_index_next(&l->by_ip, &p))
        if (!memcmp(l->conns[v].ip, ip, 16)) n++;
    return n;
}

/* ---- epoll ----------------------------------------------------------------------- */

/* Input is dropped once a final answer is queued; before, it waits in the
 * buffer while there is room. */
static bool discarding(const conn *c) { return c->phase == PH_CLOSING || c->phase == PH_LINGER; }
static bool has_room(const conn *c) { return discarding(c) || c->in_len < HTTP_INBUF_BYTES; }

static uint32_t wanted_events(const conn *c) {
    uint32_t ev = 0;
    if (!c->read_eof) ev |= EPOLLRDHUP | (has_room(c) ? EPOLLIN : 0);
    if (unsent(c) > 0) ev |= EPOLLOUT;
    return ev;
}

static void epoll_sync(http_loop *l, conn *c) {
    uint32_t ev = wanted_events(c);
    if (ev == c->events) return;
    struct epoll_event e = {.events = ev, .data.u64 = (uint64_t)c->gen << 32 | slot_of(l, c)};
    int rc = epoll_ctl(l->epfd, EPOLL_CTL_MOD, c->fd, &e);
    PD_ASSERT(rc == 0);
    c->events = ev;
}

/* ---- closing ----------------------------------------------------------------------- */

static void conn_close(http_loop *l, conn *c) {
    PD_ASSERT(c->phase != PH_FREE);
    pd_http_req *r = c->req;
    c->req = NULL;
    if (r) {
        http_req_detach(r); /* the watch sees GONE if the answer had not ended */
        pd_http_req_release(r);
    }
    timer_clear(l, c);
    c->out.len = c->out_off = 0;
    write_timer_update(l, c, false);
    if (c->rejecting) {
        l->rejecting--;
    } else {
        pd_index_remove(&l->by_ip, ip_hash(c->ip), slot_of(l, c));
        l->live--;
    }
    close(c->fd);
    http_reqparse_free(&c->parse);
    free(c->in);
    http_buf_free(&c->out);
    uint32_t gen = c->gen + 1;
    *c = (conn){.fd = -1, .gen = gen, .phase = PH_FREE, .timer = T_NONE};
    pd_list_push_back(&l->free_slots, PD_LINKS(l->conns, conn, free_link), slot_of(l, c));
}

/* Written and shut for writing: read until the client closes (L-intro). */
static void conn_linger(http_loop *l, conn *c) {
    if (c->read_eof || shutdown(c->fd, SHUT_WR) != 0) {
        conn_close(l, c);
        return;
    }
    enter(l, c, PH_LINGER);
    epoll_sync(l, c);
}

/* ---- writing --------------------------------------------------------------------- */

static void conn_parse(http_loop *l, conn *c);

static void after_write(http_loop *l, conn *c, bool progress) {
    if (unsent(c) == 0) c->out.len = c->out_off = 0;
    else if (c->out_off > c->out.len / 2) {
        http_buf_consume(&c->out, c->out_off);
        c->out_off = 0;
    }
    write_timer_update(l, c, progress);
    if (c->req) http_req_set_unsent(c->req, unsent(c));
}

/* Sends what the kernel takes. False when the connection was closed. */
static bool conn_flush(http_loop *l, conn *c) {
    bool progress = false;
    while (unsent(c) > 0) {
        ssize_t n = send(c->fd, c->out.data + c->out_off, unsent(c), MSG_NOSIGNAL);
        if (n > 0) {
            c->out_off += (size_t)n;
            progress = true;
        } else if (n < 0 && errno == EINTR) {
            continue;
        } else if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            break;
        } else {
            conn_close(l, c);
            return false;
        }
    }
    after_write(l, c, progress);
    if (unsent(c) == 0 && c->phase == PH_CLOSING) {
        conn_linger(l, c);
        return c->phase != PH_FREE;
    }
    if (progress && c->phase != PH_HANDLING) conn_parse(l, c);
    if (c->phase != PH_FREE) epoll_sync(l, c);
    return c->phase != PH_FREE;
}

/* S1: the server's own answer, then the end of the connection. */
static void conn_refuse(http_loop *l, conn *c, unsigned status, const char *message) {
    size_t len = 0;
    char *resp = http_error_response(status, message, &len);
    bool ok = resp && http_buf_append(&c->out, resp, len);
    free(resp);
    if (!ok) {
        conn_close(l, c);
        return;
    }
    enter(l, c, PH_CLOSING);
    conn_flush(l, c);
}

/* ---- requests ----------------------------------------------------------------------- */

static void conn_dispatch(http_loop *l, conn *c) {
    pd_http_req *r = http_reqparse_take(&c->parse);
    if (!r) {
        conn_refuse(l, c, 503, "out of memory for the request");
        return;
    }
    snprintf(r->client, sizeof r->client, "%s", c->client);
    http_req_attach(r, l, slot_of(l, c), l->cfg->output_watermark_bytes, l->stopping);
    c->req = r; /* L3 */
    enter(l, c, PH_HANDLING);
    l->cfg->on_request(r, l->cfg->user);
}

static bool parsing(const conn *c) {
    return c->phase == PH_IDLE || c->phase == PH_HEADERS || c->phase == PH_BODY;
}

static void conn_feed_event(http_loop *l, conn *c, http_feed ev) {
    switch (ev) {
    case HTTP_FEED_HEADERS:
        enter(l, c, PH_BODY);
        if (c->parse.expect_continue && c->parse.ll.http_minor == 1 &&
            !http_buf_append(&c->out, "HTTP/1.1 100 Continue\r\n\r\n", 25))
            conn_refuse(l, c, 503, "out of memory");
        break;
    case HTTP_FEED_DONE: conn_dispatch(l, c); break;
    case HTTP_FEED_ERROR: conn_refuse(l, c, c->parse.err_status, c->parse.err_msg); break;
    case HTTP_FEED_MORE: break;
    }
}

/* Parses what is buffered, one request at a time (S4); stops while the
 * output backlog is over the watermark (S3). */
static void conn_parse(http_loop *l, conn *c) {
    while (parsing(c) && unsent(c) < l->cfg->output_watermark_bytes) {
        if (c->in_len == 0 && !c->parse.paused) return;
        if (c->phase == PH_IDLE && c->in_len > 0) enter(l, c, PH_HEADERS);
        http_feed ev;
        size_t took = http_reqparse_feed(&c->parse, c->in, c->in_len, &ev);
        PD_ASSERT(took <= c->in_len);
        memmove(c->in, c->in + took, c->in_len - took);
        c->in_len -= (uint32_t)took;
        conn_feed_event(l, c, ev);
        if (ev == HTTP_FEED_MORE) return;
    }
}

/* The answer has ended: the next request, or the end. */
static void conn_answered(http_loop *l, conn *c, bool close_after) {
    pd_http_req *r = c->req;
    c->req = NULL;
    http_req_detach(r);
    pd_http_req_release(r);
    if (close_after || l->stopping) {
        enter(l, c, PH_CLOSING);
    } else {
        enter(l, c, c->in_len > 0 ? PH_HEADERS : PH_IDLE);
        conn_parse(l, c);
    }
}

/* A handle on the ready list: move its bytes to its connection. */
static void take_answer(http_loop *l, pd_http_req *r) {
    conn *c = r->loop == l ? &l->conns[r->conn] : NULL;
    PD_ASSERT(!c || c->req == r);
    bool ended = false, close_after = false;
    int rc = http_req_take(r, c ? &c->out : NULL, &ended, &close_after);
    if (rc < 0) conn_close(l, c);
    if (rc <= 0) return;
    if (ended) conn_answered(l, c, close_after);
    if (c->phase != PH_FREE) conn_flush(l, c);
}

/* Until the list is empty: an answer taken can let the next pipelined
 * request in, and a handler answering it at once posts again, on this
 * thread, with no wake-up. */
static void drain_ready(http_loop *l) {
    for (;;) {
        pthread_mutex_lock(&l->mu);
        pd_http_req *r = l->ready_head;
        l->ready_head = l->ready_tail = NULL;
        pthread_mutex_unlock(&l->mu);
        if (!r) return;
        while (r) {
            pd_http_req *next = r->ready_next;
            r->ready_next = NULL;
            take_answer(l, r);
            pd_http_req_release(r); /* the ready list's reference */
            r = next;
        }
    }
}

void http_loop_post(struct http_loop *l, pd_http_req *r) {
    pthread_mutex_lock(&l->mu);
    if (l->ready_tail) l->ready_tail->ready_next = r;
    else l->ready_head = r;
    l->ready_tail = r;
    pthread_mutex_unlock(&l->mu);
    if (!pthread_equal(pthread_self(), l->tid)) {
        uint64_t one = 1;
        ssize_t n = write(l->wakefd, &one, sizeof one);
        (void)n; /* EAGAIN: the counter is already non-zero, the loop will wake */
    }
}

/* ---- reading --------------------------------------------------------------------- */

/* The client closed its side. With a handle attached the client is gone;
 * otherwise what was already queued is still written, then the end. */
static void conn_eof(http_loop *l, conn *c) {
    c->read_eof = true;
    if (c->phase == PH_HANDLING || c->phase == PH_LINGER || unsent(c) == 0) {
        conn_close(l, c);
        return;
    }
    if (c->phase != PH_CLOSING) enter(l, c, PH_CLOSING);
    epoll_sync(l, c);
}

static void conn_read(http_loop *l, conn *c) {
    char drop[4096];
    bool discard = discarding(c);
    char *to = discard ? drop : c->in + c->in_len;
    size_t room = discard ? sizeof drop : HTTP_INBUF_BYTES - c->in_len;
    PD_ASSERT(room > 0);
    ssize_t n = recv(c->fd, to, room, 0);
    if (n == 0) {
        conn_eof(l, c);
    } else if (n < 0) {
        if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) conn_close(l, c);
    } else if (!discard) {
        c->in_len += (uint32_t)n;
        conn_parse(l, c);
        if (c->phase != PH_FREE && unsent(c) > 0) conn_flush(l, c);
        if (c->phase != PH_FREE) epoll_sync(l, c);
    }
}

static void conn_event(http_loop *l, uint64_t tag, uint32_t ev) {
    uint32_t slot = (uint32_t)tag;
    if (slot >= l->slots) return;
    conn *c = &l->conns[slot];
    if (c->phase == PH_FREE || c->gen != (uint32_t)(tag >> 32)) return; /* L4 */
    if (ev & (EPOLLERR | EPOLLHUP)) {
        conn_close(l, c);
        return;
    }
    if ((ev & EPOLLOUT) && !conn_flush(l, c)) return;
    /* A hang-up while a handle waits, or with no room to read up to it: a
     * half-close counts as the client gone. */
    if ((ev & EPOLLRDHUP) && (c->phase == PH_HANDLING || !has_room(c))) conn_eof(l, c);
    else if (ev & (EPOLLIN | EPOLLRDHUP)) conn_read(l, c);
}

/* ---- accepting ------------------------------------------------------------------- */

typedef struct peer {
    uint8_t ip[16];
    char text[64];
} peer;

static peer peer_of(const struct sockaddr_storage *ss) {
    peer p = {0};
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
        p.ip[10] = p.ip[11] = 0xff;
        memcpy(p.ip + 12, &a->sin_addr, 4);
        inet_ntop(AF_INET, &a->sin_addr, p.text, sizeof p.text);
    } else if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
        memcpy(p.ip, &a->sin6_addr, 16);
        if (IN6_IS_ADDR_V4MAPPED(&a->sin6_addr))
            inet_ntop(AF_INET, p.ip + 12, p.text, sizeof p.text);
        else inet_ntop(AF_INET6, &a->sin6_addr, p.text, sizeof p.text);
    }
    return p;
}

/* Over a cap, or stopping: a spare slot to say 503 in (L2); none, and the
 * newcomer is closed at once. NULL when the connection was refused. */
static conn *conn_slot(http_loop *l, int fd, const struct sockaddr_storage *ss, bool *over,
                       char *why, size_t why_cap) {
    peer p = peer_of(ss);
    *over = true;
    if (l->stopping) snprintf(why, why_cap, "the server is stopping");
    else if (l->live >= l->cfg->connections_max)
        snprintf(why, why_cap, "too many connections (%u)", l->cfg->connections_max);
    else if (ip_count(l, p.ip) >= l->cfg->connections_per_ip_max)
        snprintf(why, why_cap, "too many connections from %s (%u)", p.text,
                 l->cfg->connections_per_ip_max);
    else *over = false;
    if ((*over && l->rejecting >= HTTP_REJECT_SLOTS) || l->free_slots.len == 0) {
        close(fd);
        return NULL;
    }
    uint32_t slot = l->free_slots.head;
    pd_list_remove(&l->free_slots, PD_LINKS(l->conns, conn, free_link), slot);
    conn *c = &l->conns[slot];
    memcpy(c->ip, p.ip, sizeof c->ip);
    memcpy(c->client, p.text, sizeof c->client);
    c->fd = fd;
    return c;
}

static bool conn_buffers(http_loop *l, conn *c) {
    http_limits lim = {.header_bytes_max = l->cfg->header_bytes_max,
                       .headers_max = l->cfg->headers_max,
                       .body_bytes_max = l->cfg->body_bytes_max};
    c->in = malloc(HTTP_INBUF_BYTES);
    return c->in && http_reqparse_init(&c->parse, &lim) == PD_OK;
}

static void conn_open(http_loop *l, int fd, const struct sockaddr_storage *ss) {
    bool over;
    char why[160];
    conn *c = conn_slot(l, fd, ss, &over, why, sizeof why);
    if (!c) return;
    c->rejecting = over;
    c->phase = PH_CLOSING; /* until it is counted or refused */
    if (over) l->rejecting++;
    else {
        l->live++;
        pd_index_insert(&l->by_ip, ip_hash(c->ip), slot_of(l, c));
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->events = EPOLLIN | EPOLLRDHUP;
    struct epoll_event e = {.events = c->events,
                            .data.u64 = (uint64_t)c->gen << 32 | slot_of(l, c)};
    if (epoll_ctl(l->epfd, EPOLL_CTL_ADD, fd, &e) != 0 || (!over && !conn_buffers(l, c))) {
        conn_close(l, c);
        return;
    }
    if (over) conn_refuse(l, c, 503, why);
    else enter(l, c, PH_HEADERS); /* S2: the first header deadline runs from accept */
}

static void listen_watch(http_loop *l, bool on) {
    struct epoll_event e = {.events = EPOLLIN, .data.u64 = TAG_LISTEN};
    epoll_ctl(l->epfd, on ? EPOLL_CTL_ADD : EPOLL_CTL_DEL, l->listenfd, &e);
}

static void on_listen(http_loop *l) {
    for (int i = 0; i < HTTP_ACCEPT_BATCH && !l->stopping; i++) {
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        int fd = accept4(l->listenfd, (struct sockaddr *)&ss, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) {
            conn_open(l, fd, &ss);
        } else if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
            /* Out of descriptors: the socket stays readable; look away a while. */
            listen_watch(l, false);
            l->accept_resume_ms = now_ms() + HTTP_ACCEPT_PAUSE_MS;
            return;
        } else if (errno != EINTR && errno != ECONNABORTED && errno != EPROTO) {
            return;
        }
    }
}

/* ---- deadlines fire -------------------------------------------------------------- */

static void expire(http_loop *l, conn *c, int kind) {
    char msg[128];
    bool started = http_reqparse_started(&c->parse) || c->in_len > 0;
    if (kind == T_HEADER && started) {
        snprintf(msg, sizeof msg, "the request's header did not arrive within %u ms",
                 l->cfg->header_timeout_ms);
        conn_refuse(l, c, 408, msg);
    } else if (kind == T_BODY) {
        snprintf(msg, sizeof msg, "the request's body did not arrive within %u ms",
                 l->cfg->body_timeout_ms);
        conn_refuse(l, c, 408, msg);
    } else if (kind == T_IDLE && unsent(c) > 0) {
        timer_set(l, c, T_IDLE); /* still reading the last answer: the write deadline guards it */
    } else {
        conn_close(l, c); /* idle, lingered, or never said a word */
    }
}

static void run_timers(http_loop *l) {
    uint64_t now = now_ms();
    for (int k = 0; k < T_COUNT; k++)
        while (l->timers[k].head != PD_NONE && l->conns[l->timers[k].head].deadline_ms <= now)
            expire(l, &l->conns[l->timers[k].head], k);
    while (l->writes.head != PD_NONE && l->conns[l->writes.head].write_deadline_ms <= now)
        conn_close(l, &l->conns[l->writes.head]); /* the client stopped reading */
    if (l->accept_resume_ms && now >= l->accept_resume_ms && !l->stopping) {
        l->accept_resume_ms = 0;
        listen_watch(l, true);
    }
}

static int next_timeout_ms(const http_loop *l) {
    uint64_t next = UINT64_MAX;
    for (int k = 0; k < T_COUNT; k++)
        if (l->timers[k].head != PD_NONE)
            next = PD_MIN(next, l->conns[l->timers[k].head].deadline_ms);
    if (l->writes.head != PD_NONE) next = PD_MIN(next, l->conns[l->writes.head].write_deadline_ms);
    if (l->accept_resume_ms) next = PD_MIN(next, l->accept_resume_ms);
    if (l->stopping) next = PD_MIN(next, l->stop_deadline_ms);
    if (next == UINT64_MAX) return -1;
    uint64_t now = now_ms();
    return next <= now ? 0 : (int)PD_MIN(next - now, (uint64_t)60000);
}

/* ---- stopping -------------------------------------------------------------------- */

static void begin_stop(http_loop *l) {
    l->stopping = true;
    l->stop_deadline_ms = now_ms() + l->cfg->stop_grace_ms;
    listen_watch(l, false);
    close(l->listenfd);
    l->listenfd = -1;
    for (uint32_t i = 0; i < l->slots; i++) {
        conn *c = &l->conns[i];
        if (c->phase == PH_HANDLING) http_req_close_after(c->req);
        else if (parsing(c) && unsent(c) == 0) conn_close(l, c);
        else if (parsing(c)) enter(l, c, PH_CLOSING);
    }
}

static void close_all(http_loop *l) {
    for (uint32_t i = 0; i < l->slots; i++)
        if (l->conns[i].phase != PH_FREE) conn_close(l, &l->conns[i]);
}

static void loop_turn(http_loop *l, struct epoll_event *evs) {
    int n = epoll_wait(l->epfd, evs, HTTP_EVENTS_MAX, next_timeout_ms(l));
    for (int i = 0; i < n; i++) {
        if (evs[i].data.u64 == TAG_LISTEN) {
            on_listen(l);
        } else if (evs[i].data.u64 == TAG_WAKE) {
            uint64_t v;
            ssize_t got = read(l->wakefd, &v, sizeof v);
            (void)got;
        } else {
            conn_event(l, evs[i].data.u64, evs[i].events);
        }
        drain_ready(l); /* answers given inside on_request go out at once */
    }
    drain_ready(l);
    run_timers(l);
}

static void *loop_main(void *arg) {
    http_loop *l = arg;
    l->tid = pthread_self();
    struct epoll_event evs[HTTP_EVENTS_MAX];
    for (;;) {
        if (!l->stopping && atomic_load(&l->stop_requested)) begin_stop(l);
        if (l->stopping && (l->live + l->rejecting == 0 || now_ms() >= l->stop_deadline_ms)) break;
        loop_turn(l, evs);
    }
    close_all(l); /* past the grace: the rest see GONE */
    drain_ready(l);
    return NULL;
}

/* ---- start and stop -------------------------------------------------------------- */

void pd_http_server_config_default(pd_http_server_config *c) {
    *c = (pd_http_server_config){.host = "127.0.0.1",
                                 .connections_max = 1024,
                                 .connections_per_ip_max = 256,
                                 .header_bytes_max = 16 * 1024,
                                 .headers_max = 100,
                                 .body_bytes_max = 1024 * 1024,
                                 .header_timeout_ms = 10000,
                                 .body_timeout_ms = 30000,
                                 .idle_timeout_ms = 60000,
                                 .write_timeout_ms = 30000,
                                 .linger_ms = 2000,
                                 .stop_grace_ms = 5000,
                                 .output_watermark_bytes = 1024 * 1024};
}

static pd_err config_check(const pd_http_server_config *c, char *msg, size_t cap) {
    if (!c->on_request) return pd_errorf(msg, cap, PD_ERR_INVALID, "http server: no on_request");
    if (!c->connections_max || !c->connections_per_ip_max || !c->headers_max ||
        !c->body_bytes_max || !c->header_timeout_ms || !c->body_timeout_ms || !c->idle_timeout_ms ||
        !c->write_timeout_ms || !c->output_watermark_bytes)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "http server: a limit of zero");
    if (c->header_bytes_max < 64 || c->header_bytes_max > (1u << 20) || c->headers_max > 10000 ||
        c->connections_max > (1u << 20))
        return pd_errorf(msg, cap, PD_ERR_INVALID, "http server: a limit out of range");
    return PD_OK;
}

/* The first address of host:port that binds; SO_REUSEADDR (a restart need
 * not wait out TIME_WAIT) but never SO_REUSEPORT: a port in use is an error. */
static pd_err listen_on(pd_http_server *s, char *msg, size_t cap) {
    char port[8];
    snprintf(port, sizeof port, "%u", (unsigned)s->cfg.port);
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(s->host, port, &hints, &res);
    if (gai != 0)
        return pd_errorf(msg, cap, PD_ERR_IO, "http server: cannot resolve %s: %s", s->host,
                         gai_strerror(gai));
    int fd = -1, err = 0;
    for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        int one = 1;
        if (fd >= 0 &&
            (setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0 ||
             bind(fd, ai->ai_addr, ai->ai_addrlen) != 0 || listen(fd, 511) != 0)) {
            err = errno;
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0)
        return pd_errorf(msg, cap, PD_ERR_IO, "http server: cannot listen on %s:%u: %s", s->host,
                         (unsigned)s->cfg.port, strerror(err ? err : EADDRNOTAVAIL));
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    getsockname(fd, (struct sockaddr *)&ss, &len);
    s->port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
    s->loop.listenfd = fd;
    return PD_OK;
}

static pd_err loop_init(http_loop *l, const pd_http_server_config *cfg) {
    l->cfg = cfg;
    l->slots = cfg->connections_max + HTTP_REJECT_SLOTS;
    l->epfd = epoll_create1(EPOLL_CLOEXEC);
    l->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    l->conns = calloc(l->slots, sizeof *l->conns);
    atomic_init(&l->stop_requested, false);
    if (l->epfd < 0 || l->wakefd < 0 || !l->conns ||
        pd_index_init(&l->by_ip, cfg->connections_max, slot_ip_hash, l) != PD_OK)
        return PD_ERR_NOMEM;
    pd_list_init(&l->free_slots);
    pd_list_init(&l->writes);
    for (int k = 0; k < T_COUNT; k++) pd_list_init(&l->timers[k]);
    for (uint32_t i = 0; i < l->slots; i++) {
        l->conns[i] = (conn){.fd = -1, .phase = PH_FREE, .timer = T_NONE};
        pd_list_push_back(&l->free_slots, PD_LINKS(l->conns, conn, free_link), i);
    }
    struct epoll_event e = {.events = EPOLLIN, .data.u64 = TAG_WAKE};
    if (epoll_ctl(l->epfd, EPOLL_CTL_ADD, l->wakefd, &e) != 0) return PD_ERR_IO;
    listen_watch(l, true);
    return PD_OK;
}

static void server_free(pd_http_server *s) {
    http_loop *l = &s->loop;
    if (l->listenfd >= 0) close(l->listenfd);
    if (l->epfd >= 0) close(l->epfd);
    if (l->wakefd >= 0) close(l->wakefd);
    pd_index_free(&l->by_ip);
    free(l->conns);
    pthread_mutex_destroy(&l->mu);
    free(s);
}

pd_err pd_http_server_start(pd_http_server **out, const pd_http_server_config *c, char *msg,
                            size_t msg_cap) {
    *out = NULL;
    pd_err err = config_check(c, msg, msg_cap);
    if (err != PD_OK) return err;
    pd_http_server *s = calloc(1, sizeof *s);
    if (!s) return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "http server: out of memory");
    s->cfg = *c;
    snprintf(s->host, sizeof s->host, "%s", c->host ? c->host : "127.0.0.1");
    s->cfg.host = s->host;
    s->loop.listenfd = s->loop.epfd = s->loop.wakefd = -1;
    pthread_mutex_init(&s->loop.mu, NULL);
    err = listen_on(s, msg, msg_cap);
    if (err == PD_OK && loop_init(&s->loop, &s->cfg) != PD_OK)
        err = pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "http server: cannot set up the loop");
    if (err == PD_OK && pthread_create(&s->loop.thread, NULL, loop_main, &s->loop) != 0)
        err = pd_errorf(msg, msg_cap, PD_ERR_IO, "http server: cannot start the loop thread");
    if (err != PD_OK) {
        server_free(s);
        return err;
    }
    *out = s;
    return PD_OK;
}

uint16_t pd_http_server_port(const pd_http_server *s) { return s->port; }

void pd_http_server_stop(pd_http_server *s) {
    if (!s) return;
    http_loop *l = &s->loop;
    PD_ASSERT(!pthread_equal(pthread_self(), l->thread)); /* never from a handler */
    atomic_store(&l->stop_requested, true);
    uint64_t one = 1;
    ssize_t n = write(l->wakefd, &one, sizeof one);
    (void)n;
    pthread_join(l->thread, NULL);
    PD_ASSERT(l->live == 0 && l->rejecting == 0 && l->ready_head == NULL);
    server_free(s);
}
