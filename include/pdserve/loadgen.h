/*
 * loadgen.h — `pdserve bench`'s engine: the request sequence a benchmark
 * sends (a dataset, reproducible from a seed), the client that sends it to
 * a server over HTTP and times every token, the pdserve nodes it watches
 * (their pool units by ledger state, and the idle check at the end), and
 * the results. docs/bench-serving.md describes the command and its output.
 *
 * Three steps, each its own file in src/loadgen/:
 *   dataset.c  pd_lg_dataset_build: what to send and when (no I/O but the
 *              ShareGPT or trace file it reads);
 *   client.c   pd_lg_run: sends it (libcurl's multi interface, one thread),
 *              aborts what the dataset says to abort, samples the nodes;
 *   results.c  pd_lg_results_json: statistics, SGLang bench_serving's field
 *              names where they exist, pdserve's own under "pdserve".
 */
#ifndef PDSERVE_LOADGEN_H
#define PDSERVE_LOADGEN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "pdserve/base.h"

/* ---- the dataset ----------------------------------------------------------------------- */

typedef enum pd_lg_kind {
    PD_LG_RANDOM,        /* lengths drawn from [len * ratio, len] */
    PD_LG_SHARED_PREFIX, /* groups of questions behind one shared system prompt each */
    PD_LG_MULTI_TURN,    /* conversations: each turn extends the last */
    PD_LG_SHAREGPT,      /* a ShareGPT-format JSON file */
    PD_LG_TRACE,         /* one JSON object per line, with timestamps */
    PD_LG__KINDS
} pd_lg_kind;

typedef enum pd_lg_abort {
    PD_LG_ABORT_NONE,
    PD_LG_ABORT_REQUEST, /* POST /abort_request with the request's rid */
    PD_LG_ABORT_CLOSE,   /* close the connection */
} pd_lg_abort;

/* Which part of a conversation a segment of a prompt is (chat requests send
 * the segments as messages; the other APIs send them concatenated). */
typedef enum pd_lg_role { PD_LG_SYSTEM, PD_LG_USER, PD_LG_ASSISTANT } pd_lg_role;

typedef struct pd_lg_segment {
    pd_lg_role role;
    uint32_t off, len; /* into the request's ids or text */
} pd_lg_segment;

#define PD_LG_SEGMENTS_MAX 64

typedef struct pd_lg_request {
    uint32_t index;
    bool warmup;        /* sent before the measured run, not counted */
    int32_t *ids;       /* the prompt as token ids, or NULL ... */
    char *text;         /* ... as text (NUL-terminated) */
    uint32_t n_ids;     /* ids in the prompt; for text, its length in bytes */
    uint32_t input_len; /* prompt tokens (ids), or the estimate for text */
    uint32_t output_len;
    pd_lg_segment seg[PD_LG_SEGMENTS_MAX];
    uint32_t n_seg;
    /* When to send it: independent requests (and a conversation's first
     * turn) at arrival_s after the run's start; a later turn arrival_s after
     * its previous turn (prev) has ended. */
    double arrival_s;
    int32_t prev;
    pd_lg_abort abort;
    double abort_after_s; /* after it was sent */
} pd_lg_request;

typedef struct pd_lg_dataset_config {
    pd_lg_kind kind;
    const char *path; /* sharegpt, trace */
    uint64_t seed;
    uint32_t num_prompts, warmup;
    uint32_t input_len, output_len; /* random; multi-turn: per turn */
    double range_ratio;             /* lengths uniform in [len * ratio, len] */
    uint32_t vocab, token_min;      /* ids drawn from [token_min, vocab) */
    bool text;                      /* prompts as text (words), not ids */
    uint32_t gsp_groups, gsp_system_len, gsp_question_len;
    uint32_t turns;               /* multi-turn: turns per conversation */
    uint32_t sharegpt_output_len; /* 0: from the dataset's answer */
    uint32_t trace_block_tokens;  /* tokens per hash id of a trace line */
    double request_rate;          /* requests/s; 0 = all at once */
    double burstiness;            /* gamma shape: 1 = Poisson, < 1 burstier */
    double abort_fraction;
    pd_lg_abort abort_mode; /* NONE = half each way */
    double abort_min_s, abort_max_s;
} pd_lg_dataset_config;

typedef struct pd_lg_dataset {
    pd_lg_kind kind;
    pd_lg_request *reqs;
    uint32_t n;
} pd_lg_dataset;

void pd_lg_dataset_config_default(pd_lg_dataset_config *c);
const char *pd_lg_kind_name(pd_lg_kind k);
bool pd_lg_kind_parse(const char *s, pd_lg_kind *out);
const char *pd_lg_abort_name(pd_lg_abort a);

/* Builds the request sequence: the same config (seed included) and file
 * give the same sequence on every machine. Errors name the problem (an
 * unreadable or malformed file: its path and line). */
pd_err pd_lg_dataset_build(const pd_lg_dataset_config *c, pd_lg_dataset *out, char *err,
                           size_t cap);
void pd_lg_dataset_free(pd_lg_dataset *d);
/* One JSON object per request and line: byte-identical for the same
 * sequence. Returns false when the stream failed. */
bool pd_lg_dataset_dump(const pd_lg_dataset *d, FILE *to);

/* ---- the run --------------------------------------------------------------------------- */

typedef enum pd_lg_api {
    PD_LG_API_GENERATE,    /* POST /generate (pdserve, SGLang) */
    PD_LG_API_COMPLETIONS, /* POST /v1/completions */
    PD_LG_API_CHAT,        /* POST /v1/chat/completions */
} pd_lg_api;

