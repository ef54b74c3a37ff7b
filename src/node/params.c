/*
 * params.c — the body of a generation request into gen_params (gen.h).
 *
 * Fields are checked in the order the API lists them, so a body with several
 * faults always gets the same answer; each refusal names the field. Where
 * the fields live: /v1/completions and /v1/chat/completions have them at the
 * top level; /generate has "text" or "input_ids" at the top and the sampling
 * in "sampling_params". A chat body is first rendered into the completions
 * body it means (its messages through the model's chat template).
 *
 * Known parameters pdserve does not implement are refused with a 400 that
 * names them, unless given their neutral value: a request must never get a
 * 200 that silently ignored what it asked for. Unknown fields are ignored,
 * as OpenAI does.
 */
#define _GNU_SOURCE
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gen.h"
#include "pdserve/tokenizer.h"

bool gen_rid_acceptable(json_t *v) {
    size_t n = json_string_length(v);
    return json_is_string(v) && n > 0 && n < PD_RID_MAX && strlen(json_string_value(v)) == n;
}

int node_refuse(char *err, size_t cap, int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, cap, fmt, ap);
    va_end(ap);
    return status;
}

/* The field `name` of src, or NULL when src, the field or its value is absent
 * (a JSON null means "the default"). */
static json_t *given(json_t *src, const char *name) {
    json_t *v = src ? json_object_get(src, name) : NULL;
    return v && !json_is_null(v) ? v : NULL;
}

/* ---- prompts ------------------------------------------------------------------------- */

/* The prompt field as the client wrote it: its value and its name. */
typedef struct prompt_field {
    json_t *v;
    const char *name;
} prompt_field;

/* Finds the prompt and where the sampling fields live. */
static int parse_shape(json_t *root, gen_api api, prompt_field *f, json_t **src, char *err,
                       size_t cap) {
    *src = root;
    if (api != GEN_API_GENERATE) {
        *f = (prompt_field){json_object_get(root, "prompt"), "prompt"};
        if (!f->v) return node_refuse(err, cap, 400, "'prompt' is required");
        return 0;
    }
    json_t *text = json_object_get(root, "text"), *ids = json_object_get(root, "input_ids");
    if (text && ids)
        return node_refuse(err, cap, 400, "give either 'text' or 'input_ids', not both");
    *f = text ? (prompt_field){text, "text"} : (prompt_field){ids, "input_ids"};
    if (!f->v) return node_refuse(err, cap, 400, "'text' or 'input_ids' is required");
    *src = json_object_get(root, "sampling_params");
    if (*src && !json_is_object(*src))
        return node_refuse(err, cap, 400, "'sampling_params' must be an object");
    return 0;
}

/* A text prompt's ids. A prompt a model's chat template rendered has its
 * special tokens written out already: nothing is added (as transformers'
 * apply_chat_template tokenizes). */
static int prompt_text(pd_node *n, json_t *v, const char *name, bool add_special, gen_prompt *out,
                       char *err, size_t cap) {
    const pd_node_config *cfg = node_config(n);
    const char *t = json_string_value(v);
    size_t len = json_string_length(v), k = 0;
    if (len == 0) return node_refuse(err, cap, 400, "'%s' is empty", name);
    char why[160];
    if (node_encode(n, t, len, add_special, &out->ids, &k, why, sizeof why) != PD_OK)
        return node_refuse(err, cap, 503, "the prompt %s could not be tokenized: %s", name, why);
    if (k > cfg->max_prompt_tokens)
        return node_refuse(err, cap, 413, "the prompt %s is %zu tokens, the limit is %u", name, k,
                           cfg->max_prompt_tokens);
    if (k == 0) return node_refuse(err, cap, 400, "'%s' has no tokens", name);
    out->len = (uint32_t)k;
    return 0;
}

static int prompt_ids(pd_node *n, json_t *v, const char *name, gen_prompt *out, char *err,
                      size_t cap) {
    const pd_node_config *cfg = node_config(n);
    size_t k = json_array_size(v);
    if (k == 0) return node_refuse(err, cap, 400, "'%s' is empty", name);
    if (k > cfg->max_prompt_tokens)
        return node_refuse(err, cap, 413, "the prompt %s is %zu tokens, the limit is %u", name, k,
                           cfg->max_prompt_tokens);
    out->ids = malloc(k * sizeof(int32_t));
    if (!out->ids) return node_refuse(err, cap, 503, "out of memory for a %zu-token prompt", k);
    for (size_t i = 0; i < k; i++) {
        json_t *e = json_array_get(v, i);
        if (!json_is_integer(e))
            return node_refuse(err, cap, 400, "'%s'[%zu] is not an integer", name, i);
        json_int_t x = json_integer_value(e);
        if (x < 0 || x >= (json_int_t)node_vocab(n))
            return node_refuse(err, cap, 400,
                               "'%s'[%zu] = %lld is outside the vocabulary (size %u)", name, i,
                               (long long)x, node_vocab(n));
        out->ids[i] = (int32_t)x;
    }
    out->len = (uint32_t)k;
    return 0;
}

