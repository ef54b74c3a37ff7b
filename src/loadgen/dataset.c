/*
 * The request sequence of a benchmark: prompts, lengths, arrival times and
 * which requests get aborted when, all drawn from one seeded generator so
 * the same options give the same sequence (pd_lg_dataset_dump proves it).
 *
 * Prompts are token ids by default, drawn uniformly from [token_min, vocab):
 * a server then sees exactly the lengths asked for, whatever its
 * tokenizer. With text (chat requests, --prompt-kind text) a prompt is
 * pseudo-words, one per token asked for; the server's own prompt_tokens is
 * what the results count.
 */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pdserve/loadgen.h"

static const char *const kind_names[PD_LG__KINDS] = {"random", "shared-prefix", "multi-turn",
                                                     "sharegpt", "trace"};

const char *pd_lg_kind_name(pd_lg_kind k) { return k < PD_LG__KINDS ? kind_names[k] : "?"; }

bool pd_lg_kind_parse(const char *s, pd_lg_kind *out) {
    for (int k = 0; k < PD_LG__KINDS; k++)
        if (!strcmp(s, kind_names[k])) {
            *out = (pd_lg_kind)k;
            return true;
        }
    /* SGLang's name for the shared-prefix set */
    if (!strcmp(s, "generated-shared-prefix")) {
        *out = PD_LG_SHARED_PREFIX;
        return true;
    }
    return false;
}

const char *pd_lg_abort_name(pd_lg_abort a) {
    return a == PD_LG_ABORT_REQUEST ? "request" : a == PD_LG_ABORT_CLOSE ? "close" : "none";
}

void pd_lg_dataset_config_default(pd_lg_dataset_config *c) {
    *c = (pd_lg_dataset_config){
        .kind = PD_LG_RANDOM,
        .seed = 1,
        .num_prompts = 200,
        .input_len = 256,
        .output_len = 32,
        .range_ratio = 0.5,
        .vocab = 256,
        .token_min = 1,
        .gsp_groups = 8,
        .gsp_system_len = 512,
        .gsp_question_len = 64,
        .turns = 4,
        .trace_block_tokens = 512,
        .burstiness = 1.0,
        .abort_min_s = 0.0,
        .abort_max_s = 0.5,
    };
}

/* ---- building prompts ---------------------------------------------------------------- */

/* A growing prompt: ids or text, and its segments. */
typedef struct prompt {
    int32_t *ids;
    char *text;
    uint32_t len, cap; /* ids, or bytes of text */
    pd_lg_segment seg[PD_LG_SEGMENTS_MAX];
    uint32_t n_seg, tokens;
} prompt;

static void *grow(void *p, uint32_t *cap, uint32_t need, size_t elem) {
    if (need <= *cap) return p;
    uint32_t c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(p, (size_t)c * elem);
    PD_ASSERT(q);
    *cap = c;
    return q;
}

static const char *const syllables[] = {"ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo",
                                        "be", "da", "fu", "go", "hi", "ja", "po", "ze"};

/* One pseudo-word per token; the generator decides the word. */
static void add_text_tokens(prompt *p, pd_rng *rng, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) {
        char w[16];
        uint32_t syl = 1 + (uint32_t)pd_rng_below(rng, 3), k = 0;
        if (p->len) w[k++] = ' ';
        for (uint32_t s = 0; s < syl; s++) {
            const char *y = syllables[pd_rng_below(rng, 16)];
            w[k++] = y[0];
            w[k++] = y[1];
        }
        p->text = grow(p->text, &p->cap, p->len + k + 1, 1);
        memcpy(p->text + p->len, w, k);
        p->len += k;
        p->text[p->len] = '\0';
    }
}

static void add_id_tokens(prompt *p, pd_rng *rng, uint32_t n, const pd_lg_dataset_config *c) {
    p->ids = grow(p->ids, &p->cap, p->len + n, sizeof(int32_t));
    uint32_t span = c->vocab > c->token_min ? c->vocab - c->token_min : 1;
    for (uint32_t i = 0; i < n; i++)
        p->ids[p->len++] = (int32_t)(c->token_min + pd_rng_below(rng, span));
}

