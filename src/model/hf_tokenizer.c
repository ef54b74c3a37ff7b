/*
 * hf_tokenizer.c — loading a Hugging Face tokenizer.json, id lookups,
 * decoding and the streaming decoder. Encoding is in hf_encode.c.
 *
 * The loader is strict in one direction only: every field that changes how
 * text is cut or merged is either understood or refused by name (model type,
 * normalizer, pre-tokenizer, decoder, post-processor, BPE options). Fields
 * that only matter to training or to offsets (truncation, padding,
 * trim_offsets) are ignored. The file is input from outside: sizes are
 * bounded before anything is allocated from them (HF_IDS_MAX, HF_ADDED_MAX).
 */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hf_internal.h"

/* ---- UTF-8 ------------------------------------------------------------------- */

static uint32_t utf8_need(uint8_t lead) {
    if (lead < 0x80) return 1;
    if (lead >= 0xC2 && lead <= 0xDF) return 2;
    if (lead >= 0xE0 && lead <= 0xEF) return 3;
    if (lead >= 0xF0 && lead <= 0xF4) return 4;
    return 0;
}

/* Whether byte c may stand at position i (>= 1) of a sequence led by lead. */
static bool utf8_cont_ok(uint8_t lead, uint32_t i, uint8_t c) {
    if (i == 1) {
        if (lead == 0xE0) return c >= 0xA0 && c <= 0xBF;
        if (lead == 0xED) return c >= 0x80 && c <= 0x9F;
        if (lead == 0xF0) return c >= 0x90 && c <= 0xBF;
        if (lead == 0xF4) return c >= 0x80 && c <= 0x8F;
    }
    return c >= 0x80 && c <= 0xBF;
}

uint32_t hf_utf8_len(const uint8_t *s, size_t n) {
    PD_ASSERT(n > 0);
    uint32_t need = utf8_need(s[0]);
    if (need == 0 || need > n) return 0;
    for (uint32_t i = 1; i < need; i++)
        if (!utf8_cont_ok(s[0], i, s[i])) return 0;
    return need;
}

bool hf_utf8_incomplete(const uint8_t *s, size_t n) {
    if (n == 0) return false;
    uint32_t need = utf8_need(s[0]);
    if (need <= n) return false;
    for (uint32_t i = 1; i < n; i++)
        if (!utf8_cont_ok(s[0], (uint32_t)i, s[i])) return false;
    return true;
}

/* ---- the byte-level alphabet (GPT-2's bytes_to_unicode) ---------------------- */

static bool byte_is_printable(uint32_t b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

/* Printable bytes stand for themselves; the other 68 take code points from
 * U+0100 up, in byte order. All are below U+0800, so two UTF-8 bytes at most. */
static void byte_alphabet_init(pd_hf_tokenizer *tok) {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; b++) {
        uint32_t cp = byte_is_printable(b) ? b : next++;
        if (cp < 0x80) {
            tok->byte_char[b][0] = (char)cp;
            tok->byte_char_len[b] = 1;
        } else {
            tok->byte_char[b][0] = (char)(0xC0 | (cp >> 6));
            tok->byte_char[b][1] = (char)(0x80 | (cp & 0x3F));
            tok->byte_char_len[b] = 2;
        }
    }
    PD_ASSERT(next == 256 + 68);
}

/* The byte a byte-level code point stands for, or -1. */
static int char_to_byte(uint32_t cp) {
    if (cp < 256) return byte_is_printable(cp) ? (int)cp : -1;
    if (cp >= 256 + 68) return -1;
    uint32_t k = cp - 256, b = 0;
    for (;; b++) {
        if (byte_is_printable(b)) continue;
        if (k-- == 0) return (int)b;
    }
}

/* The ByteLevel decoder's rule: a token all of whose characters are in the
 * alphabet decodes to their bytes; any other token to its own UTF-8. */
static pd_err token_bytes_init(hf_token *t) {
    size_t n = strlen(t->text);
    t->bytes = malloc(n + 1);
    if (!t->bytes) return PD_ERR_NOMEM;
    const uint8_t *s = (const uint8_t *)t->text;
    uint32_t out = 0;
    for (size_t i = 0; i < n;) {
        uint32_t len = hf_utf8_len(s + i, n - i);
        uint32_t cp = 0;
        if (len == 1) cp = s[i];
        if (len == 2) cp = ((uint32_t)(s[i] & 0x1F) << 6) | (s[i + 1] & 0x3F);
        int b = len == 1 || len == 2 ? char_to_byte(cp) : -1;
        if (b < 0) {
            memcpy(t->bytes, s, n);
            t->n_bytes = (uint32_t)n;
            return PD_OK;
        }
        t->bytes[out++] = (uint8_t)b;
        i += len;
    }
    t->n_bytes = out;
    return PD_OK;
}

