/*
 * pdserve base layer: error codes, always-on assertions, a bounded string
 * builder, a UTF-8 sanitiser, a deterministic PRNG and a hash for token runs.
 *
 * Everything above this layer reports failure by returning a pd_err (0 = ok)
 * and, where a person will read it, by filling a caller-owned message buffer.
 * Nothing on a library path prints or exits, with one exception: PD_ASSERT.
 * An assertion states an invariant whose violation means ownership is already
 * corrupted (a unit owned twice, a counter below zero); continuing would turn
 * a detectable bug into silent data corruption, so it aborts, in every build.
 */
#ifndef PDSERVE_BASE_H
#define PDSERVE_BASE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pd_err {
    PD_OK = 0,
    PD_ERR_INVALID,     /* an argument is out of its domain */
    PD_ERR_NOMEM,       /* a fixed-size pool or table has no room */
    PD_ERR_STATE,       /* the operation is illegal in the unit's/object's state */
    PD_ERR_NOTFOUND,    /* unknown id, rid, node, ticket */
    PD_ERR_EXISTS,      /* duplicate (rid, room, key) */
    PD_ERR_IO,          /* a file, socket or transport failed */
    PD_ERR_PARSE,       /* malformed input */
    PD_ERR_TOOBIG,      /* input larger than a configured limit */
    PD_ERR_INTERNAL,    /* an invariant check failed (reported, not asserted) */
    PD_ERR__COUNT
} pd_err;

/* Stable lower-case name of an error code ("invalid", "nomem", ...). */
const char *pd_err_name(pd_err err);

/* ---- assertions -------------------------------------------------------- */

/* Prints "file:line: assertion failed: expr (message)" to stderr and aborts.
 * Deliberately the only function of the library that prints. */
_Noreturn void pd_panic(const char *file, int line, const char *expr,
                        const char *fmt, ...);

