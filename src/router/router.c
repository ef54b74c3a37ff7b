/*
 * The router's HTTP server: routes, request validation, the table of
 * requests in flight, and the glue between the HTTP server
 * (pd_http_server, docs/http-server.md), the upstream event loop (loop.h)
 * and a forward (forward.c).
 *
 * No request has a thread of its own (issue 13). Two kinds of threads
 * serve them all:
 *
 *   the server's loop  parses every request and makes every answer about
 *            framing, limits and deadlines itself (JSON errors; issue 10);
 *            answers the cheap routes (/health, /server_info, /metrics, 404,
 *            405); and for a generation validates the body, picks a pair,
 *            rewrites the body with the bootstrap fields and hands a new
 *            forward to the upstream loop. None of it blocks.
 *   the upstream loops  (UPSTREAM_LOOPS threads, each epoll +
 *            curl_multi_socket_action) run every forward: both halves,
 *            their aborts, the answer through the forward's sink
 *            (forward_head / forward_data / forward_end below, which call
 *            the server's answering functions, which queue bytes and wake
 *            the server's loop); and every admin route's calls to workers
 *            as a batch (client.h: /abort_request's fan-out, /flush_cache's,
 *            /v1/models and SGLang's relayed routes), answered by the
 *            batch's `done` on the loop when all are back.
 *
 * The in-flight table (one slot per possible connection, a linear scan
 * under a mutex) maps rids to forwards for the two things that reach a
 * request from outside the upstream loop: a router-level /abort_request and
 * shutdown. A slot is taken before the workers hear of the rid, so an
 * /abort_request can never miss a request that a worker already has;
 * a flag set before the forward exists is handed to it when it attaches.
 *
 * finish() is the single end of every request: for a generation it runs
 * when the forward ended (forward_end: its halves closed, its aborts back);
 * it releases the workers, frees the slot and records the outcome.
 */
#include "pdserve/router.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <netdb.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "body.h"
#include "client.h"
#include "forward.h"
#include "health.h"
#include "loop.h"
#include "pdserve/http.h"
#include "feed.h"
#include "pdserve/http_server.h"
#include "sglang.h"
#include "stats.h"
#include "workers.h"

/* Bytes of an admin answer kept when the router reads only a field or two
 * of it (aborts, flushes) or relays a short one (/v1/models). */
#define ADMIN_ANSWER_SMALL 1024u
/* Upstream loops, each a thread with its own multi handle and connection
 * cache: libcurl's cost per transfer added or removed grows with the
 * transfers and connections one multi handle holds (a linear scan of the
 * connections to the same worker), so thousands of streams are spread. */
#define UPSTREAM_LOOPS 4
/* Descriptors per client connection: its own. A stream to a pdserve decode
 * node goes through that node's feed (feed.h): one connection per (loop,
 * decode node), counted apart; the submit and the prefill half are short
 * requests on the pools, counted in the spare. A stream to a worker
 * without feeds (SGLang) holds a connection of its own to it: such
 * deployments need to lower --max-connections (docs/router.md). */
#define FDS_PER_CONNECTION 1u
#define FDS_SPARE 64u /* listeners, epoll sets, eventfds, health probes, logs */

typedef struct slot {
    bool used;
    bool abort_pending; /* flagged before the forward attached */
    char rid[PD_RID_MAX];
    rt_fwd *fwd;
} slot;

struct pd_router {
    pd_router_config cfg;
    char host[256];
    char api_key[PD_HTTP_API_KEY_MAX]; /* cfg.api_key points here ("" = none) */
    rt_workers workers;
    rt_health health;
    rt_stats stats;
    pd_http_server *srv;
    uint16_t port;
    bool started;
    bool stopped;

    rt_loop *loops[UPSTREAM_LOOPS];
    atomic_uint next_loop; /* round robin over the loops */
    /* feeds[loop][worker]: each decode node's stream feed on each loop
     * (NULL for prefill nodes) */
    rt_feed *feeds[UPSTREAM_LOOPS][2 * PD_ROUTER_WORKERS_MAX];
    atomic_ullong streams_fed; /* streams begun through a feed */

    pthread_mutex_t table_mu;
    slot *slots;   /* cfg.connections_max of them */
    bool stopping; /* guarded by table_mu */

    /* Admin routes whose batch runs on an upstream loop: the loops stop
     * only once it is 0. */
    atomic_size_t admin_live;
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
    if (cfg->request_timeout_ms == 0 || cfg->connect_timeout_ms == 0 || cfg->abort_timeout_ms == 0)
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
    if (cfg->policy > PD_ROUTER_POWER_OF_TWO)
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID, "unknown policy");
    if (cfg->api_key && cfg->api_key[0] && !pd_http_api_key_valid(cfg->api_key))
        return pd_errorf(msg, msg_cap, PD_ERR_INVALID,
                         "the API key must be 1 to %u bytes of visible ASCII",
                         PD_HTTP_API_KEY_MAX - 1);
    pd_router *r = calloc(1, sizeof *r);
    if (!r) return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    r->cfg = *cfg;
    snprintf(r->host, sizeof r->host, "%s", cfg->host);
    r->cfg.host = r->host;
    snprintf(r->api_key, sizeof r->api_key, "%s", cfg->api_key ? cfg->api_key : "");
    r->cfg.api_key = r->api_key;
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
    atomic_init(&r->admin_live, 0u);
    rt_stats_init(&r->stats);
    *out = r;
    return PD_OK;
}

/* The port is written once the server runs, whose threads may already
 * answer /server_info: read and written atomically. */
