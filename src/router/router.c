/*
 * The router's HTTP server: routes, request validation, the table of
 * requests in flight, and the glue between libmicrohttpd and a forward.
 *
 * libmicrohttpd runs in thread-per-connection mode. A request's handler may
 * block for as long as the request lives: it validates the body, picks a
 * pair, rewrites the body with the bootstrap fields and drives the forward
 * (forward.c) until the response's head is decided, then queues it; a
 * streamed body is produced by the same thread from MHD's content-reader
 * callback. The price is one thread per client connection, bounded by
 * connections_max; the gain is straight-line code with no hand-written
 * event loop, and a forward that is never shared between threads.
 *
 * The in-flight table (one slot per possible connection, a linear scan
 * under a mutex) maps rids to forwards for the two things that reach a
 * request from outside its thread: a router-level /abort_request and
 * shutdown. A slot is taken before the workers hear of the rid, so an
 * /abort_request can never miss a request that a worker already has;
 * a flag set before the forward exists is handed to it when it attaches.
 *
 * MHD's request-completed callback is the single end of every request:
 * it closes the forward (which aborts whatever still runs — this is where a
 * hang-up that MHD noticed while writing ends up), releases the workers,
 * frees the slot and records the outcome.
 */
#include "pdserve/router.h"

#include "body.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <microhttpd.h>
#include <netdb.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "body.h"
#include "client.h"
#include "forward.h"
#include "health.h"
#include "pdserve/http.h"
#include "stats.h"
#include "workers.h"

#define STREAM_BLOCK_BYTES (16u * 1024u)

typedef struct slot {
    bool used;
    bool abort_pending;      /* flagged before the forward attached */
    char rid[PD_RID_MAX];
    rt_fwd *fwd;
} slot;

struct pd_router {
    pd_router_config cfg;
    char host[256];
    rt_workers workers;
    rt_health health;
    rt_stats stats;
    struct MHD_Daemon *mhd;
    uint16_t port;
    bool started;
    bool stopped;

    pthread_mutex_t table_mu;
    slot *slots;             /* cfg.connections_max of them */
    bool stopping;           /* guarded by table_mu */
};

/* ---- configuration ---------------------------------------------------------- */

void pd_router_config_default(pd_router_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->host = "127.0.0.1";
    cfg->port = 30000;
    cfg->bootstrap_port = PD_ROUTER_DEFAULT_BOOTSTRAP_PORT;
    cfg->policy = PD_ROUTER_ROUND_ROBIN;
    cfg->health_interval_ms = 1000;
    cfg->health_timeout_ms = 1000;
    cfg->unhealthy_after = 2;
    cfg->request_timeout_ms = 600u * 1000u;
    cfg->connect_timeout_ms = 5000;
    cfg->abort_timeout_ms = 2000;
    cfg->abort_grace_ms = 1000;
    cfg->max_body_bytes = 1u << 20;
    cfg->max_response_bytes = 64u << 20;
    cfg->connections_max = 1024;
    cfg->connections_per_ip = 256;
    cfg->client_timeout_s = 60;
}

pd_err pd_router_create(pd_router **out, const pd_router_config *cfg, char *msg, size_t msg_cap) {
    *out = NULL;
    pd_err err = rt_client_global_init(msg, msg_cap);
    if (err) return err;
    if (!cfg->host || !*cfg->host || strlen(cfg->host) >= sizeof((pd_router *)0)->host)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "a listen host is required");
    if (cfg->health_interval_ms == 0 || cfg->health_timeout_ms == 0)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "health interval and timeout must be > 0");
    if (cfg->request_timeout_ms == 0 || cfg->connect_timeout_ms == 0 ||
        cfg->abort_timeout_ms == 0)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "timeouts must be > 0");
    if (cfg->max_body_bytes == 0 || cfg->max_response_bytes == 0)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "size limits must be > 0");
    if (cfg->connections_max == 0 || cfg->connections_max > 65536)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "connections_max must be 1..65536");
    if (cfg->connections_per_ip == 0 || cfg->connections_per_ip > cfg->connections_max)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID,
                         "connections_per_ip must be 1..connections_max (%u)",
                         cfg->connections_max);
    if (cfg->client_timeout_s == 0 || cfg->client_timeout_s > 86400)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "client_timeout_s must be 1..86400");
    if (cfg->policy != PD_ROUTER_ROUND_ROBIN && cfg->policy != PD_ROUTER_LEAST_LOAD)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "unknown policy");
    pd_router *r = calloc(1, sizeof *r);
    if (!r) return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    r->cfg = *cfg;
    snprintf(r->host, sizeof r->host, "%s", cfg->host);
    r->cfg.host = r->host;
    /* The worker specs are parsed now; the table does not keep the strings. */
    for (size_t i = 0; i < PD_ROUTER_WORKERS_MAX; i++) r->cfg.prefill[i] = r->cfg.decode[i] = NULL;
    err = rt_workers_init(&r->workers, cfg, msg, msg_cap);
    if (err) {
        free(r);
        return err;
    }
    r->slots = calloc(cfg->connections_max, sizeof *r->slots);
    if (!r->slots) {
        rt_workers_destroy(&r->workers);
        free(r);
        return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    }
    pthread_mutex_init(&r->table_mu, NULL);
    rt_stats_init(&r->stats);
    *out = r;
    return PD_OK;
}

