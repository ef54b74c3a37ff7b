/*
 * The client of `pdserve bench`: one thread driving libcurl's multi
 * interface. Each loop turn it starts the requests whose time has come (and
 * the concurrency limit allows), fires the aborts that are due, samples the
 * nodes, and reads what arrived; every server-sent event is timed as it is
 * read. libcurl keeps a pool of connections, so closed-loop runs reuse
 * them; an abort by "close" removes the request's transfer, which closes
 * its connection mid-answer, exactly what a client that gives up does.
 *
 * Outcomes (pd_lg_outcome): completed when the answer ended normally;
 * aborted when it ended with finish_reason "abort" and status 499, or when
 * the bench closed it; refused when the server said no before any token
 * (4xx, 503); failed otherwise (transport errors, 5xx, an abort with 500 or
 * 504, a stream that stopped without a final event).
 */
#include <curl/curl.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "loadgen_internal.h"
#include "pdserve/progress.h"

void pd_lg_run_config_default(pd_lg_run_config *c) {
    *c = (pd_lg_run_config){
        .base_url = "http://127.0.0.1:30000",
        .api = PD_LG_API_GENERATE,
        .stream = true,
        .ignore_eos = true,
        .request_timeout_s = 600,
        .timeline_interval_s = 0.25,
        .sample_interval_s = 0.25,
        .idle_timeout_s = 30,
        .seed = 1,
    };
}

const char *pd_lg_api_endpoint(pd_lg_api api) {
    return api == PD_LG_API_COMPLETIONS ? "/v1/completions"
        : api == PD_LG_API_CHAT         ? "/v1/chat/completions"
                                        : "/generate";
}

const char *pd_lg_outcome_name(pd_lg_outcome o) {
    static const char *const n[] = {"not_sent", "completed", "aborted", "failed", "refused"};
    return o <= PD_LG_REFUSED ? n[o] : "?";
}

double lg_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ---- growing buffers ----------------------------------------------------------------- */

bool lg_buf_add(lg_buf *b, const char *p, size_t n) {
    if (n > LG_BODY_MAX - b->len) return false;
    if (b->len + n + 1 > b->cap) {
        size_t c = b->cap ? b->cap : 4096;
        while (c < b->len + n + 1) c *= 2;
        char *q = realloc(b->p, c);
        PD_ASSERT(q);
        b->p = q;
        b->cap = c;
    }
    memcpy(b->p + b->len, p, n);
    b->len += n;
    b->p[b->len] = '\0';
    return true;
}

void lg_buf_free(lg_buf *b) {
    free(b->p);
    *b = (lg_buf){0};
}

/* ---- one request's answer ------------------------------------------------------------ */

static void live_token_event(lg_run *run, lg_live *lv, uint32_t new_tokens, double now) {
    if (new_tokens == 0) return;
    pd_lg_result *res = &run->out->r[lv->req];
    if (res->ttft_s < 0) {
        res->ttft_s = now - lv->t_send;
    } else {
        if (res->n_itl == lv->cap_itl) {
            lv->cap_itl = lv->cap_itl ? lv->cap_itl * 2 : 64;
            res->itl = realloc(res->itl, lv->cap_itl * sizeof(double));
            PD_ASSERT(res->itl);
        }
        res->itl[res->n_itl++] = now - lv->t_last;
    }
    lv->t_last = now;
    lv->tokens += new_tokens;
    if (!run->d->reqs[lv->req].warmup) lg_timeline_tokens(run, now, new_tokens);
}

/* The final fields of an answer or event: finish reason, counts. */
static void take_meta(lg_live *lv, json_t *meta) {
    json_t *fr = json_object_get(meta, "finish_reason");
    if (json_is_object(fr)) {
        const char *type = json_string_value(json_object_get(fr, "type"));
        snprintf(lv->finish, sizeof(lv->finish), "%s", type ? type : "?");
        json_t *sc = json_object_get(fr, "status_code");
        if (json_is_integer(sc)) lv->abort_status = (int)json_integer_value(sc);
        const char *msg = json_string_value(json_object_get(fr, "message"));
        if (msg) snprintf(lv->message, sizeof(lv->message), "%s", msg);
    } else if (json_is_string(fr)) {
        snprintf(lv->finish, sizeof(lv->finish), "%s", json_string_value(fr));
    }
    json_t *v;
    if (json_is_integer(v = json_object_get(meta, "prompt_tokens")))
        lv->prompt_tokens = (uint32_t)json_integer_value(v);
    if (json_is_integer(v = json_object_get(meta, "cached_tokens")))
        lv->cached = (uint32_t)json_integer_value(v);
    json_t *det = json_object_get(meta, "prompt_tokens_details");
    if (json_is_integer(v = json_object_get(det, "cached_tokens")))
        lv->cached = (uint32_t)json_integer_value(v);
}

