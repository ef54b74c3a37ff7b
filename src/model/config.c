/*
 * config.c — model configurations: the built-in presets, the consistency
 * check, the derived shape, and config.json in both directions.
 *
 * Every bound below exists so that the sizes derived from a config (and the
 * allocations that follow) fit comfortably in 64-bit arithmetic: a config
 * file is input from outside, and a hostile one must get a message, not an
 * overflow or a 100 GB malloc.
 */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model_internal.h"

#define DIM_MAX 65536u
#define VOCAB_MAX (1u << 22)
#define MLP_HIDDEN_MAX (1u << 18)
#define HEADS_MAX 1024u
#define HEAD_DIM_MAX 1024u
#define D_STATE_MAX 1024u
#define D_CONV_MAX 64u
#define EXPAND_MAX 16u
#define MAMBA_HEADS_MAX 65536u
#define PARAMS_MAX (UINT64_C(1) << 33) /* 32 GiB of fp32 weights */

/* GraniteMoeHybridForCausalLM, dense. tiny: two B/C groups so that the
 * full-width gated norm differs from the hybrid's per-group one, and every
 * multiplier away from 1. Otherwise the shape of
 * ibm-granite/granite-4.0-h-350m (its config.json): attention at layers 10,
 * 13, 17 and 27 of 32. */
static void preset_granite(pd_model_config *out, bool tiny) {
    out->arch = PD_ARCH_GRANITE;
    out->no_rope = true;
    out->embed_mult = 12.0f;
    out->residual_mult = 0.246f;
    out->logits_div = 3.0f;
    if (tiny) {
        out->dim = 64;
        snprintf(out->layers, sizeof(out->layers), "MMAMA");
        out->attn_heads = 4;
        out->attn_head_dim = 16;
        out->mamba_d_state = 16;
        out->mamba_heads = 4;
        out->mamba_groups = 2;
        out->mlp_hidden = 192;
        out->attn_scale = 0.125f;
        return;
    }
    out->vocab = 100352;
    out->dim = 768;
    snprintf(out->layers, sizeof(out->layers), "%s", "MMMMMMMMMMAMMAMMMAMMMMMMMMMAMMMM");
    out->attn_heads = 12;
    out->attn_kv_heads = 4;
    out->attn_head_dim = 64;
    out->mamba_d_state = 128;
    out->mamba_heads = 48;
    out->mamba_groups = 1;
    out->mlp_hidden = 2048;
    out->tie_embeddings = true;
    out->attn_scale = 0.015625f;
    out->bos_token = out->eos_token = 100257;
}

/* The shape of Qwen/Qwen3-0.6B (its config.json). */
static void preset_qwen3_06b(pd_model_config *out) {
    out->arch = PD_ARCH_QWEN3;
    out->vocab = 151936;
    out->dim = 1024;
    memset(out->layers, 'A', 28);
    out->layers[28] = '\0';
    out->attn_heads = 16;
    out->attn_kv_heads = 8;
    out->attn_head_dim = 128;
    out->mlp_hidden = 3072;
    out->norm_eps = 1e-6f;
    out->rope_base = 1000000.0f;
    out->tie_embeddings = true;
    out->mamba_d_conv = out->mamba_expand = 0;
    out->bos_token = 151643;
    out->eos_token = 151645;
}

