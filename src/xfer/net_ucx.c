/*
 * net_ucx.c — the network transport's data path (see net.c): the UCX
 * context and worker, registered memory, page-run puts, the completion
 * notice behind a fence (version 3) or carrying a small room's bytes itself
 * (version 4), a larger room's bytes as data messages where puts are
 * emulated (version 5), completions found by room generation, and giving up
 * on writes to a dead peer.
 */
#include "net_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* UCX allocates pd_net_allocator's memory with UCP_MEM_MAP_ALLOCATE, trying
 * these methods in order (see own_alloc). */
#define OWN_ALLOC_PRIO "md:sysv,md:posix,huge,thp,md:*,mmap"

static void ep_error_cb(void *arg, ucp_ep_h ep, ucs_status_t status) {
    (void)ep;
    peer *p = arg;
    p->ucx_failed = true;
    net_log(p->net, "pd_net: UCX endpoint to %s failed: %s", p->addr, ucs_status_string(status));
}

/* ---- UCX completions -------------------------------------------------------------- */

static void write_failed(pd_net *n, room *rm) {
    n->stats.write_errors++;
    net_set_st(n, rm, PD_XFER_FAILED);
    xr_sender_done(&rm->h);
    net_stages_drop(n, rm);
    if (rm->note != N_ACK) {
        rm->note = net_peer_of(n, rm) ? N_ABORT : N_NONE;
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
        int8_t slot = ((req_ctx *)req)->data_slot;
        if (slot >= 0) rm->data_busy &= (uint8_t) ~(1u << slot); /* its header is ours again */
        if (((req_ctx *)req)->large) {
            PD_ASSERT(rm->large_out > 0 && n->large_out > 0);
            rm->large_out--;
            n->large_out--;
        }
        if (status != UCS_OK) write_failed(n, rm);
        net_mark_dirty(n, rm);
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
        net_mark_dirty(n, rm);
    }
    ucp_request_free(req);
}

static void req_track(pd_net *n, room *rm, void *req) {
    *(req_ctx *)req =
        (req_ctx){.net = n, .room = ridx(n, rm), .gen = rm->slot.gen, .data_slot = -1};
    n->ucx_out++;
}

/* A write of len bytes of the room that UCX did not complete at once (a put
 * or a data message: it reads the source until it completes): tracked, and
 * one over the inline limit counted as large (net.c, assist). */
static void write_track(pd_net *n, room *rm, void *req, size_t len) {
    req_track(n, rm, req);
    rm->puts_out++;
    if (len > FINAL_INLINE_BYTES) {
        ((req_ctx *)req)->large = true;
        rm->large_out++;
        n->large_out++;
    }
}

/* Posts one staged write. False on an immediate error. */
static bool post_put(pd_net *n, room *rm, peer *p, const stage *s) {
    uint32_t reg = s->reg;
    PD_ASSERT(reg < REG_N && p->rkey[reg]);
    size_t len = (size_t)s->n * n->unit[reg];
    const uint8_t *src = n->base[reg] + (size_t)s->src * n->unit[reg];
    uint64_t raddr = p->rbase[reg] + (uint64_t)s->dst * p->runit[reg];
    void *mapped = NULL;
    ucs_status_ptr_t sp = NULL;
    if (p->puts_direct && net_copy_parallel(n, len) &&
        ucp_rkey_ptr(p->rkey[reg], raddr, &mapped) == UCS_OK) {
        /* Complete on return, as UCX's own copy would be: no request. */
        if (net_copy(n, mapped, src, len) < len) n->stats.writes_copied_helped++;
        n->stats.writes_copied++;
    } else {
        ucp_request_param_t prm = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_MEMH,
            .cb.send = put_done,
            .memh = n->memh[reg],
        };
        sp = ucp_put_nbx(p->ep, src, len, raddr, p->rkey[reg], &prm);
    }
    if (UCS_PTR_IS_ERR(sp)) {
        net_log(n, "pd_net: put to %s failed: %s", p->addr, ucs_status_string(UCS_PTR_STATUS(sp)));
        return false;
    }
    if (sp != NULL) write_track(n, rm, sp, len);
    rm->need_flush = true;
    rm->bytes += len;
    n->stats.bytes_sent += len;
    n->stats.writes_posted++;
    return true;
}

/* Whether staged write s goes as data messages (version 5): to a peer whose
 * puts UCX emulates, of units that fit one message. */
static bool stage_as_data(const pd_net *n, const peer *p, const stage *s) {
    return n->data_msgs && p->ver >= 5 && !p->puts_direct && s->reg < REG_N &&
        n->unit[s->reg] <= BP_NOTICE_DATA_MAX;
}

