/*
 * Internals shared by the files of src/model: the weight structure, the two
 * mixers (Mamba2 and paged attention) as standalone layer functions, and the
 * sampler. The tests include this header to check a layer against a slow
 * reference; nothing outside src/model and tests/model should.
 */
#ifndef PDSERVE_MODEL_INTERNAL_H
#define PDSERVE_MODEL_INTERNAL_H

#include <jansson.h>

#include "kernels.h"
#include "pdserve/executor.h"
#include "pdserve/model.h"

/* ---- weights ------------------------------------------------------------- */

#define PD_TENSOR_NAME_BYTES 64
#define PD_MODEL_TENSORS_MAX (4 + PD_MODEL_LAYERS_MAX * 13)

/* How seeded dummy weights are drawn (weights.c, docs/model.md). */
typedef enum pd_init {
    PD_INIT_ONES,     /* norm weights, the D skip */
    PD_INIT_NEAR_ONE, /* 1 + U(+-scale): norm weights of Llama and Qwen3 */
    PD_INIT_NORMAL,   /* N(0, scale^2), scale 0: N(0, 1): token embeddings */
    PD_INIT_UNIFORM,  /* U(-scale, scale) */
    PD_INIT_DT_BIAS,  /* softplus^-1 of dt, log-uniform in [1e-3, 1e-1] */
    PD_INIT_A_LOG,    /* log of U[1, 16] */
} pd_init;

typedef struct pd_tensor_entry {
    char name[PD_TENSOR_NAME_BYTES];
    uint32_t ndim;
    uint64_t shape[3];
    uint64_t elems;
    bool bf16;       /* kept as bf16 (a matrix of a bf16 checkpoint) */
    uint64_t offset; /* in floats inside pd_model.data, or in halves
                                 * inside pd_model.data16 when bf16 */
    pd_init init;
    double scale;               /* PD_INIT_UNIFORM bound */
} pd_tensor_entry;

/* A weight matrix [n_out][n_in]: fp32, or the bf16 of a bf16 checkpoint,
 * widened as the kernel reads it (exact, so the result is the same bits as
 * the fp32 product of the widened values). Exactly one pointer is set. */
typedef struct pd_wmat {
    const float *f32;
    const uint16_t *bf16;
} pd_wmat;

static inline void mdl_matmul_w(const pd_par *par, float *out, const float *x, pd_wmat w,
                                uint32_t rows, uint32_t n_in, uint32_t n_out) {
    if (w.bf16) mdl_matmul_bf16(par, out, x, w.bf16, rows, n_in, n_out);
    else mdl_matmul(par, out, x, w.f32, rows, n_in, n_out);
}

/* Row r of w (n columns) widened into out. */
static inline void mdl_wmat_row(pd_wmat w, uint64_t r, uint32_t n, float *out) {
    if (w.f32) {
        for (uint32_t i = 0; i < n; i++) out[i] = w.f32[r * n + i];
        return;
    }
    for (uint32_t i = 0; i < n; i++) out[i] = pd_bf16_to_f32(w.bf16[r * n + i]);
}

typedef struct pd_attn_weights {
    pd_wmat wq, wk, wv, wo;       /* [q_dim][dim], [kv_dim][dim] x2, [dim][q_dim] */
    const float *q_norm, *k_norm; /* [head_dim] (Qwen3), or NULL: no q/k norm */
} pd_attn_weights;

typedef struct pd_mamba2_weights {
    pd_wmat in_proj;      /* [in_proj][dim]: rows z | x | B | C | dt */
    const float *conv_w;  /* [conv_dim][1][d_conv], tap d_conv-1 = newest */
    const float *conv_b;  /* [conv_dim] */
    const float *dt_bias; /* [heads] */
    const float *a_log;   /* [heads]; A = -exp(A_log) */
    const float *d;       /* [heads] skip */
    const float *norm;    /* [d_inner] gated RMSNorm weight */
    pd_wmat out_proj;     /* [dim][d_inner] */
} pd_mamba2_weights;

typedef struct pd_block_weights {
    char kind;                  /* 'M' or 'A' */
    uint32_t kind_index;        /* index among layers of the same kind */
    const float *norm_mixer;    /* [dim] */
    const float *norm_mlp;      /* [dim] */
    pd_attn_weights attn;
    pd_mamba2_weights mamba;
    pd_wmat gate, up; /* [mlp_hidden][dim] */
    pd_wmat down;     /* [dim][mlp_hidden] */
} pd_block_weights;

struct pd_model {
    pd_model_config cfg;
    pd_model_shape shape;
    float *data; /* every fp32 tensor, one allocation */
    uint64_t n_floats;
    uint16_t *data16; /* every bf16 one (NULL when none) */
    uint64_t n_halves;
    pd_tensor_entry tensors[PD_MODEL_TENSORS_MAX];
    uint32_t n_tensors;
    pd_wmat embed;           /* [vocab][dim] */
    const float *final_norm; /* [dim] */
    pd_wmat lm_head;         /* [vocab][dim]; == embed when tied */
    pd_block_weights blocks[PD_MODEL_LAYERS_MAX];
};

/* config.json: read and check, or write (config.c). */
pd_err mdl_config_read(pd_model_config *cfg, const char *path, char *msg, size_t msg_cap);
pd_err mdl_config_write(const pd_model_config *cfg, const char *path, char *msg, size_t msg_cap);
/* hf_config.c: a Hugging Face config.json (one with "architectures") into
 * *cfg, checked; and the config.json of a Llama or Qwen3 config. */