uint16_t pd_router_port(const pd_router *r) { return __atomic_load_n(&r->port, __ATOMIC_ACQUIRE); }

/* ---- ids -------------------------------------------------------------------- */

static bool random_bytes(void *buf, size_t n) {
    if (getrandom(buf, n, 0) == (ssize_t)n) return true;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    bool ok = read(fd, buf, n) == (ssize_t)n;
    close(fd);
    return ok;
}

/* A fresh room: random, non-zero, below 2^62: every JSON parser that reads
 * signed 64-bit integers (jansson among them) takes it whole, and so do the
 * rooms room + i of a request's other choices (src/node/gen.h). */
static bool new_room(uint64_t *room) {
    for (int tries = 0; tries < 8; tries++) {
        uint64_t v;
        if (!random_bytes(&v, sizeof v)) return false;
        v &= INT64_MAX >> 1;
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
    ROUTE_CHAT,
    ROUTE_ABORT,
    ROUTE_HEALTH,
    ROUTE_SERVER_INFO,
    ROUTE_METRICS,
    ROUTE_MODELS,     /* /v1/models and /v1/models/{id}: a decode node's answer */
    ROUTE_MODEL_INFO, /* SGLang's utility endpoints (sglang.c) */
    ROUTE_GET_SERVER_INFO,
    ROUTE_TOKENIZE,
    ROUTE_DETOKENIZE,
    ROUTE_FLUSH,
    ROUTE_HEALTH_GENERATE, /* a real generation: the generate path */
    ROUTE_NONE,
} route;

static const struct {
    const char *path;
    const char *method;
} routes[] = {
    [ROUTE_GENERATE] = {"/generate", "POST"},
    [ROUTE_COMPLETIONS] = {"/v1/completions", "POST"},
    [ROUTE_CHAT] = {"/v1/chat/completions", "POST"},
    [ROUTE_ABORT] = {"/abort_request", "POST"},
    [ROUTE_HEALTH] = {"/health", "GET"},
    [ROUTE_SERVER_INFO] = {"/server_info", "GET"},
    [ROUTE_METRICS] = {"/metrics", "GET"},
    [ROUTE_MODELS] = {"/v1/models", "GET"},
    [ROUTE_MODEL_INFO] = {"/get_model_info", "GET"},
    [ROUTE_GET_SERVER_INFO] = {"/get_server_info", "GET"},
    [ROUTE_TOKENIZE] = {"/tokenize", "POST"},
    [ROUTE_DETOKENIZE] = {"/detokenize", "POST"},
    [ROUTE_FLUSH] = {"/flush_cache", "GET, POST"},
    [ROUTE_HEALTH_GENERATE] = {"/health_generate", "GET"},
};

/* A route's method: one, or a list as the Allow header writes it ("GET, POST"). */
static bool method_allowed(route rt, const char *method) {
    const char *allowed = routes[rt].method;
    size_t n = strlen(method);
    for (const char *p = allowed; n > 0 && (p = strstr(p, method)); p += n)
        if ((p == allowed || p[-1] == ' ') && (p[n] == ',' || p[n] == '\0')) return true;
    return false;
}

/* The router's own /health_generate: one greedy token of a fixed prompt
 * through a prefill and decode pair, within HEALTH_GENERATE_TIMEOUT_MS. */
#define HEALTH_GENERATE_TIMEOUT_MS 5000u

typedef struct req {
    pd_router *r;
    pd_http_req *h; /* retained until finish() */
    route route;
    const char *body; /* the server's copy, NUL-terminated */
    size_t len;
    bool answered;   /* a response is queued */
    bool generation; /* counted in the stats */
    bool recorded;   /* its outcome is in the stats */
    unsigned status; /* for the stats, when no forward decides it */
    long slot;
    bool picked; /* a worker pair counts this request in flight */
    size_t prefill, decode;
    uint64_t start_ms;
    bool streaming; /* the answer is an event stream */
    rt_fwd *fwd;
    /* What /abort_request's answer needs once its batch (client.h) is back. */
    size_t *order; /* calls[k] went to worker order[k] */
    bool abort_all;
    char abort_rid[PD_RID_MAX];
    size_t abort_requests; /* the router's own requests flagged */
} req;

static route find_route(const char *url) {
    for (size_t i = 0; i < PD_ARRAY_LEN(routes); i++)
        if (!strcmp(url, routes[i].path)) return (route)i;
    if (!strncmp(url, "/v1/models/", 11)) return ROUTE_MODELS;
    return ROUTE_NONE;
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
__attribute__((format(printf, 4, 5)))
#endif
static bool
answer_error(req *q, unsigned status, const char *allow, const char *fmt, ...) {
    char message[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(message, sizeof message, fmt, ap);
    va_end(ap);
    q->status = status;
    q->answered = true;
    record_outcome(q, status);
    if (allow) pd_http_req_add_header(q->h, "Allow", allow);
    pd_http_req_respond_error(q->h, status, "%s", message);
    return true;
}

static bool answer_json(req *q, unsigned status, json_t *o) {
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!text) return answer_error(q, 500, NULL, "out of memory");
    q->status = status;
    q->answered = true;
    pd_http_req_respond_json(q->h, status, text, strlen(text));
    free(text);
    return true;
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
    /* A feed is the router's to name (feed.h), never a client's. */
    json_object_del(o, "stream_feed");
    json_object_del(o, "stream_feed_tag");
    char *body = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return body;
}

static void finish(req *q);
static void on_event(pd_http_req *h, pd_http_req_event ev, void *user);
static bool answer_probe(req *q, const rt_fwd_head *head);

/* The forward's sink (forward.h), on the upstream loop's thread. The head:
 * a FULL or GONE answer ends both halves, so the pair is released and the
 * outcome recorded before the client can read the answer. */
static void forward_head(void *user, const rt_fwd_head *head) {
    req *q = user;
    if (q->route == ROUTE_HEALTH_GENERATE && head->kind != RT_FWD_STREAM) {
        answer_probe(q, head);
        return;
    }
    q->answered = true;
    if (head->kind != RT_FWD_STREAM) {
        release_workers(q); /* both halves are over */
        record_outcome(q, rt_fwd_outcome(q->fwd));
    }
    if (head->kind == RT_FWD_GONE) return; /* nobody to answer */
    if (head->kind == RT_FWD_FULL) {
        pd_http_req_respond(q->h, head->status, head->content_type, head->body, head->body_len);
        return;
    }
    q->streaming = true;
    if (rt_fwd_fed(q->fwd)) atomic_fetch_add(&q->r->streams_fed, 1ull);
    pd_http_req_add_header(q->h, "Cache-Control", "no-cache");
    pd_http_req_stream_begin(q->h, head->status, head->content_type);
}

static int forward_data(void *user, const char *buf, size_t n) {
    req *q = user;
    pd_err err = pd_http_req_stream_write(q->h, buf, n);
    return err == PD_OK ? 0 : err == PD_ERR_NOMEM ? 1 : -1;
}

/* The forward is over: a stream gets its end (unless the client went). */
static void forward_end(void *user) {
    req *q = user;
    if (q->streaming) {
        release_workers(q);
        record_outcome(q, rt_fwd_outcome(q->fwd));
        if (rt_fwd_outcome(q->fwd) != RT_STATUS_CLIENT_GONE) pd_http_req_stream_end(q->h);
    }
    finish(q);
}

/* /health_generate: the pair's answer to the probe, judged: 200 when its
 * token came (finish_reason length or stop), else 503 quoting why not. */
static bool answer_probe(req *q, const rt_fwd_head *head) {
    release_workers(q); /* a probe's answer is never streamed: both halves are over */
    if (head->kind == RT_FWD_GONE) {
        q->answered = true; /* nobody to answer */
        return true;
    }
    json_t *o = head->kind == RT_FWD_FULL ? json_loadb(head->body, head->body_len, 0, NULL) : NULL;
    json_t *fin = json_object_get(json_object_get(o, "meta_info"), "finish_reason");
    const char *type = json_string_value(json_object_get(fin, "type"));
    const char *why = json_string_value(json_object_get(json_object_get(o, "error"), "message"));
    if (!why) why = json_string_value(json_object_get(fin, "message"));
    bool ok = head->status == 200 && type && (!strcmp(type, "length") || !strcmp(type, "stop"));
    const rt_worker *pw = &q->r->workers.w[q->prefill], *dw = &q->r->workers.w[q->decode];
    if (ok)
        answer_json(q, 200,
                    json_pack("{s:s, s:s, s:s}", "status", "ok", "prefill", pw->url.base, "decode",
                              dw->url.base));
    else
        answer_error(q, 503, NULL, "the health generation through %s and %s failed (%u, %s): %s",
                     pw->url.base, dw->url.base, head->status, type ? type : "no finish_reason",
                     why ? why : "no message");
    json_decref(o);
    return true;
}

/* The generation path's refusals: answered at once, and q stays the
 * caller's (false: no forward owns it). */
#define REFUSE(...) (answer_error(__VA_ARGS__), false)

/* Hands body (ownership included) to a new forward to the picked pair,
 * which answers with whatever head it decides. True: the forward owns q
 * from here (forward_end finishes it). */
static bool forward_generation(req *q, char *body, const char *rid, const char *model,
                               bool stream) {
    pd_router *r = q->r;
    rt_fwd_params p = {
        .api = q->route == ROUTE_GENERATE || q->route == ROUTE_HEALTH_GENERATE ? RT_FWD_GENERATE
            : q->route == ROUTE_CHAT                                           ? RT_FWD_CHAT
                                                                               : RT_FWD_COMPLETIONS,
        .rid = rid,
        .model = model,
        .stream = stream,
        .body = body,
        .body_len = strlen(body),
        .prefill_base = r->workers.w[q->prefill].url.base, /* url fields are immutable */
        .decode_base = r->workers.w[q->decode].url.base,
        .timeout_ms = q->route == ROUTE_HEALTH_GENERATE
            ? PD_MIN(r->cfg.request_timeout_ms, HEALTH_GENERATE_TIMEOUT_MS)
            : r->cfg.request_timeout_ms,
        .connect_timeout_ms = r->cfg.connect_timeout_ms,
        .abort_timeout_ms = r->cfg.abort_timeout_ms,
        .abort_grace_ms = r->cfg.abort_grace_ms,
        .max_response_bytes = r->cfg.max_response_bytes,
        .api_key = r->cfg.api_key,
    };
    unsigned li = atomic_fetch_add(&r->next_loop, 1u) % UPSTREAM_LOOPS;
    p.loop = r->loops[li];
    p.feed = stream ? r->feeds[li][q->decode] : NULL;
    p.slot = (uint32_t)q->slot;
    p.sink = (rt_fwd_sink){forward_head, forward_data, forward_end, q};
    char msg[256];
    rt_fwd *fwd;
    if (rt_fwd_create(&fwd, &p, msg, sizeof msg) != PD_OK) return REFUSE(q, 500, NULL, "%s", msg);
    q->fwd = fwd;
    table_attach(r, q->slot, fwd);
    pd_http_req_watch(q->h, on_event, q); /* a client already gone: reported now */
    rt_fwd_start(fwd);                    /* q belongs to the forward from here */
    return true;
}

/* Validates, picks a pair and forwards; true when a forward owns q. */
static bool handle_generation(req *q) {
    pd_router *r = q->r;
    bool probe = q->route == ROUTE_HEALTH_GENERATE; /* not a client's generation: no stats */
    if (!probe) rt_stats_begin(&r->stats);
    q->generation = !probe;
    json_t *o = NULL;
    char why[256];
    unsigned refused = probe ? 0
                             : rt_body_parse(q->route == ROUTE_GENERATE   ? RT_BODY_GENERATE
                                                 : q->route == ROUTE_CHAT ? RT_BODY_CHAT
                                                                          : RT_BODY_COMPLETIONS,
                                             q->body, q->len, &o, why, sizeof why);
    if (refused) return REFUSE(q, refused, NULL, "%s", why);
    if (probe)
        o = json_pack("{s:s, s:{s:i, s:f}}", "text", "health", "sampling_params", "max_new_tokens",
                      1, "temperature", 0.0);
    if (!o) return REFUSE(q, 503, NULL, "out of memory");
    char rid[PD_RID_MAX];
    if (!request_rid(o, rid, sizeof rid)) {
        json_decref(o);
        return REFUSE(q, 500, NULL, "no randomness for a request id");
    }
    bool stream = json_is_true(json_object_get(o, "stream"));
    const char *model = json_string_value(json_object_get(o, "model"));
    char model_copy[128];
    snprintf(model_copy, sizeof model_copy, "%s", model ? model : "pdserve");

    pd_err err = table_add(r, rid, &q->slot);
    if (err) {
        json_decref(o);
        if (err == PD_ERR_EXISTS)
            return REFUSE(q, 409, NULL, "a live request already has rid %s", rid);
        if (err == PD_ERR_STATE) return REFUSE(q, 503, NULL, "the router is shutting down");
        return REFUSE(q, 429, NULL, "too many requests in flight");
    }
    if (rt_workers_pick(&r->workers, &q->prefill, &q->decode) != PD_OK) {
        json_decref(o);
        return REFUSE(q, 503, NULL, "no healthy prefill/decode pair");
    }
    q->picked = true;
    uint64_t room;
    if (!new_room(&room)) {
        json_decref(o);
        return REFUSE(q, 500, NULL, "no randomness for a bootstrap room");
    }
    char *body = bootstrap_body(o, &r->workers.w[q->prefill], room, rid);
    if (!body) return REFUSE(q, 500, NULL, "out of memory");
    return forward_generation(q, body, rid, model_copy, stream);
}

/* ---- the admin routes: batches on the upstream loops ------------------------------ */

/* Starts q's calls as a batch on an upstream loop (client.h); true when the
 * batch owns q (its `done` ends with admin_end). Takes calls. */
static bool admin_batch(req *q, rt_call *calls, size_t n, size_t first_stage, const char *body,
                        size_t body_len, uint32_t timeout_ms, size_t cap, rt_batch_done done) {
    pd_router *r = q->r;
    rt_batch_params p = {
        .loop = r->loops[atomic_fetch_add(&r->next_loop, 1u) % UPSTREAM_LOOPS],
        .calls = calls,
        .n = n,
        .first_stage = first_stage,
        .body = body,
        .body_len = body_len,
        .timeout_ms = timeout_ms,
        .connect_timeout_ms = r->cfg.connect_timeout_ms,
        .api_key = r->cfg.api_key,
        .cap = cap,
        .done = done,
        .user = q,
    };
    atomic_fetch_add(&r->admin_live, 1u);
    char msg[256];
    pd_err err = rt_batch_start(&p, msg, sizeof msg);
    free(calls); /* the batch has its copy */
    if (err == PD_OK) return true;
    atomic_fetch_sub(&r->admin_live, 1u);
    return answer_error(q, 500, NULL, "%s", msg), false;
}

/* The end of an admin route's batch, on its loop: q is finished. */
static void admin_end(req *q) {
    pd_router *r = q->r;
    finish(q);
    atomic_fetch_sub(&r->admin_live, 1u); /* last: pd_router_stop waits for it */
}

/* /abort_request's verdict once every worker answered (or timed out). */
static void abort_done(void *user, rt_call *calls, size_t n) {
    req *q = user;
    pd_router *r = q->r;
    rt_stats_aborts_sent(&r->stats, n);
    long long total = 0;
    json_t *per = json_array();
    for (size_t k = 0; k < n; k++) {
        const rt_worker *w = &r->workers.w[q->order[k]]; /* role and url are immutable */
        long long got = calls[k].status == 200 ? rt_call_aborted(&calls[k]) : 0;
        long long a = got > 0 ? got : 0;
        total += a;
        json_array_append_new(per,
                              json_pack("{s:s, s:s, s:i, s:I}", "url", w->url.base, "role",
                                        rt_role_name(w->role), "status", (int)calls[k].status,
                                        "aborted", (json_int_t)a));
    }
    if (!q->abort_all && total == 0 && q->abort_requests == 0) {
        json_decref(per);
        answer_error(q, 404, NULL, "no live request has rid %s", q->abort_rid);
    } else {
        answer_json(q, 200,
                    json_pack("{s:I, s:I, s:o}", "aborted", (json_int_t)total, "requests",
                              (json_int_t)q->abort_requests, "workers", per));
    }
    admin_end(q);
}

/* Flags the router's own requests, then tells every worker: a batch whose
 * answer (abort_done) comes only once the workers were told. True when the
 * batch owns q. */
static bool handle_abort(req *q) {
    pd_router *r = q->r;
    json_t *o;
    char why[256];
    unsigned refused = rt_body_parse(RT_BODY_ABORT, q->body, q->len, &o, why, sizeof why);
    if (refused) return answer_error(q, refused, NULL, "%s", why), false;
    q->abort_all = json_is_true(json_object_get(o, "abort_all"));
    if (!q->abort_all)
        snprintf(q->abort_rid, sizeof q->abort_rid, "%s",
                 json_string_value(json_object_get(o, "rid")));
    json_decref(o);

    /* The router's own requests first: none can slip past, and those whose
     * workers have not registered the rid yet are ended by their forward. */
    q->abort_requests = table_flag_abort(r, q->abort_all ? NULL : q->abort_rid);

    json_t *fwd = q->abort_all ? json_pack("{s:b}", "abort_all", 1)
                               : json_pack("{s:s}", "rid", q->abort_rid);
    char *fwd_body = fwd ? json_dumps(fwd, JSON_COMPACT) : NULL;
    json_decref(fwd);
    size_t n = r->workers.count, nd = 0;
    rt_call *calls = calloc(n, sizeof *calls);
    q->order = calloc(n, sizeof *q->order);
    if (!fwd_body || !calls || !q->order) {
        free(calls);
        free(fwd_body);
        return answer_error(q, 500, NULL, "out of memory"), false;
    }
    /* Decode nodes first, and only then prefill nodes: a prefill node that
     * stopped first would fail the room under the decode node, whose answer
     * would then be a transfer failure rather than the abort the client
     * asked for (found by tests/chaos: one abort in eight came back 500). */
    size_t k = 0;
    for (int pass = 0; pass < 2; pass++)
        for (size_t i = 0; i < n; i++)
            if ((r->workers.w[i].role == RT_DECODE) == (pass == 0)) q->order[k++] = i;
    for (k = 0; k < n; k++) {
        snprintf(calls[k].url, sizeof calls[k].url, "%s/abort_request",
                 r->workers.w[q->order[k]].url.base);
        nd += r->workers.w[q->order[k]].role == RT_DECODE;
    }
    bool owned = admin_batch(q, calls, n, nd, fwd_body, strlen(fwd_body), r->cfg.abort_timeout_ms,
                             ADMIN_ANSWER_SMALL, abort_done);
    free(fwd_body); /* the batch has its copy */
    return owned;
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
        } else if (o) {
            int open = 0;
            for (size_t li = 0; li < UPSTREAM_LOOPS; li++)
                open += r->feeds[li][i] && rt_feed_is_open(r->feeds[li][i]);
            json_object_set_new(o, "stream_feeds_open", json_integer(open));
        }
        json_array_append_new(arr, o);
    }
    free(snap);
    return arr;
}

