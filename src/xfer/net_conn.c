/*
 * net_conn.c — the network transport's TCP bootstrap connections (see
 * net.c for the design and docs/bootstrap-protocol.md for the wire):
 * buffers, connect / accept / read / write, the handshake, and the room
 * messages of both sides, which it turns into calls on the room core.
 */
#include "net_internal.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

#include <sodium.h>

/* ---- the bootstrap connections: buffers ------------------------------------------ */

/* Space for a message of up to max bytes at the end of the tx buffer; NULL
 * if the peer is not reading (the caller fails it). */
uint8_t *net_tx_reserve(peer *p, size_t max) {
    PD_ASSERT(p->tx_off <= p->tx_len && p->tx_len <= p->tx_cap);
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

/* Every message is queued whole by one reserve and one commit; the encoders
 * write the newest version, and a connection that speaks an older one gets
 * its own in the header here. */
void net_tx_commit(pd_net *n, peer *p, size_t len) {
    PD_ASSERT(p->tx_len + len <= p->tx_cap && len >= BP_HEADER_BYTES);
    PD_ASSERT(p->ver >= BP_VERSION_MIN && p->ver <= BP_VERSION);
    if (p->ver != BP_VERSION) bp_put_u16(p->tx + p->tx_len + 4, p->ver);
    p->tx_len += len;
    p->last_tx_ms = now_ms();
    (void)n;
}

/* Queues a room message; false if the peer had to be failed. */
bool net_send_room_msg(pd_net *n, uint32_t pi, bp_type type, uint64_t room_id, uint64_t value) {
    PD_ASSERT(pi < n->cfg.peers_max);
    peer *p = &n->peers[pi];
    uint8_t *b = net_tx_reserve(p, BP_HEADER_BYTES + BP_ROOM_MSG_BYTES);
    if (!b) {
        net_peer_fail(n, pi, "send queue full: the peer does not read");
        return false;
    }
    size_t len = bp_room_write(b, BP_HEADER_BYTES + BP_ROOM_MSG_BYTES, type, room_id, value);
    net_tx_commit(n, p, len);
    return true;
}

static void send_error(pd_net *n, uint32_t pi, bp_code code, bool has_room, uint64_t room_id,
                       const char *text) {
    peer *p = &n->peers[pi];
    size_t max = BP_HEADER_BYTES + 16 + BP_ERROR_TEXT_MAX;
    uint8_t *b = net_tx_reserve(p, max);
    if (!b) {
        net_peer_fail(n, pi, "send queue full: the peer does not read");
        return;
    }
    net_tx_commit(n, p, bp_error_write(b, max, code, has_room, room_id, text));
    n->stats.error_replies++;
}

/* A protocol violation that ends the connection: counted, answered with an
 * ERROR, then the connection is closed once the reply is out. */
static void refuse_conn(pd_net *n, uint32_t pi, bp_code code, const char *text) {
    PD_ASSERT(pi < n->cfg.peers_max);
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
    PD_ASSERT(pi < n->cfg.peers_max);
    n->stats.bad_messages++;
    net_log(n, "pd_net: refusing room %llu from %s: %s", (unsigned long long)room_id,
            n->peers[pi].addr, text);
    send_error(n, pi, code, true, room_id, text);
}

/* ---- peers: lifecycle --------------------------------------------------------------- */

void net_peer_release(pd_net *n, peer *p) {
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
void net_peer_fail(pd_net *n, uint32_t pi, const char *why) {
    PD_ASSERT(pi < n->cfg.peers_max);
    peer *p = &n->peers[pi];
    if (p->state == PS_FREE || p->state == PS_CLOSING) return;
    uint64_t now = now_ms();
    if (p->ever_ready) n->stats.peers_lost++;
    net_log(n, "pd_net: connection to %s closed: %s", p->addr, why);
    if (p->state == PS_RESOLVING) net_dns_abandon(n, pi);
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
        net_set_st(n, rm, PD_XFER_FAILED);
        rm->peer_lost = true;
        rm->lost_unreliable = p->ep_no_peer_mode;
        rm->lost_ms = now;
        if (rm->lost_unreliable) n->abandon_pending++;
        if (n->cfg.role == PD_NET_PREFILL) {
            xr_peer_failed(&rm->h, XR_SENDER);
            rm->note = N_NONE; /* nobody left to tell */
            net_stages_drop(n, rm);
        } else {
            xr_peer_failed(&rm->h, XR_RECEIVER);
            /* A hung prefill may still write until it declares us dead itself. */
            if (rm->h.dest_sent) rm->h.settle_until = now + n->cfg.drain_grace_ms;
        }
        net_mark_dirty(n, rm);
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
    net_peer_release(n, p);
}

static uint32_t peer_alloc(pd_net *n) {
    for (uint32_t i = 0; i < n->cfg.peers_max; i++)
        if (n->peers[i].state == PS_FREE && net_dns_slot_free(n, i)) {
            peer *p = &n->peers[i];
            p->rx = malloc(RX_INIT_BYTES);
            if (!p->rx) return PD_NONE;
            p->rx_cap = RX_INIT_BYTES;
            p->ver = n->proto;
            p->t_state_ms = p->last_rx_ms = p->last_tx_ms = now_ms();
            return i;
        }
    return PD_NONE;
}

/* ---- the receiver's pump (progress thread) ------------------------------------------ */

static bool send_dest(pd_net *n, uint32_t pi, room *rm) {
    PD_ASSERT(n->cfg.role == PD_NET_DECODE && rm->dest.known && !rm->h.dest_sent);
    peer *p = &n->peers[pi];
    size_t max = BP_HEADER_BYTES + BP_DEST_FIXED + 4u * (size_t)rm->dest.n_pages;
    uint8_t *b = net_tx_reserve(p, max);
    if (!b) {
        net_peer_fail(n, pi, "send queue full: the peer does not read");
        return false;
    }
    const xr_dest *d = &rm->dest;
    size_t len = bp_dest_write(b, max, rm->slot.id, d->prompt, d->cached, d->mamba_slot,
                               d->meta_row, d->pages, d->n_pages);
    PD_ASSERT(len == max);
    net_tx_commit(n, p, len);
    rm->h.dest_sent = true;
    net_expect_soon(n); /* DEST_OK, then the data and the notice */
    if (!net_dest_list_kept(n, rm, p)) {
        free(rm->dest.pages); /* the prefill has it now; the receiver never needs it again */
        rm->dest.pages = NULL;
    }
    return true;
}

bool net_dest_list_kept(const pd_net *n, const room *rm, const peer *p) {
    size_t bytes = (size_t)rm->dest.n_pages * n->unit[REG_KV] + n->unit[REG_META] +
        (rm->dest.mamba_slot != PD_NONE ? n->unit[REG_MAMBA] : 0);
    /* Version 5: any room may come in data messages (where puts are
     * emulated, which only the prefill knows); the list is 4 bytes a page. */
    if (p->ver >= 5 && n->proto >= 5) return true;
    return p->ver >= 4 && n->proto >= 4 && bytes <= BP_NOTICE_DATA_MAX;
}

void net_pump_receiver(pd_net *n, room *rm, uint64_t now) {
    PD_ASSERT(n->cfg.role == PD_NET_DECODE && rm->slot.used);
    peer *p = net_peer_of(n, rm);
    if (rm->cancel_only) {
        /* Tell the prefill once the connection is up; a lost connection
         * tells it nothing, and the room goes either way. */
        if (p) {
            if (p->state != PS_READY) return;
            net_send_room_msg(n, rm->peer, BP_ABORT, rm->slot.id, ABORT_REASON_ENGINE);
        }
        net_room_free(n, ridx(n, rm));
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
            net_due_at(n, rm, rm->due_ms);
            return;
        }
        rm->abort_wired = true;
        net_send_room_msg(n, pi, BP_ABORT, rm->slot.id, ABORT_REASON_DEST_SENT);
    }
}

/* ---- messages: prefill side --------------------------------------------------------- */

static bp_auth peer_auth(const pd_net *n, const peer *p) {
    bp_auth a = {.key = (const uint8_t *)n->token, .key_len = n->token_len};
    memcpy(a.nonce_decode, p->nonce_decode, BP_NONCE_BYTES);
    memcpy(a.nonce_prefill, p->nonce_prefill, BP_NONCE_BYTES);
    return a;
}

/* AUTH: the decode node's nonce. Answered with ours and our proof. */
static void on_auth(pd_net *n, uint32_t pi, const uint8_t *pl, uint32_t len) {
    peer *p = &n->peers[pi];
    if (p->state != PS_AUTH) {
        refuse_conn(n, pi, BP_E_UNEXPECTED, "AUTH sent twice");
        return;
    }
    if (bp_auth_read(pl, len, p->nonce_decode) != PD_OK) {
        refuse_conn(n, pi, BP_E_MALFORMED, "malformed AUTH");
        return;
    }
    randombytes_buf(p->nonce_prefill, BP_NONCE_BYTES);
    bp_auth a = peer_auth(n, p);
    uint8_t proof[BP_PROOF_BYTES];
    bp_prefill_proof(&a, proof);
    size_t max = BP_HEADER_BYTES + BP_NONCE_BYTES + BP_PROOF_BYTES;
    uint8_t *b = net_tx_reserve(p, max);
    if (!b) {
        net_peer_fail(n, pi, "send queue full");
        return;
    }
    net_tx_commit(n, p, bp_challenge_write(b, max, p->nonce_prefill, proof));
    p->state = PS_HELLO;
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

static void on_hello(pd_net *n, uint32_t pi, const uint8_t *pl, uint32_t len) {
    PD_ASSERT(n->cfg.role == PD_NET_PREFILL && pi < n->cfg.peers_max);
    peer *p = &n->peers[pi];
    bp_hello h;
    if (p->state != PS_HELLO) {
        refuse_conn(n, pi, BP_E_UNEXPECTED,
                    p->state == PS_AUTH ? "HELLO before AUTH" : "HELLO sent twice");
        return;
    }
    if (bp_hello_read(pl, len, &h) != PD_OK) {
        refuse_conn(n, pi, BP_E_MALFORMED, "malformed HELLO");
        return;
    }
    bp_auth a = peer_auth(n, p);
    if (!bp_hello_verify(&a, pl, len)) {
        n->stats.auth_refused++;
        refuse_conn(n, pi, BP_E_AUTH,
                    "the HELLO's proof does not verify: the peer holds another token, or none");
        return;
    }
    char why[160];
    if (!hello_layout_matches(n, &h, why, sizeof(why))) {
        refuse_conn(n, pi, BP_E_MISMATCH, why);
        return;
    }
    const char *bad_addr = net_worker_addr_problem(n, h.worker_addr, h.worker_addr_len);
    if (bad_addr) {
        refuse_conn(n, pi, BP_E_MISMATCH, bad_addr);
        return;
    }
    ucs_status_t st = net_peer_ep_create(n, p, &h);
    if (st != UCS_OK) {
        snprintf(why, sizeof(why), "no UCX path to the decode node's worker: %s",
                 ucs_status_string(st));
        refuse_conn(n, pi, BP_E_UCX, why);
        return;
    }
    if (!net_peer_regions_set(p, &h)) {
        refuse_conn(n, pi, BP_E_MALFORMED, "a remote key does not unpack");
        return;
    }
    p->node_id = h.node_id;
    uint8_t *b = net_tx_reserve(p, BP_HEADER_BYTES + 16);
    if (!b) {
        net_peer_fail(n, pi, "send queue full");
        return;
    }
    net_tx_commit(n, p, bp_hello_ok_write(b, BP_HEADER_BYTES + 16, n->node_id, n->cfg.page_size));
    p->state = PS_READY;
    p->ever_ready = true;
    p->t_state_ms = now_ms();
    n->stats.peers_connected++;
}

/* Checks a destination against the decode node's advertised memory and this
 * node's; NULL if acceptable, else why not. */
static const char *dest_problem(const pd_net *n, const peer *p, const bp_dest *d) {
    uint32_t ps = n->cfg.page_size;
    if (d->room == 0) return "room 0 names no request";
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

/* Orphan destinations that came on connection pi (issue 10, finding 5: a
 * peer holding the token could fill the room table with them). */
static uint32_t orphans_of(const pd_net *n, uint32_t pi) {
    uint32_t k = 0;
    for (uint32_t r = 0; r < n->cfg.rooms_max; r++) {
        const room *rm = room_at(n, r);
        k += net_room_orphan(rm) && rm->peer == pi && rm->peer_gen == n->peers[pi].gen;
    }
    return k;
}

static void on_dest(pd_net *n, uint32_t pi, const uint8_t *pl, uint32_t len) {
    PD_ASSERT(n->cfg.role == PD_NET_PREFILL && n->peers[pi].state == PS_READY);
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
    uint32_t r = net_room_find(n, d.room);
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
            net_send_room_msg(n, pi, BP_ABORT, d.room, ABORT_REASON_ENGINE);
            net_room_try_release(n, rm);
            return;
        }
    } else {
        /* Counted only when the table is three quarters full: the scan costs
         * a pass over the table, and below that no connection can crowd the
         * others out (a live room evicts the oldest orphan anyway). */
        bool crowded = (uint64_t)xr_used(&n->rooms) * 4 >= (uint64_t)n->cfg.rooms_max * 3;
        if (crowded && orphans_of(n, pi) >= n->cfg.orphans_per_peer) {
            n->stats.orphans_refused++;
            send_error(n, pi, BP_E_BUSY, true, d.room,
                       "too many destinations from this peer that no request has claimed");
            return;
        }
        r = net_room_new(n, d.room);
        if (r == PD_NONE) {
            send_error(n, pi, BP_E_BUSY, true, d.room, "no room slot free on the prefill node");
            return;
        }
    }
    room *rm = room_at(n, r);
    uint32_t *pages = malloc(((size_t)d.n_pages + 1) * sizeof(uint32_t));
    if (!pages) {
        if (!rm->h.open) net_room_free(n, r);
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
    if (!rm->h.open) {
        rm->t_ms = now_ms();
        xr_set_tomb(&n->rooms, r, true); /* evictable, oldest first, before any live room */
    }
    if (rm->h.open) xr_dest_arrived(&rm->h);
    net_send_room_msg(n, pi, BP_DEST_OK, d.room, 0);
}

static void on_decode_abort(pd_net *n, uint32_t pi, uint64_t room_id, uint64_t reason) {
    PD_ASSERT(n->cfg.role == PD_NET_PREFILL && n->peers[pi].state == PS_READY);
    peer *p = &n->peers[pi];
    uint32_t r = net_room_find(n, room_id);
    if (r == PD_NONE) {
        /* Closed here already (a race with our own notice: nothing of it
         * can write any more), or the decode half ended before this half
         * opened: a tombstone makes a later sender_open fail at once. Not
         * when the decode's DEST went first on this connection: a room that
         * got a DEST stays here until the engine closed it (or it went as
         * an orphan, and its decode half was told), so it was closed. */
        r = reason == ABORT_REASON_DEST_SENT ? PD_NONE : net_room_new(n, room_id);
        if (r != PD_NONE) {
            room *tomb = room_at(n, r);
            tomb->r_aborted = true;
            xr_peer_failed(&tomb->h, XR_SENDER);
            xr_set_tomb(&n->rooms, r, true);
        }
        net_send_room_msg(n, pi, BP_ACK, room_id, 0);
        return;
    }
    room *rm = room_at(n, r);
    if (rm->peer == PD_NONE) {
        /* No destination came: the decode half ended before it sent one.
         * Nothing was ever written. */
        rm->r_aborted = true;
        net_set_st(n, rm, PD_XFER_FAILED);
        xr_peer_failed(&rm->h, XR_SENDER);
        net_stages_drop(n, rm);
        net_send_room_msg(n, pi, BP_ACK, room_id, 0);
        if (xr_gone(&rm->h)) net_room_free(n, r); /* our own tombstone: both halves are gone */
        return;
    }
    if (rm->peer != pi || rm->peer_gen != p->gen) {
        refuse_room(n, pi, BP_E_ROOM_UNKNOWN, room_id,
                    "this connection holds no destination for the room");
        return;
    }
    rm->r_aborted = true;
    net_set_st(n, rm, PD_XFER_FAILED);
    net_stages_drop(n, rm);
    if (rm->h.done && rm->note == N_NONE && rm->flush_out == 0 && !rm->need_flush) {
        /* Every put landed (the flush after the notice completed): nothing
         * of the room can write any more. Otherwise the ACK waits for that
         * flush: on the bootstrap socket it could overtake a put. */
        net_send_room_msg(n, pi, BP_ACK, room_id, 0);
        return;
    }
    xr_peer_failed(&rm->h, XR_SENDER);
    rm->note = N_ACK;
    rm->note_value = 0;
    rm->due_ms = 0;
    net_mark_dirty(n, rm);
}

/* ---- messages: decode side ----------------------------------------------------------- */

static room *own_room(pd_net *n, uint32_t pi, uint64_t room_id) {
    uint32_t r = net_room_find(n, room_id);
    if (r == PD_NONE) return NULL;
    room *rm = room_at(n, r);
    return rm->peer == pi && rm->peer_gen == n->peers[pi].gen ? rm : NULL;
}

static void queue_hello(pd_net *n, uint32_t pi);

/* CHALLENGE: the prefill's nonce and its proof, checked before our memory
 * descriptors leave the node. */
static void on_challenge(pd_net *n, uint32_t pi, const uint8_t *pl, uint32_t len) {
    peer *p = &n->peers[pi];
    uint8_t proof[BP_PROOF_BYTES], want[BP_PROOF_BYTES];
    if (p->state != PS_AUTH) {
        refuse_conn(n, pi, BP_E_UNEXPECTED, "CHALLENGE out of turn");
        return;
    }
    if (bp_challenge_read(pl, len, p->nonce_prefill, proof) != PD_OK) {
        refuse_conn(n, pi, BP_E_MALFORMED, "malformed CHALLENGE");
        return;
    }
    bp_auth a = peer_auth(n, p);
    bp_prefill_proof(&a, want);
    if (!bp_proof_equal(proof, want)) {
        n->stats.auth_refused++;
        refuse_conn(n, pi, BP_E_AUTH,
                    "the prefill node's proof does not verify: it holds another token, or none");
        return;
    }
    queue_hello(n, pi);
}

/* A room message from the prefill (decode side, mutex held): what it tells
 * the room core. */
static void on_room_msg(pd_net *n, room *rm, uint32_t type, uint64_t value) {
    if (type == BP_DEST_OK) {
        xr_dest_arrived(&rm->h);
        net_expect_soon(n);
    } else if (type == BP_START) {
        xr_data_started(&rm->h);
        net_expect_soon(n);
    } else if (type == BP_DONE) {
        n->stats.bytes_received += value;
        net_set_st(n, rm, PD_XFER_SUCCESS);
        xr_peer_stopped(&rm->h);
    } else if (type == BP_ABORT) {
        net_set_st(n, rm, PD_XFER_FAILED);
        xr_peer_failed(&rm->h, XR_RECEIVER);
    } else {
        xr_peer_stopped(&rm->h);
    }
}

void net_on_notice(pd_net *n, uint64_t room_id, uint64_t bytes, uint64_t node_id) {
    PD_ASSERT(n->cfg.role == PD_NET_DECODE);
    uint32_t r = net_room_find(n, room_id);
    if (r == PD_NONE) return; /* gone: drained on ACK or a dead peer's grace */
    room *rm = room_at(n, r);
    peer *p = net_peer_of(n, rm);
    /* Only the connection that carried the room's destination may end it; a
     * notice from an endpoint of a connection since lost is dropped (the
     * room failed with it and drains after drain_grace_ms). So is one for a
     * room that already heard the prefill is done with it: since version 5
     * the prefill answers a crossing ABORT at once when only data messages
     * were on the wire (nothing to flush), so its ACK may overtake them and
     * the notice behind them; the messages were dropped (peer_stopped), and
     * the notice must not then say SUCCESS for bytes that never landed. */
    if (!p || p->state != PS_READY || p->node_id != node_id || rm->h.peer_stopped) return;
    on_room_msg(n, rm, BP_DONE, bytes);
    net_mark_dirty(n, rm);
}

/* What is wrong with a data-bearing notice for room rm (why may hold the
 * text), or NULL: every segment lies within the room's own destination and
 * the data is exactly their bytes. */
static const char *notice_data_problem(const pd_net *n, const room *rm, const peer *p,
                                       const bp_notice *nt, const uint8_t *data, size_t len,
                                       char *why, size_t cap) {
    if (p->ver < 4) return "data in a notice on a version-3 connection";
    if (!data) return "the data did not come with the notice (rendezvous)";
    if (!rm->dest.pages) return "the room's destination is too large to come in a notice";
    size_t want = 0;
    for (uint32_t i = 0; i < nt->n_segs; i++) {
        const bp_notice_seg *g = &nt->segs[i];
        if (g->region == REG_KV &&
            (g->index > rm->dest.n_pages || g->units > rm->dest.n_pages - g->index)) {
            snprintf(why, cap, "KV page positions %u..%u outside the room's %u pages", g->index,
                     g->index + g->units - 1, rm->dest.n_pages);
            return why;
        }
        if (g->region == REG_MAMBA && rm->dest.mamba_slot == PD_NONE)
            return "a Mamba slot for a room without one";
        want += (size_t)g->units * n->unit[g->region];
    }
    if (len != want || nt->bytes != len) {
        snprintf(why, cap, "%zu bytes of data (%llu announced) where its segments need %zu", len,
                 (unsigned long long)nt->bytes, want);
        return why;
    }
    return NULL;
}

/* Copies the checked segments into the room's pages, slot and row. */
static void notice_data_copy(pd_net *n, const room *rm, const bp_notice *nt, const uint8_t *at) {
    for (uint32_t i = 0; i < nt->n_segs; i++) {
        const bp_notice_seg *g = &nt->segs[i];
        size_t unit = n->unit[g->region];
        for (uint32_t k = 0; k < g->units; k++, at += unit) {
            uint32_t u = g->region == REG_KV ? rm->dest.pages[g->index + k]
                : g->region == REG_MAMBA     ? rm->dest.mamba_slot
                                             : rm->dest.meta_row;
            PD_ASSERT(u < n->units[g->region]); /* receiver_open checked the destination */
            memcpy(n->base[g->region] + (size_t)u * unit, at, unit);
        }
    }
}

void net_on_room_bytes(pd_net *n, const bp_notice *nt, const uint8_t *data, size_t len,
                       bool final) {
    PD_ASSERT(n->cfg.role == PD_NET_DECODE && nt->n_segs <= BP_NOTICE_SEGS_MAX);
    uint32_t r = net_room_find(n, nt->room);
    if (r == PD_NONE) return; /* gone: its pages are no longer its own */
    room *rm = room_at(n, r);
    peer *p = net_peer_of(n, rm);
    /* As for the plain notice: only the connection that carried the DEST.
     * And only while the room still owns its pages: a room that learnt the
     * prefill is done with it (its ACK may overtake these bytes on the
     * bootstrap socket) may be drained, its pages given to another. A data
     * message also only while the room has not ended. */
    if (!p || p->state != PS_READY || p->node_id != nt->node_id || rm->h.peer_stopped) return;
    if (!final && xr_is_final(xr_status(&rm->h))) return;
    char buf[160];
    const char *why = !final && p->ver < 5
        ? "a data message on a connection older than version 5"
        : notice_data_problem(n, rm, p, nt, data, len, buf, sizeof(buf));
    if (why) {
        n->stats.bad_messages++;
        net_log(n, "pd_net: room %llu from %s: refusing %s: %s", (unsigned long long)nt->room,
                p->addr, final ? "the notice's data" : "a data message", why);
        net_set_st(n, rm, PD_XFER_FAILED);
        /* The notice was the prefill's last word; after a data message the
         * prefill learns of the failure from our ABORT, and what it sent
         * meanwhile is dropped here (the room has ended). */
        if (final) xr_peer_failed(&rm->h, XR_RECEIVER);
        net_mark_dirty(n, rm);
        return;
    }
    notice_data_copy(n, rm, nt, data);
    if (final) {
        n->stats.notices_with_data++;
        on_room_msg(n, rm, BP_DONE, len);
    } else {
        n->stats.data_messages++;
        xr_data_started(&rm->h);
    }
    net_mark_dirty(n, rm);
}

static void on_decode_msg(pd_net *n, uint32_t pi, uint32_t type, const uint8_t *pl, uint32_t len) {
    PD_ASSERT(n->cfg.role == PD_NET_DECODE && pi < n->cfg.peers_max);
    peer *p = &n->peers[pi];
    if (type == BP_CHALLENGE) {
        on_challenge(n, pi, pl, len);
        return;
    }
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
                if (rm->slot.used && rm->peer == pi && rm->peer_gen == p->gen)
                    net_mark_dirty(n, rm);
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
            /* ACK may cross our close legitimately, and so may DEST_OK and
             * START since the notice travels on the data path: a room can
             * end, and be gone, before they arrive. DONE or ABORT about a
             * room we do not have is the peer's mistake. */
            if (type == BP_DONE || type == BP_ABORT)
                refuse_room(n, pi, BP_E_ROOM_UNKNOWN, room_id, "unknown room");
            return;
        }
        on_room_msg(n, rm, type, value);
        return;
    }
    default: refuse_conn(n, pi, BP_E_UNEXPECTED, "message type not sent to a decode node"); return;
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
    peer *p = &n->peers[pi];
    if (!e.has_room && e.code == BP_E_VERSION && n->cfg.role == PD_NET_DECODE &&
        p->state == PS_AUTH && p->ver > BP_VERSION_MIN) {
        /* A prefill node of an older version (it refuses ours on our AUTH):
         * once the parse of this buffer stops, reconnect speaking the
         * version below ours, down to the oldest we speak (a version-5 node
         * reaches a version-4 one in 4, a version-3 one in 3). */
        net_log(n, "pd_net: %s speaks an older protocol (%s): reconnecting in version %u", p->addr,
                text, p->ver - 1u);
        p->redial_ver = (uint16_t)(p->ver - 1u);
        return;
    }
    if (!e.has_room) {
        char why[BP_ERROR_TEXT_MAX + 64];
        snprintf(why, sizeof(why), "peer refused the connection: %s (%s)", text,
                 bp_code_name(e.code));
        net_peer_fail(n, pi, why);
        return;
    }
    net_log(n, "pd_net: %s refused room %llu: %s (%s)", n->peers[pi].addr,
            (unsigned long long)e.room, text, bp_code_name(e.code));
    if (n->cfg.role == PD_NET_DECODE) {
        /* The prefill refused our destination: it will never write to it. */
        room *rm = own_room(n, pi, e.room);
        if (rm) {
            net_set_st(n, rm, PD_XFER_FAILED);
            xr_peer_failed(&rm->h, XR_RECEIVER);
        }
    }
}

