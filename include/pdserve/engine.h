/*
 * pd_engine — the prefill and decode lifecycle engines (DESIGN.md sections
 * 3 to 5): single-threaded, sans-I/O state machines. No sockets, threads,
 * clocks or sleeps inside: the driver calls submit / abort / step with the
 * current time, and the engine talks to the world through three vtables —
 * executor (forward passes), transport (the room's sender or receiver) and
 * sink (streamed tokens and terminal events).
 *
 * The same code runs under the node runtime (threads, sockets) and under the
 * deterministic simulator, so every race the simulator finds is a race of
 * the real server.
 *
 * The promise: every resource unit has one owner at every instant (the
 * ledger); every request leaves through one idempotent retire path; every
 * request that submit accepted gets exactly one terminal event.
 */
#ifndef PDSERVE_ENGINE_H
#define PDSERVE_ENGINE_H

#include "pdserve/base.h"
#include "pdserve/executor.h"
#include "pdserve/ledger.h"
#include "pdserve/xfer.h"

#ifdef __cplusplus
extern "C" {
#endif

/* PREFILL and DECODE are the two halves of disaggregated serving; COLOCATED
 * (pdserve serve) prefills and decodes in one engine, without a transfer. */
typedef enum pd_role { PD_ROLE_PREFILL, PD_ROLE_DECODE, PD_ROLE_COLOCATED } pd_role;

const char *pd_role_name(pd_role role);

#define PD_STOP_TOKENS_MAX 8
#define PD_PEER_MAX 96

typedef struct pd_engine_config {
    pd_role role;
    uint32_t page_size;            /* tokens per KV page */
    uint32_t kv_pages;
    uint32_t rows;                 /* requests holding memory at once */
    uint32_t mamba_slots;          /* 0: attention-only model */
    uint32_t meta_rows;
    uint32_t host_pages;           /* 0: no host tier */
    uint32_t requests_max;         /* live: queued, running, parked, transferring, draining */
    uint32_t chunk_tokens;         /* prefill: tokens per forward (chunked_prefill_size) */
    uint32_t batch_max;            /* requests per forward */
    uint32_t prompt_tokens_max;    /* 0: as many as the KV pool holds */
    uint32_t new_tokens_max;       /* bound on max_new_tokens (decode) */
    bool overlap;                  /* prefill: launch batch N+1 before processing N */
    uint32_t optimistic_attempts;  /* prefill: start before bootstrap completes */
    bool prefix_cache;
    bool strict;                   /* per-unit owner map in the ledger */
    uint64_t bootstrap_timeout_us; /* 0: none */
    uint64_t transfer_timeout_us;  /* 0: none */
    pd_meta_row *meta_mem;         /* meta_rows rows, caller-owned, registered with the transport */
} pd_engine_config;

/* Defaults for a role: small pools suitable for tests; adjust and pass. */
void pd_engine_config_default(pd_engine_config *cfg, pd_role role);

typedef struct pd_request_spec {
    const char *rid;               /* unique among live requests of the node */
    uint64_t room;                 /* non-zero; unique among live requests (colocated: any) */
    const int32_t *prompt;
    uint32_t prompt_len;
    uint32_t max_new_tokens;       /* >= 1 */
    pd_sampling sampling;
    const int32_t *stop_tokens;    /* finish with "stop" on any of these */
    uint32_t n_stop_tokens;        /* <= PD_STOP_TOKENS_MAX */
    bool ignore_eos;
    const char *peer;              /* decode: the prefill node's bootstrap address */
    /* The caller's own handle for the request: every sink event echoes it. */
    uint64_t tag;
} pd_request_spec;

typedef enum pd_terminal_kind {
    PD_TERM_NONE = 0,
    PD_TERM_FINISHED,
    PD_TERM_ABORTED,
    PD_TERM_FAILED,
} pd_terminal_kind;

typedef enum pd_finish_reason {
    PD_FINISH_NONE = 0,
    PD_FINISH_LENGTH,              /* decode: max_new_tokens reached */
    PD_FINISH_STOP,                /* decode: end or stop token */
    PD_FINISH_TRANSFERRED,         /* prefill: the hand-off succeeded */
} pd_finish_reason;

const char *pd_terminal_kind_name(pd_terminal_kind k);
const char *pd_finish_reason_name(pd_finish_reason f);

typedef struct pd_terminal_event {
    uint64_t tag; /* the request's pd_request_spec.tag */
    const char *rid;
    uint64_t room;
    pd_terminal_kind kind;
    pd_finish_reason finish;
    int status_code;               /* 200, or the HTTP-style status of a failure */
    const char *message;           /* why, for aborts and failures */
    uint32_t prompt_tokens;
    uint32_t completion_tokens;
    uint32_t cached_tokens;
    /* When this node reached each stage, on the driver's clock (the now_us it
     * gives submit and step; the step's time, not the instant within it);
     * 0: the request never reached it here. */
    uint64_t submit_us;
    uint64_t admit_us;      /* prefill, colocated: admitted (memory reserved for its chunks) */
    uint64_t computed_us;   /* prefill, colocated: the prompt's last chunk's result processed */
    uint64_t xfer_first_us; /* prefill: the first send of the room posted */
    uint64_t xfer_start_us; /* prefill: the final send posted; decode: the destination sent */
    uint64_t xfer_done_us;  /* prefill: the transport reported success; decode: likewise */
    /* KV pages, Mamba state and metadata row this node posted to the room
     * (prefill) or received through it (decode, once the transfer succeeded). */
    uint64_t xfer_bytes;
} pd_terminal_event;

/* Every event names its request by the tag the caller gave at submit
 * (pd_request_spec.tag), so a caller finds its own record without knowing the
 * engine's ids; rid and room come along for logs and checks. */
typedef struct pd_sink_vtable {
    /* A generated token (decode node). index 0 is the first output token. */
    void (*token)(void *self, uint64_t tag, const char *rid, uint64_t room, int32_t token,
                  float logprob, uint32_t index);
    /* The request's one terminal event on this node. */
    void (*terminal)(void *self, const pd_terminal_event *ev);
    /* Optional (may be NULL): output token `index`'s most likely
     * alternatives, when its sampling asked for top_logprobs; called just
     * before token() for the same index. */
    void (*top_logprobs)(void *self, uint64_t tag, uint32_t index, const int32_t *tokens,
                         const float *logprobs, uint32_t n);
} pd_sink_vtable;

typedef struct pd_sink {
    const pd_sink_vtable *vt;
    void *self;
} pd_sink;

typedef struct pd_engine pd_engine;

/* Creates the engine and its pools. The executor's memory must match the
 * pool sizes (checked). msg receives the reason on failure. */
pd_err pd_engine_create(pd_engine **out, const pd_engine_config *cfg,
                        pd_executor exec, pd_xfer xfer, pd_sink sink,
                        char *msg, size_t msg_cap);
/* Frees everything. Requests still live get no terminal event. */
void pd_engine_destroy(pd_engine *e);

/* Why submit refused a request: an HTTP-style status and a message. */
typedef struct pd_reject {
    int status;                    /* 400, 409, 413, 429 */
    char message[192];
} pd_reject;

/* Accepts a request (PD_OK) or refuses it before it enters any queue
 * (a generating node needs KV for prompt + max_new_tokens - 1 positions):
 * PD_ERR_INVALID (400: empty prompt, max_new_tokens < 1 or above the bound,
 * bad sampling parameters, missing room, too many stop tokens),
 * PD_ERR_TOOBIG (413: the prompt cannot fit the KV pool),
 * PD_ERR_EXISTS (409: duplicate live rid or room),
 * PD_ERR_NOMEM (429: too many live requests). *why may be NULL. */
pd_err pd_engine_submit(pd_engine *e, const pd_request_spec *spec, uint64_t now_us,
                        pd_reject *why);

/* Aborts a live request (terminal: aborted). PD_ERR_NOTFOUND for an unknown
 * or already-ended rid: a no-op. */
pd_err pd_engine_abort(pd_engine *e, const char *rid);
/* Aborts every live request; returns how many. */
uint32_t pd_engine_abort_all(pd_engine *e);

/* What pd_engine_flush_cache gave back: the units the prefix cache held. */
typedef struct pd_cache_flush {
    uint64_t kv_pages;    /* device KV pages */
    uint64_t host_pages;  /* host-tier copies */
    uint64_t mamba_slots; /* Mamba snapshots */
} pd_cache_flush;

/* Empties the prefix cache (SGLang's /flush_cache): every unit it holds, on
 * the device and on the host tier, goes back to its pool's free list through
 * the ledger. Refused with PD_ERR_STATE while any request is live or a
 * forward is in flight (a live request may hold a lock on a cached prefix,
 * or match one at its next admission): msg then says how many are live and
 * how many of them hold cached units. PD_OK, with what was freed in *out
 * (may be NULL) and a one-line summary in msg; a node without a prefix cache
 * has nothing to flush (PD_OK). */
pd_err pd_engine_flush_cache(pd_engine *e, pd_cache_flush *out, char *msg, size_t msg_cap);

/* One scheduler iteration at time now_us: poll the transport, process
 * forward results, admit and launch. Never blocks. */
void pd_engine_step(pd_engine *e, uint64_t now_us);

/* Nothing queued, running, parked, transferring, loading or draining, and no
 * forward in flight. */
bool pd_engine_idle(const pd_engine *e);

/* Runs the ledger's three-source check (deep when the engine is strict),
 * the clean-idle check when idle, and the engine's own check that every
 * live request holds exactly the units its flags say. PD_OK, or
 * PD_ERR_INTERNAL with the violations and the attribution report in *report. */
pd_err pd_engine_check(pd_engine *e, pd_strbuf *report);

typedef struct pd_engine_counters {
    uint64_t submitted, rejected, finished, aborted, failed;
    uint64_t batches, prefill_tokens, decode_tokens, cached_tokens;
    uint64_t xfer_abort_errors;    /* transport abort() reported an error */
    uint64_t rooms_cancelled;      /* rooms ended here before they opened (xfer.h, cancel) */
    uint64_t retire_deferred;      /* retires that waited for a forward */
    uint64_t requeued;             /* optimistic attempts released back */
    uint64_t late_results_ignored; /* results for already-retired requests */
    uint32_t queued_bootstrap, queued_waiting, loading, running, parked,
             transferring, draining, prealloc, wait_transfer;
    uint32_t forwards_in_flight;
} pd_engine_counters;

void pd_engine_counters_get(const pd_engine *e, pd_engine_counters *out);

/* A request for `room` was refused before it reached pd_engine_submit (bad
 * input at the front end): cancels the room at the transport (xfer.h) so the
 * peer's half of the request fails now instead of at its timeout — unless
 * the room is live here. peer: the prefill's bootstrap address (decode). */
void pd_engine_cancel_room(pd_engine *e, uint64_t room, const char *peer);
pd_ledger *pd_engine_ledger(pd_engine *e);
const pd_engine_config *pd_engine_config_of(const pd_engine *e);

/* Ledger report (text or JSON) with owners described as requests. */
void pd_engine_report(pd_engine *e, pd_report_format fmt, pd_strbuf *out);

/* The engine's id of a live request (the ledger owner and pd_batch_item.req),
 * or 0 if the rid is not live: for inspecting the ledger and matching executor
 * items; a sink finds its request by tag. The id is opaque. A request is live
 * until its terminal event is out; then its rid is free for a new request,
 * even while its record still drains its room. */
uint64_t pd_engine_request_id(const pd_engine *e, const char *rid);

/* What the engine does on a request's behalf, reported as it happens, so an
 * observer outside the engine (the simulator's oracle) can judge every action
 * against the lifecycle rules instead of trusting the engine's own flags.
 * The engine reports; it never checks its own reports. */
typedef enum pd_action {
    PD_ACT_ACCEPT = 0,      /* submit accepted it */
    PD_ACT_TERMINAL_REASON, /* retire step 1: its terminal reason is recorded (once) */
    PD_ACT_ROOM_OPEN,       /* opened its room at the transport (sender or receiver) */
    PD_ACT_LAUNCH,          /* a forward that includes it was launched (final: its last chunk) */
    PD_ACT_RESULT,          /* a result of one of its forwards is being processed */
    PD_ACT_SEND_PAGES,      /* posted a middle send of KV pages */
    PD_ACT_SEND_FINAL,      /* posted the final send (last pages, Mamba state, metadata row) */
    PD_ACT_PARK,            /* final chunk done, bootstrap pending: parked */
    PD_ACT_REQUEUE,         /* optimistic attempt released back to a queue */
    PD_ACT_INSERT,          /* inserted computed pages into the prefix cache */
    PD_ACT_COMMIT,          /* decode: took the transferred data as its own */
    PD_ACT_TOKEN,           /* emitted a generated token */
    PD_ACT_ROOM_ABORT,      /* retire step 3: aborted its room at the transport */
    PD_ACT_ROOM_CANCEL,     /* retire step 3: cancelled a room it never opened */
    PD_ACT_RELEASE,         /* retire step 4: released what it held (final: with insertion) */
    PD_ACT_TERMINAL,        /* retire step 5: emitted its terminal event */
    PD_ACT_ROOM_CLOSE,      /* closed its room: no write of the room will touch memory again */
    PD_ACT__COUNT
} pd_action;

const char *pd_action_name(pd_action a);

typedef struct pd_action_event {
    pd_action action;
    uint64_t req;             /* the engine's id of the record (pd_engine_request_id) */
    /* The record's index, < requests_max: the engine reuses records, never ids. */
    uint32_t record;
    const char *rid;
    uint64_t room;
    pd_terminal_kind kind;    /* TERMINAL_REASON, TERMINAL: the reason */
    bool final;               /* LAUNCH: the prompt's last chunk; RELEASE: success insertion */
    uint32_t n;               /* SEND_*: pages posted; INSERT: tokens inserted */
} pd_action_event;

typedef void (*pd_action_observer)(void *ctx, const pd_action_event *ev);
/* At most one observer; NULL removes it. Costs one branch per action when unset. */
void pd_engine_set_action_observer(pd_engine *e, pd_action_observer fn, void *ctx);

#ifdef __cplusplus
}
#endif
#endif /* PDSERVE_ENGINE_H */
