/*
 * net_copy.c — puts into a peer's shared memory, copied by several threads.
 *
 * Over shared memory a put into memory the peer's transport allocated is a
 * memcpy through a mapping of the peer's segment (ucp_rkey_ptr), done inside
 * ucp_put_nbx on the posting thread, the progress thread: one core's copy.
 * One core does not reach the memory system's limit: here an 8 MiB copy ran
 * at 30-33 GB/s on one thread and 58-62 GB/s split over two, a 32 MiB one at
 * 11-12 and 19-20 GB/s (docs/bootstrap-protocol.md, "Copies over shared
 * memory on more than one core"). So a put of at least
 * COPY_PARALLEL_MIN_BYTES whose destination the peer's rkey maps here is
 * copied by the progress thread together with copy_threads - 1 helpers,
 * each taking COPY_CHUNK_BYTES at a time from a shared cursor until none is
 * left: a helper that wakes late, or not at all on a busy machine, leaves
 * its share to the others, so the copy never takes longer than the progress
 * thread alone would, but for the wake-up's system call.
 *
 * The put is complete when net_copy returns (every chunk copied, each
 * helper's stores visible to the caller through the release of its
 * count): what the caller posts next (the small puts, the fence, the
 * completion notice) follows the bytes, as a put that completed inside
 * ucp_put_nbx would. A job's fields change only under the pool's mutex,
 * once no helper is inside the previous job (active == 0), so a helper
 * that took a job late never copies with another job's addresses.
 */
#include "net_internal.h"

#include <errno.h>
#include <string.h>

/* Takes chunks of the job until none is left; the bytes it copied. */
static size_t copy_chunks(copy_pool *cp, uint8_t *dst, const uint8_t *src, size_t len) {
    size_t off, mine = 0;
    while ((off = atomic_fetch_add_explicit(&cp->next, COPY_CHUNK_BYTES, memory_order_relaxed)) <
           len) {
        size_t k = PD_MIN((size_t)COPY_CHUNK_BYTES, len - off);
        memcpy(dst + off, src + off, k);
        atomic_fetch_add_explicit(&cp->copied, k, memory_order_release);
        mine += k;
    }
    return mine;
}

static void *copy_main(void *arg) {
    copy_pool *cp = arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&cp->mu);
    for (;;) {
        while (cp->gen == seen && !cp->stop) pthread_cond_wait(&cp->cv, &cp->mu);
        if (cp->stop) break;
        seen = cp->gen;
        uint8_t *dst = cp->dst;
        const uint8_t *src = cp->src;
        size_t len = cp->len;
        atomic_fetch_add_explicit(&cp->active, 1, memory_order_relaxed);
        pthread_mutex_unlock(&cp->mu);
        (void)copy_chunks(cp, dst, src, len);
        atomic_fetch_sub_explicit(&cp->active, 1, memory_order_release);
        pthread_mutex_lock(&cp->mu);
    }
    pthread_mutex_unlock(&cp->mu);
    return NULL;
}

pd_err net_copy_start(pd_net *n, char *msg, size_t msg_cap) {
    copy_pool *cp = &n->copy;
    *cp = (copy_pool){0};
    pthread_mutex_init(&cp->mu, NULL);
    pthread_cond_init(&cp->cv, NULL);
    cp->ready = true;
    uint32_t want = n->cfg.role == PD_NET_PREFILL ? n->cfg.copy_threads - 1 : 0;
    for (uint32_t i = 0; i < want; i++) {
        if (pthread_create(&cp->threads[i], NULL, copy_main, cp) != 0) {
            int e = errno;
            net_copy_stop(n);
            return pd_errorf(msg, msg_cap, PD_ERR_IO, "copy thread: %s", strerror(e));
        }
        cp->helpers++;
    }
    return PD_OK;
}

void net_copy_stop(pd_net *n) {
    copy_pool *cp = &n->copy;
    if (!cp->ready) return;
    pthread_mutex_lock(&cp->mu);
    cp->stop = true;
    pthread_cond_broadcast(&cp->cv);
    pthread_mutex_unlock(&cp->mu);
    for (uint32_t i = 0; i < cp->helpers; i++) pthread_join(cp->threads[i], NULL);
    cp->helpers = 0;
    pthread_cond_destroy(&cp->cv);
    pthread_mutex_destroy(&cp->mu);
    cp->ready = false;
}

bool net_copy_parallel(const pd_net *n, size_t len) {
    return n->copy.helpers > 0 && len >= COPY_PARALLEL_MIN_BYTES;
}

size_t net_copy(pd_net *n, void *dst, const void *src, size_t len) {
    copy_pool *cp = &n->copy;
    PD_ASSERT(cp->helpers > 0);
    pthread_mutex_lock(&cp->mu);
    /* A helper still inside the last job (it took it after the job's end)
     * finds no chunk left and leaves at once. */
    while (atomic_load_explicit(&cp->active, memory_order_acquire) > 0) sched_yield();
    cp->dst = dst;
    cp->src = src;
    cp->len = len;
    atomic_store_explicit(&cp->next, 0, memory_order_relaxed);
    atomic_store_explicit(&cp->copied, 0, memory_order_relaxed);
    cp->gen++;
    pthread_cond_broadcast(&cp->cv);
    pthread_mutex_unlock(&cp->mu);
    size_t mine = copy_chunks(cp, dst, src, len);
    while (atomic_load_explicit(&cp->copied, memory_order_acquire) < len) sched_yield();
    return mine;
}