/* /v1/models' relayed answer: the decode node's, same status, same body. */
static void models_done(void *user, rt_call *calls, size_t n) {
    req *q = user;
    PD_ASSERT(n == 1);
    const rt_call *c = &calls[0];
    /* At most ADMIN_ANSWER_SMALL bytes are kept: a cut answer is not JSON,
     * and never relayed. */
    json_t *check = c->body && !c->cut ? json_loadb(c->body, c->len, 0, NULL) : NULL;
    if (c->status < 200 || c->status > 599)
        answer_error(q, 502, NULL, "the decode node did not answer %s", c->url);
    else if (!check)
        answer_error(q, 502, NULL, "the decode node's answer to %s is not JSON", c->url);
    else {
        q->status = (unsigned)c->status;
        q->answered = true;
        pd_http_req_respond_json(q->h, (unsigned)c->status, c->body, c->len);
    }
    json_decref(check);
    admin_end(q);
}

/* /v1/models[/{id}]: the router serves what its decode nodes serve, so it
 * relays the answer of the first healthy one. True when a batch owns q. */
static bool handle_models(req *q) {
    pd_router *r = q->r;
    const char *path = pd_http_req_path(q->h);
    /* Relayed as a URL: only characters a model id needs (a decoded '?', '#'
     * or space would change what the decode node is asked). */
    for (const char *c = path; *c; c++)
        if (!isalnum((unsigned char)*c) && !strchr("/._:-", *c))
            return answer_error(q, 404, NULL, "no model is named '%.200s'", path + 11), false;
    rt_worker *snap = malloc(r->workers.count * sizeof *snap);
    rt_call *call = calloc(1, sizeof *call);
    if (!snap || !call) {
        free(snap);
        free(call);
        return answer_error(q, 500, NULL, "out of memory"), false;
    }
    rt_workers_snapshot(&r->workers, snap);
    const char *base = NULL;
    for (size_t i = 0; i < r->workers.count && !base; i++)
        if (snap[i].role == RT_DECODE && snap[i].healthy) base = snap[i].url.base;
    if (base) snprintf(call->url, sizeof call->url, "%s%.300s", base, path);
    free(snap);
    if (!base) {
        free(call);
        return answer_error(q, 503, NULL, "no healthy decode node to ask"), false;
    }
    return admin_batch(q, call, 1, 1, NULL, 0, r->cfg.connect_timeout_ms + r->cfg.abort_timeout_ms,
                       ADMIN_ANSWER_SMALL, models_done);
}