/* How many of s's units the next data message carries: all that fit. */
static uint32_t data_msg_units(const pd_net *n, const stage *s) {
    return PD_MIN(s->n, (uint32_t)(BP_NOTICE_DATA_MAX / n->unit[s->reg]));
}

/* Posts the first k units of staged write s as one data message (version
 * 5): a data-bearing notice's header with one segment, named by position in
 * the room's destination, in a free header slot of the room, and the bytes
 * straight from the prefill's memory. Eager, as the notice: UCX copies the
 * bytes into the socket as it sends (a request reads the source until it
 * completes: a write, as a put). No flush follows: the decode copies the
 * bytes in itself, so nothing of it is acknowledged (over tcp an emulated
 * put's acknowledgement is what a dying peer left UCX unable to send:
 * docs/bootstrap-protocol.md, "A prefill that dies mid-room over tcp").
 * False on an immediate error. */
static bool post_data(pd_net *n, room *rm, peer *p, const stage *s, uint32_t k) {
    PD_ASSERT(rm->data_busy != (1u << DATA_MSGS_INFLIGHT) - 1u && k >= 1 && k <= s->n);
    uint32_t slot = (uint32_t)__builtin_ctz(~(unsigned)rm->data_busy);
    size_t len = (size_t)k * n->unit[s->reg];
    bp_notice nt = {.room = rm->slot.id, .bytes = len, .node_id = n->node_id, .n_segs = 1};
    nt.segs[0] = (bp_notice_seg){s->reg, s->reg == REG_KV ? s->pos : 0, k};
    size_t hlen = bp_notice_data_write(rm->data_wire[slot], &nt);
    PD_ASSERT(hlen == DATA_MSG_HEADER_BYTES);
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = put_done,
        .flags = UCP_AM_SEND_FLAG_EAGER,
    };
    const uint8_t *src = n->base[s->reg] + (size_t)s->src * n->unit[s->reg];
    ucs_status_ptr_t sp =
        ucp_am_send_nbx(p->ep, BP_AM_DATA, rm->data_wire[slot], hlen, src, len, &prm);
    if (UCS_PTR_IS_ERR(sp)) {
        net_log(n, "pd_net: data message to %s failed: %s", p->addr,
                ucs_status_string(UCS_PTR_STATUS(sp)));
        return false;
    }
    if (sp != NULL) {
        write_track(n, rm, sp, len);
        ((req_ctx *)sp)->data_slot = (int8_t)slot;
        rm->data_busy |= (uint8_t)(1u << slot);
    }
    rm->bytes += len;
    n->stats.bytes_sent += len;
    n->stats.data_messages++;
    return true;
}

/* Posts a flush of the room's endpoint: its completion is remote completion
 * of every put posted before it. */
static void post_flush(pd_net *n, room *rm, peer *p) {
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK,
        .cb.send = flush_done,
    };
    ucs_status_ptr_t sp = ucp_ep_flush_nbx(p->ep, &prm);
    rm->need_flush = false;
    p->flush_waits = sp != NULL && !UCS_PTR_IS_ERR(sp);
    if (UCS_PTR_IS_ERR(sp)) {
        write_failed(n, rm);
    } else if (sp != NULL) {
        req_track(n, rm, sp);
        rm->flush_out++;
    }
}

/* The completion notice (protocol version 3): an active message on the
 * endpoint that carried the room's puts, sent once every put completed
 * locally, behind a fence. UCX orders it after them (ucp_worker_fence: what
 * was posted before completes before what is posted after), so the decode
 * side handles it only once the room's bytes are in its memory: over shm the
 * puts were copies into its segment, over tcp they are earlier messages of
 * the same stream. No flush round trip and no TCP message on the room's
 * critical path. False on an immediate error. */
static bool send_notice(pd_net *n, room *rm, peer *p) {
    PD_ASSERT(rm->puts_out == 0 && rm->flush_out == 0);
    ucs_status_t st = ucp_worker_fence(n->worker);
    if (st != UCS_OK) return false;
    bp_notice_write(rm->notice_wire, rm->slot.id, rm->bytes, n->node_id);
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_FLAGS,
        .cb.send = put_done,
        .flags = UCP_AM_SEND_FLAG_EAGER,
    };
    ucs_status_ptr_t sp =
        ucp_am_send_nbx(p->ep, BP_AM_NOTICE, rm->notice_wire, BP_NOTICE_BYTES, NULL, 0, &prm);
    if (UCS_PTR_IS_ERR(sp)) {
        net_log(n, "pd_net: notice to %s failed: %s", p->addr,
                ucs_status_string(UCS_PTR_STATUS(sp)));
        return false;
    }
    if (sp != NULL) {
        req_track(n, rm, sp); /* counts as a write: the room is not drained before it left */
        rm->puts_out++;
    }
    return true;
}

