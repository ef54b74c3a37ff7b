/*
 * sglang_api.c — SGLang's native utility endpoints on a node
 * (docs/http-api.md): /get_model_info, /tokenize, /detokenize, the answer
 * to /flush_cache, and /health_generate. http.c routes them here.
 *
 * None of them owns engine state. /get_model_info reads the configuration
 * on the loop thread; /tokenize and /detokenize need only the tokenizer and
 * run on the responder; /flush_cache is a scheduler command (CMD_FLUSH,
 * node.c, pd_engine_flush_cache) whose reply http.c hands to
 * sgl_flush_answer.
 *
 * /health_generate is the one that waits, with a deadline: a real one-token
 * generation on a serve node, a scheduler round trip (CMD_INFO) on prefill
 * and decode nodes, which cannot generate alone. The loop and the responder
 * must not block and have no timers, so each probe runs on a thread of its
 * own that waits on the call's (or the reply's) condition variable with a
 * timeout. Invariants:
 *   H1  At most HEALTH_PROBES_MAX probes run at once; one more is a 503.
 *   H2  A probe slot is `used` from its thread's start until that thread is
 *       joined: when the slot is reused (the thread is `done`, so the join
 *       is immediate) or by sgl_health_destroy.
 *   H3  A probe answers its request exactly once, and touches neither the
 *       request nor the slot after setting `done`.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "node_internal.h"
#include "pdserve/tokenizer.h"

#define HEALTH_PROBES_MAX 4u
/* How long a probe waits for its token (or the scheduler's reply). */
#define HEALTH_TIMEOUT_MS 5000u
static const char health_prompt[] = "health";

/* ---- /get_model_info ------------------------------------------------------------------ */

void sgl_model_info(pd_node *n, pd_http_req *r) {
    const pd_node_config *cfg = node_config(n);
    PD_ASSERT(cfg->served_model_name != NULL);
    const char *path = cfg->model_dir ? cfg->model_dir : cfg->served_model_name;
    json_t *o = json_pack(
        "{s:s, s:s, s:s, s:b, s:n, s:s, s:I, s:I, s:I, s:s}", "model_path", path, "tokenizer_path",
        path, "served_model_name", cfg->served_model_name, "is_generation", 1,
        "preferred_sampling_params", "weight_version", "default", "max_context_length",
        cfg->context_length ? (json_int_t)cfg->context_length
                            : (json_int_t)cfg->max_prompt_tokens + cfg->max_new_tokens_limit,
        "max_prompt_tokens", (json_int_t)cfg->max_prompt_tokens, "vocab_size",
        (json_int_t)node_vocab(n), "role", pd_node_role_name(cfg->role));
    node_respond_json(r, 200, o);
}

/* ---- /tokenize and /detokenize ---------------------------------------------------------- */

/* One text's token ids, a JSON array, in *ids; where names it for the
 * messages ("'text'", "'text'[2]"). 0, or the status with err. */
static int tokenize_one(pd_node *n, json_t *text, const char *where, bool add_special, json_t **ids,
                        char *err, size_t cap) {
    if (!json_is_string(text)) return node_refuse(err, cap, 400, "%s must be a string", where);
    int32_t *buf = NULL;
    size_t need = 0;
    char why[160];
    if (node_encode(n, json_string_value(text), json_string_length(text), add_special, &buf, &need,
                    why, sizeof why) != PD_OK)
        return node_refuse(err, cap, 503, "%s could not be tokenized: %s", where, why);
    *ids = json_array();
    for (size_t i = 0; *ids && i < need; i++) json_array_append_new(*ids, json_integer(buf[i]));
    free(buf);
    return *ids ? 0 : node_refuse(err, cap, 503, "out of memory for %zu tokens", need);
}

/* {"text" (or SGLang's "prompt"): a string or an array of strings,
 * "add_special_tokens": bool} -> {"tokens", "count", "max_model_len"}, with
 * an array of each for an array of texts. 0, or the status with err. */
