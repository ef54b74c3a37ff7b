/*
 * net.c — pd_net, the network transport between a prefill node and a decode
 * node (include/pdserve/net.h): a TCP bootstrap channel for control, UCX
 * one-sided puts for the data. It implements the pd_xfer contract with the
 * same statuses, abort() and drained() semantics as src/xfer/loopback.c.
 *
 * Threads. The engine's scheduler thread calls the vtable; one progress
 * thread per pd_net owns every socket and the UCX worker (created in
 * UCS_THREAD_MODE_SINGLE: no other thread ever touches it). One mutex guards
 * all state. A vtable call takes the mutex, validates, updates the room,
 * queues work (staged page runs, a notice to send, a room marked dirty) and
 * wakes the progress thread through a pipe: it never waits on the network.
 * The progress thread holds the mutex while it works and releases it only
 * around poll(). UCX completion callbacks run inside ucp_worker_progress on
 * the progress thread, so they too run under the mutex.
 *
 * Rooms. One fixed table of rooms_max rooms (open addressing by room id),
 * allocated at creation. On the prefill side a room exists from the first of
 * sender_open() or the decode's DEST; it may outlive close() while its last
 * writes settle or its abort notice is due, and as a tombstone when it was
 * aborted before its destination arrived (the late DEST is then answered
 * with ABORT instead of being orphaned). Orphans and tombstones expire after
 * orphan_ms. On the decode side a room lives from receiver_open to close.
 *
 * Rooms ended before they opened (xfer.h, cancel). Prefill: a tombstone
 * answers the decode's DEST with ABORT, or an orphan DEST already here gets
 * its ABORT now. Decode: a cancel-only record sends one ABORT to the
 * prefill, then goes; the same happens at close() for a room whose
 * destination never left (aborted while the connection was still coming
 * up). A prefill node that gets ABORT for a room without a destination
 * fails the room if the engine has it open, or keeps a tombstone so that a
 * later sender_open() fails at once.
 *
 * The data path of one room, prefill side:
 *   send_pages/send_final stage coalesced page runs (a run = consecutive
 *   source pages onto consecutive destination pages = one put), then the
 *   Mamba slot, the metadata row and a FINAL marker, into a bounded pool;
 *   the progress thread posts them with ucp_put_nbx in order. At FINAL it
 *   flushes the endpoint (remote completion of every earlier put) and only
 *   when the flush and every put of the room have completed does it send
 *   DONE on the bootstrap connection. TCP delivers DONE after anything the
 *   flush covered has landed: the completion notice can never overtake data.
 *   An abort (either side) follows the same path: stop posting, drop what is
 *   staged, flush, and send ABORT (sender's own abort) or ACK (the decode's
 *   abort) only after every posted write has completed — that message is what
 *   lets the decode side call the room drained.
 *
 * drained(). Sender: nothing staged and no put outstanding (a put's local
 * completion means UCX no longer reads the source). Receiver: the sender said
 * it will write no more (DONE, ABORT, ACK, or a room-level ERROR refusing our
 * destination), or our destination never left this node, or the prefill peer
 * was lost and drain_grace_ms has passed since (a hung prefill may still
 * have writes in flight until it declares us dead itself).
 *
 * Dead peers. EOF, a socket error, a malformed message, silence for
 * dead_after_ms (heartbeats every heartbeat_ms), or a UCX endpoint error fail
 * every room of the peer. The prefill side then closes the endpoint with
 * UCP_EP_CLOSE_FLAG_FORCE, which in UCP_ERR_HANDLING_MODE_PEER completes
 * every outstanding request with an error, so its rooms drain. UCX 1.13's
 * shared-memory transports refuse peer mode, so a shm-only configuration
 * gets endpoints in mode PD_NONE (counted in peers_without_peer_errors); there
 * a forced close can leave requests to the dead peer pending forever, and
 * the room gives up on them after drain_grace_ms (writes_abandoned). Every
 * request carries its room's index and generation in UCX's per-request user
 * area, so a completion that comes after that touches nothing.
 *
 * Trade-offs. One coarse mutex instead of finer locks: the critical sections
 * are short and there is one engine thread per node. The progress thread
 * sleeps on the worker's event fd (UCP_FEATURE_WAKEUP), with a 1 ms cap while
 * requests are outstanding (a send waiting for resources raises no event) and
 * a 10 ms cap on a connected decode node (a missed wake-up costs at most
 * that). After UCX reports progress it keeps polling for spin_us (yielding
 * the CPU each turn): without real remote memory access (shared memory
 * between processes, TCP) UCX emulates puts with active messages that the
 * decode side applies, and a thread that sleeps between fragments turns
 * gigabytes per second into megabytes. The completion notice travels on TCP
 * rather than as a UCX active message: one channel carries every room-level
 * event, so their order is the order they were sent.
 */
#include "pdserve/net.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <ucp/api/ucp.h>

#include "bootstrap_proto.h"
#include "room.h"

#define REG_KV BP_REG_KV
#define REG_MAMBA BP_REG_MAMBA
#define REG_META BP_REG_META
#define REG_N BP_REG_COUNT
#define STAGE_FINAL 0xFFu

#define RX_INIT_BYTES (64u << 10)
#define TX_INIT_BYTES (64u << 10)
#define TX_MAX_BYTES (32u << 20)         /* a peer that stops reading is failed */
#define PEER_ADDR_MAX 256u
#define PROGRESS_BURST 256
#define POLL_IDLE_MS 100
#define POLL_BUSY_MS 1                   /* while UCX requests are outstanding */
#define POLL_RECV_MS 10                  /* decode, while a prefill peer is connected */
#define ORPHAN_SCAN_MS 250
#define ABORT_REASON_ENGINE 1u
#define ABORT_REASON_WRITE_ERROR 2u
#define ABORT_REASON_ORPHAN 3u

typedef struct stage {
    uint32_t next;
    uint32_t reg;          /* REG_* or STAGE_FINAL */
    uint32_t src, dst, n;  /* units of the region */
} stage;

typedef enum notice { N_NONE = 0, N_DONE, N_ABORT, N_ACK } notice;

/* One room on this node: the room core's half and destination (room.h),
 * plus what the network adds. */
typedef struct room {
    xr_slot slot;            /* id, generation (also bumped when writes are abandoned) */
    xr_half h;               /* the sender half on a prefill node, the receiver's on a decode */
    xr_dest dest;            /* decode: its own (pages freed once sent); prefill: the DEST */
    uint32_t peer, peer_gen; /* PD_NONE: not yet bound to a connection */
    uint64_t t_ms;           /* created / closed: orphan and tombstone expiry */
    uint64_t due_ms;         /* a notice held back by the abort-error fault */
    /* prefill */
    bool final_staged;
    bool started;            /* START sent */
    bool need_flush;         /* puts posted since the last flush */
    bool r_aborted;          /* the decode asked to stop */
    notice note;             /* sent once every posted write has completed */
    uint64_t note_value;
    uint32_t puts_out, flush_out;
    uint32_t q_head, q_tail;
    uint64_t bytes;
    /* decode */
    bool abort_wired;        /* our ABORT is on the wire */
    bool peer_lost;
    bool lost_unreliable;    /* the lost peer's endpoint had no peer-failure mode */
    bool cancel_only;        /* never opened here: one ABORT to the prefill, then freed */
    uint64_t lost_ms;
} room;

/* Lives in the user area UCX reserves in every request (request_size): a
 * completion finds its room by index and generation, so a completion that
 * comes after the room's writes were abandoned touches nothing. */
typedef struct req_ctx {
    pd_net *net;
    uint32_t room, gen;
} req_ctx;

typedef enum peer_state {
    PS_FREE = 0,
    PS_RESOLVE,
    PS_CONNECTING,
    PS_HELLO,
    PS_READY,
    PS_CLOSING
} peer_state;

typedef struct peer {
    pd_net *net;
    peer_state state;
    uint32_t gen;
    int fd;
    short revents;
    bool ever_ready;
    bool ucx_failed;          /* the endpoint's error handler fired */
    bool closing_after_tx;    /* a fatal ERROR is queued: send it, then close */
    char addr[PEER_ADDR_MAX];
    uint64_t t_state_ms, last_rx_ms, last_tx_ms;
    uint8_t *rx;
    size_t rx_len, rx_cap;
    uint8_t *tx;
    size_t tx_off, tx_len, tx_cap;
    uint64_t node_id;
    /* prefill: the decode node's memory */
    ucp_ep_h ep;
    bool ep_no_peer_mode;
    void *close_req;
    ucp_rkey_h rkey[REG_N];
    uint64_t rbase[REG_N], runit[REG_N];
    uint32_t runits[REG_N];
} peer;

struct pd_net {
    pd_net_config cfg;
    char listen_host[128];
    char token[BP_TOKEN_MAX + 1];
    size_t token_len;
    pthread_mutex_t mu;
    pthread_t thread;
    bool running, stopping;
    int wake_rd, wake_wr;
    int listen_fd;
    uint16_t port;
    bool listen_ready;
    /* UCX */
    ucp_context_h ctx;
    ucp_worker_h worker;
    int ucx_fd;
    ucp_address_t *waddr;
    size_t waddr_len;
    bool no_peer_mode;
    uint32_t ucx_out;
    uint64_t last_event_ns;   /* the worker last reported progress */
    /* registered memory */
    bool registered;
    uint8_t *base[REG_N];
    size_t unit[REG_N];
    uint32_t units[REG_N];
    ucp_mem_h memh[REG_N];
    void *rkey_buf[REG_N];
    size_t rkey_len[REG_N];
    /* tables, all sized at creation */
    xr_table rooms;
    bool *in_dirty;            /* per room slot: on the dirty ring (a stale entry may name a
                                  freed slot) */
    peer *peers;
    stage *stages;
    uint32_t stage_free, stages_avail;
    uint32_t *dirty, dirty_head, dirty_n;
    struct pollfd *pfd;
    uint32_t *pfd_peer;
    uint64_t next_due_ms, next_scan_ms;
    uint32_t abandon_pending;  /* rooms that may need abandon_dead_writes */
    bool faults[PD_NET_FAULT__COUNT];
    pd_net_stats stats;
    uint64_t node_id;
};

/* ---- small helpers ------------------------------------------------------------ */

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static void net_log(pd_net *n, const char *fmt, ...) {
    if (!n->cfg.log) return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    n->cfg.log(n->cfg.log_ctx, line);
}

static void wake(pd_net *n) {
    if (n->wake_wr < 0) return;
    uint8_t b = 1;
    ssize_t w = write(n->wake_wr, &b, 1); /* EAGAIN: a wake-up is already pending */
    (void)w;
}

static bool set_nonblocking(int fd) {
    int fl = fcntl(fd, F_GETFL, 0);
    return fl >= 0 && fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0;
}

/* Milliseconds from t to now; 0 if t is later (it was stamped after now was
 * read at the top of the progress loop). */
static uint64_t since(uint64_t now, uint64_t t) { return now > t ? now - t : 0; }

static uint32_t ridx(const pd_net *n, const room *rm) {
    return (uint32_t)(((const char *)rm - n->rooms.recs) / sizeof(room));
}

static room *room_at(const pd_net *n, uint32_t r) { return (room *)xr_at(&n->rooms, r); }

/* Status moves forward only; SUCCESS and FAILED are final (room.h). Counts
 * outcomes of rooms the engine opened; a room not opened here that fails is
 * a tombstone: it only carries the news to a later sender_open. */
static void set_st(pd_net *n, room *rm, pd_xfer_status st) {
    if (xr_is_final(rm->h.st)) return;
    xr_set_status(&rm->h, st);
    if (!rm->h.open) {
        if (st == PD_XFER_FAILED) xr_set_tomb(&n->rooms, ridx(n, rm), true);
        return;
    }
    if (st == PD_XFER_FAILED) n->stats.rooms_failed++;
    if (st == PD_XFER_SUCCESS) n->stats.rooms_succeeded++;
}

static void due_at(pd_net *n, room *rm, uint64_t t) {
    rm->due_ms = t;
    if (t < n->next_due_ms) n->next_due_ms = t;
}

/* ---- rooms --------------------------------------------------------------------- */

static uint32_t room_find(const pd_net *n, uint64_t id) { return xr_find(&n->rooms, id); }

static void mark_dirty(pd_net *n, room *rm) {
    uint32_t r = ridx(n, rm);
    if (n->in_dirty[r]) return;
    PD_ASSERT(n->dirty_n < n->cfg.rooms_max);
    n->in_dirty[r] = true;
    n->dirty[(n->dirty_head + n->dirty_n++) % n->cfg.rooms_max] = r;
}

static void stages_drop(pd_net *n, room *rm);

/* Writes, a flush or a notice of the room are still in the transport's hands. */
static bool room_busy(const room *rm) {
    return rm->puts_out || rm->flush_out || rm->q_head != PD_NONE || rm->note != N_NONE;
}

