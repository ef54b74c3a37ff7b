/*
 * mamba2.c — the Mamba2 mixer (Dao & Gu, "Transformers are SSMs", 2024),
 * computed token by token so that a request's state after position p is the
 * same bits whether the positions came in one chunk or many.
 *
 * For one token with input u (dim), per layer:
 *
 *   [z | xBC | dt] = W_in u                    z: d_inner, dt: heads,
 *                                              xBC: d_inner + 2 * G * N
 *   xBC  = SiLU(causal depthwise conv(xBC) + bias)   window: the last
 *          d_conv - 1 raw inputs (the conv state) and this one
 *   [x | B | C] = xBC                          x: heads x P, B, C: G x N
 *   dt_h = softplus(dt_h + dt_bias_h),  A_h = -exp(A_log_h)
 *   for head h (group g = h / (heads / G)), p < P, n < N:
 *       S[h,p,n] = S[h,p,n] * exp(dt_h A_h) + (dt_h B[g,n]) x[h,p]
 *       y[h,p]   = sum_n S[h,p,n] C[g,n] + D_h x[h,p]
 *   y = RMSNorm_G(y * SiLU(z)) * w_norm        normalised per group of
 *                                              d_inner / G channels (all
 *                                              d_inner at once in Granite)
 *   out = W_out y
 *
 * This is the recurrent form the reference implementation uses for decode
 * (selective_state_update); prefill uses it too, instead of the chunked SSD
 * scan, because the chunked scan sums in an order that depends on the chunk
 * boundaries. Threads split channels (conv) and heads (scan); each row's
 * arithmetic is the same whichever thread runs it.
 */
#include <math.h>
#include <string.h>

#include "detmath.h"
#include "model_internal.h"

void mdl_mamba2_dims_from_config(const pd_model_config *cfg, pd_mamba2_dims *d) {
    memset(d, 0, sizeof(*d));
    d->dim = cfg->dim;
    d->d_inner = cfg->mamba_expand * cfg->dim;
    d->d_state = cfg->mamba_d_state;
    d->d_conv = cfg->mamba_d_conv;
    d->heads = cfg->mamba_heads;
    d->head_dim = cfg->mamba_heads ? d->d_inner / cfg->mamba_heads : 0;
    d->groups = cfg->mamba_groups;
    /* Granite normalises the gated output over all of d_inner (transformers'
     * RMSNormGated without groups); mamba_ssm's grouped norm otherwise. */
    d->norm_groups = cfg->arch == PD_ARCH_GRANITE ? 1 : cfg->mamba_groups;
    d->conv_dim = d->d_inner + 2 * d->groups * d->d_state;
    d->in_proj = 2 * d->d_inner + 2 * d->groups * d->d_state + d->heads;
    d->eps = cfg->norm_eps;
}

size_t mdl_mamba2_state_floats(const pd_mamba2_dims *d) {
    return (size_t)d->conv_dim * (d->d_conv - 1) + (size_t)d->d_inner * d->d_state;
}

size_t mdl_mamba2_scratch_floats(const pd_mamba2_dims *d, uint32_t rows_max) {
    return (size_t)rows_max * (d->in_proj + d->conv_dim + d->heads + d->d_inner);
}

void mdl_mamba2_scratch_bind(pd_mamba2_scratch *s, const pd_mamba2_dims *d, uint32_t rows_max,
                             float *mem) {
    s->zxbcdt = mem;
    s->xbc = s->zxbcdt + (size_t)rows_max * d->in_proj;
    s->dt = s->xbc + (size_t)rows_max * d->conv_dim;
    s->y = s->dt + (size_t)rows_max * d->heads;
}

typedef struct mamba_job {
    const pd_mamba2_dims *d;
    const pd_mamba2_weights *w;
    const pd_mamba2_scratch *s;
    float *const *state;
    uint32_t rows;
} mamba_job;

/* Causal depthwise conv over channels [begin, end), every row in order. The
 * channel's state holds its last d_conv - 1 raw inputs, oldest first; taps
 * are summed oldest to newest, then the bias. */
