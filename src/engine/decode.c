/*
 * decode.c — the decode node's scheduler (DESIGN.md section 5).
 *
 *   submit -> PREALLOC -> WAIT_TRANSFER -> COMMIT -> RUNNING -> done
 *
 * PREALLOC reserves everything the request will ever need on this node — a
 * row, pages for the prompt minus what this node's prefix cache holds plus
 * pages for every token it may generate, a Mamba slot, a metadata row — so a
 * running request never stalls for memory. The destination (page ids, slot,
 * row, cached prefix) goes to the prefill node through the transport.
 *
 * COMMIT trusts the metadata row only if its nonce is the room's: a row
 * written for another room is "context corruption" and fails the request
 * instead of generating from someone else's KV. The first output token comes
 * from the prefill node; each decode step then adds one token per running
 * request (one batch in flight: a step needs the previous token).
 */
#include <stdio.h>
#include <string.h>

#include "engine_internal.h"

static void fail(pd_engine *e, req *r, int status, const char *msg) {
    eng_retire(e, r, PD_TERM_FAILED, PD_FINISH_NONE, status, msg);
}

/* After token out_len-1 was produced: is the request done? */
static bool finished(pd_engine *e, req *r, pd_finish_reason *why) {
    int32_t t = r->last_token;
    /* The token first: it is rarely the eos token, the other two rarely stop it. */
    if (t == e->info.eos_token && e->info.eos_token >= 0 && !r->ignore_eos) {
        *why = PD_FINISH_STOP;
        return true;
    }
    for (uint32_t i = 0; i < r->n_stop; i++)
        if (t == r->stop[i]) {
            *why = PD_FINISH_STOP;
            return true;
        }
    if (r->out_len >= r->max_new) {
        *why = PD_FINISH_LENGTH;
        return true;
    }
    return false;
}

/* Streams the token of res for r; true, with *why, when it was r's last
 * (the caller retires r). Inline into the decode step's loop over its
 * results, one per item. */
static inline bool stream_token(pd_engine *e, req *r, const pd_item_result *res,
                                const pd_item_top *top, pd_finish_reason *why) {
    const int32_t token = res->token;
    if (r->history) r->history[r->out_len] = token; /* out_len < max_new here */
    r->last_token = token;
    r->out_len++;
    eng_act(e, r, PD_ACT_TOKEN, false, r->out_len);
    if (res->n_top && e->sink.vt->top_logprobs)
        e->sink.vt->top_logprobs(e->sink.self, r->tag, r->out_len - 1, top->token, top->logprob,
                                 res->n_top);
    e->sink.vt->token(e->sink.self, r->tag, r->rid, r->room, token, res->logprob, r->out_len - 1);
    return finished(e, r, why);
}

static inline void emit_token(pd_engine *e, req *r, const pd_item_result *res,
                              const pd_item_top *top) {
    pd_finish_reason why;
    if (stream_token(e, r, res, top, &why)) eng_retire(e, r, PD_TERM_FINISHED, why, 200, "");
}

void decode_emit_token(pd_engine *e, req *r, const pd_item_result *res, const pd_item_top *top) {
    emit_token(e, r, res, top);
}

