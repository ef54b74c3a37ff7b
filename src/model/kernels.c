/*
 * kernels.c — the fixed-order numeric kernels. kernels.h defines the order
 * (8 lanes, one FMA per term, a fixed fold) and says why it is fixed.
 *
 * mdl_matmul, AVX2 path. A tile is up to 4 weight rows (outputs) against up
 * to 3 input rows: 12 running sums, each one 8-lane register, fed per step of
 * 8 terms by 3 input loads and 4 weight loads (7 loads for 12 FMAs; the 4x3
 * shape is what fits the 16 registers: 12 sums, 3 inputs, 1 weight). The
 * loop nest, outermost first:
 *
 *   input rows in blocks of ROWS_BLOCK (64, the most a forward pass sends)
 *   outputs in groups of 4 (within the thread's piece of [0, n_out))
 *   terms in blocks of K_BLOCK (512): with 10 rows or more the group's block
 *     of weights is first copied (bf16 widened) into an 8 KiB buffer, which
 *     every 3-row tile then reads from L1. The copy is contiguous, where the
 *     weight rows themselves are n_in apart and, for n_in a multiple of 1024,
 *     fall in the same L1 sets as each other and as the input rows, and
 *     evict each other between tiles; bf16 is widened once, not once per
 *     tile. While the tiles run, the next block is prefetched. Between term
 *     blocks a tile's sums wait in a small buffer, so each lane's chain
 *     continues in order: blocking changes no bits.
 *   input rows in tiles of 3 (the last 4 as 2 + 2)
 *
 * Decode (a row block of one row) takes 8 outputs at a time, whole rows
 * without term blocks: no input row shares a weight, so what counts is the
 * number of independent FMA chains and of weight rows streaming at once
 * (1 output: about 12 GB/s of bf16 weights, bound by the FMA latency; 4: 19;
 * 8: 22, on a Zen 4 core that reads 30 GB/s). The input row stays in L1.
 * Leftovers (fewer outputs or rows) take the smaller tiles; all 16 shapes,
 * f32 and bf16, are instances of one inline function. A vector's tail
 * (n_in mod 8 terms) is loaded zero-filled and blended in only where a lane
 * owns a term. Each output is therefore computed exactly as mdl_dot defines
 * it whatever tile, block or thread it fell in; the tests check it bit for
 * bit against a term-by-term transcription of the definition and against
 * the portable code.
 */
#include "kernels.h"
#include "detmath.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define LANES PD_DOT_LANES
#define TILE_W 4  /* outputs (weight rows) per tile */
#define TILE_W1 8 /* outputs per tile when the row block is one row (decode) */
#define TILE_W_MAX 8
#define TILE_X 3      /* input rows per tile */
#define ROWS_BLOCK 64 /* input rows per pass over the weights */
#define K_BLOCK 512   /* terms per block; a multiple of LANES */

_Static_assert(K_BLOCK % LANES == 0, "term blocks hold whole lane steps");

/* Set by tests only (mdl_kernels_force_portable), read by every kernel. */
static bool force_portable;

void mdl_kernels_force_portable(bool on) {
    __atomic_store_n(&force_portable, on, __ATOMIC_RELAXED);
}

/* The CPU's answer is read from the table libgcc fills once at start-up. */
static bool use_avx2(void) {
#if defined(__x86_64__)
    return !__atomic_load_n(&force_portable, __ATOMIC_RELAXED) && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma");
#else
    return false;
#endif
}

const char *mdl_kernels_path(void) { return use_avx2() ? "avx2" : "portable"; }

void mdl_par_run(const pd_par *par, uint32_t units, uint64_t flops, pd_task_fn fn, void *ctx) {
    if (par->tp && mdl_threads_count(par->tp) > 1 && flops >= par->min_flops)
        mdl_threads_run(par->tp, units, fn, ctx);
    else if (units > 0) fn(ctx, 0, units, 0);
}

/* ---- portable code: the definition, term by term ------------------------------- */

