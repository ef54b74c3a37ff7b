/*
 * Client helpers and the router fixture for the router tests; see
 * test_client.h.
 */
#include "test_client.h"

#include <arpa/inet.h>
#include <curl/curl.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "pdserve/base.h"

void tk_sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

uint64_t tk_now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static size_t on_body(char *p, size_t size, size_t n, void *ud) {
    tc_response *r = ud;
    size_t k = size * n;
    r->body = realloc(r->body, r->len + k + 1);
    memcpy(r->body + r->len, p, k);
    r->len += k;
    r->body[r->len] = '\0';
    return k;
}

static size_t on_header(char *p, size_t size, size_t n, void *ud) {
    tc_response *r = ud;
    size_t k = size * n;
    if (k > 6 && !strncasecmp(p, "Allow:", 6)) {
        const char *v = p + 6;
        while (*v == ' ') v++;
        size_t l = (size_t)(p + k - v);
        while (l && (v[l - 1] == '\r' || v[l - 1] == '\n')) l--;
        snprintf(r->allow, sizeof r->allow, "%.*s", (int)l, v);
    }
    return k;
}

void tc_request(const char *method, const char *url, const char *body, long timeout_ms,
                tc_response *out) {
    memset(out, 0, sizeof *out);
    CURL *e = curl_easy_init();
    PD_ASSERT(e != NULL);
    struct curl_slist *h = curl_slist_append(NULL, "Content-Type: application/json");
    curl_easy_setopt(e, CURLOPT_URL, url);
    curl_easy_setopt(e, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(e, CURLOPT_NOPROXY, "*");
    curl_easy_setopt(e, CURLOPT_CUSTOMREQUEST, method);
    curl_easy_setopt(e, CURLOPT_HTTPHEADER, h);
    curl_easy_setopt(e, CURLOPT_TIMEOUT_MS, timeout_ms);
    curl_easy_setopt(e, CURLOPT_WRITEFUNCTION, on_body);
    curl_easy_setopt(e, CURLOPT_WRITEDATA, out);
    curl_easy_setopt(e, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(e, CURLOPT_HEADERDATA, out);
    if (body) {
        curl_easy_setopt(e, CURLOPT_POSTFIELDS, body);
        curl_easy_setopt(e, CURLOPT_POSTFIELDSIZE, (long)strlen(body));
    } else if (!strcmp(method, "GET")) {
        curl_easy_setopt(e, CURLOPT_HTTPGET, 1L);
    }
    out->curl_code = curl_easy_perform(e);
    curl_easy_getinfo(e, CURLINFO_RESPONSE_CODE, &out->status);
    char *ct = NULL;
    curl_easy_getinfo(e, CURLINFO_CONTENT_TYPE, &ct);
    snprintf(out->content_type, sizeof out->content_type, "%s", ct ? ct : "");
    if (!out->body) out->body = calloc(1, 1);
    curl_slist_free_all(h);
    curl_easy_cleanup(e);
}

void tc_free(tc_response *r) {
    free(r->body);
    r->body = NULL;
}

json_t *tc_json(const tc_response *r) { return json_loadb(r->body, r->len, 0, NULL); }

const char *tc_error_message(json_t *body, long status) {
    json_t *err = json_object_get(body, "error");
    json_t *code = json_object_get(err, "code");
    if (!json_is_string(json_object_get(err, "message")) ||
        !json_is_string(json_object_get(err, "type")) || !json_is_integer(code) ||
        json_integer_value(code) != status)
        return NULL;
    return json_string_value(json_object_get(err, "message"));
}

json_t *tc_sse_check(const char *body, size_t len, size_t *token_events, char *why, size_t cap) {
    size_t i = 0, events = 0, before_final = 0;
    json_t *final = NULL;
    bool done = false;
    *token_events = 0;
    while (i < len) {
        const char *end = NULL;
        for (size_t k = i; k + 1 < len; k++)
            if (body[k] == '\n' && body[k + 1] == '\n') {
                end = body + k;
                break;
            }
        if (!end) {
            snprintf(why, cap, "bytes after the last complete event: '%.*s'", (int)(len - i),
                     body + i);
            goto fail;
        }
        const char *ev = body + i;
        size_t ev_len = (size_t)(end - ev);
        i = (size_t)(end - body) + 2;
        if (ev_len < 6 || strncmp(ev, "data: ", 6)) {
            snprintf(why, cap, "an event without data: '%.*s'", (int)ev_len, ev);
            goto fail;
        }
        if (done) {
            snprintf(why, cap, "an event after [DONE]");
            goto fail;
        }
        events++;
        if (ev_len == 12 && !strncmp(ev + 6, "[DONE]", 6)) {
            done = true;
            continue;
        }
        json_t *o = json_loadb(ev + 6, ev_len - 6, 0, NULL);
        if (!o) {
            snprintf(why, cap, "an event that is not JSON: '%.*s'", (int)ev_len, ev);
            goto fail;
        }
        json_t *fr = json_object_get(json_object_get(o, "meta_info"), "finish_reason");
        if (!fr) {
            json_t *choice = json_array_get(json_object_get(o, "choices"), 0);
            fr = json_object_get(choice, "finish_reason");
        }
        bool is_final = (fr && !json_is_null(fr)) || json_object_get(o, "error");
        if (final) {
            json_decref(o);
            snprintf(why, cap, "an event after the final one");
            goto fail;
        }
        if (is_final) final = o;
        else {
            json_decref(o);
            before_final++;
        }
    }
    if (!final) {
        snprintf(why, cap, "no final event");
        goto fail;
    }
    if (!done) {
        snprintf(why, cap, "no [DONE]");
        goto fail;
    }
    *token_events = before_final;
    return final;
fail:
    json_decref(final);
    return NULL;
}

int tc_raw_post(uint16_t port, const char *path, const char *body) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    PD_ASSERT(fd >= 0);
    struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    PD_ASSERT(connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    char head[512];
    int n = snprintf(head, sizeof head,
                     "POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\n\r\n",
                     path, strlen(body));
    PD_ASSERT(send(fd, head, (size_t)n, MSG_NOSIGNAL) == n);
    PD_ASSERT(send(fd, body, strlen(body), MSG_NOSIGNAL) == (ssize_t)strlen(body));
    return fd;
}

bool tc_raw_read_until(int fd, const char *needle, int timeout_ms) {
    char buf[65536];
    size_t len = 0;
    uint64_t until = tk_now_ms() + (uint64_t)timeout_ms;
    while (tk_now_ms() < until && len + 1 < sizeof buf) {
        struct pollfd p = {fd, POLLIN, 0};
        if (poll(&p, 1, 50) <= 0) continue;
        ssize_t r = recv(fd, buf + len, sizeof buf - 1 - len, 0);
        if (r <= 0) return false;
        len += (size_t)r;
        buf[len] = '\0';
        if (strstr(buf, needle)) return true;
    }
    return false;
}

void tk_config(pd_router_config *cfg) {
    pd_router_config_default(cfg);
    cfg->port = 0;
    cfg->health_interval_ms = 50;
    cfg->health_timeout_ms = 300;
    cfg->request_timeout_ms = 20000;
    cfg->abort_timeout_ms = 2000;
    cfg->abort_grace_ms = 500;
}

pd_router *tk_router(fake_worker **prefill, size_t np, fake_worker **decode, size_t nd,
                     const pd_router_config *base) {
    pd_router_config cfg;
    if (base) cfg = *base;
    else tk_config(&cfg);
    for (size_t i = 0; i < np; i++) cfg.prefill[i] = fw_url(prefill[i]);
    for (size_t i = 0; i < nd; i++) cfg.decode[i] = fw_url(decode[i]);
    cfg.prefill_count = np;
    cfg.decode_count = nd;
    pd_router *r = NULL;
    char msg[256];
    PD_MUST(pd_router_create(&r, &cfg, msg, sizeof msg));
    PD_ASSERTF(pd_router_start(r, msg, sizeof msg) == PD_OK, "%s", msg);
    return r;
}

const char *tk_url(pd_router *r, const char *path, char *buf, size_t cap) {
    snprintf(buf, cap, "http://127.0.0.1:%u%s", (unsigned)pd_router_port(r), path);
    return buf;
}

json_t *tk_server_info(pd_router *r) {
    char url[128];
    tc_response resp;
    tc_request("GET", tk_url(r, "/server_info", url, sizeof url), NULL, 5000, &resp);
    json_t *o = resp.status == 200 ? tc_json(&resp) : NULL;
    tc_free(&resp);
    return o;
}

bool tk_wait_health(pd_router *r, const char *url, bool healthy, int timeout_ms) {
    uint64_t until = tk_now_ms() + (uint64_t)timeout_ms;
    do {
        json_t *info = tk_server_info(r);
        json_t *ws = json_object_get(info, "workers");
        size_t i;
        json_t *w;
        bool hit = false;
        json_array_foreach(ws, i, w) {
            if (!strcmp(json_string_value(json_object_get(w, "url")), url) &&
                json_is_true(json_object_get(w, "healthy")) == healthy)
                hit = true;
        }
        json_decref(info);
        if (hit) return true;
        tk_sleep_ms(10);
    } while (tk_now_ms() < until);
    return false;
}

bool tk_wait_idle(pd_router *r, int timeout_ms) {
    uint64_t until = tk_now_ms() + (uint64_t)timeout_ms;
    do {
        json_t *info = tk_server_info(r);
        json_t *counters = json_object_get(info, "counters");
        json_int_t n = json_integer_value(json_object_get(counters, "in_flight"));
        bool ok = info && n == 0;
        json_decref(info);
        if (ok) return true;
        tk_sleep_ms(10);
    } while (tk_now_ms() < until);
    return false;
}