/* Appends n tokens drawn from rng as a segment of the given role (merged
 * into the last segment when it has the same role). */
static void add_tokens(prompt *p, pd_rng *rng, uint32_t n, pd_lg_role role,
                       const pd_lg_dataset_config *c) {
    uint32_t off = p->len;
    if (c->text) add_text_tokens(p, rng, n);
    else add_id_tokens(p, rng, n, c);
    p->tokens += n;
    if (p->n_seg && p->seg[p->n_seg - 1].role == role) {
        p->seg[p->n_seg - 1].len = p->len - p->seg[p->n_seg - 1].off;
    } else if (p->n_seg < PD_LG_SEGMENTS_MAX) {
        p->seg[p->n_seg++] = (pd_lg_segment){.role = role, .off = off, .len = p->len - off};
    } else {
        p->seg[p->n_seg - 1].len = p->len - p->seg[p->n_seg - 1].off;
    }
}

static void add_text(prompt *p, const char *s, size_t n, pd_lg_role role, uint32_t tokens) {
    if (p->ids) return;
    p->text = grow(p->text, &p->cap, p->len + (uint32_t)n + 1, 1);
    if (p->n_seg < PD_LG_SEGMENTS_MAX)
        p->seg[p->n_seg++] = (pd_lg_segment){.role = role, .off = p->len, .len = (uint32_t)n};
    memcpy(p->text + p->len, s, n);
    p->len += (uint32_t)n;
    p->text[p->len] = '\0';
    p->tokens += tokens;
}

/* Moves the prompt into the request (copies, so one prompt can seed
 * several: a conversation's next turn starts from this one). */
static void put_prompt(pd_lg_request *r, const prompt *p) {
    if (p->ids) {
        r->ids = malloc((size_t)PD_MAX(p->len, 1u) * sizeof(int32_t));
        PD_ASSERT(r->ids);
        memcpy(r->ids, p->ids, (size_t)p->len * sizeof(int32_t));
    } else {
        r->text = malloc((size_t)p->len + 1);
        PD_ASSERT(r->text);
        memcpy(r->text, p->text ? p->text : "", p->len);
        r->text[p->len] = '\0';
    }
    r->n_ids = p->len;
    r->input_len = p->tokens;
    memcpy(r->seg, p->seg, sizeof(p->seg));
    r->n_seg = p->n_seg;
}

static void prompt_copy(prompt *dst, const prompt *src, bool text) {
    *dst = *src;
    dst->ids = NULL;
    dst->text = NULL;
    dst->cap = 0;
    if (!text) {
        dst->ids = grow(NULL, &dst->cap, PD_MAX(src->len, 1u), sizeof(int32_t));
        if (src->len) memcpy(dst->ids, src->ids, (size_t)src->len * sizeof(int32_t));
    } else {
        dst->text = grow(NULL, &dst->cap, src->len + 1, 1);
        memcpy(dst->text, src->text ? src->text : "", src->len);
        dst->text[src->len] = '\0';
    }
}

static void prompt_free(prompt *p) {
    free(p->ids);
    free(p->text);
    *p = (prompt){0};
}

static uint32_t draw_len(pd_rng *rng, uint32_t len, double ratio) {
    uint32_t lo = (uint32_t)floor((double)len * ratio);
    if (lo < 1) lo = 1;
    if (lo > len) lo = len;
    return (uint32_t)pd_rng_range(rng, lo, len);
}

/* ---- arrivals and aborts ------------------------------------------------------------- */

static double normal(pd_rng *rng) {
    double u1 = 1.0 - pd_rng_unit(rng), u2 = pd_rng_unit(rng);
    return sqrt(-2.0 * log(u1)) * cos(2.0 * 3.14159265358979323846 * u2);
}

