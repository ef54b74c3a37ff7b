/*
 * net_internal.h — what the three files of the network transport share
 * (src/xfer/net.c: the vtable, the progress loop, timers and lifecycle;
 * net_conn.c: the TCP bootstrap connections and their messages; net_ucx.c:
 * UCX memory, puts, flushes and completions). Private to src/xfer. One
 * mutex guards everything here (net.c explains the threads).
 */
#ifndef PD_XFER_NET_INTERNAL_H
#define PD_XFER_NET_INTERNAL_H

#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include <ucp/api/ucp.h>

#include "bootstrap_proto.h"
#include "pdserve/net.h"
#include "room.h"

#define REG_KV BP_REG_KV
#define REG_MAMBA BP_REG_MAMBA
#define REG_META BP_REG_META
#define REG_N BP_REG_COUNT
#define STAGE_FINAL 0xFFu

#define RX_INIT_BYTES (64u << 10)
#define TX_INIT_BYTES (64u << 10)
#define TX_MAX_BYTES (32u << 20) /* a peer that stops reading is failed */
#define PEER_ADDR_MAX 256u
#define PROGRESS_BURST 256
#define POLL_IDLE_MS 100
#define POLL_BUSY_MS 1  /* while UCX requests are outstanding */
#define POLL_RECV_MS 10 /* decode, while a prefill peer is connected */
#define ORPHAN_SCAN_MS 250
/* The progress thread goes under SCHED_BATCH only after this long without
 * work of its own (net.c, sched_before_sleep): longer than the gap between
 * one large room's put and the next in a stream of them. */
#define SCHED_LINGER_NS 200000u
#define FINAL_INLINE_BYTES (64u << 10) /* a final send this small may post inline */
/* A room handed off in one final send of at most this many bytes travels in
 * its completion notice (version 4, net_ucx.c send_notice_data) to a peer
 * whose puts UCX emulates, unless the config says otherwise
 * (notice_data_max; net.c final_in_notice). */
/* Over tcp (bench/xfer, tiny model, hand-off medians, notice / puts): 28 KiB
 * 14-22 / 45-56 us, 148 KiB 51-57 / 76-82, 244 KiB 79-90 / 96-108. Up to the
 * protocol's bound since 1 December 2026: per-pair ratios notice / puts over
 * 5 alternated pairs 0.65 at 276 KiB, 0.77 at 532, 0.91 at 788, 0.83 at
 * 1,012 KiB; 1,012 KiB rooms at 3.5-4.0 GB/s against 2.3-2.5, and the
 * decode's status() calls no longer than with puts (docs/bootstrap-protocol.md,
 * "The notice's bound: 1 MiB"). */
#define NOTICE_DATA_DEFAULT_BYTES BP_NOTICE_DATA_MAX
/* Data messages (version 5) of one room in flight at a time: each holds its
 * header until UCX completes it, and together they keep the socket full
 * (4 MiB where the kernel's loopback buffers took 4.8 MB at once). */
#define DATA_MSGS_INFLIGHT 4u
#define DATA_MSG_HEADER_BYTES (BP_NOTICE_DATA_FIXED + BP_NOTICE_SEG_BYTES) /* one segment */
#define TCP_TX_SEG "64K" /* UCX tcp's send segment: its receive segment's default (net_ucx.c) */
/* UCX tcp's receive segment where tcp may be used: large enough for a peer's
 * TCP_TX_SEG_LARGE (pd_net_config.ucx_tcp_large_segments; net_ucx.c). */
#define TCP_RX_SEG "256K"
#define TCP_TX_SEG_LARGE "256K"
/* Assisted progress (net.c): after a turn that took d ns, the next waits
 * ASSIST_GAP_FACTOR * d, and at least ASSIST_GAP_MIN_NS, so a caller polling
 * hundreds of rooms spends at most half of its time on them. (A gap of 2d,
 * at least 2 us, left the notice waiting longer: shm 32 us per room instead
 * of 26, tcp 97 instead of 90, medians of 8 alternated runs.) */
