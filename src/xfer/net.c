/*
 * net.c — pd_net, the network transport between a prefill node and a decode
 * node (include/pdserve/net.h): a TCP bootstrap channel for control, UCX
 * one-sided puts for the data. It implements the pd_xfer contract by driving
 * the room core (src/xfer/room.h): every status change, the drained rule,
 * abort, cancel and tombstones are the core's; this transport carries the
 * news. Three files: this one (the vtable, rooms, timers, the progress loop,
 * lifecycle), net_conn.c (the bootstrap connections and their messages) and
 * net_ucx.c (UCX memory, puts, flushes and completions), sharing
 * net_internal.h.
 *
 * Threads. The engine's scheduler thread calls the vtable; one progress
 * thread per pd_net owns every socket and the UCX worker (created in
 * UCS_THREAD_MODE_SERIALIZED: the engine thread touches it only to post a
 * small final send inline, under the mutex). One mutex guards
 * all state. A vtable call takes the mutex, validates, updates the room,
 * queues work (staged page runs, a notice to send, a room marked dirty) and
 * wakes the progress thread through a pipe: it never waits on the network.
 * status() and drained() take the mutex only if it is free, else answer
 * from what was published under it (status without the mutex, below).
 * The progress thread holds the mutex while it works and releases it only
 * around poll(). UCX completion callbacks run inside ucp_worker_progress on
 * the progress thread, so they too run under the mutex. A prefill's progress
 * thread sleeps under SCHED_BATCH while it has had nothing of its own to do
 * for 0.2 ms, so that its wake-ups do not preempt the engine (see
 * sched_set).
 *
 * Rooms. The room core's table of rooms_max rooms, allocated at creation.
 * On the prefill side a room exists from the first of sender_open() or the
 * decode's DEST; it may outlive close() while its last
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
 *   the progress thread posts them with ucp_put_nbx in order. At FINAL,
 *   once every put of the room completed locally, it posts the completion
 *   notice (protocol version 3, net_ucx.c send_notice): ucp_worker_fence,
 *   then a UCX active message on the same endpoint, which UCX delivers after
 *   the puts: the notice can never overtake data. A flush follows it, off
 *   the critical path; the room is kept until it completed.
 *   Version 4: a room handed off in one final send of at most
 *   notice_data_max bytes, to a peer whose puts UCX emulates (tcp), posts no
 *   put: its staged runs, slot and row become the segments of one eager
 *   active message (net_ucx.c send_notice_data), named by position in the
 *   room's destination; the decode node checks them against its own
 *   destination and copies them in itself, only while the room still owns
 *   its pages (net_conn.c net_on_room_bytes). No flush follows: nothing of
 *   the room is on the wire but the notice, so an ACK may overtake it, and
 *   the decode then drops it unread.
 *   Version 5: to such a peer every other room goes the same way in pieces:
 *   its staged writes as data messages (net_ucx.c post_data: the notice's
 *   layout, one segment, at most BP_NOTICE_DATA_MAX bytes, DATA_MSGS_INFLIGHT
 *   of the room at a time), then the plain notice behind them on the same
 *   endpoint. The decode checks and copies each (net_conn.c
 *   net_on_room_bytes) while the room owns its pages and has not ended; a
 *   message that does not fit fails the room. No put, so no flush and no
 *   acknowledgement that a dying prefill leaves UCX unable to send.
 *   An abort (either side): stop posting, drop what is staged, flush, and
 *   send ABORT (sender's own abort) or ACK (the decode's abort) on the
 *   bootstrap connection only after the flush and every posted write have
 *   completed (that message could otherwise overtake a put over tcp) — it is
 *   what lets the decode side call the room drained.
 *
 * drained(). Sender: nothing staged and no put outstanding (a put's local
 * completion means UCX no longer reads the source). Receiver: the sender said
 * it will write no more (the notice, ABORT, ACK, or a room-level ERROR refusing our
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
 * are short and there is one engine thread per node. It is taken by spinning
 * a bounded while before sleeping (net_lock): a thread put to sleep on it
 * waits for the scheduler, and on a room's critical path (the engine polling
 * status() while the progress thread handles the DEST) that wake-up cost
 * more than the work it waited for. The progress thread
 * sleeps on the worker's event fd (UCP_FEATURE_WAKEUP), with a 1 ms cap while
 * requests are outstanding (a send waiting for resources raises no event) and
 * a 10 ms cap on a connected decode node (a missed wake-up costs at most
 * that). After UCX reports progress it keeps polling for spin_us (yielding
 * the CPU each turn): without real remote memory access (shared memory
 * between processes, TCP) UCX emulates puts with active messages that the
 * decode side applies, and a thread that sleeps between fragments turns
 * gigabytes per second into megabytes. A decode node also spins for spin_us
 * when a room's news is due (net_expect_soon: its DEST went out, DEST_OK or
 * START came in), so the notice is handled without a wake-up from poll. Only the
 * decode side: a prefill thread spinning after a DEST arrived held the mutex
 * the engine's status() and send_final() needed, and the one-page room took
 * 47 us instead of 35-39 (bench/xfer, alternated). While a progress thread
 * spins, the vtable's calls leave out the wake-up write to the pipe (it
 * polls the dirty rooms on its next turn anyway). The completion notice travels
 * as a UCX active message behind a fence (protocol version 3, above); every
 * other room-level event (DEST, DEST_OK, START, ABORT, ACK, ERROR) on the
 * bootstrap connection, in the order it was sent.
 *
 * Assisted progress. The engine polls status() of its rooms every step. When
 * it asks about a room whose news is due (news_due) the calling thread, which
 * holds the mutex, so the progress thread is not working, runs one
 * non-blocking turn of the progress work itself (assist): ucp_worker_progress,
 * a poll() with timeout 0 on the connected peers' sockets (its own pollfd
 * array: the progress thread's is in use by its poll() outside the mutex),
 * the messages that came, the dirty rooms, queued socket writes. The DEST is
 * then picked up by the prefill's engine polling for WAITING_FOR_INPUT and
 * the completion notice by the decode's engine polling for SUCCESS, with no
 * thread woken on the path. The progress thread keeps what an assisted turn
 * does not do: accepting and connecting, closing sockets (an assisted read
 * leaves the end of a stream and errors to it), timers and heartbeats, and
 * puts beyond FINAL_INLINE_BYTES a turn (over shared memory a put is a copy
 * on the calling thread); and while such a put is in flight no turn runs at
 * all (over tcp UCX sends an emulated put's segments from whichever thread
 * progresses the worker). The decode's abort() runs a turn first, whatever
 * the rate limit, so that a notice already there makes it moot. Its poll()
 * may return for an event a turn consumed meanwhile: a spurious wake-up,
 * harmless (reads find EAGAIN; revents of a peer slot whose connection
 * changed meanwhile are dropped by generation). A turn that leaves work
 * behind (dirty rooms, unsent bytes, the first UCX request outstanding)
 * wakes it through the pipe, as a vtable call would; otherwise
 * a missed wake-up is bounded by the poll caps above. Rate-limited: a turn
 * that took d waits as long again (at least ASSIST_GAP_MIN_NS) before the
 * next.
 */
#include "net_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <sodium.h>

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
void net_log(pd_net *n, const char *fmt, ...) {
    if (!n->cfg.log) return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof(line), fmt, ap);
    va_end(ap);
    n->cfg.log(n->cfg.log_ctx, line);
}

void net_wake(pd_net *n) {
    if (n->wake_wr < 0) return;
    uint8_t b = 1;
    ssize_t w = write(n->wake_wr, &b, 1); /* EAGAIN: a wake-up is already pending */
    (void)w;
}

bool net_set_nonblocking(int fd) {
    int fl = fcntl(fd, F_GETFL, 0);
    return fl >= 0 && fcntl(fd, F_SETFL, fl | O_NONBLOCK) == 0;
}

/* Status moves forward only; SUCCESS and FAILED are final (room.h). Counts
 * outcomes of rooms the engine opened; a room not opened here that fails is
 * a tombstone: it only carries the news to a later sender_open. */