/* Gamma(shape k, scale 1) by Marsaglia and Tsang's method; k < 1 through
 * Gamma(k + 1) * U^(1/k). */
static double gamma_draw(pd_rng *rng, double k) {
    if (k < 1.0) return gamma_draw(rng, k + 1.0) * pow(1.0 - pd_rng_unit(rng), 1.0 / k);
    double d = k - 1.0 / 3.0, c = 1.0 / sqrt(9.0 * d);
    for (;;) {
        double x = normal(rng), v = 1.0 + c * x;
        if (v <= 0) continue;
        v = v * v * v;
        double u = 1.0 - pd_rng_unit(rng);
        if (log(u) < 0.5 * x * x + d - d * v + d * log(v)) return d * v;
    }
}

/* The gap before the next arrival: gamma with mean 1/rate and shape
 * burstiness (1 = exponential, a Poisson process; SGLang's convention). */
static double next_gap(pd_rng *rng, const pd_lg_dataset_config *c) {
    if (c->request_rate <= 0) return 0;
    return gamma_draw(rng, c->burstiness) / (c->request_rate * c->burstiness);
}

static void plan_abort(pd_lg_request *r, pd_rng *rng, const pd_lg_dataset_config *c) {
    if (r->warmup || c->abort_fraction <= 0) return;
    if (pd_rng_unit(rng) >= c->abort_fraction) return;
    r->abort = c->abort_mode != PD_LG_ABORT_NONE ? c->abort_mode
        : pd_rng_below(rng, 2)                   ? PD_LG_ABORT_CLOSE
                                                 : PD_LG_ABORT_REQUEST;
    r->abort_after_s = c->abort_min_s + (c->abort_max_s - c->abort_min_s) * pd_rng_unit(rng);
}

/* Puts the prompt into the request with its output length, then draws its
 * arrival (after the previous one's, *t) and whether it is aborted. */
static void place(pd_lg_request *r, prompt *p, uint32_t output_len, pd_rng *rng,
                  const pd_lg_dataset_config *c, double *t) {
    put_prompt(r, p);
    prompt_free(p);
    r->output_len = output_len;
    if (!r->warmup) *t += next_gap(rng, c);
    r->arrival_s = r->warmup ? 0 : *t;
    plan_abort(r, rng, c);
}

/* ---- the generated datasets ---------------------------------------------------------- */

static pd_lg_request *new_request(pd_lg_dataset *d, const pd_lg_dataset_config *c) {
    pd_lg_request *r = &d->reqs[d->n];
    *r = (pd_lg_request){.index = d->n, .prev = -1, .warmup = d->n < c->warmup};
    d->n++;
    return r;
}

static void build_random(const pd_lg_dataset_config *c, pd_lg_dataset *d, pd_rng *rng,
                         uint32_t total) {
    double t = 0;
    for (uint32_t i = 0; i < total; i++) {
        pd_lg_request *r = new_request(d, c);
        prompt p = {0};
        add_tokens(&p, rng, draw_len(rng, c->input_len, c->range_ratio), PD_LG_USER, c);
        place(r, &p, draw_len(rng, c->output_len, c->range_ratio), rng, c, &t);
    }
}

/* gsp_groups system prompts; each request is one of them (drawn, so the
 * groups interleave as they would) followed by a question of its own. */
static void build_shared_prefix(const pd_lg_dataset_config *c, pd_lg_dataset *d, pd_rng *rng,
                                uint32_t total) {
    uint32_t groups = PD_MAX(c->gsp_groups, 1u);
    prompt *sys = calloc(groups, sizeof(prompt));
    PD_ASSERT(sys);
    for (uint32_t g = 0; g < groups; g++)
        add_tokens(&sys[g], rng, c->gsp_system_len, PD_LG_SYSTEM, c);
    double t = 0;
    for (uint32_t i = 0; i < total; i++) {
        pd_lg_request *r = new_request(d, c);
        uint32_t g = (uint32_t)pd_rng_below(rng, groups);
        prompt p;
        prompt_copy(&p, &sys[g], c->text);
        add_tokens(&p, rng, draw_len(rng, c->gsp_question_len, c->range_ratio), PD_LG_USER, c);
        place(r, &p, draw_len(rng, c->output_len, c->range_ratio), rng, c, &t);
    }
    for (uint32_t g = 0; g < groups; g++) prompt_free(&sys[g]);
    free(sys);
}

