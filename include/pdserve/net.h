/*
 * pd_net — the network transport between a prefill node and a decode node
 * in different processes or on different hosts: a TCP bootstrap channel for
 * control and UCX for the data (shared memory and TCP on one machine; RDMA
 * where the hardware has it). It implements the pd_xfer contract of
 * include/pdserve/xfer.h, whose rules (each status, abort(), drained(),
 * tombstones, cancel()) live once in the room core (src/xfer/room.h) that
 * this transport and the in-process loopback both drive.
 *
 * Roles. The prefill node listens on its bootstrap port. A decode node
 * connects to a prefill node the first time a request names it
 * (pd_xfer_vtable.receiver_open's `peer` is "host:port"), sends a hello with
 * its memory descriptors, then per room the destination (pages, Mamba slot,
 * metadata row, cached prefix). The prefill node writes KV page runs, then
 * the Mamba state, then the metadata row into the decode node's registered
 * memory with one-sided puts, then a completion notice that is delivered
 * only after all of the room's data.
 *
 * Threads. The engine calls the vtable from its scheduler thread; a progress
 * thread owned by the transport drives the sockets and the UCX worker. Every
 * vtable call is short and never blocks on the network.
 */
#ifndef PDSERVE_NET_H
#define PDSERVE_NET_H

#include "pdserve/executor.h"
#include "pdserve/xfer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct pd_net pd_net;

typedef enum pd_net_role { PD_NET_PREFILL, PD_NET_DECODE } pd_net_role;

typedef struct pd_net_config {
    pd_net_role role;
    const char *listen_host;      /* prefill: bootstrap listen address (default "0.0.0.0") */
    uint16_t bootstrap_port;      /* prefill: default 8998; 0 = any free port (tests) */
    const char *token;            /* shared secret a peer must present; NULL/"" = none */
    uint32_t page_size;           /* tokens per KV page; both sides must agree */
    uint32_t rooms_max;           /* live rooms (default 4096) */
    uint64_t heartbeat_ms;        /* default 1000 */
    uint64_t dead_after_ms;       /* a silent peer is declared dead after this (default 5000) */
    /* ---- added by the UCX implementation (zero = default) ---- */
    uint32_t peers_max;           /* bootstrap connections (default 64) */
    uint32_t stages_max;          /* page runs queued for the progress thread
                                     (default 16 * rooms_max) */
    uint64_t drain_grace_ms;      /* decode: after its prefill peer is lost, a room counts as
                                     drained only this much later; prefill: writes to a lost
                                     peer that UCX never completes (endpoints without
                                     peer-failure mode) are abandoned after this
                                     (default dead_after_ms) */
    /* prefill: destinations no request has claimed yet, per decode connection
     * (default rooms_max / 4). */
    uint32_t orphans_per_peer;
    uint64_t orphan_ms;           /* prefill: a destination the engine never opens, or a
                                     tombstone of an aborted room, is dropped after this
                                     (default 60000) */
    const char *ucx_tls;          /* UCX transports for this node (UCX_TLS syntax, e.g. "shm",
                                     "tcp", "rc,sm"); NULL = the environment / UCX default */
    const char *ucx_net_devices;  /* UCX_NET_DEVICES for this node (e.g. "lo", "mlx5_0:1");
                                     NULL = the environment / UCX default */
    int32_t spin_us;              /* after UCX reports progress, the progress thread keeps
                                     polling without sleeping this long, so emulated
                                     one-sided writes stream (default 1000; < 0: never
                                     spin, sleep on the worker's event fd at once) */
    /* The bootstrap protocol version to speak: 0 = the newest this build
     * knows (5); 4 = as a node built before version 5 (tcp rooms over the
     * notice's bound go as puts); 3 = as one built before version 4 (no
     * completion notice carries data): for rolling upgrades and tests. A
     * node speaks an older version to a peer that does
     * (docs/bootstrap-protocol.md, "Versioning"). */
    uint16_t protocol_version;
    /* prefill: a room handed off in one final send of at most this many bytes
     * (its KV pages, Mamba slot and metadata row) travels inside its
     * completion notice instead of as puts, to a version-4 or later peer. Default
     * (0): 1 MiB (the protocol's bound), to peers whose puts UCX emulates
     * (tcp), none where a put is a transport's own (shared memory, RDMA);
     * > 0: this bound (at most 1 MiB), to every peer; < 0: never.
     * Version 5, to peers whose puts UCX emulates, every other room goes as
     * data messages (active messages of at most 1 MiB) and a plain notice;
     * < 0 also turns those off: puts only, on every transport. */
    int32_t notice_data_max;
    /* The progress thread under Linux's SCHED_BATCH, whose wake-ups never
     * preempt the thread that is running (it takes a free core at once, or
     * its turn at the next scheduling tick). Default (0): a prefill node's
     * thread sleeps under SCHED_BATCH once nothing was handed to it that
     * only it will do for 0.2 ms, so that a DEST arriving (which the prefill's engine,
     * polling status(), takes in itself) does not preempt the engine; a put
     * too large for the engine's thread, or an abort's notice, puts it back
     * under SCHED_OTHER before it is woken, so that work's wake-up preempts
     * as before (docs/bootstrap-protocol.md, "The progress thread sleeps
     * under SCHED_BATCH"); a decode node's never. > 0: always under
     * SCHED_BATCH, either role (its own large puts then wait for a free
     * core). < 0: never. Ignored where the system has no SCHED_BATCH. */
    int8_t progress_sched_batch;
    /* Over tcp UCX emulates a put with messages of one send segment each,
     * and the receiver copies and acknowledges each one. Every node receives
     * segments of up to 256 KiB; it sends segments of 64 KiB (false, the
     * default), which any peer receives, or of 256 KiB (true: a quarter of
     * the messages, acknowledgements and system calls per byte, 15-25 %
     * faster large hand-offs, docs/bootstrap-protocol.md). True only where
     * every peer is a build that receives 256 KiB segments (this one or
     * later): an older peer's UCX receives into a 64 KiB buffer and does not
     * check the length. Ignored where only shared memory may be used. */
    bool ucx_tcp_large_segments;
    /* Prefill: threads that copy a put of at least 4 MiB into a peer's
     * shared memory (a peer on this host whose memory its transport
     * allocated): the progress thread and copy_threads - 1 helpers, each
     * taking 256 KiB at a time; one core's copy is not the memory system's
     * limit (docs/bootstrap-protocol.md, "Copies over shared memory on more
     * than one core"). Default (0): 2; 1: the progress thread alone (UCX's
     * own put); at most 8. Puts over other transports are UCX's. */
    uint32_t copy_threads;
    /* Optional log sink for connection-level events (peer lost, message
     * refused); called from the progress thread. NULL = silent. */
    void (*log)(void *log_ctx, const char *line);
    void *log_ctx;
} pd_net_config;