void net_set_st(pd_net *n, room *rm, pd_xfer_status st) {
    if (xr_is_final(rm->h.st)) return;
    xr_set_status(&rm->h, st);
    if (!rm->h.open) {
        if (st == PD_XFER_FAILED) xr_set_tomb(&n->rooms, ridx(n, rm), true);
        return;
    }
    if (st == PD_XFER_FAILED) n->stats.rooms_failed++;
    if (st == PD_XFER_SUCCESS) n->stats.rooms_succeeded++;
}

void net_due_at(pd_net *n, room *rm, uint64_t t) {
    rm->due_ms = t;
    if (t < n->next_due_ms) n->next_due_ms = t;
}

/* ---- rooms --------------------------------------------------------------------- */

uint32_t net_room_find(const pd_net *n, uint64_t id) { return xr_find(&n->rooms, id); }

/* ---- status without the mutex -------------------------------------------------------------
 * A progress thread copying a large put (over shm, a put is a memcpy on the
 * thread that posts it) holds the mutex for as long as the copy takes, up
 * to a millisecond for 33 MiB; the engine's status() calls, made every
 * step, used to wait that long. Now status() and drained() take the mutex
 * only if it is free. When it is not, status() answers from the published
 * table: every call under the mutex that can change what status(id)
 * answers on the engine's side (status() itself and every other vtable
 * call) writes that answer there, and the slot's release removes it.
 * The answer is then one the room did have, at most as old as the engine's
 * last call about it: statuses only move forward (room.h), so a stale
 * answer can be late, never early (no room is reported done before it is),
 * and it changes nothing, so ACK, abort and cancel still end rooms once.
 * Each entry is a sequence lock (writers are serialised by the mutex), so
 * an id and its status are never read torn. No entry (an id never
 * published, or two live ids sharing a slot of the direct-mapped table): the
 * call waits for the mutex as before. drained() says "not yet". Answers
 * without the mutex stop STALE_MAX_NS after the first of a streak: then
 * the call waits, so the engine still sees news while a thread holds the
 * mutex for long. An unlocked answer runs no assisted turn: the mutex is
 * held, so the progress thread (or a turn) is at work already.
 * Refresh: a status() answered without the mutex asks the progress thread
 * to publish every room's status at the end of its pass (pub_refresh),
 * which restarts status()'s streak: its answers are then at most one pass
 * old, and a call waits only behind a single pass longer than
 * STALE_MAX_NS. Over tcp a pass that streams a large put's segments holds
 * the mutex for milliseconds, and the streak used to run out across
 * passes (calls of 4-6 ms). drained() keeps its own streak, and the old
 * 5 ms bound: no refresh answers it.
 * Pumps publish: process_dirty publishes each room it pumped (the rooms
 * whose messages, completions or notices came in the pass), so news
 * reaches an unlocked status() as soon as the pass has it, not when the
 * pass ends and the refresh runs. */
#define PUB_EMPTY UINT32_MAX
#define STALE_MAX_NS 50000000u        /* 50 ms: beyond any pass (a 33 MiB copy ~1 ms; tcp, ~10) */
#define DRAINED_STALE_MAX_NS 5000000u /* 5 ms: drained()'s "not yet" is never refreshed */

static net_pub *pub_of(const pd_net *n, uint64_t id) {
    uint64_t h = id * 0x9E3779B97F4A7C15ull; /* Fibonacci hashing: ids may be sequential */
    return &n->pub[(uint32_t)(h >> 32) & n->pub_mask];
}

/* Mutex held: it serialises the writers. Every access to an entry is
 * sequentially consistent (no fences: ThreadSanitizer does not model
 * them), so a reader whose two loads of seq agree, even, read id and st
 * between two writes: never one write's id with another's status. On x86
 * the reader's loads are plain loads; the writer's stores are under the
 * mutex, off the engine's path. */
static void pub_write(net_pub *e, uint64_t id, uint32_t st) {
    /* Most calls find their answer there already (a room's status changes a
     * few times in its life, status() is asked every step): no write. */
    if (atomic_load_explicit(&e->id, memory_order_relaxed) == id &&
        atomic_load_explicit(&e->st, memory_order_relaxed) == st)
        return;
    uint32_t s = atomic_load(&e->seq);
    PD_ASSERT((s & 1u) == 0);
    atomic_store(&e->seq, s + 1);
    atomic_store(&e->id, id);
    atomic_store(&e->st, st);
    atomic_store(&e->seq, s + 2);
}

/* Room rm's status, published (mutex held; rm in use). */
static void pub_room_at(const pd_net *n, const room *rm) {
    pub_write(pub_of(n, rm->slot.id), rm->slot.id, (uint32_t)xr_status(&rm->h));
}

/* What status(id) answers now, published (mutex held). */
static pd_xfer_status pub_room(pd_net *n, uint64_t id) {
    uint32_t r = net_room_find(n, id);
    pd_xfer_status st = r == PD_NONE ? PD_XFER_NONE : xr_status(&room_at(n, r)->h);
    pub_write(pub_of(n, id), id, (uint32_t)st);
    return st;
}

/* Room id's slot goes (mutex held): its answer may change without a call. */
static void pub_forget(pd_net *n, uint64_t id) {
    net_pub *e = pub_of(n, id);
    if (atomic_load_explicit(&e->id, memory_order_relaxed) == id &&
        atomic_load_explicit(&e->st, memory_order_relaxed) != PUB_EMPTY)
        pub_write(e, id, PUB_EMPTY);
}

/* Without the mutex: room id's published status; false if there is none,
 * or a writer is changing its entry. */
static bool pub_read(const pd_net *n, uint64_t id, pd_xfer_status *out) {
    net_pub *e = pub_of(n, id);
    uint32_t s1 = atomic_load(&e->seq);
    uint64_t eid = atomic_load(&e->id);
    uint32_t st = atomic_load(&e->st);
    uint32_t s2 = atomic_load(&e->seq);
    if ((s1 & 1u) || s1 != s2 || eid != id || st == PUB_EMPTY) return false;
    PD_ASSERT(st <= PD_XFER_FAILED);
    *out = (pd_xfer_status)st;
    return true;
}

/* status() and drained(): takes the mutex if it is free, or if calls have
 * been answered without it for max_ns (streak: the call's own); false: the
 * caller may answer without it (the mutex is not held). */
static bool lock_if_fresh(pd_net *n, _Atomic uint64_t *streak, uint64_t max_ns) {
    if (pthread_mutex_trylock(&n->mu) != 0) {
        uint64_t t = now_ns(), s = 0;
        if (atomic_compare_exchange_strong(streak, &s, t)) s = t;
        if (t < s || t - s < max_ns) return false;
        net_lock(n);
    }
    atomic_store_explicit(streak, 0, memory_order_relaxed);
    return true;
}

/* At the end of a pass of the progress thread or of an assisted turn
 * (mutex held): if a status() was answered without the mutex since the
 * last refresh, every room's status is published and status()'s streak
 * restarts. */
static void pub_refresh(pd_net *n) {
    if (!atomic_load_explicit(&n->pub_wanted, memory_order_relaxed) ||
        !atomic_exchange(&n->pub_wanted, false))
        return;
    for (uint32_t r = 0; r < n->cfg.rooms_max; r++) {
        const room *rm = room_at(n, r);
        if (rm->slot.used) pub_room_at(n, rm);
    }
    atomic_store(&n->stale_since_ns, 0);
    n->stats.status_refreshes++;
}

void net_mark_dirty(pd_net *n, room *rm) {
    uint32_t r = ridx(n, rm);
    if (n->in_dirty[r]) return;
    PD_ASSERT(n->dirty_n < n->cfg.rooms_max);
    n->in_dirty[r] = true;
    n->dirty[(n->dirty_head + n->dirty_n++) % n->cfg.rooms_max] = r;
}

