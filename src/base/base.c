/*
 * base.c — error names, panic, bounded string builder, UTF-8 sanitiser, PRNG,
 * token hash.
 *
 * Small utilities every layer uses. The PRNG and hash are deliberately our
 * own, fully specified algorithms so that a simulator seed reproduces the
 * same run on any machine and any libc.
 */
#include "pdserve/base.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *const err_names[PD_ERR__COUNT] = {
    [PD_OK] = "ok",
    [PD_ERR_INVALID] = "invalid",
    [PD_ERR_NOMEM] = "nomem",
    [PD_ERR_STATE] = "state",
    [PD_ERR_NOTFOUND] = "notfound",
    [PD_ERR_EXISTS] = "exists",
    [PD_ERR_IO] = "io",
    [PD_ERR_PARSE] = "parse",
    [PD_ERR_TOOBIG] = "toobig",
    [PD_ERR_INTERNAL] = "internal",
};

const char *pd_build_kind(void) {
#if defined(PD_BUILD_PGO) && defined(PD_BUILD_LTO)
    return "profile-guided, link-time optimised";
#elif defined(PD_BUILD_PGO)
    return "profile-guided";
#elif defined(PD_BUILD_PGO_GEN)
    return "instrumented (profile training)";
#else
    return "plain";
#endif
}

const char *pd_err_name(pd_err err) {
    if ((unsigned)err >= PD_ERR__COUNT) return "unknown";
    return err_names[err];
}

_Noreturn void pd_panic(const char *file, int line, const char *expr,
                        const char *fmt, ...) {
    fprintf(stderr, "%s:%d: assertion failed: %s", file, line, expr);
    if (fmt) {
        va_list ap;
        va_start(ap, fmt);
        fputs(" (", stderr);
        vfprintf(stderr, fmt, ap);
        fputs(")", stderr);
        va_end(ap);
    }
    fputc('\n', stderr);
    fflush(stderr);
    abort();
}

/* ---- strbuf ------------------------------------------------------------- */

void pd_strbuf_init(pd_strbuf *sb, char *data, size_t cap) {
    PD_ASSERT(sb != NULL);
    PD_ASSERT(data != NULL || cap == 0);
    sb->data = data;
    sb->cap = cap;
    sb->len = 0;
    sb->truncated = false;
    if (cap > 0) data[0] = '\0';
}

void pd_strbuf_reset(pd_strbuf *sb) {
    sb->len = 0;
    sb->truncated = false;
    if (sb->cap > 0) sb->data[0] = '\0';
}

void pd_strbuf_appendn(pd_strbuf *sb, const char *s, size_t n) {
    if (sb->cap == 0) {
        sb->truncated = sb->truncated || n > 0;
        return;
    }
    size_t room = sb->cap - 1 - sb->len;
    if (n > room) {
        n = room;
        sb->truncated = true;
    }
    memcpy(sb->data + sb->len, s, n);
    sb->len += n;
    sb->data[sb->len] = '\0';
}

void pd_strbuf_append(pd_strbuf *sb, const char *s) {
    pd_strbuf_appendn(sb, s, strlen(s));
}

void pd_strbuf_vprintf(pd_strbuf *sb, const char *fmt, va_list ap) {
    if (sb->cap == 0) {
        sb->truncated = true;
        return;
    }
    size_t room = sb->cap - sb->len;
    int n = vsnprintf(sb->data + sb->len, room, fmt, ap);
    if (n < 0) {
        sb->truncated = true;
        sb->data[sb->len] = '\0';
        return;
    }
    if ((size_t)n >= room) {
        sb->len = sb->cap - 1;
        sb->truncated = true;
    } else {
        sb->len += (size_t)n;
    }
}

pd_err pd_violation(pd_strbuf *report, const char *fmt, ...) {
    if (report) {
        va_list ap;
        va_start(ap, fmt);
        pd_strbuf_append(report, "violation: ");
        pd_strbuf_vprintf(report, fmt, ap);
        pd_strbuf_append(report, "\n");
        va_end(ap);
    }
    return PD_ERR_INTERNAL;
}

void pd_strbuf_printf(pd_strbuf *sb, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    pd_strbuf_vprintf(sb, fmt, ap);
    va_end(ap);
}

