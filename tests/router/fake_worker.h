/*
 * A fake prefill or decode node for the router's tests: a libmicrohttpd
 * server on 127.0.0.1 (a free port) that speaks the worker side of
 * docs/http-api.md with programmable behaviour, and records what it got.
 *
 * Behaviour (fw_set, changeable at any time; a request uses the behaviour
 * current when its body arrived):
 *   normal     prefill: answers {"finish_reason": {"type": "transferred"}}
 *              after delay_ms; decode: `tokens` tokens, one per delay_ms,
 *              as one JSON answer or as SSE events then [DONE]
 *   status     answer this error status with the standard error body
 *   hang       never answer, until aborted (then an abort answer) or stopped
 *   close      close the connection without answering
 *   garbage    HTTP 200 with a body (or an event) that is not JSON
 *   deaf       aborts are recorded but do not reach the requests
 *   health     /health answers health_status, or never (health_hang)
 *
 * A live request ends early, with finish_reason abort, when an
 * /abort_request names its rid. Every /generate body, every /abort_request
 * rid ("*" for abort_all) and every /health probe is recorded, whatever the
 * outcome, so a test can ask "did this abort reach this worker".
 */
#ifndef PDSERVE_TEST_FAKE_WORKER_H
#define PDSERVE_TEST_FAKE_WORKER_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct fw_behaviour {
    int generate_status; /* 0 = normal; otherwise this error status */
    int delay_ms;        /* prefill: before answering; decode: per token */
    int tokens;          /* decode: tokens per answer (0 = 4) */
    bool hang;
    bool close;
    bool garbage;
    bool no_done;       /* stream: end after the final event without [DONE] */
    int pad_bytes;      /* decode: each token's text padded with this many 'x' */
    bool deaf;          /* /abort_request is recorded but answered 404, as if the
                              rid were not registered yet */
    bool fail_on_abort; /* prefill: an aborted request answers 500 (a real
                              one does when the abort fails its room) */
    int abort_delay_ms; /* /abort_request: answered after this long (a slow worker) */
    int abort_status;   /* decode: the status_code of an aborted request's final
                              event (0 = 499); 500 is what a real one says when
                              the abort reached the prefill node first and the
                              room failed ("transfer failed") */
    int health_status;  /* 0 = 200 */
    bool health_hang;
} fw_behaviour;

typedef struct fake_worker fake_worker;

/* role: "prefill" or "decode". Asserts on failure (tests only). */
fake_worker *fw_start(const char *role);
void fw_stop(fake_worker *fw);
const char *fw_url(const fake_worker *fw); /* "http://127.0.0.1:PORT" */
uint16_t fw_port(const fake_worker *fw);
void fw_set(fake_worker *fw, const fw_behaviour *b);

size_t fw_generate_count(fake_worker *fw);
/* The i-th /generate (or /v1/completions) body received; new reference. */
json_t *fw_generate_body(fake_worker *fw, size_t i);
bool fw_got_generate(fake_worker *fw, const char *rid);
size_t fw_abort_count(fake_worker *fw);
bool fw_got_abort(fake_worker *fw, const char *rid);
/* The decode side finished this rid normally (finish_reason length). */
bool fw_got_completed(fake_worker *fw, const char *rid);
size_t fw_health_count(fake_worker *fw);
/* The most /abort_request calls it was answering at one time. */
size_t fw_abort_peak(fake_worker *fw);
size_t fw_connection_count(fake_worker *fw); /* TCP connections it accepted */
size_t fw_live_count(fake_worker *fw);

/* Poll helpers with a deadline; true when the condition held in time. */
bool fw_wait_generate_count(fake_worker *fw, size_t n, int timeout_ms);
bool fw_wait_got_generate(fake_worker *fw, const char *rid, int timeout_ms);
bool fw_wait_got_abort(fake_worker *fw, const char *rid, int timeout_ms);
bool fw_wait_health_count(fake_worker *fw, size_t n, int timeout_ms);
bool fw_wait_live_count(fake_worker *fw, size_t n, int timeout_ms);

/* A raw TCP server for what libmicrohttpd cannot do: `reply` bytes sent to
 * every connection then closed (garbage), or, with reply NULL, connections
 * accepted and held without a byte (a worker that hangs before HTTP). */
typedef struct raw_server raw_server;
raw_server *raw_start(const char *reply);
void raw_stop(raw_server *rs);
const char *raw_url(const raw_server *rs);

/* A port on 127.0.0.1 where nothing listens (connection refused). */
uint16_t free_port(void);

#endif