#define PD_ASSERT(cond)                                                       \
    do {                                                                      \
        if (!(cond)) pd_panic(__FILE__, __LINE__, #cond, NULL);               \
    } while (0)

/* Like PD_ASSERT with a formatted explanation. */
#define PD_ASSERTF(cond, ...)                                                 \
    do {                                                                      \
        if (!(cond)) pd_panic(__FILE__, __LINE__, #cond, __VA_ARGS__);        \
    } while (0)

/* Asserts that an expression returning pd_err succeeded. */
#define PD_MUST(expr)                                                         \
    do {                                                                      \
        pd_err pd_must_err_ = (expr);                                         \
        if (pd_must_err_ != PD_OK)                                            \
            pd_panic(__FILE__, __LINE__, #expr, "returned %s",                \
                     pd_err_name(pd_must_err_));                              \
    } while (0)

/* "No slot": the one sentinel for a uint32 index into any table or pool. */
#define PD_NONE UINT32_MAX

/* The version every component reports (CMakeLists.txt's project version). */
#ifndef PD_VERSION
#define PD_VERSION "0.1.0"
#endif

/* How the scheduler core was compiled: "profile-guided" when this build used
 * the profiles of scripts/pgo-train.sh (CMake PD_PGO=use, what `make release`
 * builds), "instrumented (profile training)" in the training's own build,
 * else "plain". Benchmarks print it beside their figures. */
const char *pd_build_kind(void);

#define PD_ARRAY_LEN(a) (sizeof(a) / sizeof((a)[0]))
#define PD_MIN(a, b) ((a) < (b) ? (a) : (b))
#define PD_MAX(a, b) ((a) > (b) ? (a) : (b))
#define PD_DIV_CEIL(a, b) (((a) + (b)-1) / (b))

/* For a function that only prefetches: it must be inlined where it is
 * called, since gcc (12, -O1 and up) counts it free of effects and, when it
 * is not inlined early, deletes the call as dead (the engine's retire
 * prefetch and the cache's victim prefetch were, until issue 13's
 * fourteenth round; tests/engine/prefetch_kept.sh checks the objects). */
#if defined(__GNUC__)
#define PD_PREFETCH_INLINE static inline __attribute__((always_inline))
#else
#define PD_PREFETCH_INLINE static inline
#endif

/* ---- request ids ----------------------------------------------------------
 * The one limit on a request id (rid), for every layer that handles one: the
 * engine and the nodes store rids in PD_RID_MAX-byte arrays, and the router,
 * which knows HTTP and base only, refuses at its door any rid the nodes would
 * refuse. Bytes with the terminating NUL: a rid is 1 to PD_RID_MAX - 1 bytes. */
#define PD_RID_MAX 64

/* ---- bounded string builder ---------------------------------------------
 * Writes into a caller-owned buffer, never past its capacity, always
 * NUL-terminated. Output beyond the capacity is dropped and `truncated` set,
 * so report code can be written without checking every append. */
typedef struct pd_strbuf {
    char *data;
    size_t cap;       /* bytes in data, including room for the NUL */
    size_t len;       /* bytes written, excluding the NUL */
    bool truncated;
} pd_strbuf;

void pd_strbuf_init(pd_strbuf *sb, char *data, size_t cap);
void pd_strbuf_reset(pd_strbuf *sb);
void pd_strbuf_append(pd_strbuf *sb, const char *s);
void pd_strbuf_appendn(pd_strbuf *sb, const char *s, size_t n);
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
void pd_strbuf_printf(pd_strbuf *sb, const char *fmt, ...);
void pd_strbuf_vprintf(pd_strbuf *sb, const char *fmt, va_list ap);
/* Appends "violation: <text>\n" to report (if any) and returns
 * PD_ERR_INTERNAL: the shared shape of every ownership check's findings. */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
pd_err pd_violation(pd_strbuf *report, const char *fmt, ...);
/* Appends s as a JSON string literal, quotes included. */
void pd_strbuf_json_string(pd_strbuf *sb, const char *s);

/* Copies in[0..len) to out replacing every byte that is not part of a valid
 * UTF-8 sequence (and every NUL) by U+FFFD; at most cap - 1 bytes,
 * NUL-terminated when cap > 0, never splitting a character. Returns the
 * bytes the whole result needs (excluding the NUL), at most 3 * len. Text
 * that leaves the process as JSON (a model's bytes, a message quoting a
 * client's) goes through it: JSON strings must be UTF-8. */
size_t pd_utf8_sanitize(const char *in, size_t len, char *out, size_t cap);

/* snprintf into a fixed message buffer; a NULL or zero-size buffer is allowed
 * and ignored. Returns err so callers can `return pd_errorf(msg, n, ...)`. */
#if defined(__GNUC__)
__attribute__((format(printf, 4, 5)))
#endif
pd_err pd_errorf(char *msg, size_t msg_cap, pd_err err, const char *fmt, ...);

/* ---- deterministic PRNG -------------------------------------------------
 * xoshiro256** seeded through splitmix64: fast, good statistical quality,
 * identical sequence on every platform for the same seed. */
typedef struct pd_rng {
    uint64_t s[4];
} pd_rng;

void pd_rng_seed(pd_rng *rng, uint64_t seed);
uint64_t pd_rng_next(pd_rng *rng);
/* Uniform in [0, bound), bound > 0, without modulo bias. */
uint64_t pd_rng_below(pd_rng *rng, uint64_t bound);
/* Uniform in [lo, hi], lo <= hi. */
int64_t pd_rng_range(pd_rng *rng, int64_t lo, int64_t hi);
/* True with probability num/den. */
bool pd_rng_chance(pd_rng *rng, uint32_t num, uint32_t den);
/* Uniform double in [0, 1). */
double pd_rng_unit(pd_rng *rng);

uint64_t pd_splitmix64(uint64_t *state);

/* ---- hashing ------------------------------------------------------------ */

/* 64-bit hash of n 32-bit tokens, mixed with a seed. Deterministic across
 * platforms (explicit little-endian-independent arithmetic on values). */
uint64_t pd_hash_tokens(const int32_t *tokens, size_t n, uint64_t seed);
/* Finaliser for a single 64-bit value (murmur3's fmix64). Inline: the
 * indexes hash a key with it on every lookup, insert and removal (request,
 * room and radix-child keys; issue 13: about 100 k calls a bench/sched run,
 * each a call into base.c before). */
static inline uint64_t pd_hash_u64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ull;
    x ^= x >> 33;
    return x;
}
/* 64-bit hash of a NUL-terminated string (FNV-1a, then pd_hash_u64). */
uint64_t pd_hash_str(const char *s);
/* FNV-1a of a NUL-terminated string alone, without the finaliser: pd_hash_str's
 * first step, for values that were derived from it and must not change (the
 * simulator's rooms). Indexes want pd_hash_str. */
uint64_t pd_hash_fnv1a(const char *s);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_BASE_H */