/* The table's eviction test: a tombstone (closed, or failed before the
 * engine opened it) with nothing in flight can make way for a live room. */
static bool evictable(void *ctx, uint32_t r) {
    const room *rm = room_at(ctx, r);
    return !room_busy(rm) && (rm->h.closed || rm->h.cancelled || xr_news_for_engine(&rm->h));
}

static void room_free(pd_net *n, uint32_t r);

static void evict(void *ctx, uint32_t r) { room_free(ctx, r); }

static uint32_t room_new(pd_net *n, uint64_t id) {
    uint32_t r = xr_add(&n->rooms, id);
    if (r == PD_NONE) return PD_NONE;
    room *rm = room_at(n, r);
    rm->peer = rm->peer_gen = PD_NONE;
    rm->dest.mamba_slot = rm->dest.meta_row = PD_NONE;
    rm->q_head = rm->q_tail = PD_NONE;
    rm->t_ms = now_ms();
    return r;
}

/* Removes r from the table; the slot's generation moves on, so a completion
 * that names the old one touches nothing. */
static void room_free(pd_net *n, uint32_t r) {
    room *rm = room_at(n, r);
    PD_ASSERT(rm->slot.used && rm->puts_out == 0 && rm->flush_out == 0);
    stages_drop(n, rm);
    xr_dest_clear(&rm->dest);
    xr_remove(&n->rooms, r);
}

/* The engine is done with the room (closed or cancelled): a tombstone from
 * now on, and freed once nothing refers to it any more. */
static void room_try_release(pd_net *n, room *rm) {
    if (!rm->slot.used || !xr_gone(&rm->h)) return;
    xr_set_tomb(&n->rooms, ridx(n, rm), true);
    if (n->cfg.role == PD_NET_PREFILL) {
        if (room_busy(rm)) return;
        /* Aborted before its destination came: keep the id, so the late DEST
         * gets an ABORT instead of waiting out the decode's timeout. */
        if (xr_news_for_peer(&rm->h, &rm->dest)) return;
    }
    room_free(n, ridx(n, rm));
}

static peer *peer_of(pd_net *n, const room *rm) {
    if (rm->peer == PD_NONE) return NULL;
    peer *p = &n->peers[rm->peer];
    if (p->gen != rm->peer_gen || p->state == PS_FREE || p->state == PS_CLOSING ||
        p->closing_after_tx)
        return NULL;
    return p;
}

/* Tells the room core how many of the sender's writes are still in the
 * transport's hands (a staged run counts until it is posted, a put until it
 * completes), and lets an abort waiting for them take effect. */
static void writes_sync(room *rm) {
    rm->h.writes_out = rm->puts_out + (rm->q_head != PD_NONE);
    if (rm->h.stopping && rm->h.writes_out == 0) xr_abort_effective(&rm->h);
}

/* ---- staged writes (prefill) --------------------------------------------------- */

static void stages_drop(pd_net *n, room *rm) {
    for (uint32_t s = rm->q_head; s != PD_NONE;) {
        uint32_t next = n->stages[s].next;
        n->stages[s].next = n->stage_free;
        n->stage_free = s;
        n->stages_avail++;
        s = next;
    }
    rm->q_head = rm->q_tail = PD_NONE;
}

static void stage_push(pd_net *n, room *rm, uint32_t reg, uint32_t src, uint32_t dst,
                       uint32_t units) {
    PD_ASSERT(n->stage_free != PD_NONE && n->stages_avail > 0);
    uint32_t s = n->stage_free;
    n->stage_free = n->stages[s].next;
    n->stages_avail--;
    n->stages[s] = (stage){.next = PD_NONE, .reg = reg, .src = src, .dst = dst, .n = units};
    if (rm->q_tail == PD_NONE) rm->q_head = s;
    else n->stages[rm->q_tail].next = s;
    rm->q_tail = s;
}

/* Runs of consecutive source pages landing on consecutive destination pages. */
static uint32_t count_runs(const room *rm, uint32_t base, uint32_t first, const uint32_t *src,
                           uint32_t cnt) {
    uint32_t runs = 0;
    for (uint32_t i = 0; i < cnt; i++) {
        uint32_t dst = rm->dest.pages[first - base + i];
        if (i == 0 || src[i] != src[i - 1] + 1 || dst != rm->dest.pages[first - base + i - 1] + 1)
            runs++;
    }
    return runs;
}

static void stage_runs(pd_net *n, room *rm, uint32_t base, uint32_t first, const uint32_t *src,
                       uint32_t cnt) {
    uint32_t i = 0;
    while (i < cnt) {
        uint32_t j = i + 1;
        while (j < cnt && src[j] == src[j - 1] + 1 &&
               rm->dest.pages[first - base + j] == rm->dest.pages[first - base + j - 1] + 1)
            j++;
        stage_push(n, rm, REG_KV, src[i], rm->dest.pages[first - base + i], j - i);
        i = j;
    }
}

/* ---- the bootstrap connections: buffers ------------------------------------------ */

static void peer_fail(pd_net *n, uint32_t pi, const char *why);

/* Space for a message of up to max bytes at the end of the tx buffer; NULL
 * if the peer is not reading (the caller fails it). */
static uint8_t *tx_reserve(peer *p, size_t max) {
    if (p->tx_off > 0 && p->tx_len + max > p->tx_cap) {
        memmove(p->tx, p->tx + p->tx_off, p->tx_len - p->tx_off);
        p->tx_len -= p->tx_off;
        p->tx_off = 0;
    }
    if (p->tx_len + max > p->tx_cap) {
        size_t cap = p->tx_cap ? p->tx_cap : TX_INIT_BYTES;
        while (cap < p->tx_len + max) cap *= 2;
        if (cap > TX_MAX_BYTES) return NULL;
        uint8_t *t = realloc(p->tx, cap);
        if (!t) return NULL;
        p->tx = t;
        p->tx_cap = cap;
    }
    return p->tx + p->tx_len;
}

static void tx_commit(pd_net *n, peer *p, size_t len) {
    PD_ASSERT(p->tx_len + len <= p->tx_cap);
    p->tx_len += len;
    p->last_tx_ms = now_ms();
    (void)n;
}

/* Queues a room message; false if the peer had to be failed. */
static bool send_room_msg(pd_net *n, uint32_t pi, bp_type type, uint64_t room_id, uint64_t value) {
    peer *p = &n->peers[pi];
    uint8_t *b = tx_reserve(p, BP_HEADER_BYTES + BP_ROOM_MSG_BYTES);
    if (!b) {
        peer_fail(n, pi, "send queue full: the peer does not read");
        return false;
    }
    tx_commit(n, p, bp_room_write(b, BP_HEADER_BYTES + BP_ROOM_MSG_BYTES, type, room_id, value));
    return true;
}

static void send_error(pd_net *n, uint32_t pi, bp_code code, bool has_room, uint64_t room_id,
                       const char *text) {
    peer *p = &n->peers[pi];
    size_t max = BP_HEADER_BYTES + 16 + BP_ERROR_TEXT_MAX;
    uint8_t *b = tx_reserve(p, max);
    if (!b) {
        peer_fail(n, pi, "send queue full: the peer does not read");
        return;
    }
    tx_commit(n, p, bp_error_write(b, max, code, has_room, room_id, text));
    n->stats.error_replies++;
}

/* A protocol violation that ends the connection: counted, answered with an
 * ERROR, then the connection is closed once the reply is out. */
static void refuse_conn(pd_net *n, uint32_t pi, bp_code code, const char *text) {
    peer *p = &n->peers[pi];
    n->stats.bad_messages++;
    net_log(n, "pd_net: refusing %s: %s (%s)", p->addr, text, bp_code_name(code));
    send_error(n, pi, code, false, 0, text);
    if (p->state == PS_FREE) return;
    p->closing_after_tx = true;
    p->t_state_ms = now_ms();
}

/* A room-level refusal: counted, answered, the connection stays. */
static void refuse_room(pd_net *n, uint32_t pi, bp_code code, uint64_t room_id, const char *text) {
    n->stats.bad_messages++;
    net_log(n, "pd_net: refusing room %llu from %s: %s", (unsigned long long)room_id,
            n->peers[pi].addr, text);
    send_error(n, pi, code, true, room_id, text);
}

/* ---- peers: lifecycle --------------------------------------------------------------- */

static void peer_release(pd_net *n, peer *p) {
    for (int r = 0; r < REG_N; r++)
        if (p->rkey[r]) ucp_rkey_destroy(p->rkey[r]);
    free(p->rx);
    free(p->tx);
    uint32_t gen = p->gen + 1;
    memset(p, 0, sizeof(*p));
    p->net = n;
    p->fd = -1;
    p->gen = gen;
    p->state = PS_FREE;
}

static void close_fd_quietly(int fd) {
    if (fd < 0) return;
    /* Discard unread input so the close sends FIN rather than RST, which
     * would let the peer lose the ERROR reply we just sent. */
    char junk[4096];
    for (int i = 0; i < 64 && recv(fd, junk, sizeof(junk), 0) > 0; i++) {}
    close(fd);
}

/* Ends a connection and fails every room bound to it. */
static void peer_fail(pd_net *n, uint32_t pi, const char *why) {
    peer *p = &n->peers[pi];
    if (p->state == PS_FREE || p->state == PS_CLOSING) return;
    uint64_t now = now_ms();
    if (p->ever_ready) n->stats.peers_lost++;
    net_log(n, "pd_net: connection to %s closed: %s", p->addr, why);
    if (p->fd >= 0) {
        if (p->tx_off < p->tx_len) {
            ssize_t w = send(p->fd, p->tx + p->tx_off, p->tx_len - p->tx_off, MSG_NOSIGNAL);
            (void)w;
        }
        close_fd_quietly(p->fd);
        p->fd = -1;
    }
    for (uint32_t r = 0; r < n->cfg.rooms_max; r++) {
        room *rm = room_at(n, r);
        if (!rm->slot.used || rm->peer != pi || rm->peer_gen != p->gen) continue;
        set_st(n, rm, PD_XFER_FAILED);
        rm->peer_lost = true;
        rm->lost_unreliable = p->ep_no_peer_mode;
        rm->lost_ms = now;
        if (rm->lost_unreliable) n->abandon_pending++;
        if (n->cfg.role == PD_NET_PREFILL) {
            xr_peer_failed(&rm->h, XR_SENDER);
            rm->note = N_NONE; /* nobody left to tell */
            stages_drop(n, rm);
        } else {
            xr_peer_failed(&rm->h, XR_RECEIVER);
            /* A hung prefill may still write until it declares us dead itself. */
            if (rm->h.dest_sent) rm->h.settle_until = now + n->cfg.drain_grace_ms;
        }
        mark_dirty(n, rm);
    }
    if (p->ep) {
        ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS,
                                   .flags = UCP_EP_CLOSE_FLAG_FORCE};
        void *req = ucp_ep_close_nbx(p->ep, &prm);
        p->ep = NULL;
        if (UCS_PTR_IS_PTR(req)) {
            p->close_req = req;
            p->state = PS_CLOSING;
            return;
        }
    }
    peer_release(n, p);
}

static void ep_error_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep;
    peer *p = arg;
    p->ucx_failed = true;
    net_log(p->net, "pd_net: UCX endpoint to %s failed: %s", p->addr, ucs_status_string(status));
}

static uint32_t peer_alloc(pd_net *n) {
    for (uint32_t i = 0; i < n->cfg.peers_max; i++)
        if (n->peers[i].state == PS_FREE) {
            peer *p = &n->peers[i];
            p->rx = malloc(RX_INIT_BYTES);
            if (!p->rx) return PD_NONE;
            p->rx_cap = RX_INIT_BYTES;
            p->t_state_ms = p->last_rx_ms = p->last_tx_ms = now_ms();
            return i;
        }
    return PD_NONE;
}

/* ---- UCX completions -------------------------------------------------------------- */

static void write_failed(pd_net *n, room *rm) {
    n->stats.write_errors++;
    set_st(n, rm, PD_XFER_FAILED);
    xr_sender_done(&rm->h);
    stages_drop(n, rm);
    if (rm->note != N_ACK) {
        rm->note = peer_of(n, rm) ? N_ABORT : N_NONE;
        rm->note_value = ABORT_REASON_WRITE_ERROR;
    }
}

/* The room a completion belongs to, or NULL if its writes were abandoned. */
static room *req_room(void *req) {
    req_ctx *c = req;
    room *rm = room_at(c->net, c->room);
    if (!rm->slot.used || rm->slot.gen != c->gen) return NULL;
    PD_ASSERT(c->net->ucx_out > 0);
    c->net->ucx_out--;
    return rm;
}

static void put_done(void *req, ucs_status_t status, void *user) {
    (void)user;
    pd_net *n = ((req_ctx *)req)->net;
    room *rm = req_room(req);
    if (rm) {
        PD_ASSERT(rm->puts_out > 0);
        rm->puts_out--;
        if (status != UCS_OK) write_failed(n, rm);
        mark_dirty(n, rm);
    }
    ucp_request_free(req);
}