static int tokenize(pd_node *n, json_t *root, json_t **out, char *err, size_t cap) {
    json_t *text = json_object_get(root, "text"), *prompt = json_object_get(root, "prompt");
    const char *name = text ? "text" : "prompt";
    if (text && prompt)
        return node_refuse(err, cap, 400, "give either 'text' or 'prompt', not both");
    if (!text && !(text = prompt)) return node_refuse(err, cap, 400, "'text' is required");
    json_t *special = json_object_get(root, "add_special_tokens");
    if (special && !json_is_boolean(special))
        return node_refuse(err, cap, 400, "'add_special_tokens' must be a boolean");
    if (!json_is_string(text) && !json_is_array(text))
        return node_refuse(err, cap, 400, "'%s' must be a string or an array of strings", name);
    bool add_special = !special || json_is_true(special);
    json_int_t max_len = node_config(n)->max_prompt_tokens;
    char where[48];
    json_t *ids;
    int st;
    if (!json_is_array(text)) {
        snprintf(where, sizeof(where), "'%s'", name);
        if ((st = tokenize_one(n, text, where, add_special, &ids, err, cap))) return st;
        *out = json_pack("{s:o, s:I, s:I}", "tokens", ids, "count",
                         (json_int_t)json_array_size(ids), "max_model_len", max_len);
        return *out ? 0 : node_refuse(err, cap, 503, "out of memory");
    }
    json_t *tokens = json_array(), *count = json_array();
    for (size_t i = 0; i < json_array_size(text); i++) {
        snprintf(where, sizeof(where), "'%s'[%zu]", name, i);
        if ((st = tokenize_one(n, json_array_get(text, i), where, add_special, &ids, err, cap))) {
            json_decref(tokens);
            json_decref(count);
            return st;
        }
        json_array_append_new(count, json_integer((json_int_t)json_array_size(ids)));
        json_array_append_new(tokens, ids);
    }
    *out = json_pack("{s:o, s:o, s:I}", "tokens", tokens, "count", count, "max_model_len", max_len);
    return *out ? 0 : node_refuse(err, cap, 503, "out of memory");
}

/* The text of one array of token ids (sanitised UTF-8) in *text. 0, or the
 * status with err. */
static int detokenize_one(pd_node *n, json_t *ids, const char *where, json_t **text, char *err,
                          size_t cap) {
    if (!json_is_array(ids))
        return node_refuse(err, cap, 400, "%s must be an array of token ids", where);
    size_t k = json_array_size(ids);
    int32_t *t = malloc((k ? k : 1) * sizeof(int32_t));
    if (!t) return node_refuse(err, cap, 503, "out of memory for %zu tokens", k);
    for (size_t i = 0; i < k; i++) {
        json_t *v = json_array_get(ids, i);
        json_int_t x = json_is_integer(v) ? json_integer_value(v) : -1;
        if (!json_is_integer(v) || x < 0 || x >= (json_int_t)node_vocab(n)) {
            free(t);
            if (!json_is_integer(v))
                return node_refuse(err, cap, 400, "%s[%zu] is not an integer", where, i);
            return node_refuse(err, cap, 400, "%s[%zu] = %lld is outside the vocabulary (size %u)",
                               where, i, (long long)x, node_vocab(n));
        }
        t[i] = (int32_t)x;
    }
    char *raw = malloc(k * NODE_TOKEN_BYTES_MAX + 1), *clean = NULL;
    size_t need = 0, raw_len = 0;
    if (raw) {
        for (size_t i = 0; i < k; i++)
            raw_len += node_token_bytes(n, t[i], true, raw + raw_len, NODE_TOKEN_BYTES_MAX + 1);
        need = pd_utf8_sanitize(raw, raw_len, NULL, 0);
        clean = malloc(need + 1);
    }
    if (clean) pd_utf8_sanitize(raw, raw_len, clean, need + 1);
    *text = clean ? json_stringn(clean, need) : NULL;
    free(t);
    free(raw);
    free(clean);
    return *text ? 0 : node_refuse(err, cap, 503, "out of memory for the text");
}

/* {"tokens": [ids] or [[ids], ...], "skip_special_tokens": true} ->
 * {"text": str} or {"text": [str, ...]}. 0, or the status with err. */
static int detokenize(pd_node *n, json_t *root, json_t **out, char *err, size_t cap) {
    json_t *tokens = json_object_get(root, "tokens");
    json_t *skip = json_object_get(root, "skip_special_tokens");
    if (!tokens) return node_refuse(err, cap, 400, "'tokens' is required");
    if (skip && !json_is_boolean(skip))
        return node_refuse(err, cap, 400, "'skip_special_tokens' must be a boolean");
    if (skip && json_is_false(skip))
        return node_refuse(
            err, cap, 400,
            "'skip_special_tokens': false is not supported (the byte-level tokenizer "
            "has no text for its special tokens)");
    json_t *text;
    int st;
    if (!json_is_array(json_array_get(tokens, 0))) {
        if ((st = detokenize_one(n, tokens, "'tokens'", &text, err, cap))) return st;
        *out = json_pack("{s:o}", "text", text);
        return *out ? 0 : node_refuse(err, cap, 503, "out of memory");
    }
    json_t *texts = json_array();
    char where[48];
    for (size_t i = 0; i < json_array_size(tokens); i++) {
        snprintf(where, sizeof(where), "'tokens'[%zu]", i);
        if ((st = detokenize_one(n, json_array_get(tokens, i), where, &text, err, cap))) {
            json_decref(texts);
            return st;
        }
        json_array_append_new(texts, text);
    }
    *out = json_pack("{s:o}", "text", texts);
    return *out ? 0 : node_refuse(err, cap, 503, "out of memory");
}