/* One prompt: a string, or (ids_ok) an array of token ids. */
static int prompt_one(pd_node *n, json_t *v, const char *name, bool text_ok, bool ids_ok,
                      bool add_special, gen_prompt *out, char *err, size_t cap) {
    if (text_ok && json_is_string(v)) return prompt_text(n, v, name, add_special, out, err, cap);
    if (ids_ok && json_is_array(v)) return prompt_ids(n, v, name, out, err, cap);
    return node_refuse(err, cap, 400, "'%s' must be %s", name,
                       text_ok && ids_ok ? "a string or an array of token ids"
                           : text_ok     ? "a string"
                                         : "an array of token ids");
}

/* The prompt, or the batch of them: a string, an array of token ids, or an
 * array of either (the OpenAI prompt; /generate's text is a string or
 * strings, its input_ids ids or arrays of ids). */
static int parse_prompts(pd_node *n, gen_api api, const prompt_field *f, gen_params *p, char *err,
                         size_t cap) {
    bool is_text = api == GEN_API_GENERATE && !strcmp(f->name, "text");
    bool is_ids = api == GEN_API_GENERATE && !is_text;
    json_t *v = f->v;
    json_t *first = json_is_array(v) ? json_array_get(v, 0) : NULL;
    bool batch = json_is_array(v) && json_array_size(v) > 0 && !json_is_integer(first);
    if (!batch && json_is_array(v) && is_text)
        return node_refuse(err, cap, 400, "'text' must be a string or an array of strings");
    size_t k = batch ? json_array_size(v) : 1;
    if (k > GEN_CHOICES_MAX)
        return node_refuse(err, cap, 400, "'%s' has %zu prompts; at most %u", f->name, k,
                           GEN_CHOICES_MAX);
    p->prompts = calloc(k, sizeof(gen_prompt));
    if (!p->prompts) return node_refuse(err, cap, 503, "out of memory");
    p->batch = batch;
    for (size_t i = 0; i < k; i++) {
        char name[48];
        if (batch) snprintf(name, sizeof name, "%s[%zu]", f->name, i);
        else snprintf(name, sizeof name, "%s", f->name);
        json_t *one = batch ? json_array_get(v, i) : v;
        int status =
            prompt_one(n, one, name, !is_ids, !is_text, !p->templated, &p->prompts[i], err, cap);
        p->n_prompts = (uint32_t)i + 1;
        if (status) return status;
    }
    return 0;
}

/* ---- sampling ------------------------------------------------------------------------ */

static int parse_stop_tokens(json_t *v, uint32_t vocab, gen_params *p, char *err, size_t cap) {
    if (!json_is_array(v))
        return node_refuse(err, cap, 400, "'stop_token_ids' must be an array of integers");
    if (json_array_size(v) > PD_STOP_TOKENS_MAX)
        return node_refuse(err, cap, 400, "'stop_token_ids': at most %d", PD_STOP_TOKENS_MAX);
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *e = json_array_get(v, i);
        if (!json_is_integer(e))
            return node_refuse(err, cap, 400, "'stop_token_ids'[%zu] is not an integer", i);
        json_int_t x = json_integer_value(e);
        if (x < 0 || x >= (json_int_t)vocab) /* checked before the cast: never wraps */
            return node_refuse(err, cap, 400,
                               "'stop_token_ids'[%zu] = %lld is outside the vocabulary (size %u)",
                               i, (long long)x, vocab);
        p->stop[p->n_stop++] = (int32_t)x;
    }
    return 0;
}

static int add_stop(json_t *s, const char *name, gen_params *p, char *err, size_t cap) {
    size_t len = json_string_length(s);
    if (len > GEN_STOP_BYTES_MAX)
        return node_refuse(err, cap, 400, "'%s' is %zu bytes; at most %d", name, len,
                           GEN_STOP_BYTES_MAX);
    if (len == 0 || strlen(json_string_value(s)) != len) return 0; /* "" stops nothing */
    if (p->n_stops == GEN_STOPS_MAX)
        return node_refuse(err, cap, 400, "'stop': at most %u strings", GEN_STOPS_MAX);
    p->stops[p->n_stops] = strdup(json_string_value(s));
    if (!p->stops[p->n_stops]) return node_refuse(err, cap, 503, "out of memory");
    p->n_stops++;
    if (len > p->stop_longest) p->stop_longest = len;
    return 0;
}

