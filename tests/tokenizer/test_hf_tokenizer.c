/* pd_hf_tokenizer on tokenizer.json files written here: a tiny byte-level
 * BPE (256 byte tokens and a few merges) whose ids can be worked out by hand,
 * and broken or unsupported variants of it. Each refusal must come back as
 * an error code with a message naming the problem, and no input (truncated
 * at every length) may crash the loader. Real files are compared with the
 * reference implementation by test_reference.py. */
#include <jansson.h>
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "pdserve/hf_tokenizer.h"

/* ---- fixtures -------------------------------------------------------------------- */

/* GPT-2's byte-level character of byte b, as UTF-8. */
static void byte_char(unsigned b, char out[3]) {
    unsigned n = 0, cp = b;
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    if (!printable) {
        for (unsigned c = 0; c < b; c++)
            n += !((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE));
        cp = 256 + n;
    }
    memset(out, 0, 3);
    if (cp < 0x80) {
        out[0] = (char)cp;
    } else {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
    }
}

/* Ids 0-255 are the bytes; merges (each "a b" in the byte-level alphabet)
 * get ids from 256 in order; added tokens follow. */
static json_t *tiny_json(const char *pattern, const char *const *merges, size_t n_merges) {
    json_t *vocab = json_object(), *mlist = json_array();
    for (unsigned b = 0; b < 256; b++) {
        char c[3];
        byte_char(b, c);
        json_object_set_new(vocab, c, json_integer(b));
    }
    for (size_t i = 0; i < n_merges; i++) {
        char both[64];
        const char *sp = strchr(merges[i], ' ');
        snprintf(both, sizeof(both), "%.*s%s", (int)(sp - merges[i]), merges[i], sp + 1);
        json_object_set_new(vocab, both, json_integer((json_int_t)(256 + i)));
        json_array_append_new(mlist, json_string(merges[i]));
    }
    json_t *added = json_pack("[{s:i, s:s, s:b, s:b, s:b, s:b, s:b}]", "id", 300, "content",
                              "<|im_start|>", "single_word", 0, "lstrip", 0, "rstrip", 0,
                              "normalized", 0, "special", 1);
    return json_pack("{s:o, s:n, s:{s:s, s:[{s:s, s:{s:s}, s:s, s:b}, {s:s, s:b, s:b}]},"
                     " s:{s:s}, s:n, s:{s:s, s:o, s:o}}",
                     "added_tokens", added, "normalizer", "pre_tokenizer", "type", "Sequence",
                     "pretokenizers", "type", "Split", "pattern", "Regex", pattern, "behavior",
                     "Isolated", "invert", 0, "type", "ByteLevel", "add_prefix_space", 0,
                     "use_regex", 0, "decoder", "type", "ByteLevel", "post_processor", "model",
                     "type", "BPE", "vocab", vocab, "merges", mlist);
}

static const char *const gpt_like =
    "(?i:'s|'t)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
    "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
static const char *const tiny_merges[] = {"h e", "l l", "he ll", "hell o",
                                          "Ġ w", "! Â", "! ï",   "! á"};

static pd_err load_json(json_t *j, pd_hf_tokenizer **t, char *msg, size_t cap) {
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    pd_err err = pd_hf_tokenizer_load_buf(s, strlen(s), t, msg, cap);
    free(s);
    return err;
}

static pd_hf_tokenizer *tiny(void) {
    char msg[256] = "";
    pd_hf_tokenizer *t = NULL;
    pd_err err = load_json(tiny_json(gpt_like, tiny_merges, 8), &t, msg, sizeof(msg));
    if (err) fail_msg("%s", msg);
    return t;
}

static size_t encode(const pd_hf_tokenizer *t, const char *s, int32_t *out, size_t cap) {
    char msg[256];
    int32_t *ids;
    size_t n;
    assert_int_equal(pd_hf_tokenizer_encode(t, s, strlen(s), false, &ids, &n, msg, sizeof(msg)),
                     PD_OK);
    assert_true(n <= cap);
    memcpy(out, ids, n * sizeof(*ids));
    free(ids);
    return n;
}

/* ---- behaviour ---------------------------------------------------------------------- */

