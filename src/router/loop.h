/*
 * rt_loop — the router's one upstream event loop: an epoll set, an eventfd
 * and one libcurl multi handle driven by curl_multi_socket_action, on one
 * thread. Every transfer to a worker (both halves of every request, the
 * aborts they send) runs on it; no request has a thread of its own.
 *
 * The loop knows two kinds of things:
 *
 *   rt_xfer  one libcurl easy handle added to the loop's multi handle. When
 *            it completes (or fails) the loop removes it from the multi
 *            handle and calls xfer->done on the loop thread.
 *   rt_task  a state machine (a forward) stepped on the loop thread: after
 *            one of its transfers made progress (rt_loop_mark), when another
 *            thread pokes it (rt_loop_poke: an abort, a hang-up, a client
 *            that can take more bytes), or when its wake_ms has passed. A
 *            step never blocks; it may free its task (rt_loop_forget first).
 *
 * Invariants:
 *   L1  A task is in the poked queue at most once (`poked`) and in the
 *       marked list at most once (`marked`); rt_loop_forget takes it out of
 *       both, so no step runs after a task was forgotten.
 *   L2  Only the loop thread touches the multi handle, the easy handles,
 *       the marked list and the timer list; other threads only push onto the
 *       poked queue (under mu) and write the eventfd.
 *   L3  A task's wake time (rt_loop_wake_at) is honoured within
 *       RT_LOOP_SWEEP_MS (deadlines here are hundreds of ms and more). Every
 *       RT_LOOP_FULL_SWEEP_MS the loop visits every task; in between it
 *       visits only the `near` list: the tasks due before the next full
 *       sweep. Thousands of streams whose only deadline is the request
 *       timeout cost nothing between full sweeps.
 */
#ifndef PD_ROUTER_LOOP_H
#define PD_ROUTER_LOOP_H

#include <curl/curl.h>
#include <stdbool.h>
#include <stdint.h>

#include "pdserve/base.h"

#define RT_LOOP_SWEEP_MS 10u
#define RT_LOOP_FULL_SWEEP_MS 250u

typedef struct rt_loop rt_loop;

typedef struct rt_xfer {
    CURL *easy;
    void (*done)(struct rt_xfer *x, CURLcode rc); /* loop thread, once removed */
} rt_xfer;

typedef struct rt_task rt_task;
struct rt_task {
    void (*step)(rt_task *t); /* loop thread */
    /* The loop's bookkeeping. */
    uint64_t wake_ms; /* 0: none; else step once rt_now_ms() >= wake_ms */
    rt_task *near_prev, *near_next;
    bool near;
    rt_task *poke_next;
    bool poked;
    rt_task *mark_prev, *mark_next;
    bool marked;
    rt_task *all_prev, *all_next; /* tasks the sweep visits */
    bool live;
};

pd_err rt_loop_start(rt_loop **out, char *msg, size_t msg_cap);
/* Joins the thread and frees the loop; every task must be forgotten. */
void rt_loop_stop(rt_loop *l);

/* Any thread: step t soon (the first poke of a task starts it). */
void rt_loop_poke(rt_loop *l, rt_task *t);
/* Loop thread: step t once rt_now_ms() >= wake_ms (0: no wake-up); a
 * step clears it. */
void rt_loop_wake_at(rt_loop *l, rt_task *t, uint64_t wake_ms);
/* Loop thread: step t before the loop waits again. */
void rt_loop_mark(rt_loop *l, rt_task *t);
/* Loop thread: t is going away; it is in no queue afterwards (L1) until
 * another thread pokes it again, which its owner must stop before it frees
 * t, and drop with a second forget (rt_fwd_destroy). */
void rt_loop_forget(rt_loop *l, rt_task *t);
/* Loop thread: adds x->easy (PRIVATE is set to x). False when curl refused. */
bool rt_loop_add_xfer(rt_loop *l, rt_xfer *x);
/* Loop thread: takes x->easy out of the multi handle without calling done. */
void rt_loop_remove_xfer(rt_loop *l, rt_xfer *x);
/* True on the loop's own thread. */
bool rt_loop_is_own_thread(const rt_loop *l);

#endif /* PD_ROUTER_LOOP_H */
