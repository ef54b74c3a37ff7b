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

/* ---- request parsing ------------------------------------------------------------------ */

typedef struct parsed {
    int32_t *prompt;
    uint32_t prompt_len;
    uint32_t max_new;
    double temperature, top_p;
    int32_t stop[PD_STOP_TOKENS_MAX];
    uint32_t n_stop;
    bool ignore_eos, stream;
    char rid[PD_RID_MAX];
    char peer[PD_PEER_MAX];
    uint64_t room;
} parsed;

/* A rid the engine takes: 1 to PD_RID_MAX - 1 bytes (base.h), no NUL. A
 * longer one is refused, never cut: cut, it would name another request. */
static bool rid_acceptable(json_t *v) {
    size_t n = json_string_length(v);
    return json_is_string(v) && n > 0 && n < PD_RID_MAX && strlen(json_string_value(v)) == n;
}

#define RID_RULE "'rid' must have 1 to %d bytes, without NUL"

/* Puts the message for a refused request in err and returns its HTTP
 * status: `return refuse(err, cap, 400, ...)`. */
#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
static int refuse(char *err, size_t cap, int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
    return status;
}

/* Each parse_* below returns 0 on success; otherwise the HTTP status, with
 * the message in err. Fields are checked in the order the API lists them, so
 * a body with several faults always gets the same answer. */

/* The prompt field as the client wrote it: its value, its name and the type
 * it must have (for the messages). */
typedef struct prompt_field {
    json_t *v;
    const char *name;
    const char *must_be;
} prompt_field;

/* Finds the prompt and where the sampling fields live: /v1/completions has
 * "prompt" and the fields at the top level, /generate "text" or "input_ids"
 * and a "sampling_params" object. */
static int parse_shape(json_t *root, bool openai, prompt_field *f, json_t **src, char *err,
                       size_t cap) {
    *src = root;
    if (openai) {
        *f = (prompt_field){json_object_get(root, "prompt"), "prompt",
                            "a string or an array of token ids"};
        if (!f->v) return refuse(err, cap, 400, "'prompt' is required");
        return 0;
    }
    json_t *text = json_object_get(root, "text"), *ids = json_object_get(root, "input_ids");
    if (text && ids) return refuse(err, cap, 400, "give either 'text' or 'input_ids', not both");
    if (text) *f = (prompt_field){text, "text", "a string"};
    else *f = (prompt_field){ids, "input_ids", "an array of integers"};
    if (!f->v) return refuse(err, cap, 400, "'text' or 'input_ids' is required");
    *src = json_object_get(root, "sampling_params");
    if (*src && !json_is_object(*src))
        return refuse(err, cap, 400, "'sampling_params' must be an object");
    return 0;
}

static int parse_prompt_text(pd_node *n, const prompt_field *f, parsed *p, char *err, size_t cap) {
    const pd_node_config *cfg = node_config(n);
    const char *t = json_string_value(f->v);
    size_t len = json_string_length(f->v);
    size_t need = pd_tokenizer_encode(t, len, node_bos(n) >= 0, NULL, 0);
    if (len == 0) return refuse(err, cap, 400, "'%s' is empty", f->name);
    if (need > cfg->max_prompt_tokens)
        return refuse(err, cap, 413, "the prompt is %zu tokens, the limit is %u", need,
                      cfg->max_prompt_tokens);
    p->prompt = malloc(need * sizeof(int32_t));
    if (!p->prompt) return refuse(err, cap, 503, "out of memory for a %zu-token prompt", need);
    p->prompt_len = (uint32_t)pd_tokenizer_encode(t, len, node_bos(n) >= 0, p->prompt, need);
    return 0;
}

static int parse_prompt_ids(pd_node *n, const prompt_field *f, parsed *p, char *err, size_t cap) {
    const pd_node_config *cfg = node_config(n);
    size_t k = json_array_size(f->v);
    if (k == 0) return refuse(err, cap, 400, "'%s' is empty", f->name);
    if (k > cfg->max_prompt_tokens)
        return refuse(err, cap, 413, "the prompt is %zu tokens, the limit is %u", k,
                      cfg->max_prompt_tokens);
    p->prompt = malloc(k * sizeof(int32_t));
    if (!p->prompt) return refuse(err, cap, 503, "out of memory for a %zu-token prompt", k);
    for (size_t i = 0; i < k; i++) {
        json_t *v = json_array_get(f->v, i);
        if (!json_is_integer(v))
            return refuse(err, cap, 400, "'%s'[%zu] is not an integer", f->name, i);
        json_int_t x = json_integer_value(v);
        if (x < 0 || x >= (json_int_t)node_vocab(n))
            return refuse(err, cap, 400, "'%s'[%zu] = %lld is outside the vocabulary (size %u)",
                          f->name, i, (long long)x, node_vocab(n));
        p->prompt[i] = (int32_t)x;
    }
    p->prompt_len = (uint32_t)k;
    return 0;
}

/* The prompt as token ids in p->prompt (malloc'd; the caller frees it, also
 * when a later field is refused). */
static int parse_prompt(pd_node *n, const prompt_field *f, parsed *p, char *err, size_t cap) {
    if (json_is_string(f->v)) return parse_prompt_text(n, f, p, err, cap);
    if (json_is_array(f->v)) return parse_prompt_ids(n, f, p, err, cap);
    return refuse(err, cap, 400, "'%s' must be %s", f->name, f->must_be);
}

/* The field `name` of src, or NULL when src, the field or its value is absent
 * (a JSON null means "the default"). */