static inline float bf16_widen(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

/* The one fold of the eight lanes. */
static float fold_lanes(const float l[LANES]) {
    return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

/* Weight i of a row held as f32 (w) or as bf16 (w16, when not NULL). */
static inline float weight_at(const float *w, const uint16_t *w16, uint32_t i) {
    return w16 ? bf16_widen(w16[i]) : w[i];
}

static float dot_portable(const float *w, const uint16_t *w16, const float *x, uint32_t n) {
    float l[LANES] = {0};
    uint32_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (uint32_t j = 0; j < LANES; j++) l[j] = fmaf(weight_at(w, w16, i + j), x[i + j], l[j]);
    for (uint32_t j = 0; i + j < n; j++) l[j] = fmaf(weight_at(w, w16, i + j), x[i + j], l[j]);
    return fold_lanes(l);
}

/* ---- AVX2 + FMA ---------------------------------------------------------------- */

#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX2_INLINE static inline __attribute__((target("avx2,fma"), always_inline))

/* fold_lanes on a register: high half onto low, then pairs, then lane 1. */
AVX2_INLINE float fold8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

/* All ones in lanes [0, rem): the lanes that own one of rem tail terms. */
AVX2_INLINE __m256 tail_mask(uint32_t rem) {
    __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)rem), lane));
}

/* Eight weights from element i of w, f32 or bf16 (exactly widened). */
AVX2_INLINE __m256 load_w(const void *w, size_t i, bool bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)w + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* The rem < 8 weights from element i, zero-filled. */
AVX2_INLINE __m256 load_w_tail(const void *w, size_t i, uint32_t rem, __m256 mask, bool bf16) {
    if (!bf16) return _mm256_maskload_ps((const float *)w + i, _mm256_castps_si256(mask));
    float buf[LANES] = {0};
    for (uint32_t j = 0; j < rem; j++) buf[j] = bf16_widen(((const uint16_t *)w)[i + j]);
    return _mm256_loadu_ps(buf);
}

/* s + w * x in the lanes of mask, s elsewhere (a tail step). */
AVX2_INLINE __m256 fma_masked(__m256 w, __m256 x, __m256 s, __m256 mask) {
    return _mm256_blendv_ps(s, _mm256_fmadd_ps(w, x, s), mask);
}

AVX2 static float dot_avx2(const float *a, const float *b, uint32_t n) {
    __m256 s = _mm256_setzero_ps();
    uint32_t i = 0;
    for (; i + LANES <= n; i += LANES)
        s = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s);
    if (i < n) {
        __m256 m = tail_mask(n - i);
        __m256i mi = _mm256_castps_si256(m);
        s = fma_masked(_mm256_maskload_ps(a + i, mi), _mm256_maskload_ps(b + i, mi), s, m);
    }
    return fold8(s);
}

/* The weight block a row block's tiles will need next: rows of seg_bytes,
 * stride_bytes apart. */
typedef struct next_block {
    const char *p;
    size_t seg_bytes, stride_bytes;
    uint32_t rows;
} next_block;

/* A walk over some of next_block's cache lines, one per step of a tile:
 * spread so, the next block arrives while the tiles compute instead of
 * stalling the copy that packs it, and without the burst of misses that
 * asking for a tile's share at once makes (a 64-row product of 4096 x 4096
 * f32 weights: about 78 GFLOP/s spread, 68 in bursts before each tile, 61
 * without, on one Zen 4 core). */
typedef struct prefetch_walk {
    const char *row;      /* the current weight row's segment */
    size_t line, per_row; /* cache line within it; lines per segment */
    size_t stride_bytes;  /* from one row to the next */
    uint32_t left;        /* lines still to ask for */
} prefetch_walk;

