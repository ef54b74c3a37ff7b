/*
 * hf_config.c — the config.json of Hugging Face checkpoints (LlamaForCausalLM,
 * Qwen3ForCausalLM, GraniteMoeHybridForCausalLM) into a pd_model_config, and
 * back.
 *
 * What is read (docs/model.md lists it with the defaults): the first entry of
 * "architectures" picks the family; vocab_size, hidden_size,
 * intermediate_size, num_hidden_layers, num_attention_heads (required);
 * num_key_value_heads (default: the heads), head_dim (default hidden_size /
 * heads), rms_norm_eps (1e-6), rope_theta (10000), rope_scaling (null or
 * type "llama3"), tie_word_embeddings (false), bos_token_id and
 * eos_token_id (an integer, null, or a list: its first entry). What the
 * forward pass does not implement is refused by name rather than ignored:
 * another hidden_act than silu, attention or MLP biases, another
 * rope_scaling type, a sliding window. Granite adds its own fields
 * (read_granite) and refuses its mixture-of-experts variants.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "model_internal.h"

static const struct {
    const char *arch, *model_type;
    pd_model_arch id;
} families[] = {
    {"LlamaForCausalLM", "llama", PD_ARCH_LLAMA},
    {"Qwen3ForCausalLM", "qwen3", PD_ARCH_QWEN3},
    {"GraniteMoeHybridForCausalLM", "granitemoehybrid", PD_ARCH_GRANITE},
};

const char *pd_model_arch_name(pd_model_arch arch) {
    for (size_t i = 0; i < PD_ARRAY_LEN(families); i++)
        if (families[i].id == arch) return families[i].arch;
    return "pdserve_hybrid";
}

/* An unsigned integer field: *out, or def when absent (def < 0: required). */
static pd_err get_u32(const json_t *root, const char *key, int64_t def, uint32_t *out,
                      const char *path, char *msg, size_t cap) {
    const json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) {
        if (def < 0) return pd_errorf(msg, cap, PD_ERR_PARSE, "%s: missing '%s'", path, key);
        *out = (uint32_t)def;
        return PD_OK;
    }
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > UINT32_MAX)
        return pd_errorf(msg, cap, PD_ERR_PARSE, "%s: '%s' must be an integer in [0, 2^32)", path,
                         key);
    *out = (uint32_t)json_integer_value(v);
    return PD_OK;
}

static pd_err get_f32(const json_t *root, const char *key, double def, float *out, const char *path,
                      char *msg, size_t cap) {
    const json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) {
        *out = (float)def;
        return PD_OK;
    }
    if (!json_is_number(v))
        return pd_errorf(msg, cap, PD_ERR_PARSE, "%s: '%s' must be a number", path, key);
    *out = (float)json_number_value(v);
    return PD_OK;
}

/* A token id: an integer, null (-1), or a list (its first entry). */
static pd_err get_token(const json_t *root, const char *key, int32_t *out, const char *path,
                        char *msg, size_t cap) {
    const json_t *v = json_object_get(root, key);
    if (json_is_array(v)) v = json_array_get(v, 0);
    *out = -1;
    if (!v || json_is_null(v)) return PD_OK;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > INT32_MAX)
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "%s: '%s' must be a token id, a list of them or null", path, key);
    *out = (int32_t)json_integer_value(v);
    return PD_OK;
}

/* A field that must be absent or have the value the forward pass assumes. */
static pd_err refuse_unless(const json_t *root, const char *key, const char *want, const char *path,
                            char *msg, size_t cap) {
    const json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v)) return PD_OK;
    bool ok = (!strcmp(want, "false") && json_is_false(v)) ||
        (json_is_string(v) && !strcmp(json_string_value(v), want));
    if (ok) return PD_OK;
    return pd_errorf(msg, cap, PD_ERR_PARSE, "%s: '%s' other than %s is not supported", path, key,
                     want);
}

static pd_err read_rope_scaling(pd_model_config *cfg, const json_t *root, const char *path,
                                char *msg, size_t cap) {
    const json_t *rs = json_object_get(root, "rope_scaling");
    if (!rs || json_is_null(rs)) return PD_OK;
    const json_t *type = json_object_get(rs, "rope_type");
    if (!type) type = json_object_get(rs, "type");
    if (!json_is_object(rs) || !json_is_string(type) || strcmp(json_string_value(type), "llama3"))
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "%s: rope_scaling other than {\"rope_type\": \"llama3\", ...} is not "
                         "supported",
                         path);
    pd_err err = get_f32(rs, "factor", 0, &cfg->rope_factor, path, msg, cap);
    if (!err) err = get_f32(rs, "low_freq_factor", 1, &cfg->rope_low_freq_factor, path, msg, cap);
    if (!err) err = get_f32(rs, "high_freq_factor", 4, &cfg->rope_high_freq_factor, path, msg, cap);
    if (!err)
        err = get_u32(rs, "original_max_position_embeddings", -1, &cfg->rope_original_max, path,
                      msg, cap);
    return err;
}

