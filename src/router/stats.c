/*
 * Router-wide counters; see stats.h.
 */
#include "stats.h"

#include <stdio.h>
#include <string.h>

static const unsigned status_codes[RT_STATUSES - 1] = {200, 400, 404, 405, 409, 413,
                                                       429, 499, 500, 502, 503, 504};
static const double latency_le_s[RT_LATENCY_BUCKETS - 1] = {
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};

static size_t status_slot(unsigned status) {
    for (size_t i = 0; i < RT_STATUSES - 1; i++)
        if (status_codes[i] == status) return i;
    return RT_STATUSES - 1;
}

void rt_stats_init(rt_stats *s) {
    memset(s, 0, sizeof *s);
    pthread_mutex_init(&s->mu, NULL);
}

void rt_stats_destroy(rt_stats *s) { pthread_mutex_destroy(&s->mu); }

void rt_stats_begin(rt_stats *s) {
    pthread_mutex_lock(&s->mu);
    s->c.requests_total++;
    s->c.in_flight++;
    pthread_mutex_unlock(&s->mu);
}

void rt_stats_end(rt_stats *s, unsigned status, double latency_s) {
    size_t b = 0;
    while (b < RT_LATENCY_BUCKETS - 1 && latency_s > latency_le_s[b]) b++;
    pthread_mutex_lock(&s->mu);
    PD_ASSERT(s->c.in_flight > 0);
    s->c.in_flight--;
    if (status == RT_STATUS_CLIENT_GONE) {
        s->c.client_disconnects_total++;
    } else {
        s->c.by_status[status_slot(status)]++;
        s->c.latency_buckets[b]++;
        s->c.latency_count++;
        s->c.latency_sum_s += latency_s;
    }
    pthread_mutex_unlock(&s->mu);
}

void rt_stats_aborts_sent(rt_stats *s, uint64_t n) {
    pthread_mutex_lock(&s->mu);
    s->c.worker_aborts_sent_total += n;
    pthread_mutex_unlock(&s->mu);
}

json_t *rt_stats_json(rt_stats *s) {
    pthread_mutex_lock(&s->mu);
    rt_counters c = s->c;
    pthread_mutex_unlock(&s->mu);
    json_t *by = json_object();
    uint64_t errors = 0;
    for (size_t i = 0; i < RT_STATUSES; i++) {
        if (!c.by_status[i]) continue;
        char key[16];
        if (i < RT_STATUSES - 1) snprintf(key, sizeof key, "%u", status_codes[i]);
        else snprintf(key, sizeof key, "other");
        json_object_set_new(by, key, json_integer((json_int_t)c.by_status[i]));
        if (i == RT_STATUSES - 1 || status_codes[i] >= 400) errors += c.by_status[i];
    }
    return json_pack("{s:I, s:I, s:o, s:I, s:I, s:I, s:f}", "requests",
                     (json_int_t)c.requests_total, "in_flight", (json_int_t)c.in_flight,
                     "responses", by, "errors", (json_int_t)errors, "client_disconnects",
                     (json_int_t)c.client_disconnects_total, "worker_aborts_sent",
                     (json_int_t)c.worker_aborts_sent_total, "latency_mean_s",
                     c.latency_count ? c.latency_sum_s / (double)c.latency_count : 0.0);
}

void rt_stats_prometheus(rt_stats *s, pd_strbuf *sb) {
    pthread_mutex_lock(&s->mu);
    rt_counters c = s->c;
    pthread_mutex_unlock(&s->mu);
    pd_strbuf_printf(
        sb,
        "# HELP pdserve_router_requests_total Generation requests the router received.\n"
        "# TYPE pdserve_router_requests_total counter\n"
        "pdserve_router_requests_total %llu\n",
        (unsigned long long)c.requests_total);
    pd_strbuf_printf(sb,
                     "# HELP pdserve_router_requests_running Generation requests in flight.\n"
                     "# TYPE pdserve_router_requests_running gauge\n"
                     "pdserve_router_requests_running %llu\n",
                     (unsigned long long)c.in_flight);
    pd_strbuf_append(sb,
                     "# HELP pdserve_router_responses_total Generation answers by HTTP status.\n"
                     "# TYPE pdserve_router_responses_total counter\n");
    for (size_t i = 0; i < RT_STATUSES; i++) {
        if (i < RT_STATUSES - 1)
            pd_strbuf_printf(sb, "pdserve_router_responses_total{code=\"%u\"} %llu\n",
                             status_codes[i], (unsigned long long)c.by_status[i]);
        else
            pd_strbuf_printf(sb, "pdserve_router_responses_total{code=\"other\"} %llu\n",
                             (unsigned long long)c.by_status[i]);
    }
    pd_strbuf_printf(
        sb,
        "# HELP pdserve_router_client_disconnects_total Clients that hung up before their answer.\n"
        "# TYPE pdserve_router_client_disconnects_total counter\n"
        "pdserve_router_client_disconnects_total %llu\n",
        (unsigned long long)c.client_disconnects_total);
    pd_strbuf_printf(
        sb,
        "# HELP pdserve_router_worker_aborts_sent_total /abort_request calls sent to workers.\n"
        "# TYPE pdserve_router_worker_aborts_sent_total counter\n"
        "pdserve_router_worker_aborts_sent_total %llu\n",
        (unsigned long long)c.worker_aborts_sent_total);
    pd_strbuf_append(sb,
                     "# HELP pdserve_router_request_latency_seconds Time from a generation request "
                     "to its answer being decided.\n"
                     "# TYPE pdserve_router_request_latency_seconds histogram\n");
    uint64_t cum = 0;
    for (size_t b = 0; b < RT_LATENCY_BUCKETS; b++) {
        cum += c.latency_buckets[b];
        if (b < RT_LATENCY_BUCKETS - 1)
            pd_strbuf_printf(sb, "pdserve_router_request_latency_seconds_bucket{le=\"%g\"} %llu\n",
                             latency_le_s[b], (unsigned long long)cum);
        else
            pd_strbuf_printf(sb,
                             "pdserve_router_request_latency_seconds_bucket{le=\"+Inf\"} %llu\n",
                             (unsigned long long)cum);
    }
    pd_strbuf_printf(sb, "pdserve_router_request_latency_seconds_sum %.6f\n", c.latency_sum_s);
    pd_strbuf_printf(sb, "pdserve_router_request_latency_seconds_count %llu\n",
                     (unsigned long long)c.latency_count);
}