#define ASSIST_GAP_MIN_NS 500u
#define ASSIST_GAP_FACTOR 1u
/* An assisted turn progresses the UCX worker at most this many times per
 * pass (the progress thread: PROGRESS_BURST). Over tcp one call receives
 * and applies up to UCX_TCP_MAX_POLL segments of an emulated put; a turn
 * that went on while calls found more kept the decode's engine thread
 * 0.2-3.6 ms in one status() call per 32.8 MiB room. One call picks up a
 * notice as well (bench/xfer, docs/bootstrap-protocol.md, "An assisted
 * turn progresses the worker once"). */
#define ASSIST_PROGRESS_BURST 1
#define DNS_THREADS_MAX 4 /* resolver threads: a hung lookup delays no other (net_dns.c) */
/* Puts into a peer's shared memory copied by several threads (net_copy.c):
 * from this size, in chunks of COPY_CHUNK_BYTES, by at most COPY_THREADS_MAX
 * threads (the progress thread and its helpers). Below it the helper's
 * wake-up eats the gain on two busy cores (bench/xfer, shm, medians of 5
 * alternated runs, one thread / two: 2 MiB 68 / 76 us, 4 MiB 129 / 125,
 * 6 MiB 203 / 186, 8 MiB 320 / 168). */
#define COPY_PARALLEL_MIN_BYTES (4u << 20)
#define COPY_CHUNK_BYTES (256u << 10)
#define COPY_THREADS_MAX 8u
#define OWN_MAX 8 /* allocations made through pd_net_allocator (KV, Mamba, meta rows) */
#define ABORT_REASON_ENGINE 1u
#define ABORT_REASON_WRITE_ERROR 2u
#define ABORT_REASON_ORPHAN 3u
#define ABORT_REASON_DEST_SENT 4u /* decode: its DEST for the room went first */

typedef struct stage {
    uint32_t next;
    uint32_t reg;         /* REG_* or STAGE_FINAL */
    uint32_t src, dst, n; /* units of the region */
    uint32_t pos;         /* KV: dst's position in the destination page list */
} stage;

/* Memory the transport allocated for its node (pd_net_allocator): UCX mapped
 * it, so a peer's rkey for it names a segment a put can copy into directly. */
typedef struct own_mem {
    uint8_t *addr;
    size_t len;
    ucp_mem_h memh; /* NULL: slot free */
    bool released;  /* its owner freed it; unmapped once the transport is done */
} own_mem;

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
    bool started;    /* START sent */
    bool need_flush; /* puts posted since the last flush */
    bool r_aborted;  /* the decode asked to stop */
    notice note;     /* sent once every posted write has completed */
    uint64_t note_value;
    uint32_t puts_out, flush_out;
    uint32_t large_out; /* of puts_out, those over FINAL_INLINE_BYTES (net.c, assist) */
    /* The notice's AM header (and, for one that carries the room's bytes,
     * the source of each segment), kept until the send completes. */
    uint8_t notice_wire[BP_NOTICE_DATA_HEADER_MAX];
    ucp_dt_iov_t notice_iov[BP_NOTICE_SEGS_MAX];
    uint32_t notice_segs;
    bool data_in_notice; /* decided at send_final: the staged writes go in the notice */
    /* Version 5: the headers of its data messages in flight, one slot each
     * (bit i of data_busy: slot i is UCX's until the send completes). */
    uint8_t data_wire[DATA_MSGS_INFLIGHT][DATA_MSG_HEADER_BYTES];
    uint8_t data_busy;
    uint32_t q_head, q_tail;
    uint64_t bytes;
    /* decode */
    bool abort_wired; /* our ABORT is on the wire */
    bool peer_lost;
    bool lost_unreliable; /* the lost peer's endpoint had no peer-failure mode */
    bool cancel_only;     /* never opened here: one ABORT to the prefill, then freed */
    uint64_t lost_ms;
} room;

/* Lives in the user area UCX reserves in every request (request_size): a
 * completion finds its room by index and generation, so a completion that
 * comes after the room's writes were abandoned touches nothing. */