static void commit(pd_engine *e, req *r) {
    const pd_meta_row *meta = &e->cfg.meta_mem[r->meta_row];
    if (meta->nonce != pd_room_nonce(r->room) || meta->prompt_tokens != r->prompt_len) {
        fail(e, r, 500, "context corruption: the metadata row does not belong to this room");
        return;
    }
    if (meta->first_token < 0 || (uint32_t)meta->first_token >= e->info.vocab) {
        fail(e, r, 500, "context corruption: first token outside the vocabulary");
        return;
    }
    /* The top lists' first n_top entries below: a designated initializer
     * would clear all 160 bytes on every commit. */
    pd_item_result first = {
        .req = r->owner, .token = meta->first_token, .logprob = meta->first_logprob};
    pd_item_top first_top;
    if (meta->first_n_top > r->sampling.top_logprobs) {
        fail(e, r, 500, "context corruption: more top logprobs than the request asked for");
        return;
    }
    for (uint32_t i = 0; i < meta->first_n_top; i++) {
        if (meta->first_top_token[i] < 0 || (uint32_t)meta->first_top_token[i] >= e->info.vocab) {
            fail(e, r, 500, "context corruption: a top-logprob token outside the vocabulary");
            return;
        }
        first_top.token[i] = meta->first_top_token[i];
        first_top.logprob[i] = meta->first_top_logprob[i];
    }
    first.n_top = meta->first_n_top;
    eng_act(e, r, PD_ACT_COMMIT, false, 0);
    eng_release_at_commit(e, r);
    r->done = r->prompt_len;
    q_move(e, r, Q_RUNNING);
    decode_emit_token(e, r, &first, &first_top);
}

static void poll_transfers(pd_engine *e) {
    uint32_t idx = e->q[Q_WAIT_XFER].head;
    while (idx != PD_NONE) {
        req *r = eng_req(e, idx);
        idx = r->qlink.next;
        eng_prefetch_walk(e, idx);
        pd_xfer_status st = eng_room_status(e, r);
        if (st == PD_XFER_SUCCESS) {
            uint32_t ps = e->cfg.page_size;
            uint64_t pages = PD_DIV_CEIL(r->prompt_len, ps) - r->cached_tokens / ps;
            r->xfer_bytes = pages * e->xfer_page_bytes + e->xfer_state_bytes;
            r->t_xfer_done = e->now;
            commit(e, r);
        } else if (st == PD_XFER_FAILED) {
            fail(e, r, 500, "transfer failed: the prefill side failed or aborted the room");
        } else if (e->cfg.transfer_timeout_us && e->now - r->t_state > e->cfg.transfer_timeout_us) {
            char msg[96];
            snprintf(msg, sizeof(msg), "transfer timed out in %s", pd_xfer_status_name(st));
            fail(e, r, 504, msg);
        }
    }
}

/* 0: not now (memory), 1: destination sent. */
static int prealloc(pd_engine *e, req *r) {
    uint32_t ps = e->cfg.page_size;
    if (pd_pool_free_count(e->row) == 0 || pd_pool_free_count(e->meta) == 0) return 0;
    if (e->mamba && pd_pool_free_count(e->mamba) == 0) return 0;
    uint32_t cached = 0;
    if (e->cache) {
        pd_cache_match_result m;
        PD_MUST(pd_cache_match(e->cache, r->prompt, r->prompt_len, r->pages, e->pages_per_req, &m));
        cached = m.dev_tokens;
        eng_cache_lock(e, r, m.dev_node);
    }
    /* Positions [0, prompt + max_new - 1) get KV here; the last sampled
     * token is never fed back. */
    uint32_t total = PD_DIV_CEIL(r->prompt_len + r->max_new - 1, ps);
    uint32_t need = total - cached / ps;
    if (!eng_reserve_pages(e, r, need)) return 0;
    r->n_pages = r->own_from = cached / ps;
    r->cached_tokens = cached;
    e->ctr.cached_tokens += cached;
    PD_MUST(eng_alloc_slot(e, e->row_id, r->owner, &r->row));
    r->holds_row = true;
    PD_MUST(eng_alloc_slot(e, e->meta_id, r->owner, &r->meta_row));
    r->holds_meta = true;
    /* Only the nonce: a row whose nonce is not the room's never commits, and
     * the transfer writes the whole row (clearing all 192 bytes cost a decode
     * step about 1 %). */
    e->cfg.meta_mem[r->meta_row].nonce = 0;
    if (e->mamba) {
        PD_MUST(eng_alloc_slot(e, e->mamba_id, r->owner, &r->mamba_run));
        r->holds_mamba = true;
    }
    uint32_t dest_pages = PD_DIV_CEIL(r->prompt_len, ps) - cached / ps;
    eng_alloc_pages(e, r, dest_pages);
    pd_xfer_dest dest = {
        .prompt_tokens = r->prompt_len, .cached_tokens = cached,
        .pages = r->pages + cached / ps, .n_pages = dest_pages,
        .mamba_slot = e->mamba ? r->mamba_run : PD_POOL_NONE, .meta_row = r->meta_row,
    };
    q_move(e, r, Q_WAIT_XFER);
    if (e->xfer.vt->receiver_open(e->xfer.self, r->room, r->peer, &dest) != PD_OK) {
        fail(e, r, 502, "bootstrap: could not reach the prefill node");
        return 1;
    }
    r->holds_room = r->opened_room = true;
    eng_room_watch(e, r);
    r->t_xfer_start = e->now;
    eng_act(e, r, PD_ACT_ROOM_OPEN, false, 0);
    return 1;
}