static void on_message(pd_net *n, uint32_t pi, uint32_t type, const uint8_t *pl, uint32_t len) {
    PD_ASSERT(pi < n->cfg.peers_max);
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
    if (type == BP_AUTH) {
        on_auth(n, pi, pl, len);
        return;
    }
    if (type == BP_HELLO) {
        on_hello(n, pi, pl, len);
        return;
    }
    if (p->state != PS_READY) {
        refuse_conn(n, pi, BP_E_UNEXPECTED, "the first messages must be AUTH, then HELLO");
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
        on_decode_abort(n, pi, room_id, value);
        return;
    default: refuse_conn(n, pi, BP_E_UNEXPECTED, "message type not sent to a prefill node"); return;
    }
}

/* ---- socket I/O ------------------------------------------------------------------------ */

/* A connection speaks the version of the decode node's first message (its
 * AUTH); every later message must carry it. An ERROR may come in any version
 * this node speaks (an older prefill refusing ours). False if refused. */
static bool connection_version(pd_net *n, uint32_t pi, const bp_header *h) {
    peer *p = &n->peers[pi];
    if (h->version == p->ver || h->type == BP_ERROR) return true;
    if (n->cfg.role == PD_NET_PREFILL && p->state == PS_AUTH && h->type == BP_AUTH) {
        p->ver = h->version;
        return true;
    }
    char why[80];
    snprintf(why, sizeof(why), "version %u on a connection that speaks %u", h->version, p->ver);
    refuse_conn(n, pi, BP_E_VERSION, why);
    return false;
}

