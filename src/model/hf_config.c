/*
 * hf_config.c — the config.json of Hugging Face checkpoints (LlamaForCausalLM,
 * Qwen3ForCausalLM) into a pd_model_config, and back.
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
 * rope_scaling type, a sliding window.
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
};

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
                     "or a pdserve_hybrid config)",
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

pd_err mdl_hf_config_parse(pd_model_config *cfg, const json_t *root, const char *path, char *msg,
                           size_t cap) {
    pd_err err = read_family(cfg, root, path, msg, cap);
    if (!err) err = read_sizes(cfg, root, path, msg, cap);
    if (!err) err = read_rope_scaling(cfg, root, path, msg, cap);
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

json_t *mdl_hf_config_json(const pd_model_config *cfg) {
    size_t f = cfg->arch == PD_ARCH_QWEN3 ? 1 : 0;
    json_t *root = json_pack(
        "{s:[s],s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:f,s:f,s:s,s:b,s:b,s:b}", "architectures",
        families[f].arch, "model_type", families[f].model_type, "vocab_size", cfg->vocab,
        "hidden_size", cfg->dim, "intermediate_size", cfg->mlp_hidden, "num_hidden_layers",
        (int)strlen(cfg->layers), "num_attention_heads", cfg->attn_heads, "num_key_value_heads",
        cfg->attn_kv_heads, "head_dim", cfg->attn_head_dim, "rms_norm_eps",
        mdl_short_real(cfg->norm_eps), "rope_theta", mdl_short_real(cfg->rope_base), "hidden_act",
        "silu", "tie_word_embeddings", cfg->tie_embeddings, "attention_bias", 0, "mlp_bias", 0);
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
