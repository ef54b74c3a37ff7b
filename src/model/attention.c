/*
 * attention.c — grouped-query attention with rotary positions over the paged
 * KV pool.
 *
 * For one token at position pos with input u (dim), per layer:
 *
 *   q = W_q u (heads x D),  k = W_k u, v = W_v u (kv_heads x D)
 *   q, k rotated by pos (RoPE, rotate-half: the pairs are (i, i + D/2), the
 *        convention of Hugging Face checkpoints)
 *   k, v stored in the request's page pages[pos / page_size], slot
 *        pos % page_size
 *   for head h (kv head h / (heads / kv_heads)):
 *       s_j = q_h . k_j / sqrt(D)  for j = 0 .. pos  (Granite: times
 *             attention_multiplier instead; and no rotation when its
 *             position_embedding_type is not "rope")
 *       a_h = sum_j softmax(s)_j v_j
 *   out = W_o a
 *
 * Every row's K and V are written before any row attends, so a chunk's later
 * tokens see its earlier ones. The scores are kept (two-pass softmax, as
 * llama2.c does) in a per-thread buffer as long as the pool's capacity in
 * tokens; positions are visited in increasing order whatever pages hold
 * them, so a score, the softmax sum and the value sum come out the same bits
 * for any chunking, page size or page placement. Threads split (row, head)
 * pairs.
 */
#include <math.h>
#include <string.h>

#include "detmath.h"
#include "model_internal.h"

float *mdl_kv_at(float *kv, const pd_attn_dims *d, uint32_t page, uint32_t slot, int which) {
    PD_ASSERT(page < d->kv_pages && slot < d->page_size);
    size_t block = ((size_t)d->layer * 2 + (size_t)which) * d->page_size + slot;
    return kv + (size_t)page * d->page_floats + block * d->kv_dim;
}

void mdl_rope_inv_freq(const pd_model_config *cfg, double *inv_freq) {
    const uint32_t head_dim = cfg->attn_head_dim, half = head_dim / 2;
    const double log_base = mdl_log((double)cfg->rope_base);
    for (uint32_t i = 0; i < half; i++)
        inv_freq[i] = mdl_exp(-2.0 * (double)i / (double)head_dim * log_base);
    if (cfg->rope_factor == 0.0f) return;
    /* llama3: wavelengths longer than original / low_freq_factor are slowed
     * by factor, shorter than original / high_freq_factor kept, and those
     * between blended linearly in original / wavelength. */
    const double factor = cfg->rope_factor, low = cfg->rope_low_freq_factor,
                 high = cfg->rope_high_freq_factor, orig = cfg->rope_original_max;
    const double two_pi = 6.283185307179586;
    for (uint32_t i = 0; i < half; i++) {
        double wavelen = two_pi / inv_freq[i];
        if (wavelen > orig / low) {
            inv_freq[i] /= factor;
        } else if (!(wavelen < orig / high)) {
            double smooth = (orig / wavelen - low) / (high - low);
            inv_freq[i] = (1.0 - smooth) * inv_freq[i] / factor + smooth * inv_freq[i];
        }
    }
}

void mdl_rope_angles(uint32_t pos, uint32_t half, const double *inv_freq, float *cos_out,
                     float *sin_out) {
    for (uint32_t i = 0; i < half; i++) {
        double s, c;
        mdl_sincos((double)pos * inv_freq[i], &s, &c);
        cos_out[i] = (float)c;
        sin_out[i] = (float)s;
    }
}

/* Rotate-half RoPE of one head vector in place. */
static void rope(float *v, const float *c, const float *s, uint32_t head_dim) {
    uint32_t half = head_dim / 2;
    for (uint32_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i] + a * s[i];
    }
}

typedef struct attn_job {
    const pd_attn_dims *d;
    const pd_attn_rows *r;
    const pd_attn_scratch *s;
    float *kv;
} attn_job;

/* Attention of (row, head) pairs [begin, end): unit u is row u / heads,
 * head u % heads. */
