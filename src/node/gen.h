/*
 * gen.h — a generation request between the HTTP side's parser and its
 * answer, apart from sockets and threads (so each half is tested and fuzzed
 * alone):
 *
 *   params.c  the body of POST /generate, /v1/completions or
 *             /v1/chat/completions into gen_params: prompts (one, or a
 *             batch), n choices each, sampling, stop strings, logprobs,
 *             echo, the bootstrap fields. Every refusal is an HTTP status
 *             and a message naming the field.
 *   choice.c  one choice's output as text: token by token, with an
 *             incomplete UTF-8 character held back, stop strings matched
 *             across token boundaries (the text is cut before the match,
 *             never shown), and what a stream may show yet (a tail that
 *             could still become a stop string is held back). Also the
 *             logprobs of each API's shape.
 *
 * A request with P prompts and n choices becomes P * n engine requests
 * (calls), choice i = prompt (i / n), copy (i % n), as OpenAI numbers them.
 * Call i has rid "<rid>" for i = 0 and "<rid>#<i>" after, and room
 * "<room> + i", so both halves of a disaggregated pair agree without the
 * router knowing about choices (docs/http-api.md).
 */
#ifndef PDSERVE_NODE_GEN_H
#define PDSERVE_NODE_GEN_H

#include <jansson.h>

#include "node_internal.h"

#define GEN_CHOICES_MAX 64u    /* prompts * n */
#define GEN_STOPS_MAX 16u      /* stop strings */
#define GEN_STOP_BYTES_MAX 256 /* bytes of one stop string */

typedef enum gen_api { GEN_API_GENERATE, GEN_API_COMPLETIONS, GEN_API_CHAT } gen_api;

typedef struct gen_prompt {
    int32_t *ids;
    uint32_t len;
} gen_prompt;

typedef struct gen_params {
    const pd_node *node; /* its tokenizer (NULL: the byte tokenizer) */
    gen_api api;
    gen_prompt *prompts; /* n_prompts, each malloc'd */
    uint32_t n_prompts;
    bool batch;     /* the prompt was a list: /generate answers a list */
    bool templated; /* the prompt is the model chat template's output */
    uint32_t n;     /* choices per prompt */
    uint32_t max_new;
    pd_sampling sampling; /* seed: see gen_seed */
    bool seeded;          /* the client gave a seed */
    uint64_t seed;
    int32_t stop[PD_STOP_TOKENS_MAX];
    uint32_t n_stop;
    char *stops[GEN_STOPS_MAX]; /* stop strings, malloc'd, non-empty */
    uint32_t n_stops;
    size_t stop_longest;
    bool logprobs;         /* return each token's logprob (top: sampling.top_logprobs) */
    bool text_in_logprobs; /* /generate: the token's text beside its id */
    bool echo;             /* /v1/completions: the prompt before the answer */
    bool ignore_eos, stream, include_usage;
    char rid[PD_RID_MAX];
    char peer[PD_PEER_MAX];
    uint64_t room;
} gen_params;

/* The body (root, a parsed JSON value) into p: 0 on success, else the HTTP
 * status with the message in err. A chat body is rendered into its prompt
 * first (root is changed). gen_params_free(p) either way. */
int gen_params_parse(pd_node *n, json_t *root, gen_api api, gen_params *p, char *err, size_t cap);
void gen_params_free(gen_params *p);

/* How many calls: prompts * n. */
static inline uint32_t gen_choices(const gen_params *p) { return p->n_prompts * p->n; }

/* Call i's rid and room (see the top). */
void gen_rid(const char *base, uint32_t i, char *out, size_t cap);
uint64_t gen_room(const gen_params *p, uint32_t i);
/* Call i's sampling seed: from the client's seed, or from the room and the
 * prompt, and the choice's index; the same on every node and placement. */
uint64_t gen_seed(const gen_params *p, uint32_t i);

/* A rid the engine takes: 1 to PD_RID_MAX - 1 bytes (base.h), no NUL. A
 * longer one is refused, never cut: cut, it would name another request. */
bool gen_rid_acceptable(json_t *v);
#define GEN_RID_RULE "'rid' must have 1 to %d bytes, without NUL"

/* A refused body that still names a room: cancels the rooms of all its
 * choices, so the other node's halves do not wait for them. */
void gen_cancel_refused(pd_node *n, json_t *root);

/* ---- one choice's output (choice.c) ------------------------------------------------ */

typedef struct gen_choice {
    call *c;
    uint32_t index; /* OpenAI's choice index */
    uint32_t fed;   /* tokens turned into text */
    uint32_t kept;  /* tokens that count: all fed, or up to the one completing a stop */
    char carry[4];  /* an incomplete UTF-8 character held for the next token */
    size_t carry_len;
    char *text; /* echo + answer so far (cut at a matched stop string) */
    size_t len, cap;
    size_t base;          /* bytes of echoed prompt at the start of text */
    uint32_t *offset;     /* logprobs: where token i's text starts in text */
    size_t sent;          /* bytes of text already sent (streams) */
    uint32_t sent_tokens; /* tokens already sent (ids, logprobs) */
    int stopped;          /* the stop string matched + 1; 0: none */
    bool flushed;         /* the call is done and every token is text */
    bool began;           /* its first event or answer is made (chat's role goes in it) */
    bool final_sent;      /* streams: this choice's last event is out */
} gen_choice;

/* Starts c's choice; the echoed prompt (if p->echo) begins its text. False
 * when out of memory. */
bool gen_choice_init(gen_choice *ch, call *c, uint32_t index, const gen_params *p);
void gen_choice_free(gen_choice *ch);
/* Turns the call's new tokens into text (under the call's mutex the caller
 * read have and done: tokens below have are final). Returns false when out
 * of memory. */
bool gen_choice_feed(gen_choice *ch, const gen_params *p, uint32_t have, bool done);
/* The end of the text a stream may send now: everything once stopped or
 * flushed, else all but a tail that could still grow into a stop string. */
size_t gen_choice_showable(const gen_choice *ch, const gen_params *p);
/* Whether the choice has ended (its call is done and flushed). */
static inline bool gen_choice_done(const gen_choice *ch) { return ch->flushed; }
/* "stop", "length", "abort", "transferred" */
const char *gen_choice_finish(const gen_choice *ch);

/* The logprobs of tokens [from, to) in the API's shape: OpenAI
 * completions' {tokens, token_logprobs, top_logprobs, text_offset}, chat's
 * {content: [...]}, or /generate's meta_info fields (set into meta). NULL
 * when the request did not ask for them. */
json_t *gen_logprobs_openai(const gen_choice *ch, const gen_params *p, uint32_t from, uint32_t to);
void gen_logprobs_generate(const gen_choice *ch, const gen_params *p, uint32_t from, uint32_t to,
                           json_t *meta);

#endif