/* Fills the documented defaults (role as given, port 8998, listen 0.0.0.0). */
void pd_net_config_default(pd_net_config *cfg, pd_net_role role);

/* Creates the transport (UCX context and worker; the prefill side's
 * listening socket). msg names the problem on failure. */
pd_err pd_net_create(pd_net **out, const pd_net_config *cfg, char *msg, size_t msg_cap);
/* Registers this node's memory once: the executor's regions and the
 * metadata rows (the engine's meta_mem). Before pd_net_start. */
pd_err pd_net_register(pd_net *n, const pd_exec_memory *mem, pd_meta_row *meta,
                       uint32_t meta_rows, char *msg, size_t msg_cap);
/* Memory for this node's transferable regions (KV pages, Mamba slots,
 * metadata rows), allocated by the transport in the form its fastest path
 * wants: UCX allocates and maps it itself (ucp_mem_map with
 * UCP_MEM_MAP_ALLOCATE), so a shared-memory put is one copy into a segment
 * the peer attached and RDMA zero-copy uses the same registration; heap
 * memory would make UCX emulate every shared-memory put with active
 * messages. Zeroed; at most 8 allocations live at once; alloc returns NULL
 * when UCX cannot allocate. Give it to the executor before pd_net_register,
 * which then reuses the mapping. The executor frees what it got before
 * pd_net_destroy; memory still registered is unmapped only by
 * pd_net_destroy, once no put or peer can reach it. Valid from
 * pd_net_create to pd_net_destroy. */
pd_exec_alloc pd_net_allocator(pd_net *n);
/* Starts the progress thread. */
pd_err pd_net_start(pd_net *n, char *msg, size_t msg_cap);
/* The endpoint for pd_engine_create. */
pd_xfer pd_net_endpoint(pd_net *n);
/* The bootstrap port actually bound (prefill), e.g. after port 0. */
uint16_t pd_net_bootstrap_port(const pd_net *n);
/* Stops the progress thread, fails every live room, closes every peer. */
void pd_net_destroy(pd_net *n);

