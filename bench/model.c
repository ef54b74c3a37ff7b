/*
 * bench/model — throughput of the tiny hybrid model on the CPU.
 *
 *   model [--quick] [--runs R] [--configs tiny,small] [--max-threads N]
 *         [--prompt-len N] [--decode-steps N] [--decode-batch B]
 *
 * For each configuration and for 1 .. max-threads threads:
 *   prefill  one request's prompt of --prompt-len tokens in one forward
 *            (prompt tokens per second)
 *   decode   --decode-batch requests advanced one token per step for
 *            --decode-steps steps, all in one batch per step (generated
 *            tokens per second)
 * Each figure is the median of R runs. GFLOP/s counts the weight matrix
 * products, the attention score and value sums and the Mamba scan, as the
 * executor tallies them.
 *
 * Baseline, measured in the same run: the textbook matrix product (one
 * running sum per output, one token at a time) on the largest weight matrix
 * of the configuration, next to the model's own fixed-order kernel on the
 * same matrix. The last lines are the achieved GFLOP/s.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../src/model/kernels.h"
#include "bench_util.h"
#include "pdserve/model.h"
#include "pdserve/tokenizer.h"

typedef struct opts {
    int runs;
    uint32_t max_threads, prompt_len, decode_steps, decode_batch;
    char configs[64];
} opts;

typedef struct figures {
    double prefill_tps, decode_tps, prefill_gflops, decode_gflops;
} figures;

#define DECODE_PROMPT 32u
#define PAGE_SIZE 16u

static void fill_prompt(int32_t *p, uint32_t n, uint64_t seed) {
    pd_rng rng;
    pd_rng_seed(&rng, seed);
    p[0] = PD_TOKEN_BOS;
    for (uint32_t i = 1; i < n; i++) p[i] = (int32_t)pd_rng_below(&rng, 256);
}

static void forward(pd_executor *ex, const pd_batch_item *items, uint32_t n, pd_item_result *res) {
    char msg[300];
    if (pd_model_forward(ex, items, n, res, NULL, msg, sizeof(msg)) != PD_OK) {
        fprintf(stderr, "model: forward failed: %s\n", msg);
        exit(1);
    }
}

/* Seconds and FLOPs of one prefill of the whole prompt. */
static void prefill_once(pd_executor *ex, const int32_t *prompt, uint32_t n, const uint32_t *pages,
                         uint32_t n_pages, double *seconds, double *flops) {
    pd_batch_item it = {.req = 1, .tokens = prompt, .n_tokens = n, .start_pos = 0, .pages = pages,
                        .n_pages = n_pages, .mamba_slot = 0, .snapshot_slot = PD_POOL_NONE,
                        .sample = true};
    pd_item_result r;
    uint64_t f0 = pd_model_executor_flops(ex), t0 = bench_now_ns();
    forward(ex, &it, 1, &r);
    *seconds = (double)(bench_now_ns() - t0) / 1e9;
    *flops = (double)(pd_model_executor_flops(ex) - f0);
}

/* Seconds and FLOPs of `steps` decode steps of `batch` requests. */
static void decode_once(pd_executor *ex, uint32_t batch, uint32_t steps, uint32_t pages_per,
                        const uint32_t *pages, const int32_t *prompts, double *seconds,
                        double *flops) {
    pd_batch_item *items = calloc(batch, sizeof(*items));
    pd_item_result *res = calloc(batch, sizeof(*res));
    int32_t *last = calloc(batch, sizeof(int32_t));
    for (uint32_t b = 0; b < batch; b++)
        items[b] = (pd_batch_item){.req = b, .tokens = prompts + (size_t)b * DECODE_PROMPT,
                                   .n_tokens = DECODE_PROMPT, .start_pos = 0,
                                   .pages = pages + (size_t)b * pages_per, .n_pages = pages_per,
                                   .mamba_slot = b, .snapshot_slot = PD_POOL_NONE, .sample = true};
    forward(ex, items, batch, res); /* the prompts, not timed */
    uint64_t f0 = pd_model_executor_flops(ex), t0 = bench_now_ns();
    for (uint32_t k = 0; k < steps; k++) {
        for (uint32_t b = 0; b < batch; b++) {
            last[b] = res[b].token;
            items[b].tokens = &last[b];
            items[b].n_tokens = 1;
            items[b].start_pos = DECODE_PROMPT + k;
            items[b].sample_index = k + 1;
        }
        forward(ex, items, batch, res);
    }
    *seconds = (double)(bench_now_ns() - t0) / 1e9;
    *flops = (double)(pd_model_executor_flops(ex) - f0);
    free(last);
    free(res);
    free(items);
}