/* One tile over the term block [k0, k1). */
typedef struct tile {
    const void *w;      /* the weight row of the tile's first output, from term w_k0 */
    size_t w_stride;    /* from one weight row to the next */
    uint32_t w_k0;      /* 0, or k0 when w is a widened copy of the block */
    const float *x;     /* the input row of the tile's first row */
    size_t n_in;        /* the stride of the input rows */
    uint32_t k0, k1;    /* the term block */
    bool first, last;   /* k0 == 0 (sums start at +0); k1 == n_in (tail, then fold) */
    bool prefetch;      /* one row, TILE_W1 outputs, short weight rows, another group next */
    prefetch_walk walk; /* several rows: the next block's lines this tile asks for */
    __m256 *sums;       /* [row][TILE_W_MAX]: the running sums between term blocks */
    float *out;         /* out[row * n_out + output] */
    size_t n_out;
} tile;

/* The tail terms of a tile's last block. */
AVX2_INLINE void tile_tail(const tile *a, uint32_t i, __m256 s[TILE_W_MAX][TILE_X], int nw, int nx,
                           bool bf16) {
    const uint32_t rem = a->k1 - i;
    const __m256 m = tail_mask(rem);
    __m256 xv[TILE_X];
#pragma GCC unroll 8
    for (int k = 0; k < nx; k++)
        xv[k] = _mm256_maskload_ps(a->x + k * a->n_in + i, _mm256_castps_si256(m));
#pragma GCC unroll 8
    for (int r = 0; r < nw; r++) {
        __m256 wv = load_w_tail(a->w, r * a->w_stride + (i - a->w_k0), rem, m, bf16);
#pragma GCC unroll 8
        for (int k = 0; k < nx; k++) s[r][k] = fma_masked(wv, xv[k], s[r][k], m);
    }
}

/* Decode over short weight rows (under 4 KiB): 8 rows read side by side are 8
 * streams of a few cache lines each, which the hardware prefetcher follows
 * badly (bf16 rows of 2 KiB read at 11 GB/s where a single stream reads 30).
 * So each step also asks for the next 8 rows, a contiguous block, in order:
 * the next group's bytes spread evenly over this group's steps, into L2
 * (17-18 GB/s then; prefetching longer rows, or into L1, was slower). */
AVX2_INLINE void prefetch_step(const tile *a, uint32_t i, bool bf16) {
    const size_t esz = bf16 ? 2 : 4;
    const char *next = (const char *)a->w + TILE_W1 * a->w_stride * esz;
    const char *p = next + (size_t)(i - a->w_k0) * TILE_W1 * esz; /* 64 * esz bytes per step */
    _mm_prefetch(p, _MM_HINT_T1);
    _mm_prefetch(p + 64, _MM_HINT_T1);
    if (!bf16) {
        _mm_prefetch(p + 128, _MM_HINT_T1);
        _mm_prefetch(p + 192, _MM_HINT_T1);
    }
}

/* Asks for the walk's next line. */
AVX2_INLINE void walk_step(prefetch_walk *w) {
    _mm_prefetch(w->row + w->line * 64, _MM_HINT_T0);
    w->left--;
    if (++w->line == w->per_row) w->line = 0, w->row += w->stride_bytes;
}

/* nw outputs x nx rows; nw, nx and bf16 are constants in every instance. */
AVX2_INLINE void tile_run(const tile *a, int nw, int nx, bool bf16) {
    __m256 s[TILE_W_MAX][TILE_X];
#pragma GCC unroll 8
    for (int r = 0; r < nw; r++)
#pragma GCC unroll 8
        for (int k = 0; k < nx; k++)
            s[r][k] = a->first ? _mm256_setzero_ps() : a->sums[k * TILE_W_MAX + r];
    const size_t n_in = a->n_in, w_stride = a->w_stride, w_k0 = a->w_k0;
    const uint32_t full = a->k0 + (a->k1 - a->k0) / LANES * LANES;
    prefetch_walk walk = a->walk;
    uint32_t i = a->k0;
    for (; i < full; i += LANES) {
        __m256 xv[TILE_X];
        if (nx == 1 && a->prefetch) prefetch_step(a, i, bf16);
        if (nx > 1 && walk.left) walk_step(&walk);
#pragma GCC unroll 8
        for (int k = 0; k < nx; k++) xv[k] = _mm256_loadu_ps(a->x + k * n_in + i);
#pragma GCC unroll 8
        for (int r = 0; r < nw; r++) {
            __m256 wv = load_w(a->w, r * w_stride + (i - w_k0), bf16);
#pragma GCC unroll 8
            for (int k = 0; k < nx; k++) s[r][k] = _mm256_fmadd_ps(wv, xv[k], s[r][k]);
        }
    }
    if (i < a->k1) tile_tail(a, i, s, nw, nx, bf16);
    float *out = a->out;
    __m256 *sums = a->sums;
    const size_t n_out = a->n_out;
    if (a->last) {
#pragma GCC unroll 8
        for (int r = 0; r < nw; r++)
#pragma GCC unroll 8
            for (int k = 0; k < nx; k++) out[k * n_out + r] = fold8(s[r][k]);
    } else {
#pragma GCC unroll 8
        for (int r = 0; r < nw; r++)
#pragma GCC unroll 8
            for (int k = 0; k < nx; k++) sums[k * TILE_W_MAX + r] = s[r][k];
    }
}