/* One /generate answer object (an event, or the whole non-streamed body):
 * returns how many tokens it adds. */
static uint32_t generate_object(lg_live *lv, json_t *o) {
    json_t *meta = json_object_get(o, "meta_info");
    take_meta(lv, meta);
    json_t *ct = json_object_get(meta, "completion_tokens");
    uint32_t total = json_is_integer(ct)
        ? (uint32_t)json_integer_value(ct)
        : (uint32_t)json_array_size(json_object_get(o, "output_ids"));
    if (total > lv->seen_tokens) {
        uint32_t n = total - lv->seen_tokens;
        lv->seen_tokens = total;
        return n;
    }
    return 0;
}

/* One OpenAI object: a chunk of a stream or a whole answer. Chunks carry
 * text, not counts: a chunk with text is one token event of one token
 * until the usage says the total. */
static uint32_t openai_object(lg_live *lv, json_t *o) {
    json_t *ch = json_array_get(json_object_get(o, "choices"), 0);
    json_t *usage = json_object_get(o, "usage");
    if (json_is_object(usage)) {
        take_meta(lv, usage);
        json_t *ct = json_object_get(usage, "completion_tokens");
        if (json_is_integer(ct)) lv->usage_tokens = (uint32_t)json_integer_value(ct);
    }
    if (!ch) return 0;
    json_t *fr = json_object_get(ch, "finish_reason");
    if (json_is_string(fr)) snprintf(lv->finish, sizeof(lv->finish), "%s", json_string_value(fr));
    const char *text = json_string_value(json_object_get(ch, "text"));
    if (!text) text = json_string_value(json_object_get(json_object_get(ch, "delta"), "content"));
    if (!text) text = json_string_value(json_object_get(json_object_get(ch, "message"), "content"));
    return text && *text ? 1 : 0;
}

static void error_object(lg_live *lv, json_t *o) {
    json_t *e = json_object_get(o, "error");
    const char *msg = json_string_value(json_object_get(e, "message"));
    if (!msg) msg = json_string_value(e);
    if (!msg) msg = json_string_value(json_object_get(o, "message"));
    snprintf(lv->message, sizeof(lv->message), "%s", msg ? msg : "error event");
    lv->error_event = true;
}

/* Handles one answer object, timing it at now. */
/* One answer object: the tokens it adds. */
static uint32_t answer_object(lg_run *run, lg_live *lv, json_t *o) {
    if (json_object_get(o, "error")) {
        error_object(lv, o);
        return 0;
    }
    return run->c->api == PD_LG_API_GENERATE ? generate_object(lv, o) : openai_object(lv, o);
}

/* Consumes the complete events ("data: ...\n\n") in the stream buffer.
 * Events that came in one read are one token event: their tokens arrived
 * together, and timing them apart would count gaps of a microsecond. */
static void stream_events(lg_run *run, lg_live *lv, double now) {
    size_t used = 0;
    uint32_t tokens = 0;
    for (;;) {
        char *start = lv->body.p + used;
        /* an event's end is looked for only in bytes not searched before */
        size_t from = PD_MAX(used, lv->searched > 0 ? lv->searched - 1 : 0);
        char *end = strstr(lv->body.p + from, "\n\n");
        if (!end) {
            lv->searched = lv->body.len - used;
            break;
        }
        *end = '\0';
        used = (size_t)(end - lv->body.p) + 2;
        for (char *line = start; line && *line;) {
            char *nl = strchr(line, '\n');
            if (nl) *nl = '\0';
            if (!strncmp(line, "data:", 5)) {
                const char *data = line + 5 + (line[5] == ' ');
                if (!strcmp(data, "[DONE]")) {
                    lv->done_marker = true;
                } else {
                    json_t *o = json_loads(data, 0, NULL);
                    if (o) tokens += answer_object(run, lv, o);
                    json_decref(o);
                }
            }
            line = nl ? nl + 1 : NULL;
        }
    }
    if (used) {
        memmove(lv->body.p, lv->body.p + used, lv->body.len - used + 1);
        lv->body.len -= used;
    }
    live_token_event(run, lv, tokens, now);
}

