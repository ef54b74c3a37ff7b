/*
 * What the loadgen files share: the run's state (client.c, sample.c) and
 * the helpers results.c needs.
 */
#ifndef PDSERVE_LOADGEN_INTERNAL_H
#define PDSERVE_LOADGEN_INTERNAL_H

#include <curl/curl.h>
#include <jansson.h>

#include "pdserve/loadgen.h"
#include "pdserve/progress.h"

typedef struct lg_buf {
    char *p;
    size_t len, cap;
} lg_buf;

/* What a server may send in one answer, or one event stream's unread part
 * (a stream without event ends): beyond it the transfer fails. */
#define LG_BODY_MAX ((size_t)64 << 20)

/* False (and nothing added) when the buffer would pass LG_BODY_MAX. */
bool lg_buf_add(lg_buf *b, const char *p, size_t n);
void lg_buf_free(lg_buf *b);
double lg_now(void);

typedef struct lg_run lg_run;

/* What a transfer of the multi handle is. */
typedef enum lg_kind { LG_REQUEST, LG_ABORT, LG_ABORT_ALL, LG_SAMPLE } lg_kind;

/* A request in flight. */
typedef struct lg_live {
    lg_kind kind; /* LG_REQUEST: first, so a transfer's private pointer tells */
    lg_run *run;
    uint32_t req;
    CURL *h;
    char *send;      /* the body sent */
    lg_buf body;     /* what came back not yet consumed */
    size_t searched; /* of body, bytes known to hold no event end */
    double t_send, t_last, abort_at;
    bool abort_sent, done_marker, error_event, too_big;
    uint32_t tokens, seen_tokens, usage_tokens, prompt_tokens, cached;
    uint32_t cap_itl;
    int abort_status;
    char finish[16];
    char message[160];
} lg_live;

/* A side transfer: an abort, an abort-all, a node's /server_info. */
typedef struct lg_side {
    lg_kind kind;
    lg_run *run;
    CURL *h;
    char *send;
    lg_buf body;
    int node; /* LG_SAMPLE */
} lg_side;

struct lg_run {
    const pd_lg_run_config *c;
    const pd_lg_dataset *d;
    pd_lg_results *out;
    CURLM *m;
    struct curl_slist *hdrs;
    json_t *extra; /* --extra-request-body, parsed once; NULL: none */
    char url[600], abort_url[600], tag[24];
    double t0; /* the measured run's start (monotonic seconds) */
    lg_live **live;
    uint32_t n_live, cap_live;
    int32_t *succ;   /* a conversation's next turn, -1: none */
    uint32_t *ready; /* later turns whose previous turn has ended */
    double *ready_at;
    uint32_t n_ready;
    uint32_t next;        /* next independent request to send */
    uint32_t first, last; /* the phase's dataset range [first, last) */
    bool stop_sending;
    double next_abort_all, next_sample;
    bool sampling[PD_LG_NODES_MAX];
    uint32_t ended, errors, n_sides;
    uint32_t tl_filled;      /* timeline intervals whose concurrency is recorded */
    double recent_ttft[256]; /* the last TTFTs, for the progress line */
    uint32_t n_recent;
    pd_progress progress;
};

void lg_timeline_tokens(lg_run *run, double now, uint32_t n);
void lg_timeline_advance(lg_run *run, double now);

/* sample.c: the nodes */
pd_err lg_nodes_resolve(lg_run *run, char *err, size_t cap);
void lg_sample_start(lg_run *run, double now);
void lg_sample_done(lg_run *run, lg_side *s, CURLcode rc, double now);
void lg_idle_check(lg_run *run);
/* Content-Type, no Expect, and the API key's Authorization. */
struct curl_slist *lg_headers(const pd_lg_run_config *c);
/* An easy handle with these headers; the answer goes to sink (bounded). */
CURL *lg_easy_with(struct curl_slist *hdrs, const char *url, lg_buf *sink);
CURL *lg_easy(lg_run *run, const char *url, lg_buf *sink);
/* GET url, blocking: the answer parsed, or NULL with err saying why. */
json_t *lg_get_json(struct curl_slist *hdrs, const char *url, double timeout_s, char *err,
                    size_t cap);
void lg_side_sample(lg_run *run, const char *url, int node);

#endif
