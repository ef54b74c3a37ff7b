/*
 * The fake worker of the router tests; see fake_worker.h.
 *
 * Thread-per-connection libmicrohttpd like the router itself, so a handler
 * may simply wait: waits are timed waits on one condition variable that
 * every abort and the stop broadcast, so an aborted request wakes at once
 * without busy polling (hundreds of them live at once in the storm test).
 */
#include "fake_worker.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "pdserve/base.h"

#define RECORDS_MAX 8192
#define HANG_MAX_MS 30000
#define STREAM_BLOCK 16384

typedef struct live {
    char rid[160];
    bool aborted;
    struct live *next;
} live;

struct fake_worker {
    bool prefill;
    struct MHD_Daemon *mhd;
    uint16_t port;
    char url[64];
    pthread_mutex_t mu;
    pthread_cond_t cv; /* CLOCK_MONOTONIC; broadcast on every change */
    bool stop;
    fw_behaviour b;
    json_t *bodies[RECORDS_MAX];
    char *generate_rids[RECORDS_MAX];
    size_t generates;
    char *abort_rids[RECORDS_MAX];
    size_t aborts;
    char *completed_rids[RECORDS_MAX];
    size_t completions;
    size_t healths;
    size_t aborts_now, aborts_peak; /* /abort_request calls being answered */
    size_t connections;             /* TCP connections accepted */
    live *lives;
    size_t live_count;
};

typedef enum fw_path { P_GENERATE, P_COMPLETIONS, P_ABORT, P_HEALTH, P_OTHER } fw_path;

typedef struct fw_req {
    fake_worker *fw;
    fw_path path;
    char *body;
    size_t len;
    live *lv; /* registered while generating */
    int fd;   /* the router's connection, watched while waiting */
    fw_behaviour b;
    /* stream state */
    char *pending; /* an event not yet fully handed to MHD */
    size_t pending_len, pending_off;
    int next; /* next token index */
    int tokens;
    bool final_sent, done_sent;
} fw_req;

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

/* Waits up to ms for an abort of lv (if any) or the stop. Returns true when
 * interrupted. */
static bool fw_wait(fake_worker *fw, live *lv, int ms) {
    uint64_t until = now_ms() + (uint64_t)(ms > 0 ? ms : 0);
    struct timespec ts = {(time_t)(until / 1000), (long)(until % 1000) * 1000000L};
    pthread_mutex_lock(&fw->mu);
    bool hit;
    while (!(hit = fw->stop || (lv && lv->aborted)) && now_ms() < until)
        pthread_cond_timedwait(&fw->cv, &fw->mu, &ts);
    pthread_mutex_unlock(&fw->mu);
    return hit;
}

