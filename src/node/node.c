/*
 * node.c — a running server's scheduler side: model, executor worker,
 * transport, engine, the scheduler thread and the command queue.
 *
 * The scheduler thread is the engine's only user. It loops: take every
 * queued command (submit, abort, abort-all, info, metrics), step the engine
 * with the monotonic clock, and go back to waiting — a short wait while the
 * engine is busy (results and transfers arrive without a signal), a longer
 * one when it is idle (a new command wakes it at once).
 *
 * Outputs reach the HTTP side through the engine's sink, which runs on the
 * scheduler thread: each token is appended to the request's call and the
 * call's wake hook queues it for http.c's responder thread, never waiting on
 * it. The call is found through the engine's request id, whose low half
 * indexes the engine's record table.
 */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gen.h"
#include "node_internal.h"
#include "pdserve/model.h"
#include "pdserve/stream.h"
#include "pdserve/net.h"
#include "pdserve/tokenizer.h"

#define NODE_STRINGS 11 /* own_config_strings's slots */

#define CMDS_MAX 4096
/* One strict-mode report: the violations and the attribution of every pool;
 * longer reports are cut (pd_strbuf), the count of violations is not. */
#define STRICT_REPORT_BYTES (64u * 1024u)
/* Failed strict-mode checks whose report goes to pd_node_config.on_violation. */
#define STRICT_REPORTS_MAX 3

typedef struct cmd {
    cmd_kind kind;
    call *c;
    char rid[PD_RID_MAX];
    cmd_reply *reply;
    uint64_t room;                 /* CANCEL_ROOM */
    char peer[PD_PEER_MAX];
} cmd;

struct pd_node {
    pd_node_config cfg;
    char *strings[NODE_STRINGS]; /* owned copies of the config's strings */
    pd_model *model;
    pd_hf_tokenizer *tok;   /* the model directory's tokenizer.json; NULL: the byte tokenizer */
    pd_chat_template *chat; /* the model's chat template; NULL: the built-in one */
    pd_executor model_ex;
    pd_stream *stream;
    pd_engine *eng;
    pd_meta_row *meta;
    uint32_t meta_rows;
    pd_net *net;             /* --transfer-backend ucx */
    pd_exec_alloc net_alloc; /* net's allocator, once asked for (transfer_alloc) */
    uint32_t requests_max;
    /* Submitted calls by slot; a call's slot is its tag in the engine
     * (pd_request_spec.tag) until its terminal event. At most requests_max
     * are awaiting one: each holds a live engine record. */
    call **calls;
    uint32_t *free_slots; /* a stack of the slots without a call */
    uint32_t n_free_slots;

    pthread_t sched;
    bool sched_running;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    cmd *cmds;
    uint32_t cmd_head, cmd_n;
    atomic_bool stopping;
    atomic_uint_fast64_t rid_counter;

    http_server *http;
    uint16_t http_port;

    /* scheduler thread only */
    node_metrics *metrics;
    uint64_t violations;
    char *strict_report;             /* STRICT_REPORT_BYTES, strict mode only: each node
                                        its own, as two run in one process (pdserve run) */
};

/* ---- small helpers --------------------------------------------------------- */

const char *pd_node_role_name(pd_node_role r) {
    switch (r) {
    case PD_NODE_PREFILL: return "prefill";
    case PD_NODE_DECODE: return "decode";
    case PD_NODE_SERVE: return "serve";
    }
    return "unknown";
}

uint64_t node_now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

const pd_node_config *node_config(const pd_node *n) { return &n->cfg; }
uint32_t node_vocab(const pd_node *n) { return pd_model_config_get(n->model)->vocab; }

pd_err node_encode(const pd_node *n, const char *text, size_t len, bool add_special, int32_t **ids,
                   size_t *n_ids, char *msg, size_t cap) {
    if (n && n->tok)
        return pd_hf_tokenizer_encode(n->tok, text, len, add_special, ids, n_ids, msg, cap);
    bool bos = add_special && n && node_bos(n) >= 0;
    size_t need = pd_tokenizer_encode(text, len, bos, NULL, 0);
    *ids = malloc((need ? need : 1) * sizeof(int32_t));
    if (!*ids) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory for %zu tokens", need);
    *n_ids = pd_tokenizer_encode(text, len, bos, *ids, need);
    return PD_OK;
}

size_t node_token_bytes(const pd_node *n, int32_t id, bool skip_special, char *out, size_t cap) {
    PD_ASSERT(cap >= NODE_TOKEN_BYTES_MAX);
    if (!n || !n->tok) {
        size_t k = pd_tokenizer_decode(&id, 1, out, cap);
        return PD_MIN(k, cap - 1);
    }
    char *bytes = NULL, msg[64];
    size_t len = 0;
    if (id < 0 || (uint32_t)id >= pd_hf_tokenizer_vocab_size(n->tok) ||
        pd_hf_tokenizer_decode(n->tok, &id, 1, skip_special, &bytes, &len, msg, sizeof msg))
        len = 0; /* an id the model has and the tokenizer not: no text */
    len = PD_MIN(len, cap - 1);
    if (len) memcpy(out, bytes, len);
    out[len] = '\0';
    free(bytes);
    return len;
}

const pd_hf_tokenizer *node_tokenizer(const pd_node *n) { return n->tok; }
const pd_chat_template *node_chat_template(const pd_node *n) { return n ? n->chat : NULL; }

const char *node_special_text(const pd_node *n, bool eos) {
    if (!n || !n->tok) return NULL;
    int32_t id = eos ? pd_hf_tokenizer_eos(n->tok) : pd_hf_tokenizer_bos(n->tok);
    return id >= 0 ? pd_hf_tokenizer_token(n->tok, id) : NULL;
}
int32_t node_bos(const pd_node *n) {
    return n->tok ? pd_hf_tokenizer_bos(n->tok) : pd_model_config_get(n->model)->bos_token;
}
uint64_t node_next_rid(pd_node *n) { return atomic_fetch_add(&n->rid_counter, 1) + 1; }
bool node_stopping(const pd_node *n) { return atomic_load(&n->stopping); }

void node_close_stream_feeds(pd_node *n) {
    if (n->http) http_close_feeds(n->http);
}