typedef struct req_ctx {
    pd_net *net;
    uint32_t room, gen;
    bool large;       /* a put over FINAL_INLINE_BYTES */
    int8_t data_slot; /* a data message's header slot in its room, else -1 */
} req_ctx;

typedef enum peer_state {
    PS_FREE = 0,
    PS_RESOLVE,   /* decode: to connect (a numeric address resolves in place) */
    PS_RESOLVING, /* decode: a host name with the resolver thread (net_dns.c) */
    PS_CONNECTING,
    PS_AUTH,  /* prefill: waiting for AUTH; decode: AUTH sent, waiting for CHALLENGE */
    PS_HELLO, /* prefill: CHALLENGE sent, waiting for HELLO; decode: waiting for HELLO_OK */
    PS_READY,
    PS_CLOSING
} peer_state;

/* A name resolution for one peer slot (net_dns.c); guarded by dns_mu. */
typedef enum dns_state { DNS_IDLE = 0, DNS_POSTED, DNS_RUNNING, DNS_DONE } dns_state;
typedef struct net_dns_job {
    dns_state state;
    bool abandoned; /* its peer failed while the resolver ran: it frees the answer */
    char host[PEER_ADDR_MAX], port[16];
    uint64_t delay_ms; /* PD_NET_FAULT_SLOW_RESOLVE */
    int gai;
    struct addrinfo *res;
} net_dns_job;

typedef struct peer {
    pd_net *net;
    peer_state state;
    uint32_t gen;
    int fd;
    short revents;
    bool ever_ready;
    bool ucx_failed;       /* the endpoint's error handler fired */
    bool closing_after_tx; /* a fatal ERROR is queued: send it, then close */
    uint16_t ver;          /* the protocol version this connection speaks */
    uint16_t redial_ver;   /* decode: the prefill refused our version: reconnect in this one */
    char addr[PEER_ADDR_MAX];
    uint64_t t_state_ms, last_rx_ms, last_tx_ms;
    uint8_t *rx;
    size_t rx_len, rx_cap;
    uint8_t *tx;
    size_t tx_off, tx_len, tx_cap;
    uint64_t node_id;
    uint8_t nonce_decode[BP_NONCE_BYTES], nonce_prefill[BP_NONCE_BYTES];
    /* prefill: the decode node's memory */
    ucp_ep_h ep;
    bool ep_no_peer_mode;
    bool flush_waits; /* its last flush did not complete at once (tcp: it waits for acks) */
    bool puts_direct; /* UCX puts to it are a transport's own, not emulated (net_ucx.c) */
    void *close_req;
    ucp_rkey_h rkey[REG_N];
    uint64_t rbase[REG_N], runit[REG_N];
    uint32_t runits[REG_N];
} peer;

/* One entry of the published status table (net.c, "status without the
 * mutex"): the status a room last had under the mutex, written under it
 * as a sequence lock, read without it. st == PUB_EMPTY: no entry. */
typedef struct net_pub {
    _Atomic uint32_t seq; /* odd while a writer changes the entry */
    _Atomic uint32_t st;
    _Atomic uint64_t id;
} net_pub;

/* pd_net_config.progress_sched_batch, resolved: the progress thread never
 * under SCHED_BATCH, only while it sleeps with nothing handed to it, or
 * always. */
typedef enum sched_mode { SCHED_MODE_NEVER, SCHED_MODE_IDLE, SCHED_MODE_ALWAYS } sched_mode;

/* The threads that copy a large put into a peer's shared memory (net_copy.c).
 * The job (dst, src, len, gen) changes under mu, only while no helper is
 * inside the last one (active == 0); helpers take chunks at next and count
 * the bytes they copied in copied. */
typedef struct copy_pool {
    pthread_t threads[COPY_THREADS_MAX - 1];
    uint32_t helpers; /* running */
    bool ready;       /* mu and cv initialised */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t gen;
    bool stop;
    uint8_t *dst;
    const uint8_t *src;
    size_t len;
    _Atomic size_t next, copied;
    _Atomic uint32_t active;
} copy_pool;