/* ---- hashes -------------------------------------------------------------------- */

static uint64_t vocab_hash_of(const void *ctx, uint32_t id) {
    const pd_hf_tokenizer *tok = ctx;
    return pd_hash_str(tok->tokens[id].text);
}

static uint64_t pair_hash(int32_t left, int32_t right) {
    return pd_hash_u64(((uint64_t)(uint32_t)left << 32) | (uint32_t)right);
}

static uint64_t merge_hash_of(const void *ctx, uint32_t i) {
    const pd_hf_tokenizer *tok = ctx;
    return pair_hash(tok->merges[i].left, tok->merges[i].right);
}

int32_t hf_vocab_find(const pd_hf_tokenizer *tok, const char *text) {
    pd_index_probe p;
    for (uint32_t v = pd_index_first(&tok->vocab_ix, pd_hash_str(text), &p); v != PD_NONE;
         v = pd_index_next(&tok->vocab_ix, &p))
        if (!strcmp(tok->tokens[v].text, text)) return (int32_t)v;
    return -1;
}

const hf_merge *hf_merge_find(const pd_hf_tokenizer *tok, int32_t left, int32_t right) {
    pd_index_probe p;
    for (uint32_t v = pd_index_first(&tok->merge_ix, pair_hash(left, right), &p); v != PD_NONE;
         v = pd_index_next(&tok->merge_ix, &p))
        if (tok->merges[v].left == left && tok->merges[v].right == right) return &tok->merges[v];
    return NULL;
}

/* ---- model: vocab and merges ---------------------------------------------------- */

/* Ids are one past the largest of the vocab's and the added tokens'. */
static pd_err count_ids(const json_t *vocab, const json_t *added, uint32_t *n_ids, char *msg,
                        size_t cap) {
    json_int_t max = -1;
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)vocab, key, v) {
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) >= HF_IDS_MAX)
            return pd_errorf(msg, cap, PD_ERR_PARSE, "model.vocab[\"%s\"]: not an id in [0, %u)",
                             key, HF_IDS_MAX);
        if (json_integer_value(v) > max) max = json_integer_value(v);
    }
    size_t i;
    json_array_foreach(added, i, v) {
        const json_t *id = json_object_get(v, "id");
        if (!json_is_integer(id) || json_integer_value(id) < 0 ||
            json_integer_value(id) >= HF_IDS_MAX)
            return pd_errorf(msg, cap, PD_ERR_PARSE, "added_tokens[%zu].id: not an id in [0, %u)",
                             i, HF_IDS_MAX);
        if (json_integer_value(id) > max) max = json_integer_value(id);
    }
    if (max < 0) return pd_errorf(msg, cap, PD_ERR_INVALID, "the vocabulary is empty");
    *n_ids = (uint32_t)max + 1;
    return PD_OK;
}

/* Gives id its text (a copy) and indexes it, keeping the first id of a text. */
static pd_err set_token(pd_hf_tokenizer *tok, uint32_t id, const char *text, char *msg,
                        size_t cap) {
    PD_ASSERT(id < tok->n_ids);
    hf_token *t = &tok->tokens[id];
    if (t->text) {
        if (!strcmp(t->text, text)) return PD_OK;
        return pd_errorf(msg, cap, PD_ERR_INVALID, "id %u is both \"%s\" and \"%s\"", id, t->text,
                         text);
    }
    if (strlen(text) > PD_HF_TOKEN_BYTES_MAX)
        return pd_errorf(msg, cap, PD_ERR_TOOBIG, "token %u is longer than %u bytes", id,
                         PD_HF_TOKEN_BYTES_MAX);
    t->text = strdup(text);
    if (!t->text) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    if (token_bytes_init(t) != PD_OK) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    if (hf_vocab_find(tok, text) < 0) pd_index_insert(&tok->vocab_ix, pd_hash_str(text), id);
    return PD_OK;
}