static json_t *given(json_t *src, const char *name) {
    json_t *v = src ? json_object_get(src, name) : NULL;
    return v && !json_is_null(v) ? v : NULL;
}

static int parse_stop_tokens(json_t *v, uint32_t vocab, parsed *p, char *err, size_t cap) {
    if (!json_is_array(v))
        return refuse(err, cap, 400, "'stop_token_ids' must be an array of integers");
    if (json_array_size(v) > PD_STOP_TOKENS_MAX)
        return refuse(err, cap, 400, "'stop_token_ids': at most %d", PD_STOP_TOKENS_MAX);
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *e = json_array_get(v, i);
        if (!json_is_integer(e))
            return refuse(err, cap, 400, "'stop_token_ids'[%zu] is not an integer", i);
        json_int_t x = json_integer_value(e);
        if (x < 0 || x >= (json_int_t)vocab) /* checked before the cast: never wraps */
            return refuse(err, cap, 400,
                          "'stop_token_ids'[%zu] = %lld is outside the vocabulary (size %u)", i,
                          (long long)x, vocab);
        p->stop[p->n_stop++] = (int32_t)x;
    }
    return 0;
}

/* max_new_tokens (max_tokens), temperature, top_p, stop_token_ids, ignore_eos. */
static int parse_sampling(const pd_node_config *cfg, uint32_t vocab, json_t *src, bool openai,
                          parsed *p, char *err, size_t cap) {
    json_t *v;
    const char *mname = openai ? "max_tokens" : "max_new_tokens";
    if ((v = given(src, mname))) {
        if (!json_is_integer(v)) return refuse(err, cap, 400, "'%s' must be an integer", mname);
        json_int_t x = json_integer_value(v);
        if (x < 1) return refuse(err, cap, 400, "'%s' must be at least 1", mname);
        if (x > (json_int_t)cfg->max_new_tokens_limit)
            return refuse(err, cap, 400, "'%s' = %lld is above the limit %u", mname, (long long)x,
                          cfg->max_new_tokens_limit);
        p->max_new = (uint32_t)x;
    }
    if ((v = given(src, "temperature"))) {
        if (!json_is_number(v)) return refuse(err, cap, 400, "'temperature' must be a number");
        p->temperature = json_number_value(v);
        if (!(p->temperature >= 0.0 && p->temperature <= 1e6))
            return refuse(err, cap, 400, "'temperature' must be in [0, 1e6], not %g",
                          p->temperature);
    }
    if ((v = given(src, "top_p"))) {
        if (!json_is_number(v)) return refuse(err, cap, 400, "'top_p' must be a number");
        p->top_p = json_number_value(v);
        if (!(p->top_p > 0.0 && p->top_p <= 1.0))
            return refuse(err, cap, 400, "'top_p' must be in (0, 1]");
    }
    int status;
    if ((v = given(src, "stop_token_ids")) && (status = parse_stop_tokens(v, vocab, p, err, cap)))
        return status;
    if ((v = given(src, "ignore_eos"))) {
        if (!json_is_boolean(v)) return refuse(err, cap, 400, "'ignore_eos' must be a boolean");
        p->ignore_eos = json_is_true(v);
    }
    return 0;
}

/* Parameters the OpenAI and SGLang APIs define that pdserve does not
 * implement yet. Given with anything but their neutral value (the one that
 * means "off"), they are refused with a 400 naming them: a request that asks
 * for stop strings, n = 2 or logprobs must not get a 200 that silently
 * ignored it (issue 11). Unknown fields stay ignored, as OpenAI does. */
typedef enum neutral { N_NULL, N_ZERO, N_ONE, N_FALSE, N_EMPTY, N_MINUS_ONE_OR_ZERO } neutral;
typedef struct unsupported {
    const char *name;
    neutral off;
} unsupported;

static const unsupported openai_unsupported[] = {
    {"n", N_ONE},
    {"best_of", N_ONE},
    {"stop", N_EMPTY},
    {"logprobs", N_NULL},
    {"top_logprobs", N_NULL},
    {"echo", N_FALSE},
    {"seed", N_NULL},
    {"presence_penalty", N_ZERO},
    {"frequency_penalty", N_ZERO},
    {"logit_bias", N_EMPTY},
    {"suffix", N_EMPTY},
    {"max_completion_tokens", N_NULL},
};
static const unsupported sampling_unsupported[] = {
    {"n", N_ONE},
    {"stop", N_EMPTY},
    {"top_k", N_MINUS_ONE_OR_ZERO},
    {"min_p", N_ZERO},
    {"repetition_penalty", N_ONE},
    {"frequency_penalty", N_ZERO},
    {"presence_penalty", N_ZERO},
    {"sampling_seed", N_NULL},
    {"seed", N_NULL},
    {"regex", N_NULL},
    {"json_schema", N_NULL},
    {"ebnf", N_NULL},
};
static const unsupported generate_unsupported[] = {
    {"return_logprob", N_FALSE},
    {"top_logprobs_num", N_ZERO},
    {"logprob_start_len", N_MINUS_ONE_OR_ZERO},
    {"return_text_in_logprobs", N_FALSE},
    {"lora_path", N_NULL},
};

static bool is_neutral(json_t *v, neutral off) {
    double x = json_is_number(v) ? json_number_value(v) : NAN;
    switch (off) {
    case N_NULL: return false; /* given() already dropped null */
    case N_ZERO: return x == 0.0;
    case N_ONE: return x == 1.0;
    case N_FALSE: return json_is_false(v);
    case N_EMPTY:
        return (json_is_string(v) && json_string_length(v) == 0) ||
            (json_is_array(v) && json_array_size(v) == 0) ||
            (json_is_object(v) && json_object_size(v) == 0);
    case N_MINUS_ONE_OR_ZERO: return x == -1.0 || x == 0.0;
    }
    return false;
}

