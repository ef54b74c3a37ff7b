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

#define RT_STATUSES 13 /* the statuses of docs/http-api.md + "other" */
#define RT_LATENCY_BUCKETS 14

/* Status recorded for a client that went away before its answer. */
#define RT_STATUS_CLIENT_GONE 0u

typedef struct rt_counters {
    uint64_t requests_total;
    uint64_t in_flight;
    uint64_t by_status[RT_STATUSES];
    uint64_t client_disconnects_total;
    uint64_t worker_aborts_sent_total;   /* /abort_request POSTs to workers */
    uint64_t latency_buckets[RT_LATENCY_BUCKETS]; /* cumulative on output only */
    uint64_t latency_count;
    double latency_sum_s;
} rt_counters;

typedef struct rt_stats {
    pthread_mutex_t mu;
    rt_counters c;
} rt_stats;

void rt_stats_init(rt_stats *s);
void rt_stats_destroy(rt_stats *s);
void rt_stats_begin(rt_stats *s);
/* status: the HTTP status the client got (a stream that ended in an error
 * event counts as that error's status, one aborted as 499), or
 * RT_STATUS_CLIENT_GONE. */
void rt_stats_end(rt_stats *s, unsigned status, double latency_s);
void rt_stats_aborts_sent(rt_stats *s, uint64_t n);

/* {"requests": N, "in_flight": N, "responses": {"200": N, ...}, ...}; new reference. */
json_t *rt_stats_json(rt_stats *s);
/* Appends the router-wide metric families in Prometheus text format. */
void rt_stats_prometheus(rt_stats *s, pd_strbuf *sb);

#endif