static figures measure(const pd_model *m, uint32_t threads, const opts *o) {
    const uint32_t prefill_pages = PD_DIV_CEIL(o->prompt_len, PAGE_SIZE);
    const uint32_t pages_per = PD_DIV_CEIL(DECODE_PROMPT + o->decode_steps, PAGE_SIZE);
    const uint32_t n_pages = PD_MAX(prefill_pages, pages_per * o->decode_batch);
    pd_executor ex;
    char msg[300];
    if (pd_model_executor_create(&ex, m, PAGE_SIZE, n_pages, o->decode_batch, 0, threads, msg,
                                 sizeof(msg)) != PD_OK) {
        fprintf(stderr, "model: %s\n", msg);
        exit(1);
    }
    uint32_t *pages = malloc(sizeof(uint32_t) * n_pages);
    for (uint32_t i = 0; i < n_pages; i++) pages[i] = i;
    int32_t *prompt = malloc(sizeof(int32_t) * o->prompt_len);
    int32_t *prompts = malloc(sizeof(int32_t) * DECODE_PROMPT * o->decode_batch);
    fill_prompt(prompt, o->prompt_len, 1);
    for (uint32_t b = 0; b < o->decode_batch; b++)
        fill_prompt(prompts + (size_t)b * DECODE_PROMPT, DECODE_PROMPT, 2 + b);

    double *tps = malloc(sizeof(double) * (size_t)o->runs);
    double *gf = malloc(sizeof(double) * (size_t)o->runs);
    figures f;
    double s, fl;
    prefill_once(&ex, prompt, o->prompt_len, pages, n_pages, &s, &fl); /* warm-up */
    for (int r = 0; r < o->runs; r++) {
        prefill_once(&ex, prompt, o->prompt_len, pages, n_pages, &s, &fl);
        tps[r] = o->prompt_len / s;
        gf[r] = fl / s / 1e9;
    }
    f.prefill_tps = bench_median(tps, (size_t)o->runs);
    f.prefill_gflops = bench_median(gf, (size_t)o->runs);
    for (int r = 0; r < o->runs; r++) {
        decode_once(&ex, o->decode_batch, o->decode_steps, pages_per, pages, prompts, &s, &fl);
        tps[r] = (double)o->decode_batch * o->decode_steps / s;
        gf[r] = fl / s / 1e9;
    }
    f.decode_tps = bench_median(tps, (size_t)o->runs);
    f.decode_gflops = bench_median(gf, (size_t)o->runs);
    free(gf);
    free(tps);
    free(prompts);
    free(prompt);
    free(pages);
    pd_model_executor_destroy(&ex);
    return f;
}

/* The textbook product: one running sum per output, one row at a time. */
static void naive_matmul(float *out, const float *x, const float *w, uint32_t rows, uint32_t n_in,
                         uint32_t n_out) {
    for (uint32_t t = 0; t < rows; t++)
        for (uint32_t o = 0; o < n_out; o++) {
            float acc = 0.0f;
            for (uint32_t i = 0; i < n_in; i++)
                acc += w[(size_t)o * n_in + i] * x[(size_t)t * n_in + i];
            out[(size_t)t * n_out + o] = acc;
        }
}

static void baseline(const pd_model *m, const char *name, int runs) {
    const pd_model_config *c = pd_model_config_get(m);
    uint32_t n_in = c->dim, n_out = c->mlp_hidden, rows = 64;
    const float *w = pd_model_tensor(m, "model.layers.0.mlp.up_proj.weight", NULL);
    float *x = malloc(sizeof(float) * rows * n_in), *out = malloc(sizeof(float) * rows * n_out);
    for (uint32_t i = 0; i < rows * n_in; i++) x[i] = (float)(i % 13) * 0.1f - 0.6f;
    double *v = malloc(sizeof(double) * (size_t)runs * 2);
    double flops = 2.0 * rows * n_in * n_out;
    pd_par par = {NULL, 0};
    for (int r = 0; r < runs; r++) {
        uint64_t t0 = bench_now_ns();
        for (int k = 0; k < 20; k++) naive_matmul(out, x, w, rows, n_in, n_out);
        v[r] = 20 * flops / ((double)(bench_now_ns() - t0));
        t0 = bench_now_ns();
        for (int k = 0; k < 20; k++) mdl_matmul(&par, out, x, w, rows, n_in, n_out);
        v[runs + r] = 20 * flops / ((double)(bench_now_ns() - t0));
    }
    double naive = bench_median(v, (size_t)runs), ours = bench_median(v + runs, (size_t)runs);
    printf("baseline %-5s  %ux%u matrix x 64 tokens, 1 thread: textbook loop %.2f GFLOP/s, "
           "fixed-order kernel %.2f GFLOP/s (x%.1f)\n",
           name, n_out, n_in, naive, ours, ours / naive);
    free(v);
    free(out);
    free(x);
}