/* stop: a string or an array of strings. */
static int parse_stop_strings(json_t *v, gen_params *p, char *err, size_t cap) {
    if (json_is_string(v)) return add_stop(v, "stop", p, err, cap);
    if (!json_is_array(v)) return node_refuse(err, cap, 400, "'stop' must be a string or strings");
    for (size_t i = 0; i < json_array_size(v); i++) {
        json_t *s = json_array_get(v, i);
        char name[32];
        snprintf(name, sizeof name, "stop[%zu]", i);
        if (!json_is_string(s)) return node_refuse(err, cap, 400, "'%s' is not a string", name);
        int status = add_stop(s, name, p, err, cap);
        if (status) return status;
    }
    return 0;
}

/* A number field in [lo, hi] into *out (unchanged when absent). */
static int number_in(json_t *src, const char *name, double lo, double hi, double *out, char *err,
                     size_t cap) {
    json_t *v = given(src, name);
    if (!v) return 0;
    if (!json_is_number(v)) return node_refuse(err, cap, 400, "'%s' must be a number", name);
    double x = json_number_value(v);
    if (!(x >= lo && x <= hi))
        return node_refuse(err, cap, 400, "'%s' must be in [%g, %g], not %g", name, lo, hi, x);
    *out = x;
    return 0;
}

/* An integer field in [lo, hi] into *out (unchanged when absent). */
static int integer_in(json_t *src, const char *name, json_int_t lo, json_int_t hi, json_int_t *out,
                      char *err, size_t cap) {
    json_t *v = given(src, name);
    if (!v) return 0;
    if (!json_is_integer(v)) return node_refuse(err, cap, 400, "'%s' must be an integer", name);
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi)
        return node_refuse(err, cap, 400, "'%s' must be in [%lld, %lld], not %lld", name,
                           (long long)lo, (long long)hi, (long long)x);
    *out = x;
    return 0;
}

/* The seed: OpenAI's "seed", SGLang's "sampling_seed" (either name in
 * either place); any integer. */
static int parse_seed(json_t *src, gen_params *p, char *err, size_t cap) {
    static const char *const names[] = {"seed", "sampling_seed"};
    for (size_t i = 0; i < PD_ARRAY_LEN(names); i++) {
        json_t *v = given(src, names[i]);
        if (!v) continue;
        if (!json_is_integer(v))
            return node_refuse(err, cap, 400, "'%s' must be an integer", names[i]);
        p->seeded = true;
        p->seed = (uint64_t)json_integer_value(v);
    }
    return 0;
}

/* max_new_tokens (max_tokens), n, temperature, top_p, top_k, min_p, the
 * penalties, the seed, stop, stop_token_ids, ignore_eos. */
static int parse_sampling(const pd_node_config *cfg, uint32_t vocab, json_t *src, gen_api api,
                          gen_params *p, char *err, size_t cap) {
    const char *mname = api != GEN_API_GENERATE ? "max_tokens" : "max_new_tokens";
    json_int_t x = p->max_new, n = 1, top_k = 0;
    double t = 0.0, top_p = 1.0, min_p = 0.0, rep = 1.0, freq = 0.0, pres = 0.0;
    int s;
    json_t *v;
    if ((v = given(src, mname)) && json_is_integer(v) && json_integer_value(v) < 1)
        return node_refuse(err, cap, 400, "'%s' must be at least 1", mname);
    if ((s = integer_in(src, mname, 1, INT32_MAX, &x, err, cap))) return s;
    if (x > (json_int_t)cfg->max_new_tokens_limit)
        return node_refuse(err, cap, 400, "'%s' = %lld is above the limit %u", mname, (long long)x,
                           cfg->max_new_tokens_limit);
    if ((s = integer_in(src, "n", 1, GEN_CHOICES_MAX, &n, err, cap))) return s;
    if ((s = number_in(src, "temperature", 0.0, 1e6, &t, err, cap))) return s;
    if ((v = given(src, "top_p")) && json_is_number(v) && !(json_number_value(v) > 0.0))
        return node_refuse(err, cap, 400, "'top_p' must be in (0, 1]");
    if ((s = number_in(src, "top_p", 0.0, 1.0, &top_p, err, cap))) return s;
    if ((v = given(src, "top_k")) && json_is_integer(v) && json_integer_value(v) == -1)
        top_k = 0; /* SGLang's "off" */
    else if ((s = integer_in(src, "top_k", 0, INT32_MAX, &top_k, err, cap))) return s;
    if ((s = number_in(src, "min_p", 0.0, 1.0, &min_p, err, cap))) return s;
    if ((s = number_in(src, "repetition_penalty", 0.0, 1e6, &rep, err, cap))) return s;
    if ((s = number_in(src, "frequency_penalty", -2.0, 2.0, &freq, err, cap))) return s;
    if ((s = number_in(src, "presence_penalty", -2.0, 2.0, &pres, err, cap))) return s;
    if ((s = parse_seed(src, p, err, cap))) return s;
    p->max_new = (uint32_t)x;
    p->n = (uint32_t)n;
    p->sampling = (pd_sampling){.temperature = (float)t,
                                .top_p = (float)top_p,
                                .top_k = (uint32_t)top_k,
                                .min_p = (float)min_p,
                                .repetition_penalty = (float)rep,
                                .frequency_penalty = (float)freq,
                                .presence_penalty = (float)pres};
    if ((v = given(src, "stop")) && (s = parse_stop_strings(v, p, err, cap))) return s;
    if ((v = given(src, "stop_token_ids")) && (s = parse_stop_tokens(v, vocab, p, err, cap)))
        return s;
    if ((v = given(src, "ignore_eos"))) {
        if (!json_is_boolean(v))
            return node_refuse(err, cap, 400, "'ignore_eos' must be a boolean");
        p->ignore_eos = json_is_true(v);
    }
    return 0;
}

