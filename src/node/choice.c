/*
 * choice.c — one choice's output as text (gen.h).
 *
 * Tokens become text one at a time, so that a stop string can be pinned to
 * the token that completed it: that token still counts (as OpenAI counts
 * it), the text is cut where the stop string begins, and nothing after it is
 * ever shown. A stop string may span tokens, so a search after each token
 * starts stop_longest - 1 bytes back. A stream shows the text only up to
 * where a stop string could still begin (the longest tail that is a prefix
 * of one is held back), and an incomplete UTF-8 character is carried to the
 * next token; at the end everything left is shown, an invalid tail as
 * U+FFFD.
 */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "gen.h"
#include "pdserve/tokenizer.h"

static bool text_add(gen_choice *ch, const char *s, size_t n) {
    if (ch->len + n + 1 > ch->cap) {
        size_t cap = ch->cap ? ch->cap : 64;
        while (cap < ch->len + n + 1) cap *= 2;
        char *t = realloc(ch->text, cap);
        if (!t) return false;
        ch->text = t;
        ch->cap = cap;
    }
    memcpy(ch->text + ch->len, s, n);
    ch->len += n;
    ch->text[ch->len] = '\0';
    return true;
}

/* raw[0, len) with carry in front, sanitised, onto the text; an incomplete
 * character at the end is carried unless final. */
static bool add_bytes(gen_choice *ch, const char *raw, size_t raw_len, bool final) {
    char stack[64];
    size_t len = ch->carry_len + raw_len;
    char *buf = len <= sizeof stack ? stack : malloc(len);
    if (!buf) return false;
    memcpy(buf, ch->carry, ch->carry_len);
    memcpy(buf + ch->carry_len, raw, raw_len);
    ch->carry_len = 0;
    if (!final) {
        /* Hold back the start of a multi-byte character cut by the end. */
        size_t k = len, back = 0;
        while (k > 0 && back < 3 && ((unsigned char)buf[k - 1] & 0xC0) == 0x80) {
            k--;
            back++;
        }
        if (k > 0) {
            unsigned char lead = (unsigned char)buf[k - 1];
            size_t want = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
            if (want > 1 && want > back + 1 && lead < 0xF8) {
                ch->carry_len = back + 1;
                memcpy(ch->carry, buf + k - 1, ch->carry_len);
                len = k - 1;
            }
        }
    }
    size_t need = pd_utf8_sanitize(buf, len, NULL, 0);
    bool ok = text_add(ch, "", 0); /* the text exists even when empty */
    if (ok && need) {
        char *clean = malloc(need + 1);
        ok = clean != NULL;
        if (ok) {
            pd_utf8_sanitize(buf, len, clean, need + 1);
            ok = text_add(ch, clean, need);
        }
        free(clean);
    }
    if (buf != stack) free(buf);
    return ok;
}

/* After token t's text was added from byte `before`: the earliest stop
 * string starting in the text's new reach cuts it. */
static void find_stop(gen_choice *ch, const gen_params *p, size_t before, uint32_t t) {
    if (!p->n_stops || ch->stopped) return;
    size_t from = before > p->stop_longest - 1 ? before - (p->stop_longest - 1) : 0;
    if (from < ch->base) from = ch->base;
    size_t best = SIZE_MAX;
    int which = -1;
    for (uint32_t s = 0; s < p->n_stops; s++) {
        const char *hit = memmem(ch->text + from, ch->len - from, p->stops[s], strlen(p->stops[s]));
        if (hit && (size_t)(hit - ch->text) < best) {
            best = (size_t)(hit - ch->text);
            which = (int)s;
        }
    }
    if (which < 0) return;
    ch->len = best;
    ch->text[best] = '\0';
    ch->carry_len = 0;
    ch->stopped = which + 1;
    ch->kept = t + 1;
}

bool gen_choice_init(gen_choice *ch, call *c, uint32_t index, const gen_params *p) {
    memset(ch, 0, sizeof(*ch));
    ch->c = c;
    ch->index = index;
    if (!text_add(ch, "", 0)) return false;
    if (p->logprobs) {
        ch->offset = calloc(c->spec.max_new_tokens + 1, sizeof(uint32_t));
        if (!ch->offset) return false;
    }
    if (p->echo) {
        char raw[NODE_TOKEN_BYTES_MAX];
        for (uint32_t i = 0; i < c->prompt_len; i++) {
            size_t n = node_token_bytes(p->node, c->prompt[i], true, raw, sizeof raw);
            if (!add_bytes(ch, raw, n, false)) return false;
        }
        if (!add_bytes(ch, "", 0, true)) return false;
        ch->base = ch->len;
    }
    return true;
}

void gen_choice_free(gen_choice *ch) {
    free(ch->text);
    free(ch->offset);
    ch->text = NULL;
    ch->offset = NULL;
}

bool gen_choice_feed(gen_choice *ch, const gen_params *p, uint32_t have, bool done) {
    const call *c = ch->c;
    while (!ch->stopped && ch->fed < have) {
        char raw[NODE_TOKEN_BYTES_MAX];
        size_t n = node_token_bytes(p->node, c->tokens[ch->fed], true, raw, sizeof raw);
        size_t before = ch->len;
        if (ch->offset) ch->offset[ch->fed] = (uint32_t)ch->len;
        if (!add_bytes(ch, raw, n, false)) return false;
        find_stop(ch, p, before, ch->fed);
        ch->fed++;
    }
    if (!ch->stopped) ch->kept = ch->fed;
    if (done && (ch->stopped || ch->fed == have) && !ch->flushed) {
        if (!ch->stopped && !add_bytes(ch, "", 0, true)) return false;
        ch->flushed = true;
    }
    return true;
}