static bool parse_u32(const char *s, uint32_t *out) {
    char *end;
    unsigned long v = strtoul(s, &end, 10);
    if (*s == '\0' || *end || v == 0 || v > 1000000) return false;
    *out = (uint32_t)v;
    return true;
}

/* Fills o from the command line; returns -1 to go on, or the exit status. */
static int parse_args(int argc, char **argv, opts *o) {
    *o = (opts){.runs = 5, .max_threads = 2, .prompt_len = 512, .decode_steps = 64,
                .decode_batch = 16};
    snprintf(o->configs, sizeof(o->configs), "tiny,small");
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint32_t n = 0;
        bool ok = true;
        if (!strcmp(a, "--quick")) {
            o->runs = 3;
            o->prompt_len = 128;
            o->decode_steps = 16;
            o->decode_batch = 8;
            continue;
        }
        if (!v) ok = false;
        else if (!strcmp(a, "--runs")) {
            ok = parse_u32(v, &n);
            o->runs = (int)n;
        }
        else if (!strcmp(a, "--max-threads"))
            ok = parse_u32(v, &o->max_threads) && o->max_threads <= PD_MODEL_THREADS_MAX;
        else if (!strcmp(a, "--prompt-len")) ok = parse_u32(v, &o->prompt_len);
        else if (!strcmp(a, "--decode-steps")) ok = parse_u32(v, &o->decode_steps);
        else if (!strcmp(a, "--decode-batch"))
            ok = parse_u32(v, &o->decode_batch) && o->decode_batch <= PD_MODEL_BATCH_ITEMS_MAX;
        else if (!strcmp(a, "--configs")) snprintf(o->configs, sizeof(o->configs), "%s", v);
        else ok = false;
        if (!ok) {
            fprintf(stderr,
                    "usage: model [--quick] [--runs R] [--configs tiny,small] [--max-threads N]\n"
                    "             [--prompt-len N] [--decode-steps N] [--decode-batch B]\n"
                    "  Prefill and decode tokens/s of the tiny hybrid model per config and thread\n"
                    "  count (medians of R runs), a textbook matrix-product baseline, and the\n"
                    "  achieved GFLOP/s. --quick: prompt 128, 16 steps of 8 requests, 3 runs.\n");
            return strcmp(a, "--help") ? 2 : 0;
        }
        i++;
    }
    return -1;
}

/* One line per thread count for configuration `name`, then its baseline;
 * fig gets the figures. Returns false if the configuration is unknown. */
static bool run_config(const char *name, const opts *o, figures *fig) {
    pd_model_config cfg;
    char msg[200];
    pd_model *m;
    if (pd_model_config_preset(&cfg, name, msg, sizeof(msg)) != PD_OK ||
        pd_model_create_random(&m, &cfg, 1, msg, sizeof(msg)) != PD_OK) {
        fprintf(stderr, "model: %s\n", msg);
        return false;
    }
    for (uint32_t t = 1; t <= o->max_threads; t++) {
        fig[t - 1] = measure(m, t, o);
        const figures *f = &fig[t - 1];
        printf("%-6s %7u %15.0f %18.2f %16.0f %15.2f\n", name, t, f->prefill_tps,
               f->prefill_gflops, f->decode_tps, f->decode_gflops);
    }
    baseline(m, name, o->runs);
    pd_model_destroy(m);
    return true;
}

int main(int argc, char **argv) {
    opts o;
    int status = parse_args(argc, argv, &o);
    if (status >= 0) return status;

    const char *names[4];
    uint32_t n_configs = 0;
    char list[64];
    snprintf(list, sizeof(list), "%s", o.configs);
    for (char *tok = strtok(list, ","); tok && n_configs < 4; tok = strtok(NULL, ","))
        names[n_configs++] = tok;
    figures fig[4][PD_MODEL_THREADS_MAX];

    printf("%-6s %7s %15s %18s %16s %15s   "
           "(median of %d; prompt %u tokens; decode %u requests x %u steps)\n",
           "config", "threads", "prefill tok/s", "prefill GFLOP/s", "decode tok/s",
           "decode GFLOP/s", o.runs, o.prompt_len, o.decode_batch, o.decode_steps);
    for (uint32_t c = 0; c < n_configs; c++)
        if (!run_config(names[c], &o, fig[c])) return 2;
    for (int phase = 0; phase < 2; phase++) {
        printf("achieved GFLOP/s, %s:", phase ? "decode " : "prefill");
        for (uint32_t c = 0; c < n_configs; c++)
            for (uint32_t t = 1; t <= o.max_threads; t++)
                printf("  %s %ut %.2f", names[c], t,
                       phase ? fig[c][t - 1].decode_gflops : fig[c][t - 1].prefill_gflops);
        printf("\n");
    }
    return 0;
}
