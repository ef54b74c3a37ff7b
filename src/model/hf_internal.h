/*
 * hf_internal.h — the loaded form of a tokenizer.json, shared by the loader
 * (hf_tokenizer.c) and the encoder (hf_encode.c). Nothing here is public.
 *
 * Invariants once pd_hf_tokenizer_load returns:
 *   T1 every id in [0, n_ids) with text != NULL is in vocab_ix under
 *      pd_hash_str(text), unless an earlier id holds the same text;
 *   T2 byte_id[b] is the id of the one-character token of byte b's
 *      byte-level character, for all 256 bytes;
 *   T3 every merge's left, right and merged ids are ids with text.
 */
#ifndef PD_HF_INTERNAL_H
#define PD_HF_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "pdserve/hf_tokenizer.h"
#include "pdserve/index.h"

#define HF_IDS_MAX (1u << 24) /* ids above this are refused */
#define HF_TEMPLATE_MAX 8u    /* post-processor ids before / after the text */
#define HF_ADDED_MAX 65536u   /* added tokens */

typedef struct hf_token {
    char *text;     /* tokenizer.json spelling, NUL-terminated; NULL: a hole */
    uint8_t *bytes; /* what decoding emits (the ByteLevel decoder's rule) */
    uint32_t n_bytes;
    bool special;
} hf_token;

typedef struct hf_merge {
    int32_t left, right, merged;
    uint32_t rank;
} hf_merge;

typedef struct hf_added {
    const char *content; /* tokens[id].text */
    uint32_t len;
    int32_t id;
    bool lstrip, rstrip, single_word;
} hf_added;

struct pd_hf_tokenizer {
    hf_token *tokens;
    uint32_t n_ids;
    pd_index vocab_ix;
    hf_merge *merges;
    uint32_t n_merges;
    pd_index merge_ix;
    hf_added *added;
    uint32_t n_added;
    bool added_first[256]; /* some added token starts with this byte */
    int32_t byte_id[256];
    char byte_char[256][3]; /* byte-level character of each byte, UTF-8 */
    uint8_t byte_char_len[256];
    bool nfc;
    bool ignore_merges;
    pcre2_code *re;
    int32_t prefix[HF_TEMPLATE_MAX], suffix[HF_TEMPLATE_MAX];
    uint32_t n_prefix, n_suffix;
    int32_t bos, eos;
};

/* Length of the valid UTF-8 sequence at s[0..n) (1 to 4), or 0 if the
 * bytes there do not start one (overlong, surrogate, > U+10FFFF, cut). */
uint32_t hf_utf8_len(const uint8_t *s, size_t n);
/* True when s[0..n) (n < the lead byte's length) can still become valid. */
bool hf_utf8_incomplete(const uint8_t *s, size_t n);

int32_t hf_vocab_find(const pd_hf_tokenizer *tok, const char *text);
/* Compiles the pre-tokenizer's Split pattern into tok->re (hf_encode.c). */
pd_err hf_compile_split(pd_hf_tokenizer *tok, const char *pattern, char *msg, size_t cap);
/* The merge of (left, right), or NULL. */
const hf_merge *hf_merge_find(const pd_hf_tokenizer *tok, int32_t left, int32_t right);

#endif /* PD_HF_INTERNAL_H */