#define TILE_FNS(nw, nx)                                                                 \
    AVX2 static void tile_f32_##nw##x##nx(const tile *a) { tile_run(a, nw, nx, false); } \
    AVX2 static void tile_b16_##nw##x##nx(const tile *a) { tile_run(a, nw, nx, true); }
TILE_FNS(1, 1)
TILE_FNS(1, 2)
TILE_FNS(1, 3)
TILE_FNS(2, 1)
TILE_FNS(2, 2)
TILE_FNS(2, 3)
TILE_FNS(3, 1)
TILE_FNS(3, 2)
TILE_FNS(3, 3)
TILE_FNS(4, 1)
TILE_FNS(4, 2)
TILE_FNS(4, 3)
TILE_FNS(5, 1)
TILE_FNS(6, 1)
TILE_FNS(7, 1)
TILE_FNS(8, 1)

typedef void (*tile_fn)(const tile *);
/* [bf16][outputs - 1][rows - 1]; more than 4 outputs only with 1 row */
static const tile_fn tile_fns[2][TILE_W_MAX][TILE_X] = {
    {{tile_f32_1x1, tile_f32_1x2, tile_f32_1x3},
     {tile_f32_2x1, tile_f32_2x2, tile_f32_2x3},
     {tile_f32_3x1, tile_f32_3x2, tile_f32_3x3},
     {tile_f32_4x1, tile_f32_4x2, tile_f32_4x3},
     {tile_f32_5x1},
     {tile_f32_6x1},
     {tile_f32_7x1},
     {tile_f32_8x1}},
    {{tile_b16_1x1, tile_b16_1x2, tile_b16_1x3},
     {tile_b16_2x1, tile_b16_2x2, tile_b16_2x3},
     {tile_b16_3x1, tile_b16_3x2, tile_b16_3x3},
     {tile_b16_4x1, tile_b16_4x2, tile_b16_4x3},
     {tile_b16_5x1},
     {tile_b16_6x1},
     {tile_b16_7x1},
     {tile_b16_8x1}},
};
#endif

/* ---- matrix products ----------------------------------------------------------- */

typedef struct matmul_job {
    float *out;
    const float *x;
    const float *w;      /* f32 weights, or NULL */
    const uint16_t *w16; /* bf16 weights, or NULL */
    uint32_t rows, n_in, n_out;
    bool avx2; /* chosen once per product, so every thread runs the same code */
} matmul_job;

static void matmul_portable(const matmul_job *j, uint32_t begin, uint32_t end) {
    const size_t in = j->n_in, on = j->n_out;
    for (uint32_t o = begin; o < end; o++) {
        const float *w = j->w ? j->w + o * in : NULL;
        const uint16_t *w16 = j->w16 ? j->w16 + o * in : NULL;
        for (uint32_t t = 0; t < j->rows; t++)
            j->out[t * on + o] = dot_portable(w, w16, j->x + t * in, j->n_in);
    }
}