static void merges_apply_by_rank_and_decode_round_trips(void **state) {
    (void)state;
    pd_hf_tokenizer *t = tiny();
    int32_t ids[64];
    size_t n = encode(t, "hello world<|im_start|>hello", ids, 64);
    int32_t want[] = {259, 260, 'o', 'r', 'l', 'd', 300, 259};
    assert_int_equal(n, 8);
    assert_memory_equal(ids, want, sizeof(want));
    char *out, msg[128];
    size_t len;
    assert_int_equal(pd_hf_tokenizer_decode(t, ids, n, false, &out, &len, msg, sizeof(msg)), 0);
    assert_string_equal(out, "hello world<|im_start|>hello");
    free(out);
    assert_int_equal(pd_hf_tokenizer_decode(t, ids, n, true, &out, &len, msg, sizeof(msg)), 0);
    assert_string_equal(out, "hello worldhello");
    free(out);
    assert_true(pd_hf_tokenizer_is_special(t, 300));
    assert_int_equal(pd_hf_tokenizer_token_id(t, "hello", 5), 259);
    assert_string_equal(pd_hf_tokenizer_token(t, 260), "Ġw");
    pd_hf_tokenizer_free(t);
}

/* \s is Unicode's White_Space, as in the Rust tokenizers crate: U+0085 is
 * a space (not in JavaScript), U+FEFF is not (it is in JavaScript), U+180E
 * is not (it is in PCRE2's own \s). A space cuts "!" from what follows; no
 * space lets the merge "! <first byte>" happen (a punctuation run takes
 * every following character that is neither space, letter nor digit). */
static void white_space_is_unicode_white_space(void **state) {
    (void)state;
    pd_hf_tokenizer *t = tiny();
    int32_t ids[16];
    assert_int_equal(encode(t, "!\xc2\x85", ids, 16), 3);     /* U+0085: cut */
    assert_int_equal(encode(t, "!\xef\xbb\xbf", ids, 16), 3); /* U+FEFF: merged */
    assert_int_equal(ids[0], 262);
    assert_int_equal(encode(t, "!\xe1\xa0\x8e", ids, 16), 3); /* U+180E: merged */
    assert_int_equal(ids[0], 263);
    pd_hf_tokenizer_free(t);
}

static void invalid_bytes_are_byte_tokens(void **state) {
    (void)state;
    pd_hf_tokenizer *t = tiny();
    int32_t ids[16];
    assert_int_equal(encode(t, "h\xffhe\xed\xa0\x80", ids, 16), 6);
    int32_t want[] = {'h', 0xff, 256, 0xed, 0xa0, 0x80};
    assert_memory_equal(ids, want, sizeof(want));
    pd_hf_tokenizer_free(t);
}

static void stream_holds_back_a_split_character(void **state) {
    (void)state;
    pd_hf_tokenizer *t = tiny();
    pd_hf_stream s;
    pd_hf_stream_init(&s, t, false);
    char out[PD_HF_TOKEN_BYTES_MAX + 4];
    const uint8_t emoji[] = {0xf0, 0x9f, 0x98, 0x80};
    for (int i = 0; i < 3; i++) assert_int_equal(pd_hf_stream_push(&s, emoji[i], out, 1028), 0);
    assert_int_equal(pd_hf_stream_push(&s, emoji[3], out, 1028), 4);
    assert_memory_equal(out, emoji, 4);
    assert_int_equal(pd_hf_stream_push(&s, 0xe2, out, 1028), 0);
    assert_int_equal(pd_hf_stream_push(&s, 'a', out, 1028), 2); /* can never complete */
    assert_int_equal(pd_hf_stream_push(&s, 0xf0, out, 1028), 0);
    assert_int_equal(pd_hf_stream_flush(&s, out, 1028), 1);
    assert_int_equal(pd_hf_stream_push(&s, 300, out, 1028), 12);    /* <|im_start|> */
    assert_int_equal(pd_hf_stream_push(&s, 1 << 30, out, 1028), 0); /* no such id */
    pd_hf_stream_init(&s, t, true);
    assert_int_equal(pd_hf_stream_push(&s, 300, out, 1028), 0); /* special, skipped */
    pd_hf_tokenizer_free(t);
}