pd_err mdl_hf_config_parse(pd_model_config *cfg, const json_t *root, const char *path, char *msg,
                           size_t msg_cap);
json_t *mdl_hf_config_json(const pd_model_config *cfg);
/* The double nearest to the shortest decimal that reads back as f (config.json
 * says 1e-05, not 9.9999997473787516e-06). */
double mdl_short_real(float f);

/* ---- Mamba2 mixer ---------------------------------------------------------- */

typedef struct pd_mamba2_dims {
    uint32_t dim, d_inner, d_state, d_conv, heads, head_dim, groups;
    uint32_t norm_groups; /* groups of the gated RMSNorm: groups, or 1 (Granite) */
    uint32_t conv_dim;    /* d_inner + 2 * groups * d_state */
    uint32_t in_proj;     /* 2 * d_inner + 2 * groups * d_state + heads */
    float eps;
} pd_mamba2_dims;

void mdl_mamba2_dims_from_config(const pd_model_config *cfg, pd_mamba2_dims *out);
/* Floats of one layer's state: conv [conv_dim][d_conv-1] then ssm
 * [heads][head_dim][d_state]. */
size_t mdl_mamba2_state_floats(const pd_mamba2_dims *d);

/* Scratch for rows_max rows (see mdl_mamba2_scratch_floats). */
typedef struct pd_mamba2_scratch {
    float *zxbcdt;              /* [rows][in_proj] */
    float *xbc;                 /* [rows][conv_dim] after conv + SiLU */
    float *dt;                  /* [rows][heads] after softplus */
    float *y;                   /* [rows][d_inner] */
} pd_mamba2_scratch;

size_t mdl_mamba2_scratch_floats(const pd_mamba2_dims *d, uint32_t rows_max);
void mdl_mamba2_scratch_bind(pd_mamba2_scratch *s, const pd_mamba2_dims *d, uint32_t rows_max,
                             float *mem);

/* The Mamba2 mixer over rows in order: in [rows][dim] -> out [rows][dim].
 * Row t reads and advances the layer state at state[t] (rows of one request
 * share a pointer and come in position order). */
void mdl_mamba2_forward(const pd_par *par, const pd_mamba2_dims *d, const pd_mamba2_weights *w,
                        const float *in, float *out, uint32_t rows, float *const *state,
                        const pd_mamba2_scratch *s);

/* ---- attention over the paged KV pool ------------------------------------- */

typedef struct pd_attn_dims {
    uint32_t dim, heads, kv_heads, head_dim;
    uint32_t q_dim, kv_dim;
    float norm_eps;   /* the q/k norms' */
    float score_mult; /* scores = q.k * score_mult; 0: q.k / sqrt(head_dim) */
    bool no_rope;     /* positions are not rotated in (Granite's "nope") */
    uint32_t page_size;
    uint32_t kv_pages;          /* pages in the pool */
    uint32_t n_attn;            /* attention layers in a page */
    uint32_t layer;             /* this layer's index among them */
    size_t page_floats;         /* floats per KV page */
} pd_attn_dims;

/* Where each row sits: its position, its request's page table, and the
 * RoPE cos/sin of its position ([rows][head_dim / 2] each). */
typedef struct pd_attn_rows {
    const uint32_t *pos;
    const uint32_t *const *pages;
    const float *rope_cos, *rope_sin;
} pd_attn_rows;

typedef struct pd_attn_scratch {
    float *q;                   /* [rows][q_dim] */
    float *k, *v;               /* [rows][kv_dim] */
    float *att;                 /* [rows][q_dim] */
    float *scores;              /* [threads][context_max] */
    size_t context_max;
} pd_attn_scratch;

/* Address of K (which = 0) or V (which = 1) of one token slot of one page. */
float *mdl_kv_at(float *kv, const pd_attn_dims *d, uint32_t page, uint32_t slot, int which);

/* Writes each row's K and V into its page slot, then attends every row over
 * positions [0, pos] of its request. in [rows][dim] -> out [rows][dim].
 * Returns the FLOPs of the score and value sums. */
uint64_t mdl_attention_forward(const pd_par *par, const pd_attn_dims *d, const pd_attn_weights *w,
                               const float *in, float *out, uint32_t rows, const pd_attn_rows *r,
                               float *kv, const pd_attn_scratch *s);

/* The head_dim / 2 rotation frequencies base^(-2i / head_dim), in double,
 * adjusted by the config's llama3 rope_scaling when it has one. */
void mdl_rope_inv_freq(const pd_model_config *cfg, double *inv_freq);
/* cos/sin of position pos for those frequencies, rounded once. */
void mdl_rope_angles(uint32_t pos, uint32_t half, const double *inv_freq, float *cos_out,
                     float *sin_out);

/* ---- sampling ---------------------------------------------------------------- */

/* Picks the next token from logits[0..vocab) by the rules at the top of
 * sample.c: penalties from history (the sample_index tokens generated so
 * far; NULL when the sampling is not penalised), greedy or tempered with the
 * top_k / top_p / min_p cuts, drawn with a generator seeded by (seed,
 * sample_index). Writes out->token, out->logprob (the model's log-softmax of
 * the token) and out->n_top, and the top_logprobs alternatives into *top
 * (none when top is NULL: n_top 0). probs and keys are vocab-sized
 * scratch. */
void mdl_sample(const float *logits, uint32_t vocab, const pd_sampling *sp, uint32_t sample_index,
                const int32_t *history, float *probs, uint64_t *keys, pd_item_result *out,
                pd_item_top *top);

#endif
