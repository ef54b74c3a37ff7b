/*
 * pd_xfer — the transport contract between a prefill node and a decode node
 * (DESIGN.md section 6), as the engines see it. NIXL-shaped: memory is
 * registered once per node; per room, the decode side hands over where it
 * wants the data (bootstrap), the prefill side posts writes of page runs,
 * then the Mamba state and the metadata row, then a completion notice that
 * arrives only after all the data.
 *
 * Everything is polled, never blocked on. A transport backend (loopback,
 * UCX) implements the vtable; each node gets its own endpoint (`self`).
 * The rules below are written once, in the room core (src/xfer/room.h),
 * which every backend drives; a backend only carries the news between the
 * two nodes.
 *
 * Rooms. A room is the 64-bit id that pairs the two halves of one request.
 * Per room and side the status moves
 *   BOOTSTRAPPING -> WAITING_FOR_INPUT -> TRANSFERRING -> SUCCESS
 * and can drop to FAILED from any state (bootstrap failure, transfer error,
 * the peer aborted the room, the peer died).
 *
 * abort(room) stops issuing work for the room and tells the peer; it may
 * itself fail (the engine counts that and releases locally anyway).
 * drained(room) is true once no operation of the room will touch this
 * node's memory again: only then may memory the room could touch be reused.
 * close(room) forgets the room; call it only once drained.
 *
 * cancel(room, peer) is for a request that ends on this side before it ever
 * opened its room (aborted or failed while queued, or refused at submit):
 * the peer's half may be waiting for a destination or for data that will
 * never come. The transport tells the peer where it can — now if the peer
 * has the room open, or later if the peer opens it afterwards (a tombstone)
 * — so the peer fails the room at once instead of at its timeout. Best
 * effort: it holds nothing of this node's memory, and no drained() or
 * close() follows. NULL where a transport cannot.
 */
#ifndef PDSERVE_XFER_H
#define PDSERVE_XFER_H

#include "pdserve/base.h"
#include "pdserve/executor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum pd_xfer_status {
    PD_XFER_NONE = 0,          /* unknown room */
    PD_XFER_BOOTSTRAPPING,
    PD_XFER_WAITING_FOR_INPUT, /* decode's destination is known to both sides */
    PD_XFER_TRANSFERRING,
    PD_XFER_SUCCESS,
    PD_XFER_FAILED,
} pd_xfer_status;

const char *pd_xfer_status_name(pd_xfer_status st);

/* The metadata row: what the prefill node hands over besides KV and state.
 * Written by the prefill node into its own row, copied by the transport into
 * the decode node's row; the decode node checks the nonce before trusting it. */
typedef struct pd_meta_row {
    uint64_t nonce;                 /* pd_room_nonce(room) */
    int32_t first_token;
    float first_logprob;
    uint32_t prompt_tokens;
    uint32_t prefill_cached_tokens; /* prefix the prefill node reused */
    uint32_t decode_cached_tokens;  /* prefix the decode node already had */
    uint32_t first_n_top;           /* top_logprobs of the first token */
    int32_t first_top_token[PD_TOP_LOGPROBS_MAX];
    float first_top_logprob[PD_TOP_LOGPROBS_MAX];
} pd_meta_row;

/* A nonce derived from the room; never 0, so a cleared row never matches. */
uint64_t pd_room_nonce(uint64_t room);

/* What the decode node preallocated for a room. */
typedef struct pd_xfer_dest {
    uint32_t prompt_tokens;
    uint32_t cached_tokens;    /* decode already holds KV of [0, cached_tokens); page multiple */
    const uint32_t *pages;     /* destinations of sequence pages [cached/ps, ceil(prompt/ps)) */
    uint32_t n_pages;
    uint32_t mamba_slot;       /* PD_POOL_NONE without Mamba layers */
    uint32_t meta_row;
} pd_xfer_dest;

typedef struct pd_xfer_vtable {
    /* ---- prefill side ---- */
    /* Starts the room: wait for the decode side's destination. */
    pd_err (*sender_open)(void *self, uint64_t room);
    /* Once WAITING_FOR_INPUT: tokens the decode side already has cached. */
    uint32_t (*sender_peer_cached)(void *self, uint64_t room);
    /* Writes sequence pages [first_page, first_page + n) from src_pages. */
    pd_err (*send_pages)(void *self, uint64_t room, uint32_t first_page,
                         const uint32_t *src_pages, uint32_t n);
    /* The last send: remaining pages, the Mamba state (PD_POOL_NONE: none)
     * and the metadata row, then the completion notice. */
    pd_err (*send_final)(void *self, uint64_t room, uint32_t first_page,
                         const uint32_t *src_pages, uint32_t n,
                         uint32_t mamba_slot, uint32_t meta_row);
    /* ---- decode side ---- */
    /* Starts the room and sends the destination to the prefill side named
     * by peer (a bootstrap address; backends without addressing ignore it). */
    pd_err (*receiver_open)(void *self, uint64_t room, const char *peer,
                            const pd_xfer_dest *dest);
    /* ---- both ---- */
    pd_xfer_status (*status)(void *self, uint64_t room);
    pd_err (*abort)(void *self, uint64_t room);
    bool (*drained)(void *self, uint64_t room);
    void (*close)(void *self, uint64_t room);
    /* This side ends a room it never opened; peer as for receiver_open
     * (decode side) or NULL (prefill side). May be NULL. */
    void (*cancel)(void *self, uint64_t room, const char *peer);
    /* Status by event rather than by call (may be NULL: the engine then asks
     * status()). Once this side has the room open, watch(room, slot) writes
     * status(room) into *slot and from then on keeps it equal: whichever
     * call or progress step of the transport changes the status writes the
     * new one there, in the same thread. The transport stops writing at
     * close(room) or watch(room, NULL). A room this side has not open (or
     * has closed) gets its status written once and is not watched. */
    void (*watch)(void *self, uint64_t room, uint8_t *slot);
} pd_xfer_vtable;

typedef struct pd_xfer {
    const pd_xfer_vtable *vt;
    void *self;
} pd_xfer;

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_XFER_H */
