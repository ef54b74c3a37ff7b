/*
 * pd_sim — the deterministic simulator (DESIGN.md section 8).
 *
 * One event loop runs a prefill engine and a decode engine, each with a
 * synthetic executor, joined by the loopback transport, plus the clients.
 * Time is a tick counter; nothing depends on the wall clock, so the same
 * seed and binary give the same run, byte for byte.
 *
 * Everything the simulator does is a line of the scenario language; a random
 * run is a scenario generated on the fly from the seed. Its trace is
 * therefore a scenario file: a failing run prints its configuration and last
 * lines, ready to paste into tests/scenarios/.
 *
 * After every line: both engines' checks (ledger three-source check, clean
 * idle when idle, request flags vs ledger, prefix cache invariants) and at
 * most one terminal event per request and node. On every action an engine
 * reports (pd_action): the oracle's rules (src/sim/oracle.h) — no work after
 * the terminal reason, the retire path in order, an accepted abort ends as
 * aborted, decode commits only what prefill sent, rooms closed only when
 * drained. At the end of every run and scenario: exactly one terminal event
 * per request on every node that accepted it, nothing pending, clean idle,
 * and every request's tokens equal to the same request run alone (all of
 * them when it finished, the streamed prefix otherwise).
 */
#ifndef PDSERVE_SIM_H
#define PDSERVE_SIM_H

#include <stdio.h>

#include "pdserve/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pd_sim_fault {
    PD_FAULT_ABORT = 1u << 0,       /* client aborts at prefill, decode or both */
    PD_FAULT_BOOTSTRAP = 1u << 1,   /* bootstrap failure, hold (slowness, timeout) */
    PD_FAULT_HOLD = 1u << 2,        /* forward results held back, released late */
    PD_FAULT_XFER = 1u << 3,        /* transfer failure, hang, slowness */
    PD_FAULT_ABORT_ERROR = 1u << 4, /* the transport's abort() reports an error */
    PD_FAULT_KILL = 1u << 5,        /* node death and restart (decode or prefill) */
    PD_FAULT_DUP = 1u << 6,         /* the same rid submitted twice */
    PD_FAULT_OVERSIZE = 1u << 7,    /* prompts that do not fit */
    PD_FAULT_REUSE = 1u << 8,       /* a rid reused right after its terminal event */
    PD_FAULT_ALL = 0x1FFu,
} pd_sim_fault;

/* "all", "none" or a comma list of: abort, bootstrap, hold, xfer,
 * abort-error, kill, dup, oversize, reuse. */
pd_err pd_sim_parse_faults(const char *list, uint32_t *out, char *msg, size_t msg_cap);

typedef struct pd_sim_result {
    uint64_t seed;
    uint32_t requests, finished, aborted, failed, rejected;
    uint32_t violations;
    uint64_t steps;       /* ticks: one scheduler iteration on every node */
    uint64_t events;      /* scenario lines executed */
    char config[480];     /* the configuration, as a scenario line */
} pd_sim_result;

typedef struct pd_sim_options {
    uint64_t seed;
    uint32_t requests;
    uint32_t faults;      /* pd_sim_fault bits */
    bool vary;            /* derive the configuration from the seed too (swarm) */
    const char *config;   /* optional "config ..." overrides (after vary) */
    FILE *trace;          /* every executed line (NULL: none) */
    /* Called with each violation as it is found (NULL: none), before the run
     * goes on: a driver can keep it somewhere that survives a crash later in
     * the same run (an assertion the violation leads to, say). */
    void (*on_violation)(void *ctx, const char *msg);
    void *violation_ctx;
} pd_sim_options;

/* A random run. PD_OK without violations; PD_ERR_INTERNAL with the seed, the
 * configuration, the violations and the last lines (as a scenario) in
 * *report. */
pd_err pd_sim_random(const pd_sim_options *o, pd_sim_result *res, pd_strbuf *report);

/* The configuration line ("config ...") the random run of o->seed uses, in
 * out; on a bad o->config, PD_ERR_PARSE with the reason in out. Runs nothing:
 * a crash report can name the configuration of the seed that crashed. */
pd_err pd_sim_seed_config(const pd_sim_options *o, char *out, size_t out_cap);

/* Replays a scenario. PD_OK if it parses, no invariant breaks and every
 * expect holds; otherwise *report says which line failed and why.
 * config_extra (may be NULL), a "config ..." line, is applied after the
 * scenario's own configuration — e.g. "config model=tiny". */
pd_err pd_sim_scenario(const char *text, const char *name, const char *config_extra, FILE *trace,
                       pd_sim_result *res, pd_strbuf *report);

typedef struct pd_sim_explore_result {
    uint64_t schedules;   /* complete schedules run */
    uint64_t violations;
    uint32_t max_choices; /* longest schedule, in choices */
} pd_sim_explore_result;

/* Exhaustive exploration of a small configuration: two requests of three
 * chunks each with overlap on; every ordering of their forward results,
 * bootstrap completions, transfer completions, one abort, one bootstrap
 * failure and one transfer failure. limit caps the schedules (0: none). */
pd_err pd_sim_explore(uint64_t limit, pd_sim_explore_result *res, pd_strbuf *report);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_SIM_H */