pd_err pd_model_config_preset(pd_model_config *out, const char *name, char *msg, size_t cap) {
    memset(out, 0, sizeof(*out));
    out->vocab = 258;
    out->attn_kv_heads = 2;
    out->mamba_d_conv = 4;
    out->mamba_expand = 2;
    out->norm_eps = 1e-5f;
    out->rope_base = 10000.0f;
    out->bos_token = 256;
    out->eos_token = 257;
    if (!strcmp(name, "tiny")) {
        out->dim = 64;
        snprintf(out->layers, sizeof(out->layers), "MAMA");
        out->attn_heads = 4;
        out->attn_head_dim = 16;
        out->mamba_d_state = 16;
        out->mamba_heads = 4;
        out->mamba_groups = 1;
        out->mlp_hidden = 192;
    } else if (!strcmp(name, "llama") || !strcmp(name, "qwen3")) {
        /* Attention only; llama exercises the llama3 RoPE scaling, qwen3 an
         * explicit head_dim (not dim / heads), q/k norms and tied embeddings. */
        bool qwen = !strcmp(name, "qwen3");
        out->arch = qwen ? PD_ARCH_QWEN3 : PD_ARCH_LLAMA;
        out->dim = 64;
        snprintf(out->layers, sizeof(out->layers), "AAAA");
        out->attn_heads = 4;
        out->attn_head_dim = qwen ? 32 : 16;
        out->mlp_hidden = 192;
        out->norm_eps = 1e-6f;
        out->rope_base = qwen ? 1000000.0f : 500000.0f;
        if (!qwen) {
            out->rope_factor = 8.0f;
            out->rope_low_freq_factor = 1.0f;
            out->rope_high_freq_factor = 4.0f;
            out->rope_original_max = 64;
        }
        out->tie_embeddings = qwen;
        out->mamba_d_conv = out->mamba_expand = 0; /* no Mamba layers */
    } else if (!strcmp(name, "small")) {
        out->dim = 256;
        snprintf(out->layers, sizeof(out->layers), "MMAMMAMM");
        out->attn_heads = 4;
        out->attn_head_dim = 64;
        out->mamba_d_state = 64;
        out->mamba_heads = 8;
        out->mamba_groups = 2;
        out->mlp_hidden = 768;
    } else if (!strcmp(name, "granite") || !strcmp(name, "granite-4.0-h-350m")) {
        preset_granite(out, !strcmp(name, "granite"));
    } else if (!strcmp(name, "qwen3-0.6b")) {
        preset_qwen3_06b(out);
    } else {
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "unknown model config '%s' (tiny, small, llama, qwen3, granite, "
                         "qwen3-0.6b or granite-4.0-h-350m)",
                         name);
    }
    return PD_OK;
}

static uint32_t count_kind(const char *layers, char kind) {
    uint32_t n = 0;
    for (const char *p = layers; *p; p++) n += *p == kind;
    return n;
}

/* llama3 rope_scaling: factor >= 1, 0 < low < high, an original context. */
static pd_err check_rope_scaling(const pd_model_config *cfg, char *msg, size_t cap) {
    if (cfg->rope_factor == 0.0f) return PD_OK;
    if (!(cfg->rope_factor >= 1.0f && cfg->rope_factor <= 1024.0f) ||
        !(cfg->rope_low_freq_factor > 0.0f) ||
        !(cfg->rope_high_freq_factor > cfg->rope_low_freq_factor) ||
        !isfinite(cfg->rope_high_freq_factor) || cfg->rope_original_max == 0)
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "rope_scaling (llama3): factor %g must be in [1, 1024], 0 < "
                         "low_freq_factor %g < high_freq_factor %g, "
                         "original_max_position_embeddings %u > 0",
                         (double)cfg->rope_factor, (double)cfg->rope_low_freq_factor,
                         (double)cfg->rope_high_freq_factor, cfg->rope_original_max);
    return PD_OK;
}

/* Granite's multipliers: finite, >= 0 (0: not used). */
static pd_err check_multipliers(const pd_model_config *cfg, char *msg, size_t cap) {
    const float mults[4] = {cfg->embed_mult, cfg->residual_mult, cfg->logits_div, cfg->attn_scale};
    for (int i = 0; i < 4; i++)
        if (!(mults[i] >= 0.0f) || !isfinite(mults[i]))
            return pd_errorf(msg, cap, PD_ERR_INVALID,
                             "multiplier %g must be finite and >= 0 (0: none)", (double)mults[i]);
    return PD_OK;
}

