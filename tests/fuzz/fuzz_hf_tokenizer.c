/* tokenizer.json and the text it encodes, from the outside world. An input
 * whose first byte is 'J' is the rest as a tokenizer.json: loaded (and, if it
 * loads, used on a fixed text) or refused, never a crash. Any other input is
 * text for a fixed byte-level BPE with merges, an NFC normalizer and added
 * tokens: it must encode, decode back to its normalized form, and stream back
 * to the same bytes one token at a time. */
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "pdserve/hf_tokenizer.h"

static const char *const merges[] = {"h e", "l l",   "he ll", "hell o", "Ġ w",
                                     "Ġ Ġ", "ĠĠ ĠĠ", "Ã ©",   "1 2",    "12 3"};

static void byte_char(unsigned b, char out[3]) {
    unsigned n = 0, cp = b;
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
    if (!printable) {
        for (unsigned c = 0; c < b; c++)
            n += !((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE));
        cp = 256 + n;
    }
    memset(out, 0, 3);
    out[0] = (char)(cp < 0x80 ? cp : 0xC0 | (cp >> 6));
    if (cp >= 0x80) out[1] = (char)(0x80 | (cp & 0x3F));
}

static char *fixed_json(void) {
    json_t *vocab = json_object(), *ml = json_array();
    for (unsigned b = 0; b < 256; b++) {
        char c[3];
        byte_char(b, c);
        json_object_set_new(vocab, c, json_integer(b));
    }
    for (size_t i = 0; i < sizeof(merges) / sizeof(merges[0]); i++) {
        char both[32];
        const char *sp = strchr(merges[i], ' ');
        snprintf(both, sizeof(both), "%.*s%s", (int)(sp - merges[i]), merges[i], sp + 1);
        json_object_set_new(vocab, both, json_integer((json_int_t)(256 + i)));
        json_array_append_new(ml, json_string(merges[i]));
    }
    json_t *j = json_pack(
        "{s:[{s:i, s:s, s:b}, {s:i, s:s, s:b, s:b}], s:{s:s}, s:{s:s, s:[{s:s, s:{s:s}, s:s},"
        " {s:s, s:b}]}, s:{s:s}, s:{s:s, s:o, s:o}}",
        "added_tokens", "id", 300, "content", "<|im_start|>", "special", 1, "id", 301, "content",
        "<x>", "special", 0, "rstrip", 1, "normalizer", "type", "NFC", "pre_tokenizer", "type",
        "Sequence", "pretokenizers", "type", "Split", "pattern", "Regex",
        "(?i:'s|'t)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
        "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+",
        "behavior", "Isolated", "type", "ByteLevel", "use_regex", 0, "decoder", "type", "ByteLevel",
        "model", "type", "BPE", "vocab", vocab, "merges", ml);
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return s;
}

static void round_trip(const pd_hf_tokenizer *t, const char *s, size_t n) {
    char msg[256], *norm, *dec;
    int32_t *ids;
    size_t n_ids, n_norm, n_dec;
    PD_MUST(pd_hf_tokenizer_encode(t, s, n, false, &ids, &n_ids, msg, sizeof(msg)));
    PD_MUST(pd_hf_tokenizer_normalize(t, s, n, &norm, &n_norm, msg, sizeof(msg)));
    PD_MUST(pd_hf_tokenizer_decode(t, ids, n_ids, false, &dec, &n_dec, msg, sizeof(msg)));
    PD_ASSERT(n_dec == n_norm && !memcmp(dec, norm, n_dec));
    pd_hf_stream st;
    pd_hf_stream_init(&st, t, false);
    char chunk[PD_HF_TOKEN_BYTES_MAX + 4];
    size_t at = 0;
    for (size_t i = 0; i < n_ids; i++) {
        size_t k = pd_hf_stream_push(&st, ids[i], chunk, sizeof(chunk));
        PD_ASSERT(at + k <= n_dec && !memcmp(chunk, dec + at, k));
        at += k;
    }
    size_t k = pd_hf_stream_flush(&st, chunk, sizeof(chunk));
    PD_ASSERT(at + k == n_dec && !memcmp(chunk, dec + at, k));
    free(ids), free(norm), free(dec);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    static pd_hf_tokenizer *fixed; /* built once, kept for the process */
    char msg[256];
    if (size > 0 && data[0] == 'J') {
        pd_hf_tokenizer *t = NULL;
        if (pd_hf_tokenizer_load_buf((const char *)data + 1, size - 1, &t, msg, sizeof(msg)) ==
            PD_OK) {
            round_trip(t, "Hello world's 123 <|im_start|> \xe2\x82", 33);
            pd_hf_tokenizer_free(t);
        }
        return 0;
    }
    if (!fixed) {
        char *json = fixed_json();
        PD_MUST(pd_hf_tokenizer_load_buf(json, strlen(json), &fixed, msg, sizeof(msg)));
        free(json);
    }
    round_trip(fixed, (const char *)data, size);
    return 0;
}