static pd_err load_vocab(pd_hf_tokenizer *tok, const json_t *vocab, char *msg, size_t cap) {
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)vocab, key, v) {
        pd_err err = set_token(tok, (uint32_t)json_integer_value(v), key, msg, cap);
        if (err) return err;
    }
    for (uint32_t b = 0; b < 256; b++) {
        char s[4] = {0};
        memcpy(s, tok->byte_char[b], tok->byte_char_len[b]);
        tok->byte_id[b] = hf_vocab_find(tok, s);
        if (tok->byte_id[b] < 0)
            return pd_errorf(msg, cap, PD_ERR_INVALID,
                             "not a byte-level vocabulary: no token for byte 0x%02x (\"%s\")", b,
                             s);
    }
    return PD_OK;
}

/* A merge as "left right" (older files) or ["left", "right"] (newer ones). */
static pd_err merge_parts(const json_t *m, size_t i, const char **l, size_t *ll, const char **r,
                          char *msg, size_t cap) {
    if (json_is_string(m)) {
        const char *s = json_string_value(m);
        const char *sp = strchr(s, ' ');
        if (!sp || sp == s || !sp[1] || strchr(sp + 1, ' '))
            return pd_errorf(msg, cap, PD_ERR_PARSE, "model.merges[%zu]: \"%s\" is not \"a b\"", i,
                             s);
        *l = s, *ll = (size_t)(sp - s), *r = sp + 1;
        return PD_OK;
    }
    if (json_is_array(m) && json_array_size(m) == 2 && json_is_string(json_array_get(m, 0)) &&
        json_is_string(json_array_get(m, 1))) {
        *l = json_string_value(json_array_get(m, 0));
        *ll = strlen(*l);
        *r = json_string_value(json_array_get(m, 1));
        return PD_OK;
    }
    return pd_errorf(msg, cap, PD_ERR_PARSE, "model.merges[%zu]: not \"a b\" nor [\"a\", \"b\"]",
                     i);
}

static pd_err load_merge(pd_hf_tokenizer *tok, const json_t *m, size_t i, char *msg, size_t cap) {
    const char *l = NULL, *r = NULL;
    size_t ll = 0;
    pd_err err = merge_parts(m, i, &l, &ll, &r, msg, cap);
    if (err) return err;
    size_t rl = strlen(r);
    char *both = malloc(ll + rl + 1);
    if (!both) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    memcpy(both, l, ll);
    both[ll] = 0;
    int32_t left = hf_vocab_find(tok, both);
    memcpy(both + ll, r, rl + 1);
    int32_t merged = hf_vocab_find(tok, both);
    int32_t right = hf_vocab_find(tok, r);
    free(both);
    if (left < 0 || right < 0 || merged < 0)
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "model.merges[%zu]: a part or the merged token is not in the vocab", i);
    const hf_merge *dup = hf_merge_find(tok, left, right);
    if (dup) { /* the references build a map from the list: the last rank wins */
        tok->merges[dup - tok->merges].rank = (uint32_t)i;
        return PD_OK;
    }
    tok->merges[tok->n_merges] = (hf_merge){left, right, merged, (uint32_t)i};
    pd_index_insert(&tok->merge_ix, pair_hash(left, right), tok->n_merges++);
    return PD_OK;
}

static pd_err load_merges(pd_hf_tokenizer *tok, const json_t *merges, char *msg, size_t cap) {
    if (!json_is_array(merges))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "model.merges is missing or not an array");
    size_t n = json_array_size(merges);
    if (n >= HF_IDS_MAX)
        return pd_errorf(msg, cap, PD_ERR_TOOBIG, "model.merges: %zu merges (at most %u)", n,
                         HF_IDS_MAX - 1);
    tok->merges = calloc(n ? n : 1, sizeof(*tok->merges));
    if (!tok->merges) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    if (pd_index_init(&tok->merge_ix, (uint32_t)(n ? n : 1), merge_hash_of, tok) != PD_OK)
        return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < n; i++) {
        pd_err err = load_merge(tok, json_array_get(merges, i), i, msg, cap);
        if (err) return err;
    }
    return PD_OK;
}

/* ---- options that change the ids: accepted or refused by name ----------------- */

static const char *type_of(const json_t *o) {
    const json_t *t = json_object_get(o, "type");
    return json_is_string(t) ? json_string_value(t) : NULL;
}