/* Decode: the prefill refused our version; the same slot connects again,
 * speaking redial_ver. Its rooms stay bound to it (no DEST left yet: the
 * handshake never completed). */
static void peer_redial(pd_net *n, uint32_t pi) {
    peer *p = &n->peers[pi];
    PD_ASSERT(n->cfg.role == PD_NET_DECODE && p->state == PS_AUTH && p->redial_ver);
    close_fd_quietly(p->fd);
    p->fd = -1;
    p->rx_len = p->tx_off = p->tx_len = 0;
    p->ver = p->redial_ver;
    p->redial_ver = 0;
    p->state = PS_RESOLVE;
    p->t_state_ms = now_ms();
}

/* Checks a message's header before its payload is read (mutex held):
 * framing, a version this node speaks, the connection's version, a type the
 * receiving role gets. False if the connection was refused. */
static bool header_ok(pd_net *n, uint32_t pi, const uint8_t *buf, bp_header *h) {
    bp_code code;
    pd_err herr = bp_header_check(buf, h, &code);
    if (!herr && h->version > n->proto) { /* a node pinned to an older version */
        herr = PD_ERR_PARSE;
        code = BP_E_VERSION;
    }
    if (herr) {
        char why[96];
        if (code == BP_E_VERSION && n->proto > BP_VERSION_MIN)
            snprintf(why, sizeof(why),
                     "protocol version %u not supported; this node speaks %u to %u", h->version,
                     BP_VERSION_MIN, n->proto);
        else if (code == BP_E_VERSION)
            snprintf(why, sizeof(why), "protocol version %u not supported; this node speaks %u",
                     h->version, n->proto);
        else if (code == BP_E_TOO_BIG)
            snprintf(why, sizeof(why), "%s of %u bytes is over the limit", bp_type_name(h->type),
                     h->length);
        else
            snprintf(why, sizeof(why), "bad header (%s)",
                     code == BP_E_MALFORMED ? "magic or flags" : "type");
        refuse_conn(n, pi, code, why);
        return false;
    }
    if (!bp_type_for_role(h->type, n->cfg.role == PD_NET_PREFILL)) {
        /* Refused on the header: a 1 MiB DEST sent to a decode node is
         * never buffered. */
        char why[64];
        snprintf(why, sizeof(why), "a %s node never receives %s",
                 n->cfg.role == PD_NET_PREFILL ? "prefill" : "decode", bp_type_name(h->type));
        refuse_conn(n, pi, BP_E_UNEXPECTED, why);
        return false;
    }
    return connection_version(n, pi, h);
}