#define RANGE(field, lo, hi)                                                                  \
    do {                                                                                      \
        if (cfg->field < (lo) || cfg->field > (hi))                                           \
            return pd_errorf(msg, cap, PD_ERR_INVALID, #field " = %u is outside [%u, %u]",    \
                             (unsigned)cfg->field, (unsigned)(lo), (unsigned)(hi));           \
    } while (0)

pd_err pd_model_config_check(const pd_model_config *cfg, char *msg, size_t cap) {
    size_t n_layers = strnlen(cfg->layers, sizeof(cfg->layers));
    if (n_layers == 0 || n_layers > PD_MODEL_LAYERS_MAX)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "layer pattern must have 1 to %d layers",
                         PD_MODEL_LAYERS_MAX);
    for (size_t i = 0; i < n_layers; i++)
        if (cfg->layers[i] != 'M' && cfg->layers[i] != 'A')
            return pd_errorf(msg, cap, PD_ERR_INVALID,
                             "layer pattern '%s': layer %zu is '%c' (M = Mamba2, A = attention)",
                             cfg->layers, i, cfg->layers[i]);
    RANGE(vocab, 2u, VOCAB_MAX);
    RANGE(dim, 1u, DIM_MAX);
    RANGE(mlp_hidden, 1u, MLP_HIDDEN_MAX);
    pd_err err = check_multipliers(cfg, msg, cap);
    if (err != PD_OK) return err;
    if (!(cfg->norm_eps > 0.0f) || !isfinite(cfg->norm_eps) || cfg->norm_eps > 1.0f)
        return pd_errorf(msg, cap, PD_ERR_INVALID, "norm_eps = %g must be in (0, 1]",
                         (double)cfg->norm_eps);
    if (cfg->bos_token < -1 || cfg->bos_token >= (int64_t)cfg->vocab ||
        cfg->eos_token < -1 || cfg->eos_token >= (int64_t)cfg->vocab)
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "bos/eos tokens (%d, %d) must be -1 or below vocab %u", cfg->bos_token,
                         cfg->eos_token, cfg->vocab);
    if (count_kind(cfg->layers, 'A') > 0) {
        RANGE(attn_heads, 1u, HEADS_MAX);
        RANGE(attn_kv_heads, 1u, cfg->attn_heads);
        RANGE(attn_head_dim, 2u, HEAD_DIM_MAX);
        if (cfg->attn_heads % cfg->attn_kv_heads)
            return pd_errorf(msg, cap, PD_ERR_INVALID,
                             "attn_heads %u is not a multiple of attn_kv_heads %u", cfg->attn_heads,
                             cfg->attn_kv_heads);
        if (cfg->attn_head_dim % 2)
            return pd_errorf(msg, cap, PD_ERR_INVALID, "attn_head_dim %u must be even (RoPE)",
                             cfg->attn_head_dim);
        if (!(cfg->rope_base > 1.0f) || !isfinite(cfg->rope_base))
            return pd_errorf(msg, cap, PD_ERR_INVALID, "rope_base = %g must be finite and > 1",
                             (double)cfg->rope_base);
        err = check_rope_scaling(cfg, msg, cap);
        if (err != PD_OK) return err;
    }
    if (cfg->arch != PD_ARCH_HYBRID && cfg->arch != PD_ARCH_GRANITE &&
        count_kind(cfg->layers, 'M') > 0)
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "layer pattern '%s': a Llama or Qwen3 model has attention layers only",
                         cfg->layers);
    if (count_kind(cfg->layers, 'M') > 0) {
        RANGE(mamba_d_state, 1u, D_STATE_MAX);
        RANGE(mamba_d_conv, 2u, D_CONV_MAX);
        RANGE(mamba_expand, 1u, EXPAND_MAX);
        RANGE(mamba_heads, 1u, MAMBA_HEADS_MAX);
        RANGE(mamba_groups, 1u, cfg->mamba_heads);
        uint64_t d_inner = (uint64_t)cfg->mamba_expand * cfg->dim;
        if (d_inner % cfg->mamba_heads)
            return pd_errorf(
                msg, cap, PD_ERR_INVALID,
                "mamba d_inner %llu (expand x dim) is not a multiple of mamba_heads %u",
                (unsigned long long)d_inner, cfg->mamba_heads);
        if (cfg->mamba_heads % cfg->mamba_groups)
            return pd_errorf(msg, cap, PD_ERR_INVALID,
                             "mamba_heads %u is not a multiple of mamba_groups %u",
                             cfg->mamba_heads, cfg->mamba_groups);
    }
    pd_model_shape s;
    pd_model_config_shape(cfg, &s);
    if (s.params > PARAMS_MAX)
        return pd_errorf(msg, cap, PD_ERR_TOOBIG, "%llu parameters, more than the limit of %llu",
                         (unsigned long long)s.params, (unsigned long long)PARAMS_MAX);
    return PD_OK;
}