void decode_on_result(pd_engine *e, req *r, const bitem *it, const pd_item_result *res,
                      const pd_item_top *top) {
    (void)it;
    if (eng_result_after_retire(e, r)) return;
    e->ctr.decode_tokens++;
    emit_token(e, r, res, top);
}

/* One item per running request from idx on that has no forward in flight
 * (a step needs the previous token). */
static void add_items_from(pd_engine *e, batch_rec *b, uint32_t idx) {
    uint32_t ps = e->cfg.page_size;
    while (idx != PD_NONE && b->n < e->cfg.batch_max) {
        req *r = eng_req(e, idx);
        idx = r->qlink.next;
        /* A list walk: start loading the next record while this one is added. */
        if (idx != PD_NONE) eng_prefetch(e, idx);
        if (r->forwards_in_flight > 0) continue;
        /* Where the last token goes: below prompt + max_new - 1, the positions
         * reserved at admission (the last sampled token is never fed back). */
        uint32_t pos = r->prompt_len + r->out_len - 1;
        PD_ASSERT(r->out_len < r->max_new);
        if (pos >= r->n_pages * ps) eng_alloc_pages(e, r, 1);
        eng_batch_add(e, b, r, &r->last_token, pos, 1, true, r->out_len, PD_NONE, false, true);
    }
}

void decode_add_items(pd_engine *e, batch_rec *b) { add_items_from(e, b, e->q[Q_RUNNING].head); }

#ifndef NDEBUG
/* Debug builds: a kept item must equal the item eng_batch_add would build. */
static void kept_check(const pd_engine *e, const pd_batch_item *it, const req *r) {
    const pd_sampling *a = &it->sampling, *s = &r->sampling;
    bool same = it->req == r->owner && it->tokens == &r->last_token && it->n_tokens == 1 &&
        it->start_pos == r->prompt_len + r->out_len - 1 && it->pages == r->pages &&
        it->n_pages == r->n_pages && it->snapshot_slot == PD_POOL_NONE && it->sample &&
        it->mamba_slot == (e->mamba ? r->mamba_run : PD_POOL_NONE) &&
        it->sample_index == r->out_len && it->history == r->history &&
        a->temperature == s->temperature && a->top_p == s->top_p && a->seed == s->seed &&
        a->top_k == s->top_k && a->min_p == s->min_p &&
        a->repetition_penalty == s->repetition_penalty &&
        a->frequency_penalty == s->frequency_penalty &&
        a->presence_penalty == s->presence_penalty && a->top_logprobs == s->top_logprobs;
    PD_ASSERTF(same, "request %s: its kept decode item differs from a fresh one", r->rid);
}
#endif