/* Writes, a flush or a notice of the room are still in the transport's hands. */
static bool room_busy(const room *rm) {
    return rm->puts_out || rm->flush_out || rm->q_head != PD_NONE || rm->note != N_NONE ||
        (rm->h.done && rm->need_flush);
}

bool net_room_orphan(const room *rm) {
    return rm->slot.used && !rm->h.open && !xr_gone(&rm->h) && rm->dest.known &&
        rm->h.st != PD_XFER_FAILED && !rm->r_aborted;
}

/* The table's eviction test: a tombstone (closed, or failed before the
 * engine opened it) or an orphan destination, with nothing in flight, can
 * make way for a live room. */
static bool evictable(void *ctx, uint32_t r) {
    const room *rm = room_at(ctx, r);
    if (room_busy(rm)) return false;
    return rm->h.closed || rm->h.cancelled || xr_news_for_engine(&rm->h) || net_room_orphan(rm);
}

/* An orphan destination (one the engine never claimed) that goes, by
 * eviction or expiry, takes an ABORT to its decode half with it, which frees
 * the pages it holds there; a tombstone goes quietly. True for an orphan. */
static bool orphan_abort(pd_net *n, room *rm) {
    if (!net_room_orphan(rm)) return false;
    if (net_peer_of(n, rm))
        net_send_room_msg(n, rm->peer, BP_ABORT, rm->slot.id, ABORT_REASON_ORPHAN);
    return true;
}

static void evict(void *ctx, uint32_t r) {
    pd_net *n = ctx;
    if (orphan_abort(n, room_at(n, r))) n->stats.orphans_evicted++;
    net_room_free(n, r);
}

uint32_t net_room_new(pd_net *n, uint64_t id) {
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
void net_room_free(pd_net *n, uint32_t r) {
    PD_ASSERT(r < n->cfg.rooms_max);
    room *rm = room_at(n, r);
    PD_ASSERT(rm->slot.used && rm->puts_out == 0 && rm->flush_out == 0 && rm->large_out == 0);
    net_stages_drop(n, rm);
    xr_dest_clear(&rm->dest);
    pub_forget(n, rm->slot.id);
    xr_remove(&n->rooms, r);
}

/* The engine is done with the room (closed or cancelled): a tombstone from
 * now on, and freed once nothing refers to it any more. */
void net_room_try_release(pd_net *n, room *rm) {
    PD_ASSERT(ridx(n, rm) < n->cfg.rooms_max);
    if (!rm->slot.used || !xr_gone(&rm->h)) return;
    xr_set_tomb(&n->rooms, ridx(n, rm), true);
    if (n->cfg.role == PD_NET_PREFILL) {
        if (room_busy(rm)) return;
        /* Aborted before its destination came: keep the id, so the late DEST
         * gets an ABORT instead of waiting out the decode's timeout. */
        if (xr_news_for_peer(&rm->h, &rm->dest)) return;
    }
    net_room_free(n, ridx(n, rm));
}

peer *net_peer_of(pd_net *n, const room *rm) {
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
void net_writes_sync(room *rm) {
    rm->h.writes_out = rm->puts_out + (rm->q_head != PD_NONE);
    if (rm->h.stopping && rm->h.writes_out == 0) xr_abort_effective(&rm->h);
}

/* ---- staged writes (prefill) --------------------------------------------------- */

void net_stages_drop(pd_net *n, room *rm) {
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
    n->stages[s] =
        (stage){.next = PD_NONE, .reg = reg, .src = src, .dst = dst, .n = units, .pos = 0};
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
        n->stages[rm->q_tail].pos = first - base + i;
        i = j;
    }
}

/* ---- timers -------------------------------------------------------------------------- */

static void timers(pd_net *n, uint64_t now) {
    for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++) {
        peer *p = &n->peers[pi];
        if (p->state == PS_FREE || p->state == PS_CLOSING || p->state == PS_RESOLVE) continue;
        if (p->state == PS_RESOLVING) {
            if (since(now, p->t_state_ms) >= n->cfg.dead_after_ms)
                net_peer_fail(n, pi, "name resolution timed out");
            continue;
        }
        if (p->closing_after_tx) {
            if (since(now, p->t_state_ms) >= n->cfg.dead_after_ms)
                net_peer_fail(n, pi, "peer did not take our refusal");
            continue;
        }
        if (p->state != PS_READY) {
            if (since(now, p->t_state_ms) >= n->cfg.dead_after_ms) {
                if (p->rx_len > 0) n->stats.bad_messages++; /* a truncated message */
                bool connecting = p->state == PS_CONNECTING;
                net_peer_fail(n, pi, connecting ? "connect timed out" : "handshake timed out");
            }
            continue;
        }
        if (since(now, p->last_rx_ms) >= n->cfg.dead_after_ms) {
            if (p->rx_len > 0) n->stats.bad_messages++;
            net_peer_fail(n, pi, "heartbeat lost");
            continue;
        }
        if (since(now, p->last_tx_ms) >= n->cfg.heartbeat_ms) {
            uint8_t *b = net_tx_reserve(p, BP_HEADER_BYTES);
            if (!b) net_peer_fail(n, pi, "send queue full");
            else net_tx_commit(n, p, bp_ping_write(b, BP_HEADER_BYTES));
        }
    }
    if (n->cfg.role == PD_NET_PREFILL) net_abandon_dead_writes(n, now);
    if (now >= n->next_due_ms) {
        n->next_due_ms = UINT64_MAX;
        for (uint32_t r = 0; r < n->cfg.rooms_max; r++) {
            room *rm = room_at(n, r);
            if (!rm->slot.used || rm->due_ms == 0) continue;
            if (rm->due_ms <= now) {
                rm->due_ms = 0;
                net_mark_dirty(n, rm);
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
            orphan_abort(n, rm);
            net_room_free(n, r);
        }
        for (uint32_t r = 0; r < n->cfg.rooms_max; r++) {
            room *rm = room_at(n, r);
            if (rm->slot.used && xr_gone(&rm->h) && since(now, rm->t_ms) >= n->cfg.orphan_ms &&
                !rm->puts_out && !rm->flush_out && rm->q_head == PD_NONE) {
                rm->note = N_NONE;
                net_room_free(n, r);
            }
        }
    }
}

/* ---- the progress thread ---------------------------------------------------------------- */

static void process_dirty(pd_net *n, uint64_t now) {
    uint32_t cnt = n->dirty_n;
    while (cnt-- > 0 && n->dirty_n > 0) {
        uint32_t r = n->dirty[n->dirty_head];
        n->dirty_head = (n->dirty_head + 1) % n->cfg.rooms_max;
        n->dirty_n--;
        room *rm = room_at(n, r);
        n->in_dirty[r] = false;
        if (!rm->slot.used) continue;
        if (n->cfg.role == PD_NET_PREFILL) net_pump_sender(n, rm, now);
        else net_pump_receiver(n, rm, now);
        /* News reaches the engine's unlocked status() at once (a pass
         * that took the notice in holds the mutex until it ends). */
        if (rm->slot.used && !n->faults[PD_NET_FAULT_NO_PASS_PUBLISH]) pub_room_at(n, rm);
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
        if (p->state == PS_RESOLVING) { /* the resolver wakes us when done */
            t = PD_MIN(t, since(p->t_state_ms + n->cfg.dead_after_ms, now));
            continue;
        }
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

/* PD_NET_FAULT_PARK_PROGRESS (mutex held): waits, doing nothing, until the
 * fault is turned off or the transport stops; the pipe wakes it. */
static void park(pd_net *n) {
    n->spinning = false;
    while (n->faults[PD_NET_FAULT_PARK_PROGRESS] && !n->stopping) {
        net_unlock(n);
        struct pollfd w = {.fd = n->wake_rd, .events = POLLIN};
        if (poll(&w, 1, POLL_IDLE_MS) > 0) {
            uint8_t junk[64];
            while (read(n->wake_rd, junk, sizeof(junk)) > 0) {}
        }
        net_lock(n);
    }
}

/* PD_NET_FAULT_HOLD_MUTEX (mutex held): keeps it, doing nothing, until the
 * fault is turned off; the pipe wakes it. */
static void hold_mutex(pd_net *n) {
    atomic_store(&n->holding_mutex, true);
    while (atomic_load(&n->hold_mutex) && !n->stopping) {
        struct pollfd w = {.fd = n->wake_rd, .events = POLLIN};
        if (poll(&w, 1, POLL_IDLE_MS) > 0) {
            uint8_t junk[64];
            while (read(n->wake_rd, junk, sizeof(junk)) > 0) {}
        }
    }
    atomic_store(&n->holding_mutex, false);
}

/* One pass of the progress work (mutex held). */
static void progress_work(pd_net *n, uint64_t now) {
    net_ucx_progress(n, PROGRESS_BURST);
    if (n->listen_ready) net_accept_all(n);
    for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++) net_peer_service(n, pi, now);
    net_ucx_progress(n, PROGRESS_BURST);
    process_dirty(n, now);
    timers(n, now);
    /* Sends: notices queued above go out in this pass. */
    for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++) {
        peer *p = &n->peers[pi];
        bool open = p->state == PS_AUTH || p->state == PS_HELLO || p->state == PS_READY;
        if (open && p->tx_off < p->tx_len) net_peer_write(n, pi);
    }
}

/* Fills n->pfd for this turn's poll. Returns the count; *first_peer: the
 * index of the first peer's entry. */
static nfds_t poll_set(pd_net *n, nfds_t *first_peer) {
    nfds_t nf = 0;
    n->pfd[nf++] = (struct pollfd){.fd = n->wake_rd, .events = POLLIN};
    n->pfd[nf++] = (struct pollfd){.fd = n->ucx_fd, .events = POLLIN};
    n->listen_ready = false;
    n->listen_pfd = n->listen_fd >= 0 ? nf : 0;
    if (n->listen_fd >= 0) n->pfd[nf++] = (struct pollfd){.fd = n->listen_fd, .events = POLLIN};
    *first_peer = nf;
    for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++) {
        peer *p = &n->peers[pi];
        p->revents = 0;
        if (p->fd < 0 || p->state == PS_FREE || p->state == PS_CLOSING) continue;
        short ev = p->closing_after_tx ? 0 : POLLIN;
        if (p->state == PS_CONNECTING || p->tx_off < p->tx_len) ev |= POLLOUT;
        n->pfd_peer[nf - *first_peer] = pi;
        n->pfd_gen[nf - *first_peer] = p->gen;
        n->pfd[nf++] = (struct pollfd){.fd = p->fd, .events = ev};
    }
    PD_ASSERT(nf <= n->cfg.peers_max + 3);
    return nf;
}