static void sglang_answer(req *q, rt_sgl_answer *a) {
    if (!a->body) {
        answer_error(q, a->status, NULL, "%s", a->message);
        return;
    }
    q->status = a->status;
    q->answered = true;
    pd_http_req_respond_json(q->h, a->status, a->body, a->len);
    free(a->body);
}

static void sglang_relay_done(void *user, rt_call *calls, size_t n) {
    req *q = user;
    PD_ASSERT(n == 1);
    rt_sgl_answer a;
    rt_sgl_relay_verdict(&calls[0], q->r->cfg.max_response_bytes, &a);
    sglang_answer(q, &a);
    admin_end(q);
}

static void sglang_flush_done(void *user, rt_call *calls, size_t n) {
    req *q = user;
    PD_ASSERT(n == q->r->workers.count);
    rt_sgl_answer a;
    rt_sgl_flush_verdict(&q->r->workers, calls, &a);
    sglang_answer(q, &a);
    admin_end(q);
}

/* SGLang's utility endpoints but /health_generate: relayed to one worker,
 * or /flush_cache to all. True when a batch owns q. */
static bool handle_sglang(req *q) {
    pd_router *r = q->r;
    uint32_t timeout_ms = r->cfg.connect_timeout_ms + r->cfg.abort_timeout_ms;
    size_t n = q->route == ROUTE_FLUSH ? r->workers.count : 1;
    rt_call *calls = calloc(n, sizeof *calls);
    if (!calls) return answer_error(q, 500, NULL, "out of memory"), false;
    if (q->route == ROUTE_FLUSH) {
        rt_sgl_flush_calls(&r->workers, calls);
        return admin_batch(q, calls, n, n, "{}", 2, timeout_ms, ADMIN_ANSWER_SMALL,
                           sglang_flush_done);
    }
    rt_sgl_answer a;
    bool decode_only = q->route == ROUTE_MODEL_INFO || q->route == ROUTE_GET_SERVER_INFO;
    if (!rt_sgl_relay_url(&r->workers, decode_only, routes[q->route].path, calls[0].url,
                          sizeof calls[0].url, &a)) {
        free(calls);
        sglang_answer(q, &a);
        return false;
    }
    bool post = !strcmp(pd_http_req_method(q->h), "POST");
    return admin_batch(q, calls, 1, 1, post ? q->body : NULL, post ? q->len : 0, timeout_ms,
                       r->cfg.max_response_bytes, sglang_relay_done);
}