/* The notice that carries the room's bytes (version 4): one active message
 * whose header names the segments (positions in the room's destination, see
 * bootstrap_proto.h) and whose data, gathered by UCX from the prefill's
 * pages (an iov), is their bytes. Sent eagerly: over tcp it is one send()
 * where three puts took three sends and three acknowledgements, and the
 * decode node copies the bytes into place itself, inside its handler, so it
 * writes only into a room that still owns its pages. No fence: no put of
 * the room was posted (send_final chose this path only then). False on an
 * immediate error. */
static bool send_notice_data(pd_net *n, room *rm, peer *p) {
    PD_ASSERT(rm->puts_out == 0 && rm->flush_out == 0 && rm->data_in_notice);
    PD_ASSERT(rm->notice_segs > 0 && rm->notice_segs <= BP_NOTICE_SEGS_MAX);
    size_t hlen = BP_NOTICE_DATA_FIXED + (size_t)BP_NOTICE_SEG_BYTES * rm->notice_segs;
    ucp_request_param_t prm = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_FLAGS |
            UCP_OP_ATTR_FIELD_DATATYPE,
        .cb.send = put_done,
        .flags = UCP_AM_SEND_FLAG_EAGER,
        .datatype = ucp_dt_make_iov(),
    };
    ucs_status_ptr_t sp = ucp_am_send_nbx(p->ep, BP_AM_NOTICE_DATA, rm->notice_wire, hlen,
                                          rm->notice_iov, rm->notice_segs, &prm);
    if (UCS_PTR_IS_ERR(sp)) {
        net_log(n, "pd_net: notice with data to %s failed: %s", p->addr,
                ucs_status_string(UCS_PTR_STATUS(sp)));
        return false;
    }
    if (sp != NULL) {
        req_track(n, rm, sp); /* reads the source pages until it completes: a write */
        rm->puts_out++;
    }
    n->stats.notices_with_data++;
    return true;
}

/* The room's staged writes, all of them up to its FINAL marker, become the
 * segments of its notice (mutex held): recorded in notice_wire and
 * notice_iov, the stages freed, the notice due. False, leaving the stages,
 * if their bytes exceed what the caller may post now (an assisted turn's
 * budget); the progress thread then sends it. */
static bool notice_take_stages(pd_net *n, room *rm) {
    PD_ASSERT(rm->data_in_notice && !rm->started && rm->bytes == 0);
    size_t total = 0;
    bp_notice nt = {.room = rm->slot.id, .node_id = n->node_id};
    for (uint32_t si = rm->q_head; si != PD_NONE && n->stages[si].reg != STAGE_FINAL;
         si = n->stages[si].next) {
        const stage *s = &n->stages[si];
        PD_ASSERT(nt.n_segs < BP_NOTICE_SEGS_MAX && s->reg < REG_N); /* send_final counted */
        size_t len = (size_t)s->n * n->unit[s->reg];
        nt.segs[nt.n_segs] = (bp_notice_seg){s->reg, s->reg == REG_KV ? s->pos : 0, s->n};
        rm->notice_iov[nt.n_segs++] =
            (ucp_dt_iov_t){n->base[s->reg] + (size_t)s->src * n->unit[s->reg], len};
        total += len;
    }
    if (total > n->post_budget) return false;
    if (n->post_budget != SIZE_MAX) n->post_budget -= total;
    nt.bytes = total;
    size_t hlen = bp_notice_data_write(rm->notice_wire, &nt);
    PD_ASSERT(hlen == BP_NOTICE_DATA_FIXED + (size_t)BP_NOTICE_SEG_BYTES * nt.n_segs);
    rm->notice_segs = nt.n_segs;
    net_stages_drop(n, rm);
    rm->started = true;
    rm->bytes = total;
    n->stats.bytes_sent += total;
    rm->note = N_DONE;
    return true;
}

/* A room's pending notice, once its writes allow (mutex held). N_DONE goes on
 * the data path without a flush; a flush follows it, off the critical path,
 * so that a later ABORT from the decode is answered (ACK) only when every
 * put has landed. ABORT and ACK are bootstrap messages and wait for the
 * flush: they must not overtake a put. False if the connection cannot take
 * a message now. */
static bool pump_notice(pd_net *n, room *rm, peer *p, uint32_t pi) {
    if (rm->need_flush && rm->note != N_DONE) post_flush(n, rm, p);
    if (rm->note == N_NONE || rm->puts_out != 0 || rm->flush_out != 0) return true;
    notice note = rm->note;
    rm->note = N_NONE;
    if (note == N_DONE) {
        if (!(rm->data_in_notice ? send_notice_data(n, rm, p) : send_notice(n, rm, p))) {
            write_failed(n, rm);
            return true;
        }
        xr_sender_done(&rm->h);
        net_set_st(n, rm, PD_XFER_SUCCESS);
        /* On the engine's thread (send_final inline, an assisted turn) a
         * flush that waits (tcp: one more send() on the room's critical
         * path) is left to the progress thread; one that completes at once
         * (shm) is not worth waking it for. */
        if (rm->need_flush && n->engine_turn && p->flush_waits) net_mark_dirty(n, rm);
        else if (rm->need_flush) post_flush(n, rm, p);
        return true;
    }
    bp_type t = note == N_ACK ? BP_ACK : BP_ABORT;
    return net_send_room_msg(n, pi, t, rm->slot.id, rm->note_value);
}

