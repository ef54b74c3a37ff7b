/*
 * bench/model — throughput of the model's forward pass on the CPU, against
 * what the machine can do, measured in the same run.
 *
 *   model [--quick] [--runs R] [--configs tiny,small] [--model-path DIR[,DIR]]
 *         [--max-threads N] [--prompt-len N] [--decode-steps N]
 *         [--decode-batch B] [--bw-mib M]
 *
 * The machine, first, for 1 .. max-threads threads:
 *   peak     independent chains of 256-bit FMAs on registers (12 per thread,
 *            enough to fill both FMA pipes), 16 FLOPs per instruction; a
 *            scalar FMA loop where there is no AVX2
 *   memory   a streaming read (summed) of an M MiB buffer (default 1 GiB,
 *            far larger than any L3), in GB/s
 *
 * Then, for each model (--configs presets with seeded weights, then each
 * --model-path checkpoint, loaded with pd_model_load) and thread count:
 *   prefill  one request's prompt of --prompt-len tokens in one forward
 *   decode   --decode-batch requests advanced one token per step for
 *            --decode-steps steps, all in one batch per step
 * with tokens/s, GFLOP/s (the weight products, attention sums and Mamba scan
 * as the executor tallies them) and its % of the peak for that thread count,
 * and for decode the weight bytes streamed per step / step time and its % of
 * the measured memory bandwidth.
 *
 * The kernels alone, decode-shaped: one row against a weight matrix of M
 * MiB (f32; M/2 in bf16), in GB/s of weights read and % of the memory read.
 *
 * Last, per model, the kernels alone on its up_proj shape (dim -> mlp_hidden)
 * for 64 rows, one thread: the textbook product (one running sum per output,
 * one row at a time) as the baseline, mdl_matmul and mdl_matmul_bf16.
 *
 * Every figure is the median of R runs. Nothing here asserts on time.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "../src/model/kernels.h"
#include "bench_util.h"
#include "pdserve/model.h"
#include "pdserve/safetensors.h"

#define TARGETS_MAX 16
#define DECODE_PROMPT 32u
#define PAGE_SIZE 16u

/* A model to measure: a preset with seeded weights, or a checkpoint. To add
 * one, add a preset to config.c, or pass its directory. */
typedef struct target {
    char name[64];
    bool is_dir; /* name is a directory for pd_model_load, else a preset */
} target;

typedef struct opts {
    int runs;
    uint32_t max_threads, prompt_len, decode_steps, decode_batch, bw_mib;
    uint32_t peak_iters; /* of the FMA loop, per thread */
    uint32_t n_targets;
    target targets[TARGETS_MAX];
} opts;

/* What the machine does, per thread count (index threads - 1). */
typedef struct machine {
    double peak_gflops[PD_MODEL_THREADS_MAX];
    double read_gbs[PD_MODEL_THREADS_MAX];
    const char *peak_kind;
} machine;

typedef struct figures {
    double prefill_tps, decode_tps, prefill_gflops, decode_gflops, decode_weight_gbs;
} figures;

/* ---- the machine ----------------------------------------------------------------- */

#define PEAK_CHAINS 12
#define PEAK_ITERS 20000000u

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) static float fma_chains_avx2(uint32_t iters) {
    __m256 a[PEAK_CHAINS];
    const __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
#pragma GCC unroll 12
    for (int k = 0; k < PEAK_CHAINS; k++) a[k] = _mm256_set1_ps((float)k * 1e-3f);
    for (uint32_t i = 0; i < iters; i++)
#pragma GCC unroll 12
        for (int k = 0; k < PEAK_CHAINS; k++) a[k] = _mm256_fmadd_ps(a[k], m, c);
    float lanes[8], sum = 0.0f;
    for (int k = 0; k < PEAK_CHAINS; k++) {
        _mm256_storeu_ps(lanes, a[k]);
        for (int j = 0; j < 8; j++) sum += lanes[j];
    }
    return sum;
}
#endif

static bool have_avx2(void) { return strcmp(mdl_kernels_path(), "avx2") == 0; }

