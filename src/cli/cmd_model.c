/*
 * pdserve model — model tools.
 *
 *   model init --out DIR ...   writes a model directory (config.json and
 *                              model.safetensors) with seeded dummy weights
 *   model info ...             prints a model's shape and what one request
 *                              hands from prefill to decode, in bytes
 *
 * Exit codes: 0 done, 1 runtime failure, 2 usage error.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "commands.h"
#include "pdserve/model.h"

static void usage(FILE *to) {
    fprintf(to,
            "usage: pdserve model init --out DIR [--config NAME] [--layers PATTERN]\n"
            "                          [--dim N] [--vocab N] [--seed N] [--dtype f32|f16|bf16]\n"
            "                          [--shards N]\n"
            "       pdserve model info [--model DIR | --config NAME [--layers PATTERN] "
            "[--dim N]\n"
            "                          [--vocab N]]\n"
            "                          [--page-size N]\n"
            "\n"
            "init writes DIR/config.json and DIR/model.safetensors (DIR is created if needed;\n"
            "existing files are replaced):\n"
            "  --out DIR          the model directory (required)\n"
            "  --config NAME      built-in configuration: tiny (default) or small (hybrids),\n"
            "                     llama, qwen3 or granite (a Hugging Face LlamaForCausalLM,\n"
            "                     Qwen3ForCausalLM or GraniteMoeHybridForCausalLM checkpoint\n"
            "                     of a tiny shape), qwen3-0.6b or granite-4.0-h-350m (those\n"
            "                     real models' shapes, random weights: 0.6 and 0.34 billion\n"
            "                     parameters)\n"
            "  --layers PATTERN   layer pattern, M = Mamba2 mixer, A = attention (e.g. MAMA)\n"
            "  --dim N            model width; the MLP hidden size follows as 3 x N (the\n"
            "                     Mamba2 width is expand x N and must split into its heads)\n"
            "  --vocab N          vocabulary size (default the config's, 258 for the byte\n"
            "                     tokenizer); to pair the checkpoint with a real tokenizer.json\n"
            "                     put in DIR, give its number of ids\n"
            "  --seed N           seed of the dummy weights (default 0)\n"
            "  --dtype T          tensor dtype in the file: f32 (default, exact), f16 or bf16\n"
            "  --shards N         write N files model-0000K-of-0000N.safetensors and\n"
            "                     model.safetensors.index.json, as large Hugging Face\n"
            "                     checkpoints are (default 1: model.safetensors)\n"
            "\n"
            "info prints the shape, the parameter count, and the bytes of KV per token and\n"
            "per page and of one Mamba state slot (what a prefill node transfers):\n"
            "  --model DIR        a model directory instead of a built-in config\n"
            "  --model-path DIR   = --model\n"
            "  --page-size N      page size for the per-page figures (default 16)\n"
            "\n"
            "  --help             this text\n");
}

typedef struct model_opts {
    const char *out, *model_dir, *config, *layers, *dtype;
    uint64_t dim, seed, page_size, shards, vocab;
    bool have_dim, builtin_option;
} model_opts;

static int usage_error(const char *sub, const char *what, const char *arg) {
    fprintf(stderr, "pdserve model %s: %s%s (see pdserve model --help)\n", sub, what, arg);
    return 2;
}

/* 0 on success (or --help, with *help set), else exit code 2. */
static int parse_args(const char *sub, int argc, char **argv, model_opts *o, bool *help) {
    *o = (model_opts){.config = "tiny", .dtype = "f32", .page_size = 16, .shards = 1};
    *help = false;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            *help = true;
            return 0;
        }
        char name[64];
        const char *val = cli_option(argc, argv, &i, name, sizeof(name));
        bool ok = true;
        bool init_only = false, info_only = false;
        if (!strcmp(name, "--out")) {
            o->out = val;
            init_only = true;
        } else if (!strcmp(name, "--model") || !strcmp(name, "--model-path")) {
            o->model_dir = val;
            info_only = true;
        } else if (!strcmp(name, "--config")) {
            o->config = val;
            o->builtin_option = true;
        } else if (!strcmp(name, "--layers")) {
            o->layers = val;
            o->builtin_option = true;
        } else if (!strcmp(name, "--dtype")) {
            o->dtype = val;
            init_only = true;
        } else if (!strcmp(name, "--vocab")) {
            ok = cli_u64(val, 2, 1u << 22, &o->vocab);
            o->builtin_option = true;
        } else if (!strcmp(name, "--dim")) {
            ok = cli_u64(val, 1, 65536, &o->dim);
            o->have_dim = o->builtin_option = true;
        } else if (!strcmp(name, "--shards")) {
            ok = cli_u64(val, 1, 256, &o->shards);
            init_only = true;
        } else if (!strcmp(name, "--seed")) {
            ok = cli_u64(val, 0, UINT64_MAX, &o->seed);
            init_only = true;
        } else if (!strcmp(name, "--page-size")) {
            ok = cli_u64(val, 1, PD_MODEL_PAGE_SIZE_MAX, &o->page_size);
            info_only = true;
        } else {
            char cmd[32];
            snprintf(cmd, sizeof cmd, "model %s", sub);
            return cli_unknown_option_usage(cmd, name, usage, NULL);
        }
        if (!val) return usage_error(sub, "missing value for ", name);
        if (!ok) return usage_error(sub, "bad number for ", name);
        if (init_only && strcmp(sub, "init"))
            return usage_error(sub, "option only for init: ", name);
        if (info_only && strcmp(sub, "info"))
            return usage_error(sub, "option only for info: ", name);
    }
    if (!strcmp(sub, "init") && !o->out) return usage_error(sub, "--out DIR is required", "");
    if (!strcmp(sub, "info") && o->model_dir && o->builtin_option)
        return usage_error(sub, "--model cannot be combined with --config, --layers or --dim", "");
    if (!strcmp(sub, "init") && strcmp(o->dtype, "f32") && strcmp(o->dtype, "f16") &&
        strcmp(o->dtype, "bf16"))
        return usage_error(sub, "--dtype must be f32, f16 or bf16, not ", o->dtype);
    return 0;
}