static size_t on_answer_bytes(char *p, size_t size, size_t n, void *user) {
    lg_live *lv = user;
    size_t bytes = size * n;
    if (!lg_buf_add(&lv->body, p, bytes)) {
        lv->too_big = true;
        return 0; /* the transfer fails: CURLE_WRITE_ERROR */
    }
    long status = 0;
    curl_easy_getinfo(lv->h, CURLINFO_RESPONSE_CODE, &status);
    if (lv->run->c->stream && status == 200) stream_events(lv->run, lv, lg_now());
    return bytes;
}

/* ---- request bodies ------------------------------------------------------------------ */

static json_t *prompt_ids(const pd_lg_request *r) {
    json_t *a = json_array();
    for (uint32_t i = 0; i < r->n_ids; i++) json_array_append_new(a, json_integer(r->ids[i]));
    return a;
}

static json_t *chat_messages(const pd_lg_request *r) {
    static const char *const roles[] = {"system", "user", "assistant"};
    json_t *a = json_array();
    for (uint32_t k = 0; k < r->n_seg; k++) {
        const pd_lg_segment *s = &r->seg[k];
        json_array_append_new(a,
                              json_pack("{s:s,s:s%}", "role", roles[s->role], "content",
                                        r->text + s->off, (size_t)s->len));
    }
    return a;
}

/* extra's keys replace the body's, but for sampling_params, merged. */
static void merge_extra(json_t *body, json_t *extra) {
    const char *k;
    json_t *v;
    json_object_foreach(extra, k, v) {
        json_t *have = json_object_get(body, k);
        if (json_is_object(have) && json_is_object(v)) json_object_update(have, v);
        else json_object_set(body, k, v);
    }
}

static char *request_body(const lg_run *run, const pd_lg_request *r, const char *rid) {
    const pd_lg_run_config *c = run->c;
    json_t *b;
    json_t *prompt = r->ids ? prompt_ids(r) : json_string(r->text);
    if (c->api == PD_LG_API_GENERATE) {
        b = json_pack("{s:o,s:{s:i,s:f,s:b},s:b,s:s}", r->ids ? "input_ids" : "text", prompt,
                      "sampling_params", "max_new_tokens", (json_int_t)r->output_len, "temperature",
                      0.0, "ignore_eos", c->ignore_eos, "stream", c->stream, "rid", rid);
    } else {
        if (c->api == PD_LG_API_CHAT) {
            json_decref(prompt);
            prompt = chat_messages(r);
        }
        b = json_pack("{s:o,s:i,s:f,s:b,s:b,s:s}", c->api == PD_LG_API_CHAT ? "messages" : "prompt",
                      prompt, "max_tokens", (json_int_t)r->output_len, "temperature", 0.0,
                      "ignore_eos", c->ignore_eos, "stream", c->stream, "rid", rid);
        if (c->stream)
            json_object_set_new(b, "stream_options", json_pack("{s:b}", "include_usage", 1));
        if (c->model) json_object_set_new(b, "model", json_string(c->model));
    }
    if (run->extra) merge_extra(b, run->extra);
    char *s = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    PD_ASSERT(s);
    return s;
}

static void rid_of(const lg_run *run, uint32_t i, char *out, size_t cap) {
    snprintf(out, cap, "bench-%s-%u", run->tag, i);
}

/* ---- transfers ----------------------------------------------------------------------- */

static size_t to_buf(char *p, size_t size, size_t n, void *user) {
    return lg_buf_add(user, p, size * n) ? size * n : 0;
}

struct curl_slist *lg_headers(const pd_lg_run_config *c) {
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    h = curl_slist_append(h, "Expect:");
    if (c->api_key) {
        char auth[600];
        snprintf(auth, sizeof(auth), "Authorization: Bearer %.500s", c->api_key);
        h = curl_slist_append(h, auth);
    }
    PD_ASSERT(h);
    return h;
}

CURL *lg_easy(lg_run *run, const char *url, lg_buf *sink) {
    return lg_easy_with(run->hdrs, url, sink);
}