/* FLOPs of fma_chains(iters). */
static double fma_chains_flops(uint32_t iters) {
    return (double)iters * PEAK_CHAINS * (have_avx2() ? 16.0 : 2.0);
}

static float fma_chains(uint32_t iters) {
#if defined(__x86_64__)
    if (have_avx2()) return fma_chains_avx2(iters);
#endif
    float a[PEAK_CHAINS];
    for (int k = 0; k < PEAK_CHAINS; k++) a[k] = (float)k * 1e-3f;
    for (uint32_t i = 0; i < iters; i++)
        for (int k = 0; k < PEAK_CHAINS; k++) a[k] = fmaf(a[k], 0.999999f, 1e-7f);
    float sum = 0.0f;
    for (int k = 0; k < PEAK_CHAINS; k++) sum += a[k];
    return sum;
}

typedef struct machine_job {
    const uint64_t *buf; /* the memory read; NULL: the FMA loop */
    size_t words;
    uint32_t iters; /* of the FMA loop */
    uint32_t units;
    uint64_t sink[PD_MODEL_THREADS_MAX]; /* per worker, so nothing is optimised away */
} machine_job;

static void machine_work(void *ctx, uint32_t begin, uint32_t end, uint32_t worker) {
    machine_job *j = ctx;
    if (!j->buf) {
        for (uint32_t u = begin; u < end; u++) j->sink[worker] += (uint64_t)fma_chains(j->iters);
        return;
    }
    const size_t lo = j->words * begin / j->units, hi = j->words * end / j->units;
    uint64_t s = 0;
    for (size_t i = lo; i < hi; i++) s += j->buf[i];
    j->sink[worker] += s;
}

/* Median seconds of one run of job over the pool's threads. */
static double machine_time(pd_threads *tp, machine_job *j, int runs) {
    double *v = malloc(sizeof(double) * (size_t)runs);
    for (int r = 0; r < runs; r++) {
        uint64_t t0 = bench_now_ns();
        mdl_threads_run(tp, j->units, machine_work, j);
        v[r] = (double)(bench_now_ns() - t0) / 1e9;
    }
    double s = bench_median(v, (size_t)runs);
    free(v);
    return s;
}

static void measure_machine(machine *mc, const opts *o) {
    const size_t bytes = (size_t)o->bw_mib << 20;
    uint64_t *buf = malloc(bytes);
    if (!buf) {
        fprintf(stderr, "model: cannot allocate %u MiB for the memory read\n", o->bw_mib);
        exit(1);
    }
    memset(buf, 1, bytes); /* touch every page before timing */
    mc->peak_kind = have_avx2() ? "AVX2 FMA" : "scalar fmaf";
    for (uint32_t t = 1; t <= o->max_threads; t++) {
        pd_threads *tp;
        if (mdl_threads_create(&tp, t) != PD_OK) exit(1);
        machine_job fj = {.units = t, .iters = o->peak_iters};
        const double flops = t * fma_chains_flops(o->peak_iters);
        mc->peak_gflops[t - 1] = flops / machine_time(tp, &fj, o->runs) / 1e9;
        machine_job mj = {.buf = buf, .words = bytes / 8, .units = 64 * t};
        machine_work(&mj, 0, mj.units, 0); /* warm the page tables */
        mc->read_gbs[t - 1] = (double)bytes / machine_time(tp, &mj, o->runs) / 1e9;
        mdl_threads_destroy(tp);
    }
    free(buf);
    printf("machine: kernels %s; peak %s (%d chains/thread), memory read %u MiB:",
           mdl_kernels_path(), mc->peak_kind, PEAK_CHAINS, o->bw_mib);
    for (uint32_t t = 1; t <= o->max_threads; t++)
        printf("  %ut %.1f GFLOP/s %.1f GB/s", t, mc->peak_gflops[t - 1], mc->read_gbs[t - 1]);
    printf("\n");
}

/* ---- the model ------------------------------------------------------------------- */

/* Bytes of weights one decode step reads: every matrix of the weight
 * products once (the embedding table only by rows). A model loaded from a
 * BF16 checkpoint keeps all its matrices in bf16 (2 bytes a weight), any
 * other in fp32 (4). */
