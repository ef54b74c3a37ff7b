/*
 * threads.c — the worker pool behind mdl_threads_run. See threads.h.
 *
 * One mutex guards the job description and two counters: `generation`
 * (bumped per job; a worker runs a job when it sees a generation it has not
 * run yet) and `pending` (workers still busy with the current job; the
 * caller waits for it to reach zero). Worker i always takes piece i, so the
 * split is a pure function of (n_units, threads).
 */
#include "threads.h"

#include <pthread.h>
#include <stdlib.h>

struct pd_threads {
    uint32_t n;                 /* threads including the caller */
    pthread_t *tids;            /* n - 1 workers */
    uint32_t started;           /* workers actually created */
    pthread_mutex_t mu;
    pthread_cond_t start_cv;
    pthread_cond_t done_cv;
    uint64_t generation;
    uint32_t pending;
    bool stop;
    pd_task_fn fn;
    void *ctx;
    uint32_t n_units;
};

typedef struct worker_arg {
    pd_threads *tp;
    uint32_t index;
} worker_arg;

static void piece(uint32_t n_units, uint32_t n, uint32_t i, uint32_t *begin, uint32_t *end) {
    *begin = (uint32_t)((uint64_t)n_units * i / n);
    *end = (uint32_t)((uint64_t)n_units * (i + 1) / n);
}

static void *worker_main(void *p) {
    worker_arg *arg = p;
    pd_threads *tp = arg->tp;
    uint32_t index = arg->index;
    free(arg);
    uint64_t seen = 0;
    pthread_mutex_lock(&tp->mu);
    for (;;) {
        while (!tp->stop && tp->generation == seen) pthread_cond_wait(&tp->start_cv, &tp->mu);
        if (tp->stop) break;
        seen = tp->generation;
        pd_task_fn fn = tp->fn;
        void *ctx = tp->ctx;
        uint32_t begin, end;
        piece(tp->n_units, tp->n, index, &begin, &end);
        pthread_mutex_unlock(&tp->mu);
        if (begin < end) fn(ctx, begin, end, index);
        pthread_mutex_lock(&tp->mu);
        PD_ASSERT(tp->pending > 0);
        if (--tp->pending == 0) pthread_cond_signal(&tp->done_cv);
    }
    pthread_mutex_unlock(&tp->mu);
    return NULL;
}

pd_err mdl_threads_create(pd_threads **out, uint32_t n_threads) {
    *out = NULL;
    if (n_threads < 1 || n_threads > 64) return PD_ERR_INVALID;
    pd_threads *tp = calloc(1, sizeof(*tp));
    if (!tp) return PD_ERR_NOMEM;
    tp->n = n_threads;
    pthread_mutex_init(&tp->mu, NULL);
    pthread_cond_init(&tp->start_cv, NULL);
    pthread_cond_init(&tp->done_cv, NULL);
    if (n_threads > 1) {
        tp->tids = calloc(n_threads - 1, sizeof(pthread_t));
        if (!tp->tids) {
            mdl_threads_destroy(tp);
            return PD_ERR_NOMEM;
        }
    }
    for (uint32_t i = 1; i < n_threads; i++) {
        worker_arg *arg = malloc(sizeof(*arg));
        if (!arg) {
            mdl_threads_destroy(tp);
            return PD_ERR_NOMEM;
        }
        arg->tp = tp;
        arg->index = i;
        if (pthread_create(&tp->tids[i - 1], NULL, worker_main, arg) != 0) {
            free(arg);
            mdl_threads_destroy(tp);
            return PD_ERR_NOMEM;
        }
        tp->started++;
    }
    *out = tp;
    return PD_OK;
}

void mdl_threads_destroy(pd_threads *tp) {
    if (!tp) return;
    pthread_mutex_lock(&tp->mu);
    tp->stop = true;
    pthread_cond_broadcast(&tp->start_cv);
    pthread_mutex_unlock(&tp->mu);
    for (uint32_t i = 0; i < tp->started; i++) pthread_join(tp->tids[i], NULL);
    pthread_cond_destroy(&tp->done_cv);
    pthread_cond_destroy(&tp->start_cv);
    pthread_mutex_destroy(&tp->mu);
    free(tp->tids);
    free(tp);
}

uint32_t mdl_threads_count(const pd_threads *tp) { return tp->n; }

void mdl_threads_run(pd_threads *tp, uint32_t n_units, pd_task_fn fn, void *ctx) {
    if (n_units == 0) return;
    if (tp->n == 1 || n_units == 1) {
        fn(ctx, 0, n_units, 0);
        return;
    }
    pthread_mutex_lock(&tp->mu);
    PD_ASSERT(tp->pending == 0);
    tp->fn = fn;
    tp->ctx = ctx;
    tp->n_units = n_units;
    tp->pending = tp->n - 1;
    tp->generation++;
    pthread_cond_broadcast(&tp->start_cv);
    pthread_mutex_unlock(&tp->mu);

    uint32_t begin, end;
    piece(n_units, tp->n, 0, &begin, &end);
    if (begin < end) fn(ctx, begin, end, 0);

    pthread_mutex_lock(&tp->mu);
    while (tp->pending > 0) pthread_cond_wait(&tp->done_cv, &tp->mu);
    pthread_mutex_unlock(&tp->mu);
}