uint16_t pd_router_port(const pd_router *r) { return r->port; }

/* ---- ids -------------------------------------------------------------------- */

static bool random_bytes(void *buf, size_t n) {
    if (getrandom(buf, n, 0) == (ssize_t)n) return true;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    bool ok = read(fd, buf, n) == (ssize_t)n;
    close(fd);
    return ok;
}

/* A fresh room: random, non-zero, below 2^63 so that every JSON parser that
 * reads signed 64-bit integers (jansson among them) takes it whole. */
static bool new_room(uint64_t *room) {
    for (int tries = 0; tries < 8; tries++) {
        uint64_t v;
        if (!random_bytes(&v, sizeof v)) return false;
        v &= INT64_MAX;
        if (v) {
            *room = v;
            return true;
        }
    }
    return false;
}

/* ---- the in-flight table ------------------------------------------------------- */

/* Takes a slot for rid. PD_ERR_EXISTS: a live request has it; PD_ERR_NOMEM:
 * full; PD_ERR_STATE: shutting down. */
static pd_err table_add(pd_router *r, const char *rid, long *slot_out) {
    pthread_mutex_lock(&r->table_mu);
    pd_err err = PD_OK;
    long free_slot = -1;
    if (r->stopping) err = PD_ERR_STATE;
    for (size_t i = 0; !err && i < r->cfg.connections_max; i++) {
        slot *s = &r->slots[i];
        if (!s->used) {
            if (free_slot < 0) free_slot = (long)i;
        } else if (!strcmp(s->rid, rid)) {
            err = PD_ERR_EXISTS;
        }
    }
    if (!err && free_slot < 0) err = PD_ERR_NOMEM;
    if (!err) {
        slot *s = &r->slots[free_slot];
        memset(s, 0, sizeof *s);
        s->used = true;
        snprintf(s->rid, sizeof s->rid, "%s", rid);
        *slot_out = free_slot;
    }
    pthread_mutex_unlock(&r->table_mu);
    return err;
}

static void table_attach(pd_router *r, long i, rt_fwd *f) {
    pthread_mutex_lock(&r->table_mu);
    slot *s = &r->slots[i];
    PD_ASSERT(s->used && s->fwd == NULL);
    s->fwd = f;
    if (s->abort_pending) rt_fwd_request_abort(f);
    if (r->stopping) rt_fwd_request_shutdown(f);
    pthread_mutex_unlock(&r->table_mu);
}

static void table_remove(pd_router *r, long i) {
    pthread_mutex_lock(&r->table_mu);
    PD_ASSERT(r->slots[i].used);
    memset(&r->slots[i], 0, sizeof r->slots[i]);
    pthread_mutex_unlock(&r->table_mu);
}

static size_t table_used(pd_router *r) {
    size_t n = 0;
    pthread_mutex_lock(&r->table_mu);
    for (size_t i = 0; i < r->cfg.connections_max; i++) n += r->slots[i].used;
    pthread_mutex_unlock(&r->table_mu);
    return n;
}

/* Flags the requests with this rid (all when rid is NULL) for abort.
 * Returns how many. */
