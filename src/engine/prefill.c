/*
 * prefill.c — the prefill node's scheduler (DESIGN.md section 4).
 *
 *   submit -> BOOTSTRAP -ok-> WAITING -> [LOADING] -> PREFILL (chunks) -> TRANSFER -> done
 *                 |  optimistic: WAITING before bootstrap   \-> PARKED (final chunk done,
 *                 \-fail-> retire(failed 500)                           bootstrap pending)
 *
 * One step: poll every room (bootstrap completion, failures, timeouts,
 * transfer outcomes), poll host loads, launch the next batch, then process
 * the oldest batch's result. With overlap on, batch N+1 is launched before
 * batch N's result is processed, so a request can have two chunks in flight.
 *
 * Admission reserves pages for the whole remaining prompt (free + evictable
 * minus earlier reservations must cover it), so an admitted request can
 * always finish its chunks: no deadlock between half-prefilled requests.
 *
 * Sending. Pages go to the decode node as soon as they are cache-owned
 * (middle chunks: inserted, under the request's lock), so a page that was
 * posted is never swapped for a duplicate and freed while the transport may
 * still read it. The partial last page, the Mamba state and the metadata row
 * go in the final send. Without a prefix cache, computed whole pages go.
 */
#include <stdio.h>
#include <string.h>

#include "engine_internal.h"

static void fail(pd_engine *e, req *r, const char *msg) {
    eng_retire(e, r, PD_TERM_FAILED, PD_FINISH_NONE, 500, msg);
}

/* Middle sends: cache-owned whole pages not yet posted. */
static bool send_ready(pd_engine *e, req *r) {
    if (!r->bootstrapped || !r->holds_room) return true;
    uint32_t ps = e->cfg.page_size;
    uint32_t limit = e->cache ? r->own_from : r->done / ps;
    limit = PD_MIN(limit, r->n_pages);
    uint32_t from = PD_MAX(r->sent_pages, r->peer_cached / ps);
    if (limit <= from) return true;
    eng_act(e, r, PD_ACT_SEND_PAGES, false, limit - from);
    pd_err err = e->xfer.vt->send_pages(e->xfer.self, r->room, from, r->pages + from, limit - from);
    if (err != PD_OK) {
        fail(e, r, "transfer: posting pages failed");
        return false;
    }
    r->xfer_bytes += (uint64_t)(limit - from) * e->xfer_page_bytes;
    if (!r->t_xfer_first) r->t_xfer_first = e->now;
    r->sent_pages = limit;
    return true;
}

/* The last send: the remaining pages (the partial tail included), the Mamba
 * state and the metadata row. */
static void send_final(pd_engine *e, req *r) {
    uint32_t ps = e->cfg.page_size;
    uint32_t total = PD_DIV_CEIL(r->prompt_len, ps);
    uint32_t from = PD_MAX(r->sent_pages, r->peer_cached / ps);
    PD_ASSERT(r->n_pages >= total && r->holds_meta);
    eng_act(e, r, PD_ACT_SEND_FINAL, true, total > from ? total - from : 0);
    pd_err err = e->xfer.vt->send_final(e->xfer.self, r->room, from, r->pages + from,
                                        total > from ? total - from : 0,
                                        e->mamba ? r->mamba_run : PD_POOL_NONE, r->meta_row);
    if (err != PD_OK) {
        fail(e, r, "transfer: posting the final send failed");
        return;
    }
    r->xfer_bytes +=
        (uint64_t)(total > from ? total - from : 0) * e->xfer_page_bytes + e->xfer_state_bytes;
    r->t_xfer_start = e->now;
    if (!r->t_xfer_first) r->t_xfer_first = e->now;
    r->sent_pages = total;
    q_move(e, r, Q_TRANSFER);
}

/* Learns bootstrap completion and failures of the request's room. Returns
 * false if the request was retired. */