static double weight_bytes_per_step(const pd_model *m) {
    double bytes_per_weight = 4.0;
    for (uint32_t i = 0; i < pd_model_tensor_count(m); i++)
        if (pd_model_tensor_is_bf16(m, pd_model_tensor_name(m, i))) bytes_per_weight = 2.0;
    return (double)pd_model_shape_get(m)->matmul_flops_per_token / 2.0 * bytes_per_weight;
}

static void fill_prompt(const pd_model_config *c, int32_t *p, uint32_t n, uint64_t seed) {
    pd_rng rng;
    pd_rng_seed(&rng, seed);
    for (uint32_t i = 0; i < n; i++) p[i] = (int32_t)pd_rng_below(&rng, c->vocab);
    if (c->bos_token >= 0) p[0] = c->bos_token;
}

static void forward(pd_executor *ex, const pd_batch_item *items, uint32_t n, pd_item_result *res) {
    char msg[300];
    if (pd_model_forward(ex, items, n, res, NULL, NULL, msg, sizeof(msg)) != PD_OK) {
        fprintf(stderr, "model: forward failed: %s\n", msg);
        exit(1);
    }
}

/* Seconds and FLOPs of one prefill of the whole prompt. */
static void prefill_once(pd_executor *ex, const int32_t *prompt, uint32_t n, const uint32_t *pages,
                         uint32_t n_pages, double *seconds, double *flops) {
    pd_batch_item it = {.req = 1,
                        .tokens = prompt,
                        .n_tokens = n,
                        .start_pos = 0,
                        .pages = pages,
                        .n_pages = n_pages,
                        .mamba_slot = 0,
                        .snapshot_slot = PD_POOL_NONE,
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
        items[b] = (pd_batch_item){.req = b,
                                   .tokens = prompts + (size_t)b * DECODE_PROMPT,
                                   .n_tokens = DECODE_PROMPT,
                                   .start_pos = 0,
                                   .pages = pages + (size_t)b * pages_per,
                                   .n_pages = pages_per,
                                   .mamba_slot = b,
                                   .snapshot_slot = PD_POOL_NONE,
                                   .sample = true};
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

/* Medians of R prefills and R decodes on ex; pages cover both. */
static void measure_runs(pd_executor *ex, const pd_model *m, const opts *o, const uint32_t *pages,
                         uint32_t n_pages, uint32_t pages_per, figures *f) {
    const pd_model_config *c = pd_model_config_get(m);
    int32_t *prompt = malloc(sizeof(int32_t) * o->prompt_len);
    int32_t *prompts = malloc(sizeof(int32_t) * DECODE_PROMPT * o->decode_batch);
    fill_prompt(c, prompt, o->prompt_len, 1);
    for (uint32_t b = 0; b < o->decode_batch; b++)
        fill_prompt(c, prompts + (size_t)b * DECODE_PROMPT, DECODE_PROMPT, 2 + b);
    const size_t runs = (size_t)o->runs;
    double *v = malloc(sizeof(double) * runs * 3), s, fl;
    prefill_once(ex, prompt, o->prompt_len, pages, n_pages, &s, &fl); /* warm-up */
    for (size_t r = 0; r < runs; r++) {
        prefill_once(ex, prompt, o->prompt_len, pages, n_pages, &s, &fl);
        v[r] = o->prompt_len / s;
        v[runs + r] = fl / s / 1e9;
    }
    f->prefill_tps = bench_median(v, runs);
    f->prefill_gflops = bench_median(v + runs, runs);
    const double step_bytes = weight_bytes_per_step(m);
    for (size_t r = 0; r < runs; r++) {
        decode_once(ex, o->decode_batch, o->decode_steps, pages_per, pages, prompts, &s, &fl);
        v[r] = (double)o->decode_batch * o->decode_steps / s;
        v[runs + r] = fl / s / 1e9;
        v[2 * runs + r] = step_bytes * o->decode_steps / s / 1e9;
    }
    f->decode_tps = bench_median(v, runs);
    f->decode_gflops = bench_median(v + runs, runs);
    f->decode_weight_gbs = bench_median(v + 2 * runs, runs);
    free(v);
    free(prompts);
    free(prompt);
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
    figures f;
    measure_runs(&ex, m, o, pages, n_pages, pages_per, &f);
    free(pages);
    pd_model_executor_destroy(&ex);
    return f;
}

/* ---- the kernels alone ----------------------------------------------------------- */

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

typedef struct product {
    float *out, *x, *w;
    uint16_t *w16;
    uint32_t rows, n_in, n_out;
} product;

/* Seconds of one call of kind k (0 textbook, 1 f32, 2 bf16): the calls of
 * 20 ms or at least one, averaged. */
static double product_seconds(const product *p, int k, const pd_par *par) {
    uint64_t t0 = bench_now_ns(), elapsed;
    uint32_t calls = 0;
    do {
        if (k == 0) naive_matmul(p->out, p->x, p->w, p->rows, p->n_in, p->n_out);
        else if (k == 1) mdl_matmul(par, p->out, p->x, p->w, p->rows, p->n_in, p->n_out);
        else mdl_matmul_bf16(par, p->out, p->x, p->w16, p->rows, p->n_in, p->n_out);
        calls++;
        elapsed = bench_now_ns() - t0;
    } while (elapsed < 20000000u);
    return (double)elapsed / 1e9 / calls;
}

static void kernels_line(const pd_model *m, const char *name, const machine *mc, int runs) {
    const pd_model_config *c = pd_model_config_get(m);
    product p = {.rows = 64, .n_in = c->dim, .n_out = c->mlp_hidden};
    const size_t nw = (size_t)p.n_out * p.n_in;
    p.x = malloc(sizeof(float) * p.rows * p.n_in);
    p.out = malloc(sizeof(float) * p.rows * p.n_out);
    p.w = malloc(sizeof(float) * nw);
    p.w16 = malloc(sizeof(uint16_t) * nw);
    for (size_t i = 0; i < (size_t)p.rows * p.n_in; i++) p.x[i] = (float)(i % 13) * 0.1f - 0.6f;
    for (size_t i = 0; i < nw; i++) {
        p.w16[i] = pd_f32_to_bf16((float)(i % 7) * 0.01f - 0.03f);
        p.w[i] = pd_bf16_to_f32(p.w16[i]);
    }
    double *v = malloc(sizeof(double) * (size_t)runs * 3), gf[3];
    const double flops = 2.0 * p.rows * p.n_in * p.n_out;
    const pd_par one = {NULL, 0};
    for (int r = 0; r < runs; r++)
        for (int k = 0; k < 3; k++) v[k * runs + r] = flops / product_seconds(&p, k, &one) / 1e9;
    for (int k = 0; k < 3; k++) gf[k] = bench_median(v + k * runs, (size_t)runs);
    const double peak = mc->peak_gflops[0] / 100.0;
    printf("kernels %-12s %ux%u weights x 64 rows, 1 thread: textbook %.2f GFLOP/s (%.1f%%), "
           "mdl_matmul %.2f (%.1f%%, x%.1f), mdl_matmul_bf16 %.2f (%.1f%%)\n",
           name, p.n_out, p.n_in, gf[0], gf[0] / peak, gf[1], gf[1] / peak, gf[1] / gf[0], gf[2],
           gf[2] / peak);
    free(v);
    free(p.w16);
    free(p.w);
    free(p.out);
    free(p.x);
}

/* The decode shape: one row against a weight matrix of bw_mib MiB (f32; half
 * that in bf16), far larger than L3, so the weights stream from memory
 * as in a decode step of a large model. GB/s of weights read, and % of the
 * memory read measured above. */
static void decode_kernels_line(const machine *mc, const opts *o) {
    product p = {.rows = 1, .n_in = 4096};
    p.n_out = (uint32_t)(((size_t)o->bw_mib << 20) / sizeof(float) / p.n_in);
    const size_t nw = (size_t)p.n_out * p.n_in;
    p.x = malloc(sizeof(float) * p.n_in);
    p.out = malloc(sizeof(float) * p.n_out);
    p.w = malloc(sizeof(float) * nw);
    p.w16 = malloc(sizeof(uint16_t) * nw);
    for (uint32_t i = 0; i < p.n_in; i++) p.x[i] = (float)(i % 13) * 0.1f - 0.6f;
    for (size_t i = 0; i < nw; i++) p.w16[i] = (uint16_t)(0x3c00 + i % 64), p.w[i] = 0.5f;
    printf("kernels decode: 1 row x %ux%u weights (%zu MiB f32, %zu MiB bf16):", p.n_out, p.n_in,
           nw * 4 >> 20, nw * 2 >> 20);
    double *v = malloc(sizeof(double) * (size_t)o->runs);
    for (uint32_t t = 1; t <= o->max_threads; t++) {
        pd_threads *tp;
        if (mdl_threads_create(&tp, t) != PD_OK) exit(1);
        pd_par par = {tp, 0};
        for (int k = 1; k <= 2; k++) {
            const double bytes = (double)nw * (k == 1 ? 4 : 2);
            for (int r = 0; r < o->runs; r++) v[r] = bytes / product_seconds(&p, k, &par) / 1e9;
            double gbs = bench_median(v, (size_t)o->runs);
            printf("  %ut %s %.1f GB/s (%.0f%%)", t, k == 1 ? "f32" : "bf16", gbs,
                   100.0 * gbs / mc->read_gbs[t - 1]);
        }
        mdl_threads_destroy(tp);
    }
    printf("\n");
    free(v);
    free(p.w16);
    free(p.w);
    free(p.out);
    free(p.x);
}

/* ---- the command line ------------------------------------------------------------ */

static bool parse_u32(const char *s, uint32_t *out) {
    char *end;
    unsigned long v = strtoul(s, &end, 10);
    if (*s == '\0' || *end || v == 0 || v > 1000000) return false;
    *out = (uint32_t)v;
    return true;
}

/* Appends the comma-separated names of list as targets; false if too many. */
static bool add_targets(opts *o, const char *list, bool is_dir) {
    char buf[1024];
    snprintf(buf, sizeof(buf), "%s", list);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        if (o->n_targets == TARGETS_MAX || strlen(tok) >= sizeof(o->targets[0].name)) return false;
        target *t = &o->targets[o->n_targets++];
        snprintf(t->name, sizeof(t->name), "%s", tok);
        t->is_dir = is_dir;
    }
    return true;
}

static int usage(const char *arg) {
    fprintf(
        stderr,
        "usage: model [--quick] [--runs R] [--configs tiny,small] [--model-path DIR[,DIR]]\n"
        "             [--max-threads N] [--prompt-len N] [--decode-steps N] [--decode-batch B]\n"
        "             [--bw-mib M]\n"
        "  Prefill and decode tokens/s and GFLOP/s of the model per config and thread count\n"
        "  (medians of R runs), as %% of the machine's FMA peak and memory bandwidth measured\n"
        "  in the same run, and the kernels against a textbook matrix product.\n"
        "  --model-path: a checkpoint directory (repeatable). --quick: prompt 128, 16 steps\n"
        "  of 8 requests, 3 runs, a 128 MiB memory read.\n");
    return strcmp(arg, "--help") ? 2 : 0;
}

/* Fills o from the command line; returns -1 to go on, or the exit status. */
static int parse_args(int argc, char **argv, opts *o) {
    *o = (opts){.runs = 5,
                .max_threads = 2,
                .prompt_len = 512,
                .decode_steps = 64,
                .decode_batch = 16,
                .bw_mib = 1024,
                .peak_iters = PEAK_ITERS};
    bool configs_given = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint32_t n = 0;
        bool ok = true;
        if (!strcmp(a, "--quick")) {
            o->runs = 3, o->prompt_len = 128, o->decode_steps = 16, o->decode_batch = 8;
            o->bw_mib = 128, o->peak_iters = PEAK_ITERS / 10;
            continue;
        }
        if (!v) ok = false;
        else if (!strcmp(a, "--runs")) {
            ok = parse_u32(v, &n);
            o->runs = (int)n;
        } else if (!strcmp(a, "--max-threads"))
            ok = parse_u32(v, &o->max_threads) && o->max_threads <= PD_MODEL_THREADS_MAX;
        else if (!strcmp(a, "--prompt-len")) ok = parse_u32(v, &o->prompt_len);
        else if (!strcmp(a, "--decode-steps")) ok = parse_u32(v, &o->decode_steps);
        else if (!strcmp(a, "--decode-batch"))
            ok = parse_u32(v, &o->decode_batch) && o->decode_batch <= PD_MODEL_BATCH_ITEMS_MAX;
        else if (!strcmp(a, "--bw-mib")) ok = parse_u32(v, &o->bw_mib) && o->bw_mib <= 65536;
        else if (!strcmp(a, "--configs")) {
            ok = add_targets(o, v, false);
            configs_given = true;
        } else if (!strcmp(a, "--model-path")) ok = add_targets(o, v, true);
        else ok = false;
        if (!ok) return usage(a);
        i++;
    }
    if (!configs_given && o->n_targets == 0) add_targets(o, "tiny,small", false);
    return -1;
}