CURL *lg_easy_with(struct curl_slist *hdrs, const char *url, lg_buf *sink) {
    CURL *h = curl_easy_init();
    PD_ASSERT(h);
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, hdrs);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, 10000L);
    if (sink) {
        curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, to_buf);
        curl_easy_setopt(h, CURLOPT_WRITEDATA, sink);
    }
    return h;
}

static void live_add(lg_run *run, lg_live *lv) {
    if (run->n_live == run->cap_live) {
        run->cap_live = run->cap_live ? run->cap_live * 2 : 64;
        run->live = realloc(run->live, run->cap_live * sizeof(lg_live *));
        PD_ASSERT(run->live);
    }
    run->live[run->n_live++] = lv;
}

static void live_remove(lg_run *run, lg_live *lv) {
    for (uint32_t i = 0; i < run->n_live; i++)
        if (run->live[i] == lv) {
            run->live[i] = run->live[--run->n_live];
            return;
        }
}

static void request_start(lg_run *run, uint32_t i, double now) {
    const pd_lg_request *r = &run->d->reqs[i];
    lg_live *lv = calloc(1, sizeof(*lv));
    PD_ASSERT(lv);
    char rid[64];
    rid_of(run, i, rid, sizeof(rid));
    *lv = (lg_live){.kind = LG_REQUEST, .run = run, .req = i, .t_send = now};
    lv->send = request_body(run, r, rid);
    lv->h = lg_easy(run, run->url, NULL);
    curl_easy_setopt(lv->h, CURLOPT_WRITEFUNCTION, on_answer_bytes);
    curl_easy_setopt(lv->h, CURLOPT_WRITEDATA, lv);
    curl_easy_setopt(lv->h, CURLOPT_POSTFIELDS, lv->send);
    curl_easy_setopt(lv->h, CURLOPT_PRIVATE, lv);
    curl_easy_setopt(lv->h, CURLOPT_TIMEOUT_MS, (long)(run->c->request_timeout_s * 1000));
    if (r->abort != PD_LG_ABORT_NONE) lv->abort_at = now + r->abort_after_s;
    pd_lg_result *res = &run->out->r[i];
    res->start_s = now - run->t0;
    res->ttft_s = -1;
    res->abort_at_s = -1;
    res->prompt_tokens = r->input_len;
    live_add(run, lv);
    PD_ASSERT(curl_multi_add_handle(run->m, lv->h) == CURLM_OK);
}

static void side_start(lg_run *run, lg_kind kind, const char *url, const char *body, int node) {
    lg_side *s = calloc(1, sizeof(*s));
    PD_ASSERT(s);
    *s = (lg_side){.kind = kind, .run = run, .node = node};
    s->h = lg_easy(run, url, &s->body);
    curl_easy_setopt(s->h, CURLOPT_PRIVATE, s);
    curl_easy_setopt(s->h, CURLOPT_TIMEOUT_MS, 10000L);
    if (body) {
        s->send = strdup(body);
        PD_ASSERT(s->send);
        curl_easy_setopt(s->h, CURLOPT_POSTFIELDS, s->send);
    }
    PD_ASSERT(curl_multi_add_handle(run->m, s->h) == CURLM_OK);
    run->n_sides++;
}

void lg_side_sample(lg_run *run, const char *url, int node) {
    side_start(run, LG_SAMPLE, url, NULL, node);
}

static void record_abort(lg_run *run, double now, pd_lg_abort kind, int32_t req) {
    pd_lg_results *o = run->out;
    if (o->n_aborts == o->cap_aborts) {
        o->cap_aborts = o->cap_aborts ? o->cap_aborts * 2 : 64;
        o->aborts = realloc(o->aborts, o->cap_aborts * sizeof(*o->aborts));
        PD_ASSERT(o->aborts);
    }
    o->aborts[o->n_aborts++] = (pd_lg_abort_event){.t_s = now - run->t0, .kind = kind, .req = req};
}

/* ---- ending a request ---------------------------------------------------------------- */

/* The message of an error answer: its error.message, message, or the body. */
static void error_message(const lg_buf *b, char *out, size_t cap) {
    json_t *o = b->p ? json_loads(b->p, 0, NULL) : NULL;
    json_t *e = json_object_get(o, "error");
    const char *msg = json_string_value(json_object_get(e, "message"));
    if (!msg) msg = json_string_value(e);
    if (!msg) msg = json_string_value(json_object_get(o, "message"));
    if (!msg) msg = json_string_value(json_object_get(o, "detail"));
    snprintf(out, cap, "%.120s", msg ? msg : b->p ? b->p : "");
    json_decref(o);
}