/* ---- the sender's pump (progress thread) --------------------------------------------- */

/* Takes the first k units of the room's head stage si for posting: the whole
 * stage off the queue, or, for a data message's share of a longer run, its
 * first k units, the rest staying at the head for the next message. */
static void stage_take(pd_net *n, room *rm, uint32_t si, uint32_t k) {
    stage *s = &n->stages[si];
    if (s->reg != STAGE_FINAL && k < s->n) {
        s->src += k, s->dst += k, s->pos += k, s->n -= k;
        return;
    }
    rm->q_head = s->next;
    if (rm->q_head == PD_NONE) rm->q_tail = PD_NONE;
    s->next = n->stage_free;
    n->stage_free = si;
    n->stages_avail++;
}

void net_pump_sender(pd_net *n, room *rm, uint64_t now) {
    PD_ASSERT(n->cfg.role == PD_NET_PREFILL && rm->slot.used);
    net_writes_sync(rm);
    peer *p = net_peer_of(n, rm);
    if (p && p->state == PS_READY && rm->dest.known) {
        uint32_t pi = rm->peer;
        if (rm->data_in_notice && rm->q_head != PD_NONE && xr_sendable(&rm->h) &&
            !notice_take_stages(n, rm))
            net_mark_dirty(n, rm); /* over an assisted turn's budget: the progress thread's */
        while (rm->q_head != PD_NONE && xr_sendable(&rm->h) && !rm->data_in_notice) {
            uint32_t si = rm->q_head;
            stage s = n->stages[si];
            /* Version 5, puts emulated: the stage in data messages of at most
             * BP_NOTICE_DATA_MAX bytes, DATA_MSGS_INFLIGHT at a time (the
             * next goes once one completed: put_done marks the room dirty). */
            bool as_data = s.reg != STAGE_FINAL && stage_as_data(n, p, &s);
            if (as_data && rm->data_busy == (1u << DATA_MSGS_INFLIGHT) - 1u) break;
            uint32_t k = as_data ? data_msg_units(n, &s) : s.n;
            /* An assisted turn posts small puts only: over shared memory a put
             * is a copy on the calling thread, the engine's. The rest waits
             * for the progress thread (the room stays dirty; it is woken). */
            size_t bytes = s.reg == STAGE_FINAL ? 0 : (size_t)k * n->unit[s.reg];
            if (bytes > n->post_budget) {
                net_mark_dirty(n, rm);
                break;
            }
            if (n->post_budget != SIZE_MAX) n->post_budget -= bytes; /* SIZE_MAX: no bound */
            if (s.reg != STAGE_FINAL && !rm->started) {
                rm->started = true;
                /* START only tells the decode side that data is moving
                 * (TRANSFERRING). A room whose last write is already staged
                 * gets its notice once its puts completed: one message fewer per
                 * room handed off in one piece. */
                if (!rm->final_staged && !net_send_room_msg(n, pi, BP_START, rm->slot.id, 0))
                    return;
            }
            stage_take(n, rm, si, k);
            if (s.reg == STAGE_FINAL) {
                if (rm->note == N_NONE) rm->note = N_DONE;
                continue;
            }
            if (!(as_data ? post_data(n, rm, p, &s, k) : post_put(n, rm, p, &s))) {
                write_failed(n, rm);
                break;
            }
        }
        /* The flush after the notice, left to the progress thread. */
        if (rm->h.done && rm->need_flush && rm->note == N_NONE) {
            if (n->engine_turn && p->flush_waits) net_mark_dirty(n, rm);
            else post_flush(n, rm, p);
        }
        if (rm->note != N_NONE && rm->due_ms <= now && !(n->faults[PD_NET_FAULT_HOLD_NOTICES])) {
            if (!pump_notice(n, rm, p, pi)) return;
        } else if (rm->note != N_NONE && rm->due_ms > now) {
            net_due_at(n, rm, rm->due_ms);
        }
    } else if (!p && rm->note != N_NONE) {
        rm->note = N_NONE; /* the connection is gone: nobody to tell */
    }
    if (!p) rm->need_flush = false; /* nothing left to flush through */
    net_room_try_release(n, rm);
}

