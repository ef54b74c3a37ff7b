/*
 * bench/router_streams — the two ends of the router's many-streams
 * benchmark (bench/router.sh), each one epoll loop on one thread:
 *
 *   router_streams worker PORT prefill|decode
 *       A stand-in prefill or decode node that holds any number of
 *       connections (pdserve's nodes take 4096 each): GET /health answers
 *       200; POST /abort_request answers {"aborted":0}; a prefill node
 *       answers POST /generate with the hand-off at once; a decode node
 *       answers one with "stream":true with an event stream, one token event
 *       a second, never final, and any other with a final answer at once.
 *       Keep-alive throughout. A decode node also serves stream feeds as
 *       pdserve's do (docs/http-api.md#stream-feeds): GET /stream_feed
 *       opens one (its id: the connection's descriptor), and a stream
 *       submitted with "stream_feed" is answered 202 and gets its token
 *       events on that feed, framed by its "stream_feed_tag", all of one
 *       feed's frames of a second in one chunk; /abort_request {"rid"} stops
 *       the stream of that rid.
 *
 *   router_streams clients PORT N HOLD_S [PID]
 *       Opens N streaming /generate requests (max_new_tokens 100000,
 *       ignore_eos) to 127.0.0.1:PORT, holds them HOLD_S seconds, then
 *       prints how many got their 200 head and a first event, how many
 *       failed, and PID's resident memory (VmRSS, VmHWM from /proc), thread
 *       and descriptor counts.
 *
 * Not a test: it prints figures and asserts nothing about time.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define BUF_BYTES 8192
#define EVENTS_MAX 512

typedef struct conn {
    int fd;
    char in[BUF_BYTES];
    size_t len;
    bool streaming; /* worker: sends a token a second */
    bool head_seen; /* client: "200" head */
    bool event_seen;
    bool failed;
} conn;

static uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void raise_nofile(void) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

static void send_all(int fd, const char *s, size_t n) {
    while (n > 0) {
        ssize_t w = send(fd, s, n, MSG_NOSIGNAL);
        if (w <= 0) return; /* a bench: a peer that went is not an error here */
        s += w;
        n -= (size_t)w;
    }
}

/* ---- worker ---------------------------------------------------------------- */

/* Streams on feeds: the feed's descriptor, the tag its frames carry, the
 * rid an abort names. */
#define FED_MAX (1u << 17)
typedef struct fed_stream {
    int feed_fd; /* -1: free */
    char tag[48];
    char rid[64];
} fed_stream;
static fed_stream *fed;
static size_t fed_n;

static void answer(conn *c, const char *status, const char *body);

/* The string value of "key":"..." in body (a compact JSON the router wrote). */
static bool json_str(const char *body, size_t len, const char *key, char *out, size_t cap) {
    char pat[64];
    int k = snprintf(pat, sizeof pat, "\"%s\":\"", key);
    const char *p = memmem(body, len, pat, (size_t)k);
    if (!p) return false;
    p += k;
    const char *q = memchr(p, '"', len - (size_t)(p - body));
    if (!q || (size_t)(q - p) >= cap) return false;
    memcpy(out, p, (size_t)(q - p));
    out[q - p] = '\0';
    return true;
}

static void fed_add(conn **conns, size_t cap, const char *body, size_t len, conn *c) {
    char id[32];
    fed_stream s = {.feed_fd = -1};
    if (!json_str(body, len, "stream_feed", id, sizeof id) ||
        !json_str(body, len, "stream_feed_tag", s.tag, sizeof s.tag) ||
        !json_str(body, len, "rid", s.rid, sizeof s.rid) || fed_n == FED_MAX) {
        answer(c, "400 Bad Request", "{}");
        return;
    }
    s.feed_fd = atoi(id);
    if (s.feed_fd < 0 || (size_t)s.feed_fd >= cap || !conns[s.feed_fd]) {
        answer(c, "400 Bad Request", "{}");
        return;
    }
    size_t i = 0;
    while (i < fed_n && fed[i].feed_fd >= 0) i++;
    if (i == fed_n) fed_n++;
    fed[i] = s;
    answer(c, "202 Accepted", "{}");
}