void pd_node_config_default(pd_node_config *c, pd_node_role role) {
    memset(c, 0, sizeof(*c));
    c->role = role;
    c->host = "127.0.0.1";
    c->max_body_bytes = 1 << 20;
    c->served_model_name = "pdserve-tiny";
    c->model_preset = "tiny";
    c->threads = 1;
    c->page_size = 16;
    c->max_total_tokens = 65536;
    c->max_running_requests = 64;
    c->max_queued_requests = 1024;
    c->chunked_prefill_size = 512;
    c->max_prompt_tokens = 8192;
    c->max_new_tokens_limit = 4096;
    c->bootstrap_timeout_ms = 30000;
    c->transfer_timeout_ms = 60000;
    c->http_header_timeout_ms = 10000;
    c->http_body_timeout_ms = 30000;
    c->http_idle_timeout_ms = 60000;
    c->http_write_timeout_ms = 30000;
    c->transfer_backend = "loopback";
    c->bootstrap_host = NULL; /* = host */
    c->bootstrap_port = 8998;
}

/* ---- calls --------------------------------------------------------------------- */

call *call_new(void) {
    call *c = calloc(1, sizeof(*c));
    if (!c) return NULL;
    atomic_init(&c->refs, 1);
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    return c;
}

void call_ref(call *c) { atomic_fetch_add(&c->refs, 1); }

void call_unref(call *c) {
    if (atomic_fetch_sub(&c->refs, 1) != 1) return;
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    free(c->prompt);
    free(c->tokens);
    free(c->logprobs);
    free(c->top);
    free(c->top_lp);
    free(c->n_top);
    free(c);
}

/* Under c->mu, after a change to c: wakes its waiters (a thread on cv, the
 * HTTP side through its hook, which only queues). */
static void call_changed(call *c) {
    pthread_cond_broadcast(&c->cv);
    if (c->wake) c->wake(c->wake_ctx);
}

/* The call a sink event is about: the engine echoes the slot the node gave
 * as the request's tag, for requests it accepted and has not ended. */
static call *call_of(pd_node *n, uint64_t tag, const char *rid) {
    PD_ASSERTF(tag < n->requests_max && n->calls[tag],
               "sink event for %s with tag %llu, which names no submitted call", rid,
               (unsigned long long)tag);
    call *c = n->calls[tag];
    PD_ASSERTF(strcmp(c->rid, rid) == 0, "sink event for %s reached the call of %s", rid, c->rid);
    return c;
}

static uint32_t slot_take(pd_node *n) {
    return n->n_free_slots > 0 ? n->free_slots[--n->n_free_slots] : PD_NONE;
}

static void slot_give(pd_node *n, uint32_t slot) {
    PD_ASSERT(slot < n->requests_max && !n->calls[slot] && n->n_free_slots < n->requests_max);
    n->free_slots[n->n_free_slots++] = slot;
}

/* ---- the sink (scheduler thread) -------------------------------------------------- */

/* The alternatives of output token `index`, kept beside it (c->top, n_top
 * per token) when the request asked for top_logprobs. */
static void sink_top(void *self, uint64_t tag, uint32_t index, const int32_t *tokens,
                     const float *logprobs, uint32_t n_top) {
    pd_node *n = self;
    PD_ASSERT(tag < n->requests_max && n->calls[tag]);
    call *c = n->calls[tag];
    uint32_t k = c->spec.sampling.top_logprobs;
    pthread_mutex_lock(&c->mu);
    if (c->top && index == c->n_tokens && index < c->spec.max_new_tokens && n_top <= k) {
        memcpy(c->top + (size_t)index * k, tokens, sizeof(int32_t) * n_top);
        memcpy(c->top_lp + (size_t)index * k, logprobs, sizeof(float) * n_top);
        c->n_top[index] = (uint8_t)n_top;
    }
    pthread_mutex_unlock(&c->mu);
}

static void sink_token(void *self, uint64_t tag, const char *rid, uint64_t room, int32_t token,
                       float logprob, uint32_t index) {
    (void)room;
    pd_node *n = self;
    call *c = call_of(n, tag, rid);
    uint64_t now = node_now_us();
    pthread_mutex_lock(&c->mu);
    if (index == c->n_tokens && c->n_tokens < c->spec.max_new_tokens) {
        c->tokens[c->n_tokens] = token;
        c->logprobs[c->n_tokens] = logprob;
        c->n_tokens++;
        bool first = c->n_tokens == 1;
        if (first) c->t_first_us = now;
        uint64_t since_us = now - (first ? c->t_submit_us : c->t_done_us);
        node_metrics_token(n->metrics, first, (double)since_us / 1e6);
        c->t_done_us = now; /* time of the latest token until done */
    }
    call_changed(c);
    pthread_mutex_unlock(&c->mu);
}

/* The request log's line for c (under c->mu), when it is to be logged:
 * every request with --log-requests, else those whose client hung up. */
static char *request_line(pd_node *n, const call *c, const pd_terminal_event *ev, uint64_t now) {
    if (!n->cfg.on_log || !(n->cfg.log_requests || c->hung_up)) return NULL;
    return node_request_line(n->cfg.role, c, ev, now);
}

/* Hands a log line on, outside every lock (the callback may block on I/O). */
static void log_line(pd_node *n, char *line) {
    if (!line) return;
    n->cfg.on_log(n->cfg.on_log_ctx, line);
    free(line);
}

static void sink_terminal(void *self, const pd_terminal_event *ev) {
    pd_node *n = self;
    call *c = call_of(n, ev->tag, ev->rid);
    uint64_t now = node_now_us();
    node_metrics_end(n->metrics, ev, now);
    pthread_mutex_lock(&c->mu);
    c->done = true;
    c->kind = ev->kind;
    c->finish = ev->finish;
    c->status = ev->status_code;
    snprintf(c->message, sizeof(c->message), "%s", ev->message ? ev->message : "");
    c->cached_tokens = ev->cached_tokens;
    c->t_done_us = now;
    char *line = request_line(n, c, ev, now);
    call_changed(c);
    pthread_mutex_unlock(&c->mu);
    log_line(n, line);
    n->calls[ev->tag] = NULL;
    slot_give(n, (uint32_t)ev->tag);
    call_unref(c); /* the scheduler's reference */
}

static const pd_sink_vtable node_sink_vt = {
    .token = sink_token, .terminal = sink_terminal, .top_logprobs = sink_top};

/* A client's /abort_request of rid also ends the other choices of its
 * request, rid#1 .. rid#63 (src/node/gen.h); returns how many ended, with
 * the first (already aborted: found). */