void pd_strbuf_json_string(pd_strbuf *sb, const char *s) {
    pd_strbuf_append(sb, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        switch (*p) {
        case '"': pd_strbuf_append(sb, "\\\""); break;
        case '\\': pd_strbuf_append(sb, "\\\\"); break;
        case '\n': pd_strbuf_append(sb, "\\n"); break;
        case '\r': pd_strbuf_append(sb, "\\r"); break;
        case '\t': pd_strbuf_append(sb, "\\t"); break;
        default:
            if (*p < 0x20) {
                pd_strbuf_printf(sb, "\\u%04x", *p);
            } else {
                char c = (char)*p;
                pd_strbuf_appendn(sb, &c, 1);
            }
        }
    }
    pd_strbuf_append(sb, "\"");
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
    PD_ASSERT(in != NULL || len == 0);
    PD_ASSERT(out != NULL || cap == 0);
    const unsigned char *s = (const unsigned char *)in;
    size_t need = 0, w = 0;
    bool full = cap == 0; /* once a piece does not fit, none after it is written */
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
    PD_ASSERT(w <= need && need <= 3 * len);
    if (cap > 0) out[w] = '\0';
    return need;
}

pd_err pd_errorf(char *msg, size_t msg_cap, pd_err err, const char *fmt, ...) {
    if (msg && msg_cap > 0) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, msg_cap, fmt, ap);
        va_end(ap);
    }
    return err;
}

/* ---- PRNG --------------------------------------------------------------- */

uint64_t pd_splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void pd_rng_seed(pd_rng *rng, uint64_t seed) {
    uint64_t st = seed;
    for (int i = 0; i < 4; i++) rng->s[i] = pd_splitmix64(&st);
    /* xoshiro must not start from the all-zero state; splitmix64 cannot
     * produce four zeros in a row, but keep the invariant explicit. */
    PD_ASSERT(rng->s[0] | rng->s[1] | rng->s[2] | rng->s[3]);
}

static inline uint64_t rotl64(uint64_t x, int k) {
    return (x << k) | (x >> (64 - k));
}

uint64_t pd_rng_next(pd_rng *rng) {
    uint64_t *s = rng->s;
    uint64_t result = rotl64(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl64(s[3], 45);
    return result;
}

uint64_t pd_rng_below(pd_rng *rng, uint64_t bound) {
    PD_ASSERT(bound > 0);
    /* Rejection sampling: discard the top partial bucket. */
    uint64_t limit = UINT64_MAX - (UINT64_MAX % bound);
    for (;;) {
        uint64_t x = pd_rng_next(rng);
        if (x < limit) return x % bound;
    }
}

int64_t pd_rng_range(pd_rng *rng, int64_t lo, int64_t hi) {
    PD_ASSERT(lo <= hi);
    uint64_t span = (uint64_t)hi - (uint64_t)lo;
    if (span == UINT64_MAX) return (int64_t)pd_rng_next(rng);
    return (int64_t)((uint64_t)lo + pd_rng_below(rng, span + 1));
}

bool pd_rng_chance(pd_rng *rng, uint32_t num, uint32_t den) {
    PD_ASSERT(den > 0);
    return pd_rng_below(rng, den) < num;
}

double pd_rng_unit(pd_rng *rng) {
    return (double)(pd_rng_next(rng) >> 11) * (1.0 / 9007199254740992.0);
}

/* ---- hashing ------------------------------------------------------------ */

uint64_t pd_hash_fnv1a(const char *s) {
    uint64_t h = 0xCBF29CE484222325ull;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        h = (h ^ *p) * 0x100000001B3ull;
    return h;
}

uint64_t pd_hash_str(const char *s) { return pd_hash_u64(pd_hash_fnv1a(s)); }

uint64_t pd_hash_tokens(const int32_t *tokens, size_t n, uint64_t seed) {
    uint64_t h = pd_hash_u64(seed ^ (0x9E3779B97F4A7C15ull * (n + 1)));
    size_t i = 0;
    /* Two tokens per multiply round; the order of tokens matters. */
    for (; i + 1 < n; i += 2) {
        uint64_t v = ((uint64_t)(uint32_t)tokens[i] << 32) |
                     (uint64_t)(uint32_t)tokens[i + 1];
        h = (h ^ pd_hash_u64(v + i)) * 0x100000001B3ull;
        h = rotl64(h, 29);
    }
    if (i < n) {
        h = (h ^ pd_hash_u64((uint64_t)(uint32_t)tokens[i] + i)) *
            0x100000001B3ull;
    }
    return pd_hash_u64(h);
}
