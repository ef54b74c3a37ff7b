/*
 * pd_tokenizer — the byte-level tokenizer of the built-in models.
 *
 * Token b in [0, 256) is the byte b; 256 begins a sequence, 257 ends one.
 * Every byte string encodes, every byte-token sequence decodes back to the
 * same bytes, and nothing needs a vocabulary file. The price is one token
 * per byte, which is fine for a reference model whose job is to move real
 * state through the engine, not to be efficient with context.
 *
 * Decoded bytes need not be valid UTF-8 (a model may emit any byte), so
 * pd_utf8_sanitize (base.h) makes text safe for JSON and terminals.
 */
#ifndef PDSERVE_TOKENIZER_H
#define PDSERVE_TOKENIZER_H

#include "pdserve/base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_TOKEN_BOS 256
#define PD_TOKEN_EOS 257
#define PD_TOKENIZER_VOCAB 258u

/* Writes the tokens of text[0..len) (preceded by BOS when add_bos) to out,
 * at most cap of them. Returns how many the whole text needs. */
size_t pd_tokenizer_encode(const char *text, size_t len, bool add_bos, int32_t *out, size_t cap);

/* Writes the bytes of the byte tokens (BOS, EOS and anything >= 256 are
 * skipped) to out, at most cap - 1 of them, NUL-terminated when cap > 0.
 * Returns how many bytes the whole sequence decodes to. */
size_t pd_tokenizer_decode(const int32_t *tokens, size_t n, char *out, size_t cap);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_TOKENIZER_H */
