/*
 * pdserve generate — offline generation with the tiny hybrid model.
 *
 * Drives the model executor directly, the way a colocated engine would
 * without the scheduling: KV pages and one Mamba slot come from pd_pool
 * pools, the prompt is prefilled in chunks of --chunked-prefill-size tokens
 * (only the last chunk samples), then one token is decoded per step. The
 * page size and chunk size change how the work is cut, never the tokens;
 * the model's test suite and tests/model/cli.cmake check that.
 *
 * Exit codes: 0 done, 1 runtime failure (model directory missing or
 * malformed, out of memory), 2 usage error.
 */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "args.h"
#include "commands.h"
#include "pdserve/hf_tokenizer.h"
#include "pdserve/model.h"
#include "pdserve/pool.h"
#include "pdserve/tokenizer.h"

#define MAX_NEW_TOKENS_MAX 1000000u
#define PROMPT_BYTES_MAX (1u << 24)

static void usage(FILE *to) {
    fprintf(to,
            "usage: pdserve generate --prompt TEXT [options]\n"
            "\n"
            "Generates text offline with the tiny hybrid attention + Mamba2 model (byte-level\n"
            "tokenizer: the prompt's bytes, preceded by a begin token), or with a checkpoint\n"
            "directory's model and its tokenizer.json when it has one.\n"
            "\n"
            "model (default: the built-in tiny config with seeded dummy weights):\n"
            "  --model DIR                 a checkpoint directory:\n"
            "                              config.json, model.safetensors or its shards, and\n"
            "                              tokenizer.json (+ tokenizer_config.json) if present;\n"
            "                              a Hugging Face checkpoint or `pdserve model init`'s\n"
            "  --model-path DIR            = --model\n"
            "  --config NAME               built-in configuration: tiny (default), small, llama,\n"
            "                              qwen3, granite, qwen3-0.6b or granite-4.0-h-350m\n"
            "  --layers PATTERN            layer pattern of the built-in config, M = Mamba2,\n"
            "                              A = attention, e.g. MAMA (default: the config's)\n"
            "  --seed N                    seed of the dummy weights (default 0)\n"
            "\n"
            "generation:\n"
            "  --prompt TEXT               the prompt (required; may be empty)\n"
            "  --max-new-tokens N          tokens to generate, at most (default 32); stops\n"
            "                              early at the end token unless --ignore-eos\n"
            "  --ignore-eos                keep generating after the end token\n"
            "  --temperature F             0 = greedy (default); otherwise sample\n"
            "  --top-p F                   nucleus cut in (0, 1] (default 1 = none)\n"
            "  --sampling-seed N           seed of the sampling generator (default 0)\n"
            "\n"
            "execution (never changes the tokens):\n"
            "  --page-size N               tokens per KV page (default 16)\n"
            "  --chunked-prefill-size N    prompt tokens per prefill forward (default 512)\n"
            "  --threads N                 worker threads, caller included (default 1)\n"
            "\n"
            "output:\n"
            "  --json                      print one JSON object: output_ids, text,\n"
            "                              prompt_tokens, completion_tokens, finish_reason,\n"
            "                              output_logprobs, timing (ms and tokens/s)\n"
            "  --help                      this text\n"
            "\n"
            "Without --json the generated text is printed (bytes that are not valid UTF-8\n"
            "shown as U+FFFD). Exit codes: 0 ok, 1 runtime error, 2 usage error.\n");
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

typedef struct gen_opts {
    const char *prompt, *model_dir, *config, *layers;
    uint64_t seed, max_new, page_size, chunk, sampling_seed, threads;
    float temperature, top_p;
    bool json, ignore_eos;
    bool builtin_option;        /* --config, --layers or --seed given */
} gen_opts;

static int usage_error(const char *fmt, const char *a, const char *b) {
    fprintf(stderr, "pdserve generate: ");
    fprintf(stderr, fmt, a, b);
    fprintf(stderr, " (see pdserve generate --help)\n");
    return 2;
}

/* 0 on success, else the exit code (2). */
static int parse_args(int argc, char **argv, gen_opts *o, bool *help) {
    *o = (gen_opts){.config = "tiny", .max_new = 32, .page_size = 16, .chunk = 512, .threads = 1,
                    .top_p = 1.0f};
    *help = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            *help = true;
            return 0;
        }
        if (!strcmp(a, "--json")) { o->json = true; continue; }
        if (!strcmp(a, "--ignore-eos")) { o->ignore_eos = true; continue; }
        /* every other option takes a value: --opt VALUE or --opt=VALUE */
        char name[64];
        const char *val = cli_option(argc, argv, &i, name, sizeof(name));
        bool known = true, ok = true;
        if (!strcmp(name, "--prompt")) o->prompt = val;
        else if (!strcmp(name, "--model") || !strcmp(name, "--model-path")) o->model_dir = val;
        else if (!strcmp(name, "--config")) {
            o->config = val;
            o->builtin_option = true;
        } else if (!strcmp(name, "--layers")) {
            o->layers = val;
            o->builtin_option = true;
        }
        else if (!strcmp(name, "--seed")) {
            ok = cli_u64(val, 0, UINT64_MAX, &o->seed);
            o->builtin_option = true;
        } else if (!strcmp(name, "--max-new-tokens"))
            ok = cli_u64(val, 1, MAX_NEW_TOKENS_MAX, &o->max_new);
        else if (!strcmp(name, "--page-size"))
            ok = cli_u64(val, 1, PD_MODEL_PAGE_SIZE_MAX, &o->page_size);
        else if (!strcmp(name, "--chunked-prefill-size"))
            ok = cli_u64(val, 1, UINT32_MAX, &o->chunk);
        else if (!strcmp(name, "--threads"))
            ok = cli_u64(val, 1, PD_MODEL_THREADS_MAX, &o->threads);
        else if (!strcmp(name, "--sampling-seed"))
            ok = cli_u64(val, 0, UINT64_MAX, &o->sampling_seed);
        else if (!strcmp(name, "--temperature"))
            ok = cli_float(val, 0.0f, 1000.0f, &o->temperature);
        else if (!strcmp(name, "--top-p")) ok = cli_float(val, 1e-6f, 1.0f, &o->top_p);
        else known = false;
        if (!known) return cli_unknown_option_usage("generate", name, usage, NULL);
        if (!val) return usage_error("%s needs a value%s", name, "");
        if (!ok) return usage_error("%s: bad value '%s'", name, val);
    }
    if (!o->prompt) return usage_error("--prompt is required%s%s", "", "");
    if (o->model_dir && o->builtin_option)
        return usage_error("--model cannot be combined with --config, --layers or --seed%s%s", "",
                           "");
    if (strlen(o->prompt) > PROMPT_BYTES_MAX)
        return usage_error("--prompt longer than 16 MiB%s%s", "", "");
    return 0;
}