/* Conversations of `turns` turns: turn k's prompt is turn k-1's prompt, an
 * answer of turn k-1's output length (drawn, so the sequence does not
 * depend on what the server said), and a new question. Turn k goes out
 * when turn k-1 has ended. */
static void build_multi_turn(const pd_lg_dataset_config *c, pd_lg_dataset *d, pd_rng *rng,
                             uint32_t total) {
    uint32_t turns = PD_MAX(c->turns, 1u);
    double t = 0;
    while (d->n < total) {
        prompt p = {0};
        int32_t prev = -1;
        uint32_t prev_out = 0;
        for (uint32_t k = 0; k < turns && d->n < total; k++) {
            pd_lg_request *r = new_request(d, c);
            if (prev >= 0) add_tokens(&p, rng, prev_out, PD_LG_ASSISTANT, c);
            add_tokens(&p, rng, draw_len(rng, c->input_len, c->range_ratio), PD_LG_USER, c);
            put_prompt(r, &p);
            r->output_len = prev_out = draw_len(rng, c->output_len, c->range_ratio);
            if (prev < 0 && !r->warmup) t += next_gap(rng, c);
            r->arrival_s = prev < 0 && !r->warmup ? t : 0;
            r->prev = prev;
            plan_abort(r, rng, c);
            prev = (int32_t)r->index;
        }
        prompt_free(&p);
    }
}

/* ---- ShareGPT ------------------------------------------------------------------------ */

/* The first human turn of a conversation and the answer that follows. */
static bool sharegpt_pair(json_t *conv, const char **q, const char **a) {
    json_t *turns = json_object_get(conv, "conversations");
    if (!turns) turns = json_object_get(conv, "conversation");
    if (!json_is_array(turns) || json_array_size(turns) < 2) return false;
    *q = json_string_value(json_object_get(json_array_get(turns, 0), "value"));
    *a = json_string_value(json_object_get(json_array_get(turns, 1), "value"));
    return *q && *a && **q;
}

static pd_err load_json_file(const char *path, json_t **out, char *err, size_t cap) {
    if (!path) return pd_errorf(err, cap, PD_ERR_INVALID, "this dataset needs --dataset-path");
    json_error_t je;
    *out = json_load_file(path, JSON_REJECT_DUPLICATES, &je);
    if (!*out) return pd_errorf(err, cap, PD_ERR_PARSE, "%s:%d: %s", path, je.line, je.text);
    return PD_OK;
}

/* Answers are counted in tokens by the server; without a tokenizer here, an
 * answer's length is estimated at 4 bytes a token (clamped to [4, 4096]). */
