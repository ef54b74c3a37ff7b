/*
 * weights.c — the model's tensors: their table, seeded dummy values, and the
 * model directory (config.json + model.safetensors) in both directions.
 *
 * The table is a pure function of the config: names, shapes, and where each
 * tensor lives inside one fp32 allocation. Creating, loading and saving all
 * walk the same table, so a file written by `pdserve model init` is by
 * construction the file the loader expects, and the loader can say exactly
 * which tensor is missing, surplus, misshapen or of the wrong dtype.
 *
 * Names follow the Hugging Face convention for hybrid checkpoints:
 *   model.embed_tokens.weight, model.norm.weight, lm_head.weight,
 *   model.layers.N.{input_layernorm, pre_ff_layernorm}.weight,
 *   model.layers.N.self_attn.{q,k,v,o}_proj.weight,
 *   model.layers.N.mamba.{in_proj.weight, conv1d.weight, conv1d.bias,
 *                         dt_bias, A_log, D, norm.weight, out_proj.weight},
 *   model.layers.N.mlp.{gate,up,down}_proj.weight.
 *
 * Dummy values are drawn per tensor from a generator seeded by (seed, name),
 * so adding a tensor to the model does not change the others. The
 * distributions are the usual ones (docs/model.md): PyTorch's Linear default
 * U(+-1/sqrt(fan_in)), residual output projections further scaled by
 * 1/sqrt(2 * layers) as GPT-2 and Mamba do, N(0, 1) embeddings, and the
 * Mamba2 recipe for dt_bias (inverse softplus of a log-uniform dt in
 * [0.001, 0.1]), A_log = log U[1, 16] and D = 1. With those, the Mamba state
 * decays at rates between exp(-16 * 0.1) and exp(-0.001) per token and the
 * activations stay bounded over long prompts.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "detmath.h"
#include "model_internal.h"

/* ---- the table ----------------------------------------------------------- */

static void add(pd_model *m, pd_init init, double scale, uint32_t ndim, uint64_t s0, uint64_t s1,
                uint64_t s2, const char *fmt, int layer) {
    PD_ASSERT(m->n_tensors < PD_MODEL_TENSORS_MAX);
    pd_tensor_entry *t = &m->tensors[m->n_tensors++];
    int n = snprintf(t->name, sizeof(t->name), fmt, layer);
    PD_ASSERT(n > 0 && (size_t)n < sizeof(t->name));
    t->ndim = ndim;
    t->shape[0] = s0;
    t->shape[1] = s1;
    t->shape[2] = s2;
    t->elems = s0 * (ndim > 1 ? s1 : 1) * (ndim > 2 ? s2 : 1);
    t->offset = m->n_floats;
    t->init = init;
    t->scale = scale;
    m->n_floats += t->elems;
}

/* The norm before the MLP: Llama and Qwen3 call it post_attention_layernorm. */
static const char *norm_mlp_name(const pd_model_config *c) {
    return c->arch == PD_ARCH_HYBRID ? "model.layers.%d.pre_ff_layernorm.weight"
                                     : "model.layers.%d.post_attention_layernorm.weight";
}

/* Layer i's MLP: gate, up and down (Granite: gate and up as one matrix). */
static void add_mlp(pd_model *m, int i, double in_scale, double out_scale) {
    const pd_model_config *c = &m->cfg;
    if (c->arch == PD_ARCH_GRANITE) {
        /* the gate's rows, then the up projection's */
        add(m, PD_INIT_UNIFORM, in_scale, 2, 2ull * c->mlp_hidden, c->dim, 0,
            "model.layers.%d.shared_mlp.input_linear.weight", i);
        add(m, PD_INIT_UNIFORM, out_scale, 2, c->dim, c->mlp_hidden, 0,
            "model.layers.%d.shared_mlp.output_linear.weight", i);
        return;
    }
    add(m, PD_INIT_UNIFORM, in_scale, 2, c->mlp_hidden, c->dim, 0,
        "model.layers.%d.mlp.gate_proj.weight", i);
    add(m, PD_INIT_UNIFORM, in_scale, 2, c->mlp_hidden, c->dim, 0,
        "model.layers.%d.mlp.up_proj.weight", i);
    add(m, PD_INIT_UNIFORM, out_scale, 2, c->dim, c->mlp_hidden, 0,
        "model.layers.%d.mlp.down_proj.weight", i);
}

