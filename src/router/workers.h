/*
 * The worker table: every prefill and decode node the router knows, its
 * health as seen by the checker, and the load this router put on it.
 *
 * A fixed array sized at start-up (PD_ROUTER_WORKERS_MAX per role), prefill
 * nodes first, guarded by one mutex. Everything that reads or changes the
 * mutable fields — picking a pair, releasing it, reporting a probe,
 * snapshotting for /server_info and /metrics — takes the lock for a few
 * dozen instructions and never does I/O under it.
 *
 * Health is a small hysteresis: a worker starts healthy (so a fresh router
 * serves at once), becomes unhealthy after `unhealthy_after` consecutive
 * failed probes (default 2: one lost probe is noise, two is a pattern) and
 * healthy again after one good probe (a worker that answers is worth
 * trying; the next probe takes it out again if it was a fluke). Only the
 * checker changes health; a failed request does not, so one slow request
 * cannot take a worker out and the rule stays easy to reason about.
 */
#ifndef PDSERVE_ROUTER_WORKERS_H
#define PDSERVE_ROUTER_WORKERS_H

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "pdserve/router.h"

typedef enum rt_role { RT_PREFILL = 0, RT_DECODE = 1 } rt_role;

typedef struct rt_worker {
    rt_role role;
    pd_router_url url;            /* prefill: bootstrap_port resolved (never 0) */
    /* Mutable, guarded by the table's lock. */
    bool healthy;
    uint32_t probe_failures_consecutive;
    uint64_t probes_total;
    uint64_t probe_failures_total;
    uint32_t in_flight;           /* requests this router has on it now */
    uint64_t requests_total;      /* halves sent */
    uint64_t failures_total;      /* halves that failed: no answer, garbage, 5xx */
} rt_worker;

typedef struct rt_workers {
    pthread_mutex_t mu;
    rt_worker w[2 * PD_ROUTER_WORKERS_MAX];
    size_t count;
    size_t prefill_count;         /* w[0, prefill_count) are prefill nodes */
    pd_router_policy policy;
    size_t cursor[2];             /* per role, see policy.h */
    uint32_t unhealthy_after;
} rt_workers;

pd_err rt_workers_init(rt_workers *t, const pd_router_config *cfg, char *msg, size_t msg_cap);
void rt_workers_destroy(rt_workers *t);

/* Picks a healthy prefill and a healthy decode node by the policy and counts
 * a request in flight on each. PD_ERR_NOTFOUND when either role has no
 * healthy worker. */
pd_err rt_workers_pick(rt_workers *t, size_t *prefill, size_t *decode);
/* Ends one half picked by rt_workers_pick; `failed` counts it. */
void rt_workers_release(rt_workers *t, size_t i, bool failed);
/* Records one /health probe. Returns true when the worker changed state. */
bool rt_workers_probe(rt_workers *t, size_t i, bool ok);
/* At least one healthy worker of each role. */
bool rt_workers_have_pair(rt_workers *t);
/* Copies all entries (t->count of them) under the lock. */
void rt_workers_snapshot(rt_workers *t, rt_worker *out);

const char *rt_role_name(rt_role role);

#endif