/* The router closed the connection (a real node would notice and abort). */
static bool conn_closed(int fd) {
    if (fd < 0) return false;
    char c;
    ssize_t r = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* fw_wait that also ends when the request's connection closes; checks the
 * socket every 25 ms. */
static bool fw_wait_req(fw_req *q, int ms) {
    uint64_t until = now_ms() + (uint64_t)(ms > 0 ? ms : 0);
    for (;;) {
        uint64_t now = now_ms();
        int slice = until > now ? (int)PD_MIN(until - now, 25u) : 0;
        if (fw_wait(q->fw, q->lv, slice)) return true;
        if (conn_closed(q->fd)) return true;
        if (now_ms() >= until) return false;
    }
}

static bool is_aborted(fake_worker *fw, live *lv) {
    pthread_mutex_lock(&fw->mu);
    bool a = lv && lv->aborted;
    pthread_mutex_unlock(&fw->mu);
    return a;
}

static enum MHD_Result reply(struct MHD_Connection *c, unsigned status, const char *ctype,
                             const char *body) {
    struct MHD_Response *r =
        MHD_create_response_from_buffer(strlen(body), (void *)body, MHD_RESPMEM_MUST_COPY);
    MHD_add_response_header(r, "Content-Type", ctype);
    enum MHD_Result ret = MHD_queue_response(c, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result reply_json(struct MHD_Connection *c, unsigned status, json_t *o) {
    char *text = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    enum MHD_Result ret = reply(c, status, "application/json", text);
    free(text);
    return ret;
}

static json_t *error_body(unsigned status, const char *message) {
    return json_pack("{s:{s:s, s:s, s:i}}", "error", "message", message, "type",
                     status == 404 ? "not_found_error" : "internal_error", "code", (int)status);
}

/* One answer object: tokens [from, to) as text "tK " and ids K; final
 * finish reason or null. Generate or completions shape. */
static json_t *answer(const fw_req *q, const char *rid, int from, int to, const char *finish) {
    size_t pad = q->b.pad_bytes > 0 ? (size_t)q->b.pad_bytes : 0;
    size_t cap = 4096 + pad * (size_t)(to - from);
    char *text = calloc(1, cap);
    size_t tl = 0;
    json_t *ids = json_array();
    for (int k = from; k < to && tl + 16 + pad < cap; k++) {
        tl += (size_t)snprintf(text + tl, cap - tl, "t%d ", k);
        memset(text + tl, 'x', pad);
        tl += pad;
        text[tl] = '\0';
        json_array_append_new(ids, json_integer(k));
    }
    json_t *out;
    if (q->path == P_COMPLETIONS) {
        json_decref(ids);
        char id[200];
        snprintf(id, sizeof id, "cmpl-%s", rid);
        out = json_pack("{s:s, s:s, s:i, s:s, s:[{s:i, s:s, s:o, s:n}]}", "id", id, "object",
                        "text_completion", "created", 1, "model", "fake", "choices", "index", 0,
                        "text", text, "finish_reason", finish ? json_string(finish) : json_null(),
                        "logprobs");
        free(text);
        return out;
    }
    json_t *fr = json_null();
    if (finish && !strcmp(finish, "abort") && q->b.abort_status >= 500)
        fr = json_pack("{s:s, s:s, s:i}", "type", "abort", "message",
                       "transfer failed: the prefill side failed or aborted the room",
                       "status_code", q->b.abort_status);
    else if (finish && !strcmp(finish, "abort"))
        fr =
            json_pack("{s:s, s:s, s:i}", "type", "abort", "message", "aborted", "status_code", 499);
    else if (finish) fr = json_pack("{s:s}", "type", finish);
    out = json_pack("{s:s, s:o, s:{s:s, s:o, s:i, s:i}}", "text", text, "output_ids", ids,
                    "meta_info", "id", rid, "finish_reason", fr, "prompt_tokens", 3,
                    "completion_tokens", to - from);
    free(text);
    return out;
}

static void record_completed(fake_worker *fw, const char *rid) {
    pthread_mutex_lock(&fw->mu);
    if (fw->completions < RECORDS_MAX) fw->completed_rids[fw->completions++] = strdup(rid);
    pthread_mutex_unlock(&fw->mu);
}

/* The next event of the stream, malloc'd, or NULL at the end (with *err
 * when the stream must break off). */
static char *next_event(fw_req *q, bool *err) {
    fake_worker *fw = q->fw;
    *err = false;
    if (q->done_sent) return NULL;
    json_t *ev = NULL;
    const char *rid = q->lv->rid;
    if (q->final_sent) {
        if (q->b.no_done) return NULL;
        q->done_sent = true;
        return strdup("data: [DONE]\n\n");
    }
    if (q->b.garbage) {
        q->final_sent = true;
        q->b.no_done = true;
        return strdup("data: this is not json\n\n");
    }
    if (q->b.hang) {
        if (!fw_wait_req(q, HANG_MAX_MS) || !is_aborted(fw, q->lv)) {
            *err = true;
            return NULL;
        }
        ev = answer(q, rid, 0, 0, "abort");
        q->final_sent = true;
    } else if (fw->prefill) {
        fw_wait_req(q, q->b.delay_ms);
        ev = answer(q, rid, 0, 0, is_aborted(fw, q->lv) ? "abort" : "transferred");
        q->final_sent = true;
    } else if (q->next < q->tokens) {
        if (fw_wait_req(q, q->b.delay_ms)) {
            if (!is_aborted(fw, q->lv)) {
                *err = true;
                return NULL;
            }
            ev = answer(q, rid, 0, 0, "abort");
            q->final_sent = true;
        } else {
            ev = answer(q, rid, q->next, q->next + 1, NULL);
            q->next++;
        }
    } else {
        ev = answer(q, rid, 0, 0, "length");
        q->final_sent = true;
        record_completed(fw, rid);
    }
    char *text = json_dumps(ev, JSON_COMPACT);
    json_decref(ev);
    size_t cap = strlen(text) + 16;
    char *out = malloc(cap);
    snprintf(out, cap, "data: %s\n\n", text);
    free(text);
    return out;
}

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    fw_req *q = cls;
    if (q->pending_off == q->pending_len) {
        free(q->pending);
        q->pending = NULL;
        q->pending_len = q->pending_off = 0;
        bool err;
        q->pending = next_event(q, &err);
        if (!q->pending)
            return err ? MHD_CONTENT_READER_END_WITH_ERROR : MHD_CONTENT_READER_END_OF_STREAM;
        q->pending_len = strlen(q->pending);
    }
    size_t n = PD_MIN(max, q->pending_len - q->pending_off);
    memcpy(buf, q->pending + q->pending_off, n);
    q->pending_off += n;
    return (ssize_t)n;
}

/* Under fw->mu: the request becomes live, so an abort finds it. */
static live *live_add_locked(fake_worker *fw, const char *rid) {
    live *lv = calloc(1, sizeof *lv);
    if (!lv) abort();
    snprintf(lv->rid, sizeof lv->rid, "%s", rid);
    lv->next = fw->lives;
    fw->lives = lv;
    fw->live_count++;
    return lv;
}

static void live_remove(fake_worker *fw, live *lv) {
    pthread_mutex_lock(&fw->mu);
    for (live **p = &fw->lives; *p; p = &(*p)->next) {
        if (*p == lv) {
            *p = lv->next;
            fw->live_count--;
            break;
        }
    }
    pthread_cond_broadcast(&fw->cv);
    pthread_mutex_unlock(&fw->mu);
    free(lv);
}

static enum MHD_Result handle_generate(fw_req *q, struct MHD_Connection *c) {
    fake_worker *fw = q->fw;
    json_t *body = json_loadb(q->body ? q->body : "", q->len, 0, NULL);
    const char *rid_s = json_string_value(json_object_get(body, "rid"));
    char rid[160];
    snprintf(rid, sizeof rid, "%s", rid_s ? rid_s : "(none)");
    bool stream = json_is_true(json_object_get(body, "stream"));
    pthread_mutex_lock(&fw->mu);
    q->b = fw->b;
    /* A request that will be answered slowly is live before it is counted
     * as received: a test that waits for the count and then aborts must
     * find it (the abort answered 404 for a request counted but not yet
     * live, one CI run in many). */
    bool goes_live = !q->b.close && !(q->b.generate_status && q->b.generate_status != 200) &&
        !(q->b.garbage && !stream);
    if (goes_live) q->lv = live_add_locked(fw, rid);
    if (fw->generates < RECORDS_MAX) {
        fw->bodies[fw->generates] = body ? json_incref(body) : json_null();
        fw->generate_rids[fw->generates] = strdup(rid);
        fw->generates++;
    }
    pthread_cond_broadcast(&fw->cv);
    pthread_mutex_unlock(&fw->mu);
    json_decref(body);
    fw_behaviour *b = &q->b;
    if (b->close) return MHD_NO;
    if (b->generate_status && b->generate_status != 200) {
        fw_wait(fw, NULL, b->delay_ms);
        return reply_json(c, (unsigned)b->generate_status,
                          error_body((unsigned)b->generate_status, "fake worker error"));
    }
    if (b->garbage && !stream) return reply(c, 200, "application/json", "this is not json");
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    q->fd = ci ? ci->connect_fd : -1;
    q->tokens = b->tokens > 0 ? b->tokens : 4;
    if (stream) {
        struct MHD_Response *r = MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, STREAM_BLOCK,
                                                                   stream_reader, q, NULL);
        MHD_add_response_header(r, "Content-Type", "text/event-stream");
        enum MHD_Result ret = MHD_queue_response(c, 200, r);
        MHD_destroy_response(r);
        return ret;
    }
    if (b->hang) {
        if (!fw_wait_req(q, HANG_MAX_MS) || !is_aborted(fw, q->lv)) return MHD_NO;
        return reply_json(c, 200, answer(q, rid, 0, 0, "abort"));
    }
    if (fw->prefill) {
        fw_wait_req(q, b->delay_ms);
        bool aborted = is_aborted(fw, q->lv);
        if (aborted && b->fail_on_abort)
            return reply_json(c, 500,
                              json_pack("{s:{s:s, s:s, s:i}}", "error", "message",
                                        "transfer failed: the room was aborted", "type",
                                        "server_error", "code", 500));
        return reply_json(c, 200, answer(q, rid, 0, 0, aborted ? "abort" : "transferred"));
    }
    int made = 0;
    while (made < q->tokens && !fw_wait_req(q, b->delay_ms)) made++;
    if (made < q->tokens && !is_aborted(fw, q->lv)) return MHD_NO; /* closed or stopped */
    if (made == q->tokens) record_completed(fw, rid);
    return reply_json(c, 200, answer(q, rid, 0, made, made < q->tokens ? "abort" : "length"));
}

static enum MHD_Result handle_abort(fw_req *q, struct MHD_Connection *c) {
    fake_worker *fw = q->fw;
    json_t *body = json_loadb(q->body ? q->body : "", q->len, 0, NULL);
    const char *rid = json_string_value(json_object_get(body, "rid"));
    bool all = json_is_true(json_object_get(body, "abort_all"));
    int n = 0;
    pthread_mutex_lock(&fw->mu);
    if (fw->aborts < RECORDS_MAX) fw->abort_rids[fw->aborts++] = strdup(all ? "*" : rid ? rid : "");
    for (live *lv = fw->b.deaf ? NULL : fw->lives; lv; lv = lv->next) {
        if (lv->aborted) continue;
        if (all || (rid && !strcmp(lv->rid, rid))) {
            lv->aborted = true;
            n++;
        }
    }
    pthread_cond_broadcast(&fw->cv);
    fw->aborts_now++;
    if (fw->aborts_now > fw->aborts_peak) fw->aborts_peak = fw->aborts_now;
    int delay_ms = fw->b.abort_delay_ms;
    pthread_mutex_unlock(&fw->mu);
    json_decref(body);
    struct timespec ts = {delay_ms / 1000, (long)(delay_ms % 1000) * 1000000L};
    if (delay_ms > 0) nanosleep(&ts, NULL);
    pthread_mutex_lock(&fw->mu);
    fw->aborts_now--;
    pthread_mutex_unlock(&fw->mu);
    if (!all && n == 0) return reply_json(c, 404, error_body(404, "no such rid"));
    return reply_json(c, 200, json_pack("{s:i}", "aborted", n));
}

static enum MHD_Result handle_health(fw_req *q, struct MHD_Connection *c) {
    fake_worker *fw = q->fw;
    pthread_mutex_lock(&fw->mu);
    fw->healths++;
    fw_behaviour b = fw->b;
    pthread_cond_broadcast(&fw->cv);
    pthread_mutex_unlock(&fw->mu);
    if (b.health_hang) {
        /* Until told otherwise or stopped (bounded: a test never waits longer). */
        for (int i = 0; i < 100; i++) {
            if (fw_wait(fw, NULL, 100)) return MHD_NO;
            pthread_mutex_lock(&fw->mu);
            bool still = fw->b.health_hang;
            pthread_mutex_unlock(&fw->mu);
            if (!still) break;
        }
    }
    if (b.health_status && b.health_status != 200)
        return reply_json(c, (unsigned)b.health_status,
                          error_body((unsigned)b.health_status, "down"));
    return reply_json(c, 200, json_pack("{s:s}", "status", "ok"));
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **req_cls) {
    (void)method, (void)version;
    fake_worker *fw = cls;
    fw_req *q = *req_cls;
    if (!q) {
        q = calloc(1, sizeof *q);
        q->fw = fw;
        q->path = !strcmp(url, "/generate")   ? P_GENERATE
            : !strcmp(url, "/v1/completions") ? P_COMPLETIONS
            : !strcmp(url, "/abort_request")  ? P_ABORT
            : !strcmp(url, "/health")         ? P_HEALTH
                                              : P_OTHER;
        *req_cls = q;
        return MHD_YES;
    }
    if (*upload_data_size) {
        q->body = realloc(q->body, q->len + *upload_data_size + 1);
        memcpy(q->body + q->len, upload_data, *upload_data_size);
        q->len += *upload_data_size;
        q->body[q->len] = '\0';
        *upload_data_size = 0;
        return MHD_YES;
    }
    switch (q->path) {
    case P_GENERATE:
    case P_COMPLETIONS: return handle_generate(q, c);
    case P_ABORT: return handle_abort(q, c);
    case P_HEALTH: return handle_health(q, c);
    case P_OTHER: break;
    }
    return reply_json(c, 404, error_body(404, "unknown path"));
}

static void on_completed(void *cls, struct MHD_Connection *c, void **req_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)c, (void)toe;
    fake_worker *fw = cls;
    fw_req *q = *req_cls;
    if (!q) return;
    if (q->lv) live_remove(fw, q->lv);
    free(q->pending);
    free(q->body);
    free(q);
    *req_cls = NULL;
}