static bool room_check(pd_engine *e, req *r) {
    if (!r->holds_room) return true;
    pd_xfer_status st = eng_room_status(e, r);
    if (st == PD_XFER_FAILED) {
        fail(e, r, r->bootstrapped ? "transfer failed: the room failed on the decode side"
                                   : "bootstrap failed");
        return false;
    }
    if (!r->bootstrapped) {
        if (st == PD_XFER_WAITING_FOR_INPUT || st == PD_XFER_TRANSFERRING) {
            uint32_t cached = e->xfer.vt->sender_peer_cached(e->xfer.self, r->room);
            if (cached > r->prompt_len || cached % e->cfg.page_size != 0) {
                fail(e, r, "bootstrap: the decode node reported an invalid cached prefix");
                return false;
            }
            r->bootstrapped = true;
            r->peer_cached = cached;
            if (r->queue == Q_PREFILL && !send_ready(e, r)) return false;
        } else if (e->cfg.bootstrap_timeout_us &&
                   e->now - r->t_submit > e->cfg.bootstrap_timeout_us) {
            char msg[96];
            snprintf(msg, sizeof(msg), "bootstrap timed out after %llu us",
                     (unsigned long long)(e->now - r->t_submit));
            fail(e, r, msg);
            return false;
        }
    }
    return true;
}

static void poll_bootstrap_queue(pd_engine *e) {
    uint32_t idx = e->q[Q_BOOTSTRAP].head;
    while (idx != PD_NONE) {
        req *r = eng_req(e, idx);
        idx = r->qlink.next;
        eng_prefetch_walk(e, idx);
        if (!r->holds_meta) {
            if (pd_pool_free_count(e->meta) == 0) {
                uint64_t timeout_us = e->cfg.bootstrap_timeout_us;
                if (timeout_us && e->now - r->t_submit > timeout_us)
                    fail(e, r, "bootstrap timed out waiting for a metadata row");
                continue;
            }
            PD_MUST(eng_alloc_slot(e, e->meta_id, r->owner, &r->meta_row));
            r->holds_meta = true;
        }
        if (!r->holds_room) {
            if (e->xfer.vt->sender_open(e->xfer.self, r->room) != PD_OK) {
                fail(e, r, "bootstrap: the transport could not open the room");
                continue;
            }
            r->holds_room = r->opened_room = true;
            eng_room_watch(e, r);
            eng_act(e, r, PD_ACT_ROOM_OPEN, false, 0);
        }
        if (!room_check(e, r)) continue;
        if (r->bootstrapped || r->attempts < e->cfg.optimistic_attempts) q_move(e, r, Q_WAITING);
    }
}

static void poll_rooms(pd_engine *e) {
    static const uint8_t queues[] = {Q_WAITING, Q_LOADING, Q_PREFILL, Q_PARKED};
    for (size_t k = 0; k < sizeof(queues); k++) {
        uint32_t idx = e->q[queues[k]].head;
        while (idx != PD_NONE) {
            req *r = eng_req(e, idx);
            idx = r->qlink.next;
            eng_prefetch_walk(e, idx);
            if (!room_check(e, r)) continue;
            if (r->queue == Q_PARKED && r->bootstrapped) send_final(e, r);
        }
    }
    uint32_t idx = e->q[Q_TRANSFER].head;
    while (idx != PD_NONE) {
        req *r = eng_req(e, idx);
        idx = r->qlink.next;
        eng_prefetch_walk(e, idx);
        pd_xfer_status st = eng_room_status(e, r);
        if (st == PD_XFER_SUCCESS) {
            r->t_xfer_done = e->now;
            eng_retire(e, r, PD_TERM_FINISHED, PD_FINISH_TRANSFERRED, 200, "");
        } else if (st == PD_XFER_FAILED) {
            fail(e, r, "transfer failed");
        } else if (e->cfg.transfer_timeout_us && e->now - r->t_state > e->cfg.transfer_timeout_us) {
            fail(e, r, "transfer timed out");
        }
    }
}