static pd_err read_family(pd_model_config *cfg, const json_t *root, const char *path, char *msg,
                          size_t cap) {
    const json_t *archs = json_object_get(root, "architectures");
    const char *name = json_string_value(json_array_get(archs, 0));
    for (size_t i = 0; name && i < PD_ARRAY_LEN(families); i++)
        if (!strcmp(name, families[i].arch)) {
            cfg->arch = families[i].id;
            return PD_OK;
        }
    return pd_errorf(msg, cap, PD_ERR_PARSE,
                     "%s: architecture %s is not supported (LlamaForCausalLM, Qwen3ForCausalLM, "
                     "GraniteMoeHybridForCausalLM, or a pdserve_hybrid config)",
                     path, name ? name : "(none: 'architectures' is not a list of names)");
}

static pd_err read_sizes(pd_model_config *cfg, const json_t *root, const char *path, char *msg,
                         size_t cap) {
    uint32_t layers = 0;
    pd_err err = get_u32(root, "vocab_size", -1, &cfg->vocab, path, msg, cap);
    if (!err) err = get_u32(root, "hidden_size", -1, &cfg->dim, path, msg, cap);
    if (!err) err = get_u32(root, "intermediate_size", -1, &cfg->mlp_hidden, path, msg, cap);
    if (!err) err = get_u32(root, "num_hidden_layers", -1, &layers, path, msg, cap);
    if (!err) err = get_u32(root, "num_attention_heads", -1, &cfg->attn_heads, path, msg, cap);
    if (err) return err;
    if (layers == 0 || layers > PD_MODEL_LAYERS_MAX)
        return pd_errorf(msg, cap, PD_ERR_PARSE, "%s: num_hidden_layers %u is outside [1, %d]",
                         path, layers, PD_MODEL_LAYERS_MAX);
    memset(cfg->layers, 'A', layers);
    cfg->layers[layers] = '\0';
    err =
        get_u32(root, "num_key_value_heads", cfg->attn_heads, &cfg->attn_kv_heads, path, msg, cap);
    uint32_t head_dim = cfg->attn_heads ? cfg->dim / cfg->attn_heads : 0;
    if (!err) err = get_u32(root, "head_dim", head_dim, &cfg->attn_head_dim, path, msg, cap);
    if (!err) err = get_f32(root, "rms_norm_eps", 1e-6, &cfg->norm_eps, path, msg, cap);
    if (!err) err = get_f32(root, "rope_theta", 10000.0, &cfg->rope_base, path, msg, cap);
    return err;
}

/* A boolean field that must be absent or `want`. */
static pd_err require_bool(const json_t *root, const char *key, bool want, const char *why,
                           const char *path, char *msg, size_t cap) {
    const json_t *v = json_object_get(root, key);
    if (!v || json_is_null(v) || (json_is_boolean(v) && json_is_true(v) == want)) return PD_OK;
    return pd_errorf(msg, cap, PD_ERR_PARSE, "%s: '%s' %s is not supported (%s)", path, key,
                     want ? "false" : "true", why);
}

/* layer_types: "mamba" or "attention" per layer (absent: all Mamba, as the
 * transformers config class says). */
static pd_err read_layer_types(pd_model_config *cfg, const json_t *root, const char *path,
                               char *msg, size_t cap) {
    const json_t *types = json_object_get(root, "layer_types");
    size_t n = strlen(cfg->layers);
    if (!types || json_is_null(types)) {
        memset(cfg->layers, 'M', n);
        return PD_OK;
    }
    if (!json_is_array(types) || json_array_size(types) != n)
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "%s: 'layer_types' must be a list of num_hidden_layers (%zu) entries",
                         path, n);
    for (size_t i = 0; i < n; i++) {
        const char *t = json_string_value(json_array_get(types, i));
        if (t && !strcmp(t, "mamba")) cfg->layers[i] = 'M';
        else if (t && !strcmp(t, "attention")) cfg->layers[i] = 'A';
        else
            return pd_errorf(msg, cap, PD_ERR_PARSE,
                             "%s: layer_types[%zu] must be \"mamba\" or \"attention\"", path, i);
    }
    return PD_OK;
}

/* GraniteMoeHybridForCausalLM (granite-4.0-h): the dense variants only. The
 * MLP is shared_mlp of shared_intermediate_size; Mamba2 sizes from mamba_*;
 * the four multipliers; RoPE only when position_embedding_type is "rope". */