static pd_err make_model(const gen_opts *o, pd_model **out, char *msg, size_t cap) {
    if (o->model_dir) return pd_model_load(out, o->model_dir, msg, cap);
    pd_model_config cfg;
    pd_err err = pd_model_config_preset(&cfg, o->config, msg, cap);
    if (err != PD_OK) return err;
    if (o->layers) {
        if (strlen(o->layers) >= sizeof(cfg.layers))
            return pd_errorf(msg, cap, PD_ERR_INVALID, "--layers: more than %d layers",
                             PD_MODEL_LAYERS_MAX);
        snprintf(cfg.layers, sizeof(cfg.layers), "%s", o->layers);
    }
    return pd_model_create_random(out, &cfg, o->seed, msg, cap);
}

typedef struct gen_result {
    int32_t *ids;
    float *logprobs;
    uint32_t n;
    bool stopped;               /* hit the end token */
    double prefill_ms, decode_ms;
} gen_result;

static pd_err run(const gen_opts *o, const pd_model *m, const int32_t *prompt, uint32_t n_prompt,
                  gen_result *res, char *msg, size_t cap) {
    const pd_model_config *cfg = pd_model_config_get(m);
    const uint32_t ps = (uint32_t)o->page_size;
    const uint64_t positions = (uint64_t)n_prompt + o->max_new;
    if (PD_DIV_CEIL(positions, ps) > PD_POOL_UNITS_MAX)
        return pd_errorf(msg, cap, PD_ERR_TOOBIG, "prompt plus new tokens need too many pages");
    const uint32_t n_pages = (uint32_t)PD_DIV_CEIL(positions, ps);
    pd_executor ex = {0};
    pd_pool *kv = NULL, *slots = NULL;
    uint32_t *pages = malloc(sizeof(uint32_t) * n_pages);
    uint32_t slot = PD_POOL_NONE;
    pd_err err = pages ? PD_OK : PD_ERR_NOMEM;
    if (err == PD_OK)
        err = pd_model_executor_create(&ex, m, ps, n_pages, 1, 0, (uint32_t)o->threads, msg, cap);
    if (err == PD_OK) err = pd_pool_create(&kv, "kv", PD_POOL_KV, n_pages, ps);
    if (err == PD_OK) err = pd_pool_create(&slots, "mamba", PD_POOL_MAMBA, 1, 0);
    if (err == PD_OK) err = pd_pool_alloc_n(kv, n_pages, pages);
    if (err == PD_OK && pd_model_shape_get(m)->n_mamba) err = pd_pool_alloc(slots, &slot);
    if (err != PD_OK && msg && !msg[0]) pd_errorf(msg, cap, err, "cannot set up the executor");

    pd_sampling sampling = {
        .temperature = o->temperature, .top_p = o->top_p, .seed = o->sampling_seed};
    pd_batch_item item = {.req = 1,
                          .pages = pages,
                          .n_pages = n_pages,
                          .mamba_slot = slot,
                          .snapshot_slot = PD_POOL_NONE,
                          .sampling = sampling};
    pd_item_result r;
    pd_item_top top; /* unread: generate prints no alternatives */
    double t0 = now_ms();
    for (uint32_t pos = 0; err == PD_OK && pos < n_prompt; pos += item.n_tokens) {
        item.tokens = prompt + pos;
        item.start_pos = pos;
        item.n_tokens = (uint32_t)PD_MIN(o->chunk, n_prompt - pos);
        item.sample = pos + item.n_tokens == n_prompt;
        item.sample_index = 0;
        err = pd_model_forward(&ex, &item, 1, &r, &top, NULL, msg, cap);
    }
    double t1 = now_ms();
    res->n = 0;
    while (err == PD_OK) {
        res->ids[res->n] = r.token;
        res->logprobs[res->n] = r.logprob;
        res->n++;
        if (r.token == cfg->eos_token && !o->ignore_eos) {
            res->stopped = true;
            break;
        }
        if (res->n == o->max_new) break;
        item.tokens = &res->ids[res->n - 1];
        item.n_tokens = 1;
        item.start_pos = n_prompt + res->n - 1;
        item.sample = true;
        item.sample_index = res->n;
        err = pd_model_forward(&ex, &item, 1, &r, &top, NULL, msg, cap);
    }
    res->prefill_ms = t1 - t0;
    res->decode_ms = now_ms() - t1;
    pd_pool_destroy(slots);
    pd_pool_destroy(kv);
    pd_model_executor_destroy(&ex);
    free(pages);
    return err;
}