static void poll_loads(pd_engine *e) {
    uint32_t idx = e->q[Q_LOADING].head;
    while (idx != PD_NONE) {
        req *r = eng_req(e, idx);
        idx = r->qlink.next;
        if (!e->exec.vt->load_poll(e->exec.self, r->load_id)) continue;
        PD_MUST(pd_cache_load_done(e->cache, r->ticket));
        r->holds_host = false;
        r->ticket = PD_TICKET_NONE;
        r->own_from = r->n_pages; /* the loaded pages are the cache's now */
        uint32_t tokens = r->n_pages * e->cfg.page_size;
        e->ctr.cached_tokens += tokens - r->cached_tokens;
        r->cached_tokens = r->launched = r->done = tokens;
        q_move(e, r, Q_PREFILL);
    }
}

/* The cached prefix r can use, its node locked for r (none without a
 * cache): *use tokens on device (with Mamba layers, up to the deepest
 * snapshot, *snap_slot), or, from the host tier, *load tokens to bring back. */
static pd_cnode match_prefix(pd_engine *e, req *r, uint32_t *use, uint32_t *load,
                             uint32_t *snap_slot) {
    pd_cnode node = PD_CNODE_NONE;
    *use = *load = 0;
    *snap_slot = PD_NONE;
    if (!e->cache) return node;
    pd_cache_match_result m;
    /* Leave at least the last token to compute: it yields the first output. */
    PD_MUST(pd_cache_match(e->cache, r->prompt, r->prompt_len - 1, r->pages,
                           e->pages_per_req, &m));
    if (e->mamba) {
        *use = m.mamba_tokens;
        node = m.mamba_node;
        *snap_slot = m.mamba_slot;
    } else {
        *use = m.dev_tokens;
        node = m.dev_node;
        if (e->host && m.host_tokens > 0) {
            *load = m.host_tokens;
            node = m.host_node;
        }
    }
    eng_cache_lock(e, r, node);
    return node;
}

/* Starts loading the host-only part of the prefix (load tokens, below node)
 * into pages of r's reservation. False if the cache has no room for the
 * load: that part is then recomputed. */
static bool start_load(pd_engine *e, req *r, pd_cnode node, uint32_t load) {
    uint32_t n = 0;
    pd_cache_ticket t;
    pd_err err = pd_cache_load_begin(e->cache, node, r->owner, r->pages + r->n_pages,
                                     e->scratch, e->pages_per_req - r->n_pages, &n, &t);
    if (err != PD_OK) return false;
    PD_ASSERT(n * e->cfg.page_size == load && r->reserved >= n);
    r->load_from = r->n_pages;
    r->load_pages = n;
    r->n_pages += n;
    r->reserved -= n;
    e->reserved -= n;
    r->ticket = t;
    r->holds_host = r->holds_kv = true;
    r->load_id = ++e->next_load_id;
    PD_MUST(e->exec.vt->load_begin(e->exec.self, r->load_id, r->pages + r->load_from,
                                   e->scratch, n));
    return true;
}

/* Admission: row, Mamba running slot, the matched prefix (locked), and a
 * reservation of pages for the rest. 0: not now; 1: ready; 2: loading. */