void pd_model_config_shape(const pd_model_config *cfg, pd_model_shape *s) {
    memset(s, 0, sizeof(*s));
    s->n_layers = (uint32_t)strnlen(cfg->layers, sizeof(cfg->layers));
    s->n_attn = count_kind(cfg->layers, 'A');
    s->n_mamba = count_kind(cfg->layers, 'M');
    uint64_t dim = cfg->dim, vocab = cfg->vocab, hidden = cfg->mlp_hidden;
    uint64_t per_layer_mlp = 3 * dim * hidden;
    uint64_t attn_w = 0, mamba_w = 0, mamba_small = 0;
    if (s->n_attn) {
        s->q_dim = cfg->attn_heads * cfg->attn_head_dim;
        s->kv_dim = cfg->attn_kv_heads * cfg->attn_head_dim;
        s->kv_bytes_per_token = (size_t)s->n_attn * 2 * s->kv_dim * sizeof(float);
        attn_w = 2 * dim * s->q_dim + 2 * dim * s->kv_dim;
    }
    if (s->n_mamba) {
        uint64_t gn = (uint64_t)cfg->mamba_groups * cfg->mamba_d_state;
        s->mamba_d_inner = cfg->mamba_expand * cfg->dim;
        s->mamba_head_dim = s->mamba_d_inner / cfg->mamba_heads;
        s->mamba_conv_dim = (uint32_t)(s->mamba_d_inner + 2 * gn);
        s->mamba_in_proj = (uint32_t)(2 * (uint64_t)s->mamba_d_inner + 2 * gn + cfg->mamba_heads);
        s->mamba_conv_bytes_per_layer =
            (size_t)s->mamba_conv_dim * (cfg->mamba_d_conv - 1) * sizeof(float);
        s->mamba_ssm_bytes_per_layer =
            (size_t)s->mamba_d_inner * cfg->mamba_d_state * sizeof(float);
        s->mamba_slot_bytes =
            s->n_mamba * (s->mamba_conv_bytes_per_layer + s->mamba_ssm_bytes_per_layer);
        mamba_w = (uint64_t)s->mamba_in_proj * dim + dim * s->mamba_d_inner;
        mamba_small = (uint64_t)s->mamba_conv_dim * (cfg->mamba_d_conv + 1) +
            3ull * cfg->mamba_heads + s->mamba_d_inner;
    }
    uint64_t lm = vocab * dim;
    uint64_t qk_norms = cfg->arch == PD_ARCH_QWEN3 ? 2ull * cfg->attn_head_dim : 0;
    s->params = vocab * dim + (cfg->tie_embeddings ? 0 : lm) + dim /* final norm */ +
        s->n_layers * (2 * dim + per_layer_mlp) + s->n_attn * (attn_w + qk_norms) +
        s->n_mamba * (mamba_w + mamba_small);
    s->matmul_flops_per_token =
        2 * (s->n_layers * per_layer_mlp + s->n_attn * attn_w + s->n_mamba * mamba_w + lm);
}

size_t pd_model_kv_page_bytes(const pd_model_config *cfg, uint32_t page_size) {
    pd_model_shape s;
    pd_model_config_shape(cfg, &s);
    return s.kv_bytes_per_token * page_size;
}