/* A field that must be absent, null, false, 0 or "" (an option not implemented). */
static bool is_off(const json_t *v) {
    return !v || json_is_null(v) || json_is_false(v) ||
        (json_is_number(v) && json_number_value(v) == 0) ||
        (json_is_string(v) && json_string_length(v) == 0);
}

static pd_err check_model(pd_hf_tokenizer *tok, const json_t *model, char *msg, size_t cap) {
    if (!json_is_object(model))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "\"model\" is missing or not an object");
    const char *type = type_of(model);
    if (type && strcmp(type, "BPE"))
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "model type %s is not supported (only byte-level BPE; "
                         "SentencePiece/Unigram and WordPiece tokenizers are refused)",
                         type);
    static const char *const off[] = {"dropout", "byte_fallback", "continuing_subword_prefix",
                                      "end_of_word_suffix"};
    for (size_t i = 0; i < PD_ARRAY_LEN(off); i++)
        if (!is_off(json_object_get(model, off[i])))
            return pd_errorf(msg, cap, PD_ERR_INVALID, "model.%s is set: not supported", off[i]);
    if (!json_is_object(json_object_get(model, "vocab")))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "model.vocab is missing or not an object");
    tok->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    return PD_OK;
}

static pd_err check_normalizer(pd_hf_tokenizer *tok, const json_t *n, char *msg, size_t cap) {
    if (!n || json_is_null(n)) return PD_OK;
    const char *type = type_of(n);
    if (type && !strcmp(type, "NFC")) {
        tok->nfc = true;
        return PD_OK;
    }
    const json_t *list = json_object_get(n, "normalizers");
    if (type && !strcmp(type, "Sequence") && json_is_array(list) && json_array_size(list) == 0)
        return PD_OK;
    return pd_errorf(msg, cap, PD_ERR_INVALID, "normalizer %s is not supported (none or NFC)",
                     type ? type : "(untyped)");
}

static pd_err check_byte_level(const json_t *bl, bool want_regex, char *msg, size_t cap) {
    if (json_is_true(json_object_get(bl, "add_prefix_space")))
        return pd_errorf(msg, cap, PD_ERR_INVALID, "ByteLevel add_prefix_space: not supported");
    bool use_regex = !json_is_false(json_object_get(bl, "use_regex"));
    if (use_regex != want_regex)
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "ByteLevel use_regex %s after a Split: not supported",
                         use_regex ? "true" : "false");
    return PD_OK;
}

static pd_err check_split(pd_hf_tokenizer *tok, const json_t *split, char *msg, size_t cap) {
    const json_t *pat = json_object_get(json_object_get(split, "pattern"), "Regex");
    const json_t *behavior = json_object_get(split, "behavior");
    if (!json_is_string(pat))
        return pd_errorf(msg, cap, PD_ERR_INVALID, "Split pattern: only {\"Regex\": ...}");
    if (!json_is_string(behavior) || strcmp(json_string_value(behavior), "Isolated"))
        return pd_errorf(msg, cap, PD_ERR_INVALID, "Split behavior: only Isolated");
    if (json_is_true(json_object_get(split, "invert")))
        return pd_errorf(msg, cap, PD_ERR_INVALID, "Split invert: not supported");
    return hf_compile_split(tok, json_string_value(pat), msg, cap);
}