static pd_hf_tokenizer *tiny_with(const char *key, json_t *value, const char *flag) {
    json_t *j = tiny_json(gpt_like, tiny_merges, 8);
    if (key) json_object_set_new(j, key, value);
    if (flag)
        json_object_set_new(json_array_get(json_object_get(j, "added_tokens"), 0), flag,
                            json_true());
    char msg[256] = "";
    pd_hf_tokenizer *t = NULL;
    if (load_json(j, &t, msg, sizeof(msg))) fail_msg("%s", msg);
    return t;
}

static void template_processing_adds_its_special_ids(void **state) {
    (void)state;
    json_t *post = json_pack("{s:s, s:[{s:{s:s}}, {s:{s:s}}], s:{s:{s:[i]}}}", "type",
                             "TemplateProcessing", "single", "SpecialToken", "id", "<|im_start|>",
                             "Sequence", "id", "A", "special_tokens", "<|im_start|>", "ids", 300);
    pd_hf_tokenizer *t = tiny_with("post_processor", post, NULL);
    int32_t *ids;
    size_t n;
    char msg[128];
    assert_int_equal(pd_hf_tokenizer_encode(t, "hello", 5, true, &ids, &n, msg, sizeof(msg)), 0);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], 300);
    assert_int_equal(ids[1], 259);
    free(ids);
    assert_int_equal(pd_hf_tokenizer_encode(t, "hello", 5, false, &ids, &n, msg, sizeof(msg)), 0);
    assert_int_equal(n, 1);
    free(ids);
    pd_hf_tokenizer_free(t);
}

static void added_token_flags_take_spaces_and_words(void **state) {
    (void)state;
    int32_t ids[32];
    pd_hf_tokenizer *t = tiny_with(NULL, NULL, "rstrip");
    assert_int_equal(encode(t, "<|im_start|>  hello", ids, 32), 2); /* the spaces go with it */
    pd_hf_tokenizer_free(t);
    t = tiny_with(NULL, NULL, "lstrip");
    assert_int_equal(encode(t, "hello  <|im_start|>", ids, 32), 2);
    pd_hf_tokenizer_free(t);
    t = tiny_with(NULL, NULL, "single_word");
    assert_int_equal(encode(t, "a<|im_start|>", ids, 32), 13); /* inside a word: plain text */
    assert_int_equal(encode(t, "a <|im_start|> a", ids, 32), 5);
    pd_hf_tokenizer_free(t);
}

/* A pre-token of 100,000 bytes merges in O(n log n), not O(n^2). */
static void long_pre_token_merges(void **state) {
    (void)state;
    pd_hf_tokenizer *t = tiny();
    size_t n = 100000;
    char *s = malloc(n);
    for (size_t i = 0; i < n; i++) s[i] = "hello"[i % 5];
    int32_t *ids;
    size_t n_ids;
    char msg[128];
    assert_int_equal(pd_hf_tokenizer_encode(t, s, n, false, &ids, &n_ids, msg, sizeof(msg)), 0);
    assert_int_equal(n_ids, n / 5);
    for (size_t i = 0; i < n_ids; i++) assert_int_equal(ids[i], 259);
    free(ids);
    free(s);
    pd_hf_tokenizer_free(t);
}

static pd_err config_from(pd_hf_tokenizer *t, const char *text, char *msg, size_t cap) {
    char path[] = "/tmp/pd_hf_config_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    fputs(text, f);
    fclose(f);
    pd_err err = pd_hf_tokenizer_load_config(t, path, msg, cap);
    unlink(path);
    return err;
}

static void write_file(const char *dir, const char *name, const char *text) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void remove_file(const char *dir, const char *name) {
    char path[256];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    unlink(path);
}

/* A checkpoint directory: no tokenizer at all is the byte tokenizer (NULL);
 * a SentencePiece tokenizer.model alone is refused by name rather than
 * silently replaced by bytes; tokenizer.json with its config loads, and a
 * tokenizer with more ids than the model is refused. */