static int refuse_unsupported(json_t *src, const unsupported *u, size_t n, const char *where,
                              char *err, size_t cap) {
    for (size_t i = 0; i < n; i++) {
        json_t *v = given(src, u[i].name);
        if (v && !is_neutral(v, u[i].off))
            return refuse(err, cap, 400,
                          "'%s%s' is not supported by pdserve yet (docs/http-api.md lists "
                          "what is); leave it out",
                          where, u[i].name);
    }
    return 0;
}

static int parse_unsupported(json_t *root, json_t *src, bool openai, char *err, size_t cap) {
    if (openai)
        return refuse_unsupported(root, openai_unsupported, PD_ARRAY_LEN(openai_unsupported), "",
                                  err, cap);
    int status = refuse_unsupported(src, sampling_unsupported, PD_ARRAY_LEN(sampling_unsupported),
                                    "sampling_params.", err, cap);
    if (status) return status;
    return refuse_unsupported(root, generate_unsupported, PD_ARRAY_LEN(generate_unsupported), "",
                              err, cap);
}

/* The bootstrap fields, set by the router on prefill and decode nodes: the
 * room (required there) and the prefill node's address (the decode node's
 * peer, required on a decode node unless the transfer is in-process). */
/* A decode node contacts only the prefill peers it was given (--prefill-peers):
 * an exact "host:port" entry of the comma-separated list. */
static bool peer_allowed(const pd_node_config *cfg, const char *peer) {
    if (cfg->role != PD_NODE_DECODE || !cfg->prefill_peers || !peer[0]) return true;
    size_t len = strlen(peer);
    for (const char *s = cfg->prefill_peers; *s;) {
        const char *end = strchr(s, ',');
        size_t n = end ? (size_t)(end - s) : strlen(s);
        if (n == len && !strncmp(s, peer, n)) return true;
        if (!end) break;
        s = end + 1;
    }
    return false;
}

static int parse_bootstrap(const pd_node_config *cfg, json_t *root, parsed *p, char *err,
                           size_t cap) {
    json_t *room = json_object_get(root, "bootstrap_room");
    json_t *host = json_object_get(root, "bootstrap_host");
    json_t *port = json_object_get(root, "bootstrap_port");
    if (room && !json_is_null(room)) {
        if (!json_is_integer(room) || json_integer_value(room) <= 0)
            return refuse(err, cap, 400, "'bootstrap_room' must be a positive integer");
        p->room = (uint64_t)json_integer_value(room);
    }
    if (host && !json_is_null(host) && !json_is_string(host))
        return refuse(err, cap, 400, "'bootstrap_host' must be a string");
    if (port && !json_is_null(port) &&
        (!json_is_integer(port) || json_integer_value(port) < 1 ||
         json_integer_value(port) > 65535))
        return refuse(err, cap, 400, "'bootstrap_port' must be an integer in [1, 65535]");
    if (cfg->role == PD_NODE_SERVE) return 0;
    if (!p->room)
        return refuse(err, cap, 400,
                      "'bootstrap_room' is required on a %s node "
                      "(send requests through the router)",
                      pd_node_role_name(cfg->role));
    if (cfg->role == PD_NODE_DECODE && strcmp(cfg->transfer_backend, "loopback") != 0 &&
        (!json_is_string(host) || !json_is_integer(port)))
        return refuse(err, cap, 400,
                      "'bootstrap_host' and 'bootstrap_port' are required on a decode node");
    if (json_is_string(host) && json_is_integer(port))
        snprintf(p->peer, sizeof(p->peer), "%s:%lld", json_string_value(host),
                 (long long)json_integer_value(port));
    if (!peer_allowed(cfg, p->peer))
        return refuse(err, cap, 403, "bootstrap peer '%s' is not one of --prefill-peers", p->peer);
    return 0;
}

/* ---- /v1/chat/completions ----------------------------------------------------------- */

/* The chat template of the built-in tiny model (docs/http-api.md): each
 * message as "<|role|>\n" content "\n", then "<|assistant|>\n" for the
 * answer. A model that ships its own template will bring it (issue 12). */