/* What poll() saw, for the next pass (mutex held). */
static void poll_seen(pd_net *n, nfds_t nf, nfds_t first_peer) {
    if (n->pfd[0].revents) {
        uint8_t junk[64];
        while (read(n->wake_rd, junk, sizeof(junk)) > 0) {}
    }
    if (n->listen_pfd && n->pfd[n->listen_pfd].revents) n->listen_ready = true;
    /* An assisted turn may have failed a peer meanwhile, and its slot gone
     * to a new connection: what poll() saw was not about that one. */
    for (nfds_t i = first_peer; i < nf; i++) {
        peer *p = &n->peers[n->pfd_peer[i - first_peer]];
        if (p->gen == n->pfd_gen[i - first_peer]) p->revents = n->pfd[i].revents;
    }
}

/* The progress thread's scheduling policy (pd_net_config.progress_sched_batch).
 * The kernel decides whether a thread that wakes preempts the one running
 * from the wakee's policy at wake-up: under SCHED_BATCH it never does (it
 * takes a free core at once, or its turn at the next tick). By default a
 * prefill's thread sleeps under SCHED_BATCH while nothing is handed to it
 * that only it will do: the DEST's send() on the decode then no longer
 * wakes a thread that preempts the sender, while the prefill's engine,
 * polling status(), takes the DEST in itself (assisted progress). Whoever
 * hands it such work (a put too large for the engine's thread, an abort's
 * notice) puts it back under SCHED_OTHER before waking it (sched_hand_over),
 * so that wake-up preempts as before; and it sleeps under SCHED_OTHER while
 * such work is outstanding, and until SCHED_LINGER_NS after. The policy
 * changes only when it must: a one-page room makes no change at all. */
enum { LINUX_SCHED_BATCH = 3 }; /* sched.h names it only under _GNU_SOURCE */

/* Sets the progress thread's policy, from any thread once it has started
 * (mutex held). A refusal (not Linux, a filtered system call) turns the
 * policy off for good; logged only on the progress thread (the log's
 * contract). */
static void sched_set(pd_net *n, bool batch) {
    if (n->sched_batch_now == batch || n->sched_mode == SCHED_MODE_NEVER) return;
    PD_ASSERT(n->sched_started);
    int rc = ENOSYS;
#if defined(__linux__)
    struct sched_param sp = {.sched_priority = 0};
    rc = pthread_setschedparam(n->sched_self, batch ? LINUX_SCHED_BATCH : SCHED_OTHER, &sp);
#endif
    if (rc != 0) {
        n->sched_mode = SCHED_MODE_NEVER;
        if (pthread_equal(pthread_self(), n->sched_self))
            net_log(n, "pd_net: progress thread: SCHED_%s refused: %s", batch ? "BATCH" : "OTHER",
                    strerror(rc));
        return;
    }
    n->sched_batch_now = batch;
    n->stats.progress_sched_switches++;
}

/* Whether the progress thread owes work that the engine's thread will not do
 * for it (mutex held): a staged page run (a put beyond what an engine's call
 * posts), a UCX request outstanding (a large put over tcp streams through
 * its turns), bootstrap bytes waiting for the socket. */
static bool sched_owes_work(const pd_net *n) {
    if (n->ucx_out > 0 || n->stages_avail < n->cfg.stages_max) return true;
    for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++)
        if (n->peers[pi].state != PS_FREE && n->peers[pi].tx_off < n->peers[pi].tx_len) return true;
    return false;
}

/* Before a poll() that blocks (mutex held): the policy the progress thread
 * sleeps under. In SCHED_MODE_IDLE, SCHED_BATCH once SCHED_LINGER_NS passed
 * since it last had work of its own (n->sched_owed: at the start of a pass
 * since its last sleep, or now). A switch is a system call of 1.5-3 us:
 * made as soon as the work was done, it sat on the critical path of the
 * room whose put the thread had just posted (the engine's thread waiting
 * for this core), and rooms whose puts follow each other within the linger
 * make none. (Shortening the poll() timeout to switch when the linger ends
 * made 0.5 MiB hand-offs over shm slower even without any switch, 37 us
 * against 25, bench/xfer alternated; so the linger ends with the first
 * wake-up after it.) */
static void sched_before_sleep(pd_net *n) {
    if (n->sched_mode != SCHED_MODE_IDLE) {
        sched_set(n, n->sched_mode == SCHED_MODE_ALWAYS);
        return;
    }
    uint64_t t = now_ns();
    if (n->sched_owed || sched_owes_work(n)) n->sched_busy_ns = t;
    n->sched_owed = false;
    sched_set(n, t - n->sched_busy_ns >= SCHED_LINGER_NS);
}

/* The caller hands the progress thread work that only it will do and is
 * about to wake it (mutex held): that wake-up must preempt, as it would
 * under SCHED_OTHER. */
static void sched_hand_over(pd_net *n) {
    if (n->sched_mode != SCHED_MODE_IDLE) return;
    n->sched_busy_ns = now_ns();
    sched_set(n, false);
}