static void on_connection(void *cls, struct MHD_Connection *c, void **socket_ctx,
                          enum MHD_ConnectionNotificationCode code) {
    (void)c, (void)socket_ctx;
    fake_worker *fw = cls;
    if (code != MHD_CONNECTION_NOTIFY_STARTED) return;
    pthread_mutex_lock(&fw->mu);
    fw->connections++;
    pthread_mutex_unlock(&fw->mu);
}

fake_worker *fw_start(const char *role) {
    fake_worker *fw = calloc(1, sizeof *fw);
    PD_ASSERT(fw != NULL);
    fw->prefill = !strcmp(role, "prefill");
    pthread_mutex_init(&fw->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&fw->cv, &ca);
    pthread_condattr_destroy(&ca);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    fw->mhd = MHD_start_daemon(
        MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION | MHD_USE_POLL, 0, NULL,
        NULL, on_request, fw, MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&sa,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, fw, MHD_OPTION_NOTIFY_CONNECTION, on_connection,
        fw, MHD_OPTION_CONNECTION_LIMIT, 2000u, MHD_OPTION_END);
    PD_ASSERTF(fw->mhd != NULL, "fake worker cannot start");
    fw->port = MHD_get_daemon_info(fw->mhd, MHD_DAEMON_INFO_BIND_PORT)->port;
    snprintf(fw->url, sizeof fw->url, "http://127.0.0.1:%u", (unsigned)fw->port);
    return fw;
}

