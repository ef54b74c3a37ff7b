/*
 * tokenizer.c — the byte-level tokenizer. See include/pdserve/tokenizer.h.
 */
#include "pdserve/tokenizer.h"

#include <string.h>

size_t pd_tokenizer_encode(const char *text, size_t len, bool add_bos, int32_t *out, size_t cap) {
    size_t need = len + (add_bos ? 1 : 0), w = 0;
    if (add_bos && w < cap) out[w++] = PD_TOKEN_BOS;
    for (size_t i = 0; i < len && w < cap; i++) out[w++] = (int32_t)(unsigned char)text[i];
    return need;
}

size_t pd_tokenizer_decode(const int32_t *tokens, size_t n, char *out, size_t cap) {
    size_t need = 0;
    for (size_t i = 0; i < n; i++) {
        if (tokens[i] < 0 || tokens[i] > 255) continue;
        if (cap > 0 && need < cap - 1) out[need] = (char)(unsigned char)tokens[i];
        need++;
    }
    if (cap > 0) out[PD_MIN(need, cap - 1)] = '\0';
    return need;
}