void sgl_tokenize_answer(pd_node *n, pd_http_req *r) {
    bool detok = !strcmp(pd_http_req_path(r), "/detokenize");
    PD_ASSERT(detok || !strcmp(pd_http_req_path(r), "/tokenize"));
    size_t len;
    const char *body = pd_http_req_body(r, &len);
    json_error_t jerr;
    json_t *root = json_loadb(body, len, 0, &jerr), *out = NULL;
    char err[256];
    int st;
    if (!root)
        st = node_refuse(err, sizeof(err), 400, "malformed JSON: %s (line %d, column %d)",
                         jerr.text, jerr.line, jerr.column);
    else if (!json_is_object(root))
        st = node_refuse(err, sizeof(err), 400, "the request body must be a JSON object");
    else
        st = detok ? detokenize(n, root, &out, err, sizeof(err))
                   : tokenize(n, root, &out, err, sizeof(err));
    json_decref(root);
    if (st) pd_http_req_respond_error(r, (unsigned)st, "%s", err);
    else node_respond_json(r, 200, out);
}

/* ---- /flush_cache ----------------------------------------------------------------------- */

void sgl_flush_answer(pd_http_req *r, const cmd_reply *q) {
    PD_ASSERT(q->ready);
    if (!q->text)
        pd_http_req_respond_error(r, 503, "the cache was not flushed: %s",
                                  q->value ? "out of memory for the answer"
                                           : "the server is shutting down");
    else if (q->value != PD_OK) pd_http_req_respond_error(r, 400, "%s", q->text);
    else node_respond_json(r, 200, json_pack("{s:s, s:s}", "status", "ok", "message", q->text));
}

/* ---- /health_generate --------------------------------------------------------------------- */

typedef struct probe {
    struct sgl_health *s;
    pthread_t thread;
    bool used, done; /* s->mu (H2, H3) */
    pd_http_req *r;  /* retained while the probe runs */
} probe;

struct sgl_health {
    pd_node *n;
    pthread_mutex_t mu;
    probe probes[HEALTH_PROBES_MAX];
};

/* CLOCK_REALTIME (the condition variables' clock), ms from now. */
static struct timespec deadline_after(uint32_t ms) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += ms / 1000u;
    ts.tv_nsec += (long)(ms % 1000u) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    return ts;
}

/* A call for one greedy token of health_prompt; NULL when out of memory. */
static call *probe_call(pd_node *n) {
    call *c = call_new();
    if (!c) return NULL;
    size_t need = 0;
    char why[160];
    if (node_encode(n, health_prompt, sizeof(health_prompt) - 1, true, &c->prompt, &need, why,
                    sizeof why) != PD_OK)
        c->prompt = NULL;
    c->tokens = calloc(1, sizeof(int32_t));
    c->logprobs = calloc(1, sizeof(float));
    if (!c->prompt || !c->tokens || !c->logprobs) {
        call_unref(c);
        return NULL;
    }
    c->prompt_len = (uint32_t)need;
    snprintf(c->rid, sizeof(c->rid), "health_generate-%llu", (unsigned long long)node_next_rid(n));
    c->spec = (pd_request_spec){.rid = c->rid,
                                .prompt = c->prompt,
                                .prompt_len = c->prompt_len,
                                .max_new_tokens = 1,
                                .sampling = {.temperature = 0.0f, .top_p = 1.0f},
                                .peer = c->peer};
    return c;
}

/* Serve nodes: one token through the engine within HEALTH_TIMEOUT_MS. True
 * when it finished; otherwise why in msg. */
static bool probe_generate(pd_node *n, char *msg, size_t cap) {
    call *c = probe_call(n);
    if (!c) return snprintf(msg, cap, "out of memory for the health request"), false;
    if (node_command(n, CMD_SUBMIT, c, NULL, NULL) != PD_OK) {
        call_unref(c);
        return snprintf(msg, cap, "the scheduler takes no requests (shutting down or full)"), false;
    }
    struct timespec until = deadline_after(HEALTH_TIMEOUT_MS);
    pthread_mutex_lock(&c->mu);
    int rc = 0;
    while (!(c->submitted && (c->submit_err != PD_OK || c->done)) && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&c->cv, &c->mu, &until);
    bool accepted = c->submitted && c->submit_err == PD_OK;
    bool ok = accepted && c->done && c->kind == PD_TERM_FINISHED;
    if (c->submitted && c->submit_err != PD_OK)
        snprintf(msg, cap, "the health request was refused: %s", c->reject.message);
    else if (!c->done) snprintf(msg, cap, "no token within %u ms", HEALTH_TIMEOUT_MS);
    else if (!ok)
        snprintf(msg, cap, "the health request ended %s: %s", pd_terminal_kind_name(c->kind),
                 c->message);
    bool abort = accepted && !c->done;
    pthread_mutex_unlock(&c->mu);
    if (abort) node_command(n, CMD_ABORT, NULL, c->rid, NULL); /* best effort */
    call_unref(c);
    return ok;
}

