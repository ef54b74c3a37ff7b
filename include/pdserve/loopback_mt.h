/*
 * pd_loopback_mt — the loopback transport shared by several threads of one
 * process (pdserve run): a mutex around the fabric and a progress thread that
 * advances it on the monotonic clock. See loopback.h for the fabric itself.
 */
#ifndef PDSERVE_LOOPBACK_MT_H
#define PDSERVE_LOOPBACK_MT_H

#include "pdserve/loopback.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_loopback_mt pd_loopback_mt;

pd_err pd_loopback_mt_create(pd_loopback_mt **out, uint32_t page_size, uint32_t rooms_max);
/* Thread-safe endpoints for pd_engine_create. */
pd_xfer pd_loopback_mt_endpoint(pd_loopback_mt *m, pd_lb_side side);
void pd_loopback_mt_register(pd_loopback_mt *m, pd_lb_side side, const pd_exec_memory *mem,
                             pd_meta_row *meta, uint32_t meta_rows);
/* Starts the progress thread. */
pd_err pd_loopback_mt_start(pd_loopback_mt *m);
/* Stops the thread and frees the fabric (after the engines are gone). */
void pd_loopback_mt_destroy(pd_loopback_mt *m);

#ifdef __cplusplus
}
#endif
#endif
