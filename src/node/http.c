/*
 * http.c — the HTTP API of a node (docs/http-api.md) on the project's own
 * server (pd_http_server, docs/http-server.md).
 *
 * Three threads meet here, and none ever waits for another:
 *   - the server's loop thread owns the sockets and runs on_request for each
 *     complete, valid request. It answers what needs nobody else (404, 405,
 *     /health, a node that is stopping) and hands the rest to the responder
 *     as an exchange;
 *   - the responder thread parses each body (jansson, checked field by
 *     field: a wrong type is a 400 naming the field), queues the engine
 *     request or the command for the scheduler, and writes the answer once
 *     the scheduler has produced it: whole, or as server-sent events while
 *     the tokens come;
 *   - the scheduler thread (node.c) appends outputs to a call and calls the
 *     call's wake hook, which only puts the exchange on the ready list.
 *
 * An exchange is one request being answered: a slot in a table sized at
 * start, run by the responder as a small state machine. Wakes move it on:
 * from the scheduler (the submit's outcome, a token, the end, a command's
 * reply) and from the loop (PD_HTTP_REQ_GONE: the client left;
 * PD_HTTP_REQ_WRITABLE: its backlog drained after a refused write). A wake
 * puts the exchange on the ready list once, and the responder then looks at
 * everything afresh, so wakes may come early, late or merged.
 *
 * Invariants:
 *   X1  An exchange is free (on the free list) or in use. In use, it holds a
 *       reference to its request handle, and one to its call once it has one.
 *   X2  Only the responder touches an exchange in use, except `queued` and
 *       `retired`, which live under h->mu. It is on the ready list exactly
 *       while `queued`.
 *   X3  An exchange is retired only once nothing can wake it any more: its
 *       watch cleared (pd_http_req_watch waits out a callback running on the
 *       loop), its call's hook cleared under the call's mutex, its command's
 *       reply seen ready. It is then freed at once, or by the responder when
 *       it pops it, if it was still queued.
 *   X4  A client that leaves before its answer has ended has its request
 *       aborted (CMD_ABORT), once, and only after the engine accepted it:
 *       until then its rid may still name another client's live request.
 *   X5  Nothing is dropped under back-pressure: an event that stream_write
 *       refuses (the backlog is over the watermark) is kept and sent first
 *       on the next wake; the tokens that arrive meanwhile go into the
 *       event after it.
 */
#define _GNU_SOURCE
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gen.h"
#include "node_internal.h"
#include "pdserve/http_server.h"
#include "pdserve/list.h"
#include "pdserve/tokenizer.h"

/* Open client connections (the limit libmicrohttpd had here). All of them may
 * come from one address: a router's connections to its nodes all do. */
#define HTTP_CONNECTIONS_MAX 4096u
/* Exchanges: one per connection waiting for its answer, plus those whose
 * client left while their command was still queued for the scheduler (at
 * most its queue's 4096); more is answered with 503. */
#define HTTP_EXCHANGES (2u * HTTP_CONNECTIONS_MAX)

/* ---- exchanges ------------------------------------------------------------------------- */

typedef enum ex_kind {
    EX_GENERATE,
    EX_COMPLETIONS,
    EX_CHAT,
    EX_ABORT,
    EX_INFO,
    EX_METRICS,
    EX_HEALTH,
    EX_MODELS,     /* /v1/models and /v1/models/{id} */
    EX_MODEL_INFO, /* the SGLang endpoints of sglang_api.c */
    EX_TOKENIZE,   /*   /tokenize and /detokenize */
    EX_FLUSH,
    EX_HEALTH_GEN,
    EX_FEED /* GET /stream_feed: the events of the streams attached to it */
} ex_kind;

typedef enum ex_state {
    EX_FREE,       /* on the free list */
    EX_NEW,        /* handed over by the loop, not looked at yet */
    EX_SUBMITTING, /* generate: the scheduler has not taken or refused the call yet */
    EX_WAITING,    /* generate, whole answer: until the terminal event */
    EX_STREAMING,  /* generate, event stream: an event per wake while tokens come */
    EX_REPLY,      /* abort, info, metrics: until the scheduler's reply */
    EX_FEEDING,    /* a stream feed: open until its client leaves or the node stops */
} ex_state;

typedef struct exchange {
    http_server *h;
    pd_http_req *r;
    ex_kind kind;
    ex_state state;
    bool queued, retired; /* h->mu (X2) */
    pd_link link;         /* the free list or the ready list (h->mu) */
    /* generate */
    gen_params p;   /* p.stop is the submits' spec until the engine copied it */
    gen_choice *ch; /* n_ch choices, each with its call */
    uint32_t n_ch;
    uint32_t n_queued;     /* calls handed to the scheduler (the first n_queued) */
    unsigned queue_status; /* 429 or 503 when the queue refused the next one */
    uint32_t next;         /* streams: the choice to look at first (they take turns) */
    uint64_t created;      /* OpenAI "created" */
    bool sent_done;
    char *ev; /* the next event, kept while stream_write refuses it (X5) */
    size_t ev_len;
    /* a stream sent through a feed (F1-F4): `fed` from the submit on; `feed`
     * NULL once the feed closed (`feed_lost`); linked on feed->attached */
    bool fed, feed_lost;
    char tag[PD_RID_MAX]; /* what its frames carry: "stream_feed_tag", else the rid */
    struct exchange *feed;
    pd_link feed_link;
    /* a feed: its id's sequence number, the streams writing to it, and
     * whether it must close (a stream could not write its end to it) */
    uint64_t feed_seq;
    pd_list attached;
    bool feed_closing;
    bool is_feed; /* h->mu: http_stop wakes every feed */
    /* abort */
    char rid[PD_RID_MAX];
    /* abort, info, metrics */
    cmd_kind cmd;
    cmd_reply reply;
    bool reply_set; /* reply's mutex and condition exist */
} exchange;

struct http_server {
    pd_node *n;
    pd_http_server *srv;
    exchange *ex;
    uint32_t ex_max;
    pthread_t thread;
    pthread_mutex_t mu; /* the lists, each exchange's queued and retired, stop */
    pthread_cond_t cv;  /* the ready list has work, or stop */
    pd_list free, ready;
    bool stop;
    uint64_t started;   /* Unix time: the served model's "created" */
    uint64_t feed_seq;  /* the last feed id's sequence number (responder) */
    uint64_t feeds_cut; /* h->mu: feeds up to this sequence number close */
    sgl_health *health; /* /health_generate's probes */
};

static pd_links ex_links(http_server *h) { return PD_LINKS(h->ex, exchange, link); }
static pd_links feed_links(http_server *h) { return PD_LINKS(h->ex, exchange, feed_link); }
static uint32_t ex_index(const exchange *e) { return (uint32_t)(e - e->h->ex); }