/* GPT-2's pattern: what ByteLevel with use_regex true splits by. */
static const char gpt2_pattern[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

static pd_err check_pre_tokenizer(pd_hf_tokenizer *tok, const json_t *p, char *msg, size_t cap) {
    const char *type = p ? type_of(p) : NULL;
    if (type && !strcmp(type, "ByteLevel")) {
        pd_err err = check_byte_level(p, true, msg, cap);
        return err ? err : hf_compile_split(tok, gpt2_pattern, msg, cap);
    }
    const json_t *list = json_object_get(p, "pretokenizers");
    if (type && !strcmp(type, "Sequence") && json_is_array(list) && json_array_size(list) == 2) {
        const json_t *split = json_array_get(list, 0), *bl = json_array_get(list, 1);
        const char *t0 = type_of(split), *t1 = type_of(bl);
        if (t0 && t1 && !strcmp(t0, "Split") && !strcmp(t1, "ByteLevel")) {
            pd_err err = check_byte_level(bl, false, msg, cap);
            return err ? err : check_split(tok, split, msg, cap);
        }
    }
    return pd_errorf(msg, cap, PD_ERR_INVALID,
                     "pre_tokenizer %s is not supported (ByteLevel, or a Sequence of a regex "
                     "Split and ByteLevel)",
                     type ? type : "(none)");
}

static pd_err check_decoder(const json_t *d, char *msg, size_t cap) {
    const char *type = d ? type_of(d) : NULL;
    if (!d || json_is_null(d) || (type && !strcmp(type, "ByteLevel"))) return PD_OK;
    return pd_errorf(msg, cap, PD_ERR_INVALID, "decoder %s is not supported (ByteLevel)",
                     type ? type : "(untyped)");
}

/* ---- post-processor: the ids add_special puts around the text ------------------ */

static pd_err template_piece(pd_hf_tokenizer *tok, const json_t *tp, const json_t *item,
                             bool *seen_a, char *msg, size_t cap) {
    if (json_object_get(item, "Sequence")) {
        if (*seen_a) return pd_errorf(msg, cap, PD_ERR_INVALID, "template: two sequences");
        *seen_a = true;
        return PD_OK;
    }
    const json_t *name = json_object_get(json_object_get(item, "SpecialToken"), "id");
    const json_t *spec = json_object_get(json_object_get(tp, "special_tokens"),
                                         json_is_string(name) ? json_string_value(name) : "");
    const json_t *ids = json_object_get(spec, "ids");
    if (!json_is_array(ids))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "post_processor: a template piece is unknown");
    size_t i;
    const json_t *id;
    json_array_foreach(ids, i, id) {
        int32_t *list = *seen_a ? tok->suffix : tok->prefix;
        uint32_t *n = *seen_a ? &tok->n_suffix : &tok->n_prefix;
        if (!json_is_integer(id) || json_integer_value(id) < 0 ||
            json_integer_value(id) >= tok->n_ids || *n >= HF_TEMPLATE_MAX)
            return pd_errorf(msg, cap, PD_ERR_INVALID, "post_processor: a bad special id");
        list[(*n)++] = (int32_t)json_integer_value(id);
    }
    return PD_OK;
}

static pd_err check_one_post(pd_hf_tokenizer *tok, const json_t *p, char *msg, size_t cap) {
    const char *type = type_of(p);
    if (type && !strcmp(type, "ByteLevel")) return PD_OK;
    if (!type || strcmp(type, "TemplateProcessing"))
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "post_processor %s is not supported (ByteLevel, TemplateProcessing)",
                         type ? type : "(untyped)");
    const json_t *single = json_object_get(p, "single");
    if (!json_is_array(single))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "TemplateProcessing.single is not an array");
    bool seen_a = false;
    size_t i;
    const json_t *item;
    json_array_foreach(single, i, item) {
        pd_err err = template_piece(tok, p, item, &seen_a, msg, cap);
        if (err) return err;
    }
    return PD_OK;
}

static pd_err check_post(pd_hf_tokenizer *tok, const json_t *p, char *msg, size_t cap) {
    if (!p || json_is_null(p)) return PD_OK;
    const char *type = type_of(p);
    const json_t *list = json_object_get(p, "processors");
    if (!type || strcmp(type, "Sequence")) return check_one_post(tok, p, msg, cap);
    if (!json_is_array(list))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "post_processor.processors is not an array");
    size_t i;
    const json_t *item;
    json_array_foreach(list, i, item) {
        pd_err err = check_one_post(tok, item, msg, cap);
        if (err) return err;
    }
    return PD_OK;
}

/* ---- added tokens --------------------------------------------------------------- */

static pd_err load_added(pd_hf_tokenizer *tok, const json_t *added, char *msg, size_t cap) {
    size_t n = json_array_size(added), i;
    const json_t *a;
    if (n > HF_ADDED_MAX)
        return pd_errorf(msg, cap, PD_ERR_TOOBIG, "%zu added tokens (at most %u)", n, HF_ADDED_MAX);
    tok->added = calloc(n ? n : 1, sizeof(*tok->added));
    if (!tok->added) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    json_array_foreach(added, i, a) {
        const json_t *content = json_object_get(a, "content");
        if (!json_is_string(content) || json_string_length(content) == 0 ||
            strlen(json_string_value(content)) != json_string_length(content))
            return pd_errorf(msg, cap, PD_ERR_PARSE,
                             "added_tokens[%zu].content: not a non-empty string without NUL", i);
        uint32_t id = (uint32_t)json_integer_value(json_object_get(a, "id"));
        pd_err err = set_token(tok, id, json_string_value(content), msg, cap);
        if (err) return err;
        tok->tokens[id].special = json_is_true(json_object_get(a, "special"));
        tok->added_first[(uint8_t)json_string_value(content)[0]] = true;
        tok->added[tok->n_added++] = (hf_added){
            .content = tok->tokens[id].text,
            .len = (uint32_t)json_string_length(content),
            .id = (int32_t)id,
            .lstrip = json_is_true(json_object_get(a, "lstrip")),
            .rstrip = json_is_true(json_object_get(a, "rstrip")),
            .single_word = json_is_true(json_object_get(a, "single_word")),
        };
    }
    return PD_OK;
}