static void *progress_main(void *arg) {
    pd_net *n = arg;
    net_lock(n);
    n->sched_self = pthread_self();
    n->sched_started = true;
    if (n->sched_mode == SCHED_MODE_ALWAYS) sched_set(n, true);
    while (!n->stopping) {
        if (n->faults[PD_NET_FAULT_PARK_PROGRESS]) {
            park(n);
            continue;
        }
        if (atomic_load(&n->hold_mutex)) {
            hold_mutex(n);
            continue;
        }
        uint64_t now = now_ms();
        n->sched_owed |= n->sched_mode == SCHED_MODE_IDLE && sched_owes_work(n);
        progress_work(n, now);
        bool spinning;
        int timeout = poll_timeout(n, now, &spinning);
        if (timeout > 0 && ucp_worker_arm(n->worker) == UCS_ERR_BUSY) timeout = 0;
        n->spinning = timeout == 0;
        if (timeout > 0) sched_before_sleep(n);
        nfds_t first_peer;
        nfds_t nf = poll_set(n, &first_peer);
        pub_refresh(n);
        net_unlock(n);
        int rc = poll(n->pfd, nf, timeout);
        /* Spinning must not starve the thread we wait for (the peer's
         * progress thread in the same process, the engine) on a busy core. */
        if (spinning) sched_yield();
        net_lock(n);
        if (rc > 0) poll_seen(n, nf, first_peer);
    }
    n->sched_mode = SCHED_MODE_NEVER; /* no one changes an ended thread's policy */
    net_unlock(n);
    return NULL;
}

/* An assisted turn: one non-blocking pass of the progress thread's work, run
 * by the thread of a status() or drained() call whose room waits for news
 * (mutex held, so the progress thread is not working: it is in poll(), or
 * waiting for the mutex). The news is then handled by the thread that polls
 * for it, without waking a sleeping progress thread. Rate-limited (see
 * ASSIST_GAP_*) unless forced (abort). Connections, timers and heartbeats
 * stay the progress thread's; what this turn leaves it to do, it is woken
 * for. Not while a put over the inline limit is in flight (unless forced):
 * the progress thread posted it and drives it, and over tcp, where UCX
 * sends an emulated put's segments from whichever thread progresses the
 * worker, a turn here sent them on the engine's thread (0.75-2.7 ms a
 * status() call in a 32.8 MiB room). True if a turn ran. */
static bool assist(pd_net *n, bool force) {
    if (!n->running || n->stopping) return false;
    if (n->large_out > 0 && !force) {
        n->stats.assists_deferred++;
        return false;
    }
    uint64_t t0 = now_ns();
    if (t0 < n->assist_next_ns && !force) return false;
    PD_ASSERT(n->post_budget == SIZE_MAX); /* no turn inside a turn */
    uint32_t out0 = n->ucx_out;
    uint64_t now = t0 / 1000000u;
    unsigned calls = net_ucx_progress(n, ASSIST_PROGRESS_BURST);
    net_peers_read_now(n, now);
    calls += net_ucx_progress(n, ASSIST_PROGRESS_BURST);
    n->stats.assist_progress_calls += calls;
    n->post_budget = FINAL_INLINE_BYTES;
    n->engine_turn = true;
    process_dirty(n, now);
    n->engine_turn = false;
    PD_ASSERT(n->post_budget <= FINAL_INLINE_BYTES);
    n->post_budget = SIZE_MAX;
    bool tx_left = false;
    for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++) {
        peer *p = &n->peers[pi];
        if (p->state == PS_READY && p->tx_off < p->tx_len) tx_left |= !net_tx_try(n, pi);
    }
    /* The progress thread chose its poll timeout before this turn: it may
     * sleep through work this turn created, unless told. */
    if (!n->spinning && (n->dirty_n > 0 || tx_left || (out0 == 0 && n->ucx_out > 0))) {
        sched_hand_over(n);
        net_wake(n);
    }
    n->stats.progress_assists++;
    pub_refresh(n);
    uint64_t t1 = now_ns();
    n->assist_next_ns = t1 + PD_MAX((t1 - t0) * ASSIST_GAP_FACTOR, (uint64_t)ASSIST_GAP_MIN_NS);
    return true;
}

/* ---- the vtable --------------------------------------------------------------------------- */

static pd_err v_sender_open(void *self, uint64_t id) {
    pd_net *n = self;
    if (n->cfg.role != PD_NET_PREFILL || !n->registered) return PD_ERR_STATE;
    net_lock(n);
    pd_err err = PD_OK;
    uint32_t r = net_room_find(n, id);
    if (r == PD_NONE) r = net_room_new(n, id);
    if (r == PD_NONE) {
        err = PD_ERR_NOMEM;
    } else if ((err = xr_open_sender(&room_at(n, r)->h, room_at(n, r)->dest.known)) == PD_OK) {
        xr_set_tomb(&n->rooms, r, false);
        n->stats.rooms_opened++;
        if (room_at(n, r)->h.st == PD_XFER_FAILED) n->stats.rooms_failed++;
    }
    pub_room(n, id);
    net_unlock(n);
    return err;
}

static uint32_t v_sender_peer_cached(void *self, uint64_t id) {
    pd_net *n = self;
    net_lock(n);
    uint32_t r = net_room_find(n, id);
    uint32_t cached = r != PD_NONE && room_at(n, r)->dest.known ? room_at(n, r)->dest.cached : 0;
    net_unlock(n);
    return cached;
}

/* Common checks for posting writes (mutex held). */
static pd_err sendable(pd_net *n, uint64_t id, uint32_t first, const uint32_t *src, uint32_t cnt,
                       room **out) {
    if (n->cfg.role != PD_NET_PREFILL) return PD_ERR_STATE;
    uint32_t r = net_room_find(n, id);
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
    net_lock(n);
    room *rm = NULL;
    pd_err err = sendable(n, id, first, src, cnt, &rm);
    if (!err && cnt > 0) {
        uint32_t base = rm->dest.cached / n->cfg.page_size;
        if (count_runs(rm, base, first, src, cnt) > n->stages_avail) {
            err = PD_ERR_NOMEM;
        } else {
            stage_runs(n, rm, base, first, src, cnt);
            net_mark_dirty(n, rm);
        }
    }
    if (!err) net_set_st(n, rm, PD_XFER_TRANSFERRING);
    bool kick = !err && !n->spinning;
    if (!err) sched_hand_over(n); /* even to a spinning thread (v_send_final) */
    pub_room(n, id);
    net_unlock(n);
    if (kick) net_wake(n);
    return err;
}

/* A small room's final send, posted from the caller's thread (mutex held):
 * its puts and the notice often all complete at once (shared memory:
 * the puts are copies into the peer's segment), which saves waking the
 * progress thread on the room's critical path. Only below FINAL_INLINE_BYTES,
 * so a large copy never runs on the engine's thread; the UCX worker is in
 * UCS_THREAD_MODE_SERIALIZED for this (every call under the mutex). True if
 * nothing is left for the progress thread. */
static bool final_inline(pd_net *n, room *rm, uint32_t pages) {
    size_t bytes = (size_t)pages * n->unit[REG_KV] + n->unit[REG_MAMBA] + n->unit[REG_META];
    peer *p = net_peer_of(n, rm);
    if (bytes > FINAL_INLINE_BYTES || !p || p->state != PS_READY || p->tx_len != 0 ||
        !rm->dest.known || n->faults[PD_NET_FAULT_HOLD_NOTICES] || rm->puts_out || rm->flush_out)
        return false;
    n->engine_turn = true;
    net_pump_sender(n, rm, now_ms());
    n->engine_turn = false;
    if (!rm->slot.used) return true; /* done, and released */
    return rm->q_head == PD_NONE && !rm->puts_out && !rm->flush_out && !rm->need_flush &&
        rm->note == N_NONE && net_tx_try(n, rm->peer);
}