static void print_json(const gen_result *res, uint32_t n_prompt, const char *text) {
    json_t *ids = json_array(), *lps = json_array();
    for (uint32_t i = 0; i < res->n; i++) {
        json_array_append_new(ids, json_integer(res->ids[i]));
        json_array_append_new(lps, json_real(res->logprobs[i]));
    }
    uint32_t decoded = res->n > 0 ? res->n - 1 : 0; /* the first token comes from prefill */
    json_t *timing = json_pack(
        "{s:f, s:f, s:f, s:f}", "prefill_ms", res->prefill_ms, "decode_ms", res->decode_ms,
        "prefill_tokens_per_s", res->prefill_ms > 0 ? n_prompt / (res->prefill_ms / 1e3) : 0.0,
        "decode_tokens_per_s", res->decode_ms > 0 ? decoded / (res->decode_ms / 1e3) : 0.0);
    json_t *root = json_pack("{s:o, s:s, s:i, s:i, s:s, s:o, s:o}", "output_ids", ids, "text", text,
                             "prompt_tokens", (json_int_t)n_prompt, "completion_tokens",
                             (json_int_t)res->n, "finish_reason", res->stopped ? "stop" : "length",
                             "output_logprobs", lps, "timing", timing);
    char *s = json_dumps(root, JSON_COMPACT | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(7));
    if (s) printf("%s\n", s);
    free(s);
    json_decref(root);
}

/* The prompt's ids: through DIR/tokenizer.json when the model directory has
 * one (with the special additions its post-processor makes, as /generate's
 * text does), else the byte tokenizer after the model's begin token. */