/* Under h->mu: on the ready list once (X2). */
static void ex_queue_locked(exchange *e) {
    http_server *h = e->h;
    if (e->queued) return;
    e->queued = true;
    pd_list_push_back(&h->ready, ex_links(h), ex_index(e));
    pthread_cond_signal(&h->cv);
}

/* From any thread, with no lock of ours held: the responder will look at e. */
static void ex_wake(void *ctx) {
    exchange *e = ctx;
    pthread_mutex_lock(&e->h->mu);
    PD_ASSERT(!e->retired); /* X3 */
    ex_queue_locked(e);
    pthread_mutex_unlock(&e->h->mu);
}

/* The loop's events (GONE, WRITABLE): either way, look again. */
static void ex_watch(pd_http_req *r, pd_http_req_event ev, void *user) {
    (void)r;
    (void)ev;
    ex_wake(user);
}

/* Under h->mu: back to the free list, every field reset. */
static void ex_free_locked(http_server *h, exchange *e) {
    PD_ASSERT(!e->queued);
    *e = (exchange){.h = h, .state = EX_FREE};
    pd_list_push_back(&h->free, ex_links(h), ex_index(e));
}

/* Takes a free exchange for r and queues it; false when none is free. */
static bool ex_start(http_server *h, pd_http_req *r, ex_kind kind) {
    pthread_mutex_lock(&h->mu);
    uint32_t i = h->free.head;
    if (i != PD_NONE) {
        pd_list_remove(&h->free, ex_links(h), i);
        exchange *e = &h->ex[i];
        PD_ASSERT(e->state == EX_FREE && !e->queued && !e->retired);
        e->state = EX_NEW;
        e->kind = kind;
        e->r = r;
        pd_http_req_retain(r);
        ex_queue_locked(e);
    }
    pthread_mutex_unlock(&h->mu);
    return i != PD_NONE;
}

/* A stream leaves its feed (F3), or a feed lets go of its streams (F4):
 * they see feed_lost and abort. A stopping node's feed closes once its
 * last stream has gone, so it is woken then. */
static void feed_detach(exchange *e) {
    http_server *h = e->h;
    if (e->kind == EX_FEED) {
        while (e->attached.len) {
            uint32_t i = e->attached.head;
            pd_list_remove(&e->attached, feed_links(h), i);
            h->ex[i].feed = NULL;
            h->ex[i].feed_lost = true;
        }
        pthread_mutex_lock(&h->mu);
        e->is_feed = false;
        pthread_mutex_unlock(&h->mu);
        return;
    }
    exchange *f = e->feed;
    if (!f) return;
    pd_list_remove(&f->attached, feed_links(h), ex_index(e));
    e->feed = NULL;
    if (f->attached.len == 0 && node_stopping(h->n)) ex_wake(f);
}

/* The end of an exchange (X3): nothing wakes it any more, its references are
 * dropped, and it is free (now, or once popped if still queued). */
static void ex_retire(exchange *e) {
    http_server *h = e->h;
    PD_ASSERT(e->state != EX_FREE && e->r != NULL);
    pd_http_req_watch(e->r, NULL, NULL);
    feed_detach(e);
    for (uint32_t i = 0; i < e->n_ch; i++) {
        call *c = e->ch[i].c;
        pthread_mutex_lock(&c->mu);
        c->wake = NULL;
        pthread_mutex_unlock(&c->mu);
        call_unref(c);
        gen_choice_free(&e->ch[i]);
    }
    free(e->ch);
    if (e->reply_set) {
        pthread_mutex_destroy(&e->reply.mu);
        pthread_cond_destroy(&e->reply.cv);
        free(e->reply.text);
    }
    gen_params_free(&e->p);
    free(e->ev);
    pd_http_req_release(e->r);
    pthread_mutex_lock(&h->mu);
    if (e->queued) e->retired = true;
    else ex_free_locked(h, e);
    pthread_mutex_unlock(&h->mu);
}

/* The project's error body as the answer, and the exchange's end. */
#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static void
ex_fail(exchange *e, unsigned status, const char *fmt, ...) {
    char message[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    pd_http_req_respond_error(e->r, status, "%s", message); /* PD_ERR_STATE: nobody to tell */
    ex_retire(e);
}

void node_respond_json(pd_http_req *r, unsigned status, json_t *o) {
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!text) {
        pd_http_req_respond_error(r, 503, "out of memory for the answer");
        return;
    }
    pd_http_req_respond_json(r, status, text, strlen(text));
    free(text);
}

static void abort_call(pd_node *n, call *c) {
    pthread_mutex_lock(&c->mu);
    bool send = !c->done && !c->aborting;
    c->aborting = true;
    pthread_mutex_unlock(&c->mu);
    if (send) node_command(n, CMD_ABORT, NULL, c->rid, NULL);
}

/* The client went before its answer was complete: the request is aborted,
 * and its log line says why (the node logs every hang-up). */
static void hang_up(pd_node *n, call *c) {
    pthread_mutex_lock(&c->mu);
    if (!c->done && !c->aborting) c->hung_up = true;
    pthread_mutex_unlock(&c->mu);
    abort_call(n, c);
}

/* Every choice's call that the engine accepted (X4: the others' rids may
 * name someone else's request), as hang-ups when the client left. */
static void ex_abort_calls(exchange *e, bool client_left) {
    for (uint32_t i = 0; i < e->n_queued; i++) {
        call *c = e->ch[i].c;
        pthread_mutex_lock(&c->mu);
        bool accepted = c->submitted && c->submit_err == PD_OK;
        pthread_mutex_unlock(&c->mu);
        if (!accepted) continue;
        if (client_left) hang_up(e->h->n, c);
        else abort_call(e->h->n, c);
    }
}

/* ---- outputs ----------------------------------------------------------------------- */

/* Turns every choice's new tokens into text; a choice whose stop string
 * matched has its request ended (aborted: the engine knows tokens, not
 * text). False when out of memory. */
static bool ex_feed(exchange *e) {
    for (uint32_t i = 0; i < e->n_ch; i++) {
        gen_choice *ch = &e->ch[i];
        call *c = ch->c;
        pthread_mutex_lock(&c->mu);
        uint32_t have = c->n_tokens;
        bool done = c->done;
        pthread_mutex_unlock(&c->mu);
        if (!gen_choice_feed(ch, &e->p, have, done)) return false;
        if (ch->stopped && !done) abort_call(e->h->n, c);
    }
    return true;
}

/* Tokens of the choice that count so far: up to a matched stop string, or
 * every one turned into text. */
static uint32_t ch_tokens(const gen_choice *ch) { return ch->stopped ? ch->kept : ch->fed; }

