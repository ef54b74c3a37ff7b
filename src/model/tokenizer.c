/*
 * tokenizer.c — byte-level tokenizer and a UTF-8 sanitiser. See
 * include/pdserve/tokenizer.h.
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

/* Length of the valid UTF-8 sequence starting at s[0] (s has len bytes), or
 * 0 when s[0] does not start one. Refuses overlong forms, surrogates and
 * code points above U+10FFFF, as RFC 3629 does. */
static size_t utf8_valid_len(const unsigned char *s, size_t len) {
    unsigned char c = s[0];
    if (c >= 0x01 && c < 0x80) return 1;
    size_t n;
    uint32_t cp, min;
    if (c >= 0xc2 && c <= 0xdf) n = 2, cp = c & 0x1fu, min = 0x80;
    else if (c >= 0xe0 && c <= 0xef) n = 3, cp = c & 0x0fu, min = 0x800;
    else if (c >= 0xf0 && c <= 0xf4) n = 4, cp = c & 0x07u, min = 0x10000;
    else return 0;
    if (len < n) return 0;
    for (size_t i = 1; i < n; i++) {
        if ((s[i] & 0xc0u) != 0x80u) return 0;
        cp = (cp << 6) | (s[i] & 0x3fu);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
    return n;
}

size_t pd_utf8_sanitize(const char *in, size_t len, char *out, size_t cap) {
    static const char replacement[] = "\xef\xbf\xbd";
    const unsigned char *s = (const unsigned char *)in;
    size_t need = 0, w = 0;
    bool full = cap == 0;
    for (size_t i = 0; i < len;) {
        size_t n = utf8_valid_len(s + i, len - i);
        const char *piece = n ? in + i : replacement;
        size_t piece_len = n ? n : 3;
        if (!full && w + piece_len <= cap - 1) {
            memcpy(out + w, piece, piece_len);
            w += piece_len;
        } else {
            full = true;
        }
        need += piece_len;
        i += n ? n : 1;
    }
    if (cap > 0) out[w] = '\0';
    return need;
}