/* The decode batch kept from step to step (the decode role; one batch in
 * flight). The running queue only grows at its tail (commit) and loses
 * requests anywhere (retire), and a batch is its first batch_max requests, so
 * the requests of the last batch still running after their results are the
 * next batch's first items, in the same order. Their items are kept — only
 * the position and the sample index change, and the page count when a page
 * is added — and the gaps of the requests gone are closed after the results:
 * the gaps before a split by moving the items before them up (launch_items
 * then starts later in launch_buf), those after it by moving the items after
 * them down, the split the one that moves the fewest items (the oldest
 * requests, first in the queue, are the ones that finish, so most gaps lie
 * near the front). When e->kept_ready, launch_items[0, n) are the next
 * batch's first n items, n its record's count (the record eng_batch_begin
 * returns next); their page growth and launch reports wait for schedule(),
 * in the order decode_add_items would make them. */

/* The record index of an owner, (gen << 32) | (index + 1): a decode batch's
 * items name their records through their req (pd_batch_item), the items of
 * the batch record (bitem) are not read. */
static inline uint32_t owner_idx(uint64_t owner) { return (uint32_t)owner - 1u; }

/* Item i of the batch just polled is r's, still running: it becomes item
 * nb->n of the next batch once the gaps are closed. */
static inline void keep_item(pd_engine *e, batch_rec *nb, req *r, uint32_t i) {
    pd_batch_item *it = &e->launch_items[i];
    PD_ASSERT(r->out_len < r->max_new);
    it->start_pos = r->prompt_len + r->out_len - 1;
    it->sample_index = r->out_len;
    /* Its next position needs a page: kept_pages adds it, in item order. The
     * record's page count, on the line just read, equals the item's (kept_check):
     * the item is only written here, its line not waited for. */
    if (it->start_pos >= r->n_pages * e->cfg.page_size) e->kept_grow[e->kept_grow_n++] = nb->n;
    nb->n++;
    r->forwards_in_flight++;
    r->pending_chunk = true;
}

/* Which gaps of n items close from the front: the first j (their items
 * before gap j-1 move up), the rest from the back, j moving the fewest. */
static uint32_t gap_split(const uint32_t *g, uint32_t k, uint32_t n) {
    uint32_t best = 0, best_cost = n - g[0] - k; /* all from the back */
    for (uint32_t j = 1; j <= k; j++) {
        uint32_t cost = g[j - 1] - (j - 1) + (j < k ? n - g[j] - (k - j) : 0);
        if (cost < best_cost) best = j, best_cost = cost;
    }
    return best;
}

/* Closes the kept_gap_n gaps of the n items at launch_items (see above). */
static void keep_compact(pd_engine *e, uint32_t n) {
    const uint32_t k = e->kept_gap_n, *g = e->kept_gap;
    if (k == 0) return;
    const uint32_t j = gap_split(g, k, n);
    pd_batch_item *it = e->launch_items;
    for (uint32_t i = j; i-- > 0;) { /* up by the gaps from i to j - 1 */
        uint32_t from = i ? g[i - 1] + 1 : 0;
        if (g[i] > from) memmove(&it[from + j - i], &it[from], (g[i] - from) * sizeof(*it));
    }
    for (uint32_t i = j; i < k; i++) { /* down by the gaps from j to i */
        uint32_t from = g[i] + 1, to = i + 1 < k ? g[i + 1] : n;
        if (to > from) memmove(&it[from - (i - j + 1)], &it[from], (to - from) * sizeof(*it));
    }
    it += j;
    /* launch_items must hold batch_max items: back to the buffer's start. */
    if (it > e->launch_buf + e->cfg.batch_max) {
        memmove(e->launch_buf, it, (n - k) * sizeof(*it));
        it = e->launch_buf;
    }
    e->launch_items = it;
    e->kept_gap_n = 0;
}