static void whole_answer(lg_run *run, lg_live *lv, double now) {
    json_t *o = lv->body.p ? json_loads(lv->body.p, 0, NULL) : NULL;
    if (json_is_array(o)) { /* a /generate batch answer: this bench sends one prompt */
        json_t *first = json_incref(json_array_get(o, 0));
        json_decref(o);
        o = first;
    }
    if (o) live_token_event(run, lv, answer_object(run, lv, o), now);
    json_decref(o);
}

static pd_lg_outcome classify(lg_live *lv, CURLcode rc, long status, bool closed, char *err,
                              size_t cap) {
    if (closed) return snprintf(err, cap, "closed by the bench"), PD_LG_ABORTED;
    if (lv->too_big) {
        snprintf(err, cap, "the answer passed %zu MiB without an end", LG_BODY_MAX >> 20);
        return PD_LG_FAILED;
    }
    if (rc != CURLE_OK) {
        snprintf(err, cap, "%s", curl_easy_strerror(rc));
        return PD_LG_FAILED;
    }
    if (status == 200) {
        if (lv->error_event) return snprintf(err, cap, "%s", lv->message), PD_LG_FAILED;
        if (!strcmp(lv->finish, "abort")) {
            snprintf(err, cap, "%s", lv->message);
            if (lv->abort_status == 0 || lv->abort_status == 499) return PD_LG_ABORTED;
            snprintf(err, cap, "aborted with status %d: %.120s", lv->abort_status, lv->message);
            return PD_LG_FAILED;
        }
        if (!lv->finish[0])
            return snprintf(err, cap, "the answer ended without a finish reason"), PD_LG_FAILED;
        return PD_LG_COMPLETED;
    }
    char msg[128];
    error_message(&lv->body, msg, sizeof(msg));
    snprintf(err, cap, "HTTP %ld: %s", status, msg);
    if (status == 499) return PD_LG_ABORTED;
    if ((status >= 400 && status < 500) || status == 503) return PD_LG_REFUSED;
    return PD_LG_FAILED;
}

static void recent_ttft(lg_run *run, double ttft) {
    run->recent_ttft[run->n_recent++ % PD_ARRAY_LEN(run->recent_ttft)] = ttft;
}

/* Schedules a conversation's next turn of the same phase. */
static void next_turn(lg_run *run, uint32_t i, double now) {
    int32_t s = run->succ[i];
    if (s < 0 || (uint32_t)s >= run->last) return;
    run->ready[run->n_ready] = (uint32_t)s;
    run->ready_at[run->n_ready++] = now + run->d->reqs[s].arrival_s;
}

static void request_end(lg_run *run, lg_live *lv, CURLcode rc, double now, bool closed) {
    pd_lg_result *res = &run->out->r[lv->req];
    long status = 0;
    curl_easy_getinfo(lv->h, CURLINFO_RESPONSE_CODE, &status);
    res->status = (int)status;
    if (!closed && rc == CURLE_OK && status == 200) {
        if (run->c->stream) stream_events(run, lv, now);
        else whole_answer(run, lv, now);
    }
    res->end_s = now - run->t0;
    res->output_tokens = lv->usage_tokens ? lv->usage_tokens : PD_MAX(lv->seen_tokens, lv->tokens);
    res->cached_tokens = lv->cached;
    if (lv->prompt_tokens) res->prompt_tokens = lv->prompt_tokens;
    res->outcome = classify(lv, rc, status, closed, res->error, sizeof(res->error));
    if (res->outcome == PD_LG_COMPLETED) res->error[0] = '\0';
    bool measured = !run->d->reqs[lv->req].warmup;
    if (measured) {
        lg_timeline_tokens(run, now, 0);
        pd_lg_results *o = run->out;
        o->done[(uint32_t)((now - run->t0) / run->c->timeline_interval_s)]++;
        run->ended++;
        if (res->outcome == PD_LG_FAILED || res->outcome == PD_LG_REFUSED) run->errors++;
        if (res->ttft_s >= 0 && res->outcome == PD_LG_COMPLETED) recent_ttft(run, res->ttft_s);
    }
    next_turn(run, lv->req, now);
    live_remove(run, lv);
    curl_multi_remove_handle(run->m, lv->h);
    curl_easy_cleanup(lv->h);
    free(lv->send);
    lg_buf_free(&lv->body);
    free(lv);
}