/* logprobs: completions' "logprobs": N (0..5 alternatives), chat's
 * "logprobs": true with "top_logprobs": N (0..20), /generate's
 * "return_logprob" with "top_logprobs_num" and "return_text_in_logprobs". */
static int parse_logprobs(json_t *root, gen_api api, gen_params *p, char *err, size_t cap) {
    json_int_t k = 0;
    json_t *v;
    int s;
    if (api == GEN_API_COMPLETIONS) {
        if ((s = integer_in(root, "logprobs", 0, 5, &k, err, cap))) return s;
        p->logprobs = given(root, "logprobs") != NULL;
    } else if (api == GEN_API_CHAT) {
        if ((v = given(root, "logprobs")) && !json_is_boolean(v))
            return node_refuse(err, cap, 400, "'logprobs' must be a boolean");
        p->logprobs = v && json_is_true(v);
        if ((s = integer_in(root, "top_logprobs", 0, PD_TOP_LOGPROBS_MAX, &k, err, cap))) return s;
        if (given(root, "top_logprobs") && !p->logprobs)
            return node_refuse(err, cap, 400, "'top_logprobs' needs 'logprobs': true");
    } else {
        if ((v = given(root, "return_logprob")) && !json_is_boolean(v))
            return node_refuse(err, cap, 400, "'return_logprob' must be a boolean");
        p->logprobs = v && json_is_true(v);
        if ((s = integer_in(root, "top_logprobs_num", 0, PD_TOP_LOGPROBS_MAX, &k, err, cap)))
            return s;
        if ((v = given(root, "return_text_in_logprobs")) && !json_is_boolean(v))
            return node_refuse(err, cap, 400, "'return_text_in_logprobs' must be a boolean");
        p->text_in_logprobs = v && json_is_true(v);
        json_int_t start = -1;
        if ((s = integer_in(root, "logprob_start_len", -1, INT32_MAX, &start, err, cap))) return s;
        if (start != -1)
            return node_refuse(
                err, cap, 400,
                "'logprob_start_len' other than -1 (prompt logprobs) is not supported "
                "by pdserve yet; leave it out");
    }
    p->sampling.top_logprobs = p->logprobs ? (uint32_t)k : 0;
    return 0;
}

/* echo (completions): the prompt before the answer. Prompt logprobs are not
 * computed, so echo with logprobs is refused. */
static int parse_echo(json_t *root, gen_api api, gen_params *p, char *err, size_t cap) {
    json_t *v = api == GEN_API_COMPLETIONS ? given(root, "echo") : NULL;
    if (!v) return 0;
    if (!json_is_boolean(v)) return node_refuse(err, cap, 400, "'echo' must be a boolean");
    p->echo = json_is_true(v);
    if (p->echo && p->logprobs)
        return node_refuse(err, cap, 400,
                           "'echo' with 'logprobs' needs the prompt's logprobs, which pdserve does "
                           "not compute yet; leave one out");
    return 0;
}

/* ---- refused parameters -------------------------------------------------------------- */