static int64_t abort_choices(pd_node *n, const char *rid, bool found) {
    int64_t k = found;
    char sub[PD_RID_MAX + 8];
    for (uint32_t i = 1; i < GEN_CHOICES_MAX && strlen(rid) + 4 < PD_RID_MAX; i++) {
        snprintf(sub, sizeof sub, "%s#%u", rid, i);
        k += pd_engine_abort(n->eng, sub) == PD_OK;
    }
    return k;
}

/* ---- commands ------------------------------------------------------------------ */

pd_err node_command(pd_node *n, cmd_kind kind, call *c, const char *rid, cmd_reply *reply) {
    pthread_mutex_lock(&n->mu);
    if (atomic_load(&n->stopping)) {
        pthread_mutex_unlock(&n->mu);
        return PD_ERR_STATE;
    }
    if (n->cmd_n == CMDS_MAX) {
        pthread_mutex_unlock(&n->mu);
        return PD_ERR_NOMEM;
    }
    cmd *q = &n->cmds[(n->cmd_head + n->cmd_n) % CMDS_MAX];
    memset(q, 0, sizeof(*q));
    q->kind = kind;
    q->c = c;
    if (c) call_ref(c);
    if (rid) snprintf(q->rid, sizeof(q->rid), "%s", rid);
    q->reply = reply;
    n->cmd_n++;
    pthread_cond_signal(&n->cv);
    pthread_mutex_unlock(&n->mu);
    return PD_OK;
}

void node_cancel_room(pd_node *n, uint64_t room, const char *peer) {
    if (room == 0 || n->cfg.role == PD_NODE_SERVE) return;
    pthread_mutex_lock(&n->mu);
    if (!atomic_load(&n->stopping) && n->cmd_n < CMDS_MAX) {
        cmd *q = &n->cmds[(n->cmd_head + n->cmd_n) % CMDS_MAX];
        memset(q, 0, sizeof(*q));
        q->kind = CMD_CANCEL_ROOM;
        q->room = room;
        snprintf(q->peer, sizeof(q->peer), "%s", peer ? peer : "");
        n->cmd_n++;
        pthread_cond_signal(&n->cv);
    }
    pthread_mutex_unlock(&n->mu);
}

pd_err node_command_wait(pd_node *n, cmd_kind kind, const char *rid, cmd_reply *reply) {
    memset(reply, 0, sizeof(*reply));
    pthread_mutex_init(&reply->mu, NULL);
    pthread_cond_init(&reply->cv, NULL);
    pd_err err = node_command(n, kind, NULL, rid, reply);
    if (!err) {
        pthread_mutex_lock(&reply->mu);
        while (!reply->ready) pthread_cond_wait(&reply->cv, &reply->mu);
        pthread_mutex_unlock(&reply->mu);
    }
    pthread_mutex_destroy(&reply->mu);
    pthread_cond_destroy(&reply->cv);
    return err;
}

static void reply_done(cmd_reply *r, int64_t value, char *text) {
    pthread_mutex_lock(&r->mu);
    r->value = value;
    r->text = text;
    r->ready = true;
    pthread_cond_broadcast(&r->cv);
    if (r->wake) r->wake(r->wake_ctx);
    pthread_mutex_unlock(&r->mu);
}

static char *info_json(pd_node *n);
static char *metrics_text(pd_node *n);

static void run_command(pd_node *n, cmd *q) {
    switch (q->kind) {
    case CMD_SUBMIT: {
        call *c = q->c;
        c->t_submit_us = node_now_us();
        pd_reject why;
        memset(&why, 0, sizeof(why));
        /* No free slot means requests_max calls await their end, each with a
         * live engine record: the engine refuses this one (429) for want of
         * a record, and the tag is never echoed. */
        uint32_t slot = slot_take(n);
        pd_request_spec spec = c->spec;
        spec.tag = slot;
        pd_err err = pd_engine_submit(n->eng, &spec, node_now_us(), &why);
        if (err == PD_OK) {
            PD_ASSERT(slot != PD_NONE && !n->calls[slot]);
            n->calls[slot] = c; /* the command's reference becomes the scheduler's */
        } else if (slot != PD_NONE) {
            slot_give(n, slot);
        }
        pthread_mutex_lock(&c->mu);
        c->submitted = true;
        c->submit_err = err;
        c->reject = why;
        char *line = err != PD_OK ? request_line(n, c, NULL, c->t_submit_us) : NULL;
        call_changed(c);
        pthread_mutex_unlock(&c->mu);
        log_line(n, line);
        if (err != PD_OK) call_unref(c);
        break;
    }
    case CMD_ABORT: {
        pd_err err = pd_engine_abort(n->eng, q->rid);
        if (q->reply) reply_done(q->reply, abort_choices(n, q->rid, err == PD_OK), NULL);
        break;
    }
    case CMD_ABORT_ALL: {
        uint32_t k = pd_engine_abort_all(n->eng);
        if (q->reply) reply_done(q->reply, k, NULL);
        break;
    }
    case CMD_CANCEL_ROOM:
        pd_engine_cancel_room(n->eng, q->room, q->peer);
        break;
    case CMD_INFO: {
        char *text = info_json(n);
        reply_done(q->reply, text ? PD_OK : PD_ERR_NOMEM, text);
        break;
    }
    case CMD_METRICS: {
        char *text = metrics_text(n);
        reply_done(q->reply, text ? PD_OK : PD_ERR_TOOBIG, text);
        break;
    }
    case CMD_FLUSH: {
        char msg[256];
        pd_err err = pd_engine_flush_cache(n->eng, NULL, msg, sizeof(msg));
        char *text = strdup(msg);
        reply_done(q->reply, text ? err : PD_ERR_NOMEM, text);
        break;
    }
    }
}

const char *node_strict_check(pd_node *n) {
    PD_ASSERT(n->cfg.strict && n->strict_report);
    pd_strbuf sb;
    pd_strbuf_init(&sb, n->strict_report, STRICT_REPORT_BYTES);
    /* Every failure is counted; only the first few are handed on in full, so a
     * broken invariant does not flood whoever reads them, one per step. */
    if (pd_engine_check(n->eng, &sb) != PD_OK) {
        if (n->violations++ < STRICT_REPORTS_MAX && n->cfg.on_violation)
            n->cfg.on_violation(n->cfg.on_violation_ctx, n->cfg.role, n->strict_report);
    }
    PD_ASSERT(sb.len < STRICT_REPORT_BYTES && n->strict_report[sb.len] == '\0');
    return n->strict_report;
}

pd_engine *node_engine(pd_node *n) { return n->eng; }