size_t gen_choice_showable(const gen_choice *ch, const gen_params *p) {
    if (ch->stopped || ch->flushed || !p->n_stops) return ch->len;
    size_t most = p->stop_longest - 1 < ch->len - ch->base ? p->stop_longest - 1
                                                           : ch->len - ch->base;
    for (size_t k = most; k > 0; k--)
        for (uint32_t s = 0; s < p->n_stops; s++)
            if (strlen(p->stops[s]) > k && !memcmp(ch->text + ch->len - k, p->stops[s], k))
                return ch->len - k;
    return ch->len;
}

const char *gen_choice_finish(const gen_choice *ch) {
    const call *c = ch->c;
    if (ch->stopped) return "stop";
    if (c->kind == PD_TERM_FINISHED) {
        if (c->finish == PD_FINISH_STOP) return "stop";
        if (c->finish == PD_FINISH_TRANSFERRED) return "transferred";
        return "length";
    }
    return "abort";
}

/* ---- logprobs ------------------------------------------------------------------------ */

/* Token t as text (sanitised: a token may be part of a character). */
static json_t *token_string(const pd_node *node, int32_t t) {
    char raw[NODE_TOKEN_BYTES_MAX], clean[3 * NODE_TOKEN_BYTES_MAX + 1];
    size_t n = node_token_bytes(node, t, false, raw, sizeof raw);
    pd_utf8_sanitize(raw, n, clean, sizeof clean);
    return json_string(clean);
}

static json_t *token_bytes(const pd_node *node, int32_t t) {
    char raw[NODE_TOKEN_BYTES_MAX];
    size_t n = node_token_bytes(node, t, false, raw, sizeof raw);
    json_t *a = json_array();
    for (size_t i = 0; i < n; i++) json_array_append_new(a, json_integer((unsigned char)raw[i]));
    return a;
}

static uint32_t tops(const call *c, uint32_t i) { return c->n_top ? c->n_top[i] : 0; }
static int32_t top_token(const call *c, uint32_t i, uint32_t r) {
    return c->top[(size_t)i * c->spec.sampling.top_logprobs + r];
}
static float top_lp(const call *c, uint32_t i, uint32_t r) {
    return c->top_lp[(size_t)i * c->spec.sampling.top_logprobs + r];
}

/* Chat: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}. */
static json_t *chat_logprobs(const gen_choice *ch, const gen_params *p, uint32_t from,
                             uint32_t to) {
    const call *c = ch->c;
    json_t *content = json_array();
    for (uint32_t i = from; i < to; i++) {
        json_t *top = json_array();
        for (uint32_t r = 0; r < tops(c, i); r++)
            json_array_append_new(top,
                                  json_pack("{s:o,s:f,s:o}", "token",
                                            token_string(p->node, top_token(c, i, r)), "logprob",
                                            (double)top_lp(c, i, r), "bytes",
                                            token_bytes(p->node, top_token(c, i, r))));
        json_array_append_new(content,
                              json_pack("{s:o,s:f,s:o,s:o}", "token",
                                        token_string(p->node, c->tokens[i]), "logprob",
                                        (double)c->logprobs[i], "bytes",
                                        token_bytes(p->node, c->tokens[i]), "top_logprobs", top));
    }
    return json_pack("{s:o}", "content", content);
}

json_t *gen_logprobs_openai(const gen_choice *ch, const gen_params *p, uint32_t from, uint32_t to) {
    if (!p->logprobs) return json_null();
    if (p->api == GEN_API_CHAT) return chat_logprobs(ch, p, from, to);
    const call *c = ch->c;
    json_t *tokens = json_array(), *lps = json_array(), *top = json_array(), *off = json_array();
    for (uint32_t i = from; i < to; i++) {
        json_array_append_new(tokens, token_string(p->node, c->tokens[i]));
        json_array_append_new(lps, json_real(c->logprobs[i]));
        json_t *alts = json_object();
        for (uint32_t r = 0; r < tops(c, i); r++) {
            json_t *s = token_string(p->node, top_token(c, i, r));
            /* equal strings (two ids of one text) keep the likelier */
            if (!json_object_get(alts, json_string_value(s)))
                json_object_set_new(alts, json_string_value(s), json_real(top_lp(c, i, r)));
            json_decref(s);
        }
        json_array_append_new(top, alts);
        json_array_append_new(off, json_integer(ch->offset ? ch->offset[i] : 0));
    }
    return json_pack("{s:o,s:o,s:o,s:o}", "tokens", tokens, "token_logprobs", lps, "top_logprobs",
                     top, "text_offset", off);
}

/* SGLang's [logprob, id, text or null]. */
static json_t *lp_triple(const gen_params *p, float lp, int32_t t) {
    return json_pack("[f,i,o]", (double)lp, t,
                     p->text_in_logprobs ? token_string(p->node, t) : json_null());
}

void gen_logprobs_generate(const gen_choice *ch, const gen_params *p, uint32_t from, uint32_t to,
                           json_t *meta) {
    if (!p->logprobs) return;
    const call *c = ch->c;
    json_t *out = json_array(), *top = json_array();
    for (uint32_t i = from; i < to; i++) {
        json_array_append_new(out, lp_triple(p, c->logprobs[i], c->tokens[i]));
        json_t *alts = json_array();
        for (uint32_t r = 0; r < tops(c, i); r++)
            json_array_append_new(alts, lp_triple(p, top_lp(c, i, r), top_token(c, i, r)));
        json_array_append_new(top, alts);
    }
    json_object_set_new(meta, "output_token_logprobs", out);
    json_object_set_new(meta, "output_top_logprobs", top);
}
