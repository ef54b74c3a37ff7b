/*
 * node_internal.h — what node.c (the scheduler side) and http.c (the HTTP
 * side) share: the call (one client request in flight) and the command
 * queue between the two sides.
 *
 * A call is shared by the HTTP side (http.c's responder thread, which
 * answers the client) and the scheduler thread that delivers its outputs; it
 * is reference counted (one reference each) and guarded by its own mutex.
 * The scheduler never blocks on HTTP: it appends tokens, signals the call's
 * condition variable and calls its wake hook, which only queues the call's
 * exchange for the responder (a short critical section, never I/O).
 */
#ifndef PDSERVE_NODE_INTERNAL_H
#define PDSERVE_NODE_INTERNAL_H

#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>

#include "pdserve/chat_template.h"
#include "pdserve/engine.h"
#include "pdserve/hf_tokenizer.h"
#include "pdserve/http_server.h"
#include "pdserve/node.h"

/* The /metrics text: some 8 KiB with every pool and histogram; a text that
 * outgrows this is answered with an error, never cut short. */
#define METRICS_TEXT_BYTES (64u * 1024u)

typedef struct call {
    atomic_int refs;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    /* Request (read-only once submitted). */
    char rid[PD_RID_MAX];
    char peer[PD_PEER_MAX];
    int32_t *prompt;
    uint32_t prompt_len;
    pd_request_spec spec;
    /* Submit outcome. */
    bool submitted;
    pd_err submit_err;
    pd_reject reject;
    /* Outputs (guarded by mu). */
    int32_t *tokens;
    float *logprobs;
    /* top_logprobs: spec.sampling.top_logprobs entries per token (NULL when
     * not asked), n_top[i] of them filled for token i */
    int32_t *top;
    float *top_lp;
    uint8_t *n_top;
    uint32_t n_tokens;
    bool done;
    pd_terminal_kind kind;
    pd_finish_reason finish;
    int status;
    char message[160];
    uint32_t cached_tokens;
    uint64_t t_submit_us, t_first_us, t_done_us;
    bool aborting; /* an abort was sent for it */
    bool hung_up;  /* ...because its client hung up */
    /* Called under mu after each change above (submit outcome, a token, the
     * end): must not block. Set before the submit, cleared (under mu) by
     * whoever frees wake_ctx. NULL: nobody listens but cv. */
    void (*wake)(void *ctx);
    void *wake_ctx;
} call;

/* The request-body parser alone, as POST /generate (api 0),
 * /v1/completions (1) or /v1/chat/completions (2) runs it: 0 if the body
 * would be submitted, else the HTTP status, with the message in err. For the
 * fuzz target (tests/fuzz/fuzz_request.c). */
int node_http_check_body(pd_node *n, const char *body, size_t len, int api, char *err, size_t cap);

call *call_new(void);
void call_ref(call *c);
void call_unref(call *c);

typedef enum cmd_kind {
    CMD_SUBMIT,
    CMD_ABORT,
    CMD_ABORT_ALL,
    CMD_INFO,
    CMD_METRICS,
    CMD_CANCEL_ROOM,
    CMD_FLUSH /* pd_engine_flush_cache: value is its pd_err, text its message */
} cmd_kind;

/* A command with an answer: node_command_wait waits on cv; the responder
 * (http.c) sets wake instead and is called, under mu, once ready is set. */
typedef struct cmd_reply {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool ready;
    /* ABORT: 1 found / 0 not; ABORT_ALL: the count; INFO / METRICS: PD_OK, or
     * the pd_err why text is NULL. */
    int64_t value;
    char *text;              /* INFO / METRICS: malloc'd, the caller frees */
    void (*wake)(void *ctx); /* may be NULL; must not block */
    void *wake_ctx;
} cmd_reply;

struct pd_node;

/* Queues a command; PD_ERR_NOMEM when the queue is full, PD_ERR_STATE when
 * the node is stopping. For SUBMIT the scheduler takes a reference. */
pd_err node_command(struct pd_node *n, cmd_kind kind, call *c, const char *rid, cmd_reply *reply);
/* A request for `room` was refused before it reached the engine (bad
 * input): queues pd_engine_cancel_room, so the other node's half of the
 * request does not wait for it. Best effort, no reply. */
void node_cancel_room(struct pd_node *n, uint64_t room, const char *peer);
/* Queues a command and waits for its reply. */
pd_err node_command_wait(struct pd_node *n, cmd_kind kind, const char *rid, cmd_reply *reply);

/* The strict-mode ownership check (pd_engine_check) of this node's engine:
 * returns the report, empty when the check passed. A failure is counted, and
 * the first few reports go to the config's on_violation. Scheduler thread
 * only, or before pd_node_start. The report stays valid until the node's
 * next check. */
const char *node_strict_check(struct pd_node *n);
/* The node's engine, for white-box tests; the scheduler thread is its only
 * user once the node has started. */