static void build_table(pd_model *m) {
    const pd_model_config *c = &m->cfg;
    const pd_model_shape *s = &m->shape;
    /* Granite's multipliers are undone in its dummy weights (embeddings
     * divided by embedding_multiplier, sublayer outputs by
     * residual_multiplier, lm_head times logits_scaling), so that every
     * sublayer moves the logits as much as in the hybrid and a test against
     * another implementation sees each one. */
    const bool granite = c->arch == PD_ARCH_GRANITE;
    double res = 1.0 / sqrt(2.0 * s->n_layers); /* residual-output scaling */
    if (granite && c->residual_mult > 0) res /= c->residual_mult;
    double in_dim = 1.0 / sqrt((double)c->dim);
    double embed = granite && c->embed_mult > 0 ? 1.0 / c->embed_mult : 0.0;
    double head = granite && c->logits_div > 0 ? in_dim * c->logits_div : in_dim;
    /* Norm weights: ones in the hybrid (as always: its seeds keep their
     * weights); 1 +- 0.2 in Llama and Qwen3, so that a test against another
     * implementation sees every norm weight applied. */
    pd_init norm = c->arch == PD_ARCH_HYBRID ? PD_INIT_ONES : PD_INIT_NEAR_ONE;
    double norm_scale = c->arch == PD_ARCH_HYBRID ? 0.0 : 0.2;
    m->n_tensors = 0;
    m->n_floats = 0;
    add(m, PD_INIT_NORMAL, embed, 2, c->vocab, c->dim, 0, "model.embed_tokens.weight", 0);
    for (uint32_t l = 0; l < s->n_layers; l++) {
        int i = (int)l;
        add(m, norm, norm_scale, 1, c->dim, 0, 0, "model.layers.%d.input_layernorm.weight", i);
        if (c->layers[l] == 'A') {
            add(m, PD_INIT_UNIFORM, in_dim, 2, s->q_dim, c->dim, 0,
                "model.layers.%d.self_attn.q_proj.weight", i);
            add(m, PD_INIT_UNIFORM, in_dim, 2, s->kv_dim, c->dim, 0,
                "model.layers.%d.self_attn.k_proj.weight", i);
            add(m, PD_INIT_UNIFORM, in_dim, 2, s->kv_dim, c->dim, 0,
                "model.layers.%d.self_attn.v_proj.weight", i);
            add(m, PD_INIT_UNIFORM, res / sqrt((double)s->q_dim), 2, c->dim, s->q_dim, 0,
                "model.layers.%d.self_attn.o_proj.weight", i);
            if (c->arch == PD_ARCH_QWEN3) {
                add(m, norm, norm_scale, 1, c->attn_head_dim, 0, 0,
                    "model.layers.%d.self_attn.q_norm.weight", i);
                add(m, norm, norm_scale, 1, c->attn_head_dim, 0, 0,
                    "model.layers.%d.self_attn.k_norm.weight", i);
            }
        } else {
            double conv = 1.0 / sqrt((double)c->mamba_d_conv);
            add(m, PD_INIT_UNIFORM, in_dim, 2, s->mamba_in_proj, c->dim, 0,
                "model.layers.%d.mamba.in_proj.weight", i);
            add(m, PD_INIT_UNIFORM, conv, 3, s->mamba_conv_dim, 1, c->mamba_d_conv,
                "model.layers.%d.mamba.conv1d.weight", i);
            add(m, PD_INIT_UNIFORM, conv, 1, s->mamba_conv_dim, 0, 0,
                "model.layers.%d.mamba.conv1d.bias", i);
            add(m, PD_INIT_DT_BIAS, 0, 1, c->mamba_heads, 0, 0, "model.layers.%d.mamba.dt_bias", i);
            add(m, PD_INIT_A_LOG, 0, 1, c->mamba_heads, 0, 0, "model.layers.%d.mamba.A_log", i);
            add(m, norm, norm_scale, 1, c->mamba_heads, 0, 0, "model.layers.%d.mamba.D", i);
            add(m, norm, norm_scale, 1, s->mamba_d_inner, 0, 0, "model.layers.%d.mamba.norm.weight",
                i);
            add(m, PD_INIT_UNIFORM, res / sqrt((double)s->mamba_d_inner), 2, c->dim,
                s->mamba_d_inner, 0, "model.layers.%d.mamba.out_proj.weight", i);
        }
        add(m, norm, norm_scale, 1, c->dim, 0, 0, norm_mlp_name(c), i);
        add_mlp(m, i, in_dim, res / sqrt((double)c->mlp_hidden));
    }
    add(m, norm, norm_scale, 1, c->dim, 0, 0, "model.norm.weight", 0);
    if (!c->tie_embeddings)
        add(m, PD_INIT_UNIFORM, head, 2, c->vocab, c->dim, 0, "lm_head.weight", 0);
    PD_ASSERT(m->n_floats == s->params);
}

