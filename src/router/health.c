/*
 * The health checker thread; see health.h.
 */
#include "health.h"

#include <stdio.h>
#include <string.h>
#include <time.h>

#include "client.h"

static size_t discard_body(char *ptr, size_t size, size_t nmemb, void *userdata) {
    (void)ptr, (void)userdata;
    return size * nmemb;
}

static bool stopping(rt_health *h) {
    pthread_mutex_lock(&h->mu);
    bool s = h->stop;
    pthread_mutex_unlock(&h->mu);
    return s;
}

/* Probes every worker once, concurrently. Returns false when stopped midway
 * (no verdicts are recorded then: a probe cut short says nothing). */
static bool probe_round(rt_health *h) {
    rt_workers *t = h->workers;
    CURL *easy[2 * PD_ROUTER_WORKERS_MAX] = {0};
    char url[PD_ROUTER_URL_MAX + 16];
    for (size_t i = 0; i < t->count; i++) {
        easy[i] = curl_easy_init();
        if (!easy[i]) continue;
        rt_client_setup(easy[i], h->connect_timeout_ms, NULL);    /* /health needs no key */
        snprintf(url, sizeof url, "%s/health", t->w[i].url.base); /* base is immutable */
        curl_easy_setopt(easy[i], CURLOPT_URL, url);
        curl_easy_setopt(easy[i], CURLOPT_TIMEOUT_MS, (long)h->timeout_ms);
        curl_easy_setopt(easy[i], CURLOPT_WRITEFUNCTION, discard_body);
        if (curl_multi_add_handle(h->multi, easy[i]) != CURLM_OK) {
            curl_easy_cleanup(easy[i]);
            easy[i] = NULL;
        }
    }
    uint64_t give_up_ms = rt_now_ms() + h->timeout_ms + h->connect_timeout_ms + 1000;
    int running = 1;
    bool cut = false;
    while (running > 0) {
        if (curl_multi_perform(h->multi, &running) != CURLM_OK) break;
        if (running == 0) break;
        if (stopping(h) || rt_now_ms() >= give_up_ms) {
            cut = stopping(h);
            break;
        }
        curl_multi_poll(h->multi, NULL, 0, 200, NULL);
    }
    /* Every handle that has not completed with 200 is a failed probe. */
    bool done_ok[2 * PD_ROUTER_WORKERS_MAX] = {false};
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(h->multi, &left))) {
        if (m->msg != CURLMSG_DONE) continue;
        for (size_t i = 0; i < t->count; i++) {
            if (easy[i] != m->easy_handle) continue;
            long status = 0;
            curl_easy_getinfo(easy[i], CURLINFO_RESPONSE_CODE, &status);
            done_ok[i] = m->data.result == CURLE_OK && status == 200;
        }
    }
    for (size_t i = 0; i < t->count; i++) {
        if (easy[i]) {
            curl_multi_remove_handle(h->multi, easy[i]);
            curl_easy_cleanup(easy[i]);
        }
        if (!cut) rt_workers_probe(t, i, done_ok[i]);
    }
    return !cut;
}

static void *health_main(void *arg) {
    rt_health *h = arg;
    for (;;) {
        uint64_t round_start_ms = rt_now_ms();
        if (!probe_round(h)) break;
        uint64_t next_ms = round_start_ms + h->interval_ms;
        struct timespec until = {(time_t)(next_ms / 1000), (long)(next_ms % 1000) * 1000000L};
        pthread_mutex_lock(&h->mu);
        while (!h->stop && rt_now_ms() < next_ms) pthread_cond_timedwait(&h->cv, &h->mu, &until);
        bool stop = h->stop;
        pthread_mutex_unlock(&h->mu);
        if (stop) break;
    }
    return NULL;
}

pd_err rt_health_start(rt_health *h, rt_workers *workers, uint32_t interval_ms, uint32_t timeout_ms,
                       uint32_t connect_timeout_ms, char *msg, size_t msg_cap) {
    memset(h, 0, sizeof *h);
    PD_ASSERT(workers != NULL && interval_ms > 0 && timeout_ms > 0);
    h->workers = workers;
    h->interval_ms = interval_ms;
    h->timeout_ms = timeout_ms;
    h->connect_timeout_ms = connect_timeout_ms < timeout_ms ? connect_timeout_ms : timeout_ms;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&h->cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&h->mu, NULL);
    h->multi = rt_client_multi();
    if (!h->multi) {
        pthread_cond_destroy(&h->cv);
        pthread_mutex_destroy(&h->mu);
        return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "curl_multi_init failed");
    }
    if (pthread_create(&h->thread, NULL, health_main, h) != 0) {
        curl_multi_cleanup(h->multi);
        pthread_cond_destroy(&h->cv);
        pthread_mutex_destroy(&h->mu);
        h->multi = NULL;
        return pd_errorf(msg, msg_cap, PD_ERR_INTERNAL, "cannot start the health thread");
    }
    h->started = true;
    return PD_OK;
}

void rt_health_stop(rt_health *h) {
    if (!h->started) return;
    pthread_mutex_lock(&h->mu);
    h->stop = true;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    curl_multi_wakeup(h->multi);
    pthread_join(h->thread, NULL);
    curl_multi_cleanup(h->multi);
    pthread_cond_destroy(&h->cv);
    pthread_mutex_destroy(&h->mu);
    h->multi = NULL;
    h->started = false;
}
