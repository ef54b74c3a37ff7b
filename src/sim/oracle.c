/*
 * oracle.c — replays the engines' action reports against the lifecycle
 * rules (oracle.h). One record per engine record slot and side, created at
 * ACCEPT and kept until the slot is accepted again (so actions on a
 * draining record are still judged); one entry per client request for what
 * crosses the two nodes (the final send, the commit).
 */
#include "oracle.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


typedef struct orec {
    uint64_t owner;          /* 0: slot never used on this incarnation of the node */
    uint64_t room;
    uint32_t client;
    pd_terminal_kind reason; /* A1: recorded at TERMINAL_REASON */
    uint32_t in_flight;      /* A4: launches minus results */
    bool final_launched, final_done;
    bool opened, aborted, cancelled, released, release_insert, emitted, closed;
} orec;

typedef struct oclient {
    bool final_sent;         /* O2: the prefill half posted its final send */
    bool committed;          /* decode took the data */
    bool cached_after_term;
    uint32_t slot[ORACLE_SIDES]; /* the client's record on each side, or PD_NONE */
    uint64_t owner[ORACLE_SIDES];
} oclient;

struct sim_oracle {
    uint32_t records_max;
    orec *recs[ORACLE_SIDES];
    oclient *clients;
    uint32_t n_clients, cap_clients;
    uint32_t next_client;
    oracle_report_fn report;
    oracle_drained_fn drained;
    void *ctx;
    uint64_t actions;
};

static const char *side_word(int side) { return side == 0 ? "prefill" : "decode"; }

static void fail(sim_oracle *o, const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    o->report(o->ctx, buf);
}

sim_oracle *oracle_create(uint32_t records_max, oracle_report_fn report, oracle_drained_fn drained,
                          void *ctx) {
    PD_ASSERT(records_max > 0 && report && drained);
    sim_oracle *o = calloc(1, sizeof(*o));
    if (!o) return NULL;
    o->records_max = records_max;
    o->report = report;
    o->drained = drained;
    o->ctx = ctx;
    o->next_client = PD_NONE;
    for (int s = 0; s < ORACLE_SIDES; s++) {
        o->recs[s] = calloc(records_max, sizeof(orec));
        if (!o->recs[s]) {
            oracle_destroy(o);
            return NULL;
        }
    }
    return o;
}

void oracle_destroy(sim_oracle *o) {
    if (!o) return;
    for (int s = 0; s < ORACLE_SIDES; s++) free(o->recs[s]);
    free(o->clients);
    free(o);
}

static oclient *client_at(sim_oracle *o, uint32_t client) {
    if (client >= o->cap_clients) {
        uint32_t cap = o->cap_clients ? o->cap_clients : 64;
        while (cap <= client) cap *= 2;
        oclient *c = realloc(o->clients, cap * sizeof(oclient));
        PD_ASSERT(c);
        o->clients = c;
        o->cap_clients = cap;
    }
    while (o->n_clients <= client) {
        oclient *c = &o->clients[o->n_clients++];
        memset(c, 0, sizeof(*c));
        c->slot[0] = c->slot[1] = PD_NONE;
    }
    return &o->clients[client];
}

void oracle_expect_client(sim_oracle *o, uint32_t client) {
    client_at(o, client);
    o->next_client = client;
}

void oracle_node_lost(sim_oracle *o, int side) {
    PD_ASSERT(side >= 0 && side < ORACLE_SIDES);
    memset(o->recs[side], 0, o->records_max * sizeof(orec));
    for (uint32_t i = 0; i < o->n_clients; i++) o->clients[i].slot[side] = PD_NONE;
}

/* The record an action is about: same slot, same owner (generation). */
static orec *record_of(sim_oracle *o, int side, const pd_action_event *ev) {
    if (ev->record >= o->records_max || ev->req == 0) {
        fail(o, "oracle: %s reported %s for %s with an invalid record %u (id %llu)",
             side_word(side), pd_action_name(ev->action), ev->rid, ev->record,
             (unsigned long long)ev->req);
        return NULL;
    }
    orec *r = &o->recs[side][ev->record];
    if (ev->action == PD_ACT_ACCEPT) {
        if (r->owner && !r->emitted)
            fail(o, "%s: %s reused record #%u while its request had no terminal event", ev->rid,
                 side_word(side), ev->record);
        uint32_t client = o->next_client;
        memset(r, 0, sizeof(*r));
        r->owner = ev->req;
        r->room = ev->room;
        r->client = client;
        if (client != PD_NONE) {
            oclient *c = client_at(o, client);
            c->slot[side] = ev->record;
            c->owner[side] = ev->req;
        }
        return r;
    }
    if (r->owner != ev->req) {
        fail(o, "%s: %s reported %s for a record it does not have (id %llu)", ev->rid,
             side_word(side), pd_action_name(ev->action), (unsigned long long)ev->req);
        return NULL;
    }
    return r;
}

