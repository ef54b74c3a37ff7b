/*
 * pd_loopback — the in-process transport: a prefill endpoint and a decode
 * endpoint joined by a deterministic "fabric" that carries control messages
 * and memcpy writes with a configurable latency.
 *
 * It is the embedded default (pdserve run) and the test double: outcomes can
 * be programmed per room (bootstrap ok / fail / hold, transfer ok / fail /
 * hang), either side's abort() can be made to report an error, and a side can
 * be killed (its peer learns after a grace period) and restarted.
 *
 * Time is whatever the caller says it is: operations posted at time t are
 * due at t + latency and happen in pd_loopback_advance(now). Writes read the
 * source memory when they happen, not when they are posted — so a source page
 * reused too early sends garbage, and a destination page reused too early is
 * overwritten by a late write: exactly the hazards that quarantine prevents,
 * and that the simulator's token check detects.
 *
 * Memory. Everything is allocated at creation (the room table, the operation
 * pool) but each room slot's page storage: the destination's page list and a
 * copy of the source pages the sender's writes name, at most one per
 * destination page. It is sized at receiver_open (admission) and kept for the
 * slot's next rooms, growing only when a room needs more than the slot ever
 * held, so a steady state allocates nothing per step nor per request. Pages
 * sent more than once (the engine does not) take a heap copy instead.
 *
 * Not thread-safe: one thread drives it (the simulator) or a mutex guards it.
 */
#ifndef PDSERVE_LOOPBACK_H
#define PDSERVE_LOOPBACK_H

#include "pdserve/executor.h"
#include "pdserve/xfer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_loopback pd_loopback;

typedef enum pd_lb_side { PD_LB_PREFILL = 0, PD_LB_DECODE = 1 } pd_lb_side;

typedef enum pd_lb_outcome {
    PD_LB_OK = 0,    /* proceed */
    PD_LB_FAIL,      /* fail the room when the step is reached */
    PD_LB_HOLD,      /* stay put (bootstrap: pending; transfer: hang) until changed */
} pd_lb_outcome;

typedef struct pd_loopback_config {
    uint64_t latency;         /* delay of every message and write (>= 1 keeps causality visible) */
    uint64_t jitter;          /* plus 0..jitter more, drawn per operation (writes of a
                                 room stay in order) */
    uint64_t jitter_seed;
    uint64_t dead_grace;      /* how long until a killed side's peer declares it dead */
    uint32_t rooms_max;
    uint32_t page_size;       /* tokens per KV page on both sides */
    /* Data operations queued at once (0: max(4096, 64 * rooms_max)); control
     * operations have slots of their own. */
    uint32_t ops_max;
} pd_loopback_config;

pd_err pd_loopback_create(pd_loopback **out, const pd_loopback_config *cfg);
void pd_loopback_destroy(pd_loopback *lb);

/* The endpoint of one side, for pd_engine_create. */
pd_xfer pd_loopback_endpoint(pd_loopback *lb, pd_lb_side side);
/* Registers a side's memory: the executor's regions and the metadata rows. */
void pd_loopback_register(pd_loopback *lb, pd_lb_side side, const pd_exec_memory *mem,
                          pd_meta_row *meta, uint32_t meta_rows);

/* Performs everything due at or before now, in posting order. */
void pd_loopback_advance(pd_loopback *lb, uint64_t now);
/* Operations posted but not yet performed (held ones included). A room
 * whose two halves are both gone holds none: its queued operations go with
 * it, whatever their kind and even if a HOLD parked them. */
uint32_t pd_loopback_pending(const pd_loopback *lb);

/* ---- the test double's controls ---- */
void pd_loopback_set_bootstrap(pd_loopback *lb, uint64_t room, pd_lb_outcome o);
void pd_loopback_set_transfer(pd_loopback *lb, uint64_t room, pd_lb_outcome o);
void pd_loopback_set_abort_error(pd_loopback *lb, pd_lb_side side, bool on);
/* The side dies now: its rooms vanish, writes to or from it are dropped, its
 * peer sees every shared room FAILED after dead_grace. */
void pd_loopback_kill(pd_loopback *lb, pd_lb_side side);
/* A fresh incarnation of a killed side (register its memory again). */
void pd_loopback_restart(pd_loopback *lb, pd_lb_side side);
/* The room's status on a side (for tests; PD_XFER_NONE if unknown). */
pd_xfer_status pd_loopback_status(pd_loopback *lb, pd_lb_side side, uint64_t room);

/* ---- ground truth for a judge ----
 * Every unit a write touches, at the moment it touches it: the prefill's
 * source (read) and the decode's destination (written), for room. Lets a
 * judge that knows who owns each unit (the simulator, through the ledgers)
 * check the transport's drained rule against what the fabric really does,
 * instead of trusting drained(). NULL removes it. */
typedef enum pd_lb_region { PD_LB_KV = 0, PD_LB_MAMBA, PD_LB_META } pd_lb_region;
typedef void (*pd_lb_touch_fn)(void *ctx, pd_lb_side side, pd_lb_region region, uint32_t unit,
                               uint64_t room);
void pd_loopback_set_touch_observer(pd_loopback *lb, pd_lb_touch_fn fn, void *ctx);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_LOOPBACK_H */