static const pd_tensor_entry *entry(const pd_model *m, const char *name) {
    for (uint32_t i = 0; i < m->n_tensors; i++)
        if (!strcmp(m->tensors[i].name, name)) return &m->tensors[i];
    return NULL;
}

static const pd_tensor_entry *named(const pd_model *m, const char *fmt, uint32_t layer) {
    char name[PD_TENSOR_NAME_BYTES];
    snprintf(name, sizeof(name), fmt, (int)layer);
    const pd_tensor_entry *t = entry(m, name);
    PD_ASSERTF(t != NULL, "no tensor %s", name);
    return t;
}

/* An fp32 tensor (vectors and the conv kernel are never kept as bf16). */
static const float *ptr(const pd_model *m, const char *fmt, uint32_t layer) {
    const pd_tensor_entry *t = named(m, fmt, layer);
    PD_ASSERT(!t->bf16);
    return m->data + t->offset;
}

/* A matrix, fp32 or bf16, from row `from` on. */
static pd_wmat wmat(const pd_model *m, const char *fmt, uint32_t layer, uint64_t from) {
    const pd_tensor_entry *t = named(m, fmt, layer);
    const uint64_t at = t->offset + from * t->shape[1];
    return t->bf16 ? (pd_wmat){NULL, m->data16 + at} : (pd_wmat){m->data + at, NULL};
}

/* Points the per-layer weight structs into data and data16. */
static void bind(pd_model *m) {
    uint32_t n_attn = 0, n_mamba = 0;
    const bool granite = m->cfg.arch == PD_ARCH_GRANITE;
    m->embed = wmat(m, "model.embed_tokens.weight", 0, 0);
    m->final_norm = ptr(m, "model.norm.weight", 0);
    m->lm_head = m->cfg.tie_embeddings ? m->embed : wmat(m, "lm_head.weight", 0, 0);
    for (uint32_t l = 0; l < m->shape.n_layers; l++) {
        pd_block_weights *b = &m->blocks[l];
        b->kind = m->cfg.layers[l];
        b->norm_mixer = ptr(m, "model.layers.%d.input_layernorm.weight", l);
        b->norm_mlp = ptr(m, norm_mlp_name(&m->cfg), l);
        const char *in = granite ? "model.layers.%d.shared_mlp.input_linear.weight"
                                 : "model.layers.%d.mlp.gate_proj.weight";
        b->gate = wmat(m, in, l, 0);
        b->up = granite ? wmat(m, in, l, m->cfg.mlp_hidden)
                        : wmat(m, "model.layers.%d.mlp.up_proj.weight", l, 0);
        b->down = wmat(m,
                       granite ? "model.layers.%d.shared_mlp.output_linear.weight"
                               : "model.layers.%d.mlp.down_proj.weight",
                       l, 0);
        if (b->kind == 'A') {
            b->kind_index = n_attn++;
            b->attn.wq = wmat(m, "model.layers.%d.self_attn.q_proj.weight", l, 0);
            b->attn.wk = wmat(m, "model.layers.%d.self_attn.k_proj.weight", l, 0);
            b->attn.wv = wmat(m, "model.layers.%d.self_attn.v_proj.weight", l, 0);
            b->attn.wo = wmat(m, "model.layers.%d.self_attn.o_proj.weight", l, 0);
            if (m->cfg.arch == PD_ARCH_QWEN3) {
                b->attn.q_norm = ptr(m, "model.layers.%d.self_attn.q_norm.weight", l);
                b->attn.k_norm = ptr(m, "model.layers.%d.self_attn.k_norm.weight", l);
            }
        } else {
            b->kind_index = n_mamba++;
            b->mamba.in_proj = wmat(m, "model.layers.%d.mamba.in_proj.weight", l, 0);
            b->mamba.conv_w = ptr(m, "model.layers.%d.mamba.conv1d.weight", l);
            b->mamba.conv_b = ptr(m, "model.layers.%d.mamba.conv1d.bias", l);
            b->mamba.dt_bias = ptr(m, "model.layers.%d.mamba.dt_bias", l);
            b->mamba.a_log = ptr(m, "model.layers.%d.mamba.A_log", l);
            b->mamba.d = ptr(m, "model.layers.%d.mamba.D", l);
            b->mamba.norm = ptr(m, "model.layers.%d.mamba.norm.weight", l);
            b->mamba.out_proj = wmat(m, "model.layers.%d.mamba.out_proj.weight", l, 0);
        }
    }
}