static bool handle_server_info(req *q) {
    pd_router *r = q->r;
    const pd_router_config *k = &r->cfg;
    json_t *cfg = json_pack(
        "{s:s, s:i, s:s, s:i, s:I, s:I, s:i, s:I, s:I, s:I, s:I, s:I, s:I, s:I}", "host", k->host,
        "port", (int)pd_router_port(r), "policy", pd_router_policy_name(k->policy),
        "bootstrap_port", (int)k->bootstrap_port, "health_interval_ms",
        (json_int_t)k->health_interval_ms, "health_timeout_ms", (json_int_t)k->health_timeout_ms,
        "unhealthy_after", (int)r->workers.unhealthy_after, "request_timeout_ms",
        (json_int_t)k->request_timeout_ms, "connect_timeout_ms", (json_int_t)k->connect_timeout_ms,
        "abort_timeout_ms", (json_int_t)k->abort_timeout_ms, "abort_grace_ms",
        (json_int_t)k->abort_grace_ms, "max_body_bytes", (json_int_t)k->max_body_bytes,
        "max_response_bytes", (json_int_t)k->max_response_bytes, "connections_max",
        (json_int_t)k->connections_max);
    json_object_set_new(cfg, "connections_per_ip", json_integer(k->connections_per_ip));
    json_object_set_new(cfg, "client_timeout_s", json_integer(k->client_timeout_s));
    json_t *o = json_pack("{s:s, s:s, s:o, s:b, s:o, s:o}", "role", "router", "version", PD_VERSION,
                          "config", cfg, "healthy_pair", rt_workers_have_pair(&r->workers),
                          "workers", workers_json(r), "counters", rt_stats_json(&r->stats));
    json_t *ctr = json_object_get(o, "counters");
    if (ctr)
        json_object_set_new(ctr, "streams_fed",
                            json_integer((json_int_t)atomic_load(&r->streams_fed)));
    return answer_json(q, 200, o);
}