static size_t table_flag_abort(pd_router *r, const char *rid) {
    size_t n = 0;
    pthread_mutex_lock(&r->table_mu);
    for (size_t i = 0; i < r->cfg.connections_max; i++) {
        slot *s = &r->slots[i];
        if (!s->used || (rid && strcmp(s->rid, rid))) continue;
        n++;
        if (s->fwd) rt_fwd_request_abort(s->fwd);
        else s->abort_pending = true;
    }
    pthread_mutex_unlock(&r->table_mu);
    return n;
}

/* ---- per-request state ------------------------------------------------------------ */

typedef enum route {
    ROUTE_GENERATE,
    ROUTE_COMPLETIONS,
    ROUTE_ABORT,
    ROUTE_HEALTH,
    ROUTE_SERVER_INFO,
    ROUTE_METRICS,
    ROUTE_NONE,
} route;

static const struct {
    const char *path;
    const char *method;
} routes[] = {
    [ROUTE_GENERATE] = {"/generate", "POST"},
    [ROUTE_COMPLETIONS] = {"/v1/completions", "POST"},
    [ROUTE_ABORT] = {"/abort_request", "POST"},
    [ROUTE_HEALTH] = {"/health", "GET"},
    [ROUTE_SERVER_INFO] = {"/server_info", "GET"},
    [ROUTE_METRICS] = {"/metrics", "GET"},
};

typedef struct req {
    pd_router *r;
    route route;
    char *body;
    size_t len, cap;
    bool too_large;
    bool answered;           /* a response is queued */
    bool generation;         /* counted in the stats */
    bool recorded;           /* its outcome is in the stats */
    unsigned status;         /* for the stats, when no forward decides it */
    long slot;
    bool picked;             /* a worker pair counts this request in flight */
    size_t prefill, decode;
    rt_fwd *fwd;
    uint64_t start_ms;
} req;

static route find_route(const char *url) {
    for (size_t i = 0; i < PD_ARRAY_LEN(routes); i++)
        if (!strcmp(url, routes[i].path)) return (route)i;
    return ROUTE_NONE;
}

/* Keeps at most max_body_bytes; past that only remembers that it was. */
static void body_append(req *q, const char *data, size_t n) {
    size_t max = q->r->cfg.max_body_bytes;
    if (q->too_large) return;
    if (n > max - q->len) {
        q->too_large = true;
        free(q->body);
        q->body = NULL;
        q->len = q->cap = 0;
        return;
    }
    if (q->len + n + 1 > q->cap) {
        size_t cap = q->cap ? q->cap : 1024;
        while (cap < q->len + n + 1) cap *= 2;
        char *nb = realloc(q->body, cap);
        if (!nb) {
            q->too_large = true; /* refused like an oversized body: the router lives on */
            free(q->body);
            q->body = NULL;
            q->len = q->cap = 0;
            return;
        }
        q->body = nb;
        q->cap = cap;
    }
    memcpy(q->body + q->len, data, n);
    q->len += n;
    q->body[q->len] = '\0';
}

/* A generation request's outcome goes into the stats when the answer is
 * decided — before the client can read it, so a client that reads the
 * answer and then the stats sees its own request counted. Idempotent. */
static void record_outcome(req *q, unsigned status) {
    if (!q->generation || q->recorded) return;
    q->recorded = true;
    rt_stats_end(&q->r->stats, status, (double)(rt_now_ms() - q->start_ms) / 1e3);
}

#if defined(__GNUC__)
__attribute__((format(printf, 5, 6)))
#endif
static enum MHD_Result answer_error(req *q, struct MHD_Connection *c, unsigned status,
                                    const char *allow, const char *fmt, ...) {
    char message[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    q->status = status;
    q->answered = true;
    record_outcome(q, status);
    return pd_http_queue_error(c, status, allow, "%s", message);
}

static enum MHD_Result answer_json(req *q, struct MHD_Connection *c, unsigned status, json_t *o) {
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!text) return answer_error(q, c, 500, NULL, "out of memory");
    q->status = status;
    q->answered = true;
    enum MHD_Result ret = pd_http_queue_json(c, status, text, strlen(text));
    free(text);
    return ret;
}

/* ---- validation ------------------------------------------------------------------- */

/* ---- routes ------------------------------------------------------------------------ */

/* The pair stops counting this request as soon as the answer is decided —
 * before the client has it — so a client that sends its next request the
 * moment it reads this answer finds the load it expects (least_load). */
