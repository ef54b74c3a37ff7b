/*
 * bench/gen_trace — writes request traces for bench/radix: one request per
 * line, space-separated token ids.
 *
 *   gen_trace [--kind shared|multiturn|mixed] [--requests N] [--seed S]
 *             [--system-prompts K] [--system-len L] [--suffix-len S]
 *             [--conversations C] [--turn-len T] [--vocab V] [--out FILE]
 *
 * shared     K long system prompts, picked with a skew (the first is the most
 *            popular, as in production), each followed by a unique user suffix
 *            of S/2..3S/2 tokens. Reuse: the system prompt.
 * multiturn  C conversations advancing in random order; each turn's request is
 *            the previous request plus the model's answer and a new user
 *            message (T/2..3T/2 tokens). Reuse: the whole previous turn.
 * mixed      both, interleaved half and half.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pdserve/base.h"

typedef struct conv {
    int32_t *tokens;
    uint32_t len, cap;
} conv;

static void usage(FILE *to) {
    fprintf(to,
            "usage: gen_trace [--kind shared|multiturn|mixed] [--requests N] [--seed S]\n"
            "                 [--system-prompts K] [--system-len L] [--suffix-len S]\n"
            "                 [--conversations C] [--turn-len T] [--max-len M] [--vocab V]\n"
            "                 [--out FILE]\n"
            "Writes one request per line (space-separated token ids) to FILE or stdout.\n");
}

static void emit(FILE *out, const int32_t *t, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) fprintf(out, i ? " %d" : "%d", t[i]);
    fputc('\n', out);
}

static uint32_t around(pd_rng *rng, uint32_t mean) {
    if (mean < 2) return 1;
    return (uint32_t)pd_rng_range(rng, mean / 2, mean + mean / 2);
}

typedef struct trace_opts {
    const char *kind, *out_path;
    uint32_t requests, n_sys, sys_len, suffix_len;
    uint32_t n_conv, turn_len, vocab, max_len;
    uint64_t seed;
} trace_opts;

/* Fills o from the command line; returns -1 to go on, or the exit status. */
static int parse_args(int argc, char **argv, trace_opts *o) {
    *o = (trace_opts){.kind = "mixed", .requests = 2000, .n_sys = 4, .sys_len = 1024,
                      .suffix_len = 128, .n_conv = 32, .turn_len = 96, .vocab = 32000,
                      .max_len = 8192, .seed = 1};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help")) { usage(stdout); return 0; }
        if (!v) { usage(stderr); return 2; }
        i++;
        if (!strcmp(a, "--kind")) o->kind = v;
        else if (!strcmp(a, "--requests")) o->requests = (uint32_t)strtoul(v, NULL, 0);
        else if (!strcmp(a, "--seed")) o->seed = strtoull(v, NULL, 0);
        else if (!strcmp(a, "--system-prompts")) o->n_sys = (uint32_t)strtoul(v, NULL, 0);
        else if (!strcmp(a, "--system-len")) o->sys_len = (uint32_t)strtoul(v, NULL, 0);
        else if (!strcmp(a, "--suffix-len")) o->suffix_len = (uint32_t)strtoul(v, NULL, 0);
        else if (!strcmp(a, "--conversations")) o->n_conv = (uint32_t)strtoul(v, NULL, 0);
        else if (!strcmp(a, "--turn-len")) o->turn_len = (uint32_t)strtoul(v, NULL, 0);
        else if (!strcmp(a, "--max-len")) o->max_len = (uint32_t)strtoul(v, NULL, 0);
        else if (!strcmp(a, "--vocab")) o->vocab = (uint32_t)strtoul(v, NULL, 0);
        else if (!strcmp(a, "--out")) o->out_path = v;
        else { fprintf(stderr, "gen_trace: unknown option %s\n", a); usage(stderr); return 2; }
    }
    return -1;
}