/* Parses every complete message in the rx buffer. */
static void peer_parse(pd_net *n, uint32_t pi) {
    PD_ASSERT(pi < n->cfg.peers_max && n->peers[pi].rx_len <= n->peers[pi].rx_cap);
    peer *p = &n->peers[pi];
    uint32_t gen = p->gen;
    size_t off = 0;
    while (p->state != PS_FREE && p->gen == gen && !p->closing_after_tx && !p->redial_ver &&
           p->rx_len - off >= BP_HEADER_BYTES) {
        bp_header h;
        if (!header_ok(n, pi, p->rx + off, &h)) return;
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
                    net_peer_fail(n, pi, "out of memory for a message");
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
    if (p->redial_ver) {
        peer_redial(n, pi);
        return;
    }
    if (off) {
        memmove(p->rx, p->rx + off, p->rx_len - off);
        p->rx_len -= off;
    }
}

/* assisted: an assisted turn's read (net_peers_read_now), which leaves the
 * end of the stream and errors to the progress thread. */
static void peer_read(pd_net *n, uint32_t pi, uint64_t now, bool assisted) {
    PD_ASSERT(pi < n->cfg.peers_max);
    peer *p = &n->peers[pi];
    uint32_t gen = p->gen;
    for (int rounds = 0; rounds < 64; rounds++) {
        if (p->state == PS_FREE || p->gen != gen || p->closing_after_tx || p->fd < 0) return;
        if (p->rx_len == p->rx_cap) return; /* parse made no room: waits for a bigger buffer */
        ssize_t got = recv(p->fd, p->rx + p->rx_len, p->rx_cap - p->rx_len, MSG_DONTWAIT);
        if (got > 0) {
            p->rx_len += (size_t)got;
            p->last_rx_ms = now;
            peer_parse(n, pi);
            continue;
        }
        if (assisted) return;
        if (got == 0) {
            if (p->rx_len > 0) {
                n->stats.bad_messages++; /* a message cut off by the close */
                net_peer_fail(n, pi, "connection closed in the middle of a message");
            } else {
                net_peer_fail(n, pi, "connection closed by the peer");
            }
            return;
        }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) net_peer_fail(n, pi, strerror(errno));
        return;
    }
}