/* A model with its table (every tensor fp32 until a loader says otherwise)
 * and no storage yet. */
static pd_err model_table(pd_model **out, const pd_model_config *cfg, char *msg, size_t cap) {
    *out = NULL;
    pd_err err = pd_model_config_check(cfg, msg, cap);
    if (err != PD_OK) return err;
    pd_model *m = calloc(1, sizeof(*m));
    if (!m) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    m->cfg = *cfg;
    pd_model_config_shape(cfg, &m->shape);
    build_table(m);
    *out = m;
    return PD_OK;
}

/* Offsets from the tensors' bf16 flags, zeroed storage, and the pointers. */
static pd_err model_storage(pd_model *m, char *msg, size_t cap) {
    m->n_floats = m->n_halves = 0;
    for (uint32_t i = 0; i < m->n_tensors; i++) {
        pd_tensor_entry *t = &m->tensors[i];
        uint64_t *n = t->bf16 ? &m->n_halves : &m->n_floats;
        t->offset = *n;
        *n += t->elems;
    }
    m->data = calloc(m->n_floats ? m->n_floats : 1, sizeof(float));
    m->data16 = m->n_halves ? calloc(m->n_halves, sizeof(uint16_t)) : NULL;
    if (!m->data || (m->n_halves && !m->data16))
        return pd_errorf(msg, cap, PD_ERR_NOMEM, "cannot allocate %llu + %llu weights",
                         (unsigned long long)m->n_floats, (unsigned long long)m->n_halves);
    bind(m);
    return PD_OK;
}

/* ---- seeded dummy weights -------------------------------------------------- */

static double normal(pd_rng *rng) {
    double u1 = 1.0 - pd_rng_unit(rng); /* (0, 1] */
    double u2 = pd_rng_unit(rng);
    double s, c;
    mdl_sincos(6.283185307179586 * u2, &s, &c);
    return sqrt(-2.0 * mdl_log(u1)) * c;
}

static void fill(float *v, const pd_tensor_entry *t, uint64_t seed) {
    pd_rng rng;
    /* pd_hash_str is the FNV-1a + finaliser this always was: the same seed
     * still gives the same weights. */
    pd_rng_seed(&rng, pd_hash_u64(seed) ^ pd_hash_str(t->name));
    for (uint64_t i = 0; i < t->elems; i++) {
        double x = 0;
        switch (t->init) {
        case PD_INIT_ONES: x = 1.0; break;
        case PD_INIT_NEAR_ONE: x = 1.0 + (2.0 * pd_rng_unit(&rng) - 1.0) * t->scale; break;
        case PD_INIT_NORMAL: x = normal(&rng) * (t->scale > 0 ? t->scale : 1.0); break;
        case PD_INIT_UNIFORM: x = (2.0 * pd_rng_unit(&rng) - 1.0) * t->scale; break;
        case PD_INIT_DT_BIAS: {
            double lo = mdl_log(1e-3), hi = mdl_log(1e-1);
            double dt = mdl_exp(lo + pd_rng_unit(&rng) * (hi - lo));
            x = dt + mdl_log(1.0 - mdl_exp(-dt)); /* softplus(x) == dt */
            break;
        }
        case PD_INIT_A_LOG: x = mdl_log(1.0 + 15.0 * pd_rng_unit(&rng)); break;
        }
        v[i] = (float)x;
    }
}