/* ---- aborts -------------------------------------------------------------------------- */

static void fire_aborts(lg_run *run, double now) {
    for (uint32_t k = run->n_live; k-- > 0;) {
        lg_live *lv = run->live[k];
        if (lv->abort_at <= 0 || lv->abort_sent || now < lv->abort_at) continue;
        pd_lg_abort mode = run->d->reqs[lv->req].abort;
        run->out->r[lv->req].abort_at_s = now - run->t0;
        record_abort(run, now, mode, (int32_t)lv->req);
        lv->abort_sent = true;
        if (mode == PD_LG_ABORT_CLOSE) {
            request_end(run, lv, CURLE_OK, now, true);
        } else {
            char rid[64], body[128];
            rid_of(run, lv->req, rid, sizeof(rid));
            snprintf(body, sizeof(body), "{\"rid\":\"%s\"}", rid);
            side_start(run, LG_ABORT, run->abort_url, body, -1);
        }
    }
    if (run->c->abort_all_every_s > 0 && now >= run->next_abort_all) {
        run->next_abort_all = now + run->c->abort_all_every_s;
        record_abort(run, now, PD_LG_ABORT_NONE, -1);
        side_start(run, LG_ABORT_ALL, run->abort_url, "{\"abort_all\":true}", -1);
    }
}

/* ---- sending ------------------------------------------------------------------------- */

static bool more_to_send(const lg_run *run) {
    return !run->stop_sending && (run->next < run->last || run->n_ready > 0);
}

static bool independent(const lg_run *run, uint32_t i) {
    int32_t p = run->d->reqs[i].prev;
    return p < 0 || (uint32_t)p < run->first;
}

static void send_due(lg_run *run, double now) {
    uint32_t cap = run->c->max_concurrency ? run->c->max_concurrency : UINT32_MAX;
    for (uint32_t k = 0; k < run->n_ready && run->n_live < cap;) {
        if (run->ready_at[k] > now) {
            k++;
            continue;
        }
        uint32_t i = run->ready[k];
        run->ready[k] = run->ready[--run->n_ready];
        run->ready_at[k] = run->ready_at[run->n_ready];
        request_start(run, i, now);
    }
    while (run->next < run->last && run->n_live < cap) {
        if (!independent(run, run->next)) {
            run->next++;
            continue;
        }
        if (run->t0 + run->d->reqs[run->next].arrival_s > now) break;
        request_start(run, run->next++, now);
    }
    while (run->next < run->last && !independent(run, run->next)) run->next++;
}

static void side_end(lg_run *run, lg_side *s, CURLcode rc, double now) {
    if (s->kind == LG_SAMPLE) lg_sample_done(run, s, rc, now);
    run->n_sides--;
    curl_multi_remove_handle(run->m, s->h);
    curl_easy_cleanup(s->h);
    free(s->send);
    lg_buf_free(&s->body);
    free(s);
}

static void drain_done(lg_run *run, double now) {
    CURLMsg *msg;
    int left;
    while ((msg = curl_multi_info_read(run->m, &left))) {
        if (msg->msg != CURLMSG_DONE) continue;
        void *p = NULL;
        curl_easy_getinfo(msg->easy_handle, CURLINFO_PRIVATE, &p);
        CURLcode rc = msg->data.result;
        if (*(lg_kind *)p == LG_REQUEST) request_end(run, p, rc, now, false);
        else side_end(run, p, rc, now);
    }
}

/* ---- the timeline -------------------------------------------------------------------- */

static void timeline_reserve(pd_lg_results *o, uint32_t k) {
    if (k < o->cap_intervals) {
        if (k >= o->n_intervals) o->n_intervals = k + 1;
        return;
    }
    uint32_t c = o->cap_intervals ? o->cap_intervals : 256;
    while (c <= k) c *= 2;
    uint32_t **arrs[] = {&o->done, &o->tokens, &o->inflight};
    for (size_t a = 0; a < PD_ARRAY_LEN(arrs); a++) {
        uint32_t *q = realloc(*arrs[a], c * sizeof(uint32_t));
        PD_ASSERT(q);
        memset(q + o->cap_intervals, 0, (c - o->cap_intervals) * sizeof(uint32_t));
        *arrs[a] = q;
    }
    o->cap_intervals = c;
    o->n_intervals = k + 1;
}

