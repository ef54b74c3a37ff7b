/*
 * pd_threads — a fixed set of worker threads that split one range of work.
 *
 * The model parallelises only over independent outputs (rows of a matrix
 * product, attention heads, Mamba heads), so a single primitive suffices:
 * mdl_threads_run(tp, n, fn, ctx) cuts [0, n) into one contiguous piece per
 * thread, runs piece 0 on the caller and the others on the workers, and
 * returns when all are done. Each output is computed by exactly the same
 * instructions whichever thread owns it, which is why 1 and N threads give
 * bit-identical results.
 *
 * Workers sleep on a condition variable between calls; one call costs a
 * broadcast and a join (microseconds), so callers skip the pool for small
 * pieces of work. Threads are created once, at mdl_threads_create.
 */
#ifndef PDSERVE_MODEL_THREADS_H
#define PDSERVE_MODEL_THREADS_H

#include "pdserve/base.h"

typedef struct pd_threads pd_threads;

/* fn computes units [begin, end); worker is in [0, threads) and indexes
 * per-thread scratch. */
typedef void (*pd_task_fn)(void *ctx, uint32_t begin, uint32_t end, uint32_t worker);

/* n_threads in [1, 64], the caller included. */
pd_err mdl_threads_create(pd_threads **out, uint32_t n_threads);
void mdl_threads_destroy(pd_threads *tp);
uint32_t mdl_threads_count(const pd_threads *tp);

/* Runs fn over [0, n_units) split across the threads; returns when done.
 * Not reentrant: one run at a time per pool. */
void mdl_threads_run(pd_threads *tp, uint32_t n_units, pd_task_fn fn, void *ctx);

#endif