static void release_workers(req *q) {
    if (!q->picked) return;
    q->picked = false;
    rt_workers_release(&q->r->workers, q->prefill,
                       q->fwd && rt_fwd_half_failed(q->fwd, RT_PREFILL));
    rt_workers_release(&q->r->workers, q->decode, q->fwd && rt_fwd_half_failed(q->fwd, RT_DECODE));
}

static ssize_t stream_reader(void *cls, uint64_t pos, char *buf, size_t max) {
    (void)pos;
    req *q = cls;
    long n = rt_fwd_stream_read(q->fwd, buf, max);
    if (n > 0) return (ssize_t)n;
    release_workers(q);
    record_outcome(q, rt_fwd_outcome(q->fwd));
    return n == 0 ? MHD_CONTENT_READER_END_OF_STREAM : MHD_CONTENT_READER_END_WITH_ERROR;
}

/* The client's rid, or a fresh random one; false when there is no randomness. */
static bool request_rid(json_t *o, char *rid, size_t cap) {
    json_t *jrid = json_object_get(o, "rid");
    uint64_t rid_bits = 0;
    if (jrid) {
        snprintf(rid, cap, "%s", json_string_value(jrid));
    } else if (random_bytes(&rid_bits, sizeof rid_bits)) {
        snprintf(rid, cap, "%016llx", (unsigned long long)rid_bits);
    } else {
        return false;
    }
    return true;
}

/* The body both halves get: the client's, with the prefill node's bootstrap
 * address, the room and the rid added. Takes o; NULL when out of memory. */
static char *bootstrap_body(json_t *o, const rt_worker *pw, uint64_t room, const char *rid) {
    json_object_set_new(o, "bootstrap_host", json_string(pw->url.host));
    json_object_set_new(o, "bootstrap_port", json_integer(pw->url.bootstrap_port));
    json_object_set_new(o, "bootstrap_room", json_integer((json_int_t)room));
    json_object_set_new(o, "rid", json_string(rid));
    char *body = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return body;
}

/* Queues the response whose head the forward decided; a STREAM body is read
 * from the forward by stream_reader, on this connection's thread. */
static enum MHD_Result queue_head(req *q, struct MHD_Connection *c, const rt_fwd_head *head) {
    q->answered = true;
    if (head->kind != RT_FWD_STREAM) {
        release_workers(q); /* both halves are over */
        record_outcome(q, rt_fwd_outcome(q->fwd));
    }
    if (head->kind == RT_FWD_GONE) return MHD_NO; /* nobody to answer: close */
    if (head->kind == RT_FWD_FULL) {
        return pd_http_queue_text(c, head->status, head->content_type, head->body, head->body_len);
    }
    struct MHD_Response *resp = MHD_create_response_from_callback(
        MHD_SIZE_UNKNOWN, STREAM_BLOCK_BYTES, stream_reader, q, NULL);
    if (!resp) return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, head->content_type);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result ret = MHD_queue_response(c, head->status, resp);
    MHD_destroy_response(resp);
    return ret;
}

/* Hands body (ownership included) to a new forward to the picked pair and
 * answers with whatever head the forward decides. */
static enum MHD_Result forward_generation(req *q, struct MHD_Connection *c, char *body,
                                          const char *rid, const char *model, bool stream) {
    pd_router *r = q->r;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    rt_fwd_params p = {
        .api = q->route == ROUTE_GENERATE ? RT_FWD_GENERATE : RT_FWD_COMPLETIONS,
        .rid = rid,
        .model = model,
        .stream = stream,
        .body = body,
        .body_len = strlen(body),
        .prefill_base = r->workers.w[q->prefill].url.base, /* url fields are immutable */
        .decode_base = r->workers.w[q->decode].url.base,
        .client_fd = ci ? ci->connect_fd : -1,
        .timeout_ms = r->cfg.request_timeout_ms,
        .connect_timeout_ms = r->cfg.connect_timeout_ms,
        .abort_timeout_ms = r->cfg.abort_timeout_ms,
        .abort_grace_ms = r->cfg.abort_grace_ms,
        .max_response_bytes = r->cfg.max_response_bytes,
    };
    char msg[256];
    if (rt_fwd_create(&q->fwd, &p, msg, sizeof msg) != PD_OK)
        return answer_error(q, c, 500, NULL, "%s", msg);
    table_attach(r, q->slot, q->fwd);

    rt_fwd_head head;
    rt_fwd_head_wait(q->fwd, &head);
    return queue_head(q, c, &head);
}