void lg_timeline_tokens(lg_run *run, double now, uint32_t n) {
    double at = now - run->t0;
    uint32_t k = at > 0 ? (uint32_t)(at / run->c->timeline_interval_s) : 0;
    timeline_reserve(run->out, k);
    run->out->tokens[k] += n;
}

void lg_timeline_advance(lg_run *run, double now) {
    double iv = run->c->timeline_interval_s;
    while (run->t0 + (run->tl_filled + 1) * iv <= now) {
        timeline_reserve(run->out, run->tl_filled);
        run->out->inflight[run->tl_filled++] = run->n_live;
    }
}

/* ---- the loop ------------------------------------------------------------------------ */

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void progress_tick(lg_run *run, bool final) {
    if (!run->c->progress_to) return;
    if (!final && !pd_progress_due(&run->progress)) return;
    char extra[PD_PROGRESS_EXTRA_MAX];
    uint32_t n = PD_MIN(run->n_recent, (uint32_t)PD_ARRAY_LEN(run->recent_ttft));
    if (n) {
        double v[PD_ARRAY_LEN(run->recent_ttft)];
        memcpy(v, run->recent_ttft, n * sizeof(double));
        qsort(v, n, sizeof(double), cmp_double);
        snprintf(extra, sizeof(extra), "in flight %u, p50 TTFT %.1f ms, errors %u", run->n_live,
                 v[n / 2] * 1e3, run->errors);
    } else {
        snprintf(extra, sizeof(extra), "in flight %u, errors %u", run->n_live, run->errors);
    }
    if (final) pd_progress_finish(&run->progress, run->ended, extra);
    else pd_progress_update(&run->progress, run->ended, extra);
}

static void measured_turn(lg_run *run, double now) {
    if (!run->stop_sending && run->c->duration_s > 0 && now - run->t0 >= run->c->duration_s)
        run->stop_sending = true;
    if (run->c->n_nodes && now >= run->next_sample) {
        run->next_sample = now + run->c->sample_interval_s;
        lg_sample_start(run, now);
    }
    lg_timeline_advance(run, now);
    progress_tick(run, false);
}

/* Sends the dataset's requests [first, last) and waits for them all. */
static void phase(lg_run *run, uint32_t first, uint32_t last, bool measured) {
    run->first = run->next = first;
    run->last = last;
    run->n_ready = 0;
    run->stop_sending = false;
    for (;;) {
        double now = lg_now();
        if (measured) measured_turn(run, now);
        fire_aborts(run, now);
        send_due(run, now);
        int running = 0;
        curl_multi_perform(run->m, &running);
        drain_done(run, lg_now());
        if (run->n_live == 0 && !more_to_send(run) && (!measured || run->n_sides == 0)) break;
        curl_multi_poll(run->m, NULL, 0, 5, NULL);
    }
}

/* ---- the run ------------------------------------------------------------------------- */

static pd_err run_setup(lg_run *run, const pd_lg_run_config *c, const pd_lg_dataset *d,
                        pd_lg_results *out, char *err, size_t cap) {
    *run = (lg_run){.c = c, .d = d, .out = out};
    const char *ep = c->endpoint ? c->endpoint : pd_lg_api_endpoint(c->api);
    if ((size_t)snprintf(run->url, sizeof(run->url), "%s%s", c->base_url, ep) >= sizeof(run->url))
        return pd_errorf(err, cap, PD_ERR_INVALID, "the URL is too long");
    snprintf(run->abort_url, sizeof(run->abort_url), "%s/abort_request", c->base_url);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    snprintf(run->tag, sizeof(run->tag), "%llx-%x", (unsigned long long)c->seed,
             (unsigned)(pd_hash_u64((uint64_t)ts.tv_nsec ^ (uint64_t)ts.tv_sec << 20) & 0xffffff));
    run->hdrs = lg_headers(c);
    run->extra = c->extra_body ? json_loads(c->extra_body, 0, NULL) : NULL;
    if (c->extra_body && !json_is_object(run->extra))
        return pd_errorf(err, cap, PD_ERR_PARSE, "the extra request body is not a JSON object");
    run->m = curl_multi_init();
    run->succ = malloc(PD_MAX(d->n, 1u) * sizeof(int32_t));
    run->ready = malloc(PD_MAX(d->n, 1u) * sizeof(uint32_t));
    run->ready_at = malloc(PD_MAX(d->n, 1u) * sizeof(double));
    PD_ASSERT(run->hdrs && run->m && run->succ && run->ready && run->ready_at);
    for (uint32_t i = 0; i < d->n; i++) run->succ[i] = -1;
    for (uint32_t i = 0; i < d->n; i++)
        if (d->reqs[i].prev >= 0) run->succ[d->reqs[i].prev] = (int32_t)i;
    out->r = calloc(PD_MAX(d->n, 1u), sizeof(pd_lg_result));
    PD_ASSERT(out->r);
    out->n = d->n;
    for (uint32_t i = 0; i < d->n; i++)
        out->r[i] = (pd_lg_result){.outcome = PD_LG_NOT_SENT,
                                   .ttft_s = -1,
                                   .abort_at_s = -1,
                                   .prompt_tokens = d->reqs[i].input_len};
    return PD_OK;
}