static void fed_abort(const char *body, size_t len) {
    char rid[64];
    if (!json_str(body, len, "rid", rid, sizeof rid)) return;
    for (size_t i = 0; i < fed_n; i++)
        if (fed[i].feed_fd >= 0 && !strcmp(fed[i].rid, rid)) fed[i].feed_fd = -1;
}

static void answer(conn *c, const char *status, const char *body) {
    char buf[512];
    int n =
        snprintf(buf, sizeof buf,
                 "HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
                 status, strlen(body), body);
    send_all(c->fd, buf, (size_t)n);
}

/* One complete request at the start of c->in: answered, and consumed.
 * False while it is incomplete. */
static bool decode_role;
static conn **worker_conns;
static size_t worker_cap;

static bool worker_request(conn *c) {
    c->in[c->len < BUF_BYTES ? c->len : BUF_BYTES - 1] = '\0';
    char *end = strstr(c->in, "\r\n\r\n");
    if (!end) return false;
    const char *cl = strcasestr(c->in, "content-length:");
    size_t body_len = cl && cl < end ? strtoul(cl + 15, NULL, 10) : 0;
    size_t total = (size_t)(end + 4 - c->in) + body_len;
    if (c->len < total) return false;
    char *body = end + 4;
    bool stream = decode_role && memmem(body, body_len, "\"stream\":true", 13) != NULL;
    bool on_feed = stream && memmem(body, body_len, "\"stream_feed\":", 14) != NULL;
    if (!strncmp(c->in, "GET /health", 11)) {
        answer(c, "200 OK", "{}");
    } else if (!strncmp(c->in, "POST /abort_request", 19)) {
        fed_abort(body, body_len);
        answer(c, "200 OK", "{\"aborted\":0}");
    } else if (!strncmp(c->in, "GET /stream_feed", 16) && decode_role) {
        char head[256];
        int n = snprintf(head, sizeof head,
                         "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         "X-Stream-Feed: %d\r\nTransfer-Encoding: chunked\r\n\r\n",
                         c->fd);
        /* Blocking writes: a feed's chunk must go out whole. */
        fcntl(c->fd, F_SETFL, fcntl(c->fd, F_GETFL) & ~O_NONBLOCK);
        send_all(c->fd, head, (size_t)n);
    } else if (!strncmp(c->in, "POST /generate", 14) && on_feed) {
        fed_add(worker_conns, worker_cap, body, body_len, c);
    } else if (!strncmp(c->in, "POST /generate", 14) && stream) {
        static const char head[] = "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                   "Transfer-Encoding: chunked\r\n\r\n";
        send_all(c->fd, head, sizeof head - 1);
        c->streaming = true;
    } else if (!strncmp(c->in, "POST /generate", 14)) {
        answer(
            c, "200 OK",
            decode_role
                ? "{\"text\":\"x\",\"meta_info\":{\"finish_reason\":{\"type\":\"length\"}}}"
                : "{\"text\":\"\",\"meta_info\":{\"finish_reason\":{\"type\":\"transferred\"}}}");
    } else {
        answer(c, "404 Not Found", "{}");
    }
    memmove(c->in, c->in + total, c->len - total);
    c->len -= total;
    return true;
}

static void token_to_all(conn **conns, size_t cap) {
    static const char ev[] = "data: {\"text\":\"x\",\"meta_info\":{\"finish_reason\":null}}\n\n";
    char chunk[128];
    int n = snprintf(chunk, sizeof chunk, "%zx\r\n%s\r\n", sizeof ev - 1, ev);
    for (size_t i = 0; i < cap; i++)
        if (conns[i] && conns[i]->streaming) send_all(conns[i]->fd, chunk, (size_t)n);
}