static enum MHD_Result handle_generation(req *q, struct MHD_Connection *c) {
    pd_router *r = q->r;
    rt_stats_begin(&r->stats);
    q->generation = true;
    json_t *o;
    char why[256];
    unsigned refused =
        rt_body_parse(q->route == ROUTE_GENERATE ? RT_BODY_GENERATE : RT_BODY_COMPLETIONS, q->body,
                      q->len, &o, why, sizeof why);
    if (refused) return answer_error(q, c, refused, NULL, "%s", why);
    char rid[PD_RID_MAX];
    if (!request_rid(o, rid, sizeof rid)) {
        json_decref(o);
        return answer_error(q, c, 500, NULL, "no randomness for a request id");
    }
    bool stream = json_is_true(json_object_get(o, "stream"));
    const char *model = json_string_value(json_object_get(o, "model"));
    char model_copy[128];
    snprintf(model_copy, sizeof model_copy, "%s", model ? model : "pdserve");

    pd_err err = table_add(r, rid, &q->slot);
    if (err) {
        json_decref(o);
        if (err == PD_ERR_EXISTS)
            return answer_error(q, c, 409, NULL, "a live request already has rid %s", rid);
        if (err == PD_ERR_STATE)
            return answer_error(q, c, 503, NULL, "the router is shutting down");
        return answer_error(q, c, 429, NULL, "too many requests in flight");
    }
    if (rt_workers_pick(&r->workers, &q->prefill, &q->decode) != PD_OK) {
        json_decref(o);
        return answer_error(q, c, 503, NULL, "no healthy prefill/decode pair");
    }
    q->picked = true;
    uint64_t room;
    if (!new_room(&room)) {
        json_decref(o);
        return answer_error(q, c, 500, NULL, "no randomness for a bootstrap room");
    }
    char *body = bootstrap_body(o, &r->workers.w[q->prefill], room, rid);
    if (!body) return answer_error(q, c, 500, NULL, "out of memory");
    return forward_generation(q, c, body, rid, model_copy, stream);
}

static enum MHD_Result handle_abort(req *q, struct MHD_Connection *c) {
    pd_router *r = q->r;
    json_t *o;
    char why[256];
    unsigned refused = rt_body_parse(RT_BODY_ABORT, q->body, q->len, &o, why, sizeof why);
    if (refused) return answer_error(q, c, refused, NULL, "%s", why);
    json_t *rid = json_object_get(o, "rid");
    bool abort_all = json_is_true(json_object_get(o, "abort_all"));
    char rid_copy[PD_RID_MAX] = "";
    if (!abort_all) snprintf(rid_copy, sizeof rid_copy, "%s", json_string_value(rid));
    json_decref(o);

    /* The router's own requests first: none can slip past, and those whose
     * workers have not registered the rid yet are ended by their forward. */
    size_t requests = table_flag_abort(r, abort_all ? NULL : rid_copy);

    json_t *fwd = abort_all ? json_pack("{s:b}", "abort_all", 1)
                            : json_pack("{s:s}", "rid", rid_copy);
    char *fwd_body = fwd ? json_dumps(fwd, JSON_COMPACT) : NULL;
    json_decref(fwd);
    if (!fwd_body) return answer_error(q, c, 500, NULL, "out of memory");
    size_t n = r->workers.count;
    rt_post *posts = calloc(n, sizeof *posts);
    if (!posts) {
        free(fwd_body);
        return answer_error(q, c, 500, NULL, "out of memory");
    }
    for (size_t i = 0; i < n; i++)
        snprintf(posts[i].url, sizeof posts[i].url, "%s/abort_request", r->workers.w[i].url.base);
    rt_fanout_post(posts, n, fwd_body, r->cfg.abort_timeout_ms, r->cfg.connect_timeout_ms);
    free(fwd_body);
    rt_stats_aborts_sent(&r->stats, n);

    long long total = 0;
    json_t *per = json_array();
    for (size_t i = 0; i < n; i++) {
        long long a = posts[i].status == 200 && posts[i].aborted > 0 ? posts[i].aborted : 0;
        total += a;
        json_array_append_new(per,
                              json_pack("{s:s, s:s, s:i, s:I}", "url", r->workers.w[i].url.base,
                                        "role", rt_role_name(r->workers.w[i].role), "status",
                                        (int)posts[i].status, "aborted", (json_int_t)a));
    }
    free(posts);
    if (!abort_all && total == 0 && requests == 0) {
        json_decref(per);
        return answer_error(q, c, 404, NULL, "no live request has rid %s", rid_copy);
    }
    return answer_json(q, c, 200,
                       json_pack("{s:I, s:I, s:o}", "aborted", (json_int_t)total, "requests",
                                 (json_int_t)requests, "workers", per));
}