static pd_err read_granite(pd_model_config *cfg, const json_t *root, const char *path, char *msg,
                           size_t cap) {
    uint32_t experts = 0, d_head = 0;
    pd_err err = get_u32(root, "num_local_experts", 8, &experts, path, msg, cap);
    if (!err && experts > 0)
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "%s: num_local_experts %u: mixture-of-experts Granite models are not "
                         "supported (only the dense ones, num_local_experts 0)",
                         path, experts);
    if (!err) err = read_layer_types(cfg, root, path, msg, cap);
    if (!err)
        err = get_u32(root, "shared_intermediate_size", 1024, &cfg->mlp_hidden, path, msg, cap);
    if (!err) err = get_u32(root, "mamba_n_heads", 128, &cfg->mamba_heads, path, msg, cap);
    if (!err) err = get_u32(root, "mamba_n_groups", 1, &cfg->mamba_groups, path, msg, cap);
    if (!err) err = get_u32(root, "mamba_d_state", 256, &cfg->mamba_d_state, path, msg, cap);
    if (!err) err = get_u32(root, "mamba_d_conv", 4, &cfg->mamba_d_conv, path, msg, cap);
    if (!err) err = get_u32(root, "mamba_expand", 2, &cfg->mamba_expand, path, msg, cap);
    const json_t *dh = json_object_get(root, "mamba_d_head");
    if (!err && json_is_integer(dh))
        err = get_u32(root, "mamba_d_head", 0, &d_head, path, msg, cap);
    if (!err && d_head && cfg->mamba_heads &&
        (uint64_t)d_head * cfg->mamba_heads != (uint64_t)cfg->mamba_expand * cfg->dim)
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "%s: mamba_d_head %u x mamba_n_heads %u is not mamba_expand x "
                         "hidden_size (%llu)",
                         path, d_head, cfg->mamba_heads,
                         (unsigned long long)cfg->mamba_expand * cfg->dim);
    if (!err) err = get_f32(root, "embedding_multiplier", 1.0, &cfg->embed_mult, path, msg, cap);
    if (!err) err = get_f32(root, "residual_multiplier", 1.0, &cfg->residual_mult, path, msg, cap);
    if (!err) err = get_f32(root, "logits_scaling", 1.0, &cfg->logits_div, path, msg, cap);
    if (!err) err = get_f32(root, "attention_multiplier", 1.0, &cfg->attn_scale, path, msg, cap);
    if (!err)
        err = require_bool(root, "mamba_conv_bias", true, "the conv1d bias is always read", path,
                           msg, cap);
    if (!err)
        err = require_bool(root, "mamba_proj_bias", false, "no in_proj/out_proj biases", path, msg,
                           cap);
    const json_t *pos = json_object_get(root, "position_embedding_type");
    const char *pos_s = json_string_value(pos);
    if (!err && pos && !json_is_null(pos) &&
        (!pos_s || (strcmp(pos_s, "rope") && strcmp(pos_s, "nope"))))
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "%s: position_embedding_type must be \"rope\", \"nope\" or null", path);
    cfg->no_rope = !pos_s || strcmp(pos_s, "rope") != 0;
    if (!err &&
        !(cfg->embed_mult > 0 && cfg->residual_mult > 0 && cfg->logits_div > 0 &&
          cfg->attn_scale > 0 && isfinite(cfg->embed_mult) && isfinite(cfg->residual_mult) &&
          isfinite(cfg->logits_div) && isfinite(cfg->attn_scale)))
        return pd_errorf(msg, cap, PD_ERR_PARSE,
                         "%s: embedding_multiplier, residual_multiplier, logits_scaling and "
                         "attention_multiplier must be finite and > 0",
                         path);
    return err;
}

pd_err mdl_hf_config_parse(pd_model_config *cfg, const json_t *root, const char *path, char *msg,
                           size_t cap) {
    pd_err err = read_family(cfg, root, path, msg, cap);
    if (!err) err = read_sizes(cfg, root, path, msg, cap);
    if (!err) err = read_rope_scaling(cfg, root, path, msg, cap);
    if (!err && cfg->arch == PD_ARCH_GRANITE) err = read_granite(cfg, root, path, msg, cap);
    if (!err) err = refuse_unless(root, "hidden_act", "silu", path, msg, cap);
    if (!err) err = refuse_unless(root, "attention_bias", "false", path, msg, cap);
    if (!err) err = refuse_unless(root, "mlp_bias", "false", path, msg, cap);
    if (!err) err = refuse_unless(root, "use_sliding_window", "false", path, msg, cap);
    const json_t *tie = json_object_get(root, "tie_word_embeddings");
    if (!err && tie && !json_is_boolean(tie))
        err = pd_errorf(msg, cap, PD_ERR_PARSE, "%s: 'tie_word_embeddings' must be true or false",
                        path);
    cfg->tie_embeddings = json_is_true(tie);
    if (!err) err = get_token(root, "bos_token_id", &cfg->bos_token, path, msg, cap);
    if (!err) err = get_token(root, "eos_token_id", &cfg->eos_token, path, msg, cap);
    char why[200];
    if (!err && pd_model_config_check(cfg, why, sizeof(why)) != PD_OK)
        err = pd_errorf(msg, cap, PD_ERR_PARSE, "%s: %s", path, why);
    return err;
}