static void run_teardown(lg_run *run) {
    curl_multi_cleanup(run->m);
    curl_slist_free_all(run->hdrs);
    json_decref(run->extra);
    free(run->live);
    free(run->succ);
    free(run->ready);
    free(run->ready_at);
}

/* Refuses to start when the server does not answer at all. */
static pd_err reachable(lg_run *run, char *err, size_t cap) {
    char url[640];
    snprintf(url, sizeof(url), "%s/health", run->c->base_url);
    lg_buf sink = {0};
    CURL *h = lg_easy(run, url, &sink);
    curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 10000L);
    CURLcode rc = curl_easy_perform(h);
    curl_easy_cleanup(h);
    lg_buf_free(&sink);
    if (rc == CURLE_OK) return PD_OK;
    return pd_errorf(err, cap, PD_ERR_IO, "cannot reach %s: %s", run->c->base_url,
                     curl_easy_strerror(rc));
}

static void measured_duration(const pd_lg_dataset *d, pd_lg_results *out) {
    double first = 0, last = 0;
    bool any = false;
    for (uint32_t i = 0; i < d->n; i++) {
        const pd_lg_result *r = &out->r[i];
        if (d->reqs[i].warmup || r->outcome == PD_LG_NOT_SENT) continue;
        if (!any || r->start_s < first) first = r->start_s;
        if (!any || r->end_s > last) last = r->end_s;
        any = true;
    }
    out->duration_s = any ? last - first : 0;
}

pd_err pd_lg_run(const pd_lg_run_config *c, const pd_lg_dataset *d, pd_lg_results *out, char *err,
                 size_t cap) {
    *out = (pd_lg_results){0};
    lg_run run;
    pd_err e = run_setup(&run, c, d, out, err, cap);
    if (!e) e = reachable(&run, err, cap);
    if (!e) e = lg_nodes_resolve(&run, err, cap);
    if (e) {
        run_teardown(&run);
        return e;
    }
    uint32_t warm = 0;
    while (warm < d->n && d->reqs[warm].warmup) warm++;
    run.t0 = lg_now();
    if (warm) phase(&run, 0, warm, false);
    uint32_t measured = 0;
    for (uint32_t i = warm; i < d->n; i++) measured++;
    pd_progress_options po = {.out = c->progress_to,
                              .label = "bench",
                              .unit = "requests",
                              .total = measured,
                              .tty_columns = c->progress_columns};
    if (c->progress_to) pd_progress_init(&run.progress, &po);
    run.t0 = run.next_sample = run.next_abort_all = lg_now();
    if (c->abort_all_every_s > 0) run.next_abort_all = run.t0 + c->abort_all_every_s;
    phase(&run, warm, d->n, true);
    lg_timeline_advance(&run, lg_now());
    progress_tick(&run, true);
    measured_duration(d, out);
    lg_idle_check(&run);
    run_teardown(&run);
    return PD_OK;
}

void pd_lg_results_free(pd_lg_results *r) {
    for (uint32_t i = 0; r->r && i < r->n; i++) free(r->r[i].itl);
    free(r->r);
    free(r->done);
    free(r->tokens);
    free(r->inflight);
    free(r->aborts);
    for (uint32_t k = 0; k < r->n_nodes; k++) free(r->nodes[k].samples);
    *r = (pd_lg_results){0};
}