/* ---- main ------------------------------------------------------------------------ */

static pd_model *load_target(const target *t) {
    pd_model_config cfg;
    char msg[300];
    pd_model *m = NULL;
    pd_err err = t->is_dir ? pd_model_load(&m, t->name, msg, sizeof(msg))
                           : pd_model_config_preset(&cfg, t->name, msg, sizeof(msg));
    if (err == PD_OK && !t->is_dir) err = pd_model_create_random(&m, &cfg, 1, msg, sizeof(msg));
    if (err != PD_OK) fprintf(stderr, "model: %s: %s\n", t->name, msg);
    return err == PD_OK ? m : NULL;
}

/* What the tables call t: a directory by its last component. */
static const char *display_name(const target *t) {
    const char *slash = t->is_dir ? strrchr(t->name, '/') : NULL;
    return slash && slash[1] ? slash + 1 : t->name;
}

/* One line per thread count for t, then its kernels line; names in a
 * column `width` wide. */
static bool run_target(const target *t, const opts *o, const machine *mc, int width) {
    pd_model *m = load_target(t);
    if (!m) return false;
    const char *name = display_name(t);
    for (uint32_t th = 1; th <= o->max_threads; th++) {
        figures f = measure(m, th, o);
        const double peak = mc->peak_gflops[th - 1] / 100.0, bw = mc->read_gbs[th - 1] / 100.0;
        printf("%-*s %3u %9.0f %9.2f %6.1f%% %9.0f %9.2f %6.1f%% %9.2f %6.1f%%\n", width, name, th,
               f.prefill_tps, f.prefill_gflops, f.prefill_gflops / peak, f.decode_tps,
               f.decode_gflops, f.decode_gflops / peak, f.decode_weight_gbs,
               f.decode_weight_gbs / bw);
        fflush(stdout);
    }
    kernels_line(m, name, mc, o->runs);
    pd_model_destroy(m);
    return true;
}

int main(int argc, char **argv) {
    opts o;
    int status = parse_args(argc, argv, &o);
    if (status >= 0) return status;
    machine mc;
    measure_machine(&mc, &o);
    decode_kernels_line(&mc, &o);
    int width = 12;
    for (uint32_t i = 0; i < o.n_targets; i++)
        width = PD_MAX(width, (int)strlen(display_name(&o.targets[i])));
    printf("%-*s %3s %9s %9s %7s %9s %9s %7s %9s %7s   (median of %d; prompt %u tokens; "
           "decode %u requests x %u steps)\n",
           width, "model", "thr", "pre tok/s", "GFLOP/s", "%peak", "dec tok/s", "GFLOP/s", "%peak",
           "wts GB/s", "%bw", o.runs, o.prompt_len, o.decode_batch, o.decode_steps);
    fflush(stdout);
    for (uint32_t i = 0; i < o.n_targets; i++)
        if (!run_target(&o.targets[i], &o, &mc, width)) return 2;
    return 0;
}