static json_t *ids_array(const int32_t *t, uint32_t from, uint32_t to) {
    json_t *a = json_array();
    for (uint32_t i = from; i < to; i++) json_array_append_new(a, json_integer(t[i]));
    return a;
}

/* SGLang's meta_info of a choice: final, the finish reason with what
 * matched; its logprobs for tokens [from, to) when asked. */
static json_t *meta_info(const exchange *e, const gen_choice *ch, bool final, uint32_t from,
                         uint32_t to) {
    const call *c = ch->c;
    json_t *m = json_object();
    json_object_set_new(m, "id", json_string(c->rid));
    if (final) {
        json_t *fr = json_object();
        json_object_set_new(fr, "type", json_string(gen_choice_finish(ch)));
        if (ch->stopped)
            json_object_set_new(fr, "matched", json_string(e->p.stops[ch->stopped - 1]));
        else if (c->kind == PD_TERM_FINISHED && c->finish == PD_FINISH_STOP && c->n_tokens)
            json_object_set_new(fr, "matched", json_integer(c->tokens[c->n_tokens - 1]));
        if (!ch->stopped && c->kind != PD_TERM_FINISHED) {
            json_object_set_new(fr, "message", json_string(c->message));
            json_object_set_new(fr, "status_code", json_integer(c->status));
        }
        json_object_set_new(m, "finish_reason", fr);
    } else {
        json_object_set_new(m, "finish_reason", json_null());
    }
    json_object_set_new(m, "prompt_tokens", json_integer(c->prompt_len));
    json_object_set_new(m, "completion_tokens", json_integer(ch_tokens(ch)));
    json_object_set_new(m, "cached_tokens", json_integer(c->cached_tokens));
    if (final)
        json_object_set_new(m, "e2e_latency",
                            json_real((double)(c->t_done_us - c->t_submit_us) / 1e6));
    gen_logprobs_generate(ch, &e->p, from, to, m);
    return m;
}

/* One /generate result (whole, or an event): text, output_ids, meta_info,
 * and the choice's index when there are several. */
static json_t *generate_object(const exchange *e, const gen_choice *ch, const char *text,
                               size_t len, uint32_t from, uint32_t to, bool final) {
    json_t *o = json_object();
    json_object_set_new(o, "text", json_stringn(text, len));
    json_object_set_new(o, "output_ids", ids_array(ch->c->tokens, from, to));
    pthread_mutex_lock(&ch->c->mu); /* the terminal event may be arriving */
    json_object_set_new(o, "meta_info", meta_info(e, ch, final, from, to));
    pthread_mutex_unlock(&ch->c->mu);
    if (e->n_ch > 1) json_object_set_new(o, "index", json_integer(ch->index));
    return o;
}

/* An OpenAI choice: completions' text, or chat's message (whole) or delta
 * (streamed; the role in each choice's first chunk). */
static json_t *openai_choice(const exchange *e, gen_choice *ch, const char *text, size_t len,
                             uint32_t from, uint32_t to, bool final) {
    json_t *fin = final ? json_string(gen_choice_finish(ch)) : json_null();
    json_t *lp = gen_logprobs_openai(ch, &e->p, from, to);
    json_t *o;
    if (e->p.api == GEN_API_CHAT) {
        json_t *msg = json_pack("{s:s%}", "content", text, len);
        if (!e->p.stream || !ch->began) json_object_set_new(msg, "role", json_string("assistant"));
        o = json_pack("{s:i,s:o,s:o,s:o}", "index", ch->index, e->p.stream ? "delta" : "message",
                      msg, "finish_reason", fin, "logprobs", lp);
    } else {
        o = json_pack("{s:i,s:s%,s:o,s:o}", "index", ch->index, "text", text, len, "finish_reason",
                      fin, "logprobs", lp);
    }
    ch->began = true;
    return o;
}

static json_t *usage(const exchange *e) {
    uint32_t prompt = 0, completion = 0;
    for (uint32_t i = 0; i < e->p.n_prompts; i++) prompt += e->p.prompts[i].len;
    for (uint32_t i = 0; i < e->n_ch; i++) completion += ch_tokens(&e->ch[i]);
    return json_pack("{s:i,s:i,s:i}", "prompt_tokens", prompt, "completion_tokens", completion,
                     "total_tokens", prompt + completion);
}

/* The OpenAI body around choices (a new array): completion or chunk. */
static json_t *openai_body(exchange *e, json_t *choices, bool with_usage) {
    const pd_node_config *cfg = node_config(e->h->n);
    bool chat = e->p.api == GEN_API_CHAT, chunk = e->p.stream;
    char id[PD_RID_MAX + 12];
    snprintf(id, sizeof(id), "%s-%s", chat ? "chatcmpl" : "cmpl", e->ch[0].c->rid);
    const char *object = !chat ? "text_completion"
        : chunk                ? "chat.completion.chunk"
                               : "chat.completion";
    json_t *body = json_pack("{s:s,s:s,s:I,s:s,s:o}", "id", id, "object", object, "created",
                             (json_int_t)e->created, "model", cfg->served_model_name, "choices",
                             choices);
    if (body && with_usage && (!chunk || !chat || e->p.include_usage))
        json_object_set_new(body, "usage", usage(e));
    return body;
}

/* ---- the event stream ------------------------------------------------------------------ */

/* The next SSE event into e->ev (obj NULL: the closing [DONE]); false when
 * out of memory. On a feed the event is framed by an "id: <rid>" line (F2). */
static bool set_event(exchange *e, json_t *obj) {
    char *text = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    if (obj) json_decref(obj);
    PD_ASSERT(e->ev == NULL);
    if (obj && !text) return false;
    size_t cap = (text ? strlen(text) : 6) + 9 + (e->fed ? strlen(e->tag) + 5 : 0);
    e->ev = malloc(cap);
    if (e->ev)
        e->ev_len = (size_t)snprintf(e->ev, cap, "%s%s%sdata: %s\n\n", e->fed ? "id: " : "",
                                     e->fed ? e->tag : "", e->fed ? "\n" : "",
                                     text ? text : "[DONE]");
    free(text);
    return e->ev != NULL;
}

/* The event of choice ch with what it has that was not sent: new text (up
 * to what may be shown), new tokens, and its end. /generate is cumulative
 * (SGLang's default: the whole text and every id so far in each event)
 * unless --incremental-streaming-output; its last event is always whole. */