static void flush_done(void *req, ucs_status_t status, void *user) {
    (void)user;
    pd_net *n = ((req_ctx *)req)->net;
    room *rm = req_room(req);
    if (rm) {
        PD_ASSERT(rm->flush_out > 0);
        rm->flush_out--;
        if (status != UCS_OK) write_failed(n, rm);
        mark_dirty(n, rm);
    }
    ucp_request_free(req);
}

static void req_track(pd_net *n, room *rm, void *req) {
    *(req_ctx *)req = (req_ctx){.net = n, .room = ridx(n, rm), .gen = rm->slot.gen};
    n->ucx_out++;
}

/* Posts one staged write. False on an immediate error. */
static bool post_put(pd_net *n, room *rm, peer *p, const stage *s) {
    uint32_t reg = s->reg;
    PD_ASSERT(reg < REG_N && p->rkey[reg]);
    size_t len = (size_t)s->n * n->unit[reg];
    const uint8_t *src = n->base[reg] + (size_t)s->src * n->unit[reg];
    uint64_t raddr = p->rbase[reg] + (uint64_t)s->dst * p->runit[reg];
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_MEMH,
        .cb.send = put_done,
        .memh = n->memh[reg],
    };
    ucs_status_ptr_t sp = ucp_put_nbx(p->ep, src, len, raddr, p->rkey[reg], &prm);
    if (UCS_PTR_IS_ERR(sp)) {
        net_log(n, "pd_net: put to %s failed: %s", p->addr, ucs_status_string(UCS_PTR_STATUS(sp)));
        return false;
    }
    if (sp != NULL) {
        req_track(n, rm, sp);
        rm->puts_out++;
    }
    rm->need_flush = true;
    rm->bytes += len;
    n->stats.bytes_sent += len;
    n->stats.writes_posted++;
    return true;
}

/* ---- the room pumps (progress thread) --------------------------------------------- */

static void pump_sender(pd_net *n, room *rm, uint64_t now) {
    writes_sync(rm);
    peer *p = peer_of(n, rm);
    if (p && p->state == PS_READY && rm->dest.known) {
        uint32_t pi = rm->peer;
        while (rm->q_head != PD_NONE && xr_sendable(&rm->h)) {
            uint32_t si = rm->q_head;
            stage s = n->stages[si];
            rm->q_head = s.next;
            if (rm->q_head == PD_NONE) rm->q_tail = PD_NONE;
            n->stages[si].next = n->stage_free;
            n->stage_free = si;
            n->stages_avail++;
            if (s.reg == STAGE_FINAL) {
                if (rm->note == N_NONE) rm->note = N_DONE;
                continue;
            }
            if (!rm->started) {
                rm->started = true;
                if (!send_room_msg(n, pi, BP_START, rm->slot.id, 0)) return;
            }
            if (!post_put(n, rm, p, &s)) {
                write_failed(n, rm);
                break;
            }
        }
        if (rm->note != N_NONE && rm->due_ms <= now && !(n->faults[PD_NET_FAULT_HOLD_NOTICES])) {
            if (rm->need_flush) {
                ucp_request_param_t prm = {
                    .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK,
                    .cb.send = flush_done,
                };
                ucs_status_ptr_t sp = ucp_ep_flush_nbx(p->ep, &prm);
                rm->need_flush = false;
                if (UCS_PTR_IS_ERR(sp)) {
                    write_failed(n, rm);
                } else if (sp != NULL) {
                    req_track(n, rm, sp);
                    rm->flush_out++;
                }
            }
            if (rm->note != N_NONE && rm->puts_out == 0 && rm->flush_out == 0) {
                notice note = rm->note;
                rm->note = N_NONE;
                if (note == N_DONE) {
                    if (!send_room_msg(n, pi, BP_DONE, rm->slot.id, rm->bytes)) return;
                    xr_sender_done(&rm->h);
                    set_st(n, rm, PD_XFER_SUCCESS);
                } else {
                    bp_type t = note == N_ACK ? BP_ACK : BP_ABORT;
                    if (!send_room_msg(n, pi, t, rm->slot.id, rm->note_value)) return;
                }
            }
        } else if (rm->note != N_NONE && rm->due_ms > now) {
            due_at(n, rm, rm->due_ms);
        }
    } else if (!p && rm->note != N_NONE) {
        rm->note = N_NONE; /* the connection is gone: nobody to tell */
    }
    room_try_release(n, rm);
}

static bool send_dest(pd_net *n, uint32_t pi, room *rm) {
    peer *p = &n->peers[pi];
    size_t max = BP_HEADER_BYTES + BP_DEST_FIXED + 4u * (size_t)rm->dest.n_pages;
    uint8_t *b = tx_reserve(p, max);
    if (!b) {
        peer_fail(n, pi, "send queue full: the peer does not read");
        return false;
    }
    const xr_dest *d = &rm->dest;
    size_t len = bp_dest_write(b, max, rm->slot.id, d->prompt, d->cached, d->mamba_slot,
                               d->meta_row, d->pages, d->n_pages);
    PD_ASSERT(len == max);
    tx_commit(n, p, len);
    rm->h.dest_sent = true;
    free(rm->dest.pages); /* the prefill has it now; the receiver never needs it again */
    rm->dest.pages = NULL;
    return true;
}

static void pump_receiver(pd_net *n, room *rm, uint64_t now) {
    peer *p = peer_of(n, rm);
    if (rm->cancel_only) {
        /* Tell the prefill once the connection is up; a lost connection
         * tells it nothing, and the room goes either way. */
        if (p) {
            if (p->state != PS_READY) return;
            send_room_msg(n, rm->peer, BP_ABORT, rm->slot.id, ABORT_REASON_ENGINE);
        }
        room_free(n, ridx(n, rm));
        return;
    }
    if (!p || rm->h.peer_stopped) return;
    uint32_t pi = rm->peer;
    if (!rm->h.dest_sent) {
        if (p->state != PS_READY) return;
        if (!send_dest(n, pi, rm)) return;
    }
    if (rm->h.abort_sent && !rm->abort_wired) {
        if (rm->due_ms > now) {
            due_at(n, rm, rm->due_ms);
            return;
        }
        rm->abort_wired = true;
        send_room_msg(n, pi, BP_ABORT, rm->slot.id, ABORT_REASON_ENGINE);
    }
}

/* ---- messages: prefill side --------------------------------------------------------- */

static bool token_ok(const pd_net *n, const bp_hello *h) {
    if (n->token_len == 0) return true;
    /* Compare every byte whatever the lengths: the time taken does not say
     * how much of a guess was right. */
    unsigned diff = (unsigned)(h->token_len ^ n->token_len);
    for (size_t i = 0; i < n->token_len; i++) {
        uint8_t a = i < h->token_len ? h->token[i] : 0;
        diff |= (unsigned)(a ^ (uint8_t)n->token[i]);
    }
    return diff == 0;
}

/* The decode node's memory must be laid out as this node's: same page size,
 * metadata rows, KV page bytes and (where both have Mamba layers) slot bytes.
 * False, with the reason in why, if not. */
static bool hello_layout_matches(const pd_net *n, const bp_hello *h, char *why, size_t cap) {
    if (h->page_size != n->cfg.page_size) {
        snprintf(why, cap, "page size %u, this node uses %u", h->page_size, n->cfg.page_size);
        return false;
    }
    if (h->meta_row_bytes != sizeof(pd_meta_row) || h->region[REG_META].units == 0 ||
        h->region[REG_META].unit_bytes != sizeof(pd_meta_row)) {
        snprintf(why, cap, "metadata rows differ from this node's");
        return false;
    }
    if (h->region[REG_KV].units == 0 || h->region[REG_KV].unit_bytes != n->unit[REG_KV]) {
        snprintf(why, cap, "KV page bytes %llu, this node uses %zu",
                 (unsigned long long)h->region[REG_KV].unit_bytes, n->unit[REG_KV]);
        return false;
    }
    if (h->region[REG_MAMBA].units && n->units[REG_MAMBA] &&
        h->region[REG_MAMBA].unit_bytes != n->unit[REG_MAMBA]) {
        snprintf(why, cap, "Mamba slot bytes differ from this node's");
        return false;
    }
    return true;
}

/* An endpoint to the decode node's worker, in peer-failure mode where the
 * transports allow it, else in mode PD_NONE. Once peer mode has failed, or if
 * the transports are shared-memory only (ucx_init), PD_NONE is asked at once. */
static ucs_status_t peer_ep_create(pd_net *n, peer *p, const bp_hello *h) {
    /* The worker address and keys are opaque to us; UCX parses them. */
    ucp_ep_params_t ep = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = (const ucp_address_t *)h->worker_addr,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = {.cb = ep_error_cb, .arg = p},
    };
    ucs_status_t st = UCS_ERR_UNSUPPORTED;
    if (!n->no_peer_mode) st = ucp_ep_create(n->worker, &ep, &p->ep);
    if (st != UCS_OK) {
        ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
        st = ucp_ep_create(n->worker, &ep, &p->ep);
        if (st == UCS_OK) {
            n->no_peer_mode = true;
            p->ep_no_peer_mode = true;
            n->stats.peers_without_peer_errors++;
        }
    }
    if (st != UCS_OK) p->ep = NULL;
    return st;
}

/* Records the decode node's regions and unpacks their remote keys; false if
 * a key does not unpack. */
static bool peer_regions_set(peer *p, const bp_hello *h) {
    for (int r = 0; r < REG_N; r++) {
        p->rbase[r] = h->region[r].base;
        p->runit[r] = h->region[r].unit_bytes;
        p->runits[r] = h->region[r].units;
        if (!h->region[r].units) continue;
        if (ucp_ep_rkey_unpack(p->ep, h->region[r].rkey, &p->rkey[r]) != UCS_OK) {
            p->rkey[r] = NULL;
            return false;
        }
    }
    return true;
}

static void on_hello(pd_net *n, uint32_t pi, const uint8_t *pl, uint32_t len) {
    peer *p = &n->peers[pi];
    bp_hello h;
    if (p->state != PS_HELLO) {
        refuse_conn(n, pi, BP_E_UNEXPECTED, "HELLO sent twice");
        return;
    }
    if (bp_hello_read(pl, len, &h) != PD_OK) {
        refuse_conn(n, pi, BP_E_MALFORMED, "malformed HELLO");
        return;
    }
    if (!token_ok(n, &h)) {
        refuse_conn(n, pi, BP_E_AUTH, h.token_len ? "wrong token" : "this node requires a token");
        return;
    }
    char why[160];
    if (!hello_layout_matches(n, &h, why, sizeof(why))) {
        refuse_conn(n, pi, BP_E_MISMATCH, why);
        return;
    }
    ucs_status_t st = peer_ep_create(n, p, &h);
    if (st != UCS_OK) {
        snprintf(why, sizeof(why), "no UCX path to the decode node's worker: %s",
                 ucs_status_string(st));
        refuse_conn(n, pi, BP_E_UCX, why);
        return;
    }
    if (!peer_regions_set(p, &h)) {
        refuse_conn(n, pi, BP_E_MALFORMED, "a remote key does not unpack");
        return;
    }
    p->node_id = h.node_id;
    uint8_t *b = tx_reserve(p, BP_HEADER_BYTES + 16);
    if (!b) {
        peer_fail(n, pi, "send queue full");
        return;
    }
    tx_commit(n, p, bp_hello_ok_write(b, BP_HEADER_BYTES + 16, n->node_id, n->cfg.page_size));
    p->state = PS_READY;
    p->ever_ready = true;
    p->t_state_ms = now_ms();
    n->stats.peers_connected++;
}

/* Checks a destination against the decode node's advertised memory and this
 * node's; NULL if acceptable, else why not. */
static const char *dest_problem(const pd_net *n, const peer *p, const bp_dest *d) {
    uint32_t ps = n->cfg.page_size;
    if (d->prompt_tokens == 0) return "empty prompt";
    if (d->cached_tokens % ps || d->cached_tokens > d->prompt_tokens)
        return "cached prefix not a page multiple within the prompt";
    if (d->n_pages != PD_DIV_CEIL(d->prompt_tokens, ps) - d->cached_tokens / ps)
        return "page count does not match the prompt";
    for (uint32_t i = 0; i < d->n_pages; i++)
        if (bp_dest_page(d, i) >= p->runits[REG_KV]) return "destination page out of range";
    if (d->meta_row >= p->runits[REG_META]) return "metadata row out of range";
    if (d->mamba_slot != BP_NONE && d->mamba_slot >= p->runits[REG_MAMBA])
        return "Mamba slot out of range";
    if ((d->mamba_slot != BP_NONE) != (n->units[REG_MAMBA] > 0))
        return "Mamba slot given for a model without one, or missing";
    return NULL;
}