typedef enum neutral { N_NULL, N_ONE, N_EMPTY } neutral;
typedef struct unsupported {
    const char *name;
    neutral off;
} unsupported;

static const unsupported openai_unsupported[] = {
    {"best_of", N_ONE},
    {"logit_bias", N_EMPTY},
    {"suffix", N_EMPTY},
};
static const unsupported chat_unsupported[] = {
    {"tools", N_EMPTY},          {"functions", N_EMPTY},
    {"response_format", N_NULL}, {"parallel_tool_calls", N_NULL},
    {"logit_bias", N_EMPTY},     {"audio", N_NULL},
    {"modalities", N_NULL},      {"prediction", N_NULL},
};
static const unsupported sampling_unsupported[] = {
    {"regex", N_NULL},          {"json_schema", N_NULL}, {"ebnf", N_NULL},
    {"structural_tag", N_NULL}, {"logit_bias", N_EMPTY},
};
static const unsupported generate_unsupported[] = {
    {"lora_path", N_NULL},
    {"return_hidden_states", N_NULL},
    {"image_data", N_NULL},
};

static bool is_neutral(json_t *v, neutral off) {
    switch (off) {
    case N_NULL: return false; /* given() already dropped null */
    case N_ONE: return json_is_number(v) && json_number_value(v) == 1.0;
    case N_EMPTY:
        return (json_is_string(v) && json_string_length(v) == 0) ||
            (json_is_array(v) && json_array_size(v) == 0) ||
            (json_is_object(v) && json_object_size(v) == 0);
    }
    return false;
}

static int refuse_unsupported(json_t *src, const unsupported *u, size_t n, const char *where,
                              char *err, size_t cap) {
    for (size_t i = 0; i < n; i++) {
        json_t *v = given(src, u[i].name);
        if (v && !is_neutral(v, u[i].off))
            return node_refuse(err, cap, 400,
                               "'%s%s' is not supported by pdserve yet (docs/http-api.md lists "
                               "what is); leave it out",
                               where, u[i].name);
    }
    return 0;
}

static int parse_unsupported(json_t *root, json_t *src, gen_api api, char *err, size_t cap) {
    if (api == GEN_API_CHAT) {
        json_t *tc = given(root, "tool_choice");
        if (tc && !(json_is_string(tc) && !strcmp(json_string_value(tc), "none")))
            return node_refuse(err, cap, 400, "'tool_choice' is not supported by pdserve yet");
        return refuse_unsupported(root, chat_unsupported, PD_ARRAY_LEN(chat_unsupported), "", err,
                                  cap);
    }
    if (api == GEN_API_COMPLETIONS)
        return refuse_unsupported(root, openai_unsupported, PD_ARRAY_LEN(openai_unsupported), "",
                                  err, cap);
    int status = refuse_unsupported(src, sampling_unsupported, PD_ARRAY_LEN(sampling_unsupported),
                                    "sampling_params.", err, cap);
    if (status) return status;
    return refuse_unsupported(root, generate_unsupported, PD_ARRAY_LEN(generate_unsupported), "",
                              err, cap);
}

/* ---- bootstrap ----------------------------------------------------------------------- */

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

/* The bootstrap fields, set by the router on prefill and decode nodes: the
 * room (required there) and the prefill node's address (the decode node's
 * peer, required on a decode node unless the transfer is in-process). */
static int parse_bootstrap(const pd_node_config *cfg, json_t *root, gen_params *p, char *err,
                           size_t cap) {
    json_t *room = json_object_get(root, "bootstrap_room");
    json_t *host = json_object_get(root, "bootstrap_host");
    json_t *port = json_object_get(root, "bootstrap_port");
    if (room && !json_is_null(room)) {
        if (!json_is_integer(room) || json_integer_value(room) <= 0)
            return node_refuse(err, cap, 400, "'bootstrap_room' must be a positive integer");
        p->room = (uint64_t)json_integer_value(room);
        if (p->room > (uint64_t)INT64_MAX - GEN_CHOICES_MAX)
            return node_refuse(err, cap, 400, "'bootstrap_room' must be below 2^63 - %u",
                               GEN_CHOICES_MAX);
    }
    if (host && !json_is_null(host) && !json_is_string(host))
        return node_refuse(err, cap, 400, "'bootstrap_host' must be a string");
    if (port && !json_is_null(port) &&
        (!json_is_integer(port) || json_integer_value(port) < 1 ||
         json_integer_value(port) > 65535))
        return node_refuse(err, cap, 400, "'bootstrap_port' must be an integer in [1, 65535]");
    if (cfg->role == PD_NODE_SERVE) return 0;
    if (!p->room)
        return node_refuse(err, cap, 400,
                           "'bootstrap_room' is required on a %s node "
                           "(send requests through the router)",
                           pd_node_role_name(cfg->role));
    if (cfg->role == PD_NODE_DECODE && strcmp(cfg->transfer_backend, "loopback") != 0 &&
        (!json_is_string(host) || !json_is_integer(port)))
        return node_refuse(err, cap, 400,
                           "'bootstrap_host' and 'bootstrap_port' are required on a decode node");
    if (json_is_string(host) && json_is_integer(port))
        snprintf(p->peer, sizeof(p->peer), "%s:%lld", json_string_value(host),
                 (long long)json_integer_value(port));
    if (!peer_allowed(cfg, p->peer))
        return node_refuse(err, cap, 403, "bootstrap peer '%s' is not one of --prefill-peers",
                           p->peer);
    return 0;
}