/* Whether a final send of `runs` KV page runs (`pages` pages) should travel
 * in the room's completion notice (version 4, net_ucx.c send_notice_data)
 * rather than as puts: nothing of the room was staged or posted before (the
 * notice then carries all of it), its bytes are within notice_data_max and
 * its segments within the protocol's bound, and the peer speaks version 4.
 * By default only to a peer whose puts UCX emulates with active messages
 * (tcp: three puts were three send()s and three acknowledgements, 30-40 us;
 * the notice is one send()): where a put is one copy into the peer's
 * segment (shared memory), it is cheaper than the notice's copies through
 * UCX's buffers (bench/xfer, shm hand-offs of 28-60 KiB: 3-5 us as puts,
 * 8-42 in the notice). A notice_data_max set in the config applies to every
 * peer. */
static bool final_in_notice(pd_net *n, const room *rm, uint32_t runs, uint32_t pages,
                            uint32_t mamba_slot) {
    const peer *p = net_peer_of(n, rm);
    if (!p || p->ver < 4 || (p->puts_direct && !n->notice_data_always) || rm->q_head != PD_NONE ||
        rm->started || rm->puts_out || runs + 2 > BP_NOTICE_SEGS_MAX)
        return false;
    size_t bytes = (size_t)pages * n->unit[REG_KV] + n->unit[REG_META] +
        (mamba_slot != PD_POOL_NONE ? n->unit[REG_MAMBA] : 0);
    return bytes <= n->notice_data_max;
}

static pd_err v_send_final(void *self, uint64_t id, uint32_t first, const uint32_t *src,
                           uint32_t cnt, uint32_t mamba_slot, uint32_t meta_row) {
    pd_net *n = self;
    net_lock(n);
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
            uint32_t runs = count_runs(rm, base, first, src, cnt);
            rm->data_in_notice = final_in_notice(n, rm, runs, cnt, mamba_slot);
            stage_runs(n, rm, base, first, src, cnt);
            if (mamba_slot != PD_POOL_NONE)
                stage_push(n, rm, REG_MAMBA, mamba_slot, rm->dest.mamba_slot, 1);
            stage_push(n, rm, REG_META, meta_row, rm->dest.meta_row, 1);
            stage_push(n, rm, STAGE_FINAL, 0, 0, 0);
            rm->final_staged = true;
            net_set_st(n, rm, PD_XFER_TRANSFERRING);
            net_mark_dirty(n, rm);
        }
    }
    /* Handed over even to a spinning thread: it may be under SCHED_BATCH,
     * woken without preempting, and still waiting for a core. */
    bool handed = !err && !final_inline(n, rm, cnt), kick = handed && !n->spinning;
    if (handed) sched_hand_over(n);
    pub_room(n, id);
    net_unlock(n);
    if (kick) net_wake(n);
    return err;
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
    if (!dest_fits_here(n, dest) || !net_addr_ok(peer_addr)) return PD_ERR_INVALID;
    net_lock(n);
    pd_err err = PD_OK;
    uint32_t r = PD_NONE, pi = PD_NONE;
    bool kick = false;
    if (net_room_find(n, id) != PD_NONE) err = PD_ERR_EXISTS;
    else if ((pi = net_peer_for_addr(n, peer_addr)) == PD_NONE) err = PD_ERR_NOMEM;
    else if ((r = net_room_new(n, id)) == PD_NONE) err = PD_ERR_NOMEM;
    else if ((err = xr_dest_set(&room_at(n, r)->dest, dest)) != PD_OK) net_room_free(n, r);
    if (!err) {
        room *rm = room_at(n, r);
        rm->peer = pi;
        rm->peer_gen = n->peers[pi].gen;
        PD_MUST(xr_open_receiver(&rm->h));
        n->stats.rooms_opened++;
        /* Over a connection that is up, the DEST leaves from this thread:
         * waking the progress thread to send it cost a thread switch on
         * every room's critical path. Anything left over is its job. */
        peer *p = net_peer_of(n, rm);
        bool sent = p && p->state == PS_READY && p->tx_len == 0;
        if (sent) {
            net_pump_receiver(n, rm, now_ms());
            sent = rm->h.dest_sent && net_tx_try(n, pi);
        }
        if (!sent) net_mark_dirty(n, rm);
        kick = !sent;
    } else {
        net_peer_forget_if_unused(n, pi);
    }
    if (kick) sched_hand_over(n);
    pub_room(n, id);
    net_unlock(n);
    if (kick) net_wake(n);
    return err;
}

/* Whether a room in status st waits for news the network brings: on the
 * prefill side its destination (BOOTSTRAPPING) or its writes' completions
 * (TRANSFERRING); on the decode side anything short of a final status. */
static bool news_due(const pd_net *n, pd_xfer_status st) {
    if (st == PD_XFER_NONE || st == PD_XFER_SUCCESS || st == PD_XFER_FAILED) return false;
    return n->cfg.role == PD_NET_DECODE || st != PD_XFER_WAITING_FOR_INPUT;
}

static pd_xfer_status v_status(void *self, uint64_t id) {
    pd_net *n = self;
    pd_xfer_status st;
    if (!lock_if_fresh(n, &n->stale_since_ns, STALE_MAX_NS)) {
        if (pub_read(n, id, &st)) {
            atomic_fetch_add_explicit(&n->status_unlocked, 1, memory_order_relaxed);
            atomic_store_explicit(&n->pub_wanted, true, memory_order_relaxed);
            return st;
        }
        net_lock(n);
    }
    uint32_t r = net_room_find(n, id);
    st = r == PD_NONE ? PD_XFER_NONE : xr_status(&room_at(n, r)->h);
    /* The turn may evict a room the engine never opened: asked again. */
    if (news_due(n, st) && assist(n, false)) st = pub_room(n, id);
    else pub_write(pub_of(n, id), id, (uint32_t)st);
    net_unlock(n);
    return st;
}

/* The engine's abort on the prefill side (mutex held): stop posting, and
 * tell the decode once the writes in flight have completed. */
static pd_err abort_sender(pd_net *n, room *rm, uint64_t late) {
    PD_ASSERT(n->cfg.role == PD_NET_PREFILL && rm->slot.used);
    net_writes_sync(rm);
    if (xr_abort(&rm->h, XR_SENDER) == XR_ACT_NONE) return PD_OK;
    net_stages_drop(n, rm);
    net_writes_sync(rm);
    if (!rm->dest.known) {
        rm->h.early_abort = true; /* told when (if) the destination arrives */
        return PD_OK;
    }
    /* The decode side is unreachable: it fails the room itself. */
    if (!net_peer_of(n, rm)) return PD_ERR_IO;
    if (rm->note != N_ACK) {
        rm->note = N_ABORT;
        rm->note_value = ABORT_REASON_ENGINE;
    }
    if (late) net_due_at(n, rm, late);
    net_mark_dirty(n, rm);
    return PD_OK;
}

static pd_err v_abort(void *self, uint64_t id) {
    pd_net *n = self;
    net_lock(n);
    bool fault = n->faults[PD_NET_FAULT_ABORT_ERROR];
    uint32_t r = net_room_find(n, id);
    if (r == PD_NONE) {
        net_unlock(n);
        return PD_OK;
    }
    room *rm = room_at(n, r);
    uint64_t late = fault ? now_ms() + 2 * n->cfg.heartbeat_ms : 0;
    pd_err err = PD_OK;
    if (n->cfg.role == PD_NET_PREFILL) {
        err = abort_sender(n, rm, late);
    } else {
        /* What already arrived is taken in first: a completion notice here
         * makes the abort moot (the room succeeded), and no ABORT goes to
         * cross the prefill's close (it would leave a tombstone there). */
        if (news_due(n, xr_status(&rm->h))) assist(n, true);
        if (xr_abort(&rm->h, XR_RECEIVER) == XR_ACT_NOTIFY) {
            if (late) net_due_at(n, rm, late);
            net_mark_dirty(n, rm);
            if (!net_peer_of(n, rm)) err = PD_ERR_IO;
        }
    }
    sched_hand_over(n);
    pub_room(n, id);
    net_unlock(n);
    net_wake(n);
    return fault ? PD_ERR_IO : err;
}