static void on_dest(pd_net *n, uint32_t pi, const uint8_t *pl, uint32_t len) {
    peer *p = &n->peers[pi];
    bp_dest d;
    if (bp_dest_read(pl, len, &d) != PD_OK) {
        refuse_conn(n, pi, BP_E_MALFORMED, "malformed DEST");
        return;
    }
    const char *bad = dest_problem(n, p, &d);
    if (bad) {
        refuse_room(n, pi, BP_E_DEST_INVALID, d.room, bad);
        return;
    }
    uint32_t r = room_find(n, d.room);
    if (r != PD_NONE) {
        room *rm = room_at(n, r);
        if (rm->dest.known || rm->peer != PD_NONE) {
            refuse_room(n, pi, BP_E_ROOM_DUPLICATE, d.room,
                        "a destination for this room already exists");
            return;
        }
        if (rm->h.early_abort || rm->h.st == PD_XFER_FAILED) {
            /* The prefill half is gone already: tell the decode half now. */
            rm->dest.known = true; /* a tombstone's job is done */
            send_room_msg(n, pi, BP_ABORT, d.room, ABORT_REASON_ENGINE);
            room_try_release(n, rm);
            return;
        }
    } else {
        r = room_new(n, d.room);
        if (r == PD_NONE) {
            send_error(n, pi, BP_E_BUSY, true, d.room, "no room slot free on the prefill node");
            return;
        }
    }
    room *rm = room_at(n, r);
    uint32_t *pages = malloc(((size_t)d.n_pages + 1) * sizeof(uint32_t));
    if (!pages) {
        if (!rm->h.open) room_free(n, r);
        send_error(n, pi, BP_E_BUSY, true, d.room, "out of memory on the prefill node");
        return;
    }
    for (uint32_t i = 0; i < d.n_pages; i++) pages[i] = bp_dest_page(&d, i);
    rm->dest.pages = pages;
    rm->dest.n_pages = d.n_pages;
    rm->dest.prompt = d.prompt_tokens;
    rm->dest.cached = d.cached_tokens;
    rm->dest.mamba_slot = d.mamba_slot;
    rm->dest.meta_row = d.meta_row;
    rm->dest.known = true;
    rm->peer = pi;
    rm->peer_gen = p->gen;
    if (!rm->h.open) rm->t_ms = now_ms();
    if (rm->h.open && rm->h.st == PD_XFER_BOOTSTRAPPING) set_st(n, rm, PD_XFER_WAITING_FOR_INPUT);
    send_room_msg(n, pi, BP_DEST_OK, d.room, 0);
}

static void on_decode_abort(pd_net *n, uint32_t pi, uint64_t room_id) {
    peer *p = &n->peers[pi];
    uint32_t r = room_find(n, room_id);
    if (r == PD_NONE) {
        /* Closed here already (a race with our own notice: nothing of it
         * can write any more), or the decode half ended before this half
         * opened: a tombstone makes a later sender_open fail at once. */
        r = room_new(n, room_id);
        if (r != PD_NONE) {
            room *tomb = room_at(n, r);
            tomb->r_aborted = true;
            xr_peer_failed(&tomb->h, XR_SENDER);
            xr_set_tomb(&n->rooms, r, true);
        }
        send_room_msg(n, pi, BP_ACK, room_id, 0);
        return;
    }
    room *rm = room_at(n, r);
    if (rm->peer == PD_NONE) {
        /* No destination came: the decode half ended before it sent one.
         * Nothing was ever written. */
        rm->r_aborted = true;
        set_st(n, rm, PD_XFER_FAILED);
        xr_peer_failed(&rm->h, XR_SENDER);
        stages_drop(n, rm);
        send_room_msg(n, pi, BP_ACK, room_id, 0);
        if (xr_gone(&rm->h)) room_free(n, r); /* our own tombstone: both halves are gone */
        return;
    }
    if (rm->peer != pi || rm->peer_gen != p->gen) {
        refuse_room(n, pi, BP_E_ROOM_UNKNOWN, room_id,
                    "this connection holds no destination for the room");
        return;
    }
    rm->r_aborted = true;
    set_st(n, rm, PD_XFER_FAILED);
    stages_drop(n, rm);
    if (rm->h.done && rm->note == N_NONE) {
        send_room_msg(n, pi, BP_ACK, room_id, 0);
        return;
    }
    xr_peer_failed(&rm->h, XR_SENDER);
    rm->note = N_ACK;
    rm->note_value = 0;
    rm->due_ms = 0;
    mark_dirty(n, rm);
}

/* ---- messages: decode side ----------------------------------------------------------- */

static room *own_room(pd_net *n, uint32_t pi, uint64_t room_id) {
    uint32_t r = room_find(n, room_id);
    if (r == PD_NONE) return NULL;
    room *rm = room_at(n, r);
    return rm->peer == pi && rm->peer_gen == n->peers[pi].gen ? rm : NULL;
}

static void on_decode_msg(pd_net *n, uint32_t pi, uint32_t type, const uint8_t *pl, uint32_t len) {
    peer *p = &n->peers[pi];
    if (type == BP_HELLO_OK) {
        uint64_t node_id;
        uint32_t ps;
        if (p->state != PS_HELLO) {
            refuse_conn(n, pi, BP_E_UNEXPECTED, "HELLO_OK out of turn");
        } else if (bp_hello_ok_read(pl, len, &node_id, &ps) != PD_OK) {
            refuse_conn(n, pi, BP_E_MALFORMED, "malformed HELLO_OK");
        } else if (ps != n->cfg.page_size) {
            refuse_conn(n, pi, BP_E_MISMATCH, "page size differs");
        } else {
            p->node_id = node_id;
            p->state = PS_READY;
            p->ever_ready = true;
            n->stats.peers_connected++;
            for (uint32_t r = 0; r < n->cfg.rooms_max; r++) {
                room *rm = room_at(n, r);
                if (rm->slot.used && rm->peer == pi && rm->peer_gen == p->gen) mark_dirty(n, rm);
            }
        }
        return;
    }
    if (p->state != PS_READY) {
        refuse_conn(n, pi, BP_E_UNEXPECTED, "message before HELLO_OK");
        return;
    }
    uint64_t room_id, value;
    switch (type) {
    case BP_DEST_OK:
    case BP_START:
    case BP_DONE:
    case BP_ABORT:
    case BP_ACK: {
        if (bp_room_read(pl, len, &room_id, &value) != PD_OK) {
            refuse_conn(n, pi, BP_E_MALFORMED, "malformed room message");
            return;
        }
        room *rm = own_room(n, pi, room_id);
        if (!rm) {
            /* ACK may cross our close legitimately; anything else about a
             * room we do not have is the peer's mistake. */
            if (type != BP_ACK) refuse_room(n, pi, BP_E_ROOM_UNKNOWN, room_id, "unknown room");
            return;
        }
        if (type == BP_DEST_OK) {
            xr_dest_arrived(&rm->h);
        } else if (type == BP_START) {
            xr_data_started(&rm->h);
        } else if (type == BP_DONE) {
            n->stats.bytes_received += value;
            set_st(n, rm, PD_XFER_SUCCESS);
            xr_peer_stopped(&rm->h);
        } else if (type == BP_ABORT) {
            set_st(n, rm, PD_XFER_FAILED);
            xr_peer_failed(&rm->h, XR_RECEIVER);
        } else {
            xr_peer_stopped(&rm->h);
        }
        return;
    }
    default:
        refuse_conn(n, pi, BP_E_UNEXPECTED, "message type not sent to a decode node");
        return;
    }
}

static void on_error_msg(pd_net *n, uint32_t pi, const uint8_t *pl, uint32_t len) {
    bp_error e;
    if (bp_error_read(pl, len, &e) != PD_OK) {
        refuse_conn(n, pi, BP_E_MALFORMED, "malformed ERROR");
        return;
    }
    char text[BP_ERROR_TEXT_MAX + 1];
    memcpy(text, e.text, e.text_len);
    text[e.text_len] = 0;
    if (!e.has_room) {
        char why[BP_ERROR_TEXT_MAX + 64];
        snprintf(why, sizeof(why), "peer refused the connection: %s (%s)", text,
                 bp_code_name(e.code));
        peer_fail(n, pi, why);
        return;
    }
    net_log(n, "pd_net: %s refused room %llu: %s (%s)", n->peers[pi].addr,
            (unsigned long long)e.room, text, bp_code_name(e.code));
    if (n->cfg.role == PD_NET_DECODE) {
        /* The prefill refused our destination: it will never write to it. */
        room *rm = own_room(n, pi, e.room);
        if (rm) {
            set_st(n, rm, PD_XFER_FAILED);
            xr_peer_failed(&rm->h, XR_RECEIVER);
        }
    }
}

static void on_message(pd_net *n, uint32_t pi, uint32_t type, const uint8_t *pl, uint32_t len) {
    peer *p = &n->peers[pi];
    if (type == BP_ERROR) {
        on_error_msg(n, pi, pl, len);
        return;
    }
    if (type == BP_PING) {
        if (p->state != PS_READY) refuse_conn(n, pi, BP_E_UNEXPECTED, "PING before the handshake");
        return;
    }
    if (n->cfg.role == PD_NET_DECODE) {
        on_decode_msg(n, pi, type, pl, len);
        return;
    }
    if (type == BP_HELLO) {
        on_hello(n, pi, pl, len);
        return;
    }
    if (p->state != PS_READY) {
        refuse_conn(n, pi, BP_E_UNEXPECTED, "the first message must be HELLO");
        return;
    }
    uint64_t room_id, value;
    switch (type) {
    case BP_DEST: on_dest(n, pi, pl, len); return;
    case BP_ABORT:
        if (bp_room_read(pl, len, &room_id, &value) != PD_OK) {
            refuse_conn(n, pi, BP_E_MALFORMED, "malformed ABORT");
            return;
        }
        on_decode_abort(n, pi, room_id);
        return;
    default: refuse_conn(n, pi, BP_E_UNEXPECTED, "message type not sent to a prefill node"); return;
    }
}

/* ---- socket I/O ------------------------------------------------------------------------ */

/* Parses every complete message in the rx buffer. */
static void peer_parse(pd_net *n, uint32_t pi) {
    peer *p = &n->peers[pi];
    uint32_t gen = p->gen;
    size_t off = 0;
    while (p->state != PS_FREE && p->gen == gen && !p->closing_after_tx &&
           p->rx_len - off >= BP_HEADER_BYTES) {
        bp_header h;
        bp_code code;
        if (bp_header_check(p->rx + off, &h, &code) != PD_OK) {
            char why[96];
            if (code == BP_E_VERSION)
                snprintf(why, sizeof(why), "protocol version %u not supported; this node speaks %u",
                         h.version, BP_VERSION);
            else if (code == BP_E_TOO_BIG)
                snprintf(why, sizeof(why), "%s of %u bytes is over the limit", bp_type_name(h.type),
                         h.length);
            else
                snprintf(why, sizeof(why), "bad header (%s)",
                         code == BP_E_MALFORMED ? "magic or flags" : "type");
            refuse_conn(n, pi, code, why);
            return;
        }
        size_t need = BP_HEADER_BYTES + (size_t)h.length;
        if (p->rx_len - off < need) {
            if (need > p->rx_cap) {
                /* The header was checked: need is within the type's limit. */
                if (off) {
                    memmove(p->rx, p->rx + off, p->rx_len - off);
                    p->rx_len -= off;
                    off = 0;
                }
                uint8_t *b = realloc(p->rx, need);
                if (!b) {
                    peer_fail(n, pi, "out of memory for a message");
                    return;
                }
                p->rx = b;
                p->rx_cap = need;
            }
            break;
        }
        on_message(n, pi, h.type, p->rx + off + BP_HEADER_BYTES, h.length);
        off += need;
    }
    if (p->state == PS_FREE || p->gen != gen) return;
    if (off) {
        memmove(p->rx, p->rx + off, p->rx_len - off);
        p->rx_len -= off;
    }
}

static void peer_read(pd_net *n, uint32_t pi, uint64_t now) {
    peer *p = &n->peers[pi];
    uint32_t gen = p->gen;
    for (int rounds = 0; rounds < 64; rounds++) {
        if (p->state == PS_FREE || p->gen != gen || p->closing_after_tx) return;
        if (p->rx_len == p->rx_cap) return; /* parse made no room: waits for a bigger buffer */
        ssize_t got = recv(p->fd, p->rx + p->rx_len, p->rx_cap - p->rx_len, 0);
        if (got > 0) {
            p->rx_len += (size_t)got;
            p->last_rx_ms = now;
            peer_parse(n, pi);
            continue;
        }
        if (got == 0) {
            if (p->rx_len > 0) {
                n->stats.bad_messages++; /* a message cut off by the close */
                peer_fail(n, pi, "connection closed in the middle of a message");
            } else {
                peer_fail(n, pi, "connection closed by the peer");
            }
            return;
        }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) peer_fail(n, pi, strerror(errno));
        return;
    }
}