/* The number of choices a refused body asked for, as far as it can be read
 * (its rooms are cancelled): prompts * n, at least 1, at most the limit. */
static uint32_t choices_asked(json_t *root) {
    json_t *prompt = json_object_get(root, "prompt");
    if (!prompt) prompt = json_object_get(root, "text");
    if (!prompt) prompt = json_object_get(root, "input_ids");
    json_t *first = json_is_array(prompt) ? json_array_get(prompt, 0) : NULL;
    size_t k = first && !json_is_integer(first) ? json_array_size(prompt) : 1;
    json_t *sp = json_object_get(root, "sampling_params");
    json_t *n = json_object_get(json_is_object(sp) ? sp : root, "n");
    json_int_t each = json_is_integer(n) ? json_integer_value(n) : 1;
    if (each < 1) each = 1;
    uint64_t all = (uint64_t)k * (uint64_t)(each > GEN_CHOICES_MAX ? GEN_CHOICES_MAX : each);
    return all > GEN_CHOICES_MAX ? GEN_CHOICES_MAX : (uint32_t)all;
}

void gen_cancel_refused(pd_node *n, json_t *root) {
    json_t *room = json_object_get(root, "bootstrap_room");
    if (!json_is_integer(room) || json_integer_value(room) <= 0 ||
        (uint64_t)json_integer_value(room) > (uint64_t)INT64_MAX - GEN_CHOICES_MAX)
        return;
    json_t *host = json_object_get(root, "bootstrap_host");
    json_t *port = json_object_get(root, "bootstrap_port");
    char peer[PD_PEER_MAX] = "";
    if (json_is_string(host) && json_is_integer(port) && json_integer_value(port) >= 1 &&
        json_integer_value(port) <= 65535)
        snprintf(peer, sizeof(peer), "%s:%lld", json_string_value(host),
                 (long long)json_integer_value(port));
    if (!peer_allowed(node_config(n), peer)) peer[0] = '\0'; /* never contacted */
    uint32_t k = choices_asked(root);
    for (uint32_t i = 0; i < k; i++)
        node_cancel_room(n, (uint64_t)json_integer_value(room) + i, peer);
}

/* ---- chat ---------------------------------------------------------------------------- */

/* The chat template of the built-in tiny model (docs/http-api.md): each
 * message as "<|role|>\n" content "\n", then "<|assistant|>\n" for the
 * answer. A model that ships its own template will bring it (issue 12). */
