/*
 * http.c — the HTTP API of a node (docs/http-api.md) on libmicrohttpd, one
 * thread per connection.
 *
 * A request body is collected up to --max-body-bytes (beyond: 413), parsed
 * with jansson, checked field by field (a wrong type is a 400 naming the
 * field), turned into an engine request and handed to the scheduler. The
 * connection's thread then waits for the outputs: for a plain response it
 * waits for the terminal event; for a streaming one, MHD pulls server-sent
 * events from a reader callback that waits for the next tokens. While
 * waiting it watches the client's socket: a client that hangs up aborts its
 * request.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#include "node_internal.h"
#include "pdserve/http.h"
#include "pdserve/tokenizer.h"

struct http_server {
    struct MHD_Daemon *d;
    pd_node *n;
};

typedef struct conn_state {
    pd_node *n;
    char *body;
    size_t len, cap;
    bool too_big;
    call *c;
    int fd;
    /* streaming */
    uint32_t sent_tokens;
    bool sent_final, sent_done;
    char *ev;                /* the event being written */
    size_t ev_len, ev_off;
    char carry[4];           /* an incomplete UTF-8 character held for the next event */
    size_t carry_len;
    uint64_t created;        /* /v1/completions "created" */
} conn_state;

/* ---- responses -----------------------------------------------------------------
 * Bodies, errors and headers come from the http layer (pdserve/http.h), shared
 * with the router; only the event stream is built here. */

#define send_error(conn, status, ...) \
    pd_http_queue_error(conn, (unsigned)(status), NULL, __VA_ARGS__)

/* ---- client liveness ----------------------------------------------------------------- */

/* True if the client closed its side (or the socket broke). */
static bool client_gone(int fd) {
    if (fd < 0) return false;
    struct pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP};
    if (poll(&p, 1, 0) <= 0) return false;
    if (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) return true;
    if (p.revents & POLLIN) {
        char b;
        ssize_t k = recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
        return k == 0;
    }
    return false;
}

static void abort_call(pd_node *n, call *c) {
    pthread_mutex_lock(&c->mu);
    bool send = !c->done && !c->aborting;
    c->aborting = true;
    pthread_mutex_unlock(&c->mu);
    if (send) node_command(n, CMD_ABORT, NULL, c->rid, NULL);
}

/* Waits (up to wait_ms) for c to have more than `have` tokens or be done.
 * Returns false if the client hung up meanwhile (the request is aborted). */
static bool wait_outputs(conn_state *st, uint32_t have, int wait_ms) {
    call *c = st->c;
    uint64_t until = node_now_us() + (uint64_t)wait_ms * 1000;
    pthread_mutex_lock(&c->mu);
    while (!c->done && c->n_tokens <= have) {
        uint64_t now = node_now_us();
        if (now >= until) break;
        pthread_mutex_unlock(&c->mu);
        if (client_gone(st->fd)) {
            abort_call(st->n, c);
            return false;
        }
        pthread_mutex_lock(&c->mu);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 50 * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        if (!c->done && c->n_tokens <= have) pthread_cond_timedwait(&c->cv, &c->mu, &ts);
    }
    pthread_mutex_unlock(&c->mu);
    return true;
}

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
 * character is kept in st->carry for the next piece unless final. NULL when
 * out of memory. */