static void peer_write(pd_net *n, uint32_t pi) {
    peer *p = &n->peers[pi];
    while (p->tx_off < p->tx_len) {
        ssize_t w = send(p->fd, p->tx + p->tx_off, p->tx_len - p->tx_off, MSG_NOSIGNAL);
        if (w > 0) {
            p->tx_off += (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        peer_fail(n, pi, w < 0 ? strerror(errno) : "send failed");
        return;
    }
    p->tx_off = p->tx_len = 0;
    if (p->closing_after_tx) peer_fail(n, pi, "closed after refusing the peer");
}

static void accept_all(pd_net *n) {
    for (int i = 0; i < 64; i++) {
        struct sockaddr_storage sa;
        socklen_t sl = sizeof(sa);
        int fd = accept(n->listen_fd, (struct sockaddr *)&sa, &sl);
        if (fd < 0) return;
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        uint32_t pi = set_nonblocking(fd) ? peer_alloc(n) : PD_NONE;
        if (pi == PD_NONE) {
            uint8_t b[BP_HEADER_BYTES + 16 + BP_ERROR_TEXT_MAX];
            size_t len = bp_error_write(b, sizeof(b), BP_E_BUSY, false, 0, "too many connections");
            ssize_t w = send(fd, b, len, MSG_NOSIGNAL | MSG_DONTWAIT);
            (void)w;
            n->stats.error_replies++;
            close(fd);
            continue;
        }
        peer *p = &n->peers[pi];
        p->fd = fd;
        p->state = PS_HELLO;
        char host[INET6_ADDRSTRLEN + 1] = "?", serv[16] = "?";
        getnameinfo((struct sockaddr *)&sa, sl, host, sizeof(host), serv, sizeof(serv),
                    NI_NUMERICHOST | NI_NUMERICSERV);
        snprintf(p->addr, sizeof(p->addr), "%s:%s", host, serv);
    }
}

/* Splits "host:port" or "[v6]:port". */
static bool split_addr(const char *s, char *host, size_t host_cap, char *port, size_t port_cap) {
    const char *colon;
    const char *h = s;
    size_t hl;
    if (s[0] == '[') {
        const char *close = strchr(s, ']');
        if (!close || close[1] != ':') return false;
        h = s + 1;
        hl = (size_t)(close - h);
        colon = close + 1;
    } else {
        colon = strrchr(s, ':');
        if (!colon) return false;
        hl = (size_t)(colon - s);
    }
    const char *pt = colon + 1;
    size_t pl = strlen(pt);
    if (hl == 0 || hl >= host_cap || pl == 0 || pl >= port_cap) return false;
    for (size_t i = 0; i < pl; i++)
        if (pt[i] < '0' || pt[i] > '9') return false;
    if (atol(pt) <= 0 || atol(pt) > 65535) return false;
    memcpy(host, h, hl);
    host[hl] = 0;
    memcpy(port, pt, pl + 1);
    return true;
}

static void queue_hello(pd_net *n, uint32_t pi) {
    peer *p = &n->peers[pi];
    bp_hello h = {
        .node_id = n->node_id,
        .page_size = n->cfg.page_size,
        .meta_row_bytes = sizeof(pd_meta_row),
        .token_len = (uint16_t)n->token_len,
        .token = (const uint8_t *)n->token,
        .worker_addr_len = (uint16_t)n->waddr_len,
        .worker_addr = (const uint8_t *)n->waddr,
    };
    for (int r = 0; r < REG_N; r++)
        h.region[r] = (bp_region){
            .base = (uint64_t)(uintptr_t)n->base[r],
            .unit_bytes = n->unit[r],
            .units = n->units[r],
            .rkey_len = (uint16_t)n->rkey_len[r],
            .rkey = n->rkey_buf[r],
        };
    uint8_t *b = tx_reserve(p, BP_HEADER_BYTES + BP_HELLO_MAX);
    size_t len = b ? bp_hello_write(b, BP_HEADER_BYTES + BP_HELLO_MAX, &h) : 0;
    if (len == 0) {
        peer_fail(n, pi, "cannot encode HELLO (worker address or keys too large)");
        return;
    }
    tx_commit(n, p, len);
    p->state = PS_HELLO;
    p->t_state_ms = now_ms();
}

static void peer_connect(pd_net *n, uint32_t pi) {
    peer *p = &n->peers[pi];
    char host[PEER_ADDR_MAX], port[16];
    if (!split_addr(p->addr, host, sizeof(host), port, sizeof(port))) {
        peer_fail(n, pi, "bad peer address (want host:port)");
        return;
    }
    struct addrinfo hints = {
        .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    /* May block on DNS: the mutex is released meanwhile, so only the
     * progress thread waits, never the engine. The peer may be forgotten in
     * the meantime (its only room refused): its generation tells. */
    uint32_t gen = p->gen;
    pthread_mutex_unlock(&n->mu);
    int gai = getaddrinfo(host, port, &hints, &res);
    pthread_mutex_lock(&n->mu);
    if (p->gen != gen || p->state != PS_RESOLVE) {
        if (res) freeaddrinfo(res);
        return;
    }
    if (gai != 0 || !res) {
        peer_fail(n, pi, gai ? gai_strerror(gai) : "no address");
        return;
    }
    int fd = socket(res->ai_family, res->ai_socktype, res->ai_protocol);
    if (fd < 0 || !set_nonblocking(fd)) {
        if (fd >= 0) close(fd);
        freeaddrinfo(res);
        peer_fail(n, pi, "socket() failed");
        return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    p->fd = fd;
    int rc = connect(fd, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    p->t_state_ms = now_ms();
    if (rc == 0) {
        queue_hello(n, pi);
    } else if (errno == EINPROGRESS) {
        p->state = PS_CONNECTING;
    } else {
        peer_fail(n, pi, strerror(errno));
    }
}

static void peer_service(pd_net *n, uint32_t pi, uint64_t now) {
    peer *p = &n->peers[pi];
    switch (p->state) {
    case PS_FREE: return;
    case PS_CLOSING:
        if (ucp_request_check_status(p->close_req) != UCS_INPROGRESS) {
            ucp_request_free(p->close_req);
            p->close_req = NULL;
            peer_release(n, p);
        }
        return;
    case PS_RESOLVE: peer_connect(n, pi); return;
    case PS_CONNECTING:
        if (p->revents & (POLLOUT | POLLERR | POLLHUP)) {
            int err = 0;
            socklen_t el = sizeof(err);
            if (getsockopt(p->fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0) err = errno;
            if (err) peer_fail(n, pi, strerror(err));
            else queue_hello(n, pi);
        }
        return;
    case PS_HELLO:
    case PS_READY:
        if (p->ucx_failed) {
            peer_fail(n, pi, "UCX endpoint error");
            return;
        }
        if (p->revents & (POLLIN | POLLHUP | POLLERR)) peer_read(n, pi, now);
        return;
    }
}

/* ---- timers ----------------------------------------------------------------------------- */

/* Without peer-failure mode (UCX 1.13 shared memory) a forced close may leave
 * requests to a dead peer pending forever. They can only move if the dead
 * peer's side consumes them, which it no longer does; after the drain grace
 * the room stops waiting for them (and ignores them should they complete). */
static void abandon_dead_writes(pd_net *n, uint64_t now) {
    if (n->abandon_pending == 0) return;
    uint32_t still = 0;
    for (uint32_t r = 0; r < n->cfg.rooms_max; r++) {
        room *rm = room_at(n, r);
        if (!rm->slot.used || !rm->peer_lost || !rm->lost_unreliable ||
            (!rm->puts_out && !rm->flush_out))
            continue;
        if (since(now, rm->lost_ms) < n->cfg.drain_grace_ms) {
            still++;
            continue;
        }
        net_log(n, "pd_net: room %llu: abandoning %u writes to a dead peer",
                (unsigned long long)rm->slot.id, rm->puts_out);
        n->stats.writes_abandoned += rm->puts_out + rm->flush_out;
        PD_ASSERT(n->ucx_out >= rm->puts_out + rm->flush_out);
        n->ucx_out -= rm->puts_out + rm->flush_out;
        rm->puts_out = rm->flush_out = 0;
        rm->slot.gen++;
        mark_dirty(n, rm);
    }
    n->abandon_pending = still;
}

static void timers(pd_net *n, uint64_t now) {
    for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++) {
        peer *p = &n->peers[pi];
        if (p->state == PS_FREE || p->state == PS_CLOSING || p->state == PS_RESOLVE) continue;
        if (p->closing_after_tx) {
            if (since(now, p->t_state_ms) >= n->cfg.dead_after_ms)
                peer_fail(n, pi, "peer did not take our refusal");
            continue;
        }
        if (p->state != PS_READY) {
            if (since(now, p->t_state_ms) >= n->cfg.dead_after_ms) {
                if (p->rx_len > 0) n->stats.bad_messages++; /* a truncated message */
                bool connecting = p->state == PS_CONNECTING;
                peer_fail(n, pi, connecting ? "connect timed out" : "handshake timed out");
            }
            continue;
        }
        if (since(now, p->last_rx_ms) >= n->cfg.dead_after_ms) {
            if (p->rx_len > 0) n->stats.bad_messages++;
            peer_fail(n, pi, "heartbeat lost");
            continue;
        }
        if (since(now, p->last_tx_ms) >= n->cfg.heartbeat_ms) {
            uint8_t *b = tx_reserve(p, BP_HEADER_BYTES);
            if (!b) peer_fail(n, pi, "send queue full");
            else tx_commit(n, p, bp_ping_write(b, BP_HEADER_BYTES));
        }
    }
    if (n->cfg.role == PD_NET_PREFILL) abandon_dead_writes(n, now);
    if (now >= n->next_due_ms) {
        n->next_due_ms = UINT64_MAX;
        for (uint32_t r = 0; r < n->cfg.rooms_max; r++) {
            room *rm = room_at(n, r);
            if (!rm->slot.used || rm->due_ms == 0) continue;
            if (rm->due_ms <= now) {
                rm->due_ms = 0;
                mark_dirty(n, rm);
            } else if (rm->due_ms < n->next_due_ms) {
                n->next_due_ms = rm->due_ms;
            }
        }
    }
    if (n->cfg.role == PD_NET_PREFILL && now >= n->next_scan_ms) {
        n->next_scan_ms = now + ORPHAN_SCAN_MS;
        for (uint32_t r = 0; r < n->cfg.rooms_max; r++) {
            room *rm = room_at(n, r);
            if (!rm->slot.used || rm->h.open || since(now, rm->t_ms) < n->cfg.orphan_ms) continue;
            if (rm->puts_out || rm->flush_out || rm->note != N_NONE) continue;
            if (!xr_gone(&rm->h) && rm->dest.known && !rm->r_aborted &&
                rm->h.st != PD_XFER_FAILED) {
                /* A destination the engine never claimed: free the decode's pages. */
                uint32_t pi = rm->peer;
                if (peer_of(n, rm))
                    send_room_msg(n, pi, BP_ABORT, rm->slot.id, ABORT_REASON_ORPHAN);
            }
            room_free(n, r);
        }
        for (uint32_t r = 0; r < n->cfg.rooms_max; r++) {
            room *rm = room_at(n, r);
            if (rm->slot.used && xr_gone(&rm->h) && since(now, rm->t_ms) >= n->cfg.orphan_ms &&
                !rm->puts_out && !rm->flush_out && rm->q_head == PD_NONE) {
                rm->note = N_NONE;
                room_free(n, r);
            }
        }
    }
}

/* ---- the progress thread ------------------------------------------------------------------ */

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void ucx_progress(pd_net *n) {
    unsigned events = 0;
    for (int i = 0; i < PROGRESS_BURST; i++) {
        unsigned k = ucp_worker_progress(n->worker);
        if (!k) break;
        events += k;
    }
    if (events) n->last_event_ns = now_ns();
}

static void process_dirty(pd_net *n, uint64_t now) {
    uint32_t cnt = n->dirty_n;
    while (cnt-- > 0 && n->dirty_n > 0) {
        uint32_t r = n->dirty[n->dirty_head];
        n->dirty_head = (n->dirty_head + 1) % n->cfg.rooms_max;
        n->dirty_n--;
        room *rm = room_at(n, r);
        n->in_dirty[r] = false;
        if (!rm->slot.used) continue;
        if (n->cfg.role == PD_NET_PREFILL) pump_sender(n, rm, now);
        else pump_receiver(n, rm, now);
    }
}

static int poll_timeout(pd_net *n, uint64_t now, bool *spinning) {
    *spinning = false;
    if (n->dirty_n > 0) return 0;
    /* Data is moving: UCX emulates one-sided writes with active messages on
     * transports without direct remote access (shared memory between two
     * processes here, TCP), so both sides keep the worker turning rather
     * than sleeping between fragments. Bounded: spin_us after the last event. */
    if (n->cfg.spin_us > 0 && now_ns() - n->last_event_ns < (uint64_t)n->cfg.spin_us * 1000u) {
        *spinning = true;
        return 0;
    }
    uint64_t t = POLL_IDLE_MS;
    bool receiving = false;
    for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++) {
        peer *p = &n->peers[pi];
        if (p->state == PS_FREE) continue;
        if (p->state == PS_CLOSING || p->state == PS_RESOLVE)
            return p->state == PS_RESOLVE ? 0 : POLL_BUSY_MS;
        uint64_t d = p->t_state_ms + n->cfg.dead_after_ms;
        if (p->state == PS_READY && !p->closing_after_tx) {
            d = PD_MIN(p->last_rx_ms + n->cfg.dead_after_ms, p->last_tx_ms + n->cfg.heartbeat_ms);
            receiving |= n->cfg.role == PD_NET_DECODE;
        }
        t = PD_MIN(t, d > now ? d - now : 0);
    }
    if (n->next_due_ms != UINT64_MAX)
        t = PD_MIN(t, n->next_due_ms > now ? n->next_due_ms - now : 0);
    if (n->cfg.role == PD_NET_PREFILL)
        t = PD_MIN(t, n->next_scan_ms > now ? n->next_scan_ms - now : 0);
    if (n->ucx_out > 0) t = PD_MIN(t, POLL_BUSY_MS);
    /* Belt and braces for transports whose wake-up events are unreliable:
     * a decode node with connected prefill peers never naps for long while
     * data may be arriving through emulated one-sided writes. */
    if (receiving) t = PD_MIN(t, POLL_RECV_MS);
    return (int)t;
}

static void *progress_main(void *arg) {
    pd_net *n = arg;
    pthread_mutex_lock(&n->mu);
    while (!n->stopping) {
        uint64_t now = now_ms();
        ucx_progress(n);
        if (n->listen_ready) accept_all(n);
        for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++) peer_service(n, pi, now);
        ucx_progress(n);
        process_dirty(n, now);
        timers(n, now);
        /* Sends: notices queued above go out in this pass. */
        for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++) {
            peer *p = &n->peers[pi];
            if ((p->state == PS_HELLO || p->state == PS_READY) && p->tx_off < p->tx_len)
                peer_write(n, pi);
        }
        bool spinning;
        int timeout = poll_timeout(n, now, &spinning);
        if (timeout > 0 && ucp_worker_arm(n->worker) == UCS_ERR_BUSY) timeout = 0;
        nfds_t nf = 0;
        n->pfd[nf++] = (struct pollfd){.fd = n->wake_rd, .events = POLLIN};
        n->pfd[nf++] = (struct pollfd){.fd = n->ucx_fd, .events = POLLIN};
        n->listen_ready = false;
        if (n->listen_fd >= 0) n->pfd[nf++] = (struct pollfd){.fd = n->listen_fd, .events = POLLIN};
        nfds_t first_peer = nf;
        for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++) {
            peer *p = &n->peers[pi];
            p->revents = 0;
            if (p->fd < 0 || p->state == PS_FREE || p->state == PS_CLOSING) continue;
            short ev = p->closing_after_tx ? 0 : POLLIN;
            if (p->state == PS_CONNECTING || p->tx_off < p->tx_len) ev |= POLLOUT;
            n->pfd_peer[nf - first_peer] = pi;
            n->pfd[nf++] = (struct pollfd){.fd = p->fd, .events = ev};
        }
        pthread_mutex_unlock(&n->mu);
        int rc = poll(n->pfd, nf, timeout);
        /* Spinning must not starve the thread we wait for (the peer's
         * progress thread in the same process, the engine) on a busy core. */
        if (spinning) sched_yield();
        pthread_mutex_lock(&n->mu);
        if (rc <= 0) continue;
        if (n->pfd[0].revents) {
            uint8_t junk[64];
            while (read(n->wake_rd, junk, sizeof(junk)) > 0) {}
        }
        if (n->listen_fd >= 0 && n->pfd[2].revents) n->listen_ready = true;
        for (nfds_t i = first_peer; i < nf; i++)
            n->peers[n->pfd_peer[i - first_peer]].revents = n->pfd[i].revents;
    }
    pthread_mutex_unlock(&n->mu);
    return NULL;
}

/* ---- the vtable --------------------------------------------------------------------------- */

static pd_err v_sender_open(void *self, uint64_t id) {
    pd_net *n = self;
    if (n->cfg.role != PD_NET_PREFILL || !n->registered) return PD_ERR_STATE;
    pthread_mutex_lock(&n->mu);
    pd_err err = PD_OK;
    uint32_t r = room_find(n, id);
    if (r == PD_NONE) r = room_new(n, id);
    if (r == PD_NONE) {
        err = PD_ERR_NOMEM;
    } else if ((err = xr_open_sender(&room_at(n, r)->h, room_at(n, r)->dest.known)) == PD_OK) {
        xr_set_tomb(&n->rooms, r, false);
        n->stats.rooms_opened++;
        if (room_at(n, r)->h.st == PD_XFER_FAILED) n->stats.rooms_failed++;
    }
    pthread_mutex_unlock(&n->mu);
    return err;
}

static uint32_t v_sender_peer_cached(void *self, uint64_t id) {
    pd_net *n = self;
    pthread_mutex_lock(&n->mu);
    uint32_t r = room_find(n, id);
    uint32_t cached = r != PD_NONE && room_at(n, r)->dest.known ? room_at(n, r)->dest.cached : 0;
    pthread_mutex_unlock(&n->mu);
    return cached;
}

/* Common checks for posting writes (mutex held). */
static pd_err sendable(pd_net *n, uint64_t id, uint32_t first, const uint32_t *src, uint32_t cnt,
                       room **out) {
    if (n->cfg.role != PD_NET_PREFILL) return PD_ERR_STATE;
    uint32_t r = room_find(n, id);
    if (r == PD_NONE) return PD_ERR_NOTFOUND;
    room *rm = room_at(n, r);
    if (!xr_sendable(&rm->h) || rm->final_staged) return PD_ERR_STATE;
    if ((cnt > 0 && !src) || !xr_dest_covers(&rm->dest, n->cfg.page_size, first, cnt))
        return PD_ERR_INVALID;
    for (uint32_t i = 0; i < cnt; i++)
        if (src[i] >= n->units[REG_KV]) return PD_ERR_INVALID;
    *out = rm;
    return PD_OK;
}

static pd_err v_send_pages(void *self, uint64_t id, uint32_t first, const uint32_t *src,
                           uint32_t cnt) {
    pd_net *n = self;
    pthread_mutex_lock(&n->mu);
    room *rm = NULL;
    pd_err err = sendable(n, id, first, src, cnt, &rm);
    if (!err && cnt > 0) {
        uint32_t base = rm->dest.cached / n->cfg.page_size;
        if (count_runs(rm, base, first, src, cnt) > n->stages_avail) {
            err = PD_ERR_NOMEM;
        } else {
            stage_runs(n, rm, base, first, src, cnt);
            mark_dirty(n, rm);
        }
    }
    if (!err) set_st(n, rm, PD_XFER_TRANSFERRING);
    pthread_mutex_unlock(&n->mu);
    if (!err) wake(n);
    return err;
}

static pd_err v_send_final(void *self, uint64_t id, uint32_t first, const uint32_t *src,
                           uint32_t cnt, uint32_t mamba_slot, uint32_t meta_row) {
    pd_net *n = self;
    pthread_mutex_lock(&n->mu);
    room *rm = NULL;
    pd_err err = sendable(n, id, first, src, cnt, &rm);
    if (!err) {
        uint32_t ps = n->cfg.page_size, base = rm->dest.cached / ps;
        if (!xr_final_fits(&rm->dest, ps, first, cnt, mamba_slot) ||
            (mamba_slot != PD_POOL_NONE && mamba_slot >= n->units[REG_MAMBA]) ||
            meta_row >= n->units[REG_META]) {
            err = PD_ERR_INVALID;
        } else if (count_runs(rm, base, first, src, cnt) + 3 > n->stages_avail) {
            err = PD_ERR_NOMEM;
        } else {
            stage_runs(n, rm, base, first, src, cnt);
            if (mamba_slot != PD_POOL_NONE)
                stage_push(n, rm, REG_MAMBA, mamba_slot, rm->dest.mamba_slot, 1);
            stage_push(n, rm, REG_META, meta_row, rm->dest.meta_row, 1);
            stage_push(n, rm, STAGE_FINAL, 0, 0, 0);
            rm->final_staged = true;
            set_st(n, rm, PD_XFER_TRANSFERRING);
            mark_dirty(n, rm);
        }
    }
    pthread_mutex_unlock(&n->mu);
    if (!err) wake(n);
    return err;
}

/* Finds the live connection to addr or starts one (mutex held). */
static uint32_t peer_for_addr(pd_net *n, const char *addr) {
    for (uint32_t i = 0; i < n->cfg.peers_max; i++) {
        peer *p = &n->peers[i];
        if (p->state != PS_FREE && p->state != PS_CLOSING && !p->closing_after_tx &&
            !strcmp(p->addr, addr))
            return i;
    }
    uint32_t pi = peer_alloc(n);
    if (pi == PD_NONE) return PD_NONE;
    peer *p = &n->peers[pi];
    snprintf(p->addr, sizeof(p->addr), "%s", addr);
    p->state = PS_RESOLVE;
    return pi;
}

/* A connection started for nothing: forget it again if no room uses it. */
static void peer_forget_if_unused(pd_net *n, uint32_t pi) {
    if (pi == PD_NONE || n->peers[pi].state != PS_RESOLVE) return;
    for (uint32_t i = 0; i < n->cfg.rooms_max; i++)
        if (room_at(n, i)->slot.used && room_at(n, i)->peer == pi &&
            room_at(n, i)->peer_gen == n->peers[pi].gen)
            return;
    peer_release(n, &n->peers[pi]);
}

static bool addr_ok(const char *addr) {
    char host[PEER_ADDR_MAX], port[16];
    return addr && strlen(addr) < PEER_ADDR_MAX &&
        split_addr(addr, host, sizeof(host), port, sizeof(port));
}

static bool dest_fits_here(const pd_net *n, const pd_xfer_dest *dest) {
    if (!xr_dest_valid(dest, n->cfg.page_size) || dest->n_pages > BP_DEST_PAGES_MAX ||
        dest->meta_row >= n->units[REG_META] ||
        (dest->mamba_slot != PD_POOL_NONE && dest->mamba_slot >= n->units[REG_MAMBA]))
        return false;
    for (uint32_t i = 0; i < dest->n_pages; i++)
        if (dest->pages[i] >= n->units[REG_KV]) return false;
    return true;
}

static pd_err v_receiver_open(void *self, uint64_t id, const char *peer_addr,
                              const pd_xfer_dest *dest) {
    pd_net *n = self;
    if (n->cfg.role != PD_NET_DECODE || !n->registered) return PD_ERR_STATE;
    if (!dest_fits_here(n, dest) || !addr_ok(peer_addr)) return PD_ERR_INVALID;
    pthread_mutex_lock(&n->mu);
    pd_err err = PD_OK;
    uint32_t r = PD_NONE, pi = PD_NONE;
    if (room_find(n, id) != PD_NONE) err = PD_ERR_EXISTS;
    else if ((pi = peer_for_addr(n, peer_addr)) == PD_NONE) err = PD_ERR_NOMEM;
    else if ((r = room_new(n, id)) == PD_NONE) err = PD_ERR_NOMEM;
    else if ((err = xr_dest_set(&room_at(n, r)->dest, dest)) != PD_OK) room_free(n, r);
    if (!err) {
        room *rm = room_at(n, r);
        rm->peer = pi;
        rm->peer_gen = n->peers[pi].gen;
        PD_MUST(xr_open_receiver(&rm->h));
        n->stats.rooms_opened++;
        mark_dirty(n, rm);
    } else {
        peer_forget_if_unused(n, pi);
    }
    pthread_mutex_unlock(&n->mu);
    if (!err) wake(n);
    return err;
}

static pd_xfer_status v_status(void *self, uint64_t id) {
    pd_net *n = self;
    pthread_mutex_lock(&n->mu);
    uint32_t r = room_find(n, id);
    pd_xfer_status st = r == PD_NONE ? PD_XFER_NONE : xr_status(&room_at(n, r)->h);
    pthread_mutex_unlock(&n->mu);
    return st;
}

/* The engine's abort on the prefill side (mutex held): stop posting, and
 * tell the decode once the writes in flight have completed. */
static pd_err abort_sender(pd_net *n, room *rm, uint64_t late) {
    writes_sync(rm);
    if (xr_abort(&rm->h, XR_SENDER) == XR_ACT_NONE) return PD_OK;
    stages_drop(n, rm);
    writes_sync(rm);
    if (!rm->dest.known) {
        rm->h.early_abort = true; /* told when (if) the destination arrives */
        return PD_OK;
    }
    if (!peer_of(n, rm)) return PD_ERR_IO; /* the decode side is unreachable; it fails the room */
    if (rm->note != N_ACK) {
        rm->note = N_ABORT;
        rm->note_value = ABORT_REASON_ENGINE;
    }
    if (late) due_at(n, rm, late);
    mark_dirty(n, rm);
    return PD_OK;
}

static pd_err v_abort(void *self, uint64_t id) {
    pd_net *n = self;
    pthread_mutex_lock(&n->mu);
    bool fault = n->faults[PD_NET_FAULT_ABORT_ERROR];
    uint32_t r = room_find(n, id);
    if (r == PD_NONE) {
        pthread_mutex_unlock(&n->mu);
        return PD_OK;
    }
    room *rm = room_at(n, r);
    uint64_t late = fault ? now_ms() + 2 * n->cfg.heartbeat_ms : 0;
    pd_err err = PD_OK;
    if (n->cfg.role == PD_NET_PREFILL) {
        err = abort_sender(n, rm, late);
    } else if (xr_abort(&rm->h, XR_RECEIVER) == XR_ACT_NOTIFY) {
        if (late) due_at(n, rm, late);
        mark_dirty(n, rm);
        if (!peer_of(n, rm)) err = PD_ERR_IO;
    }
    pthread_mutex_unlock(&n->mu);
    wake(n);
    return fault ? PD_ERR_IO : err;
}

static bool v_drained(void *self, uint64_t id) {
    pd_net *n = self;
    pthread_mutex_lock(&n->mu);
    bool drained = true;
    uint32_t r = room_find(n, id);
    if (r != PD_NONE) {
        room *rm = room_at(n, r);
        bool sender = n->cfg.role == PD_NET_PREFILL;
        if (sender) writes_sync(rm);
        drained = xr_drained(&rm->h, sender ? XR_SENDER : XR_RECEIVER, now_ms());
    }
    pthread_mutex_unlock(&n->mu);
    return drained;
}

static void v_close(void *self, uint64_t id) {
    pd_net *n = self;
    pthread_mutex_lock(&n->mu);
    uint32_t r = room_find(n, id);
    bool kick = false;
    if (r != PD_NONE && room_at(n, r)->h.open && !room_at(n, r)->h.closed) {
        room *rm = room_at(n, r);
        xr_close(&rm->h);
        rm->t_ms = now_ms();
        if (n->cfg.role == PD_NET_DECODE && !rm->h.dest_sent && peer_of(n, rm)) {
            /* Ended before its destination left: the prefill half may be
             * waiting for one. Tell it, then forget the room. */
            rm->cancel_only = true;
            xr_set_tomb(&n->rooms, r, true);
            mark_dirty(n, rm);
            kick = true;
        } else {
            room_try_release(n, rm);
        }
    }
    pthread_mutex_unlock(&n->mu);
    if (kick) wake(n);
}

/* cancel() on the prefill side (mutex held). */
static void cancel_sender(pd_net *n, uint32_t r, uint64_t id) {
    if (r == PD_NONE) {
        /* The decode half may still send its destination: answer it with ABORT. */
        if ((r = room_new(n, id)) == PD_NONE) return;
        room *rm = room_at(n, r);
        xr_cancel(&rm->h, XR_SENDER);
        rm->h.early_abort = true;
        set_st(n, rm, PD_XFER_FAILED);
        xr_set_tomb(&n->rooms, r, true);
        n->stats.rooms_cancelled++;
        return;
    }
    room *rm = room_at(n, r);
    if (!xr_can_open(&rm->h)) return;
    xr_cancel(&rm->h, XR_SENDER);
    rm->t_ms = now_ms();
    n->stats.rooms_cancelled++;
    if (rm->dest.known && rm->h.st != PD_XFER_FAILED && peer_of(n, rm)) {
        /* An orphan destination: its decode half waits for data. */
        rm->note = N_ABORT;
        rm->note_value = ABORT_REASON_ENGINE;
        xr_set_tomb(&n->rooms, r, true);
        mark_dirty(n, rm);
    } else {
        room_try_release(n, rm);
    }
}

/* cancel() on the decode side (mutex held): a record that sends one ABORT. */
static void cancel_receiver(pd_net *n, uint32_t r, uint64_t id, const char *peer_addr) {
    if (r != PD_NONE || !addr_ok(peer_addr)) return;
    uint32_t pi = peer_for_addr(n, peer_addr);
    if (pi == PD_NONE || (r = room_new(n, id)) == PD_NONE) {
        peer_forget_if_unused(n, pi);
        return;
    }
    room *rm = room_at(n, r);
    rm->peer = pi;
    rm->peer_gen = n->peers[pi].gen;
    rm->cancel_only = xr_cancel(&rm->h, XR_RECEIVER) == XR_ACT_NOTIFY;
    PD_ASSERT(rm->cancel_only);
    xr_set_tomb(&n->rooms, r, true);
    n->stats.rooms_cancelled++;
    mark_dirty(n, rm);
}

static void v_cancel(void *self, uint64_t id, const char *peer_addr) {
    pd_net *n = self;
    if (!n->registered) return;
    pthread_mutex_lock(&n->mu);
    uint32_t r = room_find(n, id);
    if (n->cfg.role == PD_NET_PREFILL) cancel_sender(n, r, id);
    else cancel_receiver(n, r, id, peer_addr);
    pthread_mutex_unlock(&n->mu);
    wake(n);
}

static const pd_xfer_vtable net_vt = {
    .sender_open = v_sender_open,
    .sender_peer_cached = v_sender_peer_cached,
    .send_pages = v_send_pages,
    .send_final = v_send_final,
    .receiver_open = v_receiver_open,
    .status = v_status,
    .abort = v_abort,
    .drained = v_drained,
    .close = v_close,
    .cancel = v_cancel,
};

/* ---- lifecycle ------------------------------------------------------------------------------ */

void pd_net_config_default(pd_net_config *cfg, pd_net_role role) {
    memset(cfg, 0, sizeof(*cfg));
    cfg->role = role;
    cfg->listen_host = "0.0.0.0";
    cfg->bootstrap_port = 8998;
    cfg->page_size = 16;
    cfg->rooms_max = 4096;
    cfg->heartbeat_ms = 1000;
    cfg->dead_after_ms = 5000;
    cfg->peers_max = 64;
}

/* True if every transport named in tls is a shared-memory one (UCX 1.13
 * gives those no peer-failure mode, so asking for it only logs an error). */
static bool tls_shm_only(const char *tls) {
    if (!tls || !*tls || tls[0] == '^') return false;
    static const char *const shm[] = {"shm", "sm", "posix", "sysv", "cma", "knem", "xpmem", "self"};
    char buf[256];
    snprintf(buf, sizeof(buf), "%s", tls);
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        bool ok = false;
        for (size_t i = 0; i < PD_ARRAY_LEN(shm) && !ok; i++) ok = !strcmp(t, shm[i]);
        if (!ok) return false;
    }
    return true;
}