static void *sched_main(void *arg) {
    pd_node *n = arg;
    cmd *batch = malloc(CMDS_MAX * sizeof(cmd));
    PD_ASSERT(batch);
    for (;;) {
        pthread_mutex_lock(&n->mu);
        uint32_t k = 0;
        while (n->cmd_n > 0) {
            batch[k++] = n->cmds[n->cmd_head];
            n->cmd_head = (n->cmd_head + 1) % CMDS_MAX;
            n->cmd_n--;
        }
        bool stop = atomic_load(&n->stopping);
        pthread_mutex_unlock(&n->mu);
        for (uint32_t i = 0; i < k; i++) run_command(n, &batch[i]);
        if (stop) break;
        uint64_t now = node_now_us();
        pd_engine_step(n->eng, now);
        node_metrics_tick(n->metrics, now);
        if (n->cfg.strict) node_strict_check(n);
        pthread_mutex_lock(&n->mu);
        if (n->cmd_n == 0 && !atomic_load(&n->stopping)) {
            /* Busy: results and transfers arrive unannounced, look again soon. */
            long wait_ns = pd_engine_idle(n->eng) ? 20000000L : 100000L;
            struct timespec until;
            clock_gettime(CLOCK_REALTIME, &until);
            until.tv_nsec += wait_ns;
            if (until.tv_nsec >= 1000000000L) {
                until.tv_sec++;
                until.tv_nsec -= 1000000000L;
            }
            pthread_cond_timedwait(&n->cv, &n->mu, &until);
        }
        pthread_mutex_unlock(&n->mu);
    }
    /* Shutting down: end every live request, let the engine settle. */
    pd_engine_abort_all(n->eng);
    for (int i = 0; i < 20000 && !pd_engine_idle(n->eng); i++) {
        pd_engine_step(n->eng, node_now_us());
        struct timespec ts = {0, 100000};
        nanosleep(&ts, NULL);
    }
    free(batch);
    return NULL;
}

/* ---- info and metrics (scheduler thread) --------------------------------------------- */

/* The engine's configuration, as /server_info reports it. */
static json_t *info_config(pd_node *n) {
    const pd_engine_config *ec = pd_engine_config_of(n->eng);
    json_t *cfg = json_object();
    json_object_set_new(cfg, "page_size", json_integer(ec->page_size));
    json_object_set_new(cfg, "kv_pages", json_integer(ec->kv_pages));
    json_object_set_new(cfg, "max_total_tokens",
                        json_integer((json_int_t)ec->kv_pages * ec->page_size));
    json_object_set_new(cfg, "max_running_requests", json_integer(ec->rows));
    json_object_set_new(cfg, "mamba_slots", json_integer(ec->mamba_slots));
    json_object_set_new(cfg, "meta_rows", json_integer(ec->meta_rows));
    json_object_set_new(cfg, "host_pages", json_integer(ec->host_pages));
    json_object_set_new(cfg, "chunked_prefill_size", json_integer(ec->chunk_tokens));
    json_object_set_new(cfg, "max_prompt_tokens", json_integer(ec->prompt_tokens_max));
    json_object_set_new(cfg, "context_length", json_integer(n->cfg.context_length));
    json_object_set_new(cfg, "max_new_tokens", json_integer(ec->new_tokens_max));
    json_object_set_new(cfg, "overlap", json_boolean(ec->overlap));
    json_object_set_new(cfg, "prefix_cache", json_boolean(ec->prefix_cache));
    json_object_set_new(cfg, "optimistic_attempts", json_integer(ec->optimistic_attempts));
    json_object_set_new(cfg, "strict", json_boolean(ec->strict));
    json_object_set_new(cfg, "model_layers", json_string(pd_model_config_get(n->model)->layers));
    pd_exec_memory mem; /* what one hand-off moves per page and per room */
    n->model_ex.vt->memory(n->model_ex.self, &mem);
    json_object_set_new(cfg, "kv_page_bytes", json_integer((json_int_t)mem.kv_page_bytes));
    json_object_set_new(cfg, "mamba_slot_bytes", json_integer((json_int_t)mem.mamba_slot_bytes));
    const char *backend = n->cfg.role == PD_NODE_SERVE ? "none" : n->cfg.transfer_backend;
    json_object_set_new(cfg, "transfer_backend", json_string(backend));
    return cfg;
}

/* The engine's counters and the node's count of failed ownership checks. */
static json_t *info_counters(pd_node *n) {
    pd_engine_counters c;
    pd_engine_counters_get(n->eng, &c);
    json_t *ctr = json_object();
#define CTR(name) json_object_set_new(ctr, #name, json_integer((json_int_t)c.name))
    CTR(submitted); CTR(rejected); CTR(finished); CTR(aborted); CTR(failed); CTR(batches);
    CTR(prefill_tokens); CTR(decode_tokens); CTR(cached_tokens); CTR(xfer_abort_errors);
    CTR(rooms_cancelled); CTR(retire_deferred); CTR(requeued); CTR(late_results_ignored);
    CTR(queued_bootstrap); CTR(queued_waiting); CTR(loading); CTR(running); CTR(parked);
    CTR(transferring); CTR(draining); CTR(prealloc); CTR(wait_transfer);
#undef CTR
    json_object_set_new(ctr, "ownership_violations", json_integer((json_int_t)n->violations));
    return ctr;
}

static char *info_json(pd_node *n) {
    json_t *root = json_object();
    json_object_set_new(root, "role", json_string(pd_node_role_name(n->cfg.role)));
    json_object_set_new(root, "version", json_string(PD_VERSION));
    json_object_set_new(root, "config", info_config(n));
    json_object_set_new(root, "counters", info_counters(n));
    char *rep = malloc(1 << 20);
    pd_strbuf sb;
    pd_strbuf_init(&sb, rep, 1 << 20);
    pd_engine_report(n->eng, PD_REPORT_JSON, &sb);
    json_t *pools = json_loads(rep, 0, NULL);
    json_object_set_new(root, "pools", pools ? pools : json_null());
    bool idle = pd_engine_idle(n->eng);
    json_object_set_new(root, "idle", json_boolean(idle));
    if (idle) {
        pd_strbuf_reset(&sb);
        bool clean = pd_engine_check(n->eng, &sb) == PD_OK;
        json_object_set_new(root, "idle_clean", json_boolean(clean));
        if (sb.len) json_object_set_new(root, "idle_report", json_string(rep));
    }
    free(rep);
    char *out = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    return out;
}