static json_t *choice_event(exchange *e, gen_choice *ch, size_t show, uint32_t to, bool final,
                            bool last) {
    json_t *ev;
    if (e->p.api == GEN_API_GENERATE) {
        bool whole = final || !node_config(e->h->n)->incremental_streaming_output;
        size_t from_b = whole ? ch->base : ch->sent;
        ev = generate_object(e, ch, ch->text + from_b, show - from_b, whole ? 0 : ch->sent_tokens,
                             to, final);
    } else {
        json_t *one =
            openai_choice(e, ch, ch->text + ch->sent, show - ch->sent, ch->sent_tokens, to, final);
        ev = openai_body(e, json_pack("[o]", one), final && last);
    }
    ch->sent = show;
    ch->sent_tokens = to;
    ch->final_sent = final;
    return ev;
}

typedef enum ev_next { EV_NONE, EV_READY, EV_FAILED } ev_next;

/* Makes the next event, if there is one yet: a choice with something new
 * (taking turns), then [DONE] once every choice has sent its end. */
static ev_next next_event(exchange *e) {
    PD_ASSERT(e->ev == NULL && !e->sent_done);
    if (!ex_feed(e)) return EV_FAILED;
    uint32_t ended = 0;
    for (uint32_t i = 0; i < e->n_ch; i++) ended += e->ch[i].final_sent;
    if (ended == e->n_ch) {
        e->sent_done = true;
        return set_event(e, NULL) ? EV_READY : EV_FAILED;
    }
    for (uint32_t k = 0; k < e->n_ch; k++) {
        gen_choice *ch = &e->ch[(e->next + k) % e->n_ch];
        if (ch->final_sent) continue;
        size_t show = gen_choice_showable(ch, &e->p);
        uint32_t to = ch_tokens(ch);
        /* What is new goes out first; the end in an event of its own. */
        bool fresh = show > ch->sent || to > ch->sent_tokens;
        bool final = gen_choice_done(ch) && !fresh;
        if (!fresh && !final) continue;
        e->next = (ch->index + 1) % e->n_ch;
        json_t *ev = choice_event(e, ch, show, to, final, final && ended + 1 == e->n_ch);
        return ev && set_event(e, ev) ? EV_READY : EV_FAILED;
    }
    return EV_NONE; /* the next token or the end wakes us */
}

/* A feed that cannot carry a stream's end any more closes (F4): its
 * consumer learns from the close that none of its streams will end. */
static void feed_kill(exchange *f) {
    f->feed_closing = true;
    ex_wake(f);
}

/* The stream's client left: its own connection, or its feed (F3). */
static bool stream_client_gone(exchange *e) {
    return e->fed ? e->feed_lost : pd_http_req_gone(e->r);
}

/* The stream ends: [DONE] went out, or (ok false) it could not. */
static void stream_close(exchange *e, bool ok) {
    if (!ok) ex_abort_calls(e, false);
    if (!e->fed) pd_http_req_stream_end(e->r);
    else if (!ok && e->feed) feed_kill(e->feed);
    ex_retire(e);
}

/* EX_STREAMING: as many events as there are, until the stream ends, the
 * client leaves, or stream_write refuses (X5: the event waits in e->ev for
 * the WRITABLE wake, or the next token's; on a feed, the feed's WRITABLE
 * wakes every stream holding an event). */
static void gen_stream(exchange *e) {
    for (;;) {
        if (stream_client_gone(e)) {
            ex_abort_calls(e, true); /* X4 */
            ex_retire(e);
            return;
        }
        if (e->ev) {
            pd_http_req *out = e->fed ? e->feed->r : e->r;
            pd_err err = pd_http_req_stream_write(out, e->ev, e->ev_len);
            if (err == PD_ERR_NOMEM) return;
            if (err && e->fed) { /* the feed's client left: its GONE wakes the feed */
                ex_wake(e->feed);
                return;
            }
            if (err) { /* PD_ERR_STATE: the client left meanwhile */
                ex_abort_calls(e, true);
                ex_retire(e);
                return;
            }
            free(e->ev);
            e->ev = NULL;
        }
        if (e->sent_done) {
            stream_close(e, true);
            return;
        }
        ev_next next = next_event(e);
        if (next == EV_NONE) return;
        if (next == EV_FAILED) { /* out of memory: the stream ends without [DONE] */
            stream_close(e, false);
            return;
        }
    }
}

/* ---- generate -------------------------------------------------------------------------- */

/* The call of choice i, ready to submit (NULL when out of memory). Its spec
 * points at e->p.stop, so e->p must outlive the submit. */
static call *choice_call(exchange *e, uint32_t i, const char *base_rid) {
    const gen_params *p = &e->p;
    const gen_prompt *pr = &p->prompts[i / p->n];
    call *c = call_new();
    if (!c) return NULL;
    gen_rid(base_rid, i, c->rid, sizeof(c->rid));
    snprintf(c->peer, sizeof(c->peer), "%s", p->peer);
    c->prompt = malloc(pr->len * sizeof(int32_t));
    c->prompt_len = pr->len;
    c->tokens = calloc(p->max_new + 1, sizeof(int32_t));
    c->logprobs = calloc(p->max_new + 1, sizeof(float));
    uint32_t k = p->sampling.top_logprobs;
    if (k) {
        c->top = calloc((size_t)(p->max_new + 1) * k, sizeof(int32_t));
        c->top_lp = calloc((size_t)(p->max_new + 1) * k, sizeof(float));
        c->n_top = calloc(p->max_new + 1, 1);
    }
    if (!c->prompt || !c->tokens || !c->logprobs || (k && (!c->top || !c->top_lp || !c->n_top))) {
        call_unref(c);
        return NULL;
    }
    memcpy(c->prompt, pr->ids, pr->len * sizeof(int32_t));
    pd_sampling s = p->sampling;
    s.seed = gen_seed(p, i);
    c->spec = (pd_request_spec){
        .rid = c->rid,
        .room = gen_room(p, i),
        .prompt = c->prompt,
        .prompt_len = c->prompt_len,
        .max_new_tokens = p->max_new,
        .sampling = s,
        .stop_tokens = p->stop,
        .n_stop_tokens = p->n_stop,
        .ignore_eos = p->ignore_eos,
        .peer = c->peer,
    };
    return c;
}

/* The whole answer once every choice has ended, in the shape of its API. */
static void answer_done(exchange *e) {
    unsigned http = 200;
    const call *failed = NULL;
    for (uint32_t i = 0; i < e->n_ch && !failed; i++) {
        const call *c = e->ch[i].c;
        if (c->kind == PD_TERM_FAILED && c->status >= 400) failed = c;
    }
    if (failed) http = (unsigned)failed->status;
    if (failed && e->p.api != GEN_API_GENERATE) {
        pd_http_req_respond_error(e->r, http, "%s", failed->message);
        return;
    }
    json_t *all = json_array();
    for (uint32_t i = 0; i < e->n_ch; i++) {
        gen_choice *ch = &e->ch[i];
        json_array_append_new(
            all,
            e->p.api == GEN_API_GENERATE
                ? generate_object(e, ch, ch->text, ch->len, 0, ch_tokens(ch), true)
                : openai_choice(e, ch, ch->text, ch->len, 0, ch_tokens(ch), true));
    }
    json_t *body;
    if (e->p.api != GEN_API_GENERATE) {
        body = openai_body(e, all, true);
    } else if (e->n_ch == 1 && !e->p.batch) {
        body = json_incref(json_array_get(all, 0));
        json_decref(all);
    } else {
        body = all;
    }
    node_respond_json(e->r, http, body);
}