static void checkpoint_directory_tokenizer(void **state) {
    (void)state;
    char dir[] = "/tmp/pd_hf_dir_XXXXXX";
    assert_non_null(mkdtemp(dir));
    char msg[512] = "";
    pd_hf_tokenizer *t = (pd_hf_tokenizer *)1;
    assert_int_equal(pd_hf_tokenizer_load_dir(dir, 1000, &t, msg, sizeof msg), PD_OK);
    assert_null(t);
    write_file(dir, "tokenizer.model", "sentencepiece bytes");
    assert_int_equal(pd_hf_tokenizer_load_dir(dir, 1000, &t, msg, sizeof msg), PD_ERR_INVALID);
    assert_null(t);
    assert_non_null(strstr(msg, "tokenizer.model (SentencePiece)"));
    assert_non_null(strstr(msg, "needs tokenizer.json"));
    json_t *j = tiny_json(gpt_like, tiny_merges, 8);
    char *text = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    write_file(dir, "tokenizer.json", text);
    free(text);
    write_file(dir, "tokenizer_config.json", "{\"eos_token\": \"hello\"}");
    assert_int_equal(pd_hf_tokenizer_load_dir(dir, 1000, &t, msg, sizeof msg), PD_OK);
    assert_non_null(t);
    assert_int_equal(pd_hf_tokenizer_eos(t), 259); /* the config was read */
    uint32_t ids = pd_hf_tokenizer_vocab_size(t);
    pd_hf_tokenizer_free(t);
    assert_int_equal(pd_hf_tokenizer_load_dir(dir, ids - 1, &t, msg, sizeof msg), PD_ERR_INVALID);
    assert_null(t);
    assert_non_null(strstr(msg, "more than the model's vocab_size"));
    remove_file(dir, "tokenizer.json");
    remove_file(dir, "tokenizer_config.json");
    remove_file(dir, "tokenizer.model");
    rmdir(dir);
}

/* bos_token / eos_token: a string, an {"content": ...} object or null; a
 * huge integer elsewhere in the file (Llama-3's model_max_length) is fine. */
static void config_names_bos_and_eos(void **state) {
    (void)state;
    pd_hf_tokenizer *t = tiny();
    char msg[256];
    assert_int_equal(pd_hf_tokenizer_bos(t), -1);
    assert_int_equal(config_from(t,
                                 "{\"bos_token\": {\"content\": \"<|im_start|>\"}, \"eos_token\":"
                                 " \"hello\", \"model_max_length\": "
                                 "1000000000000000019884624838656}",
                                 msg, sizeof(msg)),
                     PD_OK);
    assert_int_equal(pd_hf_tokenizer_bos(t), 300);
    assert_int_equal(pd_hf_tokenizer_eos(t), 259);
    assert_int_equal(config_from(t, "{\"eos_token\": \"<nope>\"}", msg, sizeof(msg)),
                     PD_ERR_INVALID);
    assert_non_null(strstr(msg, "<nope>"));
    assert_int_equal(config_from(t, "{\"eos_token\": 3", msg, sizeof(msg)), PD_ERR_PARSE);
    pd_hf_tokenizer_free(t);
}

/* ---- refusals ------------------------------------------------------------------------ */

static void expect_refusal(json_t *j, pd_err want, const char *needle) {
    char msg[512] = "";
    pd_hf_tokenizer *t = (pd_hf_tokenizer *)1;
    assert_int_equal(load_json(j, &t, msg, sizeof(msg)), want);
    assert_null(t);
    if (!strstr(msg, needle)) fail_msg("message \"%s\" lacks \"%s\"", msg, needle);
}

static void malformed_json_is_a_parse_error(void **state) {
    (void)state;
    char msg[256];
    pd_hf_tokenizer *t;
    const char *bad = "{\"model\": {\"type\": \"BPE\",, }";
    assert_int_equal(pd_hf_tokenizer_load_buf(bad, strlen(bad), &t, msg, sizeof(msg)),
                     PD_ERR_PARSE);
    assert_non_null(strstr(msg, "line 1"));
    assert_int_equal(pd_hf_tokenizer_load_buf("[]", 2, &t, msg, sizeof(msg)), PD_ERR_PARSE);
    assert_int_equal(pd_hf_tokenizer_load("/nonexistent/tokenizer.json", &t, msg, sizeof(msg)),
                     PD_ERR_IO);
    assert_non_null(strstr(msg, "/nonexistent/tokenizer.json"));
}