pd_err pd_model_create_random(pd_model **out, const pd_model_config *cfg, uint64_t seed, char *msg,
                              size_t cap) {
    pd_model *m = NULL;
    pd_err err = model_table(&m, cfg, msg, cap);
    if (err == PD_OK) err = model_storage(m, msg, cap);
    if (err != PD_OK) {
        pd_model_destroy(m);
        return err;
    }
    for (uint32_t i = 0; i < m->n_tensors; i++)
        fill(m->data + m->tensors[i].offset, &m->tensors[i], seed);
    *out = m;
    return PD_OK;
}

/* ---- the model directory ---------------------------------------------------- */

static pd_err join(char *out, size_t cap, const char *dir, const char *file, char *msg,
                   size_t mcap) {
    int n = snprintf(out, cap, "%s/%s", dir, file);
    if (n < 0 || (size_t)n >= cap)
        return pd_errorf(msg, mcap, PD_ERR_INVALID, "model directory path too long");
    return PD_OK;
}

static void shape_text(char *out, size_t cap, uint32_t ndim, const uint64_t *shape) {
    pd_strbuf sb;
    pd_strbuf_init(&sb, out, cap);
    pd_strbuf_append(&sb, "[");
    for (uint32_t d = 0; d < ndim; d++)
        pd_strbuf_printf(&sb, "%s%llu", d ? ", " : "", (unsigned long long)shape[d]);
    pd_strbuf_append(&sb, "]");
}

/* Every table tensor present with its shape and an accepted dtype, and no
 * tensor the model does not have. */
/* ---- the checkpoint's files ------------------------------------------------------ */

/* The weights of a model directory: model.safetensors, or the shards that
 * model.safetensors.index.json names ("weight_map": tensor -> file). */
#define SHARDS_MAX 256u
#define INDEX_BYTES_MAX (16u << 20)

typedef struct shard_set {
    pd_safetensors st[SHARDS_MAX];
    char file[SHARDS_MAX][128];
    uint32_t n;
    json_t *map; /* the index's weight_map; NULL for a single file */
} shard_set;

/* The tensor `name` and the shard holding it, or NULL. */
static const pd_st_tensor *find_tensor(const shard_set *set, const char *name, uint32_t *which) {
    uint32_t k = 0;
    if (set->map) {
        const char *file = json_string_value(json_object_get(set->map, name));
        if (!file) return NULL;
        while (k < set->n && strcmp(set->file[k], file)) k++;
        if (k == set->n) return NULL;
    }
    *which = k;
    return pd_safetensors_find(&set->st[k], name);
}

static pd_err match_tensor(const pd_tensor_entry *e, const pd_st_tensor *t, char *msg, size_t cap) {
    if (!t) return pd_errorf(msg, cap, PD_ERR_PARSE, "tensor '%s' is missing", e->name);
    if (t->dtype != PD_DTYPE_F32 && t->dtype != PD_DTYPE_F16 && t->dtype != PD_DTYPE_BF16)
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "tensor '%s': dtype %s not accepted (F32, F16 or BF16)", e->name,
                         pd_dtype_name(t->dtype));
    bool same = t->ndim == e->ndim;
    for (uint32_t d = 0; same && d < e->ndim; d++) same = t->shape[d] == e->shape[d];
    if (same) return PD_OK;
    char got[96], want[96];
    shape_text(got, sizeof(got), t->ndim, t->shape);
    shape_text(want, sizeof(want), e->ndim, e->shape);
    return pd_errorf(msg, cap, PD_ERR_PARSE, "tensor '%s': shape %s but the config needs %s",
                     e->name, got, want);
}

/* Every tensor of the model in the files, with its shape and a dtype we
 * read; every tensor of the files part of the model and (sharded) in the
 * shard the index names for it. */
static pd_err match_files(const pd_model *m, const shard_set *set, char *msg, size_t cap) {
    for (uint32_t i = 0; i < m->n_tensors; i++) {
        uint32_t k;
        pd_err err =
            match_tensor(&m->tensors[i], find_tensor(set, m->tensors[i].name, &k), msg, cap);
        if (err != PD_OK) return err;
    }
    for (uint32_t k = 0; k < set->n; k++)
        for (uint32_t i = 0; i < set->st[k].n_tensors; i++) {
            const char *name = set->st[k].tensors[i].name;
            const char *mapped = set->map ? json_string_value(json_object_get(set->map, name)) : "";
            if (set->map && (!mapped || strcmp(mapped, set->file[k])))
                return pd_errorf(msg, cap, PD_ERR_PARSE,
                                 "tensor '%s' is in %s, but the index says %s", name, set->file[k],
                                 mapped ? mapped : "nothing of it");
            if (!entry(m, name))
                return pd_errorf(msg, cap, PD_ERR_PARSE,
                                 "tensor '%s' is not part of this model (%s)", name,
                                 m->cfg.tie_embeddings && !strcmp(name, "lm_head.weight")
                                     ? "tie_word_embeddings is true"
                                     : "unexpected name");
        }
    return PD_OK;
}