struct pd_net {
    pd_net_config cfg;
    uint16_t proto;          /* the newest protocol version this node speaks (config) */
    size_t notice_data_max;  /* 0: no room's bytes travel in its notice */
    bool notice_data_always; /* also to peers whose puts are direct (config > 0) */
    bool data_msgs;          /* version 5 and notice_data_max >= 0: rooms as data messages
                                to peers whose puts UCX emulates */
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
    uint32_t large_out;     /* puts over FINAL_INLINE_BYTES not yet completed, all rooms */
    uint64_t last_event_ns; /* the worker last reported progress, or a reply became due */
    bool spinning;          /* the progress thread's next poll does not sleep: it sees
                               dirty rooms without a wake-up through the pipe */
    /* The progress thread's scheduling policy (net.c, sched_set) */
    sched_mode sched_mode;
    bool sched_started;   /* sched_self is set */
    bool sched_batch_now; /* it is under SCHED_BATCH */
    pthread_t sched_self;
    uint64_t sched_busy_ns; /* it was last handed work, or owed some (SCHED_LINGER_NS) */
    bool sched_owed;        /* it owed work at the start of a pass since it last slept */
    /* registered memory */
    bool registered;
    uint8_t *base[REG_N];
    size_t unit[REG_N];
    uint32_t units[REG_N];
    ucp_mem_h memh[REG_N];
    bool memh_own[REG_N]; /* memh[r] belongs to an own_mem, not to the registration */
    own_mem own[OWN_MAX];
    void *rkey_buf[REG_N];
    size_t rkey_len[REG_N];
    /* tables, all sized at creation */
    xr_table rooms;
    bool *in_dirty; /* per room slot: on the dirty ring (a stale entry may name a
                                  freed slot) */
    peer *peers;
    stage *stages;
    uint32_t stage_free, stages_avail;
    uint32_t *dirty, dirty_head, dirty_n;
    struct pollfd *pfd;
    uint32_t *pfd_peer, *pfd_gen; /* the peer slot (and its generation) of pfd[i] */
    /* Assisted turns (net.c): their own poll set, apart from the one the
     * progress thread's poll() is using outside the mutex. */
    struct pollfd *apfd;
    uint32_t *apfd_peer;
    uint64_t assist_next_ns;
    /* Status without the mutex (net.c): the published table, pub_mask + 1
     * entries (a power of two, at least twice rooms_max), direct-mapped by
     * a hash of the room id; since when status() has answered from it
     * (0: it took the mutex last). */
    net_pub *pub;
    uint32_t pub_mask;
    _Atomic uint64_t stale_since_ns;         /* status()'s streak, restarted by a refresh */
    _Atomic uint64_t drained_stale_since_ns; /* drained()'s, which no refresh answers */
    atomic_bool pub_wanted; /* a status() answered without the mutex since the last refresh */
    /* PD_NET_FAULT_HOLD_MUTEX: asked for; the progress thread holds the mutex for it */
    atomic_bool hold_mutex, holding_mutex;
    _Atomic uint64_t status_unlocked, drained_unlocked; /* pd_net_stats */
    bool engine_turn;   /* the engine's thread pumps (send_final inline, an assisted turn):
                       * the flush after a notice is left to the progress thread */
    size_t post_budget; /* bytes of puts the caller may still post: SIZE_MAX but in an
                           assisted turn, where FINAL_INLINE_BYTES (net_pump_sender) */
    nfds_t listen_pfd;  /* the listening socket's index in pfd, 0: none */
    uint64_t next_due_ms, next_scan_ms;
    uint32_t abandon_pending; /* rooms that may need abandon_dead_writes */
    bool faults[PD_NET_FAULT__COUNT];
    pd_net_stats stats;
    uint64_t node_id;
    /* the resolver thread (net_dns.c), started on the first host name */
    net_dns_job *dns;
    pthread_mutex_t dns_mu;
    pthread_cond_t dns_cv;
    pthread_t dns_threads[DNS_THREADS_MAX];
    uint32_t dns_threads_up, dns_busy; /* started; in a lookup (or its fault's delay) */
    bool dns_ready, dns_stopping;
    copy_pool copy;
};