/* An endpoint to the decode node's worker, in peer-failure mode where the
 * transports allow it, else in mode PD_NONE. Once peer mode has failed, or if
 * the transports are shared-memory only (ucx_init), PD_NONE is asked at once. */
/* UCX packs a worker address behind a one-byte header whose low four bits
 * are the address format's version; ucp_ep_create aborts the process on a
 * version it does not know (UCX 1.13: "addr version 15" for a 0xff byte).
 * So an address whose version is not the one this build packs never reaches
 * UCX. NULL if acceptable, else why not. This screens out garbage and other
 * builds; it is no parser: a forged address with the right header still
 * reaches UCX, which is why only a peer that proved it holds the token
 * should get this far (docs/bootstrap-protocol.md, "Trust"). */
const char *net_worker_addr_problem(const pd_net *n, const uint8_t *addr, size_t len) {
    PD_ASSERT(n->waddr && n->waddr_len > 0);
    if (len == 0) return "empty UCX worker address";
    if (len > BP_WORKER_ADDR_MAX) return "UCX worker address too long";
    uint8_t ours = *(const uint8_t *)n->waddr;
    if ((addr[0] & 0x0F) != (ours & 0x0F))
        return "UCX worker address of another format version (another UCX build?)";
    return NULL;
}

/* Whether UCX puts on ep are a transport's own (shared memory: one copy into
 * the peer's segment; RDMA) rather than emulated with active messages (tcp).
 * UCX has no query for it; its endpoint report lists a "put[lane]" protocol
 * line only for transport-level puts, so the report is printed into memory
 * and searched, as net_ucx_config_value does for a setting. */
static bool ep_puts_direct(ucp_ep_h ep) {
    char *text = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&text, &len);
    if (!mem) return true; /* unknown: puts, the path every transport has */
    ucp_ep_print_info(ep, mem);
    bool direct = fclose(mem) != 0 || !text || strstr(text, " put[") != NULL;
    free(text);
    return direct;
}

ucs_status_t net_peer_ep_create(pd_net *n, peer *p, const bp_hello *h) {
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
    else p->puts_direct = ep_puts_direct(p->ep);
    return st;
}

/* Records the decode node's regions and unpacks their remote keys; false if
 * a key does not unpack. */
bool net_peer_regions_set(peer *p, const bp_hello *h) {
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

/* ---- writes to a dead peer --------------------------------------------------------------- */

/* Without peer-failure mode (UCX 1.13 shared memory) a forced close may leave
 * requests to a dead peer pending forever. They can only move if the dead
 * peer's side consumes them, which it no longer does; after the drain grace
 * the room stops waiting for them (and ignores them should they complete). */
void net_abandon_dead_writes(pd_net *n, uint64_t now) {
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
        PD_ASSERT(n->large_out >= rm->large_out);
        n->large_out -= rm->large_out;
        rm->puts_out = rm->flush_out = rm->large_out = 0;
        rm->data_busy = 0;
        rm->slot.gen++;
        net_mark_dirty(n, rm);
    }
    n->abandon_pending = still;
}