/* A shard's file name from the index: a plain name in the directory. */
static bool shard_name_ok(const char *f) {
    size_t n = strlen(f);
    return n > 12 && n < 128 && !strchr(f, '/') && f[0] != '.' &&
        !strcmp(f + n - 12, ".safetensors");
}

/* The index's weight_map and the distinct files it names (set->file). */
static pd_err read_index(shard_set *set, const char *path, char *msg, size_t cap) {
    json_error_t jerr;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return pd_errorf(msg, cap, PD_ERR_PARSE, "%s: not valid JSON: %s (line %d)", path,
                         jerr.text, jerr.line);
    json_t *map = json_object_get(root, "weight_map");
    if (!json_is_object(map) || json_object_size(map) == 0) {
        json_decref(root);
        return pd_errorf(msg, cap, PD_ERR_PARSE, "%s: 'weight_map' must be a non-empty object",
                         path);
    }
    set->map = json_incref(map);
    json_decref(root);
    const char *name;
    json_t *v;
    json_object_foreach(map, name, v) {
        const char *f = json_string_value(v);
        if (!f || !shard_name_ok(f))
            return pd_errorf(msg, cap, PD_ERR_PARSE,
                             "%s: tensor '%s' maps to %s, not a .safetensors file in the "
                             "directory",
                             path, name, f ? f : "a non-string");
        uint32_t k = 0;
        while (k < set->n && strcmp(set->file[k], f)) k++;
        if (k < set->n) continue;
        if (set->n == SHARDS_MAX)
            return pd_errorf(msg, cap, PD_ERR_TOOBIG, "%s: more than %u shards", path, SHARDS_MAX);
        snprintf(set->file[set->n++], sizeof(set->file[0]), "%s", f);
    }
    return PD_OK;
}

/* Opens the directory's weight files into set; msg names the file at fault. */
static pd_err open_files(shard_set *set, const char *dir, char *msg, size_t cap) {
    char path[4096], why[512];
    pd_err err = join(path, sizeof(path), dir, "model.safetensors.index.json", msg, cap);
    if (err != PD_OK) return err;
    struct stat sb;
    if (stat(path, &sb) == 0) {
        if (sb.st_size > (off_t)INDEX_BYTES_MAX)
            return pd_errorf(msg, cap, PD_ERR_TOOBIG, "%s: larger than %u bytes", path,
                             INDEX_BYTES_MAX);
        err = read_index(set, path, msg, cap);
        if (err != PD_OK) return err;
    } else {
        set->n = 1;
        snprintf(set->file[0], sizeof(set->file[0]), "model.safetensors");
    }
    for (uint32_t k = 0; k < set->n; k++) {
        err = join(path, sizeof(path), dir, set->file[k], msg, cap);
        if (err == PD_OK)
            err = pd_safetensors_open(&set->st[k], path, PD_MODEL_FILE_BYTES_MAX, why, sizeof(why));
        if (err != PD_OK) return pd_errorf(msg, cap, err, "%s: %s", path, why);
    }
    return PD_OK;
}

static void close_files(shard_set *set) {
    for (uint32_t k = 0; k < set->n; k++) pd_safetensors_close(&set->st[k]);
    json_decref(set->map);
}

/* The matrices stored as BF16 in the files stay bf16 in memory (half the
 * bytes every decode step reads; the kernels widen them exactly). Vectors
 * and the conv kernel are widened to fp32 once. */
static void keep_bf16(pd_model *m, const shard_set *set) {
    for (uint32_t i = 0; i < m->n_tensors; i++) {
        pd_tensor_entry *e = &m->tensors[i];
        uint32_t k = 0;
        const pd_st_tensor *t = find_tensor(set, e->name, &k);
        e->bf16 = e->ndim == 2 && t && t->dtype == PD_DTYPE_BF16;
    }
}