/* ---- small helpers ---------------------------------------------------------------- */

static inline uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Milliseconds from t to now; 0 if t is later (it was stamped after now was
 * read at the top of the progress loop). */
static inline uint64_t since(uint64_t now, uint64_t t) { return now > t ? now - t : 0; }

static inline uint32_t ridx(const pd_net *n, const room *rm) {
    return (uint32_t)(((const char *)rm - n->rooms.recs) / sizeof(room));
}

static inline room *room_at(const pd_net *n, uint32_t r) { return (room *)xr_at(&n->rooms, r); }

static inline uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* The transport's mutex, taken by spinning a while before sleeping: the
 * critical sections are a few microseconds, and a thread put to sleep on a
 * contended futex waits for the scheduler to wake it (10-30 us on a busy
 * host), which on a room's critical path cost more than the work itself
 * (the engine polling status() while the progress thread handles the DEST).
 * Bounded, and short: a longer spin (2,000 tries, about 80 us) cost more
 * than it saved on an oversubscribed host, where the holder was waiting
 * for the CPU the spinner burnt (a receiver_open took 83 us that way). */
#define NET_LOCK_SPINS 64 /* tries with a pause between, about 2-4 us */
#define NET_LOCK_YIELDS 8 /* then tries that give the CPU away in between */
static inline void net_lock(pd_net *n) {
    for (int i = 0; i < NET_LOCK_SPINS; i++) {
        if (pthread_mutex_trylock(&n->mu) == 0) return;
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
    }
    /* The holder may be waiting for this CPU (an oversubscribed host):
     * spinning on would burn the time it needs. */
    for (int i = 0; i < NET_LOCK_YIELDS; i++) {
        if (pthread_mutex_trylock(&n->mu) == 0) return;
        sched_yield();
    }
    pthread_mutex_lock(&n->mu);
}

static inline void net_unlock(pd_net *n) { pthread_mutex_unlock(&n->mu); }

/* Decode side: a room's news is due soon (its DEST went out, its data is on
 * the way): the progress thread polls without sleeping for spin_us from
 * now, so that DONE is handled without a wake-up from poll (mutex held). */
