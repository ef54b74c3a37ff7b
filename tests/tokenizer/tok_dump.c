/* tok_dump — the C side of the reference test (test_reference.py).
 *
 *   tok_dump TOKENIZER.json CORPUS.json
 *
 * Prints one JSON array of ids per corpus string (add_special false), then
 * the first string's with add_special true: the same lines ref_encode.mjs
 * prints. Checks on the way, exiting 1 with the reason on stderr:
 *   - decode(encode(x)) == x for every string, whole and streamed one token
 *     at a time (the stream never emits a split character);
 *   - invalid UTF-8 spliced into each string (bytes no reference can hold)
 *     encodes as the documented rule says: every invalid byte is its own
 *     byte token, a hard boundary, so encode(A X B) = encode(A) X' encode(B),
 *     and the result still decodes to A X B.
 * Encoding speed (CPU time) and the bos / eos ids of the tokenizer_config.json
 * beside the file go to stderr. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "pdserve/hf_tokenizer.h"

static const char *const invalid[] = {
    "\xff",     "\x80",         "\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80",
    "\xe2\x82", "\xf0\x9f\x98", "\xfe\xfe"};

static int fail(const char *what, size_t doc) {
    fprintf(stderr, "tok_dump: document %zu: %s\n", doc, what);
    return 1;
}

static int32_t *enc(const pd_hf_tokenizer *t, const char *s, size_t n, bool special,
                    size_t *n_ids) {
    char msg[256];
    int32_t *ids = NULL;
    if (pd_hf_tokenizer_encode(t, s, n, special, &ids, n_ids, msg, sizeof(msg)) != PD_OK) {
        fprintf(stderr, "tok_dump: encode: %s\n", msg);
        exit(1);
    }
    return ids;
}

static char *normalize(const pd_hf_tokenizer *t, const char *s, size_t n, size_t *len) {
    char msg[256], *out = NULL;
    if (pd_hf_tokenizer_normalize(t, s, n, &out, len, msg, sizeof(msg)) != PD_OK) {
        fprintf(stderr, "tok_dump: normalize: %s\n", msg);
        exit(1);
    }
    return out;
}

/* decode(ids) == normalize(s): the round trip, up to the file's normalizer. */
static bool decodes_to(const pd_hf_tokenizer *t, const int32_t *ids, size_t n, const char *raw,
                       size_t raw_len) {
    char msg[256], *out = NULL;
    size_t out_len = 0, len;
    char *s = normalize(t, raw, raw_len, &len);
    bool ok = pd_hf_tokenizer_decode(t, ids, n, false, &out, &out_len, msg, sizeof(msg)) == PD_OK &&
        out_len == len && !memcmp(out, s, len);
    free(out);
    free(s);
    return ok;
}

/* Streamed one token at a time, the bytes are s's and no character is split. */
static bool stream_matches(const pd_hf_tokenizer *t, const int32_t *ids, size_t n, const char *s,
                           size_t len) {
    pd_hf_stream st;
    pd_hf_stream_init(&st, t, false);
    char chunk[PD_HF_TOKEN_BYTES_MAX + 4];
    size_t at = 0;
    for (size_t i = 0; i < n; i++) {
        size_t k = pd_hf_stream_push(&st, ids[i], chunk, sizeof(chunk));
        if (at + k > len || memcmp(chunk, s + at, k)) return false;
        at += k;
        if (at < len && (s[at] & 0xC0) == 0x80) return false; /* split a valid character */
    }
    size_t k = pd_hf_stream_flush(&st, chunk, sizeof(chunk));
    return at + k == len && !memcmp(chunk, s + at, k);
}

static bool streams_to(const pd_hf_tokenizer *t, const int32_t *ids, size_t n, const char *raw,
                       size_t raw_len) {
    size_t len;
    char *s = normalize(t, raw, raw_len, &len);
    bool ok = stream_matches(t, ids, n, s, len);
    free(s);
    return ok;
}