/* The requests whose last token the poll just streamed, retired in turn
 * after it: their terminal reason was recorded at once (stream_token's
 * caller), only the release waits. Each retire reads lines of its request
 * that have gone cold while it waited its turn in the batch (the record's
 * terminal and ownership fields, the prompt it inserts into the cache, its
 * page table, its index slots, the child index slot the insert looks up):
 * each retire's are asked for, in three stages, while the ones before it
 * retire, so that they load side by side with that work instead of one
 * after another within its own. A request that is no longer the record's,
 * or no longer live (a sink's callback may have aborted it, which retires
 * it with the reason already recorded), is skipped. */
static req *done_req(pd_engine *e, pd_owner owner) {
    req *r = eng_req(e, owner_idx(owner));
    return r->live && r->owner == owner ? r : NULL;
}

static void retire_done(pd_engine *e) {
    /* The first three are started before the loop, which then keeps each
     * stage its distance ahead (one loop over n + 3 turns with bounds
     * checks in each cost the decode step 0.4 % more instructions). */
    const uint32_t n = e->done_n;
    const pd_owner *d = e->done;
    req *r;
    for (uint32_t k = 0; k < n && k < 3; k++)
        eng_retire_prefetch_record(e, eng_req(e, owner_idx(d[k])));
    for (uint32_t k = 0; k < n && k < 2; k++)
        if ((r = done_req(e, d[k]))) eng_retire_prefetch_deps(e, r);
    if (n > 0 && (r = done_req(e, d[0]))) eng_retire_prefetch_insert(e, r);
    for (uint32_t k = 0; k < n; k++) {
        if (k + 3 < n) eng_retire_prefetch_record(e, eng_req(e, owner_idx(d[k + 3])));
        if (k + 2 < n && (r = done_req(e, d[k + 2]))) eng_retire_prefetch_deps(e, r);
        if (k + 1 < n && (r = done_req(e, d[k + 1]))) eng_retire_prefetch_insert(e, r);
        if ((r = done_req(e, d[k])))
            eng_retire(e, r, (pd_terminal_kind)r->term, r->finish, r->status, r->msg);
    }
    e->done_n = 0;
}

/* eng_batch_poll with decode_on_result (a decode item is one token, never a
 * final chunk), keeping the items of the requests still running for the
 * next batch. */
static void poll_and_keep(pd_engine *e) {
    if (e->inflight_n == 0) return;
    PD_ASSERT(e->inflight_n == 1);
    batch_rec *b = &e->inflight[e->inflight_head];
    if (!e->exec.vt->poll(e->exec.self, b->id, e->results, e->result_tops)) return;
    e->inflight_head = (e->inflight_head + 1) % INFLIGHT_MAX;
    e->inflight_n--;
    batch_rec *nb = &e->inflight[e->inflight_head]; /* eng_batch_begin's next */
    nb->n = 0;
    e->kept_grow_n = e->kept_gap_n = 0;
    const pd_batch_item *items = e->launch_items;
    enum { AHEAD = 4 };
    for (uint32_t i = 0; i < b->n && i < AHEAD; i++) eng_prefetch(e, owner_idx(items[i].req));
    for (uint32_t i = 0; i < b->n; i++) {
        if (i + AHEAD < b->n) eng_prefetch(e, owner_idx(items[i + AHEAD].req));
        const uint64_t owner = items[i].req;
        req *r = eng_req(e, owner_idx(owner));
        if (!r->live || r->owner != owner) {
            e->ctr.late_results_ignored++; /* as eng_batch_poll */
            e->kept_gap[e->kept_gap_n++] = i;
            continue;
        }
        PD_ASSERT(e->results[i].req == owner);
        PD_ASSERT(r->forwards_in_flight > 0);
        r->forwards_in_flight--;
        if (r->forwards_in_flight == 0) r->pending_chunk = false;
        eng_act(e, r, PD_ACT_RESULT, false, 1);
        if (eng_result_after_retire(e, r)) { /* decode_on_result's drop */
            e->kept_gap[e->kept_gap_n++] = i;
            continue;
        }
        e->ctr.decode_tokens++;
        pd_finish_reason why;
        if (stream_token(e, r, &e->results[i], &e->result_tops[i], &why)) {
            eng_terminal_reason(e, r, PD_TERM_FINISHED, why, 200, "");
            e->done[e->done_n++] = owner;
            e->kept_gap[e->kept_gap_n++] = i;
        } else if (r->live && r->owner == owner && r->queue == Q_RUNNING) {
            keep_item(e, nb, r, i);
        } else {
            e->kept_gap[e->kept_gap_n++] = i; /* its sink's callback ended it */
        }
    }
    retire_done(e);
    keep_compact(e, b->n);
    e->kept_ready = true;
}