static int admit(pd_engine *e, req *r) {
    uint32_t ps = e->cfg.page_size;
    if (pd_pool_free_count(e->row) == 0) return 0;
    if (e->mamba && pd_pool_free_count(e->mamba) == 0) {
        if (!e->cache) return 0;
        PD_MUST(pd_cache_evict_snapshots(e->cache, 1, NULL));
        if (pd_pool_free_count(e->mamba) == 0) return 0;
    }
    uint32_t use, load, snap_slot;
    pd_cnode node = match_prefix(e, r, &use, &load, &snap_slot);
    /* Colocated: the pages of every token the request may generate too (the
     * last sampled token is never fed back). */
    uint32_t positions =
        e->cfg.role == PD_ROLE_COLOCATED ? r->prompt_len + r->max_new - 1 : r->prompt_len;
    uint32_t need = PD_DIV_CEIL(positions, ps) - use / ps;
    if (!eng_reserve_pages(e, r, need)) return 0;
    PD_MUST(eng_alloc_slot(e, e->row_id, r->owner, &r->row));
    r->holds_row = true;
    if (e->mamba) {
        PD_MUST(eng_alloc_slot(e, e->mamba_id, r->owner, &r->mamba_run));
        r->holds_mamba = true;
        if (use > 0) {
            /* Resume from the cached snapshot: copy it into the running slot.
             * The copy is synchronous, so nothing can evict the snapshot
             * during it: the snapshot's lock and unlock around it are only
             * their effect on recency (pd_cache_mamba_touch). The request now
             * holds a Mamba slot before any KV page of its own. */
            PD_MUST(pd_cache_mamba_touch(e->cache, node));
            PD_MUST(e->exec.vt->copy_state(e->exec.self, r->mamba_run, snap_slot));
        }
    }
    r->n_pages = r->own_from = use / ps;
    r->cached_tokens = r->launched = r->done = use;
    e->ctr.cached_tokens += use;
    r->t_admit = e->now; /* an optimistic retry's admission replaces the first */
    if (load > 0 && start_load(e, r, node, load)) {
        q_move(e, r, Q_LOADING);
        return 2;
    }
    q_move(e, r, Q_PREFILL);
    return 1;
}

static void requeue(pd_engine *e, req *r) {
    eng_act(e, r, PD_ACT_REQUEUE, false, r->attempts + 1);
    r->attempts++;
    e->ctr.requeued++;
    eng_release_for_requeue(e, r);
    q_move(e, r, r->attempts < e->cfg.optimistic_attempts ? Q_WAITING : Q_BOOTSTRAP);
}

/* Adds r's next chunk to the batch. Returns tokens scheduled (0: none). */
static uint32_t add_chunk(pd_engine *e, batch_rec *b, req *r, uint32_t budget) {
    uint32_t ps = e->cfg.page_size;
    uint32_t n = PD_MIN(PD_MIN(budget, e->cfg.chunk_tokens), r->prompt_len - r->launched);
    if (n == 0) return 0;
    uint32_t end = r->launched + n;
    /* A hybrid model can only reuse a prefix that ends with a snapshot, and
     * snapshots are taken at chunk ends: end the last full page's chunk there
     * so the whole prompt (but its partial last page) can be cached. */
    uint32_t last_page_end = (r->prompt_len / ps) * ps;
    if (e->tracks > 0 && end == r->prompt_len && end != last_page_end &&
        last_page_end > r->launched) {
        end = last_page_end;
        n = end - r->launched;
    }
    uint32_t need = PD_DIV_CEIL(end, ps) > r->n_pages ? PD_DIV_CEIL(end, ps) - r->n_pages : 0;
    eng_alloc_pages(e, r, need);
    uint32_t snap = PD_NONE;
    if (e->tracks > 0 && end % ps == 0) {
        uint32_t t = r->track_next % e->tracks;
        if (r->mamba_track[t] == PD_NONE &&
            eng_alloc_slot(e, e->mamba_id, r->owner, &r->mamba_track[t]) != PD_OK)
            r->mamba_track[t] = PD_NONE;
        if (r->mamba_track[t] != PD_NONE) {
            snap = r->mamba_track[t];
            r->track_next++;
        }
    }
    bool final = end == r->prompt_len;
    if (final) r->final_snap = snap;
    eng_batch_add(e, b, r, r->prompt + r->launched, r->launched, n, final, 0, snap, final, false);
    r->launched = end;
    e->ctr.prefill_tokens += n;
    return n;
}

/* Admission runs ahead of the batch: a request is admitted (memory reserved,
 * prefix locked, snapshot copied) when rows allow, and gets its first chunk
 * when the token budget reaches it. At most batch_max admitted requests wait
 * for their first chunk, so admission never hoards the pools. */