unsigned net_ucx_progress(pd_net *n, int burst) {
    if (n->faults[PD_NET_FAULT_HOLD_DATA]) return 0;
    unsigned events = 0, calls = 0;
    for (int i = 0; i < burst; i++) {
        unsigned k = ucp_worker_progress(n->worker);
        calls++;
        if (!k) break;
        events += k;
    }
    if (events) n->last_event_ns = now_ns();
    return calls;
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
pd_err net_ucx_config_make(const pd_net_config *cfg, ucp_config_t **out, char *msg, size_t cap) {
    ucp_config_t *uc = NULL;
    ucs_status_t st = ucp_config_read(NULL, NULL, &uc);
    if (st != UCS_OK)
        return pd_errorf(msg, cap, PD_ERR_IO, "UCX config: %s", ucs_status_string(st));
    const char *tls = cfg->ucx_tls, *devices = cfg->ucx_net_devices;
    if (tls && (st = ucp_config_modify(uc, "TLS", tls)) != UCS_OK) {
        ucp_config_release(uc);
        return pd_errorf(msg, cap, PD_ERR_INVALID, "UCX TLS '%s': %s", tls, ucs_status_string(st));
    }
    if ((st = ucp_config_modify(uc, "ALLOC_PRIO", OWN_ALLOC_PRIO)) != UCS_OK) {
        ucp_config_release(uc);
        return pd_errorf(msg, cap, PD_ERR_IO, "UCX ALLOC_PRIO: %s", ucs_status_string(st));
    }
    if (devices && (st = ucp_config_modify(uc, "NET_DEVICES", devices)) != UCS_OK) {
        ucp_config_release(uc);
        return pd_errorf(msg, cap, PD_ERR_INVALID, "UCX NET_DEVICES '%s': %s", devices,
                         ucs_status_string(st));
    }
    /* Over tcp UCX emulates a put with messages of at most TCP_TX_SEG_SIZE
     * (8K by default), each its own send() and, on the decode side, its own
     * acknowledgement: a one-page room's KV page, Mamba slot and metadata
     * row took six sends. Segments as large as the receiver's (64K) make
     * them three: 94 -> 68 us per one-page room (bench/xfer, tiny model). A
     * hint: a UCX without that setting keeps its default. Not where only
     * shared-memory transports are allowed: no interface would take it, and
     * UCX warns "invalid configuration" at each worker's creation. */
    char tls_now[256];
    net_ucx_config_value(uc, "UCX_TLS=", tls_now, sizeof(tls_now));
    if (!tls_shm_only(tls_now)) {
        /* Receiving up to 256K costs one larger buffer per connection and
         * lets a peer send large segments (ucx_tcp_large_segments); UCX
         * refuses a send segment larger than its own receive segment. */
        (void)ucp_config_modify(uc, "RX_SEG_SIZE", TCP_RX_SEG);
        const char *tx = cfg->ucx_tcp_large_segments ? TCP_TX_SEG_LARGE : TCP_TX_SEG;
        (void)ucp_config_modify(uc, "TX_SEG_SIZE", tx);
    }
    /* UCX's adaptive progress leaves an interface that none of this
     * worker's endpoints sends on deactivated: the decode's shared-memory
     * interface, which only receives. UCX keeps it armed, so the sender of
     * each message to it (the completion notice's ucp_am_send_nbx) signals
     * it with a sendto() on a Unix socket, UCX's async thread wakes up and
     * writes the worker's event fd, and the next progress re-arms it: 8 of
     * a one-page room's 24 us over shm. With every interface active nothing
     * is armed unless our progress thread sleeps on the worker (a room in
     * 13.5 us, bench/xfer). Set whatever the environment says, like the
     * segment above: a library does not read the environment. */
    (void)ucp_config_modify(uc, "ADAPTIVE_PROGRESS", "n");
    /* No UCX keepalive: the bootstrap connection's heartbeats already tell
     * a dead peer (dead_after_ms), and UCX 1.13's keepalive can abort this
     * process when a peer leaves. A keepalive round starts at once on a new
     * endpoint, so a decode sends an EP_CHECK to the prefill right after
     * connecting. If the prefill has closed its endpoint before it reads
     * that message (the decode's bootstrap connection closed: the decode
     * is going away), UCX opens a new connection back to the decode to
     * answer "endpoint removed"; the decode's listener is gone by then, the
     * connection is refused, and UCX's tcp transport fails its assertion
     * tcp_ep.c:478 (`!(ep->flags & UCT_TCP_EP_FLAG_CTX_TYPE_TX)`). Seen as
     * test_net_tcp aborting in CI. A pair that hands off one room and goes,
     * beside two busy threads: 6 aborts in 1,861 runs, none in 9,411
     * without keepalive (docs/bootstrap-protocol.md, "No UCX keepalive"). */
    (void)ucp_config_modify(uc, "KEEPALIVE_INTERVAL", "inf");
    *out = uc;
    return PD_OK;
}

/* One setting of a UCX configuration as UCX prints it, key with its prefix
 * and "=" ("UCX_TLS="): UCX has no getter for a single setting, so the
 * configuration is printed into memory and the key's line copied to out
 * ("" if that fails or there is none). */
void net_ucx_config_value(const ucp_config_t *uc, const char *key, char *out, size_t cap) {
    size_t klen = strlen(key);
    out[0] = '\0';
    char *text = NULL;
    size_t len = 0;
    FILE *mem = open_memstream(&text, &len);
    if (!mem) return;
    ucp_config_print(uc, mem, NULL, UCS_CONFIG_PRINT_CONFIG);
    if (fclose(mem) == 0 && text) {
        const char *at = text;
        while (at && strncmp(at, key, klen) != 0) {
            at = strchr(at, '\n');
            if (at) at++;
        }
        if (at) {
            at += klen;
            snprintf(out, cap, "%.*s", (int)strcspn(at, "\n"), at);
        }
    }
    free(text);
}

/* Decode side: a prefill's completion notice (send_notice), handled inside
 * ucp_worker_progress on the progress thread, which holds the mutex. UCX
 * runs it only after every earlier message of the endpoint, emulated puts
 * included. Anything malformed is dropped: only an endpoint created from
 * our worker address, that is by a peer that proved the token, reaches it. */
static ucs_status_t on_notice_am(void *arg, const void *header, size_t header_len, void *data,
                                 size_t len, const ucp_am_recv_param_t *prm) {
    (void)data;
    (void)prm;
    pd_net *n = arg;
    uint64_t room_id, bytes, node_id;
    if (len != 0 || bp_notice_read(header, header_len, &room_id, &bytes, &node_id) != PD_OK) {
        n->stats.bad_messages++;
        return UCS_OK;
    }
    net_on_notice(n, room_id, bytes, node_id);
    return UCS_OK;
}

/* Decode side: a message that carries room bytes, handled like the plain
 * notice: the notice with data (version 4, final) or a data message
 * (version 5, part of the room's bytes: the plain notice follows it on the
 * same endpoint). The data is UCX's, valid during this call: it is copied
 * into the room's pages here (net_on_room_bytes checks the segments against
 * the room's destination first). Data that came by rendezvous (a peer that
 * did not send it eagerly) is not read: that room fails. A header that does
 * not parse names no room we can trust: dropped and counted. */
static ucs_status_t on_bytes_am(pd_net *n, const void *header, size_t header_len, void *data,
                                size_t len, const ucp_am_recv_param_t *prm, bool final) {
    bp_notice nt;
    if (bp_notice_data_read(header, header_len, &nt) != PD_OK) {
        n->stats.bad_messages++;
        net_log(n, "pd_net: dropped a %s whose header of %zu bytes is malformed",
                final ? "notice with data" : "data message", header_len);
        return UCS_OK;
    }
    bool inline_data = !(prm->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV);
    net_on_room_bytes(n, &nt, inline_data ? data : NULL, len, final);
    return UCS_OK;
}

static ucs_status_t on_notice_data_am(void *arg, const void *header, size_t header_len, void *data,
                                      size_t len, const ucp_am_recv_param_t *prm) {
    return on_bytes_am(arg, header, header_len, data, len, prm, true);
}

static ucs_status_t on_data_am(void *arg, const void *header, size_t header_len, void *data,
                               size_t len, const ucp_am_recv_param_t *prm) {
    return on_bytes_am(arg, header, header_len, data, len, prm, false);
}

static ucs_status_t notice_handler_set(pd_net *n, unsigned id, ucp_am_recv_callback_t cb) {
    ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
            UCP_AM_HANDLER_PARAM_FIELD_ARG,
        .id = id,
        .cb = cb,
        .arg = n,
    };
    return ucp_worker_set_am_recv_handler(n->worker, &hp);
}