void fw_stop(fake_worker *fw) {
    if (!fw) return;
    pthread_mutex_lock(&fw->mu);
    fw->stop = true;
    pthread_cond_broadcast(&fw->cv);
    pthread_mutex_unlock(&fw->mu);
    MHD_stop_daemon(fw->mhd);
    for (size_t i = 0; i < fw->generates; i++) {
        json_decref(fw->bodies[i]);
        free(fw->generate_rids[i]);
    }
    for (size_t i = 0; i < fw->aborts; i++) free(fw->abort_rids[i]);
    for (size_t i = 0; i < fw->completions; i++) free(fw->completed_rids[i]);
    PD_ASSERT(fw->lives == NULL);
    pthread_cond_destroy(&fw->cv);
    pthread_mutex_destroy(&fw->mu);
    free(fw);
}

const char *fw_url(const fake_worker *fw) { return fw->url; }
uint16_t fw_port(const fake_worker *fw) { return fw->port; }

void fw_set(fake_worker *fw, const fw_behaviour *b) {
    pthread_mutex_lock(&fw->mu);
    fw->b = *b;
    pthread_cond_broadcast(&fw->cv);
    pthread_mutex_unlock(&fw->mu);
}

size_t fw_generate_count(fake_worker *fw) {
    pthread_mutex_lock(&fw->mu);
    size_t n = fw->generates;
    pthread_mutex_unlock(&fw->mu);
    return n;
}