#define PD_LG_NODES_MAX 16

typedef struct pd_lg_run_config {
    const char *base_url; /* http://host:port, no trailing slash */
    const char *endpoint; /* NULL: the API's */
    pd_lg_api api;
    const char *model;      /* OpenAI "model"; NULL: omitted */
    const char *api_key;    /* Authorization: Bearer; NULL: none */
    const char *extra_body; /* a JSON object merged into every body; NULL: none */
    bool stream;
    bool ignore_eos;
    uint32_t max_concurrency; /* 0: unbounded */
    double duration_s;        /* stop sending after this; 0: send everything */
    double request_timeout_s;
    double abort_all_every_s; /* 0: never */
    double timeline_interval_s;
    const char *nodes[PD_LG_NODES_MAX]; /* --check-node URLs */
    uint32_t n_nodes;
    double sample_interval_s;
    double idle_timeout_s;
    FILE *progress_to;       /* the progress line (pdserve/progress.h); NULL: none */
    size_t progress_columns; /* a terminal's width, the line cut to it; 0: not cut */
    uint64_t seed;           /* names the rids */
} pd_lg_run_config;

void pd_lg_run_config_default(pd_lg_run_config *c);
/* The server's vocabulary size from GET /get_model_info (pdserve's nodes and
 * router say vocab_size); 0 when it does not say or does not answer. */
uint32_t pd_lg_server_vocab(const pd_lg_run_config *c);
const char *pd_lg_api_endpoint(pd_lg_api api);

typedef enum pd_lg_outcome {
    PD_LG_NOT_SENT, /* --duration ran out first */
    PD_LG_COMPLETED,
    PD_LG_ABORTED,
    PD_LG_FAILED,
    PD_LG_REFUSED, /* the server said no (4xx, 429, 503) before any token */
} pd_lg_outcome;
const char *pd_lg_outcome_name(pd_lg_outcome o);

typedef struct pd_lg_result {
    pd_lg_outcome outcome;
    int status;                    /* HTTP status, 0 when none came */
    double start_s, end_s, ttft_s; /* relative to the run's start; ttft < 0: none */
    uint32_t prompt_tokens;        /* the server's count when it said, else the dataset's */
    uint32_t output_tokens, cached_tokens;
    double *itl; /* seconds between token-carrying events after the first */
    uint32_t n_itl;
    double abort_at_s; /* < 0: the bench did not abort it */
    char error[192];
} pd_lg_result;

typedef struct pd_lg_pool_sample {
    char name[24];
    uint64_t total, free, req, quarantine;
    uint64_t cache_evictable, cache_protected;
} pd_lg_pool_sample;

#define PD_LG_POOLS_MAX 8

typedef struct pd_lg_node_sample {
    double t_s;
    pd_lg_pool_sample pools[PD_LG_POOLS_MAX];
    uint32_t n_pools;
} pd_lg_node_sample;

typedef struct pd_lg_node {
    char url[256];
    char role[16];
    pd_lg_node_sample *samples;
    uint32_t n_samples, cap_samples;
    /* counters.cached_tokens and prefill_tokens of /server_info before the
     * run and at the idle check: what the node's prefix cache saved */
    uint64_t cached0, cached1, prefill0, prefill1;
    bool has_counters;
    bool checked, passed; /* the idle check ran; its verdict */
    double waited_s;
    pd_lg_node_sample last; /* the idle check's last look at the pools */
    bool has_last;          /* that look read them */
    char problem[512];      /* why it failed, naming the pools */
} pd_lg_node;

typedef struct pd_lg_abort_event {
    double t_s;
    pd_lg_abort kind; /* NONE here means an abort-all burst */
    int32_t req;      /* -1 for abort-all */
} pd_lg_abort_event;

typedef struct pd_lg_results {
    pd_lg_result *r; /* one per dataset request, warm-ups included */
    uint32_t n;
    double duration_s; /* first measured send to last end */
    /* per timeline interval (end of interval k = (k + 1) * interval) */
    uint32_t *done, *tokens, *inflight;
    uint32_t n_intervals, cap_intervals;
    pd_lg_abort_event *aborts;
    uint32_t n_aborts, cap_aborts;
    pd_lg_node nodes[PD_LG_NODES_MAX];
    uint32_t n_nodes;
} pd_lg_results;

/* Sends the dataset as the config says, then runs the idle check of every
 * node. PD_OK when the run happened (whatever the requests' outcomes and
 * the check's verdict, which are in out); an error (naming it) when it
 * could not: the server unreachable before the first request, a node that
 * is not a pdserve node. */
pd_err pd_lg_run(const pd_lg_run_config *c, const pd_lg_dataset *d, pd_lg_results *out, char *err,
                 size_t cap);
void pd_lg_results_free(pd_lg_results *r);

/* ---- the results ----------------------------------------------------------------------- */

typedef struct pd_lg_slo {
    double ttft_ms, tpot_ms, itl_ms, e2e_ms; /* 0: not given */
} pd_lg_slo;

/* Parses "ttft=200ms,tpot=50ms" (units ms or s; keys ttft, tpot, itl, e2e). */
bool pd_lg_slo_parse(const char *s, pd_lg_slo *out, char *err, size_t cap);

/* The results as a JSON object (jansson's json_t *, returned as void * so
 * this header needs no jansson): see docs/bench-serving.md. */
void *pd_lg_results_json(const pd_lg_run_config *c, const pd_lg_dataset_config *dc,
                         const pd_lg_dataset *d, const pd_lg_results *r, const pd_lg_slo *slo);

#endif