/* Skewed pick among n system prompts: prompt k with weight 1/(k+1). */
static uint32_t pick_system_prompt(pd_rng *rng, uint32_t n) {
    double total = 0, x;
    for (uint32_t k = 0; k < n; k++) total += 1.0 / (k + 1);
    x = pd_rng_unit(rng) * total;
    uint32_t k = 0;
    while (k + 1 < n && (x -= 1.0 / (k + 1)) > 0) k++;
    return k;
}

/* The next turn of conversation c: the previous answer and a new user
 * message (or a fresh opening), appended to what it already holds. */
static void next_turn(FILE *out, pd_rng *rng, conv *c, const trace_opts *o) {
    uint32_t add = around(rng, o->turn_len) + (c->len ? around(rng, o->turn_len) : 0);
    if (c->len + add > o->max_len) c->len = 0; /* the conversation starts over */
    if (c->len + add > c->cap) {
        c->cap = (c->len + add) * 2;
        c->tokens = realloc(c->tokens, c->cap * sizeof(int32_t));
    }
    for (uint32_t i = 0; i < add; i++) c->tokens[c->len + i] = (int32_t)pd_rng_below(rng, o->vocab);
    c->len += add;
    emit(out, c->tokens, c->len);
}

static void write_trace(FILE *out, const trace_opts *o, bool shared, bool mixed) {
    pd_rng rng;
    pd_rng_seed(&rng, o->seed);
    int32_t **sys = calloc(o->n_sys, sizeof(int32_t *));
    uint32_t *sys_n = calloc(o->n_sys, sizeof(uint32_t));
    for (uint32_t k = 0; k < o->n_sys; k++) {
        sys_n[k] = around(&rng, o->sys_len);
        sys[k] = malloc(sys_n[k] * sizeof(int32_t));
        for (uint32_t i = 0; i < sys_n[k]; i++) sys[k][i] = (int32_t)pd_rng_below(&rng, o->vocab);
    }
    conv *convs = calloc(o->n_conv, sizeof(conv));
    int32_t *buf = malloc((o->sys_len * 2 + o->suffix_len * 2 + 8) * sizeof(int32_t));

    for (uint32_t r = 0; r < o->requests; r++) {
        bool do_shared = shared || (mixed && pd_rng_chance(&rng, 1, 2));
        if (do_shared) {
            uint32_t k = pick_system_prompt(&rng, o->n_sys);
            uint32_t s = around(&rng, o->suffix_len);
            memcpy(buf, sys[k], sys_n[k] * sizeof(int32_t));
            for (uint32_t i = 0; i < s; i++)
                buf[sys_n[k] + i] = (int32_t)pd_rng_below(&rng, o->vocab);
            emit(out, buf, sys_n[k] + s);
        } else {
            next_turn(out, &rng, &convs[pd_rng_below(&rng, o->n_conv)], o);
        }
    }
    for (uint32_t k = 0; k < o->n_sys; k++) free(sys[k]);
    for (uint32_t k = 0; k < o->n_conv; k++) free(convs[k].tokens);
    free(sys);
    free(sys_n);
    free(convs);
    free(buf);
}

int main(int argc, char **argv) {
    trace_opts o;
    int status = parse_args(argc, argv, &o);
    if (status >= 0) return status;
    bool shared = !strcmp(o.kind, "shared"), multi = !strcmp(o.kind, "multiturn"),
         mixed = !strcmp(o.kind, "mixed");
    if (!shared && !multi && !mixed) {
        fprintf(stderr, "gen_trace: --kind must be shared, multiturn or mixed (got %s)\n", o.kind);
        return 2;
    }
    if (o.n_sys == 0 || o.n_conv == 0 || o.vocab < 2 || o.sys_len == 0 || o.max_len < 2) {
        fprintf(stderr, "gen_trace: counts and lengths must be positive\n");
        return 2;
    }
    FILE *out = o.out_path ? fopen(o.out_path, "w") : stdout;
    if (!out) { perror(o.out_path); return 1; }
    write_trace(out, &o, shared, mixed);
    if (o.out_path) fclose(out);
    return 0;
}