/* Every fed stream's token event, one chunk per feed (a few feeds). */
#define FEEDS_MAX 64
static void token_to_feeds(void) {
    static const char ev[] = "data: {\"text\":\"x\",\"meta_info\":{\"finish_reason\":null}}\n\n";
    static struct {
        int fd;
        char *buf;
        size_t len, cap;
    } out[FEEDS_MAX];
    size_t n_out = 0;
    for (size_t i = 0; i < fed_n; i++) {
        if (fed[i].feed_fd < 0) continue;
        size_t k = 0;
        while (k < n_out && out[k].fd != fed[i].feed_fd) k++;
        if (k == FEEDS_MAX) continue;
        if (k == n_out) {
            out[n_out].fd = fed[i].feed_fd;
            out[n_out++].len = 0;
        }
        if (out[k].len + 128 + sizeof ev > out[k].cap) {
            out[k].cap = out[k].cap ? 2 * out[k].cap : 1u << 20;
            out[k].buf = realloc(out[k].buf, out[k].cap);
        }
        out[k].len += (size_t)snprintf(out[k].buf + out[k].len, out[k].cap - out[k].len,
                                       "id: %s\n%s", fed[i].tag, ev);
    }
    for (size_t k = 0; k < n_out; k++) {
        char size[32];
        int n = snprintf(size, sizeof size, "%zx\r\n", out[k].len);
        send_all(out[k].fd, size, (size_t)n);
        send_all(out[k].fd, out[k].buf, out[k].len);
        send_all(out[k].fd, "\r\n", 2);
    }
}

static int listen_on(int port) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(fd, (struct sockaddr *)&sa, sizeof sa) != 0 || listen(fd, 4096) != 0) {
        perror("router_streams worker: bind/listen");
        exit(1);
    }
    return fd;
}

static void conn_close(int ep, conn **conns, int fd) {
    for (size_t i = 0; i < fed_n; i++) /* a feed that went takes its streams */
        if (fed[i].feed_fd == fd) fed[i].feed_fd = -1;
    epoll_ctl(ep, EPOLL_CTL_DEL, fd, NULL);
    close(fd);
    free(conns[fd]);
    conns[fd] = NULL;
}

static void worker_read(int ep, conn **conns, int fd) {
    conn *c = conns[fd];
    ssize_t r = recv(fd, c->in + c->len, BUF_BYTES - 1 - c->len, 0);
    if (r == 0 || (r < 0 && errno != EAGAIN)) {
        conn_close(ep, conns, fd);
        return;
    }
    if (r > 0) c->len += (size_t)r;
    while (worker_request(c)) {}
}

static _Noreturn void worker(int port) {
    size_t cap = 1u << 20;
    conn **conns = calloc(cap, sizeof *conns);
    worker_conns = conns;
    worker_cap = cap;
    fed = calloc(FED_MAX, sizeof *fed);
    int lfd = listen_on(port), ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = lfd}, evs[EVENTS_MAX];
    epoll_ctl(ep, EPOLL_CTL_ADD, lfd, &ev);
    uint64_t next_token = now_ms() + 1000;
    for (;;) {
        int n = epoll_wait(ep, evs, EVENTS_MAX, 100);
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd != lfd) {
                worker_read(ep, conns, fd);
                continue;
            }
            int cfd;
            while ((cfd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK)) >= 0) {
                if ((size_t)cfd >= cap) {
                    close(cfd);
                    continue;
                }
                conns[cfd] = calloc(1, sizeof(conn));
                conns[cfd]->fd = cfd;
                struct epoll_event cev = {.events = EPOLLIN, .data.fd = cfd};
                epoll_ctl(ep, EPOLL_CTL_ADD, cfd, &cev);
            }
        }
        if (now_ms() >= next_token) {
            token_to_all(conns, cap);
            token_to_feeds();
            next_token += 1000;
        }
    }
}

/* ---- clients ---------------------------------------------------------------- */

static int connect_to(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    return fd;
}

static int failures_shown;

static void client_read(conn *c) {
    ssize_t r = recv(c->fd, c->in, BUF_BYTES - 1, MSG_DONTWAIT);
    if (r < 0 && errno == EAGAIN) return;
    c->in[r > 0 ? r : 0] = '\0';
    if (r <= 0) c->failed = true;
    if (!c->head_seen && !strncmp(c->in, "HTTP/1.1 200", 12)) c->head_seen = true;
    else if (!c->head_seen) c->failed = true;
    if (strstr(c->in, "data: {")) c->event_seen = true;
    if (strstr(c->in, "\"error\"") || strstr(c->in, "[DONE]")) c->failed = true;
    if (c->failed && failures_shown++ < 3)
        printf("a stream failed (%s): %.300s\n",
               r < 0        ? strerror(errno)
                   : r == 0 ? "closed"
                            : "answer",
               c->in);
}