static inline void net_expect_soon(pd_net *n) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    n->last_event_ns = (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- net.c: helpers, rooms, staged writes, timers -------------------------------- */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
void net_log(pd_net *n, const char *fmt, ...);
bool net_set_nonblocking(int fd);
/* Wakes the progress thread from its poll (any thread, no lock needed). */
void net_wake(pd_net *n);
void net_set_st(pd_net *n, room *rm, pd_xfer_status st);
void net_due_at(pd_net *n, room *rm, uint64_t t);
uint32_t net_room_find(const pd_net *n, uint64_t id);
void net_mark_dirty(pd_net *n, room *rm);
uint32_t net_room_new(pd_net *n, uint64_t id);
void net_room_free(pd_net *n, uint32_t r);
void net_room_try_release(pd_net *n, room *rm);
peer *net_peer_of(pd_net *n, const room *rm);
void net_writes_sync(room *rm);
/* A destination that came from the decode and that the engine never opened. */
bool net_room_orphan(const room *rm);
void net_stages_drop(pd_net *n, room *rm);

/* ---- net_conn.c: bootstrap connections and messages ------------------------------ */
uint8_t *net_tx_reserve(peer *p, size_t max);
void net_tx_commit(pd_net *n, peer *p, size_t len);
bool net_send_room_msg(pd_net *n, uint32_t pi, bp_type type, uint64_t room_id, uint64_t value);
void net_peer_release(pd_net *n, peer *p);
void net_peer_fail(pd_net *n, uint32_t pi, const char *why);
void net_pump_receiver(pd_net *n, room *rm, uint64_t now);
/* Decode side: a room's completion notice came on the data path (net_ucx.c's
 * active-message handler, mutex held). */
void net_on_notice(pd_net *n, uint64_t room_id, uint64_t bytes, uint64_t node_id);
/* Decode side: a message that carries room bytes, checked against the
 * room's destination and copied into it: the notice with data (final,
 * version 4: then the room succeeds) or a data message (not final, version
 * 5). One that does not fit writes nothing and fails the room. */
void net_on_room_bytes(pd_net *n, const bp_notice *nt, const uint8_t *data, size_t len, bool final);
/* Decode side: whether a room's bytes may come in messages it copies in
 * itself (a notice with data, version 4; data messages, version 5), so its
 * destination page list is kept once the DEST is out. */
bool net_dest_list_kept(const pd_net *n, const room *rm, const peer *p);
void net_peer_write(pd_net *n, uint32_t pi);
bool net_tx_try(pd_net *n, uint32_t pi);
void net_accept_all(pd_net *n);
void net_peer_service(pd_net *n, uint32_t pi, uint64_t now);
/* An assisted turn (a vtable caller, mutex held): reads and handles what the
 * connected peers' sockets hold now, without waiting and without closing any
 * (end of stream and errors are left to the progress thread, whose poll()
 * watches the same sockets). */
void net_peers_read_now(pd_net *n, uint64_t now);
uint32_t net_peer_for_addr(pd_net *n, const char *addr);
void net_peer_forget_if_unused(pd_net *n, uint32_t pi);
bool net_addr_ok(const char *addr);
pd_err net_listen_init(pd_net *n, char *msg, size_t cap);

/* ---- net_dns.c: name resolution off the progress thread ------------------------- */
pd_err net_dns_init(pd_net *n);
/* Hands host:port of peer slot pi to the resolver; false if it cannot start. */
bool net_dns_post(pd_net *n, uint32_t pi, const char *host, const char *port, uint64_t delay_ms);
/* NET_DNS_PENDING while pending; else getaddrinfo's result (*res is the
 * caller's to free when 0). */
#define NET_DNS_PENDING 1 /* getaddrinfo's own codes are 0 or negative */
int net_dns_take(pd_net *n, uint32_t pi, struct addrinfo **res);
void net_dns_abandon(pd_net *n, uint32_t pi);
/* False while an abandoned resolution of that slot is still running. */
bool net_dns_slot_free(pd_net *n, uint32_t pi);
void net_dns_fini(pd_net *n);

/* ---- net_copy.c: large puts into shared memory, on several threads ------------- */
pd_err net_copy_start(pd_net *n, char *msg, size_t msg_cap);
void net_copy_stop(pd_net *n);
/* Whether a put of len bytes is copied by the copy threads (when its
 * destination is mapped here). */
bool net_copy_parallel(const pd_net *n, size_t len);
/* Copies len bytes on the calling thread and the helpers; returns when all
 * are, with how many the calling thread copied itself. */
size_t net_copy(pd_net *n, void *dst, const void *src, size_t len);

/* ---- net_ucx.c: UCX memory, puts and completions --------------------------------- */
void net_pump_sender(pd_net *n, room *rm, uint64_t now);
const char *net_worker_addr_problem(const pd_net *n, const uint8_t *addr, size_t len);
ucs_status_t net_peer_ep_create(pd_net *n, peer *p, const bp_hello *h);
bool net_peer_regions_set(peer *p, const bp_hello *h);
void net_abandon_dead_writes(pd_net *n, uint64_t now);
/* Up to burst ucp_worker_progress calls, while they report events; the
 * calls made. */
unsigned net_ucx_progress(pd_net *n, int burst);
pd_err net_ucx_init(pd_net *n, char *msg, size_t cap);
/* UCX's configuration as a node with cfg uses it (UCX_* environment, then
 * cfg's transports and devices, then pd_net's own settings); the caller
 * releases it. */
pd_err net_ucx_config_make(const pd_net_config *cfg, ucp_config_t **out, char *msg, size_t cap);
void net_ucx_config_value(const ucp_config_t *uc, const char *key, char *out, size_t cap);
void net_ucx_settle(pd_net *n, uint64_t budget_ms);
/* Unmaps what pd_net_allocator gave out (destroy: every owner has freed it). */
void net_own_release_all(pd_net *n);

#endif /* PD_XFER_NET_INTERNAL_H */