/* ---- config.json ------------------------------------------------------------- */

typedef enum field_kind { F_U32, F_I32, F_F32, F_BOOL, F_PATTERN } field_kind;

typedef struct field {
    const char *key;
    field_kind kind;
    size_t offset;
    bool required;
} field;

#define FIELD(key, kind, member, req) {key, kind, offsetof(pd_model_config, member), req}

static const field fields[] = {
    FIELD("vocab_size", F_U32, vocab, true),
    FIELD("hidden_size", F_U32, dim, true),
    FIELD("layer_pattern", F_PATTERN, layers, true),
    FIELD("num_attention_heads", F_U32, attn_heads, true),
    FIELD("num_key_value_heads", F_U32, attn_kv_heads, true),
    FIELD("head_dim", F_U32, attn_head_dim, true),
    FIELD("mamba_d_state", F_U32, mamba_d_state, true),
    FIELD("mamba_d_conv", F_U32, mamba_d_conv, true),
    FIELD("mamba_expand", F_U32, mamba_expand, true),
    FIELD("mamba_n_heads", F_U32, mamba_heads, true),
    FIELD("mamba_n_groups", F_U32, mamba_groups, true),
    FIELD("intermediate_size", F_U32, mlp_hidden, true),
    FIELD("rms_norm_eps", F_F32, norm_eps, true),
    FIELD("rope_theta", F_F32, rope_base, true),
    FIELD("tie_word_embeddings", F_BOOL, tie_embeddings, false),
    FIELD("bos_token_id", F_I32, bos_token, false),
    FIELD("eos_token_id", F_I32, eos_token, false),
};

#define MODEL_TYPE "pdserve_hybrid"

static pd_err read_field(pd_model_config *cfg, const field *f, const json_t *v, char *msg,
                         size_t cap) {
    char *base = (char *)cfg + f->offset;
    switch (f->kind) {
    case F_U32:
        if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > UINT32_MAX)
            return pd_errorf(msg, cap, PD_ERR_PARSE, "'%s' must be an integer in [0, 2^32)",
                             f->key);
        *(uint32_t *)base = (uint32_t)json_integer_value(v);
        return PD_OK;
    case F_I32:
        if (json_is_null(v)) {
            *(int32_t *)base = -1;
            return PD_OK;
        }
        if (!json_is_integer(v) || json_integer_value(v) < -1 || json_integer_value(v) > INT32_MAX)
            return pd_errorf(msg, cap, PD_ERR_PARSE, "'%s' must be an integer >= -1 or null",
                             f->key);
        *(int32_t *)base = (int32_t)json_integer_value(v);
        return PD_OK;
    case F_F32:
        if (!json_is_number(v))
            return pd_errorf(msg, cap, PD_ERR_PARSE, "'%s' must be a number", f->key);
        *(float *)base = (float)json_number_value(v);
        return PD_OK;
    case F_BOOL:
        if (!json_is_boolean(v))
            return pd_errorf(msg, cap, PD_ERR_PARSE, "'%s' must be true or false", f->key);
        *(bool *)base = json_is_true(v);
        return PD_OK;
    case F_PATTERN:
        if (!json_is_string(v) || json_string_length(v) > PD_MODEL_LAYERS_MAX)
            return pd_errorf(msg, cap, PD_ERR_PARSE, "'%s' must be a string of at most %d layers",
                             f->key, PD_MODEL_LAYERS_MAX);
        snprintf(cfg->layers, sizeof(cfg->layers), "%s", json_string_value(v));
        return PD_OK;
    }
    return PD_ERR_INTERNAL;
}