/* EX_WAITING: the whole answer once every choice is done. */
static void gen_wait(exchange *e) {
    if (pd_http_req_gone(e->r)) {
        ex_abort_calls(e, true); /* X4 */
        ex_retire(e);
        return;
    }
    if (!ex_feed(e)) {
        ex_abort_calls(e, false);
        ex_fail(e, 503, "out of memory for the answer");
        return;
    }
    for (uint32_t i = 0; i < e->n_ch; i++)
        if (!gen_choice_done(&e->ch[i])) return;
    answer_done(e); /* done: the scheduler writes to the calls no more */
    ex_retire(e);
}

static void feed_id_print(const struct exchange *f, char *buf, size_t cap);

/* A stream on a feed was accepted: 202 with its rid and feed, then its
 * events go to the feed (F2). A feed gone meanwhile is a 503. */
static void feed_accepted(exchange *e) {
    if (e->feed_lost) {
        ex_abort_calls(e, false);
        ex_fail(e, 503, "the stream feed closed before the request was accepted");
        return;
    }
    char feed_id[32];
    feed_id_print(e->feed, feed_id, sizeof feed_id);
    node_respond_json(e->r, 202,
                      json_pack("{s:s, s:s, s:s}", "rid", e->ch[0].c->rid, "stream_feed", feed_id,
                                "stream_feed_tag", e->tag));
    gen_stream(e);
}

/* EX_SUBMITTING: once the engine took or refused every queued call: on to
 * waiting or streaming, or the first refusal (the accepted ones aborted). */
static void gen_submitted(exchange *e) {
    unsigned status = e->queue_status;
    const char *why = e->queue_status == 503 ? "the server is shutting down"
                                             : "the command queue is full";
    for (uint32_t i = 0; i < e->n_queued; i++) {
        call *c = e->ch[i].c;
        pthread_mutex_lock(&c->mu);
        bool submitted = c->submitted;
        pthread_mutex_unlock(&c->mu);
        if (!submitted) return;     /* also when the client left: X4 */
        c->spec.stop_tokens = NULL; /* the engine copied them out of e->p */
        if (c->submit_err != PD_OK && !status) {
            status = c->reject.status ? (unsigned)c->reject.status : 500;
            why = c->reject.message;
        }
    }
    if (status) {
        ex_abort_calls(e, false);
        ex_fail(e, status, "%s", why);
        return;
    }
    if (!e->p.stream) {
        e->state = EX_WAITING;
        gen_wait(e);
        return;
    }
    e->state = EX_STREAMING;
    if (e->fed) {
        feed_accepted(e);
        return;
    }
    pd_http_req_add_header(e->r, "Cache-Control", "no-cache");
    if (pd_http_req_stream_begin(e->r, 200, "text/event-stream") == PD_ERR_NOMEM) {
        ex_abort_calls(e, false);
        ex_fail(e, 503, "out of memory for the answer");
        return;
    }
    gen_stream(e); /* PD_ERR_STATE: the client left; gen_stream sees it */
}

/* The choices of the parsed request, each with its call; false when out of
 * memory. */
static bool make_choices(exchange *e) {
    pd_node *n = e->h->n;
    char base[PD_RID_MAX];
    if (e->p.rid[0]) snprintf(base, sizeof(base), "%s", e->p.rid);
    else
        snprintf(base, sizeof(base), "%s-%llu", pd_node_role_name(node_config(n)->role),
                 (unsigned long long)node_next_rid(n));
    if (!e->tag[0]) snprintf(e->tag, sizeof(e->tag), "%s", base); /* F2 */
    uint32_t k = gen_choices(&e->p);
    e->ch = calloc(k, sizeof(gen_choice));
    if (!e->ch) return false;
    for (uint32_t i = 0; i < k; i++) {
        call *c = choice_call(e, i, base);
        if (!c) return false;
        bool ok = gen_choice_init(&e->ch[i], c, i, &e->p);
        e->n_ch = i + 1; /* ex_retire frees it from here on */
        if (!ok) return false;
    }
    return true;
}

/* ---- stream feeds ------------------------------------------------------------------------
 * One long-lived event stream (GET /stream_feed) that carries the events of
 * many streaming requests, so a router holds one connection per feed, not
 * one per stream (docs/http-api.md#stream-feeds).
 *   F1  A feed is an exchange in EX_FEEDING; its id "<index>.<seq>" names
 *       its slot and a sequence number no other feed had, so a stale id
 *       never finds a later feed in the same slot.
 *   F2  A request given "stream_feed" is answered 202 once accepted, and
 *       every event of it goes to the feed, framed "id: <tag>\n" + the event
 *       (the tag: its "stream_feed_tag", else its rid); its last one is
 *       data: [DONE], exactly once, unless the feed closes.
 *   F3  A stream is on its feed's `attached` list from its submit until it
 *       retires; the feed closing (its client left) is a hang-up for every
 *       stream on it: aborted through the normal abort path.
 *   F4  A feed's output is bounded by the server's watermark plus the one
 *       event each stream keeps (X5): back-pressure, then the server's write
 *       deadline, which closes the feed and so aborts its streams (F3). */

static void feed_id_print(const exchange *f, char *buf, size_t cap) {
    snprintf(buf, cap, "%u.%llu", ex_index(f), (unsigned long long)f->feed_seq);
}

/* The open feed an id names (F1), or NULL. */
static exchange *feed_find(http_server *h, const char *id) {
    unsigned idx;
    unsigned long long seq;
    int used = 0;
    if (sscanf(id, "%u.%llu%n", &idx, &seq, &used) != 2 || id[used] != '\0') return NULL;
    if (idx >= h->ex_max) return NULL;
    exchange *f = &h->ex[idx];
    bool open = f->kind == EX_FEED && f->state == EX_FEEDING && f->feed_seq == seq;
    return open && !f->feed_closing ? f : NULL;
}

/* A frame's tag: 1..PD_RID_MAX-1 bytes of printable ASCII, so one line. */
static bool tag_acceptable(const char *t) {
    size_t n = strlen(t);
    for (size_t i = 0; i < n; i++)
        if (t[i] < 0x21 || t[i] > 0x7e) return false;
    return n > 0 && n < PD_RID_MAX;
}