static void conv_channels(void *ctx, uint32_t begin, uint32_t end, uint32_t worker) {
    (void)worker;
    const mamba_job *j = ctx;
    const pd_mamba2_dims *d = j->d;
    uint32_t k_state = d->d_conv - 1;
    for (uint32_t c = begin; c < end; c++) {
        const float *w = j->w->conv_w + (size_t)c * d->d_conv;
        for (uint32_t t = 0; t < j->rows; t++) {
            float *st = j->state[t] + (size_t)c * k_state;
            float in = j->s->zxbcdt[(size_t)t * d->in_proj + d->d_inner + c];
            float acc = 0.0f;
            for (uint32_t k = 0; k < k_state; k++) acc += w[k] * st[k];
            acc += w[k_state] * in;
            acc += j->w->conv_b[c];
            memmove(st, st + 1, sizeof(float) * (k_state - 1));
            st[k_state - 1] = in;
            j->s->xbc[(size_t)t * d->conv_dim + c] = mdl_silu(acc);
        }
    }
}

/* The selective state update for heads [begin, end), every row in order. */
static void scan_heads(void *ctx, uint32_t begin, uint32_t end, uint32_t worker) {
    (void)worker;
    const mamba_job *j = ctx;
    const pd_mamba2_dims *d = j->d;
    const size_t conv_floats = (size_t)d->conv_dim * (d->d_conv - 1);
    const uint32_t heads_per_group = d->heads / d->groups;
    const uint32_t P = d->head_dim, N = d->d_state;
    for (uint32_t h = begin; h < end; h++) {
        const float a = -mdl_expf(j->w->a_log[h]);
        const float skip = j->w->d[h];
        const uint32_t g = h / heads_per_group;
        for (uint32_t t = 0; t < j->rows; t++) {
            const float *xbc = j->s->xbc + (size_t)t * d->conv_dim;
            const float *x = xbc + (size_t)h * P;
            const float *B = xbc + d->d_inner + (size_t)g * N;
            const float *C = xbc + d->d_inner + (size_t)d->groups * N + (size_t)g * N;
            const float dt = j->s->dt[(size_t)t * d->heads + h];
            const float decay = mdl_expf(dt * a);
            float *S = j->state[t] + conv_floats + (size_t)h * P * N;
            float *y = j->s->y + (size_t)t * d->d_inner + (size_t)h * P;
            for (uint32_t p = 0; p < P; p++) {
                float *Sp = S + (size_t)p * N;
                for (uint32_t n = 0; n < N; n++) Sp[n] = Sp[n] * decay + (dt * B[n]) * x[p];
                y[p] = mdl_dot(Sp, C, N) + skip * x[p];
            }
        }
    }
}

void mdl_mamba2_forward(const pd_par *par, const pd_mamba2_dims *d, const pd_mamba2_weights *w,
                        const float *in, float *out, uint32_t rows, float *const *state,
                        const pd_mamba2_scratch *s) {
    PD_ASSERT(d->d_conv >= 2 && d->heads % d->groups == 0 && d->d_inner % d->groups == 0);
    mamba_job job = {d, w, s, state, rows};

    /* 1. input projection: z, xBC and dt for every row */
    mdl_matmul_w(par, s->zxbcdt, in, w->in_proj, rows, d->dim, d->in_proj);

    /* 2. causal conv + SiLU, advancing each row's conv state */
    mdl_par_run(par, d->conv_dim, 2ull * rows * d->conv_dim * d->d_conv, conv_channels, &job);

    /* 3. step sizes */
    for (uint32_t t = 0; t < rows; t++) {
        const float *dt_raw = s->zxbcdt + (size_t)t * d->in_proj + d->d_inner + d->conv_dim;
        for (uint32_t h = 0; h < d->heads; h++)
            s->dt[(size_t)t * d->heads + h] = mdl_softplus(dt_raw[h] + w->dt_bias[h]);
    }

    /* 4. the selective scan, advancing each row's ssm state */
    mdl_par_run(par, d->heads, 5ull * rows * d->d_inner * d->d_state, scan_heads, &job);

    /* 5. gate with SiLU(z), then RMSNorm per group (norm_groups) */
    const uint32_t group = d->d_inner / d->norm_groups;
    for (uint32_t t = 0; t < rows; t++) {
        float *y = s->y + (size_t)t * d->d_inner;
        const float *z = s->zxbcdt + (size_t)t * d->in_proj;
        for (uint32_t i = 0; i < d->d_inner; i++) y[i] = y[i] * mdl_silu(z[i]);
        for (uint32_t g = 0; g < d->norm_groups; g++)
            mdl_rmsnorm(y + (size_t)g * group, y + (size_t)g * group, w->norm + (size_t)g * group,
                        group, d->eps);
    }

    /* 6. output projection */
    mdl_matmul_w(par, out, s->y, w->out_proj, rows, d->d_inner, d->dim);
}