static json_t *workers_json(pd_router *r) {
    rt_worker *snap = malloc(r->workers.count * sizeof *snap);
    json_t *arr = json_array();
    if (!snap) return arr;
    rt_workers_snapshot(&r->workers, snap);
    for (size_t i = 0; i < r->workers.count; i++) {
        const rt_worker *w = &snap[i];
        json_t *o = json_pack(
            "{s:s, s:s, s:b, s:i, s:I, s:I, s:I, s:I, s:I}", "url", w->url.base, "role",
            rt_role_name(w->role), "healthy", w->healthy, "consecutive_probe_failures",
            (int)w->probe_failures_consecutive, "in_flight", (json_int_t)w->in_flight, "requests",
            (json_int_t)w->requests_total, "failures", (json_int_t)w->failures_total, "probes",
            (json_int_t)w->probes_total, "probe_failures", (json_int_t)w->probe_failures_total);
        if (o && w->role == RT_PREFILL) {
            json_object_set_new(o, "bootstrap_host", json_string(w->url.host));
            json_object_set_new(o, "bootstrap_port", json_integer(w->url.bootstrap_port));
        }
        json_array_append_new(arr, o);
    }
    free(snap);
    return arr;
}

static enum MHD_Result handle_server_info(req *q, struct MHD_Connection *c) {
    pd_router *r = q->r;
    const pd_router_config *k = &r->cfg;
    json_t *cfg = json_pack(
        "{s:s, s:i, s:s, s:i, s:I, s:I, s:i, s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "host", k->host,
        "port", (int)r->port, "policy", pd_router_policy_name(k->policy), "bootstrap_port",
        (int)k->bootstrap_port, "health_interval_ms", (json_int_t)k->health_interval_ms,
        "health_timeout_ms", (json_int_t)k->health_timeout_ms, "unhealthy_after",
        (int)r->workers.unhealthy_after, "request_timeout_ms", (json_int_t)k->request_timeout_ms,
        "connect_timeout_ms", (json_int_t)k->connect_timeout_ms, "abort_timeout_ms",
        (json_int_t)k->abort_timeout_ms, "abort_grace_ms", (json_int_t)k->abort_grace_ms,
        "max_body_bytes", (json_int_t)k->max_body_bytes, "max_response_bytes",
        (json_int_t)k->max_response_bytes, "connections_max", (json_int_t)k->connections_max);
    json_object_set_new(cfg, "connections_per_ip", json_integer(k->connections_per_ip));
    json_object_set_new(cfg, "client_timeout_s", json_integer(k->client_timeout_s));
    json_t *o = json_pack("{s:s, s:s, s:o, s:b, s:o, s:o}", "role", "router", "version", PD_VERSION,
                          "config", cfg, "healthy_pair", rt_workers_have_pair(&r->workers),
                          "workers", workers_json(r), "counters", rt_stats_json(&r->stats));
    return answer_json(q, c, 200, o);
}