static const orec *client_rec(const sim_oracle *o, int side, uint32_t client) {
    if (client >= o->n_clients) return NULL;
    const oclient *c = &o->clients[client];
    if (c->slot[side] == PD_NONE) return NULL;
    const orec *r = &o->recs[side][c->slot[side]];
    return r->owner == c->owner[side] ? r : NULL;
}

/* A1: work that must not follow the terminal reason. */
static bool is_work(pd_action a) {
    switch (a) {
    case PD_ACT_ROOM_OPEN: case PD_ACT_LAUNCH: case PD_ACT_SEND_PAGES: case PD_ACT_SEND_FINAL:
    case PD_ACT_PARK: case PD_ACT_REQUEUE: case PD_ACT_COMMIT: case PD_ACT_TOKEN:
        return true;
    default:
        return false;
    }
}

static void judge_insert(sim_oracle *o, int side, orec *r, const pd_action_event *ev) {
    if (r->reason == PD_TERM_NONE) return;
    /* The one insertion after a reason: the success release's own. */
    if (r->reason == PD_TERM_FINISHED && r->released && r->release_insert) return;
    fail(o, "%s: [A1] inserted into the %s prefix cache after its terminal reason (%s)", ev->rid,
         side_word(side), pd_terminal_kind_name(r->reason));
    if (r->client != PD_NONE) client_at(o, r->client)->cached_after_term = true;
}

/* A3: the retire path's steps 3 to 5, in order. */
static void judge_retire(sim_oracle *o, int side, orec *r, const pd_action_event *ev) {
    const char *rid = ev->rid, *sw = side_word(side);
    if (r->reason == PD_TERM_NONE)
        fail(o, "%s: [A3] %s on %s before a terminal reason was recorded", rid,
             pd_action_name(ev->action), sw);
    if (ev->action == PD_ACT_ROOM_ABORT || ev->action == PD_ACT_ROOM_CANCEL) {
        if (r->released)
            fail(o, "%s: [A3] %s on %s after the local release", rid, pd_action_name(ev->action),
                 sw);
        if (ev->action == PD_ACT_ROOM_ABORT && !r->opened)
            fail(o, "%s: [A3] aborted a room on %s it never opened", rid, sw);
        if (ev->action == PD_ACT_ROOM_CANCEL && r->opened)
            fail(o, "%s: [A3] cancelled a room on %s it had opened (the room is the peer's too)",
                 rid, sw);
        r->aborted |= ev->action == PD_ACT_ROOM_ABORT;
        r->cancelled |= ev->action == PD_ACT_ROOM_CANCEL;
        return;
    }
    if (ev->action == PD_ACT_RELEASE) {
        if (r->released) fail(o, "%s: [A3] released twice on %s", rid, sw);
        if (r->in_flight)
            fail(o, "%s: [A3] released on %s while %u forward(s) of it are in flight", rid, sw,
                 r->in_flight);
        if (ev->final && r->reason != PD_TERM_FINISHED)
            fail(o, "%s: [A3] release with insertion on %s for a request that %s", rid, sw,
                 pd_terminal_kind_name(r->reason));
        r->released = true;
        r->release_insert = ev->final;
        return;
    }
    /* PD_ACT_TERMINAL */
    if (!r->released) fail(o, "%s: [A3] terminal event on %s before the local release", rid, sw);
    if (ev->kind != r->reason)
        fail(o, "%s: [O1] terminal event on %s says %s, the recorded reason is %s", rid, sw,
             pd_terminal_kind_name(ev->kind), pd_terminal_kind_name(r->reason));
    r->emitted = true;
}

static void judge_flow(sim_oracle *o, int side, orec *r, const pd_action_event *ev) {
    oclient *c = r->client != PD_NONE ? client_at(o, r->client) : NULL;
    switch (ev->action) {
    case PD_ACT_ROOM_OPEN:
        r->opened = true;
        break;
    case PD_ACT_LAUNCH:
        r->in_flight++;
        if (ev->final && side == 0) r->final_launched = true;
        break;
    case PD_ACT_RESULT:
        if (r->in_flight == 0)
            fail(o, "%s: [A4] a result on %s without a forward in flight", ev->rid,
                 side_word(side));
        else r->in_flight--;
        if (ev->final && side == 0) r->final_done = true;
        break;
    case PD_ACT_REQUEUE:
        if (r->in_flight)
            fail(o, "%s: [A4] requeued on %s while a forward of it is in flight", ev->rid,
                 side_word(side));
        r->final_launched = r->final_done = false;
        break;
    case PD_ACT_SEND_FINAL:
        if (c) c->final_sent = true;
        break;
    case PD_ACT_COMMIT:
        if (c && !c->final_sent)
            fail(o, "%s: [O2] decode committed data the prefill half never sent (its final send "
                    "was not posted)", ev->rid);
        if (c) c->committed = true;
        break;
    default:
        break;
    }
}