/* encode(A X B) == encode(A) ++ encode(X) ++ encode(B), X one byte token a byte. */
static int check_splice(const pd_hf_tokenizer *t, const char *s, size_t n, size_t doc) {
    size_t cut = n / 2;
    while (cut > 0 && (s[cut] & 0xC0) == 0x80) cut--;
    const char *x = invalid[doc % (sizeof(invalid) / sizeof(invalid[0]))];
    size_t xn = strlen(x), total = n + xn, na, nx, nb, nall;
    char *all = malloc(total + 1);
    memcpy(all, s, cut);
    memcpy(all + cut, x, xn);
    memcpy(all + cut + xn, s + cut, n - cut);
    int32_t *a = enc(t, s, cut, false, &na), *xi = enc(t, x, xn, false, &nx);
    int32_t *b = enc(t, s + cut, n - cut, false, &nb), *whole = enc(t, all, total, false, &nall);
    int rc = 0;
    if (nx != xn) rc = fail("an invalid byte is not one token", doc);
    if (!rc &&
        (nall != na + nx + nb || memcmp(whole, a, na * 4) || memcmp(whole + na, xi, nx * 4) ||
         memcmp(whole + na + nx, b, nb * 4)))
        rc = fail("invalid bytes are not a hard boundary", doc);
    if (!rc && !decodes_to(t, whole, nall, all, total)) rc = fail("invalid bytes lost", doc);
    free(all), free(a), free(xi), free(b), free(whole);
    return rc;
}

static void print_ids(const int32_t *ids, size_t n) {
    putchar('[');
    for (size_t i = 0; i < n; i++) printf(i ? ",%d" : "%d", (int)ids[i]);
    puts("]");
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: tok_dump TOKENIZER.json CORPUS.json\n");
        return 2;
    }
    char msg[512];
    pd_hf_tokenizer *t = NULL;
    if (pd_hf_tokenizer_load(argv[1], &t, msg, sizeof(msg)) != PD_OK) {
        fprintf(stderr, "tok_dump: %s\n", msg);
        return 1;
    }
    char config[4096];
    snprintf(config, sizeof(config), "%.*s/tokenizer_config.json",
             (int)(strrchr(argv[1], '/') ? strrchr(argv[1], '/') - argv[1] : 1),
             strrchr(argv[1], '/') ? argv[1] : ".");
    if (pd_hf_tokenizer_load_config(t, config, msg, sizeof(msg)) != PD_OK) {
        fprintf(stderr, "tok_dump: %s\n", msg);
        pd_hf_tokenizer_free(t);
        return 1;
    }
    fprintf(stderr, "tok_dump: bos %d eos %d\n", (int)pd_hf_tokenizer_bos(t),
            (int)pd_hf_tokenizer_eos(t));
    json_error_t jerr;
    json_t *docs = json_load_file(argv[2], 0, &jerr);
    if (!json_is_array(docs)) return fail("corpus is not a JSON array", 0);
    size_t bytes = 0, ids_total = 0, i;
    double secs = 0;
    json_t *d;
    int rc = 0;
    json_array_foreach(docs, i, d) {
        const char *s = json_string_value(d);
        size_t n = json_string_length(d), n_ids;
        struct timespec t0, t1;
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t0);
        int32_t *ids = enc(t, s, n, false, &n_ids);
        clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t1);
        secs += (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
        bytes += n, ids_total += n_ids;
        print_ids(ids, n_ids);
        if (!rc && !decodes_to(t, ids, n_ids, s, n)) rc = fail("decode(encode(x)) != x", i);
        if (!rc && !streams_to(t, ids, n_ids, s, n)) rc = fail("the stream decodes wrong", i);
        if (!rc) rc = check_splice(t, s, n, i);
        free(ids);
    }
    size_t n_ids;
    const json_t *first = json_array_get(docs, 0);
    int32_t *ids = enc(t, json_string_value(first), json_string_length(first), true, &n_ids);
    print_ids(ids, n_ids);
    free(ids);
    fprintf(stderr, "tok_dump: %zu documents, %zu bytes, %zu ids, %.1f MB/s encode (CPU time)\n",
            json_array_size(docs), bytes, ids_total, secs > 0 ? (double)bytes / secs / 1e6 : 0.0);
    json_decref(docs);
    pd_hf_tokenizer_free(t);
    return rc;
}