static void unigram_model_is_refused_by_name(void **state) {
    (void)state;
    json_t *j = json_pack("{s:{s:s, s:i, s:[[s, f]]}}", "model", "type", "Unigram", "unk_id", 0,
                          "vocab", "<unk>", 0.0);
    expect_refusal(j, PD_ERR_INVALID, "Unigram");
}

static void missing_merges_is_refused(void **state) {
    (void)state;
    json_t *j = tiny_json(gpt_like, tiny_merges, 2);
    json_object_del(json_object_get(j, "model"), "merges");
    expect_refusal(j, PD_ERR_PARSE, "merges");
}

static void merge_outside_the_vocab_is_refused(void **state) {
    (void)state;
    json_t *j = tiny_json(gpt_like, tiny_merges, 2);
    json_array_append_new(json_object_get(json_object_get(j, "model"), "merges"),
                          json_string("he o"));
    expect_refusal(j, PD_ERR_INVALID, "merges[2]");
}

static void unsupported_stages_are_named(void **state) {
    (void)state;
    json_t *j = tiny_json(gpt_like, tiny_merges, 2);
    json_object_set_new(j, "normalizer", json_pack("{s:s}", "type", "Lowercase"));
    expect_refusal(j, PD_ERR_INVALID, "normalizer Lowercase");
    j = tiny_json(gpt_like, tiny_merges, 2);
    json_object_set_new(j, "pre_tokenizer", json_pack("{s:s}", "type", "Metaspace"));
    expect_refusal(j, PD_ERR_INVALID, "pre_tokenizer Metaspace");
    j = tiny_json(gpt_like, tiny_merges, 2);
    json_object_set_new(j, "decoder", json_pack("{s:s}", "type", "WordPiece"));
    expect_refusal(j, PD_ERR_INVALID, "decoder WordPiece");
    j = tiny_json(gpt_like, tiny_merges, 2);
    json_object_set_new(json_object_get(j, "model"), "byte_fallback", json_true());
    expect_refusal(j, PD_ERR_INVALID, "byte_fallback");
    j = tiny_json("(unclosed", tiny_merges, 2);
    expect_refusal(j, PD_ERR_INVALID, "Split regex");
    j = tiny_json(gpt_like, tiny_merges, 2);
    json_object_del(json_object_get(j, "model"), "vocab");
    expect_refusal(j, PD_ERR_PARSE, "vocab");
}

static void vocab_without_every_byte_is_refused(void **state) {
    (void)state;
    json_t *j = tiny_json(gpt_like, tiny_merges, 0);
    json_object_del(json_object_get(json_object_get(j, "model"), "vocab"), "A");
    expect_refusal(j, PD_ERR_INVALID, "byte 0x41");
}

/* Every prefix of a valid file is refused, never a crash (ASan watches). */
static void truncated_file_never_crashes(void **state) {
    (void)state;
    json_t *j = tiny_json(gpt_like, tiny_merges, 8);
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    size_t n = strlen(s);
    for (size_t len = 0; len < n; len += 1 + len / 64) {
        char msg[256];
        pd_hf_tokenizer *t = NULL;
        assert_int_not_equal(pd_hf_tokenizer_load_buf(s, len, &t, msg, sizeof(msg)), PD_OK);
        assert_null(t);
    }
    free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(merges_apply_by_rank_and_decode_round_trips),
        cmocka_unit_test(white_space_is_unicode_white_space),
        cmocka_unit_test(invalid_bytes_are_byte_tokens),
        cmocka_unit_test(stream_holds_back_a_split_character),
        cmocka_unit_test(template_processing_adds_its_special_ids),
        cmocka_unit_test(added_token_flags_take_spaces_and_words),
        cmocka_unit_test(long_pre_token_merges),
        cmocka_unit_test(config_names_bos_and_eos),
        cmocka_unit_test(checkpoint_directory_tokenizer),
        cmocka_unit_test(malformed_json_is_a_parse_error),
        cmocka_unit_test(unigram_model_is_refused_by_name),
        cmocka_unit_test(missing_merges_is_refused),
        cmocka_unit_test(merge_outside_the_vocab_is_refused),
        cmocka_unit_test(unsupported_stages_are_named),
        cmocka_unit_test(vocab_without_every_byte_is_refused),
        cmocka_unit_test(truncated_file_never_crashes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