json_t *fw_generate_body(fake_worker *fw, size_t i) {
    pthread_mutex_lock(&fw->mu);
    json_t *b = i < fw->generates ? json_deep_copy(fw->bodies[i]) : NULL;
    pthread_mutex_unlock(&fw->mu);
    return b;
}

static bool has(char **list, size_t n, const char *rid) {
    for (size_t i = 0; i < n; i++)
        if (!strcmp(list[i], rid)) return true;
    return false;
}

bool fw_got_generate(fake_worker *fw, const char *rid) {
    pthread_mutex_lock(&fw->mu);
    bool v = has(fw->generate_rids, fw->generates, rid);
    pthread_mutex_unlock(&fw->mu);
    return v;
}

bool fw_got_completed(fake_worker *fw, const char *rid) {
    pthread_mutex_lock(&fw->mu);
    bool v = has(fw->completed_rids, fw->completions, rid);
    pthread_mutex_unlock(&fw->mu);
    return v;
}

size_t fw_abort_count(fake_worker *fw) {
    pthread_mutex_lock(&fw->mu);
    size_t n = fw->aborts;
    pthread_mutex_unlock(&fw->mu);
    return n;
}

bool fw_got_abort(fake_worker *fw, const char *rid) {
    pthread_mutex_lock(&fw->mu);
    bool v = has(fw->abort_rids, fw->aborts, rid);
    pthread_mutex_unlock(&fw->mu);
    return v;
}