static char *decode_text(conn_state *st, const int32_t *tokens, uint32_t from, uint32_t to,
                         bool final) {
    size_t raw_len = pd_tokenizer_decode(tokens + from, to - from, NULL, 0);
    char *raw = malloc(st->carry_len + raw_len + 1);
    if (!raw) return NULL;
    memcpy(raw, st->carry, st->carry_len);
    pd_tokenizer_decode(tokens + from, to - from, raw + st->carry_len, raw_len + 1);
    size_t len = st->carry_len + raw_len;
    st->carry_len = 0;
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
                st->carry_len = back + 1;
                memcpy(st->carry, raw + k - 1, st->carry_len);
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

static json_t *openai_body(conn_state *st, const call *c, const char *text, bool final,
                           bool with_usage) {
    const pd_node_config *cfg = node_config(st->n);
    char id[PD_RID_MAX + 8];
    snprintf(id, sizeof(id), "cmpl-%s", c->rid);
    json_t *choice = json_pack("{s:i,s:s,s:o,s:n}", "index", 0, "text", text, "finish_reason",
                               final ? json_string(finish_name(c)) : json_null(), "logprobs");
    json_t *body = json_pack("{s:s,s:s,s:I,s:s,s:[o]}", "id", id, "object", "text_completion",
                             "created", (json_int_t)st->created, "model", cfg->served_model_name,
                             "choices", choice);
    if (with_usage)
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

/* ---- streaming ------------------------------------------------------------------------- */

/* The next SSE event (NULL: the closing [DONE]); false when out of memory,
 * and the stream ends there. */
static bool set_event(conn_state *st, json_t *obj) {
    char *text = obj ? json_dumps(obj, JSON_COMPACT) : NULL;
    if (obj) json_decref(obj);
    free(st->ev);
    st->ev = NULL;
    st->ev_len = st->ev_off = 0;
    if (obj && !text) return false;
    size_t len = text ? strlen(text) : 6;
    st->ev = malloc(len + 9);
    if (st->ev)
        st->ev_len = (size_t)snprintf(st->ev, len + 9, "data: %s\n\n", text ? text : "[DONE]");
    free(text);
    return st->ev != NULL;
}

static ssize_t sse_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    conn_state *st = cls;
    call *c = st->c;
    for (;;) {
        if (st->ev_off < st->ev_len) {
            size_t k = PD_MIN(max, st->ev_len - st->ev_off);
            memcpy(buf, st->ev + st->ev_off, k);
            st->ev_off += k;
            return (ssize_t)k;
        }
        if (st->sent_done) return MHD_CONTENT_READER_END_OF_STREAM;
        if (st->sent_final) {
            st->sent_done = true;
            if (!set_event(st, NULL)) return MHD_CONTENT_READER_END_WITH_ERROR; /* [DONE] */
            continue;
        }
        if (!wait_outputs(st, st->sent_tokens, 200)) return MHD_CONTENT_READER_END_WITH_ERROR;
        pthread_mutex_lock(&c->mu);
        uint32_t have = c->n_tokens;
        bool done = c->done;
        pthread_mutex_unlock(&c->mu);
        if (have > st->sent_tokens) {
            /* Tokens are only appended, and the ones below `have` are final. */
            char *text = decode_text(st, c->tokens, st->sent_tokens, have, false);
            if (!text) return MHD_CONTENT_READER_END_WITH_ERROR;
            json_t *ev;
            if (c->openai) {
                ev = openai_body(st, c, text, false, false);
            } else {
                ev = json_object();
                json_object_set_new(ev, "text", json_string(text));
                json_object_set_new(ev, "output_ids", ids_array(c->tokens, st->sent_tokens, have));
                pthread_mutex_lock(&c->mu);
                json_object_set_new(ev, "meta_info", meta_info(c, false));
                pthread_mutex_unlock(&c->mu);
            }
            free(text);
            st->sent_tokens = have;
            if (!set_event(st, ev)) return MHD_CONTENT_READER_END_WITH_ERROR;
        } else if (done) {
            char *text = decode_text(st, c->tokens, have, have, true);
            if (!text) return MHD_CONTENT_READER_END_WITH_ERROR;
            json_t *ev;
            if (c->openai) {
                ev = openai_body(st, c, text, true, true);
            } else {
                ev = json_object();
                json_object_set_new(ev, "text", json_string(text));
                json_object_set_new(ev, "output_ids", json_array());
                json_object_set_new(ev, "meta_info", meta_info(c, true));
            }
            free(text);
            st->sent_final = true;
            if (!set_event(st, ev)) return MHD_CONTENT_READER_END_WITH_ERROR;
        }
    }
}

static void sse_free(void *cls) { (void)cls; /* conn_state is freed by the completed callback */ }

/* ---- handlers -------------------------------------------------------------------------- */

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

/* Hands c to the scheduler and waits until the engine took or refused it:
 * 0 when it took it; otherwise the HTTP status, with the message in err. */
static int submit_call(pd_node *n, call *c, char *err, size_t cap) {
    pd_err qerr = node_command(n, CMD_SUBMIT, c, NULL, NULL);
    if (qerr == PD_ERR_STATE) return refuse(err, cap, 503, "the server is shutting down");
    if (qerr) return refuse(err, cap, 429, "the command queue is full");
    pthread_mutex_lock(&c->mu);
    while (!c->submitted) pthread_cond_wait(&c->cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    c->spec.stop_tokens = NULL; /* the engine copied them */
    if (c->submit_err == PD_OK) return 0;
    return refuse(err, cap, c->reject.status ? c->reject.status : 500, "%s", c->reject.message);
}

/* The response is an event stream that sse_reader produces as tokens come. */
static enum MHD_Result queue_stream(conn_state *st, struct MHD_Connection *conn) {
    struct MHD_Response *r =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 4096, sse_reader, st, sse_free);
    if (!r) return MHD_NO;
    MHD_add_response_header(r, "Content-Type", "text/event-stream");
    MHD_add_response_header(r, "Cache-Control", "no-cache");
    enum MHD_Result ret = MHD_queue_response(conn, 200, r);
    MHD_destroy_response(r);
    return ret;
}

/* Waits for the call's terminal event; false when the client hung up
 * meanwhile (the request is being aborted). */
static bool wait_done(conn_state *st) {
    call *c = st->c;
    for (;;) {
        pthread_mutex_lock(&c->mu);
        bool done = c->done;
        uint32_t have = c->n_tokens;
        pthread_mutex_unlock(&c->mu);
        if (done) return true;
        if (!wait_outputs(st, have, 200)) return false;
    }
}

/* The whole answer of a finished call, in the shape of its API. */
static enum MHD_Result answer_done(conn_state *st, struct MHD_Connection *conn, bool openai) {
    call *c = st->c;
    char *text = decode_text(st, c->tokens, 0, c->n_tokens, true);
    if (!text) return send_error(conn, 503, "out of memory for the answer");
    int http = (c->kind == PD_TERM_FAILED && c->status >= 400) ? c->status : 200;
    json_t *body;
    if (openai) {
        if (c->kind == PD_TERM_FAILED) {
            free(text);
            return send_error(conn, http, "%s", c->message);
        }
        body = openai_body(st, c, text, true, true);
    } else {
        body = json_object();
        json_object_set_new(body, "text", json_string(text));
        json_object_set_new(body, "output_ids", ids_array(c->tokens, 0, c->n_tokens));
        json_object_set_new(body, "meta_info", meta_info(c, true));
    }
    free(text);
    return pd_http_queue_json_value(conn, (unsigned)http, body);
}

static enum MHD_Result handle_generate(conn_state *st, struct MHD_Connection *conn, bool openai) {
    pd_node *n = st->n;
    if (st->too_big)
        return send_error(conn, 413, "the body is larger than %zu bytes",
                          node_config(n)->max_body_bytes);
    json_error_t jerr;
    json_t *root = json_loadb(st->body ? st->body : "", st->len, 0, &jerr);
    if (!root)
        return send_error(conn, 400, "malformed JSON: %s (line %d, column %d)", jerr.text,
                          jerr.line, jerr.column);
    parsed p;
    char err[256];
    int status = parse_request(n, root, openai, &p, err, sizeof(err));
    if (status) cancel_refused(n, root);
    json_decref(root);
    if (status) {
        free(p.prompt);
        return send_error(conn, status, "%s", err);
    }
    call *c = call_new();
    if (!c) {
        free(p.prompt);
        return send_error(conn, 503, "out of memory");
    }
    call_fill(n, c, &p, openai);
    /* p.stop lives on this stack frame until the submit is answered. */
    st->c = c; /* released with the connection, whatever happens next */
    if (!c->tokens || !c->logprobs) return send_error(conn, 503, "out of memory for the answer");
    st->created = (uint64_t)time(NULL);
    if ((status = submit_call(n, c, err, sizeof(err)))) return send_error(conn, status, "%s", err);
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    st->fd = ci ? ci->connect_fd : -1;
    if (c->stream) return queue_stream(st, conn);
    /* A client that hung up has its request aborted; nobody to answer. */
    if (!wait_done(st)) return MHD_NO;
    return answer_done(st, conn, openai);
}

static enum MHD_Result handle_abort(conn_state *st, struct MHD_Connection *conn) {
    pd_node *n = st->n;
    if (st->too_big) return send_error(conn, 413, "the body is too large");
    json_error_t jerr;
    json_t *root = json_loadb(st->body ? st->body : "", st->len, 0, &jerr);
    if (!root)
        return send_error(conn, 400, "malformed JSON: %s (line %d, column %d)", jerr.text,
                          jerr.line, jerr.column);
    if (!json_is_object(root)) {
        json_decref(root);
        return send_error(conn, 400, "the request body must be a JSON object");
    }
    json_t *rid = json_object_get(root, "rid"), *all = json_object_get(root, "abort_all");
    cmd_reply reply;
    pd_err err;
    if (all && json_is_true(all)) {
        json_decref(root);
        err = node_command_wait(n, CMD_ABORT_ALL, NULL, &reply);
    } else if (rid && json_is_string(rid) && !rid_acceptable(rid)) {
        json_decref(root);
        return send_error(conn, 400, RID_RULE, PD_RID_MAX - 1);
    } else if (rid && json_is_string(rid)) {
        char r[PD_RID_MAX];
        snprintf(r, sizeof(r), "%s", json_string_value(rid));
        json_decref(root);
        err = node_command_wait(n, CMD_ABORT, r, &reply);
        if (!err && reply.value == 0)
            return send_error(conn, 404, "no live request has rid '%s'", r);
    } else {
        json_decref(root);
        return send_error(conn, 400, "give 'rid' (a string) or 'abort_all': true");
    }
    if (err) return send_error(conn, 503, "the server is shutting down");
    json_t *body = json_pack("{s:I}", "aborted", (json_int_t)reply.value);
    return pd_http_queue_json_value(conn, 200, body);
}

static enum MHD_Result handle_text_command(conn_state *st, struct MHD_Connection *conn,
                                           cmd_kind kind) {
    cmd_reply reply;
    if (node_command_wait(st->n, kind, NULL, &reply) != PD_OK)
        return send_error(conn, 503, "the server is shutting down");
    if (!reply.text && reply.value == PD_ERR_TOOBIG)
        return send_error(conn, 500,
                          "the metrics text is larger than its %u-byte buffer; "
                          "no partial metrics are served",
                          (unsigned)METRICS_TEXT_BYTES);
    if (!reply.text)
        return send_error(conn, 500, "the server could not build its answer (%s)",
                          pd_err_name((pd_err)reply.value));
    const char *type = kind == CMD_INFO ? "application/json" : "text/plain; version=0.0.4";
    enum MHD_Result ret = pd_http_queue_text(conn, 200, type, reply.text, strlen(reply.text));
    free(reply.text);
    return ret;
}

typedef struct route {
    const char *path, *method;
} route;

static const route routes[] = {
    {"/generate", "POST"}, {"/v1/completions", "POST"}, {"/abort_request", "POST"},
    {"/health", "GET"},    {"/server_info", "GET"},     {"/get_server_info", "GET"},
    {"/metrics", "GET"},
};

static enum MHD_Result handler(void *cls, struct MHD_Connection *conn, const char *url,
                               const char *method, const char *version, const char *upload,
                               size_t *upload_size, void **con_cls) {
    pd_node *n = cls;
    conn_state *st = *con_cls;
    if (!st) {
        st = calloc(1, sizeof(*st));
        if (!st) return MHD_NO;
        st->n = n;
        st->fd = -1;
        *con_cls = st;
        /* Framing a proxy could read otherwise: refused before the body. */
        const char *ambiguous = pd_http_ambiguous(conn, version);
        if (ambiguous) return send_error(conn, 400, "%s", ambiguous);
        return MHD_YES;
    }
    if (*upload_size) {
        size_t limit = node_config(n)->max_body_bytes;
        if (!st->too_big && st->len + *upload_size <= limit) {
            if (st->len + *upload_size + 1 > st->cap) {
                size_t cap = PD_MAX(st->cap * 2, st->len + *upload_size + 1);
                char *b = realloc(st->body, cap);
                if (!b) return MHD_NO;
                st->body = b;
                st->cap = cap;
            }
            memcpy(st->body + st->len, upload, *upload_size);
            st->len += *upload_size;
        } else {
            st->too_big = true; /* keep reading, answer 413 at the end */
        }
        *upload_size = 0;
        return MHD_YES;
    }
    const route *r = NULL;
    for (size_t i = 0; i < PD_ARRAY_LEN(routes); i++)
        if (!strcmp(url, routes[i].path)) r = &routes[i];
    if (!r) return send_error(conn, 404, "no such path: %s", url);
    if (strcmp(method, r->method))
        return pd_http_queue_error(conn, 405, r->method, "%s %s is not allowed (use %s)", method,
                                   url, r->method);
    if (node_stopping(n)) return send_error(conn, 503, "the server is shutting down");
    if (!strcmp(url, "/generate")) return handle_generate(st, conn, false);
    if (!strcmp(url, "/v1/completions")) return handle_generate(st, conn, true);
    if (!strcmp(url, "/abort_request")) return handle_abort(st, conn);
    if (!strcmp(url, "/health"))
        return pd_http_queue_json_value(conn, 200,
                                        json_pack("{s:s,s:s}", "status", "ok", "role",
                                                  pd_node_role_name(node_config(n)->role)));
    if (!strcmp(url, "/metrics")) {
        if (!node_config(n)->enable_metrics)
            return send_error(conn, 404, "metrics are off (start with --enable-metrics)");
        return handle_text_command(st, conn, CMD_METRICS);
    }
    return handle_text_command(st, conn, CMD_INFO);
}

static void completed(void *cls, struct MHD_Connection *conn, void **con_cls,
                      enum MHD_RequestTerminationCode toe) {
    (void)conn;
    pd_node *n = cls;
    conn_state *st = *con_cls;
    if (!st) return;
    if (st->c) {
        /* A request whose client went away before its end is aborted. */
        if (toe != MHD_REQUEST_TERMINATED_COMPLETED_OK) abort_call(n, st->c);
        call_unref(st->c);
    }
    free(st->body);
    free(st->ev);
    free(st);
    *con_cls = NULL;
}

pd_err http_start(pd_node *n, http_server **out, uint16_t *bound_port, char *msg, size_t cap) {
    const pd_node_config *cfg = node_config(n);
    struct sockaddr_in addr;
    memset(&addr, 0, sizeof(addr));
    addr.sin_family = AF_INET;
    addr.sin_port = htons(cfg->port);
    const char *host = cfg->host && strcmp(cfg->host, "localhost") ? cfg->host : "127.0.0.1";
    if (inet_pton(AF_INET, host, &addr.sin_addr) != 1)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "--host '%s' is not an IPv4 address", host);
    http_server *h = calloc(1, sizeof(*h));
    if (!h) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    h->n = n;
    /* poll(), not select(): one process (pdserve run) holds more than
     * FD_SETSIZE sockets under load, and select() refuses those. */
    h->d = MHD_start_daemon(
        MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_POLL |
            MHD_USE_ERROR_LOG,
        cfg->port, NULL, NULL, handler, n, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&addr,
        MHD_OPTION_NOTIFY_COMPLETED, completed, n, MHD_OPTION_CONNECTION_LIMIT, (unsigned)4096,
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)60, MHD_OPTION_UNESCAPE_CALLBACK, pd_http_unescape,
        NULL, MHD_OPTION_THREAD_STACK_SIZE, (size_t)(512 * 1024), MHD_OPTION_END);
    if (!h->d) {
        free(h);
        return pd_errorf(msg, cap, PD_ERR_IO, "could not listen on %s:%u (in use?)", host,
                         cfg->port);
    }
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
    *bound_port = di ? di->port : cfg->port;
    *out = h;
    return PD_OK;
}

void http_stop(http_server *h) {
    if (!h) return;
    MHD_stop_daemon(h->d);
    free(h);
}