/* UCX's configuration as this node uses it: UCX_* environment variables,
 * which UCX reads itself, with this node's ucx_tls / ucx_net_devices over them. */
static pd_err ucx_config_make(const pd_net *n, ucp_config_t **out, char *msg, size_t cap) {
    ucp_config_t *uc = NULL;
    ucs_status_t st = ucp_config_read(NULL, NULL, &uc);
    if (st != UCS_OK)
        return pd_errorf(msg, cap, PD_ERR_IO, "UCX config: %s", ucs_status_string(st));
    const char *tls = n->cfg.ucx_tls, *devices = n->cfg.ucx_net_devices;
    if (tls && (st = ucp_config_modify(uc, "TLS", tls)) != UCS_OK) {
        ucp_config_release(uc);
        return pd_errorf(msg, cap, PD_ERR_INVALID, "UCX TLS '%s': %s", tls, ucs_status_string(st));
    }
    if (devices && (st = ucp_config_modify(uc, "NET_DEVICES", devices)) != UCS_OK) {
        ucp_config_release(uc);
        return pd_errorf(msg, cap, PD_ERR_INVALID, "UCX NET_DEVICES '%s': %s", devices,
                         ucs_status_string(st));
    }
    *out = uc;
    return PD_OK;
}

/* The transport list of a UCX configuration, as UCX_TLS syntax ("all" when
 * nothing restricts it): ucx_tls if this node set one, else UCX_TLS as UCX
 * read it. UCX has no getter for a single setting, so the configuration is
 * printed into memory and its UCX_TLS line copied to out ("" if that fails). */