static void kept_grow_one(pd_engine *e, pd_batch_item *it) {
    req *r = eng_req(e, owner_idx(it->req));
    eng_alloc_pages(e, r, 1);
    it->n_pages = r->n_pages;
}

/* The kept items' page growth, in their order (the order decode_add_items
 * allocates in), and their launch reports. Without an observer only the
 * items keep_item listed are visited (about one in sixteen at 256 live: a
 * request needs a page every page_size tokens); with one, each item's
 * report follows its page growth, as in decode_add_items. Debug builds check
 * that every item has its page, is the running queue's next request and
 * equals a fresh item. */
static void kept_pages(pd_engine *e, batch_rec *b) {
    uint32_t ps = e->cfg.page_size;
    PD_ASSERT(e->kept_grow_n <= b->n);
    if (!e->obs) {
        for (uint32_t g = 0; g < e->kept_grow_n; g++)
            kept_grow_one(e, &e->launch_items[e->kept_grow[g]]);
    } else {
        for (uint32_t i = 0; i < b->n; i++) {
            pd_batch_item *it = &e->launch_items[i];
            if (it->start_pos >= it->n_pages * ps) kept_grow_one(e, it);
            eng_act(e, eng_req(e, owner_idx(it->req)), PD_ACT_LAUNCH, false, 1);
        }
    }
    e->kept_grow_n = 0;
#ifndef NDEBUG
    uint32_t q = e->q[Q_RUNNING].head;
    for (uint32_t i = 0; i < b->n; i++) {
        const pd_batch_item *it = &e->launch_items[i];
        PD_ASSERT(it->start_pos < it->n_pages * ps);
        kept_check(e, it, eng_req(e, owner_idx(it->req)));
        PD_ASSERT(q == owner_idx(it->req));
        q = eng_req(e, q)->qlink.next;
    }
#endif
}

/* The batch: the kept items, then one per running request after them (the
 * requests beyond the last batch's batch_max, and those committed since). */
static void schedule(pd_engine *e) {
    if (e->inflight_n > 0) return;
    uint32_t kept = e->inflight[e->inflight_head].n; /* eng_batch_begin clears it */
    batch_rec *b = eng_batch_begin(e);
    uint32_t idx = e->q[Q_RUNNING].head;
    if (e->kept_ready) {
        PD_ASSERT(b == &e->inflight[e->inflight_head]);
        b->n = kept;
        kept_pages(e, b);
        if (b->n) idx = eng_req(e, owner_idx(e->launch_items[b->n - 1].req))->qlink.next;
        e->kept_ready = false;
    }
    add_items_from(e, b, idx);
    eng_batch_launch(e, b);
}

void decode_step(pd_engine *e) {
    poll_transfers(e);
    while (e->q[Q_PREALLOC].head != PD_NONE) {
        req *r = eng_req(e, e->q[Q_PREALLOC].head);
        /* The next one's match: its likely child index slot, guessed at
         * submit. */
        uint32_t next = r->qlink.next;
        if (next != PD_NONE) pd_cache_guess_prefetch(e->cache, eng_req(e, next)->guess);
        if (prealloc(e, r) == 0) break;
    }
    poll_and_keep(e);
    schedule(e);
}