static bool handle_metrics(req *q) {
    pd_router *r = q->r;
    size_t cap = 8192 + r->workers.count * 1024;
    char *buf = malloc(cap);
    if (!buf) return answer_error(q, 500, NULL, "out of memory");
    rt_worker *snap = malloc(r->workers.count * sizeof *snap);
    if (!snap) {
        free(buf);
        return answer_error(q, 500, NULL, "out of memory");
    }
    pd_strbuf sb;
    pd_strbuf_init(&sb, buf, cap);
    rt_workers_snapshot(&r->workers, snap);
    static const char *families[][3] = {
        {"pdserve_router_worker_healthy", "gauge", "1 while the worker passes its health probes."},
        {"pdserve_router_worker_requests_running", "gauge",
         "Requests the router has in flight on the worker."},
        {"pdserve_router_worker_requests_total", "counter", "Requests sent to the worker."},
        {"pdserve_router_worker_failures_total", "counter",
         "Requests the worker failed (transport errors and 5xx)."},
        {"pdserve_router_worker_probe_failures_total", "counter",
         "Health probes the worker failed."},
    };
    for (size_t f = 0; f < PD_ARRAY_LEN(families); f++) {
        pd_strbuf_printf(&sb, "# HELP %s %s\n# TYPE %s %s\n", families[f][0], families[f][2],
                         families[f][0], families[f][1]);
        for (size_t i = 0; i < r->workers.count; i++) {
            const rt_worker *w = &snap[i];
            unsigned long long v = f == 0 ? (unsigned long long)w->healthy
                : f == 1                  ? (unsigned long long)w->in_flight
                : f == 2                  ? (unsigned long long)w->requests_total
                : f == 3                  ? (unsigned long long)w->failures_total
                                          : (unsigned long long)w->probe_failures_total;
            pd_strbuf_printf(&sb, "%s{worker=\"%s\",role=\"%s\"} %llu\n", families[f][0],
                             w->url.base, rt_role_name(w->role), v);
        }
    }
    pd_strbuf_printf(&sb,
                     "# HELP pdserve_router_healthy_pair 1 while at least one healthy prefill and "
                     "decode pair exists.\n"
                     "# TYPE pdserve_router_healthy_pair gauge\npdserve_router_healthy_pair %d\n",
                     rt_workers_have_pair(&r->workers) ? 1 : 0);
    rt_stats_prometheus(&r->stats, &sb);
    q->status = 200;
    q->answered = true;
    pd_http_req_respond(q->h, 200, "text/plain; version=0.0.4", sb.data, sb.len);
    free(snap);
    free(buf);
    return true;
}

