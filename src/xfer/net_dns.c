/*
 * net_dns.c — name resolution off the progress thread.
 *
 * The progress thread owns every socket and the UCX worker; a blocking
 * getaddrinfo there (a prefill peer named by host name, a slow DNS server)
 * would stall heartbeats to every other peer (issue 10, finding 11). Numeric
 * addresses never come here (net_conn.c resolves them in place). A name is
 * handed to a resolver thread through a job per peer slot: the progress
 * thread posts it and polls it; a resolver runs getaddrinfo without any
 * lock held and wakes the progress thread when done.
 *
 * Up to DNS_THREADS_MAX resolver threads per pd_net, started on demand: a
 * job posted while every running resolver is inside a lookup gets a new
 * thread. With one thread, a lookup that hangs (a DNS server that does not
 * answer) held every later name behind it until the later peers hit their
 * own resolution deadline (dead_after_ms from their post) and failed,
 * though their names would have resolved at once; test_net_bad_input
 * (a_hung_lookup_delays_no_other_name) replays it.
 *
 * A job outlives its peer: when the peer fails while the resolver is in
 * getaddrinfo, the job is marked abandoned and the resolver frees the result
 * itself. Until then the slot is busy and peer_alloc skips it, so a new
 * connection can never pick up an old answer. A pthread mutex and condition
 * guard the jobs (visible to ThreadSanitizer, unlike glibc's getaddrinfo_a,
 * whose internal locks it cannot see).
 */
#include "net_internal.h"

#include <stdlib.h>
#include <string.h>
#include <time.h>

static void *resolver_main(void *arg) {
    pd_net *n = arg;
    pthread_mutex_lock(&n->dns_mu);
    for (;;) {
        uint32_t pi = PD_NONE;
        while (!n->dns_stopping) {
            for (uint32_t i = 0; i < n->cfg.peers_max && pi == PD_NONE; i++)
                if (n->dns[i].state == DNS_POSTED) pi = i;
            if (pi != PD_NONE) break;
            pthread_cond_wait(&n->dns_cv, &n->dns_mu);
        }
        if (pi == PD_NONE) break;
        net_dns_job *j = &n->dns[pi];
        j->state = DNS_RUNNING;
        n->dns_busy++;
        char host[PEER_ADDR_MAX], port[16];
        memcpy(host, j->host, sizeof(host));
        memcpy(port, j->port, sizeof(port));
        uint64_t delay_ms = j->delay_ms;
        pthread_mutex_unlock(&n->dns_mu);
        if (delay_ms)
            nanosleep(&(struct timespec){.tv_sec = (time_t)(delay_ms / 1000),
                                         .tv_nsec = (long)(delay_ms % 1000) * 1000000L},
                      NULL);
        struct addrinfo hints = {
            .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
        struct addrinfo *res = NULL;
        int gai = getaddrinfo(host, port, &hints, &res);
        pthread_mutex_lock(&n->dns_mu);
        PD_ASSERT(n->dns_busy > 0);
        n->dns_busy--;
        if (j->abandoned) {
            if (res) freeaddrinfo(res);
            *j = (net_dns_job){0};
        } else {
            j->gai = gai;
            j->res = res;
            j->state = DNS_DONE;
        }
        net_wake(n);
    }
    pthread_mutex_unlock(&n->dns_mu);
    return NULL;
}

pd_err net_dns_init(pd_net *n) {
    n->dns = calloc(n->cfg.peers_max, sizeof(net_dns_job));
    if (!n->dns) return PD_ERR_NOMEM;
    if (pthread_mutex_init(&n->dns_mu, NULL) != 0) return PD_ERR_NOMEM;
    if (pthread_cond_init(&n->dns_cv, NULL) != 0) {
        pthread_mutex_destroy(&n->dns_mu);
        return PD_ERR_NOMEM;
    }
    n->dns_ready = true;
    return PD_OK;
}

bool net_dns_post(pd_net *n, uint32_t pi, const char *host, const char *port, uint64_t delay_ms) {
    pthread_mutex_lock(&n->dns_mu);
    net_dns_job *j = &n->dns[pi];
    PD_ASSERT(j->state == DNS_IDLE);
    uint32_t waiting = 0; /* jobs posted, not yet taken by a resolver */
    for (uint32_t i = 0; i < n->cfg.peers_max; i++) waiting += n->dns[i].state == DNS_POSTED;
    /* Idle resolvers take it; else a new one, up to the limit. */
    bool ok = n->dns_threads_up > n->dns_busy + waiting;
    if (!ok && n->dns_threads_up < DNS_THREADS_MAX) {
        ok = pthread_create(&n->dns_threads[n->dns_threads_up], NULL, resolver_main, n) == 0;
        if (ok) n->dns_threads_up++;
    }
    ok |= n->dns_threads_up > 0; /* all busy at the limit: it queues */
    if (ok) {
        snprintf(j->host, sizeof(j->host), "%s", host);
        snprintf(j->port, sizeof(j->port), "%s", port);
        j->delay_ms = delay_ms;
        j->state = DNS_POSTED;
        pthread_cond_signal(&n->dns_cv);
    }
    pthread_mutex_unlock(&n->dns_mu);
    return ok;
}

int net_dns_take(pd_net *n, uint32_t pi, struct addrinfo **res) {
    pthread_mutex_lock(&n->dns_mu);
    net_dns_job *j = &n->dns[pi];
    int gai = NET_DNS_PENDING;
    if (j->state == DNS_DONE) {
        gai = j->gai;
        *res = j->res;
        *j = (net_dns_job){0};
    }
    pthread_mutex_unlock(&n->dns_mu);
    return gai;
}

void net_dns_abandon(pd_net *n, uint32_t pi) {
    pthread_mutex_lock(&n->dns_mu);
    net_dns_job *j = &n->dns[pi];
    if (j->state == DNS_RUNNING) {
        j->abandoned = true; /* the resolver frees the answer */
    } else {
        if (j->res) freeaddrinfo(j->res);
        *j = (net_dns_job){0};
    }
    pthread_mutex_unlock(&n->dns_mu);
}

bool net_dns_slot_free(pd_net *n, uint32_t pi) {
    if (!n->dns_ready) return true;
    pthread_mutex_lock(&n->dns_mu);
    bool idle = n->dns[pi].state == DNS_IDLE;
    pthread_mutex_unlock(&n->dns_mu);
    return idle;
}

/* Joins the resolvers: each has at most one getaddrinfo still running,
 * bounded by the system resolver's own timeouts (resolv.conf). */
void net_dns_fini(pd_net *n) {
    if (!n->dns_ready) {
        free(n->dns);
        n->dns = NULL;
        return;
    }
    pthread_mutex_lock(&n->dns_mu);
    n->dns_stopping = true;
    pthread_cond_broadcast(&n->dns_cv);
    uint32_t up = n->dns_threads_up;
    pthread_mutex_unlock(&n->dns_mu);
    for (uint32_t i = 0; i < up; i++) pthread_join(n->dns_threads[i], NULL);
    for (uint32_t i = 0; i < n->cfg.peers_max; i++)
        if (n->dns[i].res) freeaddrinfo(n->dns[i].res);
    pthread_cond_destroy(&n->dns_cv);
    pthread_mutex_destroy(&n->dns_mu);
    free(n->dns);
    n->dns = NULL;
    n->dns_ready = false;
}
