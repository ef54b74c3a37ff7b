/*
 * The report's insides (include/pdserve/report.h is its public face).
 *
 * Two steps. extract.c reads the results JSON into the model below, checking
 * every field it uses (a wrong type is an error naming the field; nothing
 * after it touches JSON types). svg.c and report.c then write the page from
 * the model alone, streaming it into a FILE: no step can fail half-way for
 * a reason of the input's.
 */
#ifndef PDSERVE_REPORT_INT_H
#define PDSERVE_REPORT_INT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include <jansson.h>

#include "pdserve/report.h"

#define RPT_POOLS_MAX 16   /* pools drawn per node; more are listed, not drawn */
#define RPT_CDF_POINTS 500 /* points per CDF curve at most */
#define RPT_FAILURES_SHOWN 50

/* A run of doubles owned by the model. */
typedef struct rpt_vec {
    double *v;
    size_t n;
} rpt_vec;

/* The summary's numbers, NAN where the JSON has null or nothing. */
enum rpt_stat { RPT_MEAN, RPT_MEDIAN, RPT_P90, RPT_P99, RPT_MAX, RPT_STATS };
enum rpt_metric { RPT_TTFT, RPT_TPOT, RPT_ITL, RPT_E2E, RPT_METRICS };

typedef struct rpt_pool_series {
    const char *name, *kind;                         /* borrowed from the JSON */
    double *total, *free, *req, *cache, *quarantine; /* per sample; NAN: absent */
} rpt_pool_series;

typedef struct rpt_node {
    const char *url, *role;
    size_t samples;
    double *t_s;
    size_t pools, pools_dropped;
    rpt_pool_series pool[RPT_POOLS_MAX];
    int idle; /* 1 passed, 0 failed, -1 not checked */
    double idle_waited_s;
    const char *idle_problem;
    char held[256]; /* "kv (req 12), mamba (quarantine 1)": pools still held */
} rpt_node;

enum rpt_abort_kind { RPT_ABORT_REQUEST, RPT_ABORT_CLOSE, RPT_ABORT_ALL, RPT_ABORT_KINDS };

typedef struct rpt_model {
    /* what was run */
    const char *backend, *dataset, *url, *endpoint, *version;
    double request_rate, burstiness, max_concurrency, seed, duration, num_prompts;
    /* counts and throughputs */
    double completed, aborted, failed, refused;
    double total_input_tokens, total_output_tokens, cache_hit_tokens;
    double request_throughput, input_throughput, output_throughput, total_throughput;
    double goodput, good_requests, concurrency;
    bool has_slo;
    double slo_ms[RPT_METRICS]; /* the --slo limits, NAN where none */
    double stat[RPT_METRICS][RPT_STATS];
    int idle_check_passed; /* 1, 0, -1 (null: no --check-node) */
    /* curves: sorted, in ms */
    rpt_vec ttft_ms, itl_ms, e2e_ms;
    /* the requests that failed or were refused (first RPT_FAILURES_SHOWN) */
    const json_t *failures[RPT_FAILURES_SHOWN];
    size_t failures_n, failures_total;
    /* timeline */
    double interval_s;
    size_t tl_n;
    double *tl_t, *tl_rps, *tl_tps, *tl_conc;
    size_t aborts_n;
    double *abort_t;
    unsigned char *abort_kind;
    size_t abort_count[RPT_ABORT_KINDS];
    /* nodes */
    size_t nodes_n;
    rpt_node *nodes;
} rpt_model;

/* Reads `results` into m (zeroed first). PD_ERR_PARSE with err naming the
 * field on bad input, PD_ERR_NOMEM; m is freed on error. */
pd_err rpt_extract(const json_t *results, rpt_model *m, char *err, size_t errlen);
void rpt_model_free(rpt_model *m);

/* ---- output ---- */

void rpt_put(FILE *f, const char *s);
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
void rpt_putf(FILE *f, const char *fmt, ...);
/* s escaped for XML text and attributes, control characters replaced, at
 * most max_bytes of it (cut on a character boundary, "…" added). */
void rpt_put_esc(FILE *f, const char *s, size_t max_bytes);

/* ---- charts (svg.c) ---- */

void rpt_svg_cdf(FILE *f, const char *id, const char *title, const char *what, const rpt_vec *ms);
void rpt_svg_timeline(FILE *f, const rpt_model *m);
void rpt_svg_pool(FILE *f, const rpt_node *n, size_t node_index, size_t pool_index);

#endif