/* ---- load ------------------------------------------------------------------------ */

static pd_err alloc_ids(pd_hf_tokenizer *tok, const json_t *vocab, const json_t *added, char *msg,
                        size_t cap) {
    pd_err err = count_ids(vocab, added, &tok->n_ids, msg, cap);
    if (err) return err;
    tok->tokens = calloc(tok->n_ids, sizeof(*tok->tokens));
    if (!tok->tokens) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    uint32_t entries = (uint32_t)(json_object_size(vocab) + json_array_size(added));
    if (pd_index_init(&tok->vocab_ix, entries ? entries : 1, vocab_hash_of, tok) != PD_OK)
        return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    return PD_OK;
}

static pd_err load_root(pd_hf_tokenizer *tok, const json_t *root, char *msg, size_t cap) {
    if (!json_is_object(root))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "tokenizer.json is not a JSON object");
    const json_t *model = json_object_get(root, "model");
    const json_t *added = json_object_get(root, "added_tokens");
    if (added && !json_is_null(added) && !json_is_array(added))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "added_tokens is not an array");
    pd_err err = check_model(tok, model, msg, cap);
    if (!err) err = check_normalizer(tok, json_object_get(root, "normalizer"), msg, cap);
    if (!err) err = check_pre_tokenizer(tok, json_object_get(root, "pre_tokenizer"), msg, cap);
    if (!err) err = check_decoder(json_object_get(root, "decoder"), msg, cap);
    if (!err) err = alloc_ids(tok, json_object_get(model, "vocab"), added, msg, cap);
    if (!err) err = load_vocab(tok, json_object_get(model, "vocab"), msg, cap);
    if (!err) err = load_added(tok, added, msg, cap);
    if (!err) err = load_merges(tok, json_object_get(model, "merges"), msg, cap);
    if (!err) err = check_post(tok, json_object_get(root, "post_processor"), msg, cap);
    return err;
}

pd_err pd_hf_tokenizer_load_buf(const char *json, size_t len, pd_hf_tokenizer **out, char *msg,
                                size_t msg_cap) {
    PD_ASSERT(out != NULL);
    *out = NULL;
    json_error_t jerr;
    json_t *root = json_loadb(json, len, 0, &jerr);
    if (!root)
        return pd_errorf(msg, msg_cap, PD_ERR_PARSE, "tokenizer.json: line %d: %s", jerr.line,
                         jerr.text);
    pd_hf_tokenizer *tok = calloc(1, sizeof(*tok));
    if (!tok) {
        json_decref(root);
        return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    }
    tok->bos = tok->eos = -1;
    byte_alphabet_init(tok);
    pd_err err = load_root(tok, root, msg, msg_cap);
    json_decref(root);
    if (err) {
        pd_hf_tokenizer_free(tok);
        return err;
    }
    *out = tok;
    return PD_OK;
}

static pd_err read_file(const char *path, char **buf, size_t *len, char *msg, size_t cap) {
    FILE *f = fopen(path, "rb");
    if (!f) return pd_errorf(msg, cap, PD_ERR_IO, "%s: cannot open", path);
    long n = fseek(f, 0, SEEK_END) == 0 ? ftell(f) : -1;
    if (n < 0 || fseek(f, 0, SEEK_SET) != 0) {
        fclose(f);
        return pd_errorf(msg, cap, PD_ERR_IO, "%s: cannot read", path);
    }
    *buf = malloc((size_t)n + 1);
    size_t got = *buf ? fread(*buf, 1, (size_t)n, f) : 0;
    fclose(f);
    if (!*buf || got != (size_t)n) {
        free(*buf);
        *buf = NULL;
        return pd_errorf(msg, cap, PD_ERR_IO, "%s: short read", path);
    }
    *len = (size_t)n;
    return PD_OK;
}