#if defined(__x86_64__)
/* dst[r][i - k0] = w[r][i] (widened if bf16) for r < nw, k0 <= i < k1. */
AVX2 static void pack_block(float dst[TILE_W][K_BLOCK], const void *w, bool bf16, size_t n_in,
                            uint32_t nw, uint32_t k0, uint32_t k1) {
    for (uint32_t r = 0; r < nw; r++) {
        if (!bf16) {
            memcpy(dst[r], (const float *)w + r * n_in + k0, sizeof(float) * (k1 - k0));
            continue;
        }
        const uint16_t *src = (const uint16_t *)w + r * n_in;
        uint32_t i = k0;
        for (; i + LANES <= k1; i += LANES) _mm256_storeu_ps(&dst[r][i - k0], load_w(src, i, true));
        for (; i < k1; i++) dst[r][i - k0] = bf16_widen(src[i]);
    }
}

/* Where the weights of the block after (group at o, block b) start. */
static next_block following_block(const matmul_job *j, uint32_t o, uint32_t b, uint32_t blocks,
                                  uint32_t group, uint32_t end) {
    const size_t esz = j->w16 ? 2 : 4;
    const char *base = j->w16 ? (const char *)j->w16 : (const char *)j->w;
    if (b + 1 == blocks) o += group, b = 0;
    else b++;
    if (o >= end) return (next_block){.rows = 0};
    const uint32_t k0 = b * K_BLOCK, k1 = PD_MIN(j->n_in, k0 + K_BLOCK);
    return (next_block){.p = base + ((size_t)o * j->n_in + k0) * esz,
                        .seg_bytes = (k1 - k0) * esz,
                        .stride_bytes = j->n_in * esz,
                        .rows = PD_MIN(group, end - o)};
}

/* The tiles of rows [t0, t1) for the group and term block a describes,
 * asking for the next block's weights (if next.rows) as they go. */
AVX2 static void run_tiles(tile *a, const matmul_job *j, uint32_t t0, uint32_t t1, uint32_t o,
                           const tile_fn fns[TILE_W_MAX][TILE_X], uint32_t nw, __m256 *sums,
                           const next_block *next) {
    const uint32_t tiles = PD_DIV_CEIL(t1 - t0, TILE_X);
    const size_t per_row = PD_DIV_CEIL(next->seg_bytes, 64), lines = per_row * next->rows;
    for (uint32_t t = t0, ti = 0, nx; t < t1; t += nx, ti++) {
        /* tile ti asks for lines [l0, l1) of the next block */
        const size_t l0 = lines * ti / tiles, l1 = lines * (ti + 1) / tiles;
        a->walk = (prefetch_walk){.left = 0};
        if (lines)
            a->walk = (prefetch_walk){.row = next->p + l0 / per_row * next->stride_bytes,
                                      .line = l0 % per_row,
                                      .per_row = per_row,
                                      .stride_bytes = next->stride_bytes,
                                      .left = (uint32_t)(l1 - l0)};
        /* the last 4 rows as 2 + 2, not 3 + 1 (as many tiles, and a 4x1 tile
         * loads 5 vectors per 4 FMAs) */
        nx = t1 - t == 4 ? 2 : PD_MIN(TILE_X, t1 - t);
        a->x = j->x + t * a->n_in;
        a->sums = sums + (t - t0) * TILE_W_MAX;
        a->out = j->out + t * a->n_out + o;
        fns[nw - 1][nx - 1](a);
    }
}