static bool v_drained(void *self, uint64_t id) {
    pd_net *n = self;
    /* "not yet" is never wrong: asked again next step */
    if (!lock_if_fresh(n, &n->drained_stale_since_ns, DRAINED_STALE_MAX_NS)) {
        atomic_fetch_add_explicit(&n->drained_unlocked, 1, memory_order_relaxed);
        return false;
    }
    bool drained = true;
    uint32_t r = net_room_find(n, id);
    if (r != PD_NONE) {
        room *rm = room_at(n, r);
        bool sender = n->cfg.role == PD_NET_PREFILL;
        if (sender) net_writes_sync(rm);
        drained = xr_drained(&rm->h, sender ? XR_SENDER : XR_RECEIVER, now_ms());
        if (!drained && assist(n, false) && room_at(n, r)->slot.id == id &&
            room_at(n, r)->slot.used) {
            if (sender) net_writes_sync(rm);
            drained = xr_drained(&rm->h, sender ? XR_SENDER : XR_RECEIVER, now_ms());
        }
    }
    net_unlock(n);
    return drained;
}

static void v_close(void *self, uint64_t id) {
    pd_net *n = self;
    net_lock(n);
    uint32_t r = net_room_find(n, id);
    bool kick = false;
    if (r != PD_NONE && room_at(n, r)->h.open && !room_at(n, r)->h.closed) {
        room *rm = room_at(n, r);
        xr_close(&rm->h);
        rm->t_ms = now_ms();
        if (n->cfg.role == PD_NET_DECODE && !rm->h.dest_sent && net_peer_of(n, rm)) {
            /* Ended before its destination left: the prefill half may be
             * waiting for one. Tell it, then forget the room. */
            rm->cancel_only = true;
            xr_set_tomb(&n->rooms, r, true);
            net_mark_dirty(n, rm);
            kick = true;
        } else {
            net_room_try_release(n, rm);
        }
    }
    if (kick) sched_hand_over(n);
    pub_room(n, id);
    net_unlock(n);
    if (kick) net_wake(n);
}

/* cancel() on the prefill side (mutex held). */
static void cancel_sender(pd_net *n, uint32_t r, uint64_t id) {
    PD_ASSERT(n->cfg.role == PD_NET_PREFILL);
    if (r == PD_NONE) {
        /* The decode half may still send its destination: answer it with ABORT. */
        if ((r = net_room_new(n, id)) == PD_NONE) return;
        room *rm = room_at(n, r);
        xr_cancel(&rm->h, XR_SENDER);
        rm->h.early_abort = true;
        net_set_st(n, rm, PD_XFER_FAILED);
        xr_set_tomb(&n->rooms, r, true);
        n->stats.rooms_cancelled++;
        return;
    }
    room *rm = room_at(n, r);
    if (!xr_can_open(&rm->h)) return;
    xr_cancel(&rm->h, XR_SENDER);
    rm->t_ms = now_ms();
    n->stats.rooms_cancelled++;
    if (rm->dest.known && rm->h.st != PD_XFER_FAILED && net_peer_of(n, rm)) {
        /* An orphan destination: its decode half waits for data. */
        rm->note = N_ABORT;
        rm->note_value = ABORT_REASON_ENGINE;
        xr_set_tomb(&n->rooms, r, true);
        net_mark_dirty(n, rm);
    } else {
        net_room_try_release(n, rm);
    }
}

/* cancel() on the decode side (mutex held): a record that sends one ABORT. */
static void cancel_receiver(pd_net *n, uint32_t r, uint64_t id, const char *peer_addr) {
    PD_ASSERT(n->cfg.role == PD_NET_DECODE);
    if (r != PD_NONE || !net_addr_ok(peer_addr)) return;
    uint32_t pi = net_peer_for_addr(n, peer_addr);
    if (pi == PD_NONE || (r = net_room_new(n, id)) == PD_NONE) {
        net_peer_forget_if_unused(n, pi);
        return;
    }
    room *rm = room_at(n, r);
    rm->peer = pi;
    rm->peer_gen = n->peers[pi].gen;
    rm->cancel_only = xr_cancel(&rm->h, XR_RECEIVER) == XR_ACT_NOTIFY;
    PD_ASSERT(rm->cancel_only);
    xr_set_tomb(&n->rooms, r, true);
    n->stats.rooms_cancelled++;
    net_mark_dirty(n, rm);
}

static void v_cancel(void *self, uint64_t id, const char *peer_addr) {
    pd_net *n = self;
    if (!n->registered) return;
    net_lock(n);
    uint32_t r = net_room_find(n, id);
    if (n->cfg.role == PD_NET_PREFILL) cancel_sender(n, r, id);
    else cancel_receiver(n, r, id, peer_addr);
    sched_hand_over(n);
    pub_room(n, id);
    net_unlock(n);
    net_wake(n);
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

/* What can be refused before anything is allocated. */
static pd_err config_check(const pd_net_config *cfg, char *msg, size_t cap) {
    if (cfg->role != PD_NET_PREFILL && cfg->role != PD_NET_DECODE)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "role must be prefill or decode");
    if (cfg->page_size == 0)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "page_size must be positive");
    if (cfg->token && strlen(cfg->token) > BP_TOKEN_MAX)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "token longer than %u bytes", BP_TOKEN_MAX);
    if (cfg->protocol_version &&
        (cfg->protocol_version < BP_VERSION_MIN || cfg->protocol_version > BP_VERSION))
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "protocol_version %u: this build speaks versions %u to %u",
                         cfg->protocol_version, BP_VERSION_MIN, BP_VERSION);
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
    if (!c->orphans_per_peer) c->orphans_per_peer = PD_MAX(1u, c->rooms_max / 4);
    if (!c->spin_us) c->spin_us = 1000;
    if (!c->copy_threads) c->copy_threads = 2;
    c->copy_threads = PD_MIN(c->copy_threads, COPY_THREADS_MAX);
    n->proto = c->protocol_version ? c->protocol_version : BP_VERSION;
    /* At most what one eager active message should carry: a larger room
     * goes as puts, or (version 5, puts emulated) as data messages. */
    n->data_msgs = c->notice_data_max >= 0 && n->proto >= 5;
    if (c->notice_data_max < 0 || n->proto < 4) n->notice_data_max = 0;
    else if (c->notice_data_max == 0) n->notice_data_max = NOTICE_DATA_DEFAULT_BYTES;
    else n->notice_data_max = PD_MIN((size_t)c->notice_data_max, (size_t)BP_NOTICE_DATA_MAX);
    n->notice_data_always = c->notice_data_max > 0;
    n->sched_mode = c->progress_sched_batch > 0                    ? SCHED_MODE_ALWAYS
        : c->progress_sched_batch < 0 || c->role != PD_NET_PREFILL ? SCHED_MODE_NEVER
                                                                   : SCHED_MODE_IDLE;
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
/* The published status table: a power of two, at least twice rooms_max
 * (at most 2^24) entries, so that live ids rarely share one. */
static pd_err pub_alloc(pd_net *n, char *msg, size_t cap) {
    uint64_t want = PD_MIN(2ull * n->cfg.rooms_max, 1ull << 24), len = 1;
    while (len < want) len <<= 1;
    n->pub = malloc(len * sizeof(net_pub));
    if (!n->pub)
        return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory for %u rooms", n->cfg.rooms_max);
    for (uint64_t i = 0; i < len; i++) {
        atomic_init(&n->pub[i].seq, 0);
        atomic_init(&n->pub[i].st, PUB_EMPTY);
        atomic_init(&n->pub[i].id, 0);
    }
    n->pub_mask = (uint32_t)(len - 1);
    return PD_OK;
}

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
    n->pfd_gen = malloc((c->peers_max + 3) * sizeof(uint32_t));
    n->apfd = malloc(c->peers_max * sizeof(struct pollfd));
    n->apfd_peer = malloc(c->peers_max * sizeof(uint32_t));
    if (!n->in_dirty || !n->peers || !n->stages || !n->dirty || !n->pfd || !n->pfd_peer ||
        !n->pfd_gen || !n->apfd || !n->apfd_peer)
        return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory for %u rooms", c->rooms_max);
    for (uint32_t s = 0; s < c->stages_max; s++)
        n->stages[s].next = s + 1 < c->stages_max ? s + 1 : PD_NONE;
    n->stage_free = 0;
    n->stages_avail = c->stages_max;
    for (uint32_t i = 0; i < c->peers_max; i++) {
        n->peers[i].net = n;
        n->peers[i].fd = -1;
    }
    return pub_alloc(n, msg, cap);
}