static char *render_chat(json_t *messages, int *status, char *err, size_t cap) {
    if (!json_is_array(messages) || json_array_size(messages) == 0) {
        *status = refuse(err, cap, 400, "'messages' must be a non-empty array of messages");
        return NULL;
    }
    size_t need = 16, i;
    json_t *m;
    json_array_foreach(messages, i, m) {
        json_t *role = json_object_get(m, "role"), *content = json_object_get(m, "content");
        const char *r = json_string_value(role);
        if (!r || (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant"))) {
            *status =
                refuse(err, cap, 400, "'messages'[%zu].role must be system, user or assistant", i);
            return NULL;
        }
        if (!json_is_string(content)) {
            *status = refuse(err, cap, 400, "'messages'[%zu].content must be a string", i);
            return NULL;
        }
        need += strlen(r) + json_string_length(content) + 8;
    }
    char *out = malloc(need), *w = out;
    if (!out) {
        *status = refuse(err, cap, 503, "out of memory for the prompt");
        return NULL;
    }
    json_array_foreach(messages, i, m) {
        w += sprintf(w, "<|%s|>\n", json_string_value(json_object_get(m, "role")));
        json_t *content = json_object_get(m, "content");
        memcpy(w, json_string_value(content), json_string_length(content));
        w += json_string_length(content);
        *w++ = '\n';
    }
    strcpy(w, "<|assistant|>\n");
    return out;
}

/* stream_options: {"include_usage": bool} is understood (and taken out of
 * the body); anything else in it is refused. */
static int take_stream_options(json_t *root, bool *include_usage, char *err, size_t cap) {
    json_t *so = given(root, "stream_options");
    if (!so) return 0;
    json_t *iu = json_object_get(so, "include_usage");
    if (!json_is_object(so) || json_object_size(so) != (iu ? 1u : 0u) ||
        (iu && !json_is_boolean(iu)))
        return refuse(err, cap, 400, "'stream_options' supports only {\"include_usage\": bool}");
    *include_usage = json_is_true(iu);
    json_object_del(root, "stream_options");
    return 0;
}

/* Turns a chat body into the completions body it means: the messages
 * rendered into "prompt", max_completion_tokens as max_tokens. Chat-only
 * parameters pdserve lacks are refused by name. */
static int chat_to_completions(json_t *root, char *err, size_t cap) {
    static const char *const refused[] = {"tools", "functions", "response_format",
                                          "parallel_tool_calls", "top_logprobs"};
    for (size_t i = 0; i < PD_ARRAY_LEN(refused); i++) {
        json_t *v = given(root, refused[i]);
        if (v && !(json_is_array(v) && json_array_size(v) == 0))
            return refuse(err, cap, 400, "'%s' is not supported by pdserve yet; leave it out",
                          refused[i]);
    }
    json_t *tc = given(root, "tool_choice");
    if (tc && !(json_is_string(tc) && !strcmp(json_string_value(tc), "none")))
        return refuse(err, cap, 400, "'tool_choice' is not supported by pdserve yet");
    json_t *lp = given(root, "logprobs");
    if (lp && !json_is_false(lp))
        return refuse(err, cap, 400, "'logprobs' is not supported by pdserve yet; leave it out");
    json_object_del(root, "logprobs");
    json_t *mct = given(root, "max_completion_tokens");
    if (mct) {
        if (given(root, "max_tokens"))
            return refuse(err, cap, 400, "give 'max_completion_tokens' or 'max_tokens', not both");
        json_object_set(root, "max_tokens", mct);
        json_object_del(root, "max_completion_tokens");
    }
    if (json_object_get(root, "prompt"))
        return refuse(err, cap, 400, "a chat request has 'messages', not 'prompt'");
    int status = 0;
    char *text = render_chat(json_object_get(root, "messages"), &status, err, cap);
    if (!text) return status;
    json_object_set_new(root, "prompt", json_string(text));
    free(text);
    return json_object_get(root, "prompt") ? 0 : refuse(err, cap, 400, "messages are not UTF-8");
}

/* A request body into p: 0 on success; otherwise the HTTP status, with the
 * message in err. p->prompt is the caller's to free either way. */
static int parse_request(pd_node *n, json_t *root, bool openai, parsed *p, char *err, size_t cap) {
    const pd_node_config *cfg = node_config(n);
    memset(p, 0, sizeof(*p));
    p->max_new = openai ? 16 : 128;
    p->temperature = 0.0;
    p->top_p = 1.0;
    if (!json_is_object(root))
        return refuse(err, cap, 400, "the request body must be a JSON object");
    prompt_field prompt = {0};
    json_t *src = NULL;
    int status;
    if ((status = parse_shape(root, openai, &prompt, &src, err, cap))) return status;
    if ((status = parse_prompt(n, &prompt, p, err, cap))) return status;
    if ((status = parse_sampling(cfg, node_vocab(n), src, openai, p, err, cap))) return status;
    if ((status = parse_unsupported(root, src, openai, err, cap))) return status;
    json_t *v;
    if ((v = given(root, "stream"))) {
        if (!json_is_boolean(v)) return refuse(err, cap, 400, "'stream' must be a boolean");
        p->stream = json_is_true(v);
    }
    if ((v = given(root, "rid"))) {
        if (!json_is_string(v)) return refuse(err, cap, 400, "'rid' must be a string");
        if (!rid_acceptable(v)) return refuse(err, cap, 400, RID_RULE, PD_RID_MAX - 1);
        snprintf(p->rid, sizeof(p->rid), "%s", json_string_value(v));
    }
    return parse_bootstrap(cfg, root, p, err, cap);
}

/* ---- exchanges ------------------------------------------------------------------------- */

typedef enum ex_kind {
    EX_GENERATE,
    EX_COMPLETIONS,
    EX_CHAT,
    EX_ABORT,
    EX_INFO,
    EX_METRICS,
    EX_HEALTH,
    EX_MODELS /* /v1/models and /v1/models/{id} */
} ex_kind;

typedef enum ex_state {
    EX_FREE,       /* on the free list */
    EX_NEW,        /* handed over by the loop, not looked at yet */
    EX_SUBMITTING, /* generate: the scheduler has not taken or refused the call yet */
    EX_WAITING,    /* generate, whole answer: until the terminal event */
    EX_STREAMING,  /* generate, event stream: an event per wake while tokens come */
    EX_REPLY,      /* abort, info, metrics: until the scheduler's reply */
} ex_state;

typedef struct exchange {
    http_server *h;
    pd_http_req *r;
    ex_kind kind;
    ex_state state;
    bool queued, retired; /* h->mu (X2) */
    pd_link link;         /* the free list or the ready list (h->mu) */
    /* generate */
    call *c;
    parsed p;         /* p.stop is the submit's spec until the engine copied it */
    uint64_t created; /* /v1/completions "created" */
    uint32_t sent_tokens;
    bool sent_final, sent_done;
    char *ev; /* the next event, kept while stream_write refuses it (X5) */
    size_t ev_len;
    char carry[4]; /* an incomplete UTF-8 character held for the next event */
    size_t carry_len;
    char *so_far; /* /generate streams: the text of every event so far (cumulative mode) */
    size_t so_far_len;
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
    uint64_t started; /* Unix time: the served model's "created" */
};

static pd_links ex_links(http_server *h) { return PD_LINKS(h->ex, exchange, link); }
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

/* The end of an exchange (X3): nothing wakes it any more, its references are
 * dropped, and it is free (now, or once popped if still queued). */
static void ex_retire(exchange *e) {
    http_server *h = e->h;
    PD_ASSERT(e->state != EX_FREE && e->r != NULL);
    pd_http_req_watch(e->r, NULL, NULL);
    if (e->c) {
        pthread_mutex_lock(&e->c->mu);
        e->c->wake = NULL;
        pthread_mutex_unlock(&e->c->mu);
        call_unref(e->c);
    }
    if (e->reply_set) {
        pthread_mutex_destroy(&e->reply.mu);
        pthread_cond_destroy(&e->reply.cv);
        free(e->reply.text);
    }
    free(e->p.prompt);
    free(e->ev);
    free(e->so_far);
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

/* o as compact JSON (o is released; NULL, as a failed json_pack returns, is
 * out of memory). */
static void respond_value(pd_http_req *r, unsigned status, json_t *o) {
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
/* ---- outputs ----------------------------------------------------------------------- */

static const char *finish_name(const call *c) {
    if (c->kind == PD_TERM_FINISHED) {
        if (c->finish == PD_FINISH_STOP) return "stop";
        if (c->finish == PD_FINISH_TRANSFERRED) return "transferred";
        return "length";
    }
    return "abort";
}

/* Bytes of tokens [from, to), sanitised; an incomplete trailing UTF-8
 * character is kept in e->carry for the next piece unless final. NULL when
 * out of memory. */
static char *decode_text(exchange *e, const int32_t *tokens, uint32_t from, uint32_t to,
                         bool final) {
    size_t raw_len = pd_tokenizer_decode(tokens + from, to - from, NULL, 0);
    char *raw = malloc(e->carry_len + raw_len + 1);
    if (!raw) return NULL;
    memcpy(raw, e->carry, e->carry_len);
    pd_tokenizer_decode(tokens + from, to - from, raw + e->carry_len, raw_len + 1);
    size_t len = e->carry_len + raw_len;
    e->carry_len = 0;
    if (!final) {
        /* Hold back the start of a multi-byte character cut by the piece's end. */
        size_t k = len, back = 0;
        while (k > 0 && back < 3 && ((unsigned char)raw[k - 1] & 0xC0) == 0x80) {
            k--;
            back++;
        }
        if (k > 0) {
            unsigned char lead = (unsigned char)raw[k - 1];
            size_t want = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
            if (want > 1 && want > back + 1 && lead < 0xF8) {
                e->carry_len = back + 1;
                memcpy(e->carry, raw + k - 1, e->carry_len);
                len = k - 1;
            }
        }
    }
    size_t need = pd_utf8_sanitize(raw, len, NULL, 0);
    char *out = malloc(need + 1);
    if (out) pd_utf8_sanitize(raw, len, out, need + 1);
    free(raw);
    return out;
}

static json_t *meta_info(const call *c, bool final) {
    json_t *m = json_object();
    json_object_set_new(m, "id", json_string(c->rid));
    if (final) {
        json_t *fr = json_object();
        json_object_set_new(fr, "type", json_string(finish_name(c)));
        if (c->kind != PD_TERM_FINISHED) {
            json_object_set_new(fr, "message", json_string(c->message));
            json_object_set_new(fr, "status_code", json_integer(c->status));
        }
        json_object_set_new(m, "finish_reason", fr);
    } else {
        json_object_set_new(m, "finish_reason", json_null());
    }
    json_object_set_new(m, "prompt_tokens", json_integer(c->prompt_len));
    json_object_set_new(m, "completion_tokens", json_integer(c->n_tokens));
    json_object_set_new(m, "cached_tokens", json_integer(c->cached_tokens));
    if (final)
        json_object_set_new(m, "e2e_latency",
                            json_real((double)(c->t_done_us - c->t_submit_us) / 1e6));
    return m;
}

static json_t *ids_array(const int32_t *t, uint32_t from, uint32_t to) {
    json_t *a = json_array();
    for (uint32_t i = from; i < to; i++) json_array_append_new(a, json_integer(t[i]));
    return a;
}

/* A chat completion (whole) or chunk (streamed): the message, or the delta
 * with the role in the first chunk. */
static json_t *chat_choice(const call *c, const char *text, bool final, bool chunk, bool first) {
    json_t *msg = json_pack("{s:s}", "content", text);
    if (!chunk || first) json_object_set_new(msg, "role", json_string("assistant"));
    return json_pack("{s:i,s:o,s:o,s:n}", "index", 0, chunk ? "delta" : "message", msg,
                     "finish_reason", final ? json_string(finish_name(c)) : json_null(),
                     "logprobs");
}

static json_t *openai_body(exchange *e, const call *c, const char *text, bool final,
                           bool with_usage) {
    const pd_node_config *cfg = node_config(e->h->n);
    char id[PD_RID_MAX + 12];
    snprintf(id, sizeof(id), "%s-%s", c->chat ? "chatcmpl" : "cmpl", c->rid);
    bool chunk = c->stream;
    json_t *choice = c->chat
        ? chat_choice(c, text, final, chunk, e->sent_tokens == 0)
        : json_pack("{s:i,s:s,s:o,s:n}", "index", 0, "text", text, "finish_reason",
                    final ? json_string(finish_name(c)) : json_null(), "logprobs");
    const char *object = !c->chat ? "text_completion"
        : chunk                   ? "chat.completion.chunk"
                                  : "chat.completion";
    json_t *body = json_pack("{s:s,s:s,s:I,s:s,s:[o]}", "id", id, "object", object, "created",
                             (json_int_t)e->created, "model", cfg->served_model_name, "choices",
                             choice);
    if (with_usage && (!chunk || !c->chat || c->include_usage))
        json_object_set_new(body, "usage",
                            json_pack("{s:i,s:i,s:i}", "prompt_tokens", c->prompt_len,
                                      "completion_tokens", c->n_tokens, "total_tokens",
                                      c->prompt_len + c->n_tokens));
    return body;
}

int node_http_check_body(pd_node *n, const char *body, size_t len, bool openai, char *err,
                         size_t cap) {
    json_error_t jerr;
    json_t *root = json_loadb(body, len, 0, &jerr);
    if (!root) return refuse(err, cap, 400, "malformed JSON: %s", jerr.text);
    parsed p;
    int status = parse_request(n, root, openai, &p, err, cap);
    json_decref(root);
    free(p.prompt);
    return status;
}

/* ---- the event stream ------------------------------------------------------------------ */

/* The next SSE event into e->ev (obj NULL: the closing [DONE]); false when
 * out of memory. */
static bool set_event(exchange *e, json_t *obj) {
    char *text = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    if (obj) json_decref(obj);
    PD_ASSERT(e->ev == NULL);
    if (obj && !text) return false;
    size_t len = text ? strlen(text) : 6;
    e->ev = malloc(len + 9);
    if (e->ev) e->ev_len = (size_t)snprintf(e->ev, len + 9, "data: %s\n\n", text ? text : "[DONE]");
    free(text);
    return e->ev != NULL;
}

/* Appends a piece of text to e->so_far; false when out of memory. */
static bool so_far_add(exchange *e, const char *text) {
    size_t n = strlen(text);
    char *b = realloc(e->so_far, e->so_far_len + n + 1);
    if (!b) return false;
    memcpy(b + e->so_far_len, text, n + 1);
    e->so_far = b;
    e->so_far_len += n;
    return true;
}

/* A /generate event: SGLang's default is cumulative (the whole text and
 * every token id so far, in each event); --incremental-streaming-output sends
 * only what is new. The final event is always the complete output. */
static json_t *generate_event(exchange *e, const char *delta, uint32_t from, uint32_t to,
                              bool final) {
    call *c = e->c;
    bool whole = final || !node_config(e->h->n)->incremental_streaming_output;
    if (!so_far_add(e, delta)) return NULL;
    json_t *ev = json_object();
    json_object_set_new(ev, "text", json_string(whole ? e->so_far : delta));
    json_object_set_new(ev, "output_ids", ids_array(c->tokens, whole ? 0 : from, to));
    pthread_mutex_lock(&c->mu);
    json_object_set_new(ev, "meta_info", meta_info(c, final));
    pthread_mutex_unlock(&c->mu);
    return ev;
}

/* The event for tokens [e->sent_tokens, have). */
static json_t *token_event(exchange *e, uint32_t have) {
    call *c = e->c;
    /* Tokens are only appended, and the ones below `have` are final. */
    char *text = decode_text(e, c->tokens, e->sent_tokens, have, false);
    if (!text) return NULL;
    json_t *ev = c->openai ? openai_body(e, c, text, false, false)
                           : generate_event(e, text, e->sent_tokens, have, false);
    free(text);
    e->sent_tokens = have;
    return ev;
}

/* The last event before [DONE], once the call is done. */
static json_t *final_event(exchange *e) {
    call *c = e->c;
    char *text = decode_text(e, c->tokens, c->n_tokens, c->n_tokens, true);
    if (!text) return NULL;
    json_t *ev = c->openai ? openai_body(e, c, text, true, true)
                           : generate_event(e, text, 0, c->n_tokens, true);
    free(text);
    return ev;
}

typedef enum ev_next { EV_NONE, EV_READY, EV_FAILED } ev_next;

/* Makes the next event, if there is one yet: new tokens, then the final
 * event once the call is done, then [DONE]. */
static ev_next next_event(exchange *e) {
    call *c = e->c;
    PD_ASSERT(e->ev == NULL && !e->sent_done);
    if (e->sent_final) {
        e->sent_done = true;
        return set_event(e, NULL) ? EV_READY : EV_FAILED;
    }
    pthread_mutex_lock(&c->mu);
    uint32_t have = c->n_tokens;
    bool done = c->done;
    pthread_mutex_unlock(&c->mu);
    json_t *ev;
    if (have > e->sent_tokens) {
        ev = token_event(e, have);
    } else if (done) {
        ev = final_event(e);
        e->sent_final = true;
    } else {
        return EV_NONE; /* the next token or the end wakes us */
    }
    return ev && set_event(e, ev) ? EV_READY : EV_FAILED;
}

/* EX_STREAMING: as many events as there are, until the stream ends, the
 * client leaves, or stream_write refuses (X5: the event waits in e->ev for
 * the WRITABLE wake, or the next token's). */
static void gen_stream(exchange *e) {
    pd_node *n = e->h->n;
    for (;;) {
        if (pd_http_req_gone(e->r)) {
            abort_call(n, e->c); /* X4 */
            ex_retire(e);
            return;
        }
        if (e->ev) {
            pd_err err = pd_http_req_stream_write(e->r, e->ev, e->ev_len);
            if (err == PD_ERR_NOMEM) return;
            if (err) { /* PD_ERR_STATE: the client left meanwhile */
                abort_call(n, e->c);
                ex_retire(e);
                return;
            }
            free(e->ev);
            e->ev = NULL;
        }
        if (e->sent_done) {
            pd_http_req_stream_end(e->r);
            ex_retire(e);
            return;
        }
        ev_next next = next_event(e);
        if (next == EV_NONE) return;
        if (next == EV_FAILED) { /* out of memory: the stream ends without [DONE] */
            abort_call(n, e->c);
            pd_http_req_stream_end(e->r);
            ex_retire(e);
            return;
        }
    }
}

/* ---- generate -------------------------------------------------------------------------- */

/* A refused body that still names a room: the other node's half of the
 * request (the router sends both at once) must not wait for this one. */
static void cancel_refused(pd_node *n, json_t *root) {
    json_t *room = json_object_get(root, "bootstrap_room");
    if (!json_is_integer(room) || json_integer_value(room) <= 0) return;
    json_t *host = json_object_get(root, "bootstrap_host");
    json_t *port = json_object_get(root, "bootstrap_port");
    char peer[PD_PEER_MAX] = "";
    if (json_is_string(host) && json_is_integer(port) && json_integer_value(port) >= 1 &&
        json_integer_value(port) <= 65535)
        snprintf(peer, sizeof(peer), "%s:%lld", json_string_value(host),
                 (long long)json_integer_value(port));
    if (!peer_allowed(node_config(n), peer)) peer[0] = '\0'; /* never contacted */
    node_cancel_room(n, (uint64_t)json_integer_value(room), peer);
}

/* A call for the parsed request; it takes p->prompt. Its spec points at
 * p->stop, so p must outlive the submit. */
static void call_fill(pd_node *n, call *c, parsed *p, bool openai) {
    if (p->rid[0]) snprintf(c->rid, sizeof(c->rid), "%s", p->rid);
    else snprintf(c->rid, sizeof(c->rid), "%s-%llu", pd_node_role_name(node_config(n)->role),
                  (unsigned long long)node_next_rid(n));
    snprintf(c->peer, sizeof(c->peer), "%s", p->peer);
    c->prompt = p->prompt;
    c->prompt_len = p->prompt_len;
    c->stream = p->stream;
    c->openai = openai;
    c->tokens = calloc(p->max_new + 1, sizeof(int32_t));
    c->logprobs = calloc(p->max_new + 1, sizeof(float));
    c->spec = (pd_request_spec){
        .rid = c->rid,
        .room = p->room,
        .prompt = c->prompt,
        .prompt_len = c->prompt_len,
        .max_new_tokens = p->max_new,
        .sampling = {.temperature = (float)p->temperature,
                     .top_p = (float)p->top_p,
                     .seed = pd_hash_u64(p->room ^ pd_hash_tokens(c->prompt, c->prompt_len, 7))},
        .stop_tokens = p->stop,
        .n_stop_tokens = p->n_stop,
        .ignore_eos = p->ignore_eos,
        .peer = c->peer,
    };
}

/* The whole answer of a finished call, in the shape of its API. */
static void answer_done(exchange *e) {
    call *c = e->c;
    char *text = decode_text(e, c->tokens, 0, c->n_tokens, true);
    if (!text) {
        pd_http_req_respond_error(e->r, 503, "out of memory for the answer");
        return;
    }
    unsigned http = (c->kind == PD_TERM_FAILED && c->status >= 400) ? (unsigned)c->status : 200;
    json_t *body;
    if (e->kind == EX_COMPLETIONS || e->kind == EX_CHAT) {
        if (c->kind == PD_TERM_FAILED) {
            free(text);
            pd_http_req_respond_error(e->r, http, "%s", c->message);
            return;
        }
        body = openai_body(e, c, text, true, true);
    } else {
        body = json_object();
        json_object_set_new(body, "text", json_string(text));
        json_object_set_new(body, "output_ids", ids_array(c->tokens, 0, c->n_tokens));
        json_object_set_new(body, "meta_info", meta_info(c, true));
    }
    free(text);
    respond_value(e->r, http, body);
}

/* EX_WAITING: the whole answer once the call is done. */
static void gen_wait(exchange *e) {
    call *c = e->c;
    if (pd_http_req_gone(e->r)) {
        abort_call(e->h->n, c); /* X4 */
        ex_retire(e);
        return;
    }
    pthread_mutex_lock(&c->mu);
    bool done = c->done;
    pthread_mutex_unlock(&c->mu);
    if (!done) return;
    answer_done(e); /* done: the scheduler writes to c no more */
    ex_retire(e);
}

/* EX_SUBMITTING: the engine took the call (on to waiting or streaming) or
 * refused it (its status and message). */
static void gen_submitted(exchange *e) {
    call *c = e->c;
    pthread_mutex_lock(&c->mu);
    bool submitted = c->submitted;
    pthread_mutex_unlock(&c->mu);
    if (!submitted) return;     /* also when the client left: X4 */
    c->spec.stop_tokens = NULL; /* the engine copied them out of e->p */
    if (c->submit_err != PD_OK) {
        ex_fail(e, c->reject.status ? (unsigned)c->reject.status : 500, "%s", c->reject.message);
        return;
    }
    if (!c->stream) {
        e->state = EX_WAITING;
        gen_wait(e);
        return;
    }
    e->state = EX_STREAMING;
    pd_http_req_add_header(e->r, "Cache-Control", "no-cache");
    if (pd_http_req_stream_begin(e->r, 200, "text/event-stream") == PD_ERR_NOMEM) {
        abort_call(e->h->n, c);
        ex_fail(e, 503, "out of memory for the answer");
        return;
    }
    gen_stream(e); /* PD_ERR_STATE: the client left; gen_stream sees it */
}

/* EX_NEW for /generate and /v1/completions: parse, check, submit. */
static void gen_begin(exchange *e) {
    pd_node *n = e->h->n;
    bool openai = e->kind == EX_COMPLETIONS || e->kind == EX_CHAT;
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
    bool include_usage = false;
    int status = openai ? take_stream_options(root, &include_usage, err, sizeof(err)) : 0;
    if (!status && e->kind == EX_CHAT) status = chat_to_completions(root, err, sizeof(err));
    if (!status) status = parse_request(n, root, openai, &e->p, err, sizeof(err));
    if (status) cancel_refused(n, root);
    json_decref(root);
    if (status) {
        ex_fail(e, (unsigned)status, "%s", err);
        return;
    }
    call *c = call_new();
    if (!c) {
        ex_fail(e, 503, "out of memory");
        return;
    }
    call_fill(n, c, &e->p, openai); /* takes p.prompt; the spec points at e->p.stop */
    c->chat = e->kind == EX_CHAT;
    c->include_usage = include_usage;
    e->p.prompt = NULL;
    e->c = c;
    if (!c->tokens || !c->logprobs) {
        ex_fail(e, 503, "out of memory for the answer");
        return;
    }
    e->created = (uint64_t)time(NULL);
    c->wake = ex_wake; /* nobody else knows c yet */
    c->wake_ctx = e;
    e->state = EX_SUBMITTING;
    pd_err qerr = node_command(n, CMD_SUBMIT, c, NULL, NULL);
    if (qerr) {
        ex_fail(e, qerr == PD_ERR_STATE ? 503 : 429, "%s",
                qerr == PD_ERR_STATE ? "the server is shutting down" : "the command queue is full");
        return;
    }
    pd_http_req_watch(e->r, ex_watch, e); /* the client leaving, and WRITABLE */
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
    bool rid_ok = rid_given && rid_acceptable(rid);
    if (rid_ok) snprintf(e->p.rid, sizeof(e->p.rid), "%s", json_string_value(rid));
    json_decref(root);
    if (rid_given && !rid_ok) {
        ex_fail(e, 400, RID_RULE, PD_RID_MAX - 1);
        return;
    }
    if (!abort_all && !rid_ok) {
        ex_fail(e, 400, "give 'rid' (a string) or 'abort_all': true");
        return;
    }
    if (!ex_command(e, abort_all ? CMD_ABORT_ALL : CMD_ABORT, abort_all ? NULL : e->p.rid))
        ex_fail(e, 503, "the server is shutting down");
}

static void answer_abort(exchange *e) {
    if (e->cmd == CMD_ABORT && e->reply.value == 0) {
        pd_http_req_respond_error(e->r, 404, "no live request has rid '%s'", e->p.rid);
        return;
    }
    respond_value(e->r, 200, json_pack("{s:I}", "aborted", (json_int_t)e->reply.value));
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
    else answer_text(e);
    ex_retire(e);
}

/* ---- the responder --------------------------------------------------------------------- */

static void ex_run(exchange *e) {
    switch (e->state) {
    case EX_NEW:
        if (e->kind == EX_GENERATE || e->kind == EX_COMPLETIONS || e->kind == EX_CHAT) gen_begin(e);
        else if (e->kind == EX_ABORT) abort_begin(e);
        else if (!ex_command(e, e->kind == EX_INFO ? CMD_INFO : CMD_METRICS, NULL))
            ex_fail(e, 503, "the server is shutting down");
        break;
    case EX_SUBMITTING: gen_submitted(e); break;
    case EX_WAITING: gen_wait(e); break;
    case EX_STREAMING: gen_stream(e); break;
    case EX_REPLY: reply_check(e); break;
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
    {"/v1/models", "GET", EX_MODELS},
};

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
        respond_value(r, 200, json_pack("{s:s, s:[o]}", "object", "list", "data", model));
    } else if (!strcmp(path + 11, name)) {
        respond_value(r, 200, model);
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
    const char *path = pd_http_req_path(r), *method = pd_http_req_method(r);
    const route *rt = find_route(path);
    if (!rt) {
        pd_http_req_respond_error(r, 404, "no such path: %s", path);
    } else if (strcmp(method, rt->method)) {
        pd_http_req_add_header(r, "Allow", rt->method);
        pd_http_req_respond_error(r, 405, "%s %s is not allowed (use %s)", method, path,
                                  rt->method);
    } else if (node_stopping(h->n)) {
        pd_http_req_respond_error(r, 503, "the server is shutting down");
    } else if (rt->kind == EX_HEALTH) {
        respond_value(r, 200,
                      json_pack("{s:s,s:s}", "status", "ok", "role", pd_node_role_name(cfg->role)));
    } else if (rt->kind == EX_MODELS) {
        answer_models(h, r, path);
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
    if (!h->ex) {
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
     * server's grace, the rest see GONE and are retired. */
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