static void admit_waiting(pd_engine *e) {
    uint32_t unstarted = 0;
    for (uint32_t idx = e->q[Q_PREFILL].head; idx != PD_NONE; idx = eng_req(e, idx)->qlink.next) {
        req *r = eng_req(e, idx);
        unstarted += r->launched == r->cached_tokens;
    }
    while (unstarted < e->cfg.batch_max && e->q[Q_WAITING].head != PD_NONE) {
        req *r = eng_req(e, e->q[Q_WAITING].head);
        /* The next one's match: its likely child index slot, guessed at
         * submit (decode.c, decode_step, does the same for its admissions). */
        uint32_t next = r->qlink.next;
        if (next != PD_NONE) pd_cache_guess_prefetch(e->cache, eng_req(e, next)->guess);
        int got = admit(e, r);
        if (got == 0) break; /* first come, first served: no overtaking */
        unstarted += got == 1;
    }
}

static void schedule(pd_engine *e) {
    uint32_t depth = e->cfg.overlap ? 2 : 1;
    if (e->inflight_n >= depth) return;
    batch_rec *b = eng_batch_begin(e);
    if (!b) return;
    /* Colocated: running requests' next tokens go first (mixed batches). */
    if (e->cfg.role == PD_ROLE_COLOCATED) decode_add_items(e, b);
    uint32_t budget = e->cfg.chunk_tokens;
    uint32_t idx = e->q[Q_PREFILL].head;
    while (idx != PD_NONE && budget > 0 && b->n < e->cfg.batch_max) {
        req *r = eng_req(e, idx);
        idx = r->qlink.next;
        if (r->launched == r->prompt_len) continue;
        if (!r->bootstrapped && r->launched > r->cached_tokens) {
            /* Optimistic and still bootstrapping: at a chunk boundary with
             * nothing in flight, release and retry; otherwise wait. */
            if (r->forwards_in_flight == 0) requeue(e, r);
            continue;
        }
        budget -= add_chunk(e, b, r, budget);
    }
    eng_batch_launch(e, b);
}

static void on_result(pd_engine *e, req *r, const bitem *it, const pd_item_result *res,
                      const pd_item_top *top) {
    if (it->decode) {
        decode_on_result(e, r, it, res, top);
        return;
    }
    /* Aborted or failed while this forward ran: the last result in flight
     * completes the retire; nothing of this chunk is cached or sent. */
    if (eng_result_after_retire(e, r)) return;
    uint32_t ps = e->cfg.page_size;
    r->done = it->start + it->n;
    if (it->final) r->t_computed = e->now;
    if (!it->final) {
        if (e->cache) {
            uint32_t whole = (r->done / ps) * ps;
            bool at_snapshot = it->snapshot_slot != PD_NONE && r->done % ps == 0;
            uint32_t snap = at_snapshot ? it->snapshot_slot : PD_NONE;
            if (whole > r->own_from * ps || snap != PD_NONE) eng_cache_insert(e, r, whole, snap);
        }
        send_ready(e, r);
        return;
    }
    if (e->cfg.role == PD_ROLE_COLOCATED) {
        /* No hand-off: the request starts generating here. */
        q_move(e, r, Q_RUNNING);
        decode_emit_token(e, r, res, top);
        return;
    }
    pd_meta_row *meta = &e->cfg.meta_mem[r->meta_row];
    *meta = (pd_meta_row){
        .nonce = pd_room_nonce(r->room), .first_token = res->token,
        .first_logprob = res->logprob, .prompt_tokens = r->prompt_len,
        .prefill_cached_tokens = r->cached_tokens, .decode_cached_tokens = r->peer_cached,
        .first_n_top = res->n_top,
    };
    memcpy(meta->first_top_token, top->token, sizeof(int32_t) * res->n_top);
    memcpy(meta->first_top_logprob, top->logprob, sizeof(float) * res->n_top);
    if (r->bootstrapped) {
        send_final(e, r);
    } else {
        eng_act(e, r, PD_ACT_PARK, false, 0);
        q_move(e, r, Q_PARKED);
    }
}

void prefill_step(pd_engine *e) {
    poll_bootstrap_queue(e);
    poll_rooms(e);
    poll_loads(e);
    admit_waiting(e);
    schedule(e);
    eng_batch_poll(e, on_result);
}