/* The request's "stream_feed": 0 and attached (F3), or the 400 to answer. */
static int feed_attach(exchange *e, json_t *root, char *err, size_t cap) {
    json_t *v = json_object_get(root, "stream_feed");
    json_t *tag = json_object_get(root, "stream_feed_tag");
    if (!v || json_is_null(v)) return 0;
    if (!json_is_string(v))
        return snprintf(err, cap, "'stream_feed' must be a string (a feed's id)"), 400;
    if (!e->p.stream) return snprintf(err, cap, "'stream_feed' needs \"stream\": true"), 400;
    const char *t = tag ? json_string_value(tag) : e->p.rid[0] ? e->p.rid : NULL;
    if ((tag && !t) || (t && !tag_acceptable(t)))
        return snprintf(err, cap,
                        "'stream_feed_tag' (or, without it, 'rid') must be 1 to %d bytes of "
                        "printable ASCII without spaces on a stream feed",
                        PD_RID_MAX - 1),
               400;
    if (t) snprintf(e->tag, sizeof(e->tag), "%s", t);
    exchange *f = feed_find(e->h, json_string_value(v));
    if (!f)
        return snprintf(err, cap, "unknown stream_feed '%.64s': no open GET /stream_feed has it",
                        json_string_value(v)),
               400;
    e->fed = true;
    e->feed = f;
    pd_list_push_back(&f->attached, feed_links(e->h), ex_index(e));
    return 0;
}

/* EX_NEW for GET /stream_feed: a 200 event stream that names its id in the
 * X-Stream-Feed header; nothing is written to it but the streams' frames. */
static void feed_begin(exchange *f) {
    http_server *h = f->h;
    size_t len;
    pd_http_req_body(f->r, &len);
    if (len || pd_http_req_query(f->r)[0]) {
        ex_fail(f, 400, "GET /stream_feed takes no query and no body");
        return;
    }
    f->feed_seq = ++h->feed_seq;
    pd_list_init(&f->attached);
    char id[32];
    feed_id_print(f, id, sizeof id);
    pd_http_req_add_header(f->r, "X-Stream-Feed", id);
    pd_http_req_add_header(f->r, "Cache-Control", "no-cache");
    if (pd_http_req_stream_begin(f->r, 200, "text/event-stream") == PD_ERR_NOMEM) {
        ex_fail(f, 503, "out of memory for the answer");
        return;
    }
    f->state = EX_FEEDING;
    pthread_mutex_lock(&h->mu);
    f->is_feed = true;
    pthread_mutex_unlock(&h->mu);
    pd_http_req_watch(f->r, ex_watch, f); /* GONE, WRITABLE; a client gone: at once */
}

/* EX_FEEDING: the feed's client took its backlog (the streams holding an
 * event retry), or the feed ends: its client left, a stream could not end on
 * it, or the node stops and no stream is left (F3). */
static void feed_run(exchange *f) {
    http_server *h = f->h;
    bool gone = pd_http_req_gone(f->r);
    pthread_mutex_lock(&h->mu);
    if (f->feed_seq <= h->feeds_cut) f->feed_closing = true;
    pthread_mutex_unlock(&h->mu);
    if (!gone && !f->feed_closing && !(node_stopping(h->n) && f->attached.len == 0)) {
        for (uint32_t i = f->attached.head; i != PD_NONE; i = pd_link_at(feed_links(h), i)->next)
            if (h->ex[i].ev) ex_wake(&h->ex[i]);
        return;
    }
    for (uint32_t i = f->attached.head; i != PD_NONE; i = pd_link_at(feed_links(h), i)->next)
        ex_wake(&h->ex[i]); /* they see feed_lost once ex_retire let go of them */
    if (!gone) pd_http_req_stream_end(f->r);
    ex_retire(f);
}

void http_close_feeds(http_server *h) {
    pthread_mutex_lock(&h->mu);
    for (uint32_t i = 0; i < h->ex_max; i++)
        if (h->ex[i].is_feed) {
            h->feeds_cut = PD_MAX(h->feeds_cut, h->ex[i].feed_seq);
            ex_queue_locked(&h->ex[i]);
        }
    pthread_mutex_unlock(&h->mu);
}

/* EX_NEW for /generate, /v1/completions and /v1/chat/completions: parse,
 * check, submit every choice. */
static void gen_begin(exchange *e) {
    pd_node *n = e->h->n;
    gen_api api = e->kind == EX_CHAT ? GEN_API_CHAT
        : e->kind == EX_COMPLETIONS  ? GEN_API_COMPLETIONS
                                     : GEN_API_GENERATE;
    size_t len;
    const char *body = pd_http_req_body(e->r, &len);
    json_error_t jerr;
    json_t *root = json_loadb(body, len, 0, &jerr);
    if (!root) {
        ex_fail(e, 400, "malformed JSON: %s (line %d, column %d)", jerr.text, jerr.line,
                jerr.column);
        return;
    }
    char err[256];
    int status = gen_params_parse(n, root, api, &e->p, err, sizeof(err));
    if (!status) status = feed_attach(e, root, err, sizeof(err));
    if (status) gen_cancel_refused(n, root);
    json_decref(root);
    if (status) {
        ex_fail(e, (unsigned)status, "%s", err);
        return;
    }
    if (!make_choices(e)) {
        ex_fail(e, 503, "out of memory for the answer");
        return;
    }
    e->created = (uint64_t)time(NULL);
    e->state = EX_SUBMITTING;
    for (uint32_t i = 0; i < e->n_ch; i++) {
        call *c = e->ch[i].c;
        c->wake = ex_wake; /* nobody else knows c yet */
        c->wake_ctx = e;
        pd_err qerr = node_command(n, CMD_SUBMIT, c, NULL, NULL);
        if (qerr) {
            e->queue_status = qerr == PD_ERR_STATE ? 503 : 429;
            break;
        }
        e->n_queued = i + 1;
    }
    pd_http_req_watch(e->r, ex_watch, e); /* the client leaving, and WRITABLE */
    gen_submitted(e);
}

/* ---- abort, info, metrics: a command and its reply -------------------------------------- */

/* Queues the command; the reply wakes e. False when the queue refused it. */
static bool ex_command(exchange *e, cmd_kind kind, const char *rid) {
    cmd_reply *q = &e->reply;
    memset(q, 0, sizeof(*q));
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    q->wake = ex_wake;
    q->wake_ctx = e;
    e->reply_set = true;
    e->cmd = kind;
    e->state = EX_REPLY;
    return node_command(e->h->n, kind, NULL, rid, q) == PD_OK;
}