pd_err net_ucx_init(pd_net *n, char *msg, size_t cap) {
    ucp_config_t *uc = NULL;
    pd_err err = net_ucx_config_make(&n->cfg, &uc, msg, cap);
    if (err) return err;
    /* The transport list as UCX_TLS syntax ("all" when nothing restricts
     * it): ucx_tls if this node set one, else UCX_TLS as UCX read it. */
    char tls[256];
    net_ucx_config_value(uc, "UCX_TLS=", tls, sizeof(tls));
    n->no_peer_mode = tls_shm_only(tls);
    ucp_params_t prm = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME |
            UCP_PARAM_FIELD_REQUEST_SIZE,
        .features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
        .request_size = sizeof(req_ctx),
        .name = n->cfg.role == PD_NET_PREFILL ? "pdserve-prefill" : "pdserve-decode",
    };
    ucs_status_t st = ucp_init(&prm, uc, &n->ctx);
    ucp_config_release(uc);
    if (st != UCS_OK) {
        n->ctx = NULL;
        return pd_errorf(msg, cap, PD_ERR_IO, "UCX init: %s", ucs_status_string(st));
    }
    /* Serialized, not single: the progress thread drives the worker, and a
     * small room's final send posts from the engine's thread (net.c,
     * final_inline); the mutex keeps the two apart. */
    ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                              .thread_mode = UCS_THREAD_MODE_SERIALIZED};
    if ((st = ucp_worker_create(n->ctx, &wp, &n->worker)) != UCS_OK) {
        n->worker = NULL;
        return pd_errorf(msg, cap, PD_ERR_IO, "UCX worker: %s", ucs_status_string(st));
    }
    if (n->cfg.role == PD_NET_DECODE &&
        ((st = notice_handler_set(n, BP_AM_NOTICE, on_notice_am)) != UCS_OK ||
         (n->proto >= 4 &&
          (st = notice_handler_set(n, BP_AM_NOTICE_DATA, on_notice_data_am)) != UCS_OK) ||
         (n->proto >= 5 && (st = notice_handler_set(n, BP_AM_DATA, on_data_am)) != UCS_OK)))
        return pd_errorf(msg, cap, PD_ERR_IO, "UCX notice handler: %s", ucs_status_string(st));
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

/* ---- memory the transport allocates (pd_net_allocator) ------------------------------ */

