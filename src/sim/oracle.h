/*
 * oracle.h — the simulator's judge of actions (private to src/sim).
 *
 * The ledger proves no unit is lost; it cannot see a wrong *action*: a final
 * send posted for an aborted request, a token emitted after the terminal, a
 * room cancelled after it was opened. The engines report every action they
 * take on a request's behalf (engine.h, pd_action); the oracle replays those
 * reports against the lifecycle rules, with its own state per request record,
 * so a rule holds because an independent observer saw it hold — not because
 * the engine's flags say so. The rules, numbered as in docs/simulator.md:
 *
 *   A1  no work after the terminal reason: once it is recorded, no room is
 *       opened, no forward launched, nothing sent, parked, requeued,
 *       committed, streamed — and nothing inserted into the prefix cache but
 *       the success release's own insertion;
 *   A2  nothing after the terminal event but closing the drained room;
 *   A3  the retire path in order: reason (once), then room abort or cancel,
 *       release, terminal event; release never while a forward of the
 *       request is in flight; a room it opened is never cancelled, a room it
 *       never opened never aborted;
 *   A4  forwards balance: every result matches a launch; no requeue while a
 *       forward is in flight;
 *   A5  a room is closed only once the transport says it is drained (no
 *       write of it will touch this node's memory again), and only once;
 *   O1  an abort accepted by a node ends the request there as aborted,
 *       unless a terminal reason was already recorded (the first one wins);
 *       the terminal event carries the recorded reason;
 *   O2  decode commits a room only after the prefill half of the same
 *       request posted its final send — so a request whose prefill half
 *       ended (aborted, failed, died) before that never finishes at decode
 *       with tokens.
 *
 * O3 (the client sees the outcome of the node that ended first) defines the
 * client's outcome; sim.c applies it.
 */
#ifndef PDSERVE_SIM_ORACLE_H
#define PDSERVE_SIM_ORACLE_H

#include "pdserve/engine.h"

#define ORACLE_SIDES 2

typedef void (*oracle_report_fn)(void *ctx, const char *msg);
/* The transport's own word: is the room drained on that side? (A5) */
typedef bool (*oracle_drained_fn)(void *ctx, int side, uint64_t room);

typedef struct sim_oracle sim_oracle;

/* records_max: the engines' requests_max (the low half of an owner id is
 * the record index + 1). NULL when out of memory. */
sim_oracle *oracle_create(uint32_t records_max, oracle_report_fn report, oracle_drained_fn drained,
                          void *ctx);
void oracle_destroy(sim_oracle *o);

/* The next ACCEPT on any side belongs to this client request (the sim's
 * index of a submit line). */
void oracle_expect_client(sim_oracle *o, uint32_t client);
/* A node died: its records are gone with it. */
void oracle_node_lost(sim_oracle *o, int side);
void oracle_on_action(sim_oracle *o, int side, const pd_action_event *ev);

/* The reason recorded for the client's record on that side (NONE if none
 * or no record). */
pd_terminal_kind oracle_reason(const sim_oracle *o, int side, uint32_t client);
/* O1, after the node accepted an abort; before: the reason before the call. */
void oracle_abort_accepted(sim_oracle *o, int side, uint32_t client, const char *rid,
                           pd_terminal_kind before);
/* O1, when the node's terminal event reaches the sink. */
void oracle_terminal_seen(sim_oracle *o, int side, uint32_t client, const char *rid,
                          pd_terminal_kind kind);

/* For the generator and the expectations. */
bool oracle_final_in_flight(const sim_oracle *o, uint32_t client); /* prefill, no reason yet */
bool oracle_running(const sim_oracle *o, uint32_t client);         /* decode committed, no reason */
bool oracle_cached_after_term(const sim_oracle *o, uint32_t client);
uint64_t oracle_actions(const sim_oracle *o);
/* The room of the record the engine on `side` knows as `owner` (a ledger
 * owner of state REQ), accepted and not yet replaced; false if none. */
bool oracle_room_of(const sim_oracle *o, int side, uint64_t owner, uint64_t *room);

#endif