/* ---- the server's side ------------------------------------------------------------ */

/* The server's news about the client (its loop thread, never blocks):
 * handed to the forward, which acts on it on the upstream loop. */
static void on_event(pd_http_req *h, pd_http_req_event ev, void *user) {
    (void)h;
    req *q = user;
    if (ev == PD_HTTP_REQ_GONE) rt_fwd_client_gone(q->fwd);
    else rt_fwd_writable(q->fwd);
}

/* A client that hung up before its answer is logged as a hang-up, with the
 * rid the workers know its halves by. */
static void log_hang_up(req *q) {
    pd_router *r = q->r;
    if (!r->cfg.on_log) return;
    char rid[PD_RID_MAX] = "";
    pthread_mutex_lock(&r->table_mu);
    if (q->slot >= 0) snprintf(rid, sizeof rid, "%s", r->slots[q->slot].rid);
    pthread_mutex_unlock(&r->table_mu);
    json_t *o = json_pack("{s:s?, s:s, s:s, s:i, s:f, s:b, s:s}", "rid", rid[0] ? rid : NULL,
                          "role", "router", "outcome", "aborted", "status", 499, "e2e_ms",
                          (double)(rt_now_ms() - q->start_ms), "client_hung_up", 1, "message",
                          "the client hung up");
    char *line = o ? json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
    json_decref(o);
    if (line) r->cfg.on_log(r->cfg.on_log_ctx, line);
    free(line);
}

/* The single end of every request. */
static void finish(req *q) {
    pd_router *r = q->r;
    pd_http_req_watch(q->h, NULL, NULL); /* waits out a callback in flight */
    unsigned status = q->status;
    if (q->fwd) {
        status = rt_fwd_outcome(q->fwd);
        rt_stats_aborts_sent(&r->stats, rt_fwd_aborts_sent(q->fwd));
    } else if (q->generation && !q->answered) {
        status = RT_STATUS_CLIENT_GONE;
    }
    release_workers(q);
    if (q->generation && status == RT_STATUS_CLIENT_GONE) log_hang_up(q);
    /* Off the table before the forward goes: an abort may hold a pointer
     * (and rt_fwd_destroy drops a poke that came meanwhile). */
    if (q->slot >= 0) table_remove(r, q->slot);
    rt_fwd_destroy(q->fwd);
    record_outcome(q, status);
    if (!q->answered) pd_http_req_respond_error(q->h, 500, "the router could not answer");
    pd_http_req_release(q->h);
    free(q->order);
    free(q);
}

/* Answers the cheap routes here, on the loop thread. */
static void answer_here(req *q) {
    pd_router *r = q->r;
    const char *path = pd_http_req_path(q->h), *method = pd_http_req_method(q->h);
    if (q->route == ROUTE_NONE) answer_error(q, 404, NULL, "unknown path %.200s", path);
    else if (!method_allowed(q->route, method))
        answer_error(q, 405, routes[q->route].method, "%s takes %s, not %.16s",
                     routes[q->route].path, routes[q->route].method, method);
    else if (q->route == ROUTE_SERVER_INFO) handle_server_info(q);
    else if (q->route == ROUTE_METRICS) handle_metrics(q);
    else if (!rt_workers_have_pair(&r->workers))
        answer_error(q, 503, NULL, "no healthy prefill/decode pair");
    else answer_json(q, 200, json_pack("{s:s}", "status", "ok"));
}

static void on_request(pd_http_req *h, void *user) {
    pd_router *r = user;
    if (!pd_http_req_authorize(h, r->cfg.api_key)) return; /* 401 answered */
    req *q = calloc(1, sizeof *q);
    if (!q) {
        pd_http_req_respond_error(h, 503, "out of memory");
        return;
    }
    q->r = r;
    q->h = h;
    q->slot = -1;
    q->route = find_route(pd_http_req_path(h));
    q->start_ms = rt_now_ms();
    q->body = pd_http_req_body(h, &q->len);
    pd_http_req_retain(h);
    bool allowed = q->route != ROUTE_NONE && method_allowed(q->route, pd_http_req_method(h));
    bool generation = q->route == ROUTE_GENERATE || q->route == ROUTE_COMPLETIONS ||
        q->route == ROUTE_CHAT || q->route == ROUTE_HEALTH_GENERATE;
    bool admin = q->route == ROUTE_ABORT || q->route == ROUTE_MODELS ||
        (q->route >= ROUTE_MODEL_INFO && q->route < ROUTE_HEALTH_GENERATE);
    if (allowed && admin) {
        bool owned = q->route == ROUTE_ABORT ? handle_abort(q)
            : q->route == ROUTE_MODELS       ? handle_models(q)
                                             : handle_sglang(q);
        if (owned) return; /* q is the batch's now */
    } else if (allowed && generation) {
        if (handle_generation(q)) return; /* q is the forward's now */
    } else {
        answer_here(q);
    }
    finish(q);
}