static pd_err build_sharegpt(const pd_lg_dataset_config *c, pd_lg_dataset *d, pd_rng *rng,
                             uint32_t total, char *err, size_t cap) {
    json_t *root;
    pd_err e = load_json_file(c->path, &root, err, cap);
    if (e) return e;
    if (!json_is_array(root)) {
        json_decref(root);
        return pd_errorf(err, cap, PD_ERR_PARSE, "%s: a ShareGPT file is a JSON array", c->path);
    }
    size_t n = json_array_size(root), usable = 0;
    uint32_t *pick = malloc(PD_MAX(n, (size_t)1) * sizeof(uint32_t));
    PD_ASSERT(pick);
    for (size_t i = 0; i < n; i++) {
        const char *q, *a;
        if (sharegpt_pair(json_array_get(root, i), &q, &a)) pick[usable++] = (uint32_t)i;
    }
    if (!usable) {
        free(pick);
        json_decref(root);
        return pd_errorf(err, cap, PD_ERR_PARSE,
                         "%s: no conversation with a question and an answer "
                         "(\"conversations\": [{\"from\": \"human\", \"value\": ...}, ...])",
                         c->path);
    }
    for (size_t i = usable; i > 1; i--) { /* Fisher-Yates: the seed picks the order */
        size_t j = pd_rng_below(rng, i);
        uint32_t t = pick[i - 1];
        pick[i - 1] = pick[j];
        pick[j] = t;
    }
    double t = 0;
    for (uint32_t i = 0; i < total; i++) {
        const char *q, *a;
        sharegpt_pair(json_array_get(root, pick[i % usable]), &q, &a);
        pd_lg_request *r = new_request(d, c);
        prompt p = {0};
        size_t ql = strlen(q);
        add_text(&p, q, ql, PD_LG_USER, (uint32_t)PD_MAX(ql / 4, (size_t)1));
        size_t est = PD_MIN(PD_MAX(strlen(a) / 4, (size_t)4), (size_t)4096);
        place(r, &p, c->sharegpt_output_len ? c->sharegpt_output_len : (uint32_t)est, rng, c, &t);
    }
    free(pick);
    json_decref(root);
    return PD_OK;
}

/* ---- traces -------------------------------------------------------------------------- */

/* Tokens of one block of a trace line's hash_ids: the same hash id gives
 * the same tokens on every line, so lines sharing a prefix of hash ids share
 * that prefix of tokens (Mooncake's trace format). */
static void add_block(prompt *p, uint64_t hash, uint32_t n, const pd_lg_dataset_config *c) {
    pd_rng brng;
    pd_rng_seed(&brng, pd_hash_u64(c->seed * 0x9E3779B97F4A7C15ull ^ pd_hash_u64(hash)));
    add_tokens(p, &brng, n, PD_LG_USER, c);
}

static pd_err trace_prompt(json_t *o, prompt *p, pd_rng *rng, const pd_lg_dataset_config *c,
                           const char *where, char *err, size_t cap) {
    json_t *ids = json_object_get(o, "input_ids"), *txt = json_object_get(o, "text");
    if (!txt) txt = json_object_get(o, "prompt");
    if (json_is_string(txt)) {
        if (!c->text)
            return pd_errorf(err, cap, PD_ERR_INVALID, "%s: a text prompt needs --prompt-kind text",
                             where);
        size_t n = json_string_length(txt);
        add_text(p, json_string_value(txt), n, PD_LG_USER, (uint32_t)PD_MAX(n / 4, (size_t)1));
        return PD_OK;
    }
    if (json_is_array(ids)) {
        if (c->text)
            return pd_errorf(err, cap, PD_ERR_INVALID, "%s: input_ids need --prompt-kind ids",
                             where);
        size_t i;
        json_t *v;
        p->ids = grow(p->ids, &p->cap, (uint32_t)json_array_size(ids) + 1, sizeof(int32_t));
        json_array_foreach(ids, i, v) {
            if (!json_is_integer(v) || json_integer_value(v) < 0 ||
                json_integer_value(v) > INT32_MAX)
                return pd_errorf(err, cap, PD_ERR_PARSE, "%s: input_ids[%zu] is not a token id",
                                 where, i);
            p->ids[p->len++] = (int32_t)json_integer_value(v);
        }
        p->tokens = p->len;
        p->seg[0] = (pd_lg_segment){.role = PD_LG_USER, .off = 0, .len = p->len};
        p->n_seg = 1;
        return PD_OK;
    }
    json_t *il = json_object_get(o, "input_length");
    if (!json_is_integer(il) || json_integer_value(il) < 1 || json_integer_value(il) > 1 << 24)
        return pd_errorf(err, cap, PD_ERR_PARSE,
                         "%s: a trace line needs input_ids, text or input_length (1..16777216)",
                         where);
    uint32_t need = (uint32_t)json_integer_value(il), block = PD_MAX(c->trace_block_tokens, 1u);
    json_t *hashes = json_object_get(o, "hash_ids");
    for (size_t b = 0; p->tokens < need; b++) {
        uint32_t n = PD_MIN(block, need - p->tokens);
        json_t *h = json_array_get(hashes, b);
        if (json_is_integer(h)) add_block(p, (uint64_t)json_integer_value(h), n, c);
        else add_tokens(p, rng, n, PD_LG_USER, c);
    }
    return PD_OK;
}