pd_err pd_hf_tokenizer_load(const char *path, pd_hf_tokenizer **out, char *msg, size_t msg_cap) {
    char *buf = NULL;
    size_t len = 0;
    *out = NULL;
    pd_err err = read_file(path, &buf, &len, msg, msg_cap);
    if (err) return err;
    err = pd_hf_tokenizer_load_buf(buf, len, out, msg, msg_cap);
    free(buf);
    return err;
}

static pd_err config_token(const pd_hf_tokenizer *tok, const json_t *root, const char *key,
                           int32_t *id, char *msg, size_t cap) {
    const json_t *v = json_object_get(root, key);
    if (json_is_object(v)) v = json_object_get(v, "content");
    if (!v || json_is_null(v)) return PD_OK;
    if (!json_is_string(v))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "tokenizer_config.json: %s is not a string", key);
    *id = hf_vocab_find(tok, json_string_value(v));
    if (*id < 0)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "tokenizer_config.json: %s \"%s\" is no token",
                         key, json_string_value(v));
    return PD_OK;
}

pd_err pd_hf_tokenizer_load_dir(const char *dir, uint32_t model_vocab, pd_hf_tokenizer **out,
                                char *msg, size_t cap) {
    char path[4096];
    *out = NULL;
    int n = snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    if (n < 0 || (size_t)n >= sizeof path)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "model directory path too long");
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    FILE *f = fopen(path, "rb");
    if (!f) {
        /* A SentencePiece-only checkpoint must not fall back to bytes. */
        snprintf(path, sizeof path, "%s/tokenizer.model", dir);
        f = fopen(path, "rb");
        if (!f) return PD_OK; /* no tokenizer: the byte tokenizer */
        fclose(f);
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "%s has tokenizer.model (SentencePiece), which pdserve does not read; "
                         "it needs tokenizer.json (a byte-level BPE tokenizer, as transformers' "
                         "save_pretrained writes for a fast tokenizer)",
                         dir);
    }
    fclose(f);
    pd_hf_tokenizer *tok = NULL;
    pd_err err = pd_hf_tokenizer_load(path, &tok, msg, cap);
    snprintf(path, sizeof path, "%s/tokenizer_config.json", dir);
    f = err ? NULL : fopen(path, "rb");
    if (f) {
        fclose(f);
        err = pd_hf_tokenizer_load_config(tok, path, msg, cap);
    }
    if (!err && pd_hf_tokenizer_vocab_size(tok) > model_vocab)
        err = pd_errorf(msg, cap, PD_ERR_INVALID,
                        "%s/tokenizer.json has ids up to %u, more than the model's vocab_size %u",
                        dir, pd_hf_tokenizer_vocab_size(tok), model_vocab);
    if (err) {
        pd_hf_tokenizer_free(tok);
        return err;
    }
    *out = tok;
    return PD_OK;
}

pd_err pd_hf_tokenizer_load_config(pd_hf_tokenizer *tok, const char *path, char *msg,
                                   size_t msg_cap) {
    json_error_t jerr;
    /* Integers as reals: Llama-3's model_max_length is 1e30 written out,
     * which no 64-bit integer holds, and only the strings matter here. */
    json_t *root = json_load_file(path, JSON_DECODE_INT_AS_REAL, &jerr);
    if (!root)
        return pd_errorf(msg, msg_cap, PD_ERR_PARSE, "%s: line %d: %s", path, jerr.line, jerr.text);
    pd_err err = json_is_object(root)
        ? PD_OK
        : pd_errorf(msg, msg_cap, PD_ERR_PARSE, "%s: not a JSON object", path);
    if (!err) err = config_token(tok, root, "bos_token", &tok->bos, msg, msg_cap);
    if (!err) err = config_token(tok, root, "eos_token", &tok->eos, msg, msg_cap);
    json_decref(root);
    return err;
}

void pd_hf_tokenizer_free(pd_hf_tokenizer *tok) {
    if (!tok) return;
    for (uint32_t i = 0; tok->tokens && i < tok->n_ids; i++) {
        free(tok->tokens[i].text);
        free(tok->tokens[i].bytes);
    }
    free(tok->tokens);
    free(tok->merges);
    free(tok->added);
    pd_index_free(&tok->vocab_ix);
    pd_index_free(&tok->merge_ix);
    pcre2_code_free(tok->re);
    free(tok);
}