static void print_memory(int pid) {
    char path[64], line[256];
    snprintf(path, sizeof path, "/proc/%d/status", pid);
    FILE *f = fopen(path, "r");
    if (!f) return;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, "VmRSS:", 6) || !strncmp(line, "VmHWM:", 6) ||
            !strncmp(line, "Threads:", 8))
            printf("router %s", line);
    fclose(f);
    snprintf(path, sizeof path, "/proc/%d/fd", pid);
    DIR *d = opendir(path);
    if (!d) return;
    int fds = 0;
    for (struct dirent *e; (e = readdir(d));) fds += e->d_name[0] != '.';
    closedir(d);
    printf("router open descriptors: %d\n", fds);
}

static void tally(conn *cs, int n, const char *when) {
    int open = 0, heads = 0, events = 0, failed = 0;
    for (int i = 0; i < n; i++) {
        open += cs[i].fd >= 0 && !cs[i].failed;
        heads += cs[i].head_seen;
        events += cs[i].event_seen;
        failed += cs[i].failed;
    }
    printf("%-10s streams open %d, with a 200 head %d, with an event %d, failed %d\n", when, open,
           heads, events, failed);
}

/* Reads what came within wait_ms. */
static void pump(int ep, conn *cs, int wait_ms) {
    struct epoll_event evs[EVENTS_MAX];
    int k = epoll_wait(ep, evs, EVENTS_MAX, wait_ms);
    for (int i = 0; i < k; i++) {
        conn *c = &cs[evs[i].data.u32];
        client_read(c);
        if (c->failed) epoll_ctl(ep, EPOLL_CTL_DEL, c->fd, NULL);
    }
}

/* Streams are opened OPEN_BATCH at a time, OPEN_PAUSE_MS apart, so the
 * prefill halves (answered at once) reuse a few pooled connections. */
#define OPEN_BATCH 200
#define OPEN_PAUSE_MS 50

static int clients(int port, int n, int hold_s, int pid) {
    static const char body[] = "{\"text\":\"hello\",\"stream\":true,\"sampling_params\":"
                               "{\"max_new_tokens\":100000,\"ignore_eos\":true}}";
    char req[512];
    int len = snprintf(req, sizeof req,
                       "POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                       "application/json\r\nContent-Length: %zu\r\n\r\n%s",
                       sizeof body - 1, body);
    conn *cs = calloc((size_t)n, sizeof *cs);
    int ep = epoll_create1(0);
    uint64_t t0 = now_ms();
    for (int i = 0; i < n; i++) {
        cs[i].fd = connect_to(port);
        if (cs[i].fd < 0) {
            cs[i].failed = true;
            continue;
        }
        send_all(cs[i].fd, req, (size_t)len);
        struct epoll_event ev = {.events = EPOLLIN, .data.u32 = (uint32_t)i};
        epoll_ctl(ep, EPOLL_CTL_ADD, cs[i].fd, &ev);
        if (i % OPEN_BATCH == OPEN_BATCH - 1) pump(ep, cs, OPEN_PAUSE_MS);
        if (i % 2000 == 1999) {
            printf("  %d opened at %.1f s\n", i + 1, (double)(now_ms() - t0) / 1e3);
            fflush(stdout);
        }
    }
    printf("opened %d streams in %.1f s\n", n, (double)(now_ms() - t0) / 1e3);
    uint64_t until = now_ms() + (uint64_t)hold_s * 1000u, report = now_ms() + 5000;
    while (now_ms() < until) {
        pump(ep, cs, 200);
        if (now_ms() >= report) {
            char when[32];
            snprintf(when, sizeof when, "t=%.0fs", (double)(now_ms() - t0) / 1e3);
            tally(cs, n, when);
            report += 10000;
        }
    }
    tally(cs, n, "held");
    if (pid > 0) print_memory(pid);
    for (int i = 0; i < n; i++)
        if (cs[i].fd >= 0) close(cs[i].fd);
    free(cs);
    return 0;
}

int main(int argc, char **argv) {
    raise_nofile();
    if (argc == 4 && !strcmp(argv[1], "worker")) {
        decode_role = !strcmp(argv[3], "decode");
        worker(atoi(argv[2]));
    }
    if ((argc == 5 || argc == 6) && !strcmp(argv[1], "clients"))
        return clients(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), argc == 6 ? atoi(argv[5]) : 0);
    fprintf(stderr,
            "usage: router_streams worker PORT prefill|decode\n"
            "       router_streams clients PORT N HOLD_S [ROUTER_PID]\n");
    return 2;
}