static void attend(void *ctx, uint32_t begin, uint32_t end, uint32_t worker) {
    const attn_job *j = ctx;
    const pd_attn_dims *d = j->d;
    const uint32_t D = d->head_dim, group = d->heads / d->kv_heads;
    const float scale = sqrtf((float)D);
    float *scores = j->s->scores + (size_t)worker * j->s->context_max;
    for (uint32_t u = begin; u < end; u++) {
        const uint32_t t = u / d->heads, h = u % d->heads, kvh = h / group;
        const uint32_t n = j->r->pos[t] + 1;
        const uint32_t *pages = j->r->pages[t];
        const float *q = j->s->q + (size_t)t * d->q_dim + (size_t)h * D;
        PD_ASSERT(n <= j->s->context_max);

        /* scores, page by page, positions in increasing order */
        float max = -INFINITY;
        for (uint32_t p0 = 0; p0 < n; p0 += d->page_size) {
            const float *k = mdl_kv_at(j->kv, d, pages[p0 / d->page_size], 0, 0) + (size_t)kvh * D;
            const uint32_t m = PD_MIN(d->page_size, n - p0);
            for (uint32_t s = 0; s < m; s++) {
                float dot = mdl_dot(q, k + (size_t)s * d->kv_dim, D);
                float sc = d->score_mult != 0.0f ? dot * d->score_mult : dot / scale;
                scores[p0 + s] = sc;
                if (sc > max) max = sc;
            }
        }
        float sum = 0.0f;
        for (uint32_t p = 0; p < n; p++) {
            scores[p] = mdl_expf(scores[p] - max);
            sum += scores[p];
        }
        /* the softmax-weighted sum of values, same order */
        float *a = j->s->att + (size_t)t * d->q_dim + (size_t)h * D;
        memset(a, 0, sizeof(float) * D);
        for (uint32_t p0 = 0; p0 < n; p0 += d->page_size) {
            const float *v = mdl_kv_at(j->kv, d, pages[p0 / d->page_size], 0, 1) + (size_t)kvh * D;
            const uint32_t m = PD_MIN(d->page_size, n - p0);
            for (uint32_t s = 0; s < m; s++) {
                const float weight = scores[p0 + s] / sum;
                const float *vs = v + (size_t)s * d->kv_dim;
                for (uint32_t i = 0; i < D; i++) a[i] += weight * vs[i];
            }
        }
    }
}

uint64_t mdl_attention_forward(const pd_par *par, const pd_attn_dims *d, const pd_attn_weights *w,
                               const float *in, float *out, uint32_t rows, const pd_attn_rows *r,
                               float *kv, const pd_attn_scratch *s) {
    PD_ASSERT(d->heads % d->kv_heads == 0 && d->head_dim % 2 == 0 && d->layer < d->n_attn);
    const uint32_t D = d->head_dim, half = D / 2;

    /* 1. projections */
    mdl_matmul_w(par, s->q, in, w->wq, rows, d->dim, d->q_dim);
    mdl_matmul_w(par, s->k, in, w->wk, rows, d->dim, d->kv_dim);
    mdl_matmul_w(par, s->v, in, w->wv, rows, d->dim, d->kv_dim);

    /* 2. rotate q and k by each row's position; 3. store k and v in the page */
    uint64_t context = 0;
    for (uint32_t t = 0; t < rows; t++) {
        const float *c = r->rope_cos + (size_t)t * half, *sn = r->rope_sin + (size_t)t * half;
        float *q = s->q + (size_t)t * d->q_dim, *k = s->k + (size_t)t * d->kv_dim;
        const float *v = s->v + (size_t)t * d->kv_dim;
        for (uint32_t h = 0; w->q_norm && h < d->heads; h++)
            mdl_rmsnorm(q + (size_t)h * D, q + (size_t)h * D, w->q_norm, D, d->norm_eps);
        for (uint32_t h = 0; w->k_norm && h < d->kv_heads; h++)
            mdl_rmsnorm(k + (size_t)h * D, k + (size_t)h * D, w->k_norm, D, d->norm_eps);
        for (uint32_t h = 0; !d->no_rope && h < d->heads; h++) rope(q + (size_t)h * D, c, sn, D);
        for (uint32_t h = 0; !d->no_rope && h < d->kv_heads; h++) rope(k + (size_t)h * D, c, sn, D);
        uint32_t pos = r->pos[t];
        uint32_t page = r->pages[t][pos / d->page_size], slot = pos % d->page_size;
        PD_ASSERT(page < d->kv_pages); /* page tables are checked at launch */
        memcpy(mdl_kv_at(kv, d, page, slot, 0), k, sizeof(float) * d->kv_dim);
        memcpy(mdl_kv_at(kv, d, page, slot, 1), v, sizeof(float) * d->kv_dim);
        context += pos + 1;
    }

    /* 4. every (row, head) attends over its request's positions [0, pos] */
    attn_job job = {d, r, s, kv};
    uint64_t flops = 4ull * context * d->q_dim;
    mdl_par_run(par, rows * d->heads, flops, attend, &job);

    /* 5. output projection */
    mdl_matmul_w(par, out, s->att, w->wo, rows, d->q_dim, d->dim);
    return flops;
}