static char *render_chat(json_t *messages, int *status, char *err, size_t cap) {
    if (!json_is_array(messages) || json_array_size(messages) == 0) {
        *status = node_refuse(err, cap, 400, "'messages' must be a non-empty array of messages");
        return NULL;
    }
    size_t need = 16, i;
    json_t *m;
    json_array_foreach(messages, i, m) {
        json_t *role = json_object_get(m, "role"), *content = json_object_get(m, "content");
        const char *r = json_string_value(role);
        if (!r || (strcmp(r, "system") && strcmp(r, "user") && strcmp(r, "assistant"))) {
            *status = node_refuse(err, cap, 400,
                                  "'messages'[%zu].role must be system, user or assistant", i);
            return NULL;
        }
        if (!json_is_string(content)) {
            *status = node_refuse(err, cap, 400, "'messages'[%zu].content must be a string", i);
            return NULL;
        }
        need += strlen(r) + json_string_length(content) + 8;
    }
    char *out = malloc(need), *w = out;
    if (!out) {
        *status = node_refuse(err, cap, 503, "out of memory for the prompt");
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

/* stream_options: {"include_usage": bool} is understood; anything else in
 * it is refused. */
static int parse_stream_options(json_t *root, gen_params *p, char *err, size_t cap) {
    json_t *so = given(root, "stream_options");
    if (!so) return 0;
    json_t *iu = json_object_get(so, "include_usage");
    if (!json_is_object(so) || json_object_size(so) != (iu ? 1u : 0u) ||
        (iu && !json_is_boolean(iu)))
        return node_refuse(err, cap, 400,
                           "'stream_options' supports only {\"include_usage\": bool}");
    p->include_usage = json_is_true(iu);
    return 0;
}

/* The messages through the model's own chat template: the context has the
 * messages as given, add_generation_prompt true, the tokenizer's bos_token
 * and eos_token, and the request's chat_template_kwargs (enable_thinking,
 * ...). NULL with the status when refused. */
static char *render_model_chat(const pd_node *n, json_t *root, int *status, char *err, size_t cap) {
    json_t *messages = json_object_get(root, "messages");
    json_t *kwargs = given(root, "chat_template_kwargs");
    if (!json_is_array(messages) || json_array_size(messages) == 0) {
        *status = node_refuse(err, cap, 400, "'messages' must be a non-empty array of messages");
        return NULL;
    }
    if (kwargs && !json_is_object(kwargs)) {
        *status = node_refuse(err, cap, 400, "'chat_template_kwargs' must be an object");
        return NULL;
    }
    json_t *ctx = kwargs ? json_deep_copy(kwargs) : json_object();
    const char *bos = node_special_text(n, false), *eos = node_special_text(n, true);
    json_object_set(ctx, "messages", messages);
    json_object_set_new(ctx, "add_generation_prompt", json_true());
    json_object_set_new(ctx, "bos_token", json_string(bos ? bos : ""));
    json_object_set_new(ctx, "eos_token", json_string(eos ? eos : ""));
    char *out = NULL, why[200];
    size_t len = 0;
    pd_err e = pd_chat_template_render(node_chat_template(n), ctx, &out, &len, why, sizeof why);
    json_decref(ctx);
    if (e != PD_OK) {
        *status = node_refuse(err, cap, e == PD_ERR_NOMEM ? 503 : 400,
                              "the model's chat template refused the messages: %s", why);
        return NULL;
    }
    return out;
}

/* Turns a chat body into the completions body it means: the messages
 * rendered into "prompt" (by the model's chat template, or the built-in
 * one), max_completion_tokens as max_tokens. */
static int chat_to_completions(const pd_node *n, json_t *root, gen_params *p, char *err,
                               size_t cap) {
    json_t *mct = given(root, "max_completion_tokens");
    if (mct) {
        if (given(root, "max_tokens"))
            return node_refuse(err, cap, 400,
                               "give 'max_completion_tokens' or 'max_tokens', not both");
        json_object_set(root, "max_tokens", mct);
        json_object_del(root, "max_completion_tokens");
    }
    if (json_object_get(root, "prompt"))
        return node_refuse(err, cap, 400, "a chat request has 'messages', not 'prompt'");
    int status = 0;
    p->templated = node_chat_template(n) != NULL;
    char *text = p->templated ? render_model_chat(n, root, &status, err, cap)
                              : render_chat(json_object_get(root, "messages"), &status, err, cap);
    if (!text) return status;
    json_object_set_new(root, "prompt", json_string(text));
    free(text);
    return json_object_get(root, "prompt") ? 0
                                           : node_refuse(err, cap, 400, "messages are not UTF-8");
}

/* ---- the whole body ------------------------------------------------------------------ */

/* --context-length: each prompt and the tokens it may add fit in it. A
 * max_new_tokens left at its default is cut to fit the longest prompt; one
 * the client asked for is refused, as SGLang refuses it. */
static int fit_context(const pd_node_config *cfg, json_t *root, gen_params *p, char *err,
                       size_t cap) {
    const uint32_t ctx = cfg->context_length;
    uint32_t longest = 0;
    for (uint32_t i = 0; i < p->n_prompts; i++)
        if (p->prompts[i].len > longest) longest = p->prompts[i].len;
    if (ctx == 0 || (uint64_t)longest + p->max_new <= ctx) return 0;
    if (longest >= ctx)
        return node_refuse(
            err, cap, 400,
            "the prompt is %u tokens, the context length %u (--context-length) leaves "
            "no room for output",
            longest, ctx);
    const char *mname = p->api != GEN_API_GENERATE ? "max_tokens" : "max_new_tokens";
    json_t *src = p->api != GEN_API_GENERATE ? root : json_object_get(root, "sampling_params");
    if (!given(src, mname)) {
        p->max_new = ctx - longest;
        return 0;
    }
    return node_refuse(
        err, cap, 400,
        "the prompt (%u tokens) and '%s' = %u exceed the context length of %u tokens "
        "(--context-length)",
        longest, mname, p->max_new, ctx);
}

static int parse_flags(json_t *root, gen_params *p, char *err, size_t cap) {
    json_t *v;
    if ((v = given(root, "stream"))) {
        if (!json_is_boolean(v)) return node_refuse(err, cap, 400, "'stream' must be a boolean");
        p->stream = json_is_true(v);
    }
    if ((v = given(root, "user")) && !json_is_string(v))
        return node_refuse(err, cap, 400, "'user' must be a string");
    if ((v = given(root, "rid"))) {
        if (!json_is_string(v)) return node_refuse(err, cap, 400, "'rid' must be a string");
        if (!gen_rid_acceptable(v)) return node_refuse(err, cap, 400, GEN_RID_RULE, PD_RID_MAX - 1);
        snprintf(p->rid, sizeof(p->rid), "%s", json_string_value(v));
    }
    return 0;
}

int gen_params_parse(pd_node *n, json_t *root, gen_api api, gen_params *p, char *err, size_t cap) {
    const pd_node_config *cfg = node_config(n);
    memset(p, 0, sizeof(*p));
    p->node = n;
    p->api = api;
    p->max_new = api != GEN_API_GENERATE ? 16 : 128;
    p->n = 1;
    if (!json_is_object(root))
        return node_refuse(err, cap, 400, "the request body must be a JSON object");
    int status = 0;
    if (api != GEN_API_GENERATE) status = parse_stream_options(root, p, err, cap);
    if (!status && api == GEN_API_CHAT) status = chat_to_completions(n, root, p, err, cap);
    prompt_field prompt = {0};
    json_t *src = NULL;
    if (!status) status = parse_shape(root, api, &prompt, &src, err, cap);
    if (!status) status = parse_prompts(n, api, &prompt, p, err, cap);
    if (!status) status = parse_sampling(cfg, node_vocab(n), src, api, p, err, cap);
    if (!status) status = parse_logprobs(root, api, p, err, cap);
    if (!status) status = parse_echo(root, api, p, err, cap);
    if (!status) status = parse_unsupported(root, src, api, err, cap);
    if (!status) status = parse_flags(root, p, err, cap);
    if (!status) status = fit_context(cfg, root, p, err, cap);
    if (status) return status;
    if (p->n_prompts * p->n > GEN_CHOICES_MAX)
        return node_refuse(err, cap, 400, "%u prompts times n = %u is %u choices; at most %u",
                           p->n_prompts, p->n, p->n_prompts * p->n, GEN_CHOICES_MAX);
    if (p->rid[0] && gen_choices(p) > 1 && strlen(p->rid) + 4 >= PD_RID_MAX)
        return node_refuse(err, cap, 400, "'rid' must be at most %d bytes with several choices",
                           PD_RID_MAX - 5);
    return parse_bootstrap(cfg, root, p, err, cap);
}

void gen_params_free(gen_params *p) {
    for (uint32_t i = 0; i < p->n_prompts; i++) free(p->prompts[i].ids);
    free(p->prompts);
    for (uint32_t i = 0; i < p->n_stops; i++) free(p->stops[i]);
    memset(p, 0, sizeof(*p));
}

void gen_rid(const char *base, uint32_t i, char *out, size_t cap) {
    if (i == 0) snprintf(out, cap, "%s", base);
    else snprintf(out, cap, "%s#%u", base, i);
}

uint64_t gen_room(const gen_params *p, uint32_t i) { return p->room ? p->room + i : 0; }

uint64_t gen_seed(const gen_params *p, uint32_t i) {
    const gen_prompt *pr = &p->prompts[i / p->n];
    uint64_t s = p->seeded ? pd_hash_u64(p->seed ^ 0x5eedc11e47ull)
                           : pd_hash_u64(p->room ^ pd_hash_tokens(pr->ids, pr->len, 7));
    return i == 0 ? s : s ^ pd_hash_u64(0xC401CEull + i);
}

int node_http_check_body(pd_node *n, const char *body, size_t len, int api, char *err, size_t cap) {
    json_error_t jerr;
    json_t *root = json_loadb(body, len, 0, &jerr);
    if (!root) return node_refuse(err, cap, 400, "malformed JSON: %s", jerr.text);
    static const gen_api apis[] = {GEN_API_GENERATE, GEN_API_COMPLETIONS, GEN_API_CHAT};
    gen_params p;
    int status = gen_params_parse(n, root, apis[api >= 0 && api < 3 ? api : 0], &p, err, cap);
    json_decref(root);
    gen_params_free(&p);
    return status;
}