/* ---- lookups ---------------------------------------------------------------------- */

uint32_t pd_hf_tokenizer_vocab_size(const pd_hf_tokenizer *tok) { return tok->n_ids; }

int32_t pd_hf_tokenizer_token_id(const pd_hf_tokenizer *tok, const char *token, size_t len) {
    char *s = malloc(len + 1);
    if (!s || memchr(token, 0, len)) {
        free(s);
        return -1;
    }
    memcpy(s, token, len);
    s[len] = 0;
    int32_t id = hf_vocab_find(tok, s);
    free(s);
    return id;
}

static const hf_token *token_at(const pd_hf_tokenizer *tok, int32_t id) {
    if (id < 0 || (uint32_t)id >= tok->n_ids || !tok->tokens[id].text) return NULL;
    return &tok->tokens[id];
}

const char *pd_hf_tokenizer_token(const pd_hf_tokenizer *tok, int32_t id) {
    const hf_token *t = token_at(tok, id);
    return t ? t->text : NULL;
}

bool pd_hf_tokenizer_is_special(const pd_hf_tokenizer *tok, int32_t id) {
    const hf_token *t = token_at(tok, id);
    return t && t->special;
}

int32_t pd_hf_tokenizer_bos(const pd_hf_tokenizer *tok) { return tok->bos; }
int32_t pd_hf_tokenizer_eos(const pd_hf_tokenizer *tok) { return tok->eos; }

/* ---- decoding ---------------------------------------------------------------------- */

pd_err pd_hf_tokenizer_decode(const pd_hf_tokenizer *tok, const int32_t *ids, size_t n_ids,
                              bool skip_special, char **out, size_t *out_len, char *msg,
                              size_t msg_cap) {
    *out = NULL;
    *out_len = 0;
    size_t total = 0;
    for (size_t i = 0; i < n_ids; i++) {
        const hf_token *t = token_at(tok, ids[i]);
        if (!t)
            return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "ids[%zu] = %d: no such token", i,
                             (int)ids[i]);
        total += skip_special && t->special ? 0 : t->n_bytes;
    }
    char *s = malloc(total + 1);
    if (!s) return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    size_t len = 0;
    for (size_t i = 0; i < n_ids; i++) {
        const hf_token *t = &tok->tokens[ids[i]];
        if (skip_special && t->special) continue;
        memcpy(s + len, t->bytes, t->n_bytes);
        len += t->n_bytes;
    }
    PD_ASSERT(len == total);
    s[len] = 0;
    *out = s;
    *out_len = len;
    return PD_OK;
}

void pd_hf_stream_init(pd_hf_stream *s, const pd_hf_tokenizer *tok, bool skip_special) {
    memset(s, 0, sizeof(*s));
    s->tok = tok;
    s->skip_special = skip_special;
}

/* How many trailing bytes of b[0..n) are an incomplete but still possible
 * UTF-8 sequence (0 to 3). */
static uint32_t incomplete_tail(const uint8_t *b, size_t n) {
    for (uint32_t k = 1; k <= 3 && k <= n; k++) {
        uint8_t c = b[n - k];
        if (c < 0x80 || c >= 0xC0) return hf_utf8_incomplete(b + n - k, k) ? k : 0;
    }
    return 0;
}

size_t pd_hf_stream_push(pd_hf_stream *s, int32_t id, char *out, size_t cap) {
    const hf_token *t = token_at(s->tok, id);
    if (!t || (s->skip_special && t->special)) return 0;
    PD_ASSERT(s->n_held <= 3);
    size_t n = s->n_held + t->n_bytes;
    PD_ASSERT(n <= cap);
    memcpy(out, s->held, s->n_held);
    memcpy(out + s->n_held, t->bytes, t->n_bytes);
    uint32_t keep = incomplete_tail((const uint8_t *)out, n);
    memcpy(s->held, out + n - keep, keep);
    s->n_held = keep;
    return n - keep;
}

size_t pd_hf_stream_flush(pd_hf_stream *s, char *out, size_t cap) {
    size_t n = s->n_held;
    PD_ASSERT(n <= cap);
    memcpy(out, s->held, n);
    s->n_held = 0;
    return n;
}