static pd_err encode_prompt(const pd_hf_tokenizer *tok, const pd_model_config *cfg,
                            const char *text, int32_t **ids, size_t *n, char *msg, size_t cap) {
    size_t len = strlen(text);
    if (tok) return pd_hf_tokenizer_encode(tok, text, len, true, ids, n, msg, cap);
    if (cfg->vocab < PD_TOKENIZER_VOCAB)
        return pd_errorf(msg, cap, PD_ERR_INVALID,
                         "the model's vocabulary (%u) is smaller than the byte tokenizer's (%u) "
                         "and its directory has no tokenizer.json",
                         cfg->vocab, PD_TOKENIZER_VOCAB);
    bool bos = cfg->bos_token >= 0;
    *n = len + (bos ? 1 : 0);
    *ids = malloc(sizeof(int32_t) * (*n ? *n : 1));
    if (!*ids) return pd_errorf(msg, cap, PD_ERR_NOMEM, "out of memory");
    pd_tokenizer_encode(text, len, false, *ids + (bos ? 1 : 0), len);
    if (bos) (*ids)[0] = cfg->bos_token;
    return PD_OK;
}

/* The output ids as text (special tokens left out), invalid UTF-8 replaced. */
static char *decode_text(const pd_hf_tokenizer *tok, const int32_t *ids, uint32_t n) {
    char *raw = NULL, msg[128];
    size_t raw_len = 0;
    if (tok) {
        if (pd_hf_tokenizer_decode(tok, ids, n, true, &raw, &raw_len, msg, sizeof msg) != PD_OK)
            raw = NULL; /* an id the model has and the tokenizer not: no text */
    } else {
        raw_len = pd_tokenizer_decode(ids, n, NULL, 0);
        raw = malloc(raw_len + 1);
        if (raw) pd_tokenizer_decode(ids, n, raw, raw_len + 1);
    }
    if (!raw) raw_len = 0; /* no text (or out of memory: so is the malloc below) */
    size_t text_len = pd_utf8_sanitize(raw ? raw : "", raw_len, NULL, 0);
    char *text = malloc(text_len + 1);
    if (text) pd_utf8_sanitize(raw ? raw : "", raw_len, text, text_len + 1);
    free(raw);
    return text;
}

int cli_cmd_generate(int argc, char **argv) {
    gen_opts o;
    bool help;
    int rc = parse_args(argc, argv, &o, &help);
    if (rc) return rc;
    if (help) {
        usage(stdout);
        return 0;
    }
    char msg[512] = "";
    pd_model *m = NULL;
    pd_hf_tokenizer *tok = NULL;
    if (make_model(&o, &m, msg, sizeof(msg)) != PD_OK ||
        (o.model_dir &&
         pd_hf_tokenizer_load_dir(o.model_dir, pd_model_config_get(m)->vocab, &tok, msg,
                                  sizeof msg) != PD_OK)) {
        fprintf(stderr, "pdserve generate: %s\n", msg);
        pd_model_destroy(m);
        return o.model_dir ? 1 : 2;
    }
    int32_t *prompt = NULL;
    size_t n_prompt = 0;
    gen_result res = {.ids = malloc(sizeof(int32_t) * o.max_new),
                      .logprobs = malloc(sizeof(float) * o.max_new)};
    char *text = NULL;
    rc = 1;
    if (!res.ids || !res.logprobs) {
        fprintf(stderr, "pdserve generate: out of memory\n");
        goto out;
    }
    if (encode_prompt(tok, pd_model_config_get(m), o.prompt, &prompt, &n_prompt, msg, sizeof msg) !=
        PD_OK) {
        fprintf(stderr, "pdserve generate: %s\n", msg);
        goto out;
    }
    if (n_prompt == 0) {
        fprintf(stderr, "pdserve generate: the prompt has no tokens (empty, and no begin token)\n");
        rc = 2;
        goto out;
    }
    if (run(&o, m, prompt, (uint32_t)n_prompt, &res, msg, sizeof(msg)) != PD_OK) {
        fprintf(stderr, "pdserve generate: %s\n", msg[0] ? msg : "forward failed");
        goto out;
    }
    text = decode_text(tok, res.ids, res.n);
    if (!text) {
        fprintf(stderr, "pdserve generate: out of memory\n");
        goto out;
    }
    if (o.json) print_json(&res, (uint32_t)n_prompt, text);
    else printf("%s\n", text);
    rc = 0;
out:
    free(text);
    free(res.logprobs);
    free(res.ids);
    free(prompt);
    pd_hf_tokenizer_free(tok);
    pd_model_destroy(m);
    return rc;
}