static void abort_begin(exchange *e) {
    size_t len;
    const char *body = pd_http_req_body(e->r, &len);
    json_error_t jerr;
    json_t *root = json_loadb(body, len, 0, &jerr);
    if (!root) {
        ex_fail(e, 400, "malformed JSON: %s (line %d, column %d)", jerr.text, jerr.line,
                jerr.column);
        return;
    }
    if (!json_is_object(root)) {
        json_decref(root);
        ex_fail(e, 400, "the request body must be a JSON object");
        return;
    }
    json_t *rid = json_object_get(root, "rid"), *all = json_object_get(root, "abort_all");
    bool abort_all = all && json_is_true(all);
    bool rid_given = !abort_all && rid && json_is_string(rid);
    bool rid_ok = rid_given && gen_rid_acceptable(rid);
    if (rid_ok) snprintf(e->rid, sizeof(e->rid), "%s", json_string_value(rid));
    json_decref(root);
    if (rid_given && !rid_ok) {
        ex_fail(e, 400, GEN_RID_RULE, PD_RID_MAX - 1);
        return;
    }
    if (!abort_all && !rid_ok) {
        ex_fail(e, 400, "give 'rid' (a string) or 'abort_all': true");
        return;
    }
    if (!ex_command(e, abort_all ? CMD_ABORT_ALL : CMD_ABORT, abort_all ? NULL : e->rid))
        ex_fail(e, 503, "the server is shutting down");
}

static void answer_abort(exchange *e) {
    if (e->cmd == CMD_ABORT && e->reply.value == 0) {
        pd_http_req_respond_error(e->r, 404, "no live request has rid '%s'", e->rid);
        return;
    }
    node_respond_json(e->r, 200, json_pack("{s:I}", "aborted", (json_int_t)e->reply.value));
}

static void answer_text(exchange *e) {
    const cmd_reply *q = &e->reply;
    if (!q->text && q->value == PD_ERR_TOOBIG)
        pd_http_req_respond_error(e->r, 500,
                                  "the metrics text is larger than its %u-byte buffer; "
                                  "no partial metrics are served",
                                  (unsigned)METRICS_TEXT_BYTES);
    else if (!q->text)
        pd_http_req_respond_error(e->r, 500, "the server could not build its answer (%s)",
                                  pd_err_name((pd_err)q->value));
    else
        pd_http_req_respond(e->r, 200,
                            e->cmd == CMD_INFO ? "application/json" : "text/plain; version=0.0.4",
                            q->text, strlen(q->text));
}

/* EX_REPLY: the answer once the scheduler has replied (also to a client
 * that left: the reply is written into e, which must wait for it; X3). */
static void reply_check(exchange *e) {
    pthread_mutex_lock(&e->reply.mu);
    bool ready = e->reply.ready;
    pthread_mutex_unlock(&e->reply.mu);
    if (!ready) return;
    if (e->cmd == CMD_ABORT || e->cmd == CMD_ABORT_ALL) answer_abort(e);
    else if (e->cmd == CMD_FLUSH) sgl_flush_answer(e->r, &e->reply);
    else answer_text(e);
    ex_retire(e);
}

/* ---- the responder --------------------------------------------------------------------- */

/* The scheduler command whose reply answers a route (info, metrics, flush). */
static cmd_kind command_of(ex_kind kind) {
    return kind == EX_INFO ? CMD_INFO : kind == EX_FLUSH ? CMD_FLUSH : CMD_METRICS;
}

static void ex_run(exchange *e) {
    switch (e->state) {
    case EX_NEW:
        if (e->kind == EX_GENERATE || e->kind == EX_COMPLETIONS || e->kind == EX_CHAT) gen_begin(e);
        else if (e->kind == EX_ABORT) abort_begin(e);
        else if (e->kind == EX_FEED) feed_begin(e);
        else if (e->kind == EX_TOKENIZE) {
            sgl_tokenize_answer(e->h->n, e->r);
            ex_retire(e);
        } else if (!ex_command(e, command_of(e->kind), NULL))
            ex_fail(e, 503, "the server is shutting down");
        break;
    case EX_SUBMITTING: gen_submitted(e); break;
    case EX_WAITING: gen_wait(e); break;
    case EX_STREAMING: gen_stream(e); break;
    case EX_REPLY: reply_check(e); break;
    case EX_FEEDING: feed_run(e); break;
    case EX_FREE: PD_ASSERTF(false, "exchange %u woken while free", ex_index(e));
    }
}

/* Runs each exchange put on the ready list, one at a time, until stopped
 * with the list empty. */