static pd_err trace_line(const pd_lg_dataset_config *c, pd_lg_dataset *d, pd_rng *rng, json_t *o,
                         const char *where, double *t0, char *err, size_t cap) {
    if (!json_is_object(o))
        return pd_errorf(err, cap, PD_ERR_PARSE, "%s: not a JSON object", where);
    json_t *ts = json_object_get(o, "timestamp");
    if (!json_is_number(ts))
        return pd_errorf(err, cap, PD_ERR_PARSE, "%s: \"timestamp\" (milliseconds) is missing",
                         where);
    double ms = json_number_value(ts);
    json_t *ol = json_object_get(o, "output_length");
    if (!ol) ol = json_object_get(o, "max_tokens");
    if (!json_is_integer(ol) || json_integer_value(ol) < 1 || json_integer_value(ol) > 1 << 20)
        return pd_errorf(err, cap, PD_ERR_PARSE, "%s: \"output_length\" must be 1..1048576", where);
    if (d->n == 0) *t0 = ms;
    double at = (ms - *t0) / 1000.0;
    if (d->n > 0 && at < d->reqs[d->n - 1].arrival_s)
        return pd_errorf(err, cap, PD_ERR_PARSE, "%s: timestamps must not go back", where);
    prompt p = {0};
    pd_err e = trace_prompt(o, &p, rng, c, where, err, cap);
    if (e) {
        prompt_free(&p);
        return e;
    }
    pd_lg_request *r = new_request(d, c);
    put_prompt(r, &p);
    prompt_free(&p);
    r->output_len = (uint32_t)json_integer_value(ol);
    r->arrival_s = r->warmup ? 0 : at;
    plan_abort(r, rng, c);
    return PD_OK;
}

static pd_err build_trace(const pd_lg_dataset_config *c, pd_lg_dataset *d, pd_rng *rng,
                          uint32_t total, char *err, size_t cap) {
    if (!c->path) return pd_errorf(err, cap, PD_ERR_INVALID, "a trace needs --dataset-path");
    FILE *f = fopen(c->path, "r");
    if (!f) return pd_errorf(err, cap, PD_ERR_IO, "%s: %s", c->path, strerror(errno));
    char *line = NULL;
    size_t lcap = 0;
    uint32_t lineno = 0;
    double t0 = 0;
    pd_err e = PD_OK;
    while (!e && d->n < total && getline(&line, &lcap, f) >= 0) {
        lineno++;
        if (strspn(line, " \t\r\n") == strlen(line)) continue;
        char where[320];
        snprintf(where, sizeof(where), "%s:%u", c->path, lineno);
        json_error_t je;
        json_t *o = json_loads(line, JSON_REJECT_DUPLICATES, &je);
        if (!o) {
            e = pd_errorf(err, cap, PD_ERR_PARSE, "%s: %s", where, je.text);
            break;
        }
        e = trace_line(c, d, rng, o, where, &t0, err, cap);
        json_decref(o);
    }
    free(line);
    fclose(f);
    if (!e && d->n == 0) e = pd_errorf(err, cap, PD_ERR_PARSE, "%s: no request in it", c->path);
    return e;
}

/* ---- building, dumping, freeing ------------------------------------------------------ */