/* UCX allocates with UCP_MEM_MAP_ALLOCATE, trying OWN_ALLOC_PRIO in order:
 * a System V or POSIX shared segment first (a shared-memory peer attaches it
 * through the rkey, so a put is one memcpy into it; RDMA registers the same
 * pages), then huge pages and plain mmap. UCX's own default ends with
 * "heap", which is left out: every method here hands out fresh pages the
 * kernel zeroed, which is what the executor's contract (zeroed memory)
 * needs, without touching gigabytes of KV at start-up. */

static void *own_alloc(void *self, size_t bytes) {
    pd_net *n = self;
    PD_ASSERT(n && n->ctx);
    if (bytes == 0) return NULL;
    net_lock(n);
    own_mem *m = NULL;
    for (int i = 0; i < OWN_MAX && !m; i++)
        if (!n->own[i].memh) m = &n->own[i];
    ucp_mem_h memh = NULL;
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
            UCP_MEM_MAP_PARAM_FIELD_FLAGS,
        .address = NULL,
        .length = bytes,
        .flags = UCP_MEM_MAP_ALLOCATE,
    };
    ucp_mem_attr_t at = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH};
    if (m && ucp_mem_map(n->ctx, &mp, &memh) == UCS_OK) {
        if (ucp_mem_query(memh, &at) == UCS_OK && at.address && at.length >= bytes) {
            *m = (own_mem){.addr = at.address, .len = at.length, .memh = memh};
        } else {
            ucp_mem_unmap(n->ctx, memh);
            m = NULL;
        }
    } else {
        m = NULL;
    }
    net_unlock(n);
    return m ? m->addr : NULL;
}

/* The owner is done with p. Unmapped now unless it is registered (a put may
 * still read it, a peer may still write it): then at pd_net_destroy, after
 * the progress thread has stopped and the endpoints are closed. */
static void own_free(void *self, void *p) {
    pd_net *n = self;
    if (!p) return;
    net_lock(n);
    own_mem *m = NULL;
    for (int i = 0; i < OWN_MAX && !m; i++)
        if (n->own[i].memh && n->own[i].addr == p) m = &n->own[i];
    PD_ASSERT(m != NULL && !m->released); /* freeing what this transport never gave */
    bool registered = false;
    for (int r = 0; r < REG_N; r++) registered |= n->memh_own[r] && n->memh[r] == m->memh;
    m->released = true;
    if (!registered) {
        ucp_mem_unmap(n->ctx, m->memh);
        *m = (own_mem){0};
    }
    net_unlock(n);
}

pd_exec_alloc pd_net_allocator(pd_net *n) {
    PD_ASSERT(n != NULL);
    return (pd_exec_alloc){.alloc = own_alloc, .free = own_free, .self = n};
}

void net_own_release_all(pd_net *n) {
    for (int i = 0; i < OWN_MAX; i++) {
        own_mem *m = &n->own[i];
        if (!m->memh) continue;
        /* An owner that outlives its transport would keep a dangling pointer. */
        PD_ASSERT(m->released);
        ucp_mem_unmap(n->ctx, m->memh);
        *m = (own_mem){0};
    }
}

/* Region r's memory handle: the one of the transport's own allocation that
 * holds it, else a registration of the caller's memory (heap memory: UCX
 * can register it, but a shared-memory put into it is emulated with active
 * messages through bounce buffers). */
static pd_err region_map(pd_net *n, int r, char *msg, size_t cap) {
    const uint8_t *lo = n->base[r];
    size_t len = n->unit[r] * n->units[r];
    for (int i = 0; i < OWN_MAX; i++) {
        own_mem *m = &n->own[i];
        if (m->memh && !m->released && lo >= m->addr && lo + len <= m->addr + m->len) {
            n->memh[r] = m->memh;
            n->memh_own[r] = true;
            n->stats.regions_own_memory++;
            return PD_OK;
        }
    }
    ucp_mem_map_params_t mp = {
        .field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
        .address = n->base[r],
        .length = len,
    };
    ucs_status_t st = ucp_mem_map(n->ctx, &mp, &n->memh[r]);
    if (st != UCS_OK) {
        n->memh[r] = NULL;
        return pd_errorf(msg, cap, PD_ERR_IO, "UCX memory registration: %s", ucs_status_string(st));
    }
    return PD_OK;
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
        pd_err err = region_map(n, r, msg, msg_cap);
        if (err) return err;
        ucs_status_t st = ucp_rkey_pack(n->ctx, n->memh[r], &n->rkey_buf[r], &n->rkey_len[r]);
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

/* UCX 1.13 aborts the process in ucp_worker_destroy when a wire-up message
 * is still queued on an endpoint UCX created itself (seen over TCP when the
 * peer's endpoint was created moments before the shutdown). Let the worker
 * finish what it started — a worker flush waits for that — within budget_ms. */
void net_ucx_settle(pd_net *n, uint64_t budget_ms) {
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