/* Requests by state and by outcome, and the rooms still draining. */
static void metrics_requests(pd_strbuf *t, const pd_engine_counters *c, const char *role) {
    pd_strbuf_printf(t,
                     "# HELP pdserve_requests_running "
                     "Requests computing (prefill chunks or decoding).\n"
                     "# TYPE pdserve_requests_running gauge\n"
                     "pdserve_requests_running{role=\"%s\"} %u\n",
                     role, c->running);
    pd_strbuf_printf(t,
                     "# HELP pdserve_requests_queued Requests waiting, by queue.\n"
                     "# TYPE pdserve_requests_queued gauge\n");
    pd_strbuf_printf(t, "pdserve_requests_queued{queue=\"bootstrap\"} %u\n", c->queued_bootstrap);
    pd_strbuf_printf(t, "pdserve_requests_queued{queue=\"waiting\"} %u\n", c->queued_waiting);
    pd_strbuf_printf(t, "pdserve_requests_queued{queue=\"prealloc\"} %u\n", c->prealloc);
    pd_strbuf_printf(t, "pdserve_requests_queued{queue=\"wait_transfer\"} %u\n", c->wait_transfer);
    pd_strbuf_printf(t, "pdserve_requests_queued{queue=\"loading\"} %u\n", c->loading);
    pd_strbuf_printf(t,
                     "# HELP pdserve_requests_transferring Requests handing over (prefill).\n"
                     "# TYPE pdserve_requests_transferring gauge\n"
                     "pdserve_requests_transferring %u\n",
                     c->transferring + c->parked);
    pd_strbuf_printf(t,
                     "# HELP pdserve_rooms_draining "
                     "Retired requests whose room may still touch memory.\n"
                     "# TYPE pdserve_rooms_draining gauge\n"
                     "pdserve_rooms_draining %u\n",
                     c->draining);
    pd_strbuf_printf(t,
                     "# HELP pdserve_requests_total Requests by outcome.\n"
                     "# TYPE pdserve_requests_total counter\n");
    pd_strbuf_printf(t, "pdserve_requests_total{outcome=\"finished\"} %llu\n",
                     (unsigned long long)c->finished);
    pd_strbuf_printf(t, "pdserve_requests_total{outcome=\"aborted\"} %llu\n",
                     (unsigned long long)c->aborted);
    pd_strbuf_printf(t, "pdserve_requests_total{outcome=\"failed\"} %llu\n",
                     (unsigned long long)c->failed);
    pd_strbuf_printf(t, "pdserve_requests_total{outcome=\"rejected\"} %llu\n",
                     (unsigned long long)c->rejected);
}

/* Tokens computed, transport failures and rooms cancelled. */
static void metrics_work(pd_strbuf *t, const pd_engine_counters *c) {
    pd_strbuf_printf(t,
                     "# HELP pdserve_tokens_total Tokens computed.\n"
                     "# TYPE pdserve_tokens_total counter\n");
    pd_strbuf_printf(t, "pdserve_tokens_total{kind=\"prefill\"} %llu\n",
                     (unsigned long long)c->prefill_tokens);
    pd_strbuf_printf(t, "pdserve_tokens_total{kind=\"decode\"} %llu\n",
                     (unsigned long long)c->decode_tokens);
    pd_strbuf_printf(t, "pdserve_tokens_total{kind=\"cached\"} %llu\n",
                     (unsigned long long)c->cached_tokens);
    pd_strbuf_printf(t,
                     "# HELP pdserve_transfer_failures_total "
                     "Transport abort() calls that reported an error.\n"
                     "# TYPE pdserve_transfer_failures_total counter\n"
                     "pdserve_transfer_failures_total %llu\n",
                     (unsigned long long)c->xfer_abort_errors);
    pd_strbuf_printf(t,
                     "# HELP pdserve_rooms_cancelled_total "
                     "Requests that ended before opening their room; the peer was told.\n"
                     "# TYPE pdserve_rooms_cancelled_total counter\n"
                     "pdserve_rooms_cancelled_total %llu\n",
                     (unsigned long long)c->rooms_cancelled);
}

/* Units of every pool of the ledger, by ownership state. */
static void metrics_pools(pd_strbuf *t, pd_ledger *l) {
    pd_strbuf_printf(t,
                     "# HELP pdserve_pool_units Units of each pool by ownership state.\n"
                     "# TYPE pdserve_pool_units gauge\n");
    for (int pid = 0; pid < pd_ledger_pool_count(l); pid++) {
        const char *pname = pd_pool_name(pd_ledger_pool(l, pid));
        for (int st = 0; st < PD_UNIT_STATE__COUNT; st++)
            pd_strbuf_printf(t, "pdserve_pool_units{pool=\"%s\",state=\"%s\"} %llu\n", pname,
                             pd_unit_state_name((pd_unit_state)st),
                             (unsigned long long)pd_ledger_count(l, pid, (pd_unit_state)st));
    }
}

/* The Prometheus text, malloc'd; NULL if it does not fit METRICS_TEXT_BYTES
 * (the client gets an error, never metrics cut short). */
static char *metrics_text(pd_node *n) {
    char *text = malloc(METRICS_TEXT_BYTES);
    if (!text) return NULL;
    pd_strbuf t;
    pd_strbuf_init(&t, text, METRICS_TEXT_BYTES);
    pd_engine_counters c;
    pd_engine_counters_get(n->eng, &c);
    metrics_requests(&t, &c, pd_node_role_name(n->cfg.role));
    metrics_work(&t, &c);
    metrics_pools(&t, pd_engine_ledger(n->eng));
    node_metrics_text(n->metrics, &t, &c, pd_engine_ledger(n->eng), node_now_us());
    pd_strbuf_printf(&t,
                     "# HELP pdserve_ownership_violations_total "
                     "Failed ownership checks (strict mode).\n"
                     "# TYPE pdserve_ownership_violations_total counter\n"
                     "pdserve_ownership_violations_total %llu\n",
                     (unsigned long long)n->violations);
    if (t.truncated) {
        free(text);
        return NULL;
    }
    PD_ASSERT(t.len < METRICS_TEXT_BYTES && text[t.len] == '\0');
    return text;
}

/* ---- create / start / destroy -------------------------------------------------------- */

static const char *own(pd_node *n, int slot, const char *s) {
    if (!s) return NULL;
    n->strings[slot] = strdup(s);
    return n->strings[slot];
}

/* The node keeps its own copies of the configuration's strings: the caller's
 * may go away once pd_node_create returns. */