static void ucx_config_tls(const ucp_config_t *uc, char *out, size_t cap) {
    static const char key[] = "UCX_TLS=";
    out[0] = '\0';
    char *text = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&text, &len);
    if (!mem) return;
    ucp_config_print(uc, mem, NULL, UCS_CONFIG_PRINT_CONFIG);
    if (fclose(mem) == 0 && text) {
        const char *at = text;
        while (at && strncmp(at, key, sizeof(key) - 1) != 0) {
            at = strchr(at, '\n');
            if (at) at++;
        }
        if (at) {
            at += sizeof(key) - 1;
            snprintf(out, cap, "%.*s", (int)strcspn(at, "\n"), at);
        }
    }
    free(text);
}

static pd_err ucx_init(pd_net *n, char *msg, size_t cap) {
    ucp_config_t *uc = NULL;
    pd_err err = ucx_config_make(n, &uc, msg, cap);
    if (err) return err;
    char tls[256];
    ucx_config_tls(uc, tls, sizeof(tls));
    n->no_peer_mode = tls_shm_only(tls);
    ucp_params_t prm = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME |
            UCP_PARAM_FIELD_REQUEST_SIZE,
        .features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP,
        .request_size = sizeof(req_ctx),
        .name = n->cfg.role == PD_NET_PREFILL ? "pdserve-prefill" : "pdserve-decode",
    };
    ucs_status_t st = ucp_init(&prm, uc, &n->ctx);
    ucp_config_release(uc);
    if (st != UCS_OK) {
        n->ctx = NULL;
        return pd_errorf(msg, cap, PD_ERR_IO, "UCX init: %s", ucs_status_string(st));
    }
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SINGLE};
    if ((st = ucp_worker_create(n->ctx, &wp, &n->worker)) != UCS_OK) {
        n->worker = NULL;
        return pd_errorf(msg, cap, PD_ERR_IO, "UCX worker: %s", ucs_status_string(st));
    }
    if ((st = ucp_worker_get_efd(n->worker, &n->ucx_fd)) != UCS_OK)
        return pd_errorf(msg, cap, PD_ERR_IO, "UCX worker event fd: %s", ucs_status_string(st));
    if ((st = ucp_worker_get_address(n->worker, &n->waddr, &n->waddr_len)) != UCS_OK) {
        n->waddr = NULL;
        return pd_errorf(msg, cap, PD_ERR_IO, "UCX worker address: %s", ucs_status_string(st));
    }
    if (n->waddr_len > BP_WORKER_ADDR_MAX)
        return pd_errorf(msg, cap, PD_ERR_TOOBIG,
                         "UCX worker address of %zu bytes is over the protocol's limit",
                         n->waddr_len);
    return PD_OK;
}

static pd_err listen_init(pd_net *n, char *msg, size_t cap) {
    char port[16];
    snprintf(port, sizeof(port), "%u", n->cfg.bootstrap_port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(n->listen_host, port, &hints, &res);
    if (gai != 0 || !res)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "listen address %s: %s", n->listen_host,
                         gai ? gai_strerror(gai) : "no address");
    int fd = socket(res->ai_family, res->ai_socktype, res->ai_protocol);
    int one = 1;
    if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (fd < 0 || bind(fd, res->ai_addr, res->ai_addrlen) != 0 || listen(fd, 128) != 0 ||
        !set_nonblocking(fd)) {
        int e = errno;
        if (fd >= 0) close(fd);
        freeaddrinfo(res);
        return pd_errorf(msg, cap, PD_ERR_IO, "bootstrap port %s:%u: %s", n->listen_host,
                         n->cfg.bootstrap_port, strerror(e));
    }
    freeaddrinfo(res);
    struct sockaddr_storage sa;
    socklen_t sl = sizeof(sa);
    getsockname(fd, (struct sockaddr *)&sa, &sl);
    n->port = ntohs(sa.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&sa)->sin6_port
                                             : ((struct sockaddr_in *)&sa)->sin_port);
    n->listen_fd = fd;
    return PD_OK;
}

/* What can be refused before anything is allocated. */
static pd_err config_check(const pd_net_config *cfg, char *msg, size_t cap) {
    if (cfg->role != PD_NET_PREFILL && cfg->role != PD_NET_DECODE)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "role must be prefill or decode");
    if (cfg->page_size == 0)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "page_size must be positive");
    if (cfg->token && strlen(cfg->token) > BP_TOKEN_MAX)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "token longer than %u bytes", BP_TOKEN_MAX);
    return PD_OK;
}