size_t fw_connection_count(fake_worker *fw) {
    pthread_mutex_lock(&fw->mu);
    size_t n = fw->connections;
    pthread_mutex_unlock(&fw->mu);
    return n;
}

size_t fw_abort_peak(fake_worker *fw) {
    pthread_mutex_lock(&fw->mu);
    size_t n = fw->aborts_peak;
    pthread_mutex_unlock(&fw->mu);
    return n;
}

size_t fw_health_count(fake_worker *fw) {
    pthread_mutex_lock(&fw->mu);
    size_t n = fw->healths;
    pthread_mutex_unlock(&fw->mu);
    return n;
}

size_t fw_live_count(fake_worker *fw) {
    pthread_mutex_lock(&fw->mu);
    size_t n = fw->live_count;
    pthread_mutex_unlock(&fw->mu);
    return n;
}

/* Waits on the worker's condition variable until pred holds or the deadline. */
typedef bool (*fw_pred)(fake_worker *fw, const void *arg);

static bool wait_for(fake_worker *fw, fw_pred pred, const void *arg, int timeout_ms) {
    uint64_t until = now_ms() + (uint64_t)timeout_ms;
    struct timespec ts = {(time_t)(until / 1000), (long)(until % 1000) * 1000000L};
    pthread_mutex_lock(&fw->mu);
    bool ok;
    while (!(ok = pred(fw, arg)) && now_ms() < until) pthread_cond_timedwait(&fw->cv, &fw->mu, &ts);
    pthread_mutex_unlock(&fw->mu);
    return ok;
}