static void own_config_strings(pd_node *n) {
    pd_node_config *c = &n->cfg;
    c->host = own(n, 0, c->host);
    c->served_model_name = own(n, 1, c->served_model_name);
    c->model_dir = own(n, 2, c->model_dir);
    c->model_preset = own(n, 3, c->model_preset);
    c->layers = own(n, 4, c->layers);
    c->transfer_backend = own(n, 5, c->transfer_backend);
    c->bootstrap_host = own(n, 6, c->bootstrap_host);
    c->bootstrap_token = own(n, 7, c->bootstrap_token);
    c->prefill_peers = own(n, 8, c->prefill_peers);
    c->api_key = own(n, 9, c->api_key);
    c->chat_template_path = own(n, 10, c->chat_template_path);
    /* The bootstrap channel listens where the HTTP port does unless told. */
    if (!c->bootstrap_host) c->bootstrap_host = c->host;
}

static bool is_loopback_host(const char *h) {
    return !strncmp(h, "127.", 4) || !strcmp(h, "::1") || !strcmp(h, "localhost");
}

/* A prefill node's bootstrap channel hands what a peer sends to UCX, which
 * trusts it: beyond this host, only with a token, or when told to. */
static pd_err check_bootstrap_exposure(const pd_node_config *c, char *msg, size_t cap) {
    if (c->role != PD_NODE_PREFILL || strcmp(c->transfer_backend, "ucx") != 0) return PD_OK;
    if (is_loopback_host(c->bootstrap_host) || c->bootstrap_token || c->insecure_bootstrap)
        return PD_OK;
    return pd_errorf(msg, cap, PD_ERR_INVALID,
                     "the bootstrap channel would listen on %s without a token, so anyone who "
                     "can reach it could talk to UCX on this node: give --bootstrap-token "
                     "SECRET (the same on the decode nodes), or --insecure-bootstrap to accept "
                     "that",
                     c->bootstrap_host);
}

/* The model: loaded from --model, or a built-in configuration with dummy
 * weights, its layer pattern optionally replaced by --layers. */
/* The model directory's tokenizer.json (and tokenizer_config.json's begin
 * and end tokens), when it has one; its ids must be the model's. */
static pd_err load_tokenizer(pd_node *n, char *msg, size_t cap) {
    return pd_hf_tokenizer_load_dir(n->cfg.model_dir, node_vocab(n), &n->tok, msg, cap);
}

/* A file's text, malloc'd (NUL-terminated), at most max bytes. */
static char *read_text(const char *path, size_t max, size_t *len, char *msg, size_t cap) {
    FILE *f = fopen(path, "rb");
    char *buf = f ? malloc(max + 1) : NULL;
    *len = buf ? fread(buf, 1, max + 1, f) : 0;
    if (f) fclose(f);
    if (!buf || *len > max) {
        pd_errorf(msg, cap, !f ? PD_ERR_IO : PD_ERR_TOOBIG, "%s: %s", path,
                  !f ? strerror(errno) : "too large");
        free(buf);
        return NULL;
    }
    buf[*len] = '\0';
    return buf;
}

/* The chat template: --chat-template FILE, else tokenizer_config.json's
 * "chat_template" (a string, or a list of {name, template}: "default"). */
static pd_err load_chat_template(pd_node *n, char *msg, size_t cap) {
    const pd_node_config *c = &n->cfg;
    char path[4096], why[256];
    size_t len = 0;
    char *src = NULL;
    json_t *cfg = NULL;
    if (c->chat_template_path) {
        snprintf(path, sizeof path, "%s", c->chat_template_path);
        src = read_text(path, PD_CHAT_TEMPLATE_SOURCE_MAX, &len, msg, cap);
        if (!src) return PD_ERR_IO;
    } else {
        if (!c->model_dir) return PD_OK;
        snprintf(path, sizeof path, "%s/tokenizer_config.json", c->model_dir);
        json_error_t jerr;
        cfg = access(path, F_OK) == 0 ? json_load_file(path, 0, &jerr) : NULL;
        json_t *t = json_object_get(cfg, "chat_template");
        for (size_t i = 0; json_is_array(t) && i < json_array_size(t); i++) {
            json_t *e = json_array_get(t, i);
            const char *name = json_string_value(json_object_get(e, "name"));
            if (name && !strcmp(name, "default")) t = json_object_get(e, "template");
        }
        if (!json_is_string(t)) {
            json_decref(cfg);
            return PD_OK; /* none: chat requests use the built-in template */
        }
        src = strdup(json_string_value(t));
        len = src ? strlen(src) : 0;
    }
    json_decref(cfg);
    pd_err err = src ? pd_chat_template_compile(src, len, &n->chat, why, sizeof why) : PD_ERR_NOMEM;
    if (err) pd_errorf(msg, cap, err, "%s: %s", path, src ? why : "out of memory");
    free(src);
    return err;
}

static pd_err create_weights(pd_node *n, char *msg, size_t cap) {
    const pd_node_config *c = &n->cfg;
    if (c->model_dir) {
        pd_err err = pd_model_load(&n->model, c->model_dir, msg, cap);
        return err ? err : load_tokenizer(n, msg, cap);
    }
    pd_model_config mc;
    pd_err err = pd_model_config_preset(&mc, c->model_preset ? c->model_preset : "tiny", msg, cap);
    if (!err && c->layers) {
        if (strlen(c->layers) > PD_MODEL_LAYERS_MAX) {
            err = pd_errorf(msg, cap, PD_ERR_INVALID, "--layers: at most %d layers",
                            PD_MODEL_LAYERS_MAX);
        } else {
            snprintf(mc.layers, sizeof(mc.layers), "%s", c->layers);
            err = pd_model_config_check(&mc, msg, cap);
        }
    }
    if (!err) err = pd_model_create_random(&n->model, &mc, c->seed, msg, cap);
    return err;
}

/* The model, its tokenizer and its chat template. */
static pd_err create_model(pd_node *n, char *msg, size_t cap) {
    pd_err err = create_weights(n, msg, cap);
    return err ? err : load_chat_template(n, msg, cap);
}

/* The flags that size the pools and queues. */
static pd_err check_sizes(const pd_node_config *c, char *msg, size_t cap) {
    if (c->page_size == 0 || c->page_size > 4096)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "--page-size must be in [1, 4096]");
    if (c->max_total_tokens < c->page_size || c->max_running_requests == 0 ||
        c->chunked_prefill_size == 0 || c->max_queued_requests == 0 || c->max_prompt_tokens == 0 ||
        c->max_new_tokens_limit == 0)
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "--max-total-tokens (>= page size), --max-running-requests, "
                         "--chunked-prefill-size, --max-queued-requests, --max-prompt-tokens and "
                         "--max-new-tokens must be positive");
    return PD_OK;
}