/* n->cfg: the caller's config with the documented defaults filled in, and the
 * strings the transport keeps (listen host, token) copied into n. The UCX
 * strings are cleared: ucx_init reads them while the caller's cfg is alive. */
static void config_adopt(pd_net *n, const pd_net_config *cfg) {
    n->cfg = *cfg;
    pd_net_config *c = &n->cfg;
    if (!c->rooms_max) c->rooms_max = 4096;
    if (!c->heartbeat_ms) c->heartbeat_ms = 1000;
    if (!c->dead_after_ms) c->dead_after_ms = 5000;
    if (!c->peers_max) c->peers_max = 64;
    if (!c->stages_max) c->stages_max = PD_MAX(16u * c->rooms_max, 1024u);
    if (!c->drain_grace_ms) c->drain_grace_ms = c->dead_after_ms;
    if (!c->orphan_ms) c->orphan_ms = 60000;
    if (!c->spin_us) c->spin_us = 1000;
    snprintf(n->listen_host, sizeof(n->listen_host), "%s",
             cfg->listen_host ? cfg->listen_host : "0.0.0.0");
    c->listen_host = n->listen_host;
    if (cfg->token) {
        n->token_len = strlen(cfg->token);
        memcpy(n->token, cfg->token, n->token_len);
    }
    c->token = n->token;
    c->ucx_tls = c->ucx_net_devices = NULL;
}

/* Rooms (the room core's table), peers, page-run stages and the poll
 * set, all sized once from the config. */
static pd_err tables_alloc(pd_net *n, char *msg, size_t cap) {
    const pd_net_config *c = &n->cfg;
    if (xr_table_init(&n->rooms, c->rooms_max, sizeof(room), evictable, evict, n) != PD_OK)
        return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory for %u rooms", c->rooms_max);
    n->in_dirty = calloc(c->rooms_max, sizeof(bool));
    n->peers = calloc(c->peers_max, sizeof(peer));
    n->stages = malloc(c->stages_max * sizeof(stage));
    n->dirty = malloc(c->rooms_max * sizeof(uint32_t));
    n->pfd = malloc((c->peers_max + 3) * sizeof(struct pollfd));
    n->pfd_peer = malloc((c->peers_max + 3) * sizeof(uint32_t));
    if (!n->in_dirty || !n->peers || !n->stages || !n->dirty || !n->pfd || !n->pfd_peer)
        return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory for %u rooms", c->rooms_max);
    for (uint32_t s = 0; s < c->stages_max; s++)
        n->stages[s].next = s + 1 < c->stages_max ? s + 1 : PD_NONE;
    n->stage_free = 0;
    n->stages_avail = c->stages_max;
    for (uint32_t i = 0; i < c->peers_max; i++) {
        n->peers[i].net = n;
        n->peers[i].fd = -1;
    }
    return PD_OK;
}

/* The self-pipe other threads write to wake the progress thread. */
static pd_err wake_pipe_init(pd_net *n, char *msg, size_t cap) {
    int pfd[2];
    if (pipe(pfd) != 0) return pd_errorf(msg, cap, PD_ERR_IO, "pipe: %s", strerror(errno));
    n->wake_rd = pfd[0];
    n->wake_wr = pfd[1];
    if (!set_nonblocking(n->wake_rd) || !set_nonblocking(n->wake_wr))
        return pd_errorf(msg, cap, PD_ERR_IO, "pipe: %s", strerror(errno));
    return PD_OK;
}

pd_err pd_net_create(pd_net **out, const pd_net_config *cfg, char *msg, size_t msg_cap) {
    if (!out || !cfg) return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "no config");
    *out = NULL;
    pd_err err = config_check(cfg, msg, msg_cap);
    if (err) return err;
    pd_net *n = calloc(1, sizeof(*n));
    if (!n) return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    n->listen_fd = n->wake_rd = n->wake_wr = n->ucx_fd = -1;
    config_adopt(n, cfg);
    pd_net_config *c = &n->cfg;
    if (c->dead_after_ms <= c->heartbeat_ms) {
        err = pd_errorf(msg, msg_cap, PD_ERR_INVALID,
                        "dead_after_ms (%llu) must exceed heartbeat_ms (%llu)",
                        (unsigned long long)c->dead_after_ms, (unsigned long long)c->heartbeat_ms);
        goto fail;
    }
    if (pthread_mutex_init(&n->mu, NULL) != 0) {
        free(n);
        return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "mutex");
    }
    if ((err = tables_alloc(n, msg, msg_cap))) goto fail;
    n->next_due_ms = UINT64_MAX;
    uint64_t seed = now_ms() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)n;
    n->node_id = pd_splitmix64(&seed);
    if ((err = wake_pipe_init(n, msg, msg_cap))) goto fail;
    c->ucx_tls = cfg->ucx_tls;
    c->ucx_net_devices = cfg->ucx_net_devices;
    err = ucx_init(n, msg, msg_cap);
    c->ucx_tls = c->ucx_net_devices = NULL;
    if (err) goto fail;
    if (c->role == PD_NET_PREFILL && (err = listen_init(n, msg, msg_cap))) goto fail;
    *out = n;
    return PD_OK;
fail:
    pd_net_destroy(n);
    return err;
}

pd_err pd_net_register(pd_net *n, const pd_exec_memory *mem, pd_meta_row *meta, uint32_t meta_rows,
                       char *msg, size_t msg_cap) {
    if (!n || !mem) return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "no memory description");
    if (n->registered || n->running)
        return pd_errorf(msg, msg_cap, PD_ERR_STATE, "memory is registered once, before start");
    if (!mem->kv || mem->kv_pages == 0 || mem->kv_page_bytes == 0)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "no KV pages to register");
    if (!meta || meta_rows == 0)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "no metadata rows to register");
    if ((mem->mamba_slots > 0) != (mem->mamba != NULL && mem->mamba_slot_bytes > 0))
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "Mamba region incomplete");
    n->base[REG_KV] = mem->kv;
    n->unit[REG_KV] = mem->kv_page_bytes;
    n->units[REG_KV] = mem->kv_pages;
    n->base[REG_MAMBA] = mem->mamba_slots ? mem->mamba : NULL;
    n->unit[REG_MAMBA] = mem->mamba_slots ? mem->mamba_slot_bytes : 0;
    n->units[REG_MAMBA] = mem->mamba_slots;
    n->base[REG_META] = (uint8_t *)meta;
    n->unit[REG_META] = sizeof(pd_meta_row);
    n->units[REG_META] = meta_rows;
    for (int r = 0; r < REG_N; r++) {
        if (!n->units[r]) continue;
        ucp_mem_map_params_t mp = {
            .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
            .address = n->base[r],
            .length = n->unit[r] * n->units[r],
        };
        ucs_status_t st = ucp_mem_map(n->ctx, &mp, &n->memh[r]);
        if (st != UCS_OK) {
            n->memh[r] = NULL;
            return pd_errorf(msg, msg_cap, PD_ERR_IO, "UCX memory registration: %s",
                             ucs_status_string(st));
        }
        st = ucp_rkey_pack(n->ctx, n->memh[r], &n->rkey_buf[r], &n->rkey_len[r]);
        if (st != UCS_OK) {
            n->rkey_buf[r] = NULL;
            return pd_errorf(msg, msg_cap, PD_ERR_IO, "UCX remote key: %s", ucs_status_string(st));
        }
        if (n->rkey_len[r] == 0 || n->rkey_len[r] > BP_RKEY_MAX)
            return pd_errorf(msg, msg_cap, PD_ERR_TOOBIG, "UCX remote key of %zu bytes",
                             n->rkey_len[r]);
    }
    n->registered = true;
    return PD_OK;
}

pd_err pd_net_start(pd_net *n, char *msg, size_t msg_cap) {
    if (!n || !n->registered)
        return pd_errorf(msg, msg_cap, PD_ERR_STATE, "register memory before start");
    if (n->running) return pd_errorf(msg, msg_cap, PD_ERR_STATE, "already started");
    if (pthread_create(&n->thread, NULL, progress_main, n) != 0)
        return pd_errorf(msg, msg_cap, PD_ERR_IO, "progress thread: %s", strerror(errno));
    n->running = true;
    return PD_OK;
}

pd_xfer pd_net_endpoint(pd_net *n) { return (pd_xfer){.vt = &net_vt, .self = n}; }

uint16_t pd_net_bootstrap_port(const pd_net *n) { return n->port; }

void pd_net_stats_get(pd_net *n, pd_net_stats *out) {
    pthread_mutex_lock(&n->mu);
    *out = n->stats;
    pthread_mutex_unlock(&n->mu);
}

uint32_t pd_net_rooms_live(pd_net *n) {
    pthread_mutex_lock(&n->mu);
    uint32_t live = xr_used(&n->rooms);
    pthread_mutex_unlock(&n->mu);
    return live;
}

void pd_net_set_fault(pd_net *n, pd_net_fault fault, bool on) {
    if ((unsigned)fault >= PD_NET_FAULT__COUNT) return;
    pthread_mutex_lock(&n->mu);
    n->faults[fault] = on;
    if (!on && fault == PD_NET_FAULT_HOLD_NOTICES)
        for (uint32_t r = 0; r < n->cfg.rooms_max; r++)
            if (room_at(n, r)->slot.used && room_at(n, r)->note != N_NONE)
                mark_dirty(n, room_at(n, r));
    pthread_mutex_unlock(&n->mu);
    wake(n);
}

/* UCX 1.13 aborts the process in ucp_worker_destroy when a wire-up message
 * is still queued on an endpoint UCX created itself (seen over TCP when the
 * peer's endpoint was created moments before the shutdown). Let the worker
 * finish what it started — a worker flush waits for that — within budget_ms. */
static void ucx_settle(pd_net *n, uint64_t budget_ms) {
    if (!n->worker) return;
    ucp_request_param_t prm = {.op_attr_mask = 0};
    void *req = ucp_worker_flush_nbx(n->worker, &prm);
    if (!UCS_PTR_IS_PTR(req)) return;
    uint64_t t0 = now_ms();
    while (ucp_request_check_status(req) == UCS_INPROGRESS && since(now_ms(), t0) < budget_ms) {
        if (!ucp_worker_progress(n->worker)) nanosleep(&(struct timespec){.tv_nsec = 100000}, NULL);
    }
    ucp_request_free(req);
}

void pd_net_destroy(pd_net *n) {
    if (!n) return;
    if (n->running) {
        pthread_mutex_lock(&n->mu);
        n->stopping = true;
        pthread_mutex_unlock(&n->mu);
        wake(n);
        pthread_join(n->thread, NULL);
        n->running = false;
    }
    /* Single-threaded from here. Fail every connection: the forced endpoint
     * closes complete every outstanding put before memory goes away. */
    bool made = n->rooms.recs != NULL;
    if (n->peers && made) {
        for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++)
            peer_fail(n, pi, "transport shutting down");
        /* Forced closes complete at once in peer-failure mode; requests a
         * mode-PD_NONE endpoint left behind are released by the worker below. */
        uint64_t t0 = now_ms();
        for (;;) {
            bool closing = false;
            if (n->worker) ucx_progress(n);
            for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++) {
                peer *p = &n->peers[pi];
                if (p->state != PS_CLOSING) continue;
                if (ucp_request_check_status(p->close_req) != UCS_INPROGRESS) {
                    ucp_request_free(p->close_req);
                    peer_release(n, p);
                } else {
                    closing = true;
                }
            }
            if ((!closing && n->ucx_out == 0) || since(now_ms(), t0) > 1000) break;
            nanosleep(&(struct timespec){.tv_nsec = 200000}, NULL);
        }
        /* Late completions find a stale generation and are ignored. */
        for (uint32_t r = 0; r < n->cfg.rooms_max; r++) room_at(n, r)->slot.gen++;
        ucx_settle(n, 1000);
        for (uint32_t r = 0; r < n->cfg.rooms_max; r++) xr_dest_clear(&room_at(n, r)->dest);
    }
    for (int r = 0; r < REG_N; r++) {
        if (n->rkey_buf[r]) ucp_rkey_buffer_release(n->rkey_buf[r]);
        if (n->memh[r]) ucp_mem_unmap(n->ctx, n->memh[r]);
    }
    if (n->waddr) ucp_worker_release_address(n->worker, n->waddr);
    if (n->worker) ucp_worker_destroy(n->worker);
    if (n->ctx) ucp_cleanup(n->ctx);
    if (n->listen_fd >= 0) close(n->listen_fd);
    if (n->wake_rd >= 0) close(n->wake_rd);
    if (n->wake_wr >= 0) close(n->wake_wr);
    if (made) pthread_mutex_destroy(&n->mu);
    xr_table_free(&n->rooms);
    free(n->in_dirty);
    free(n->peers);
    free(n->stages);
    free(n->dirty);
    free(n->pfd);
    free(n->pfd_peer);
    free(n);
}