/* Prefill and decode nodes: a scheduler round trip (CMD_INFO) within
 * HEALTH_TIMEOUT_MS. The reply is written into q whenever it comes, so q is
 * waited out (the scheduler, or node shutdown, always replies) — but only
 * after the answer went out. */
static void probe_round_trip(pd_node *n, pd_http_req *r) {
    cmd_reply q;
    memset(&q, 0, sizeof(q));
    pthread_mutex_init(&q.mu, NULL);
    pthread_cond_init(&q.cv, NULL);
    if (node_command(n, CMD_INFO, NULL, NULL, &q) != PD_OK) {
        pd_http_req_respond_error(r, 503, "the scheduler takes no commands (shutting down)");
    } else {
        struct timespec until = deadline_after(HEALTH_TIMEOUT_MS);
        pthread_mutex_lock(&q.mu);
        int rc = 0;
        while (!q.ready && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&q.cv, &q.mu, &until);
        bool in_time = q.ready && q.text;
        pthread_mutex_unlock(&q.mu);
        if (in_time)
            node_respond_json(r, 200,
                              json_pack("{s:s, s:s}", "status", "ok", "role",
                                        pd_node_role_name(node_config(n)->role)));
        else
            pd_http_req_respond_error(r, 503, "the scheduler did not answer within %u ms",
                                      HEALTH_TIMEOUT_MS);
        pthread_mutex_lock(&q.mu);
        while (!q.ready) pthread_cond_wait(&q.cv, &q.mu);
        pthread_mutex_unlock(&q.mu);
        free(q.text);
    }
    pthread_mutex_destroy(&q.mu);
    pthread_cond_destroy(&q.cv);
}

static void *probe_main(void *arg) {
    probe *p = arg;
    pd_node *n = p->s->n;
    char msg[256];
    if (node_config(n)->role != PD_NODE_SERVE) probe_round_trip(n, p->r);
    else if (probe_generate(n, msg, sizeof(msg)))
        node_respond_json(p->r, 200, json_pack("{s:s, s:s}", "status", "ok", "role", "serve"));
    else pd_http_req_respond_error(p->r, 503, "%s", msg);
    pd_http_req_release(p->r);
    pthread_mutex_lock(&p->s->mu);
    p->r = NULL;
    p->done = true; /* H3: nothing of p is touched after this */
    pthread_mutex_unlock(&p->s->mu);
    return NULL;
}

pd_err sgl_health_create(pd_node *n, sgl_health **out) {
    sgl_health *s = calloc(1, sizeof(*s));
    if (!s) return PD_ERR_NOMEM;
    s->n = n;
    pthread_mutex_init(&s->mu, NULL);
    for (uint32_t i = 0; i < HEALTH_PROBES_MAX; i++) s->probes[i].s = s;
    *out = s;
    return PD_OK;
}

void sgl_health_generate(sgl_health *s, pd_http_req *r) {
    pthread_mutex_lock(&s->mu);
    probe *p = NULL;
    for (uint32_t i = 0; i < HEALTH_PROBES_MAX && !p; i++)
        if (!s->probes[i].used || s->probes[i].done) p = &s->probes[i];
    if (p && p->used) {
        pthread_join(p->thread, NULL); /* H2: done, so it has ended or is ending */
        p->used = false;
    }
    if (p) {
        PD_ASSERT(!p->used && p->r == NULL);
        p->r = r;
        p->done = false;
        pd_http_req_retain(r);
        p->used = pthread_create(&p->thread, NULL, probe_main, p) == 0;
        if (!p->used) {
            pd_http_req_release(r);
            p->r = NULL;
        }
    }
    bool started = p && p->used;
    pthread_mutex_unlock(&s->mu);
    if (!started)
        pd_http_req_respond_error(r, 503, "%u health probes are running; try again later",
                                  HEALTH_PROBES_MAX);
}

void sgl_health_destroy(sgl_health *s) {
    if (!s) return;
    for (uint32_t i = 0; i < HEALTH_PROBES_MAX; i++)
        if (s->probes[i].used) pthread_join(s->probes[i].thread, NULL);
    pthread_mutex_destroy(&s->mu);
    free(s);
}