static bool pred_generates(fake_worker *fw, const void *arg) {
    return fw->generates >= *(const size_t *)arg;
}
static bool pred_got_generate(fake_worker *fw, const void *arg) {
    return has(fw->generate_rids, fw->generates, arg);
}
static bool pred_got_abort(fake_worker *fw, const void *arg) {
    return has(fw->abort_rids, fw->aborts, arg);
}
static bool pred_healths(fake_worker *fw, const void *arg) {
    return fw->healths >= *(const size_t *)arg;
}
static bool pred_live(fake_worker *fw, const void *arg) {
    return fw->live_count == *(const size_t *)arg;
}

bool fw_wait_generate_count(fake_worker *fw, size_t n, int timeout_ms) {
    return wait_for(fw, pred_generates, &n, timeout_ms);
}
bool fw_wait_got_generate(fake_worker *fw, const char *rid, int timeout_ms) {
    return wait_for(fw, pred_got_generate, rid, timeout_ms);
}
bool fw_wait_got_abort(fake_worker *fw, const char *rid, int timeout_ms) {
    return wait_for(fw, pred_got_abort, rid, timeout_ms);
}
bool fw_wait_health_count(fake_worker *fw, size_t n, int timeout_ms) {
    return wait_for(fw, pred_healths, &n, timeout_ms);
}
bool fw_wait_live_count(fake_worker *fw, size_t n, int timeout_ms) {
    return wait_for(fw, pred_live, &n, timeout_ms);
}

/* ---- raw TCP server ----------------------------------------------------------- */

struct raw_server {
    int listen_fd;
    int wake[2];
    char *reply;
    char url[64];
    pthread_t thread;
    int held[256];
    size_t held_n;
};

static void *raw_main(void *arg) {
    raw_server *rs = arg;
    for (;;) {
        struct pollfd p[2] = {{rs->listen_fd, POLLIN, 0}, {rs->wake[0], POLLIN, 0}};
        if (poll(p, 2, -1) < 0 && errno != EINTR) break;
        if (p[1].revents) break;
        if (!(p[0].revents & POLLIN)) continue;
        int fd = accept(rs->listen_fd, NULL, NULL);
        if (fd < 0) continue;
        if (rs->reply) {
            /* Read what the client sent (briefly), answer garbage, close. */
            char buf[4096];
            struct pollfd rp = {fd, POLLIN, 0};
            if (poll(&rp, 1, 1000) > 0) (void)!recv(fd, buf, sizeof buf, 0);
            (void)!send(fd, rs->reply, strlen(rs->reply), MSG_NOSIGNAL);
            close(fd);
        } else if (rs->held_n < PD_ARRAY_LEN(rs->held)) {
            rs->held[rs->held_n++] = fd;
        } else {
            close(fd);
        }
    }
    return NULL;
}

raw_server *raw_start(const char *reply) {
    raw_server *rs = calloc(1, sizeof *rs);
    rs->reply = reply ? strdup(reply) : NULL;
    rs->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    PD_ASSERT(bind(rs->listen_fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    PD_ASSERT(listen(rs->listen_fd, 64) == 0);
    socklen_t sl = sizeof sa;
    getsockname(rs->listen_fd, (struct sockaddr *)&sa, &sl);
    snprintf(rs->url, sizeof rs->url, "http://127.0.0.1:%u", (unsigned)ntohs(sa.sin_port));
    PD_ASSERT(pipe(rs->wake) == 0);
    PD_ASSERT(pthread_create(&rs->thread, NULL, raw_main, rs) == 0);
    return rs;
}

void raw_stop(raw_server *rs) {
    if (!rs) return;
    (void)!write(rs->wake[1], "x", 1);
    pthread_join(rs->thread, NULL);
    for (size_t i = 0; i < rs->held_n; i++) close(rs->held[i]);
    close(rs->listen_fd);
    close(rs->wake[0]);
    close(rs->wake[1]);
    free(rs->reply);
    free(rs);
}

const char *raw_url(const raw_server *rs) { return rs->url; }

uint16_t free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = 0};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    PD_ASSERT(bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    socklen_t sl = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &sl);
    close(fd);
    return ntohs(sa.sin_port);
}