/* Rows [t0, t1) (at most ROWS_BLOCK) x outputs [begin, end). */
AVX2 static void row_block(const matmul_job *j, uint32_t t0, uint32_t t1, uint32_t begin,
                           uint32_t end) {
    __m256 sums[ROWS_BLOCK * TILE_W_MAX];
    float packed[TILE_W][K_BLOCK];
    const size_t in = j->n_in, esz = j->w16 ? 2 : 4;
    const bool bf16 = j->w16 != NULL, one_row = t1 - t0 == 1;
    const uint32_t group = one_row ? TILE_W1 : TILE_W;
    /* one row reuses no weight: its weight rows stream whole */
    const uint32_t k_block = one_row ? j->n_in : K_BLOCK;
    const uint32_t blocks = j->n_in > k_block ? PD_DIV_CEIL(j->n_in, k_block) : 1;
    /* four tiles or more share each block: copy it (widened) to a buffer */
    const bool pack = t1 - t0 > 3 * TILE_X;
    const tile_fn(*fns)[TILE_X] = tile_fns[bf16 && !pack];
    for (uint32_t o = begin; o < end; o += group) {
        const uint32_t nw = PD_MIN(group, end - o);
        const void *w =
            (const char *)(bf16 ? (const void *)j->w16 : (const void *)j->w) + o * in * esz;
        tile a = {.w = pack ? (const void *)packed : w,
                  .w_stride = pack ? K_BLOCK : in,
                  .n_in = in,
                  .n_out = j->n_out,
                  .prefetch = one_row && o + 2 * group <= end && in * esz < 4096};
        for (uint32_t b = 0; b < blocks; b++) {
            a.k0 = b * k_block;
            a.k1 = PD_MIN(j->n_in, a.k0 + k_block);
            a.first = b == 0;
            a.last = b + 1 == blocks;
            next_block next = {.rows = 0};
            if (pack) {
                pack_block(packed, w, bf16, in, nw, a.k0, a.k1);
                a.w_k0 = a.k0;
            }
            if (!one_row) next = following_block(j, o, b, blocks, group, end);
            run_tiles(&a, j, t0, t1, o, fns, nw, sums, &next);
        }
    }
}

/* Outputs [begin, end) for every row: the loop nest of the header comment. */
AVX2 static void matmul_avx2(const matmul_job *j, uint32_t begin, uint32_t end) {
    for (uint32_t t0 = 0; t0 < j->rows; t0 += ROWS_BLOCK)
        row_block(j, t0, PD_MIN(j->rows, t0 + ROWS_BLOCK), begin, end);
}
#endif

static void matmul_range(void *ctx, uint32_t begin, uint32_t end, uint32_t worker) {
    (void)worker;
    const matmul_job *j = ctx;
#if defined(__x86_64__)
    if (j->avx2) {
        matmul_avx2(j, begin, end);
        return;
    }
#endif
    matmul_portable(j, begin, end);
}

static void matmul_run(const pd_par *par, matmul_job *job) {
    PD_ASSERT((job->w == NULL) != (job->w16 == NULL));
    job->avx2 = use_avx2();
    mdl_par_run(par, job->n_out, 2ull * job->rows * job->n_in * job->n_out, matmul_range, job);
}

void mdl_matmul(const pd_par *par, float *out, const float *x, const float *w, uint32_t rows,
                uint32_t n_in, uint32_t n_out) {
    matmul_job job = {.out = out, .x = x, .w = w, .rows = rows, .n_in = n_in, .n_out = n_out};
    matmul_run(par, &job);
}

void mdl_matmul_bf16(const pd_par *par, float *out, const float *x, const uint16_t *w,
                     uint32_t rows, uint32_t n_in, uint32_t n_out) {
    matmul_job job = {.out = out, .x = x, .w16 = w, .rows = rows, .n_in = n_in, .n_out = n_out};
    matmul_run(par, &job);
}

/* ---- the rest ------------------------------------------------------------------ */

float mdl_dot(const float *a, const float *b, uint32_t n) {
#if defined(__x86_64__)
    if (use_avx2()) return dot_avx2(a, b, n);
#endif
    return dot_portable(a, NULL, b, n);
}

void mdl_rmsnorm(float *out, const float *x, const float *w, uint32_t n, float eps) {
    PD_ASSERT(n > 0);
    float ms = mdl_dot(x, x, n) / (float)n;
    float inv = 1.0f / sqrtf(ms + eps);
    for (uint32_t i = 0; i < n; i++) out[i] = x[i] * inv * w[i];
}

float mdl_softplus(float x) {
    if (x > 20.0f) return x;
    double e = mdl_exp((double)x);
    /* log(1 + e); for tiny e the series keeps the digits 1 + e would lose */
    return (float)(e < 1e-5 ? e - 0.5 * e * e : mdl_log(1.0 + e));
}