static pd_err not_finite(const pd_tensor_entry *e, uint64_t j, char *msg, size_t cap) {
    return pd_errorf(msg, cap, PD_ERR_PARSE, "tensor '%s': element %llu is not finite", e->name,
                     (unsigned long long)j);
}

/* Every tensor's values, as stored (fp32, or bf16 bits), checked finite. */
static pd_err read_values(pd_model *m, const shard_set *set, char *msg, size_t cap) {
    pd_err err = PD_OK;
    for (uint32_t i = 0; err == PD_OK && i < m->n_tensors; i++) {
        const pd_tensor_entry *e = &m->tensors[i];
        uint32_t k = 0;
        const pd_st_tensor *t = find_tensor(set, e->name, &k); /* sets k: not in the call */
        if (e->bf16) {
            uint16_t *h = m->data16 + e->offset;
            PD_ASSERT(t->end - t->begin == e->elems * sizeof(uint16_t)); /* the parser's check */
            memcpy(h, set->st[k].data + t->begin, e->elems * sizeof(uint16_t));
            for (uint64_t j = 0; err == PD_OK && j < e->elems; j++)
                if ((h[j] & 0x7f80u) == 0x7f80u) err = not_finite(e, j, msg, cap);
            continue;
        }
        float *v = m->data + e->offset;
        err = pd_safetensors_read_f32(&set->st[k], t, v, e->elems, msg, cap);
        for (uint64_t j = 0; err == PD_OK && j < e->elems; j++)
            if (!isfinite(v[j])) err = not_finite(e, j, msg, cap);
    }
    return err;
}

pd_err pd_model_load(pd_model **out, const char *dir, char *msg, size_t cap) {
    PD_ASSERT(out != NULL && dir != NULL);
    *out = NULL;
    char path[4096], why[512];
    pd_model_config cfg;
    pd_err err = join(path, sizeof(path), dir, "config.json", msg, cap);
    if (err != PD_OK) return err;
    err = mdl_config_read(&cfg, path, msg, cap);
    if (err != PD_OK) return err;
    pd_model *m;
    err = model_table(&m, &cfg, msg, cap);
    if (err != PD_OK) return err;
    shard_set *set = calloc(1, sizeof(*set));
    if (!set) err = pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    if (err == PD_OK) err = open_files(set, dir, msg, cap);
    if (err == PD_OK) {
        err = match_files(m, set, why, sizeof(why));
        if (err == PD_OK) keep_bf16(m, set);
        if (err == PD_OK && model_storage(m, why, sizeof(why)) != PD_OK) err = PD_ERR_NOMEM;
        if (err == PD_OK) err = read_values(m, set, why, sizeof(why));
        if (err != PD_OK)
            pd_errorf(msg, cap, err, "%s/%s: %s", dir,
                      set->map ? "model.safetensors.index.json" : "model.safetensors", why);
    }
    if (set) close_files(set);
    free(set);
    if (err != PD_OK) {
        pd_model_destroy(m);
        return err;
    }
    *out = m;
    return PD_OK;
}

/* Shards of a sharded save: tensors [first, first + n) each, in table order,
 * in files model-0000K-of-0000N.safetensors, and the index naming them. */
static pd_err save_shards(const pd_model *m, const char *dir, const pd_st_input *in, pd_dtype dtype,
                          uint32_t shards, char *msg, size_t cap) {
    json_t *map = json_object();
    pd_err err = PD_OK;
    char path[4096], file[64];
    for (uint32_t k = 0; err == PD_OK && k < shards; k++) {
        uint32_t first = (uint32_t)((uint64_t)m->n_tensors * k / shards);
        uint32_t end = (uint32_t)((uint64_t)m->n_tensors * (k + 1) / shards);
        snprintf(file, sizeof file, "model-%05u-of-%05u.safetensors", k + 1, shards);
        for (uint32_t i = first; i < end; i++)
            json_object_set_new(map, in[i].name, json_string(file));
        err = join(path, sizeof(path), dir, file, msg, cap);
        if (err == PD_OK)
            err = pd_safetensors_write(path, in + first, end - first, dtype, msg, cap);
    }
    if (err == PD_OK) err = join(path, sizeof(path), dir, "model.safetensors.index.json", msg, cap);
    json_t *index = json_pack("{s:{s:s},s:o}", "metadata", "format", "pt", "weight_map", map);
    if (err == PD_OK && json_dump_file(index, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER) != 0)
        err = pd_errorf(msg, cap, PD_ERR_IO, "%s: cannot write", path);
    json_decref(index);
    return err;
}

