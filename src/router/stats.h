/*
 * Router-wide counters for /server_info and /metrics: generation requests
 * (POST /generate and /v1/completions) by final status, client hang-ups,
 * aborts sent to workers, requests in flight, and an end-to-end latency
 * histogram with fixed Prometheus-style buckets.
 *
 * One mutex; a request touches it twice (begin, end), a scrape once. The
 * per-worker counters live in the worker table, next to the health state
 * they are reported with.
 */
#ifndef PDSERVE_ROUTER_STATS_H
#define PDSERVE_ROUTER_STATS_H

#include <jansson.h>
#include <pthread.h>
#include <stdint.h>

#include "pdserve/base.h"

#define PD_ROUTER_STATUSES 13  /* the statuses of docs/http-api.md + "other" */
#define PD_ROUTER_LATENCY_BUCKETS 14

/* Status recorded for a client that went away before its answer. */
#define PD_ROUTER_STATUS_CLIENT_GONE 0u

typedef struct pd_router_counters {
    uint64_t requests_total;
    uint64_t in_flight;
    uint64_t by_status[PD_ROUTER_STATUSES];
    uint64_t client_disconnects_total;
    uint64_t worker_aborts_sent_total;   /* /abort_request POSTs to workers */
    uint64_t latency_buckets[PD_ROUTER_LATENCY_BUCKETS]; /* cumulative on output only */
    uint64_t latency_count;
    double latency_sum_s;
} pd_router_counters;

typedef struct pd_router_stats {
    pthread_mutex_t mu;
    pd_router_counters c;
} pd_router_stats;

void pd_router_stats_init(pd_router_stats *s);
void pd_router_stats_destroy(pd_router_stats *s);
void pd_router_stats_begin(pd_router_stats *s);
/* status: the HTTP status the client got (a stream that ended in an error
 * event counts as that error's status, one aborted as 499), or
 * PD_ROUTER_STATUS_CLIENT_GONE. */
void pd_router_stats_end(pd_router_stats *s, unsigned status, double latency_s);
void pd_router_stats_aborts_sent(pd_router_stats *s, uint64_t n);

/* {"requests": N, "in_flight": N, "responses": {"200": N, ...}, ...}; new reference. */
json_t *pd_router_stats_json(pd_router_stats *s);
/* Appends the router-wide metric families in Prometheus text format. */
void pd_router_stats_prometheus(pd_router_stats *s, pd_strbuf *sb);

#endif