/* The built-in config with the command line's changes. */
static pd_err builtin_config(const model_opts *o, pd_model_config *cfg, char *msg, size_t cap) {
    pd_err err = pd_model_config_preset(cfg, o->config, msg, cap);
    if (err != PD_OK) return err;
    if (o->layers) {
        if (strlen(o->layers) >= sizeof(cfg->layers))
            return pd_errorf(msg, cap, PD_ERR_INVALID, "--layers: more than %d layers",
                             PD_MODEL_LAYERS_MAX);
        snprintf(cfg->layers, sizeof(cfg->layers), "%s", o->layers);
    }
    if (o->have_dim) {
        cfg->dim = (uint32_t)o->dim;
        cfg->mlp_hidden = 3 * (uint32_t)o->dim;
    }
    if (o->vocab) {
        /* A real tokenizer's ids: the byte tokenizer's begin and end ids
         * mean nothing there (the tokenizer's files say which they are). */
        cfg->vocab = (uint32_t)o->vocab;
        cfg->bos_token = cfg->eos_token = -1;
    }
    return pd_model_config_check(cfg, msg, cap);
}

static int cmd_init(const model_opts *o) {
    char msg[512];
    pd_model_config cfg;
    if (builtin_config(o, &cfg, msg, sizeof(msg)) != PD_OK) {
        fprintf(stderr, "pdserve model init: %s\n", msg);
        return 2;
    }
    pd_dtype dtype = PD_DTYPE_F32;
    if (!strcmp(o->dtype, "f16")) dtype = PD_DTYPE_F16;
    else if (!strcmp(o->dtype, "bf16")) dtype = PD_DTYPE_BF16;
    pd_model *m = NULL;
    if (pd_model_create_random(&m, &cfg, o->seed, msg, sizeof(msg)) != PD_OK ||
        pd_model_save_sharded(m, o->out, dtype, (uint32_t)o->shards, msg, sizeof(msg)) != PD_OK) {
        fprintf(stderr, "pdserve model init: %s\n", msg);
        pd_model_destroy(m);
        return 1;
    }
    const pd_model_shape *s = pd_model_shape_get(m);
    printf("wrote %s: layers %s, dim %u, %u tensors, %llu parameters (%s), seed %llu\n", o->out,
           cfg.layers, cfg.dim, pd_model_tensor_count(m), (unsigned long long)s->params,
           pd_dtype_name(dtype), (unsigned long long)o->seed);
    pd_model_destroy(m);
    return 0;
}

static int cmd_info(const model_opts *o) {
    char msg[512];
    pd_model_config cfg;
    if (o->model_dir) {
        pd_model *m = NULL;
        if (pd_model_load(&m, o->model_dir, msg, sizeof(msg)) != PD_OK) {
            fprintf(stderr, "pdserve model info: %s\n", msg);
            return 1;
        }
        cfg = *pd_model_config_get(m);
        pd_model_destroy(m);
    } else if (builtin_config(o, &cfg, msg, sizeof(msg)) != PD_OK) {
        fprintf(stderr, "pdserve model info: %s\n", msg);
        return 2;
    }
    pd_model_shape s;
    pd_model_config_shape(&cfg, &s);
    uint32_t ps = (uint32_t)o->page_size;
    printf("architecture      %s\n", pd_model_arch_name(cfg.arch));
    printf("layers            %s (%u attention, %u Mamba2)\n", cfg.layers, s.n_attn, s.n_mamba);
    printf("dim               %u, vocab %u, mlp hidden %u\n", cfg.dim, cfg.vocab, cfg.mlp_hidden);
    if (s.n_attn)
        printf("attention         %u heads, %u kv heads, head dim %u\n", cfg.attn_heads,
               cfg.attn_kv_heads, cfg.attn_head_dim);
    if (s.n_mamba)
        printf("mamba2            d_inner %u, %u heads x %u, %u groups, d_state %u, d_conv %u\n",
               s.mamba_d_inner, cfg.mamba_heads, s.mamba_head_dim, cfg.mamba_groups,
               cfg.mamba_d_state, cfg.mamba_d_conv);
    printf("parameters        %llu (%.2f MB fp32)\n", (unsigned long long)s.params,
           (double)s.params * 4 / 1e6);
    printf("matmul FLOPs      %llu per token\n", (unsigned long long)s.matmul_flops_per_token);
    printf("KV per token      %zu bytes (K and V, %u attention layers, fp32)\n",
           s.kv_bytes_per_token, s.n_attn);
    printf("KV page           %zu bytes (page size %u)\n", s.kv_bytes_per_token * ps, ps);
    printf("Mamba slot        %zu bytes (per layer: conv %zu + ssm %zu, fp32)\n",
           s.mamba_slot_bytes, s.mamba_conv_bytes_per_layer, s.mamba_ssm_bytes_per_layer);
    return 0;
}

int cli_cmd_model(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    const char *sub = argv[1];
    if (strcmp(sub, "init") && strcmp(sub, "info")) {
        fprintf(stderr,
                "pdserve model: unknown subcommand '%s' (init or info; see pdserve model --help)\n",
                sub);
        return 2;
    }
    model_opts o;
    bool help;
    int rc = parse_args(sub, argc, argv, &o, &help);
    if (rc) return rc;
    if (help) {
        usage(stdout);
        return 0;
    }
    return !strcmp(sub, "init") ? cmd_init(&o) : cmd_info(&o);
}
