/*
 * The health checker: one background thread that probes GET /health of
 * every worker, all at once, every interval, and reports each outcome to the
 * worker table (which applies the 2-failures-out, 1-success-in rule).
 *
 * A probe succeeds on HTTP 200 within the probe timeout; anything else —
 * refused, reset, 503, silence — is a failure. A round lasts at most the
 * probe timeout, and the next one starts an interval after the previous
 * one started (or at once when the round took longer), so a hung worker
 * slows nothing down but its own verdict. Stopping wakes the thread out of
 * a round or a wait immediately.
 */
#ifndef PDSERVE_ROUTER_HEALTH_H
#define PDSERVE_ROUTER_HEALTH_H

#include <curl/curl.h>
#include <pthread.h>
#include <stdbool.h>

#include "workers.h"

typedef struct rt_health {
    rt_workers *workers;
    uint32_t interval_ms;
    uint32_t timeout_ms;
    uint32_t connect_timeout_ms;
    CURLM *multi;             /* the thread's; kept here so stop can wake it */
    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    pthread_cond_t cv;        /* CLOCK_MONOTONIC */
    bool stop;
} rt_health;

pd_err rt_health_start(rt_health *h, rt_workers *workers, uint32_t interval_ms, uint32_t timeout_ms,
                       uint32_t connect_timeout_ms, char *msg, size_t msg_cap);
/* Joins the thread. Idempotent; safe on a never-started checker. */
void rt_health_stop(rt_health *h);

#endif