/* Granite's own fields (read_granite reads them back). */
static void granite_json(json_t *root, const pd_model_config *cfg) {
    json_t *types = json_array();
    for (const char *p = cfg->layers; *p; p++)
        json_array_append_new(types, json_string(*p == 'M' ? "mamba" : "attention"));
    json_object_set_new(root, "layer_types", types);
    json_object_set_new(root, "shared_intermediate_size", json_integer(cfg->mlp_hidden));
    json_object_set_new(root, "num_local_experts", json_integer(0));
    json_object_set_new(root, "num_experts_per_tok", json_integer(0));
    json_object_set_new(root, "mamba_n_heads", json_integer(cfg->mamba_heads));
    json_object_set_new(root, "mamba_n_groups", json_integer(cfg->mamba_groups));
    json_object_set_new(root, "mamba_d_state", json_integer(cfg->mamba_d_state));
    json_object_set_new(root, "mamba_d_conv", json_integer(cfg->mamba_d_conv));
    json_object_set_new(root, "mamba_expand", json_integer(cfg->mamba_expand));
    json_object_set_new(root, "mamba_d_head",
                        json_integer(cfg->mamba_expand * cfg->dim / cfg->mamba_heads));
    json_object_set_new(root, "mamba_conv_bias", json_true());
    json_object_set_new(root, "mamba_proj_bias", json_false());
    json_object_set_new(root, "position_embedding_type",
                        json_string(cfg->no_rope ? "nope" : "rope"));
    json_object_set_new(root, "embedding_multiplier", json_real(mdl_short_real(cfg->embed_mult)));
    json_object_set_new(root, "residual_multiplier", json_real(mdl_short_real(cfg->residual_mult)));
    json_object_set_new(root, "logits_scaling", json_real(mdl_short_real(cfg->logits_div)));
    json_object_set_new(root, "attention_multiplier", json_real(mdl_short_real(cfg->attn_scale)));
    json_object_del(root, "mlp_bias");
}

json_t *mdl_hf_config_json(const pd_model_config *cfg) {
    size_t f = 0;
    while (f + 1 < PD_ARRAY_LEN(families) && families[f].id != cfg->arch) f++;
    json_t *root = json_pack(
        "{s:[s],s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:f,s:f,s:s,s:b,s:b,s:b}", "architectures",
        families[f].arch, "model_type", families[f].model_type, "vocab_size", cfg->vocab,
        "hidden_size", cfg->dim, "intermediate_size", cfg->mlp_hidden, "num_hidden_layers",
        (int)strlen(cfg->layers), "num_attention_heads", cfg->attn_heads, "num_key_value_heads",
        cfg->attn_kv_heads, "head_dim", cfg->attn_head_dim, "rms_norm_eps",
        mdl_short_real(cfg->norm_eps), "rope_theta", mdl_short_real(cfg->rope_base), "hidden_act",
        "silu", "tie_word_embeddings", cfg->tie_embeddings, "attention_bias", 0, "mlp_bias", 0);
    if (cfg->arch == PD_ARCH_GRANITE) granite_json(root, cfg);
    json_object_set_new(root, "bos_token_id",
                        cfg->bos_token >= 0 ? json_integer(cfg->bos_token) : json_null());
    json_object_set_new(root, "eos_token_id",
                        cfg->eos_token >= 0 ? json_integer(cfg->eos_token) : json_null());
    json_object_set_new(
        root, "rope_scaling",
        cfg->rope_factor == 0.0f
            ? json_null()
            : json_pack("{s:s,s:f,s:f,s:f,s:i}", "rope_type", "llama3", "factor",
                        mdl_short_real(cfg->rope_factor), "low_freq_factor",
                        mdl_short_real(cfg->rope_low_freq_factor), "high_freq_factor",
                        mdl_short_real(cfg->rope_high_freq_factor),
                        "original_max_position_embeddings", cfg->rope_original_max));
    json_object_set_new(root, "torch_dtype", json_string("float32"));
    return root;
}