pd_err pd_lg_dataset_build(const pd_lg_dataset_config *c, pd_lg_dataset *out, char *err,
                           size_t cap) {
    *out = (pd_lg_dataset){.kind = c->kind};
    uint64_t total = (uint64_t)c->num_prompts + c->warmup;
    if (c->num_prompts == 0 || total > 10000000)
        return pd_errorf(err, cap, PD_ERR_INVALID, "the request count must be 1..10000000");
    if (!c->text && c->vocab <= c->token_min)
        return pd_errorf(err, cap, PD_ERR_INVALID,
                         "the vocabulary (%u) must exceed the lowest "
                         "token id drawn (%u)",
                         c->vocab, c->token_min);
    if (c->kind == PD_LG_SHAREGPT && !c->text)
        return pd_errorf(err, cap, PD_ERR_INVALID, "ShareGPT prompts are text: --prompt-kind text");
    out->reqs = calloc(total, sizeof(pd_lg_request));
    PD_ASSERT(out->reqs);
    pd_rng rng;
    pd_rng_seed(&rng, c->seed);
    pd_err e = PD_OK;
    switch (c->kind) {
    case PD_LG_RANDOM: build_random(c, out, &rng, (uint32_t)total); break;
    case PD_LG_SHARED_PREFIX: build_shared_prefix(c, out, &rng, (uint32_t)total); break;
    case PD_LG_MULTI_TURN: build_multi_turn(c, out, &rng, (uint32_t)total); break;
    case PD_LG_SHAREGPT: e = build_sharegpt(c, out, &rng, (uint32_t)total, err, cap); break;
    case PD_LG_TRACE: e = build_trace(c, out, &rng, (uint32_t)total, err, cap); break;
    default: e = pd_errorf(err, cap, PD_ERR_INVALID, "unknown dataset");
    }
    if (e) pd_lg_dataset_free(out);
    return e;
}

void pd_lg_dataset_free(pd_lg_dataset *d) {
    for (uint32_t i = 0; d->reqs && i < d->n; i++) {
        free(d->reqs[i].ids);
        free(d->reqs[i].text);
    }
    free(d->reqs);
    *d = (pd_lg_dataset){0};
}

static const char *const role_names[] = {"system", "user", "assistant"};

static json_t *segment_json(const pd_lg_request *r, const pd_lg_segment *s) {
    json_t *o = json_pack("{s:s}", "role", role_names[s->role]);
    if (r->ids) {
        json_t *a = json_array();
        for (uint32_t i = 0; i < s->len; i++)
            json_array_append_new(a, json_integer(r->ids[s->off + i]));
        json_object_set_new(o, "ids", a);
    } else {
        json_object_set_new(o, "text", json_stringn(r->text + s->off, s->len));
    }
    return o;
}

bool pd_lg_dataset_dump(const pd_lg_dataset *d, FILE *to) {
    for (uint32_t i = 0; i < d->n; i++) {
        const pd_lg_request *r = &d->reqs[i];
        json_t *segs = json_array();
        for (uint32_t k = 0; k < r->n_seg; k++)
            json_array_append_new(segs, segment_json(r, &r->seg[k]));
        json_t *o = json_pack("{s:i,s:b,s:f,s:i,s:i,s:i,s:o}", "index", (json_int_t)r->index,
                              "warmup", r->warmup, "arrival_s", r->arrival_s, "prev",
                              (json_int_t)r->prev, "input_len", (json_int_t)r->input_len,
                              "max_new_tokens", (json_int_t)r->output_len, "segments", segs);
        if (r->abort != PD_LG_ABORT_NONE)
            json_object_set_new(o, "abort",
                                json_pack("{s:s,s:f}", "mode", pd_lg_abort_name(r->abort),
                                          "after_s", r->abort_after_s));
        char *s = json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_ENSURE_ASCII);
        json_decref(o);
        bool ok = s && fputs(s, to) >= 0 && fputc('\n', to) != EOF;
        free(s);
        if (!ok) return false;
    }
    return fflush(to) == 0;
}