pd_engine *node_engine(struct pd_node *n);

/* Accessors the HTTP side needs. */
const pd_node_config *node_config(const struct pd_node *n);
uint32_t node_vocab(const struct pd_node *n);
int32_t node_bos(const struct pd_node *n);

/* The node's tokenizer: the model directory's tokenizer.json when it has
 * one (pd_hf_tokenizer), else the built-in byte tokenizer. n may be NULL
 * (the byte tokenizer; unit tests). */
#define NODE_TOKEN_BYTES_MAX 1024u /* PD_HF_TOKEN_BYTES_MAX */
/* text[0..len) into malloc'd ids, with what the tokenizer adds (a begin
 * token) when add_special. */
pd_err node_encode(const struct pd_node *n, const char *text, size_t len, bool add_special,
                   int32_t **ids, size_t *n_ids, char *msg, size_t cap);
/* The bytes of one token into out (cap >= NODE_TOKEN_BYTES_MAX; NUL-
 * terminated); special tokens give none when skip_special. Need not be
 * valid UTF-8: a character may span tokens. */
size_t node_token_bytes(const struct pd_node *n, int32_t id, bool skip_special, char *out,
                        size_t cap);
const pd_hf_tokenizer *node_tokenizer(const struct pd_node *n);
/* The model's chat template (or --chat-template's); NULL: the built-in one. */
const pd_chat_template *node_chat_template(const struct pd_node *n);

/* Puts the message for a refused request in err and returns its HTTP
 * status: `return node_refuse(err, cap, 400, ...)` (params.c). */
#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
int node_refuse(char *err, size_t cap, int status, const char *fmt, ...);
/* o as compact JSON, released; NULL (a failed json_pack) is a 503 (http.c). */
void node_respond_json(pd_http_req *r, unsigned status, json_t *o);
/* The tokenizer's begin (eos false) or end token as text, or NULL. */
const char *node_special_text(const struct pd_node *n, bool eos);
uint64_t node_now_us(void);
uint64_t node_next_rid(struct pd_node *n);
bool node_stopping(const struct pd_node *n);

/* metrics.c: the node's measurements of its requests, for GET /metrics and
 * the request log (scheduler thread only). */
typedef struct node_metrics node_metrics;
node_metrics *node_metrics_new(pd_node_role role, const char *model_name);
void node_metrics_free(node_metrics *m);
/* A token reached its call: the first (seconds since the submit) or a later
 * one (seconds since the previous token). */
void node_metrics_token(node_metrics *m, bool first, double seconds);
/* A request's terminal event on this node, at now_us. */
void node_metrics_end(node_metrics *m, const pd_terminal_event *ev, uint64_t now_us);
/* Samples the totals behind the windowed gauges; call it every step. */
void node_metrics_tick(node_metrics *m, uint64_t now_us);
/* Appends the latency, transfer and SGLang-named families. */
void node_metrics_text(const node_metrics *m, pd_strbuf *t, const pd_engine_counters *c,
                       pd_ledger *l, uint64_t now_us);
/* The request's log line (one JSON object, no newline; malloc'd, NULL when
 * out of memory): ev is its terminal event, or NULL when submit refused it
 * (c->reject). Read c under c->mu. */
char *node_request_line(pd_node_role role, const call *c, const pd_terminal_event *ev,
                        uint64_t now_us);

/* http.c: the node's HTTP API on pd_http_server; http_stop after the
 * scheduler has stopped and every call has ended (pd_node_destroy). */
typedef struct http_server http_server;
pd_err http_start(struct pd_node *n, http_server **out, uint16_t *bound_port, char *msg,
                  size_t cap);
void http_stop(http_server *h);
/* Closes every open stream feed (docs/http-api.md#stream-feeds), as if
 * each could not carry a stream's end: their streams are aborted. For
 * tests of what a router does when a feed drops. Any thread. */
void http_close_feeds(http_server *h);
void node_close_stream_feeds(struct pd_node *n);

/* sglang_api.c: SGLang's native utility endpoints (docs/http-api.md). */
/* GET /get_model_info, answered at once (the loop thread). */
void sgl_model_info(struct pd_node *n, pd_http_req *r);
/* POST /tokenize and /detokenize (the responder): parses, answers. */
void sgl_tokenize_answer(struct pd_node *n, pd_http_req *r);
/* /flush_cache once CMD_FLUSH has replied: 200, or 400 naming why not. */
void sgl_flush_answer(pd_http_req *r, const cmd_reply *q);
/* GET /health_generate: each probe on a thread of its own (the loop thread
 * only starts it); sgl_health_destroy joins them, after the HTTP server has
 * stopped. */
typedef struct sgl_health sgl_health;
pd_err sgl_health_create(struct pd_node *n, sgl_health **out);
void sgl_health_generate(sgl_health *s, pd_http_req *r);
void sgl_health_destroy(sgl_health *s);

#endif