/* A5: the room is closed once, when drained, by a request that opened it. */
static void judge_close(sim_oracle *o, int side, orec *r, const pd_action_event *ev) {
    const char *sw = side_word(side);
    if (!r->opened) fail(o, "%s: [A5] closed a room on %s it never opened", ev->rid, sw);
    if (r->closed) fail(o, "%s: [A5] closed its room on %s twice", ev->rid, sw);
    if (!o->drained(o->ctx, side, ev->room))
        fail(o, "%s: [A5] closed its room on %s before the transport reported it drained "
                "(a late write may land in memory already reused)", ev->rid, sw);
    r->closed = true;
}

void oracle_on_action(sim_oracle *o, int side, const pd_action_event *ev) {
    PD_ASSERT(side >= 0 && side < ORACLE_SIDES && ev);
    o->actions++;
    orec *r = record_of(o, side, ev);
    if (!r || ev->action == PD_ACT_ACCEPT) return;
    if (ev->action == PD_ACT_ROOM_CLOSE) {
        judge_close(o, side, r, ev);
        return;
    }
    if (r->emitted) {
        fail(o, "%s: [A2] %s on %s after its terminal event", ev->rid, pd_action_name(ev->action),
             side_word(side));
        return;
    }
    if (is_work(ev->action) && r->reason != PD_TERM_NONE)
        fail(o, "%s: [A1] %s on %s after its terminal reason (%s)", ev->rid,
             pd_action_name(ev->action), side_word(side), pd_terminal_kind_name(r->reason));
    switch (ev->action) {
    case PD_ACT_TERMINAL_REASON:
        if (r->reason != PD_TERM_NONE)
            fail(o, "%s: [A3] a second terminal reason on %s (%s after %s)", ev->rid,
                 side_word(side), pd_terminal_kind_name(ev->kind),
                 pd_terminal_kind_name(r->reason));
        else r->reason = ev->kind;
        return;
    case PD_ACT_INSERT:
        judge_insert(o, side, r, ev);
        return;
    case PD_ACT_ROOM_ABORT: case PD_ACT_ROOM_CANCEL: case PD_ACT_RELEASE: case PD_ACT_TERMINAL:
        judge_retire(o, side, r, ev);
        return;
    default:
        judge_flow(o, side, r, ev);
        return;
    }
}

pd_terminal_kind oracle_reason(const sim_oracle *o, int side, uint32_t client) {
    const orec *r = client_rec(o, side, client);
    return r ? r->reason : PD_TERM_NONE;
}

void oracle_abort_accepted(sim_oracle *o, int side, uint32_t client, const char *rid,
                           pd_terminal_kind before) {
    const orec *r = client_rec(o, side, client);
    if (!r) return;
    pd_terminal_kind want = before != PD_TERM_NONE ? before : PD_TERM_ABORTED;
    if (r->reason != want)
        fail(o, "%s: [O1] %s accepted an abort: the recorded reason is %s, expected %s", rid,
             side_word(side), pd_terminal_kind_name(r->reason), pd_terminal_kind_name(want));
}

void oracle_terminal_seen(sim_oracle *o, int side, uint32_t client, const char *rid,
                          pd_terminal_kind kind) {
    const orec *r = client_rec(o, side, client);
    if (r && r->reason != kind)
        fail(o, "%s: [O1] %s's terminal event says %s, the recorded reason is %s", rid,
             side_word(side),
             pd_terminal_kind_name(kind), pd_terminal_kind_name(r->reason));
}

bool oracle_final_in_flight(const sim_oracle *o, uint32_t client) {
    const orec *r = client_rec(o, 0, client);
    return r && r->final_launched && !r->final_done && r->reason == PD_TERM_NONE;
}

bool oracle_running(const sim_oracle *o, uint32_t client) {
    const orec *r = client_rec(o, 1, client);
    return r && client < o->n_clients && o->clients[client].committed && r->reason == PD_TERM_NONE;
}

bool oracle_cached_after_term(const sim_oracle *o, uint32_t client) {
    return client < o->n_clients && o->clients[client].cached_after_term;
}

uint64_t oracle_actions(const sim_oracle *o) { return o->actions; }

bool oracle_room_of(const sim_oracle *o, int side, uint64_t owner, uint64_t *room) {
    PD_ASSERT(side >= 0 && side < ORACLE_SIDES);
    for (uint32_t i = 0; owner && i < o->records_max; i++)
        if (o->recs[side][i].owner == owner) {
            *room = o->recs[side][i].room;
            return true;
        }
    return false;
}