static enum MHD_Result handle_metrics(req *q, struct MHD_Connection *c) {
    pd_router *r = q->r;
    size_t cap = 8192 + r->workers.count * 1024;
    char *buf = malloc(cap);
    if (!buf) return answer_error(q, c, 500, NULL, "out of memory");
    rt_worker *snap = malloc(r->workers.count * sizeof *snap);
    if (!snap) {
        free(buf);
        return answer_error(q, c, 500, NULL, "out of memory");
    }
    pd_strbuf sb;
    pd_strbuf_init(&sb, buf, cap);
    rt_workers_snapshot(&r->workers, snap);
    static const char *families[][2] = {
        {"pdserve_router_worker_healthy", "gauge"},
        {"pdserve_router_worker_requests_running", "gauge"},
        {"pdserve_router_worker_requests_total", "counter"},
        {"pdserve_router_worker_failures_total", "counter"},
        {"pdserve_router_worker_probe_failures_total", "counter"},
    };
    for (size_t f = 0; f < PD_ARRAY_LEN(families); f++) {
        pd_strbuf_printf(&sb, "# TYPE %s %s\n", families[f][0], families[f][1]);
        for (size_t i = 0; i < r->workers.count; i++) {
            const rt_worker *w = &snap[i];
            unsigned long long v = f == 0   ? (unsigned long long)w->healthy
                                   : f == 1 ? (unsigned long long)w->in_flight
                                   : f == 2 ? (unsigned long long)w->requests_total
                                   : f == 3 ? (unsigned long long)w->failures_total
                                            : (unsigned long long)w->probe_failures_total;
            pd_strbuf_printf(&sb, "%s{worker=\"%s\",role=\"%s\"} %llu\n", families[f][0],
                             w->url.base, rt_role_name(w->role), v);
        }
    }
    pd_strbuf_printf(&sb,
                     "# TYPE pdserve_router_healthy_pair gauge\npdserve_router_healthy_pair %d\n",
                     rt_workers_have_pair(&r->workers) ? 1 : 0);
    rt_stats_prometheus(&r->stats, &sb);
    q->status = 200;
    q->answered = true;
    enum MHD_Result ret =
        pd_http_queue_text(c, 200, "text/plain; version=0.0.4", sb.data, sb.len);
    free(snap);
    free(buf);
    return ret;
}

/* ---- libmicrohttpd callbacks ----------------------------------------------------- */

static enum MHD_Result answer_too_large(req *q, struct MHD_Connection *c) {
    if (q->route == ROUTE_GENERATE || q->route == ROUTE_COMPLETIONS) {
        rt_stats_begin(&q->r->stats);
        q->generation = true;
    }
    return answer_error(q, c, 413, NULL, "the body is larger than %zu bytes",
                        q->r->cfg.max_body_bytes);
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **req_cls) {
    pd_router *r = cls;
    req *q = *req_cls;
    if (!q) {
        q = calloc(1, sizeof *q);
        if (!q) return MHD_NO;
        q->r = r;
        q->slot = -1;
        q->route = find_route(url);
        q->start_ms = rt_now_ms();
        *req_cls = q;
        /* Framing a proxy could read otherwise: refused before the body. */
        const char *ambiguous = pd_http_ambiguous(c, version);
        if (ambiguous) return answer_error(q, c, 400, NULL, "%s", ambiguous);
        /* A declared length over the limit is refused before reading it. */
        const char *cl =
            MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
        if (cl) {
            char *end;
            errno = 0;
            unsigned long long v = strtoull(cl, &end, 10);
            if (errno || *end || v > r->cfg.max_body_bytes) q->too_large = true;
        }
        /* Refused before a byte of the body is read (MHD then closes the
         * connection instead of reading the rest). */
        if (q->too_large && q->route != ROUTE_NONE && !strcmp(method, routes[q->route].method))
            return answer_too_large(q, c);
        return MHD_YES;
    }
    if (*upload_data_size > 0) {
        if (!q->answered) body_append(q, upload_data, *upload_data_size);
        *upload_data_size = 0;
        return MHD_YES;
    }
    if (q->answered) return MHD_YES;
    if (q->route == ROUTE_NONE) return answer_error(q, c, 404, NULL, "unknown path %.200s", url);
    if (strcmp(method, routes[q->route].method))
        return answer_error(q, c, 405, routes[q->route].method, "%s takes %s, not %.16s",
                            routes[q->route].path, routes[q->route].method, method);
    if (q->too_large) return answer_too_large(q, c);
    switch (q->route) {
    case ROUTE_GENERATE:
    case ROUTE_COMPLETIONS: return handle_generation(q, c);
    case ROUTE_ABORT: return handle_abort(q, c);
    case ROUTE_HEALTH:
        if (!rt_workers_have_pair(&r->workers))
            return answer_error(q, c, 503, NULL, "no healthy prefill/decode pair");
        return answer_json(q, c, 200, json_pack("{s:s}", "status", "ok"));
    case ROUTE_SERVER_INFO: return handle_server_info(q, c);
    case ROUTE_METRICS: return handle_metrics(q, c);
    case ROUTE_NONE: break;
    }
    return MHD_NO;
}