/* The self-pipe other threads write to wake the progress thread. */
static pd_err wake_pipe_init(pd_net *n, char *msg, size_t cap) {
    int pfd[2];
    if (pipe(pfd) != 0) return pd_errorf(msg, cap, PD_ERR_IO, "pipe: %s", strerror(errno));
    n->wake_rd = pfd[0];
    n->wake_wr = pfd[1];
    if (!net_set_nonblocking(n->wake_rd) || !net_set_nonblocking(n->wake_wr))
        return pd_errorf(msg, cap, PD_ERR_IO, "pipe: %s", strerror(errno));
    return PD_OK;
}

pd_err pd_net_create(pd_net **out, const pd_net_config *cfg, char *msg, size_t msg_cap) {
    if (!out || !cfg) return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "no config");
    *out = NULL;
    pd_err err = config_check(cfg, msg, msg_cap);
    if (err) return err;
    /* The handshake's nonces and proofs (idempotent, thread-safe). */
    if (sodium_init() < 0)
        return pd_errorf(msg, msg_cap, PD_ERR_IO, "libsodium could not initialise");
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
    if ((err = net_dns_init(n))) {
        pd_errorf(msg, msg_cap, err, "cannot set up the name resolver");
        goto fail;
    }
    n->next_due_ms = UINT64_MAX;
    n->post_budget = SIZE_MAX;
    uint64_t seed = now_ms() ^ ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)n;
    n->node_id = pd_splitmix64(&seed);
    if ((err = wake_pipe_init(n, msg, msg_cap))) goto fail;
    c->ucx_tls = cfg->ucx_tls;
    c->ucx_net_devices = cfg->ucx_net_devices;
    err = net_ucx_init(n, msg, msg_cap);
    c->ucx_tls = c->ucx_net_devices = NULL;
    if (err) goto fail;
    if (c->role == PD_NET_PREFILL && (err = net_listen_init(n, msg, msg_cap))) goto fail;
    *out = n;
    return PD_OK;
fail:
    pd_net_destroy(n);
    return err;
}

pd_err pd_net_start(pd_net *n, char *msg, size_t msg_cap) {
    if (!n || !n->registered)
        return pd_errorf(msg, msg_cap, PD_ERR_STATE, "register memory before start");
    if (n->running) return pd_errorf(msg, msg_cap, PD_ERR_STATE, "already started");
    pd_err err = net_copy_start(n, msg, msg_cap);
    if (err) return err;
    if (pthread_create(&n->thread, NULL, progress_main, n) != 0) {
        int e = errno;
        net_copy_stop(n);
        return pd_errorf(msg, msg_cap, PD_ERR_IO, "progress thread: %s", strerror(e));
    }
    n->running = true;
    return PD_OK;
}

pd_xfer pd_net_endpoint(pd_net *n) { return (pd_xfer){.vt = &net_vt, .self = n}; }

uint16_t pd_net_bootstrap_port(const pd_net *n) { return n->port; }

void pd_net_stats_get(pd_net *n, pd_net_stats *out) {
    net_lock(n);
    *out = n->stats;
    net_unlock(n);
    out->status_unlocked = atomic_load_explicit(&n->status_unlocked, memory_order_relaxed);
    out->drained_unlocked = atomic_load_explicit(&n->drained_unlocked, memory_order_relaxed);
}

uint32_t pd_net_rooms_live(pd_net *n) {
    net_lock(n);
    uint32_t live = xr_used(&n->rooms);
    net_unlock(n);
    return live;
}

/* PD_NET_FAULT_HOLD_MUTEX, set without the mutex: the progress thread may
 * hold it. Turned on, it returns once the thread holds it. */
static void hold_mutex_set(pd_net *n, bool on) {
    bool running = false;
    if (on) { /* (off: the thread holds it) */
        net_lock(n);
        running = n->running && !n->stopping;
        net_unlock(n);
    }
    atomic_store(&n->stale_since_ns, 0); /* each hold starts a streak of unlocked answers */
    atomic_store(&n->drained_stale_since_ns, 0);
    atomic_store(&n->hold_mutex, on);
    net_wake(n);
    while (on && running && !atomic_load(&n->holding_mutex)) {
        struct timespec ts = {.tv_sec = 0, .tv_nsec = 100000};
        nanosleep(&ts, NULL);
    }
}

void pd_net_set_fault(pd_net *n, pd_net_fault fault, bool on) {
    if ((unsigned)fault >= PD_NET_FAULT__COUNT) return;
    if (fault == PD_NET_FAULT_HOLD_MUTEX) {
        hold_mutex_set(n, on);
        return;
    }
    net_lock(n);
    n->faults[fault] = on;
    if (!on && fault == PD_NET_FAULT_HOLD_NOTICES)
        for (uint32_t r = 0; r < n->cfg.rooms_max; r++)
            if (room_at(n, r)->slot.used && room_at(n, r)->note != N_NONE)
                net_mark_dirty(n, room_at(n, r));
    net_unlock(n);
    net_wake(n);
}

void pd_net_destroy(pd_net *n) {
    if (!n) return;
    if (n->running) {
        net_lock(n);
        n->stopping = true;
        net_unlock(n);
        net_wake(n);
        pthread_join(n->thread, NULL);
        n->running = false;
    }
    net_copy_stop(n); /* after the only thread that copies with it */
    /* Single-threaded from here. Fail every connection: the forced endpoint
     * closes complete every outstanding put before memory goes away. */
    bool made = n->rooms.recs != NULL;
    if (n->peers && made) {
        for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++)
            net_peer_fail(n, pi, "transport shutting down");
        /* Forced closes complete at once in peer-failure mode; requests a
         * mode-PD_NONE endpoint left behind are released by the worker below. */
        uint64_t t0 = now_ms();
        for (;;) {
            bool closing = false;
            if (n->worker) net_ucx_progress(n, PROGRESS_BURST);
            for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++) {
                peer *p = &n->peers[pi];
                if (p->state != PS_CLOSING) continue;
                if (ucp_request_check_status(p->close_req) != UCS_INPROGRESS) {
                    ucp_request_free(p->close_req);
                    net_peer_release(n, p);
                } else {
                    closing = true;
                }
            }
            if ((!closing && n->ucx_out == 0) || since(now_ms(), t0) > 1000) break;
            nanosleep(&(struct timespec){.tv_nsec = 200000}, NULL);
        }
        /* Late completions find a stale generation and are ignored. */
        for (uint32_t r = 0; r < n->cfg.rooms_max; r++) room_at(n, r)->slot.gen++;
        net_ucx_settle(n, 1000);
        for (uint32_t r = 0; r < n->cfg.rooms_max; r++) xr_dest_clear(&room_at(n, r)->dest);
    }
    for (int r = 0; r < REG_N; r++) {
        if (n->rkey_buf[r]) ucp_rkey_buffer_release(n->rkey_buf[r]);
        if (n->memh[r] && !n->memh_own[r]) ucp_mem_unmap(n->ctx, n->memh[r]);
    }
    if (n->ctx) net_own_release_all(n);
    if (n->waddr) ucp_worker_release_address(n->worker, n->waddr);
    if (n->worker) ucp_worker_destroy(n->worker);
    if (n->ctx) ucp_cleanup(n->ctx);
    if (n->listen_fd >= 0) close(n->listen_fd);
    net_dns_fini(n); /* before the wake pipe: the resolver writes to it */
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
    free(n->pfd_gen);
    free(n->apfd);
    free(n->pub);
    free(n->apfd_peer);
    free(n);
}
