/*
 * pd_stream — an executor wrapper that turns a synchronous executor (one
 * that computes a batch inside launch) into an in-order stream whose work
 * happens when the driver says so, as on a GPU stream.
 *
 * Batches, state copies and host loads are queued at launch and run, in
 * order, in pd_stream_run: only then does the inner executor read and write
 * memory. A batch can be held (it blocks everything behind it) or delayed by
 * a number of ticks. The simulator wraps both the synthetic executor and the
 * tiny model with it, so a forward's writes really happen late and a page
 * freed too early is really overwritten. The node runtime starts a worker
 * thread instead, which runs work as soon as it is queued.
 *
 * Thread safety: launch, poll, copy_state, load_* and the controls may be
 * called from one thread while the worker runs; write_back goes straight to
 * the inner executor (it copies cached pages no forward writes).
 */
#ifndef PDSERVE_STREAM_H
#define PDSERVE_STREAM_H

#include "pdserve/executor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_stream pd_stream;

/* inner must compute in launch (poll right after returns true) and finish
 * loads in load_begin. batch_max: items per batch. */
pd_err pd_stream_create(pd_stream **out, pd_executor inner, uint32_t batch_max);
void pd_stream_destroy(pd_stream *s);
pd_executor pd_stream_executor(pd_stream *s);

/* Called for every item at launch: PD_STREAM_HOLD holds the whole batch until
 * released, a positive value delays it by that many ticks, 0 runs it as soon
 * as it reaches the head of the stream. */
#define PD_STREAM_HOLD (-1)
typedef int (*pd_stream_hold_fn)(void *ctx, uint64_t batch_id, const pd_batch_item *item);
void pd_stream_set_hold_fn(pd_stream *s, pd_stream_hold_fn fn, void *ctx);
/* Holds or releases a launched batch that has not run yet. */
void pd_stream_hold(pd_stream *s, uint64_t batch_id, bool held);
/* While on, host loads queued from now on are held until it is turned off. */
void pd_stream_hold_loads(pd_stream *s, bool on);
/* The driver's clock: delayed batches become ready when it reaches their time. */
void pd_stream_set_now(pd_stream *s, uint64_t now);

/* Starts a worker thread that runs the stream's work as soon as it is
 * queued (the node runtime: batch N+1 computes while the scheduler processes
 * batch N's result). Without it, the driver runs the work (simulator). */
pd_err pd_stream_start_worker(pd_stream *s);

/* Runs queued work in order until the queue is empty or its head is held or
 * not ready yet. Returns the number of operations run. */
uint32_t pd_stream_run(pd_stream *s);
bool pd_stream_run_one(pd_stream *s);
uint32_t pd_stream_queued(const pd_stream *s);
bool pd_stream_blocked(const pd_stream *s);
/* Id of the batch at the head of the queue, or 0. */
uint64_t pd_stream_head_batch(const pd_stream *s);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_STREAM_H */