static pd_role engine_role(pd_node_role r) {
    switch (r) {
    case PD_NODE_PREFILL: return PD_ROLE_PREFILL;
    case PD_NODE_DECODE: return PD_ROLE_DECODE;
    case PD_NODE_SERVE: break;
    }
    return PD_ROLE_COLOCATED;
}

/* The engine's configuration from the flags and the model's shape (all but
 * meta_mem, which the node allocates from it). */
static void engine_config_from(const pd_node_config *c, const pd_model_shape *shape,
                               pd_engine_config *ec) {
    pd_role role = engine_role(c->role);
    pd_engine_config_default(ec, role);
    ec->page_size = c->page_size;
    ec->kv_pages = PD_DIV_CEIL(c->max_total_tokens, c->page_size);
    ec->rows = c->max_running_requests;
    ec->mamba_slots = shape->n_mamba ? ec->rows * 4 + 4 : 0;
    ec->requests_max = c->max_queued_requests;
    ec->meta_rows = role == PD_ROLE_PREFILL ? c->max_queued_requests : ec->rows * 2;
    ec->host_pages = c->host_cache_tokens / c->page_size;
    ec->chunk_tokens = c->chunked_prefill_size;
    ec->batch_max = PD_MIN(PD_MAX(ec->rows, 8u), 256u);
    ec->prompt_tokens_max = c->max_prompt_tokens;
    ec->new_tokens_max = c->max_new_tokens_limit;
    if (c->context_length > 1) { /* no request holds more (http.c refuses it) */
        ec->prompt_tokens_max = PD_MIN(ec->prompt_tokens_max, c->context_length - 1);
        ec->new_tokens_max = PD_MIN(ec->new_tokens_max, c->context_length - 1);
    }
    ec->overlap = !c->disable_overlap;
    ec->optimistic_attempts = c->optimistic_attempts;
    ec->prefix_cache = !c->disable_prefix_cache;
    ec->strict = c->strict;
    ec->bootstrap_timeout_us = c->bootstrap_timeout_ms * 1000;
    ec->transfer_timeout_us = c->transfer_timeout_ms * 1000;
}

/* Memory a transfer moves (KV pages, Mamba slots, meta rows) comes from the
 * transport when it allocates it in a faster form than the heap
 * (pd_net_allocator; docs/bootstrap-protocol.md, "Memory"). NULL: the heap. */
static const pd_exec_alloc *transfer_alloc(pd_node *n) {
    if (n->net && !n->net_alloc.alloc) n->net_alloc = pd_net_allocator(n->net);
    return n->net ? &n->net_alloc : NULL;
}

/* Everything the node sizes at start-up: the meta rows, the calls by slot
 * (every slot free), the command ring and (strict mode) the report buffer. */
static pd_err alloc_tables(pd_node *n, const pd_engine_config *ec, char *msg, size_t cap) {
    n->meta_rows = ec->meta_rows;
    const pd_exec_alloc *a = transfer_alloc(n);
    n->meta = a ? a->alloc(a->self, (size_t)ec->meta_rows * sizeof(pd_meta_row))
                : calloc(ec->meta_rows, sizeof(pd_meta_row));
    n->requests_max = ec->requests_max;
    n->calls = calloc(ec->requests_max, sizeof(call *));
    n->free_slots = calloc(ec->requests_max, sizeof(uint32_t));
    n->cmds = calloc(CMDS_MAX, sizeof(cmd));
    if (n->cfg.strict) n->strict_report = calloc(1, STRICT_REPORT_BYTES);
    if (!n->meta || !n->calls || !n->free_slots || !n->cmds || (n->cfg.strict && !n->strict_report))
        return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    /* Slot 0 on top: the first call gets tag 0. */
    for (uint32_t i = 0; i < ec->requests_max; i++) slot_give(n, ec->requests_max - 1 - i);
    return PD_OK;
}

/* The executor: the model behind an in-order stream with its own worker. */
static pd_err create_executor(pd_node *n, const pd_engine_config *ec, char *msg, size_t cap) {
    uint32_t threads = n->cfg.threads ? n->cfg.threads : 1;
    pd_err err = pd_model_executor_create_in(&n->model_ex, n->model, ec->page_size, ec->kv_pages,
                                             ec->mamba_slots, ec->host_pages, threads,
                                             transfer_alloc(n), msg, cap);
    if (err) return err;
    if ((err = pd_stream_create(&n->stream, n->model_ex, ec->batch_max)))
        pd_errorf(msg, cap, err, "executor stream: out of memory");
    return err;
}

static pd_lb_side loopback_side(pd_role role) {
    return role == PD_ROLE_PREFILL ? PD_LB_PREFILL : PD_LB_DECODE;
}

/* The transport of a prefill or decode node: the in-process loopback fabric
 * (pdserve run) or UCX; a colocated node has none (*xfer stays empty). */
static pd_err create_transport(pd_node *n, pd_role role, pd_xfer *xfer, char *msg, size_t cap) {
    const pd_node_config *c = &n->cfg;
    if (role == PD_ROLE_COLOCATED) return PD_OK;
    if (!strcmp(c->transfer_backend, "loopback")) {
        if (!c->loopback)
            return pd_errorf(msg, cap, PD_ERR_INVALID,
                             "--transfer-backend loopback joins a prefill and a decode node "
                             "inside one process (pdserve run); separate processes need "
                             "--transfer-backend ucx");
        *xfer = pd_loopback_mt_endpoint(c->loopback, loopback_side(role));
        return PD_OK;
    }
    if (!strcmp(c->transfer_backend, "ucx")) {
        pd_net_config nc = {
            .role = role == PD_ROLE_PREFILL ? PD_NET_PREFILL : PD_NET_DECODE,
            .listen_host = c->bootstrap_host,
            .bootstrap_port = c->bootstrap_port,
            .token = c->bootstrap_token,
            .page_size = c->page_size,
            .rooms_max = c->max_queued_requests * 2 + 64,
            .copy_threads = c->transfer_copy_threads,
        };
        pd_err err = pd_net_create(&n->net, &nc, msg, cap);
        if (err) return err;
        *xfer = pd_net_endpoint(n->net);
        return PD_OK;
    }
    return pd_errorf(msg, cap, PD_ERR_INVALID, "unknown --transfer-backend '%s' (loopback or ucx)",
                     c->transfer_backend);
}