typedef struct pd_net_stats {
    uint64_t bytes_sent, bytes_received;   /* data plane */
    uint64_t rooms_opened, rooms_succeeded, rooms_failed;
    uint64_t peers_connected, peers_lost;
    uint64_t bad_messages;                 /* malformed, truncated, unauthenticated */
    /* ---- added by the UCX implementation ---- */
    uint64_t writes_posted;                /* one-sided puts (a coalesced page run is one) */
    uint64_t write_errors;                 /* puts or flushes that completed with an error */
    uint64_t error_replies;                /* ERROR messages sent to peers */
    uint64_t peers_without_peer_errors;    /* endpoints created without UCX peer-failure
                                              mode (UCX 1.13 shared memory lacks it) */
    uint64_t writes_abandoned;             /* writes to a dead peer of such an endpoint that
                                              never completed; given up after drain_grace_ms */
    uint64_t rooms_cancelled;              /* rooms ended here before they opened; the peer
                                              is told (xfer.h, cancel) */
    /* Connections closed before they authenticated, to free a slot for a newer one. */
    uint64_t peers_evicted;
    /* Destinations no request claimed, dropped (with an ABORT to their decode
     * node) to make way for a room, or refused over the per-peer cap. */
    uint64_t orphans_evicted, orphans_refused;
    /* Handshakes refused because the peer's proof of the token did not
     * verify (it holds another token, or none). */
    uint64_t auth_refused;
    /* Registered regions that lie in memory pd_net_allocator gave out (the
     * fast path); the others are the caller's memory, registered as is. */
    uint64_t regions_own_memory;
    /* Host names handed to the resolver threads (numeric addresses are not). */
    uint64_t name_lookups;
    /* Turns of the progress work run by the engine's own status() and
     * drained() calls while a room's news was due (net.c, assisted progress). */
    uint64_t progress_assists;
    /* Assisted turns not run because a put over the inline limit was in
     * flight: its progress thread drives it (over tcp a turn would send its
     * segments on the engine's thread). */
    uint64_t assists_deferred;
    /* Completion notices that carried their room's bytes (version 4): sent
     * (prefill), or checked and copied into the room's pages (decode). */
    uint64_t notices_with_data;
    /* Data messages (version 5, rooms over the notice's bound where puts are
     * emulated): sent (prefill), or checked and copied in (decode). */
    uint64_t data_messages;
    /* Changes of the progress thread's scheduling policy (progress_sched_batch):
     * by default at most two per room whose puts it posts (none while such
     * rooms follow each other within 0.2 ms), none for a room the
     * engine's calls carry. */
    uint64_t progress_sched_switches;
    /* status() calls answered from the published status table, without the
     * mutex, while another thread held it (net.c, status without the mutex);
     * drained() calls that said "not yet" for the same reason. */
    uint64_t status_unlocked;
    uint64_t drained_unlocked;
    /* Passes of the progress thread that ended by publishing every room's
     * status, because a status() had been answered without the mutex. */
    uint64_t status_refreshes;
    /* Puts copied into a peer's shared memory by the copy threads
     * (copy_threads > 1), and how many of them a helper took part in (on a
     * busy machine the progress thread may copy a put alone). */
    uint64_t writes_copied;
    uint64_t writes_copied_helped;
    /* ucp_worker_progress calls made in assisted turns: at most two a turn
     * (net.c), so that over tcp an engine's status() never stays to
     * receive a whole emulated put. */
    uint64_t assist_progress_calls;
} pd_net_stats;
void pd_net_stats_get(pd_net *n, pd_net_stats *out);

/* Rooms in the table (open, settling, orphaned or tombstoned): for leak
 * checks in tests and /metrics. */
uint32_t pd_net_rooms_live(pd_net *n);

/* ---- fault injection (tests, scenario replays against the real transport) ---- */
typedef enum pd_net_fault {
    /* abort() reports PD_ERR_IO and its notice to the peer goes out late
     * (after 2 * heartbeat_ms) — like the loopback's abort error. */
    PD_NET_FAULT_ABORT_ERROR = 0,
    /* Prefill: completion, abort and acknowledgement notices are held back
     * while on (data writes still run); released when turned off. */
    PD_NET_FAULT_HOLD_NOTICES,
    /* Decode: each host-name lookup waits 2 * dead_after_ms first, like a
     * DNS server that does not answer (numeric addresses are not looked up). */
    PD_NET_FAULT_SLOW_RESOLVE,
    /* Decode: the UCX worker is not progressed while on, so what UCX must
     * deliver by hand (puts emulated over tcp, completion notices) waits;
     * bootstrap messages are still handled. */
    PD_NET_FAULT_HOLD_DATA,
    /* The progress thread does nothing while on (it waits for the fault to
     * be turned off): only what the engine's own calls do moves a room (the
     * sends they post inline, the progress turns status() and drained()
     * run). Heartbeats stop too: keep it shorter than dead_after_ms. */
    PD_NET_FAULT_PARK_PROGRESS,
    /* The progress thread holds the transport's mutex, doing nothing, while
     * on (like a progress thread inside a long copy): what needs the mutex
     * waits. Set without the mutex; turning it on returns once the thread
     * holds it (at once if the transport is not started). */
    PD_NET_FAULT_HOLD_MUTEX,
    /* The progress work publishes no status it changed (net.c, status
     * without the mutex): unlocked answers then wait for a refresh or a
     * vtable call, as before the pumps published. */
    PD_NET_FAULT_NO_PASS_PUBLISH,
    PD_NET_FAULT__COUNT
} pd_net_fault;
void pd_net_set_fault(pd_net *n, pd_net_fault fault, bool on);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_NET_H */