static void *responder_main(void *arg) {
    http_server *h = arg;
    pthread_mutex_lock(&h->mu);
    for (;;) {
        while (h->ready.len == 0 && !h->stop) pthread_cond_wait(&h->cv, &h->mu);
        if (h->ready.len == 0) break;
        uint32_t i = h->ready.head;
        pd_list_remove(&h->ready, ex_links(h), i);
        exchange *e = &h->ex[i];
        e->queued = false;
        if (e->retired) {
            ex_free_locked(h, e);
            continue;
        }
        pthread_mutex_unlock(&h->mu);
        ex_run(e);
        pthread_mutex_lock(&h->mu);
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

/* ---- routes (the loop thread) ---------------------------------------------------------- */

typedef struct route {
    const char *path, *method;
    ex_kind kind;
} route;

static const route routes[] = {
    {"/generate", "POST", EX_GENERATE},
    {"/v1/completions", "POST", EX_COMPLETIONS},
    {"/v1/chat/completions", "POST", EX_CHAT},
    {"/abort_request", "POST", EX_ABORT},
    {"/health", "GET", EX_HEALTH},
    {"/server_info", "GET", EX_INFO},
    {"/get_server_info", "GET", EX_INFO},
    {"/metrics", "GET", EX_METRICS},
    {"/get_model_info", "GET", EX_MODEL_INFO},
    {"/tokenize", "POST", EX_TOKENIZE},
    {"/detokenize", "POST", EX_TOKENIZE},
    {"/flush_cache", "GET, POST", EX_FLUSH},
    {"/health_generate", "GET", EX_HEALTH_GEN},
    {"/stream_feed", "GET", EX_FEED},
    {"/v1/models", "GET", EX_MODELS}, /* last: find_route's /v1/models/{id} */
};

/* A route's method: one, or a list as the Allow header writes it ("GET, POST"). */
static bool method_allowed(const char *allowed, const char *method) {
    size_t n = strlen(method);
    for (const char *p = allowed; n > 0 && (p = strstr(p, method)); p += n)
        if ((p == allowed || p[-1] == ' ') && (p[n] == ',' || p[n] == '\0')) return true;
    return false;
}

/* The route of a path: exact, or /v1/models/{id}. */
static const route *find_route(const char *path) {
    for (size_t i = 0; i < PD_ARRAY_LEN(routes); i++)
        if (!strcmp(path, routes[i].path)) return &routes[i];
    if (!strncmp(path, "/v1/models/", 11)) return &routes[PD_ARRAY_LEN(routes) - 1];
    return NULL;
}

/* OpenAI's model list and model object: this node serves one model. */
static void answer_models(http_server *h, pd_http_req *r, const char *path) {
    const char *name = node_config(h->n)->served_model_name;
    json_t *model = json_pack("{s:s, s:s, s:I, s:s}", "id", name, "object", "model", "created",
                              (json_int_t)h->started, "owned_by", "pdserve");
    if (!strcmp(path, "/v1/models")) {
        node_respond_json(r, 200, json_pack("{s:s, s:[o]}", "object", "list", "data", model));
    } else if (!strcmp(path + 11, name)) {
        node_respond_json(r, 200, model);
    } else {
        json_decref(model);
        pd_http_req_respond_error(r, 404, "the model '%s' does not exist; this server serves '%s'",
                                  path + 11, name);
    }
}

/* On the loop thread: must not block. What needs neither the body nor the
 * scheduler is answered here; the rest goes to the responder. */
static void on_request(pd_http_req *r, void *user) {
    http_server *h = user;
    const pd_node_config *cfg = node_config(h->n);
    if (!pd_http_req_authorize(r, cfg->api_key)) return; /* 401 answered */
    const char *path = pd_http_req_path(r), *method = pd_http_req_method(r);
    const route *rt = find_route(path);
    if (!rt) {
        pd_http_req_respond_error(r, 404, "no such path: %s", path);
    } else if (!method_allowed(rt->method, method)) {
        pd_http_req_add_header(r, "Allow", rt->method);
        pd_http_req_respond_error(r, 405, "%s %s is not allowed (use %s)", method, path,
                                  rt->method);
    } else if (node_stopping(h->n)) {
        pd_http_req_respond_error(r, 503, "the server is shutting down");
    } else if (rt->kind == EX_HEALTH) {
        node_respond_json(
            r, 200, json_pack("{s:s,s:s}", "status", "ok", "role", pd_node_role_name(cfg->role)));
    } else if (rt->kind == EX_MODELS) {
        answer_models(h, r, path);
    } else if (rt->kind == EX_MODEL_INFO) {
        sgl_model_info(h->n, r);
    } else if (rt->kind == EX_HEALTH_GEN) {
        sgl_health_generate(h->health, r);
    } else if (rt->kind == EX_METRICS && !cfg->enable_metrics) {
        pd_http_req_respond_error(r, 404, "metrics are off (start with --enable-metrics)");
    } else if (!ex_start(h, r, rt->kind)) {
        pd_http_req_respond_error(r, 503, "%u requests are being answered; try again later",
                                  h->ex_max);
    }
}

/* ---- start and stop -------------------------------------------------------------------- */

static void server_config(const pd_node_config *cfg, http_server *h, pd_http_server_config *sc) {
    pd_http_server_config_default(sc);
    sc->host = cfg->host && strcmp(cfg->host, "localhost") ? cfg->host : "127.0.0.1";
    sc->port = cfg->port;
    sc->connections_max = HTTP_CONNECTIONS_MAX;
    sc->connections_per_ip_max = HTTP_CONNECTIONS_MAX;
    sc->body_bytes_max = cfg->max_body_bytes;
    sc->header_timeout_ms = cfg->http_header_timeout_ms;
    sc->body_timeout_ms = cfg->http_body_timeout_ms;
    sc->idle_timeout_ms = cfg->http_idle_timeout_ms;
    sc->write_timeout_ms = cfg->http_write_timeout_ms;
    sc->on_request = on_request;
    sc->user = h;
}

/* Frees what http_start made; the responder has stopped, nothing is in use. */
static void server_free(http_server *h) {
    sgl_health_destroy(h->health); /* joins the probes: the server has stopped */
    pthread_mutex_destroy(&h->mu);
    pthread_cond_destroy(&h->cv);
    free(h->ex);
    free(h);
}

static void responder_stop(http_server *h) {
    pthread_mutex_lock(&h->mu);
    h->stop = true;
    pthread_cond_signal(&h->cv);
    pthread_mutex_unlock(&h->mu);
    pthread_join(h->thread, NULL);
}

pd_err http_start(pd_node *n, http_server **out, uint16_t *bound_port, char *msg, size_t cap) {
    http_server *h = calloc(1, sizeof(*h));
    if (!h) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    h->n = n;
    h->ex_max = HTTP_EXCHANGES;
    h->ex = calloc(h->ex_max, sizeof(*h->ex));
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    if (!h->ex || sgl_health_create(n, &h->health) != PD_OK) {
        server_free(h);
        return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    }
    pd_list_init(&h->free);
    pd_list_init(&h->ready);
    for (uint32_t i = 0; i < h->ex_max; i++) {
        h->ex[i] = (exchange){.h = h, .state = EX_FREE};
        pd_list_push_back(&h->free, ex_links(h), i);
    }
    if (pthread_create(&h->thread, NULL, responder_main, h) != 0) {
        server_free(h);
        return pd_errorf(msg, cap, PD_ERR_NOMEM, "could not start the HTTP responder thread");
    }
    h->started = (uint64_t)time(NULL);
    pd_http_server_config sc;
    server_config(node_config(n), h, &sc);
    pd_err err = pd_http_server_start(&h->srv, &sc, msg, cap);
    if (err) {
        responder_stop(h);
        server_free(h);
        return err;
    }
    *bound_port = pd_http_server_port(h->srv);
    *out = h;
    return PD_OK;
}

void http_stop(http_server *h) {
    if (!h) return;
    /* The responder still runs: answers in flight may end within the
     * server's grace, the rest see GONE and are retired. A feed ends once
     * its last stream has (F3): those with none end now. */
    pthread_mutex_lock(&h->mu);
    for (uint32_t i = 0; i < h->ex_max; i++)
        if (h->ex[i].is_feed) ex_queue_locked(&h->ex[i]);
    pthread_mutex_unlock(&h->mu);
    pd_http_server_stop(h->srv);
    responder_stop(h);
    /* Neither the loop nor the scheduler (stopped before us) can wake an
     * exchange any more; whatever is still in use ends here. */
    for (uint32_t i = 0; i < h->ex_max; i++) {
        exchange *e = &h->ex[i];
        PD_ASSERT(!e->queued && !e->retired);
        if (e->state != EX_FREE) ex_retire(e);
    }
    PD_ASSERT(h->free.len == h->ex_max);
    server_free(h);
}
