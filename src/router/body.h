/*
 * body — the router's judgement of a client's request body, apart from the
 * sockets (so it is fuzzed alone: tests/fuzz/fuzz_router_body.c). The
 * router checks only what it must to route and to keep its promises (the
 * types of the fields it knows, the rid it keys requests by); everything
 * else is the workers' to judge.
 */
#ifndef PD_ROUTER_BODY_H
#define PD_ROUTER_BODY_H

#include <jansson.h>
#include <stddef.h>

typedef enum rt_body_kind {
    RT_BODY_GENERATE,    /* POST /generate */
    RT_BODY_COMPLETIONS, /* POST /v1/completions */
    RT_BODY_CHAT,        /* POST /v1/chat/completions */
    RT_BODY_ABORT,       /* POST /abort_request: {"rid"} or {"abort_all": true} */
} rt_body_kind;

/* Parses and checks body[0, len). 0 when accepted, with the JSON object in
 * *out (the caller's to json_decref); else the HTTP status to refuse with
 * (400) and why, and *out is NULL. */
unsigned rt_body_parse(rt_body_kind what, const char *body, size_t len, json_t **out, char *why,
                       size_t cap);

#endif /* PD_ROUTER_BODY_H */