void net_peer_write(pd_net *n, uint32_t pi) {
    PD_ASSERT(pi < n->cfg.peers_max && n->peers[pi].fd >= 0);
    peer *p = &n->peers[pi];
    while (p->tx_off < p->tx_len) {
        ssize_t w = send(p->fd, p->tx + p->tx_off, p->tx_len - p->tx_off, MSG_NOSIGNAL);
        if (w > 0) {
            p->tx_off += (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        net_peer_fail(n, pi, w < 0 ? strerror(errno) : "send failed");
        return;
    }
    p->tx_off = p->tx_len = 0;
    if (p->closing_after_tx) net_peer_fail(n, pi, "closed after refusing the peer");
}

void net_peers_read_now(pd_net *n, uint64_t now) {
    nfds_t nf = 0;
    for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++) {
        const peer *p = &n->peers[pi];
        if (p->state != PS_READY || p->fd < 0 || p->closing_after_tx || p->ucx_failed) continue;
        n->apfd_peer[nf] = pi;
        n->apfd[nf++] = (struct pollfd){.fd = p->fd, .events = POLLIN};
    }
    PD_ASSERT(nf <= n->cfg.peers_max);
    if (nf == 0 || poll(n->apfd, nf, 0) <= 0) return;
    for (nfds_t i = 0; i < nf; i++) {
        /* A message handled above may have failed a peer listed here. */
        uint32_t pi = n->apfd_peer[i];
        if ((n->apfd[i].revents & POLLIN) && n->peers[pi].fd == n->apfd[i].fd &&
            n->peers[pi].state == PS_READY)
            peer_read(n, pi, now, true);
    }
}

/* From any thread, mutex held: sends what peer pi has queued with
 * non-blocking writes. What does not go now, and any error, is left to the
 * progress thread (which alone closes sockets). True if nothing is left. */
bool net_tx_try(pd_net *n, uint32_t pi) {
    PD_ASSERT(pi < n->cfg.peers_max);
    peer *p = &n->peers[pi];
    if (p->fd < 0 || p->state != PS_READY || p->closing_after_tx) return false;
    while (p->tx_off < p->tx_len) {
        ssize_t w =
            send(p->fd, p->tx + p->tx_off, p->tx_len - p->tx_off, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w <= 0) return false;
        p->tx_off += (size_t)w;
    }
    p->tx_off = p->tx_len = 0;
    return true;
}

/* Every slot is taken: the connection that has held one longest without a
 * HELLO makes way, so silent or slow strangers cannot lock the decode nodes
 * out (issue 10, finding 4). Authenticated peers are never evicted. False
 * if every slot holds one. */
static bool evict_unauthenticated(pd_net *n) {
    uint32_t victim = PD_NONE;
    for (uint32_t pi = 0; pi < n->cfg.peers_max; pi++) {
        const peer *p = &n->peers[pi];
        if ((p->state != PS_AUTH && p->state != PS_HELLO) || p->closing_after_tx) continue;
        if (victim == PD_NONE || p->t_state_ms < n->peers[victim].t_state_ms) victim = pi;
    }
    if (victim == PD_NONE) return false;
    n->stats.peers_evicted++;
    net_peer_fail(n, victim, "evicted: every slot was taken and it had not said HELLO");
    return n->peers[victim].state == PS_FREE;
}

void net_accept_all(pd_net *n) {
    for (int i = 0; i < 64; i++) {
        struct sockaddr_storage sa;
        socklen_t sl = sizeof(sa);
        int fd = accept(n->listen_fd, (struct sockaddr *)&sa, &sl);
        if (fd < 0) return;
        int one = 1;
        setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        bool nb = net_set_nonblocking(fd);
        uint32_t pi = nb ? peer_alloc(n) : PD_NONE;
        if (pi == PD_NONE && nb && evict_unauthenticated(n)) pi = peer_alloc(n);
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
        p->state = PS_AUTH;
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
    PD_ASSERT(n->cfg.role == PD_NET_DECODE && pi < n->cfg.peers_max);
    peer *p = &n->peers[pi];
    bp_hello h = {
        .node_id = n->node_id,
        .page_size = n->cfg.page_size,
        .meta_row_bytes = sizeof(pd_meta_row),
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
    uint8_t *b = net_tx_reserve(p, BP_HEADER_BYTES + BP_HELLO_MAX);
    bp_auth a = peer_auth(n, p);
    size_t len = b ? bp_hello_write(b, BP_HEADER_BYTES + BP_HELLO_MAX, &h, &a) : 0;
    if (len == 0) {
        net_peer_fail(n, pi, "cannot encode HELLO (worker address or keys too large)");
        return;
    }
    net_tx_commit(n, p, len);
    p->state = PS_HELLO;
}

/* The first message on a connection: our nonce. The handshake's deadline
 * counts from here. */
static void queue_auth(pd_net *n, uint32_t pi) {
    peer *p = &n->peers[pi];
    randombytes_buf(p->nonce_decode, BP_NONCE_BYTES);
    uint8_t *b = net_tx_reserve(p, BP_HEADER_BYTES + BP_NONCE_BYTES);
    if (!b) {
        net_peer_fail(n, pi, "send queue full");
        return;
    }
    net_tx_commit(n, p, bp_auth_write(b, BP_HEADER_BYTES + BP_NONCE_BYTES, p->nonce_decode));
    p->state = PS_AUTH;
    p->t_state_ms = now_ms();
}

/* Opens the TCP connection to a resolved address (frees res). */
static void connect_to(pd_net *n, uint32_t pi, struct addrinfo *res) {
    peer *p = &n->peers[pi];
    int fd = socket(res->ai_family, res->ai_socktype, res->ai_protocol);
    if (fd < 0 || !net_set_nonblocking(fd)) {
        if (fd >= 0) close(fd);
        freeaddrinfo(res);
        net_peer_fail(n, pi, "socket() failed");
        return;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    p->fd = fd;
    int rc = connect(fd, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    p->t_state_ms = now_ms();
    if (rc == 0) {
        queue_auth(n, pi);
    } else if (errno == EINPROGRESS) {
        p->state = PS_CONNECTING;
    } else {
        net_peer_fail(n, pi, strerror(errno));
    }
}

/* A numeric address resolves here and now; a host name goes to the
 * resolver thread, so a slow DNS answer never stalls this thread and with
 * it the heartbeats of every other peer (issue 10, finding 11). */
static void peer_connect(pd_net *n, uint32_t pi) {
    PD_ASSERT(n->cfg.role == PD_NET_DECODE && n->peers[pi].state == PS_RESOLVE);
    peer *p = &n->peers[pi];
    char host[PEER_ADDR_MAX], port[16];
    if (!split_addr(p->addr, host, sizeof(host), port, sizeof(port))) {
        net_peer_fail(n, pi, "bad peer address (want host:port)");
        return;
    }
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_NUMERICHOST | AI_NUMERICSERV};
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(host, port, &hints, &res);
    if (gai == 0 && res) {
        connect_to(n, pi, res);
        return;
    }
    if (res) freeaddrinfo(res);
    if (gai != EAI_NONAME) {
        net_peer_fail(n, pi, gai_strerror(gai));
        return;
    }
    uint64_t delay = n->faults[PD_NET_FAULT_SLOW_RESOLVE] ? 2 * n->cfg.dead_after_ms : 0;
    if (!net_dns_post(n, pi, host, port, delay)) {
        net_peer_fail(n, pi, "cannot start the name resolver thread");
        return;
    }
    n->stats.name_lookups++;
    p->state = PS_RESOLVING;
    p->t_state_ms = now_ms();
}

static void peer_resolved(pd_net *n, uint32_t pi) {
    struct addrinfo *res = NULL;
    int gai = net_dns_take(n, pi, &res);
    if (gai == NET_DNS_PENDING) return;
    if (gai != 0 || !res) {
        if (res) freeaddrinfo(res);
        net_peer_fail(n, pi, gai ? gai_strerror(gai) : "no address");
        return;
    }
    connect_to(n, pi, res);
}

void net_peer_service(pd_net *n, uint32_t pi, uint64_t now) {
    PD_ASSERT(pi < n->cfg.peers_max);
    peer *p = &n->peers[pi];
    switch (p->state) {
    case PS_FREE: return;
    case PS_CLOSING:
        if (ucp_request_check_status(p->close_req) != UCS_INPROGRESS) {
            ucp_request_free(p->close_req);
            p->close_req = NULL;
            net_peer_release(n, p);
        }
        return;
    case PS_RESOLVE: peer_connect(n, pi); return;
    case PS_RESOLVING: peer_resolved(n, pi); return;
    case PS_CONNECTING:
        if (p->revents & (POLLOUT | POLLERR | POLLHUP)) {
            int err = 0;
            socklen_t el = sizeof(err);
            if (getsockopt(p->fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0) err = errno;
            if (err) net_peer_fail(n, pi, strerror(err));
            else queue_auth(n, pi);
        }
        return;
    case PS_AUTH:
    case PS_HELLO:
    case PS_READY:
        if (p->ucx_failed) {
            net_peer_fail(n, pi, "UCX endpoint error");
            return;
        }
        if (p->revents & (POLLIN | POLLHUP | POLLERR)) peer_read(n, pi, now, false);
        return;
    }
}

/* Finds the live connection to addr or starts one (mutex held). */
uint32_t net_peer_for_addr(pd_net *n, const char *addr) {
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
void net_peer_forget_if_unused(pd_net *n, uint32_t pi) {
    if (pi == PD_NONE || n->peers[pi].state != PS_RESOLVE) return;
    for (uint32_t i = 0; i < n->cfg.rooms_max; i++)
        if (room_at(n, i)->slot.used && room_at(n, i)->peer == pi &&
            room_at(n, i)->peer_gen == n->peers[pi].gen)
            return;
    net_peer_release(n, &n->peers[pi]);
}

bool net_addr_ok(const char *addr) {
    char host[PEER_ADDR_MAX], port[16];
    return addr && strlen(addr) < PEER_ADDR_MAX &&
        split_addr(addr, host, sizeof(host), port, sizeof(port));
}

pd_err net_listen_init(pd_net *n, char *msg, size_t cap) {
    char port[16];
    snprintf(port, sizeof(port), "%u", n->cfg.bootstrap_port);
    struct addrinfo hints = {.ai_family = AF_UNSPEC,
                             .ai_socktype = SOCK_STREAM,
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
        !net_set_nonblocking(fd)) {
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