/* The executor's memory and the meta rows, registered with the transport so
 * that transfers can reach them. */
static pd_err register_memory(pd_node *n, pd_role role, char *msg, size_t cap) {
    const pd_node_config *c = &n->cfg;
    pd_exec_memory mem;
    n->model_ex.vt->memory(n->model_ex.self, &mem);
    if (role != PD_ROLE_COLOCATED && c->loopback && !strcmp(c->transfer_backend, "loopback"))
        pd_loopback_mt_register(c->loopback, loopback_side(role), &mem, n->meta, n->meta_rows);
    if (n->net) return pd_net_register(n->net, &mem, n->meta, n->meta_rows, msg, cap);
    return PD_OK;
}

pd_err pd_node_create(pd_node **out, const pd_node_config *cfg_in, char *msg, size_t cap) {
    if (!out || !cfg_in) return pd_errorf(msg, cap, PD_ERR_INVALID, "no configuration");
    *out = NULL;
    pd_node *n = calloc(1, sizeof(*n));
    if (!n) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    n->cfg = *cfg_in;
    own_config_strings(n);
    pd_err exposed = check_bootstrap_exposure(&n->cfg, msg, cap);
    if (exposed) {
        for (int i = 0; i < NODE_STRINGS; i++) free(n->strings[i]);
        free(n);
        return exposed;
    }
    pthread_mutex_init(&n->mu, NULL);
    pthread_cond_init(&n->cv, NULL);
    atomic_init(&n->stopping, false);
    atomic_init(&n->rid_counter, 0);
    n->metrics = node_metrics_new(n->cfg.role, n->cfg.served_model_name);
    pd_err err = n->metrics ? create_model(n, msg, cap)
                            : pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    if (!err) err = check_sizes(&n->cfg, msg, cap);
    if (err) goto fail;
    pd_role role = engine_role(n->cfg.role);
    pd_engine_config ec;
    engine_config_from(&n->cfg, pd_model_shape_get(n->model), &ec);
    /* The transport first: it may allocate the memory it moves. */
    pd_xfer xfer = {0};
    if ((err = create_transport(n, role, &xfer, msg, cap))) goto fail;
    if ((err = alloc_tables(n, &ec, msg, cap))) goto fail;
    ec.meta_mem = n->meta;
    if ((err = create_executor(n, &ec, msg, cap))) goto fail;
    pd_sink sink = {.vt = &node_sink_vt, .self = n};
    err = pd_engine_create(&n->eng, &ec, pd_stream_executor(n->stream), xfer, sink, msg, cap);
    if (!err) err = register_memory(n, role, msg, cap);
    if (err) goto fail;
    *out = n;
    return PD_OK;
fail:
    pd_node_destroy(n);
    return err;
}

pd_err pd_node_start(pd_node *n, char *msg, size_t cap) {
    pd_err err = pd_stream_start_worker(n->stream);
    if (err) return pd_errorf(msg, cap, err, "could not start the executor worker");
    if (n->net && (err = pd_net_start(n->net, msg, cap))) return err;
    if (pthread_create(&n->sched, NULL, sched_main, n) != 0)
        return pd_errorf(msg, cap, PD_ERR_NOMEM, "could not start the scheduler thread");
    n->sched_running = true;
    return http_start(n, &n->http, &n->http_port, msg, cap);
}

uint16_t pd_node_http_port(const pd_node *n) { return n->http_port; }
uint16_t pd_node_bootstrap_port(const pd_node *n) {
    if (n->net) return pd_net_bootstrap_port(n->net);
    return n->cfg.bootstrap_port;
}

void pd_node_destroy(pd_node *n) {
    if (!n) return;
    pthread_mutex_lock(&n->mu);
    atomic_store(&n->stopping, true);
    pthread_cond_signal(&n->cv);
    pthread_mutex_unlock(&n->mu);
    /* The scheduler first: it aborts everything live before it exits, and
     * stopping refuses new commands (an HTTP request gets a 503). The HTTP
     * side keeps answering meanwhile, and goes last, once every call has
     * ended, so it can still send each its final answer. */
    if (n->sched_running) pthread_join(n->sched, NULL);
    /* Commands that arrived after the scheduler's last look. */
    for (uint32_t i = 0; i < n->cmd_n; i++) {
        cmd *q = &n->cmds[(n->cmd_head + i) % CMDS_MAX];
        if (q->c) {
            pthread_mutex_lock(&q->c->mu);
            q->c->submitted = true;
            q->c->submit_err = PD_ERR_STATE;
            q->c->reject.status = 503;
            snprintf(q->c->reject.message, sizeof(q->c->reject.message),
                     "the server is shutting down");
            call_changed(q->c);
            pthread_mutex_unlock(&q->c->mu);
            call_unref(q->c);
        }
        if (q->reply) reply_done(q->reply, 0, NULL);
    }
    /* Anything the engine could not end in time ends here, so no HTTP
     * exchange waits forever. */
    if (n->calls)
        for (uint32_t i = 0; i < n->requests_max; i++) {
            call *c = n->calls[i];
            if (!c) continue;
            pthread_mutex_lock(&c->mu);
            if (!c->done) {
                c->done = true;
                c->kind = PD_TERM_FAILED;
                c->status = 503;
                snprintf(c->message, sizeof(c->message), "the server is shutting down");
            }
            call_changed(c);
            pthread_mutex_unlock(&c->mu);
            call_unref(c);
            n->calls[i] = NULL;
        }
    if (n->http) http_stop(n->http);
    pd_engine_destroy(n->eng);
    pd_stream_destroy(n->stream);
    if (n->model_ex.vt) pd_model_executor_destroy(&n->model_ex);
    const pd_exec_alloc *a = transfer_alloc(n);
    if (a) a->free(a->self, n->meta);
    else free(n->meta);
    n->meta = NULL;
    /* After the engine (it may still call the endpoint) and after everyone
     * who holds memory the transport allocated. */
    pd_net_destroy(n->net);
    pd_model_destroy(n->model);
    pd_hf_tokenizer_free(n->tok);
    pd_chat_template_free(n->chat);
    free(n->calls);
    free(n->free_slots);
    free(n->cmds);
    free(n->strict_report);
    node_metrics_free(n->metrics);
    for (int i = 0; i < NODE_STRINGS; i++) free(n->strings[i]);
    pthread_mutex_destroy(&n->mu);
    pthread_cond_destroy(&n->cv);
    free(n);
}