pd_err mdl_config_read(pd_model_config *cfg, const char *path, char *msg, size_t cap) {
    FILE *f = fopen(path, "rb");
    if (!f) return pd_errorf(msg, cap, PD_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    char buf[1 << 16];
    size_t len = fread(buf, 1, sizeof(buf), f);
    bool more = fgetc(f) != EOF;
    fclose(f);
    if (more)
        return pd_errorf(msg, cap, PD_ERR_TOOBIG, "%s: larger than %zu bytes", path, sizeof(buf));
    return pd_model_config_parse(cfg, buf, len, path, msg, cap);
}

pd_err pd_model_config_parse(pd_model_config *cfg, const char *json, size_t len, const char *path,
                             char *msg, size_t cap) {
    memset(cfg, 0, sizeof(*cfg));
    cfg->bos_token = -1;
    cfg->eos_token = -1;
    json_error_t jerr;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return pd_errorf(msg, cap, PD_ERR_PARSE, "%s: not valid JSON: %s (line %d, column %d)",
                         path, jerr.text, jerr.line, jerr.column);
    pd_err err = PD_OK;
    char why[200];
    if (!json_is_object(root)) {
        err = pd_errorf(msg, cap, PD_ERR_PARSE, "%s: not a JSON object", path);
        goto out;
    }
    if (json_object_get(root, "architectures")) {
        err = mdl_hf_config_parse(cfg, root, path, msg, cap);
        goto out;
    }
    const json_t *type = json_object_get(root, "model_type");
    if (!json_is_string(type) || strcmp(json_string_value(type), MODEL_TYPE)) {
        err = pd_errorf(msg, cap, PD_ERR_PARSE, "%s: model_type must be \"" MODEL_TYPE "\"", path);
        goto out;
    }
    for (size_t i = 0; i < PD_ARRAY_LEN(fields); i++) {
        const json_t *v = json_object_get(root, fields[i].key);
        if (!v) {
            if (fields[i].required) {
                err = pd_errorf(msg, cap, PD_ERR_PARSE, "%s: missing '%s'", path, fields[i].key);
                goto out;
            }
            continue;
        }
        if (read_field(cfg, &fields[i], v, why, sizeof(why)) != PD_OK) {
            err = pd_errorf(msg, cap, PD_ERR_PARSE, "%s: %s", path, why);
            goto out;
        }
    }
    if (pd_model_config_check(cfg, why, sizeof(why)) != PD_OK)
        err = pd_errorf(msg, cap, PD_ERR_PARSE, "%s: %s", path, why);
out:
    json_decref(root);
    return err;
}

/* The double nearest to the shortest decimal that reads back as f, so that
 * config.json says 1e-05 rather than 9.9999997473787516e-06. */
double mdl_short_real(float f) {
    char text[32];
    for (int digits = 1; digits <= 9; digits++) {
        snprintf(text, sizeof(text), "%.*g", digits, (double)f);
        if (strtof(text, NULL) == f) break;
    }
    return strtod(text, NULL);
}

pd_err mdl_config_write(const pd_model_config *cfg, const char *path, char *msg, size_t cap) {
    json_t *root = cfg->arch != PD_ARCH_HYBRID ? mdl_hf_config_json(cfg) : json_object();
    if (cfg->arch == PD_ARCH_HYBRID)
        json_object_set_new(root, "model_type", json_string(MODEL_TYPE));
    for (size_t i = 0; cfg->arch == PD_ARCH_HYBRID && i < PD_ARRAY_LEN(fields); i++) {
        const char *base = (const char *)cfg + fields[i].offset;
        json_t *v = NULL;
        switch (fields[i].kind) {
        case F_U32: v = json_integer(*(const uint32_t *)base); break;
        case F_I32: v = json_integer(*(const int32_t *)base); break;
        case F_F32: v = json_real(mdl_short_real(*(const float *)base)); break;
        case F_BOOL: v = json_boolean(*(const bool *)base); break;
        case F_PATTERN: v = json_string(cfg->layers); break;
        }
        json_object_set_new(root, fields[i].key, v);
    }
    int rc =
        json_dump_file(root, path, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(9));
    json_decref(root);
    if (rc != 0) return pd_errorf(msg, cap, PD_ERR_IO, "%s: cannot write", path);
    return PD_OK;
}