/* ---- start / stop ------------------------------------------------------------------- */

/* Raises RLIMIT_NOFILE's soft limit to the hard one (a process-wide
 * setting: the router is what the process is for) and checks that the
 * connections the router is configured for fit in it. */
static pd_err raise_fd_limit(const pd_router *r, char *msg, size_t msg_cap) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return pd_errorf(msg, msg_cap, PD_ERR_IO, "getrlimit(RLIMIT_NOFILE) failed");
    if (rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0) getrlimit(RLIMIT_NOFILE, &rl);
    }
    uint64_t feeds = (uint64_t)UPSTREAM_LOOPS * (r->workers.count - r->workers.prefill_count);
    uint64_t spare = FDS_SPARE + feeds;
    uint64_t need = (uint64_t)r->cfg.connections_max * FDS_PER_CONNECTION + spare;
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < need)
        return pd_errorf(
            msg, msg_cap, PD_ERR_INVALID,
            "the open-file limit (RLIMIT_NOFILE) is %llu, but %u client connections "
            "need %llu descriptors (%u each, plus %llu stream feeds and %u); raise it "
            "(ulimit -n, or the hard limit as root) or lower --max-connections to %llu",
            (unsigned long long)rl.rlim_cur, r->cfg.connections_max, (unsigned long long)need,
            FDS_PER_CONNECTION, (unsigned long long)feeds, FDS_SPARE,
            rl.rlim_cur > spare ? (unsigned long long)((rl.rlim_cur - spare) / FDS_PER_CONNECTION)
                                : 0ull);
    return PD_OK;
}

static void stop_threads(pd_router *r) {
    for (size_t i = 0; i < UPSTREAM_LOOPS; i++) {
        for (size_t w = 0; w < r->workers.count; w++) {
            rt_feed_destroy(r->feeds[i][w]);
            r->feeds[i][w] = NULL;
        }
        rt_loop_stop(r->loops[i]);
        r->loops[i] = NULL;
    }
}

/* One feed per (loop, decode node), opened at once (feed.h). */
static pd_err start_feeds(pd_router *r, size_t li, char *msg, size_t msg_cap) {
    for (size_t w = r->workers.prefill_count; w < r->workers.count; w++) {
        rt_feed_params fp = {
            .loop = r->loops[li],
            .base = r->workers.w[w].url.base, /* immutable */
            .api_key = r->cfg.api_key,
            .connect_timeout_ms = r->cfg.connect_timeout_ms,
            .slots = r->cfg.connections_max,
        };
        pd_err err = rt_feed_create(&r->feeds[li][w], &fp, msg, msg_cap);
        if (err) return err;
        rt_feed_start(r->feeds[li][w]);
    }
    return PD_OK;
}

static pd_err start_threads(pd_router *r, char *msg, size_t msg_cap) {
    pd_err err = PD_OK;
    for (size_t i = 0; i < UPSTREAM_LOOPS && !err; i++) {
        err = rt_loop_start(&r->loops[i], msg, msg_cap);
        if (!err) err = start_feeds(r, i, msg, msg_cap);
    }
    if (err) stop_threads(r);
    return err;
}

pd_err pd_router_start(pd_router *r, char *msg, size_t msg_cap) {
    if (r->started) return pd_errorf(msg, msg_cap, PD_ERR_STATE, "the router is already started");
    pd_http_server_config hc;
    pd_http_server_config_default(&hc);
    hc.host = r->host;
    hc.port = r->cfg.port;
    hc.connections_max = r->cfg.connections_max;
    hc.connections_per_ip_max = r->cfg.connections_per_ip;
    hc.body_bytes_max = r->cfg.max_body_bytes;
    /* No client holds a connection by staying silent or by trickling its
     * request: headers, body, idle time and unread answers all have
     * client_timeout_s, counted as deadlines, not inactivity. */
    uint32_t t_ms = r->cfg.client_timeout_s * 1000u;
    hc.header_timeout_ms = hc.body_timeout_ms = hc.idle_timeout_ms = hc.write_timeout_ms = t_ms;
    hc.on_request = on_request;
    hc.user = r;
    pd_err err = raise_fd_limit(r, msg, msg_cap);
    if (!err) err = start_threads(r, msg, msg_cap);
    if (err) return err;
    err = pd_http_server_start(&r->srv, &hc, msg, msg_cap);
    if (!err) {
        __atomic_store_n(&r->port, pd_http_server_port(r->srv), __ATOMIC_RELEASE);
        err = rt_health_start(&r->health, &r->workers, r->cfg.health_interval_ms,
                              r->cfg.health_timeout_ms, r->cfg.connect_timeout_ms, msg, msg_cap);
        if (err) pd_http_server_stop(r->srv);
    }
    if (err) {
        r->srv = NULL;
        stop_threads(r);
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
    /* Ends every connection (a forward still running sees its client
     * gone), then waits for the forwards and the admin batches to end (each
     * is bounded by its timeouts) before their loops stop. */
    pd_http_server_stop(r->srv);
    r->srv = NULL;
    while (table_used(r) > 0 || atomic_load(&r->admin_live) > 0) {
        struct timespec ts = {0, 5 * 1000000L};
        nanosleep(&ts, NULL);
    }
    stop_threads(r);
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