static void on_completed(void *cls, struct MHD_Connection *c, void **req_cls,
                         enum MHD_RequestTerminationCode toe) {
    (void)c, (void)toe;
    pd_router *r = cls;
    req *q = *req_cls;
    if (!q) return;
    *req_cls = NULL;
    unsigned status = q->status;
    if (q->fwd) {
        rt_fwd_close(q->fwd);
        status = rt_fwd_outcome(q->fwd);
        rt_stats_aborts_sent(&r->stats, rt_fwd_aborts_sent(q->fwd));
    } else if (q->generation && !q->answered) {
        status = RT_STATUS_CLIENT_GONE;
    }
    release_workers(q);
    /* Off the table before the forward goes: an abort may hold a pointer. */
    if (q->slot >= 0) table_remove(r, q->slot);
    rt_fwd_destroy(q->fwd);
    record_outcome(q, status);
    free(q->body);
    free(q);
}

/* ---- start / stop ------------------------------------------------------------------- */

pd_err pd_router_start(pd_router *r, char *msg, size_t msg_cap) {
    if (r->started) return pd_errorf(msg, msg_cap, PD_ERR_STATE, "the router is already started");
    struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                             .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
    struct addrinfo *ai = NULL;
    char port[8];
    snprintf(port, sizeof port, "%u", (unsigned)r->cfg.port);
    int gai = getaddrinfo(r->host, port, &hints, &ai);
    if (gai != 0 || !ai)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "cannot resolve listen host '%s': %s",
                         r->host, gai_strerror(gai));
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_THREAD_PER_CONNECTION |
        MHD_USE_POLL | MHD_USE_ERROR_LOG;
    if (ai->ai_family == AF_INET6) flags |= MHD_USE_IPv6;
    r->mhd = MHD_start_daemon(
        flags, r->cfg.port, NULL, NULL, on_request, r, MHD_OPTION_SOCK_ADDR, ai->ai_addr,
        MHD_OPTION_NOTIFY_COMPLETED, on_completed, r, MHD_OPTION_CONNECTION_LIMIT,
        (unsigned)r->cfg.connections_max, MHD_OPTION_LISTENING_ADDRESS_REUSE, 1u,
        MHD_OPTION_UNESCAPE_CALLBACK, pd_http_unescape, NULL,
        /* No client holds a slot by staying silent, and no
                               * one address takes them all. */
        MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)r->cfg.client_timeout_s,
        MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)r->cfg.connections_per_ip, MHD_OPTION_END);
    freeaddrinfo(ai);
    if (!r->mhd)
        return pd_errorf(msg, msg_cap, PD_ERR_IO, "cannot listen on %s:%u (in use? not local?)",
                         r->host, (unsigned)r->cfg.port);
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(r->mhd, MHD_DAEMON_INFO_BIND_PORT);
    r->port = di ? di->port : r->cfg.port;
    pd_err err = rt_health_start(&r->health, &r->workers, r->cfg.health_interval_ms,
                                 r->cfg.health_timeout_ms, r->cfg.connect_timeout_ms, msg, msg_cap);
    if (err) {
        MHD_stop_daemon(r->mhd);
        r->mhd = NULL;
        return err;
    }
    r->started = true;
    return PD_OK;
}

void pd_router_stop(pd_router *r) {
    if (!r->started || r->stopped) return;
    r->stopped = true;
    pthread_mutex_lock(&r->table_mu);
    r->stopping = true;
    for (size_t i = 0; i < r->cfg.connections_max; i++)
        if (r->slots[i].used && r->slots[i].fwd) rt_fwd_request_shutdown(r->slots[i].fwd);
    pthread_mutex_unlock(&r->table_mu);
    /* The flagged forwards abort their halves and answer 503; give them the
     * time to do so (bounded: aborts have their own timeout) before the
     * sockets are shut, so their clients get an answer, not a reset. */
    uint64_t until_ms = rt_now_ms() + 2ull * r->cfg.abort_timeout_ms + 1000;
    while (table_used(r) > 0 && rt_now_ms() < until_ms) {
        struct timespec ts = {0, 5 * 1000000L};
        nanosleep(&ts, NULL);
    }
    /* Joins every connection thread. */
    MHD_stop_daemon(r->mhd);
    r->mhd = NULL;
    rt_health_stop(&r->health);
}

void pd_router_destroy(pd_router *r) {
    if (!r) return;
    pd_router_stop(r);
    rt_stats_destroy(&r->stats);
    pthread_mutex_destroy(&r->table_mu);
    rt_workers_destroy(&r->workers);
    free(r->slots);
    free(r);
}