pd_err pd_model_save(const pd_model *m, const char *dir, pd_dtype dtype, char *msg, size_t cap) {
    return pd_model_save_sharded(m, dir, dtype, 1, msg, cap);
}

pd_err pd_model_save_sharded(const pd_model *m, const char *dir, pd_dtype dtype, uint32_t shards,
                             char *msg, size_t cap) {
    if (shards < 1 || shards > m->n_tensors || shards > SHARDS_MAX)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "%u shards: 1 to %u for this model", shards,
                         PD_MIN(m->n_tensors, SHARDS_MAX));
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return pd_errorf(msg, cap, PD_ERR_IO, "%s: %s", dir, strerror(errno));
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return pd_errorf(msg, cap, PD_ERR_IO, "%s: not a directory", dir);
    char path[4096];
    pd_err err = join(path, sizeof(path), dir, "config.json", msg, cap);
    if (err == PD_OK) err = mdl_config_write(&m->cfg, path, msg, cap);
    if (err != PD_OK) return err;
    pd_st_input *in = calloc(m->n_tensors, sizeof(*in));
    float **wide = calloc(m->n_tensors, sizeof(*wide)); /* bf16 tensors, widened */
    if (!in || !wide) err = pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    for (uint32_t i = 0; err == PD_OK && i < m->n_tensors; i++) {
        const pd_tensor_entry *e = &m->tensors[i];
        in[i].name = e->name;
        in[i].ndim = e->ndim;
        for (uint32_t d = 0; d < e->ndim; d++) in[i].shape[d] = e->shape[d];
        in[i].data = m->data + e->offset;
        if (!e->bf16) continue;
        wide[i] = malloc(e->elems * sizeof(float));
        if (!wide[i]) err = pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
        else pd_model_tensor_values(m, e->name, wide[i], e->elems);
        in[i].data = wide[i];
    }
    if (err != PD_OK) goto out;
    /* The other layout's files would confuse a loader: one of them goes. */
    const char *stale = shards > 1 ? "model.safetensors" : "model.safetensors.index.json";
    if (join(path, sizeof(path), dir, stale, msg, cap) == PD_OK) unlink(path);
    if (shards > 1) {
        err = save_shards(m, dir, in, dtype, shards, msg, cap);
    } else {
        err = join(path, sizeof(path), dir, "model.safetensors", msg, cap);
        if (err == PD_OK) err = pd_safetensors_write(path, in, m->n_tensors, dtype, msg, cap);
    }
out:
    for (uint32_t i = 0; wide && i < m->n_tensors; i++) free(wide[i]);
    free(wide);
    free(in);
    return err;
}

void pd_model_destroy(pd_model *m) {
    if (!m) return;
    free(m->data16);
    free(m->data);
    free(m);
}

const pd_model_config *pd_model_config_get(const pd_model *m) { return &m->cfg; }
const pd_model_shape *pd_model_shape_get(const pd_model *m) { return &m->shape; }
uint32_t pd_model_tensor_count(const pd_model *m) { return m->n_tensors; }

const char *pd_model_tensor_name(const pd_model *m, uint32_t i) {
    return i < m->n_tensors ? m->tensors[i].name : NULL;
}

const float *pd_model_tensor(const pd_model *m, const char *name, uint64_t *n_out) {
    const pd_tensor_entry *t = entry(m, name);
    if (!t || t->bf16) return NULL;
    if (n_out) *n_out = t->elems;
    return m->data + t->offset;
}

uint64_t pd_model_tensor_values(const pd_model *m, const char *name, float *out, uint64_t cap) {
    const pd_tensor_entry *t = entry(m, name);
    if (!t) return 0;
    for (uint64_t j = 0; j < t->elems && j < cap; j++) {
        if (!t->bf16) {
            out[j] = m->data[t->offset + j];
            continue;
        }
        out[j] = pd_bf16_to_f32(m->data16[t->offset + j]);
    }
    return t->elems;
}

bool pd_model_tensor_is_bf16(const pd_model *m, const char *name) {
    const pd_tensor_entry *t = entry(m, name);
    return t && t->bf16;
}
