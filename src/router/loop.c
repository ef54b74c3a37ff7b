/*
 * The router's upstream event loop; see loop.h for what it drives and its
 * invariants (L1-L3).
 *
 * One round: wait on epoll (until curl's timer, the next sweep, or an
 * event), hand each ready socket to curl_multi_socket_action, run curl's
 * timer when due, hand each finished transfer to its owner, take the tasks
 * other threads poked, sweep the timers when due, then step every marked
 * task until none is left. A step may add or remove transfers; curl asks for
 * their sockets through the socket callback (epoll_ctl) and for its timer
 * through the timer callback, both from inside the curl calls of this thread.
 */
#include "loop.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "client.h"

#define LOOP_EVENTS_MAX 256

struct rt_loop {
    int epfd, wakefd;
    CURLM *multi;
    pthread_t thread;
    atomic_bool stop;
    uint64_t curl_due_ms; /* 0: curl wants no timer */
    uint64_t sweep_due_ms, full_sweep_due_ms;
    rt_task *near;      /* due before the next full sweep (L3) */
    rt_task *marked;    /* doubly linked, loop thread only */
    rt_task *all;       /* every task started and not forgotten */
    pthread_mutex_t mu; /* guards the poked queue */
    rt_task *poked_head, *poked_tail;
};

/* ---- curl's callbacks ------------------------------------------------------ */

static int on_socket(CURL *easy, curl_socket_t fd, int what, void *user, void *socketp) {
    (void)easy, (void)socketp;
    rt_loop *l = user;
    if (what == CURL_POLL_REMOVE) {
        epoll_ctl(l->epfd, EPOLL_CTL_DEL, fd, NULL); /* ENOENT/EBADF: already gone */
        return 0;
    }
    struct epoll_event ev = {.events = 0, .data.fd = fd};
    if (what == CURL_POLL_IN || what == CURL_POLL_INOUT) ev.events |= EPOLLIN;
    if (what == CURL_POLL_OUT || what == CURL_POLL_INOUT) ev.events |= EPOLLOUT;
    if (epoll_ctl(l->epfd, EPOLL_CTL_MOD, fd, &ev) != 0 && errno == ENOENT)
        epoll_ctl(l->epfd, EPOLL_CTL_ADD, fd, &ev);
    return 0;
}

static int on_timer(CURLM *multi, long timeout_ms, void *user) {
    (void)multi;
    rt_loop *l = user;
    l->curl_due_ms = timeout_ms < 0 ? 0 : rt_now_ms() + (uint64_t)timeout_ms;
    return 0;
}

/* ---- task lists -------------------------------------------------------------- */

void rt_loop_mark(rt_loop *l, rt_task *t) {
    if (t->marked) return;
    t->marked = true;
    t->mark_prev = NULL;
    t->mark_next = l->marked;
    if (l->marked) l->marked->mark_prev = t;
    l->marked = t;
}

static void unmark(rt_loop *l, rt_task *t) {
    if (!t->marked) return;
    if (t->mark_prev) t->mark_prev->mark_next = t->mark_next;
    else l->marked = t->mark_next;
    if (t->mark_next) t->mark_next->mark_prev = t->mark_prev;
    t->marked = false;
    t->mark_prev = t->mark_next = NULL;
}

static void near_remove(rt_loop *l, rt_task *t) {
    if (!t->near) return;
    if (t->near_prev) t->near_prev->near_next = t->near_next;
    else l->near = t->near_next;
    if (t->near_next) t->near_next->near_prev = t->near_prev;
    t->near = false;
    t->near_prev = t->near_next = NULL;
}

static void near_add(rt_loop *l, rt_task *t) {
    if (t->near) return;
    t->near = true;
    t->near_prev = NULL;
    t->near_next = l->near;
    if (l->near) l->near->near_prev = t;
    l->near = t;
}

void rt_loop_wake_at(rt_loop *l, rt_task *t, uint64_t wake_ms) {
    t->wake_ms = wake_ms;
    if (wake_ms == 0) near_remove(l, t);
    else if (wake_ms < l->full_sweep_due_ms + RT_LOOP_SWEEP_MS) near_add(l, t);
}

void rt_loop_poke(rt_loop *l, rt_task *t) {
    pthread_mutex_lock(&l->mu);
    bool first = !t->poked;
    if (first) {
        t->poked = true;
        t->poke_next = NULL;
        if (l->poked_tail) l->poked_tail->poke_next = t;
        else l->poked_head = t;
        l->poked_tail = t;
    }
    pthread_mutex_unlock(&l->mu);
    if (first) {
        uint64_t one = 1;
        ssize_t w = write(l->wakefd, &one, sizeof one); /* EAGAIN: already signalled */
        (void)w;
    }
}

void rt_loop_forget(rt_loop *l, rt_task *t) {
    PD_ASSERT(rt_loop_is_own_thread(l));
    unmark(l, t);
    near_remove(l, t);
    pthread_mutex_lock(&l->mu);
    if (t->poked) {
        rt_task **pp = &l->poked_head, *prev = NULL;
        while (*pp != t) {
            prev = *pp;
            pp = &(*pp)->poke_next;
        }
        *pp = t->poke_next;
        if (l->poked_tail == t) l->poked_tail = prev;
        t->poked = false;
    }
    pthread_mutex_unlock(&l->mu);
    if (t->live) {
        if (t->all_prev) t->all_prev->all_next = t->all_next;
        else l->all = t->all_next;
        if (t->all_next) t->all_next->all_prev = t->all_prev;
        t->live = false;
    }
    /* Not t->poked: once the lock is let go another thread may poke t again
     * (a client hanging up as its forward ends), which its owner expects
     * and drops with a second forget (rt_fwd_destroy). Read here, the flag
     * raced with that poke, and the assertion could fail on it (seen under
     * ThreadSanitizer in test_node_stream_feed). */
    PD_ASSERT(!t->marked && !t->live && !t->near);
}

/* The poked queue, emptied into the marked list; a task seen for the first
 * time joins the sweep's list. */
static void take_poked(rt_loop *l) {
    /* All under the lock: another thread may re-poke a task (rewriting its
     * poke_next) the moment it is off the queue. */
    pthread_mutex_lock(&l->mu);
    rt_task *t = l->poked_head;
    l->poked_head = l->poked_tail = NULL;
    while (t) {
        rt_task *next = t->poke_next;
        t->poked = false;
        t->poke_next = NULL;
        if (!t->live) {
            t->live = true;
            t->all_prev = NULL;
            t->all_next = l->all;
            if (l->all) l->all->all_prev = t;
            l->all = t;
        }
        rt_loop_mark(l, t);
        t = next;
    }
    pthread_mutex_unlock(&l->mu);
}

/* Marks the tasks due; a full sweep also refills the near list (L3). */
static void sweep(rt_loop *l, uint64_t now) {
    bool full = now >= l->full_sweep_due_ms;
    if (full) l->full_sweep_due_ms = now + RT_LOOP_FULL_SWEEP_MS;
    rt_task *t = full ? l->all : l->near;
    while (t) {
        rt_task *next = full ? t->all_next : t->near_next;
        if (t->wake_ms && now >= t->wake_ms) rt_loop_mark(l, t);
        else if (full && t->wake_ms && t->wake_ms < l->full_sweep_due_ms + RT_LOOP_SWEEP_MS)
            near_add(l, t);
        else if (!t->wake_ms || t->wake_ms >= l->full_sweep_due_ms + RT_LOOP_SWEEP_MS)
            near_remove(l, t);
        t = next;
    }
}

static void step_marked(rt_loop *l) {
    while (l->marked) {
        rt_task *t = l->marked;
        unmark(l, t);
        t->step(t); /* may free t (after rt_loop_forget) */
    }
}

/* ---- transfers ---------------------------------------------------------------- */

bool rt_loop_add_xfer(rt_loop *l, rt_xfer *x) {
    PD_ASSERT(rt_loop_is_own_thread(l) && x->easy && x->done);
    curl_easy_setopt(x->easy, CURLOPT_PRIVATE, (char *)x);
    /* The loop's own connection cache (its multi handle's), not the
     * process-wide share: one thread uses it, without locks, and a lookup
     * scans only this loop's connections to the worker. */
    curl_easy_setopt(x->easy, CURLOPT_SHARE, NULL);
    return curl_multi_add_handle(l->multi, x->easy) == CURLM_OK;
}

void rt_loop_remove_xfer(rt_loop *l, rt_xfer *x) {
    PD_ASSERT(rt_loop_is_own_thread(l));
    curl_multi_remove_handle(l->multi, x->easy);
}

static void harvest(rt_loop *l) {
    CURLMsg *m;
    int left;
    while ((m = curl_multi_info_read(l->multi, &left))) {
        if (m->msg != CURLMSG_DONE) continue;
        rt_xfer *x = NULL;
        CURL *easy = m->easy_handle;
        CURLcode rc = m->data.result;
        curl_easy_getinfo(easy, CURLINFO_PRIVATE, (char **)&x);
        PD_ASSERT(x != NULL && x->easy == easy);
        curl_multi_remove_handle(l->multi, easy);
        x->done(x, rc);
    }
}

/* ---- the thread ---------------------------------------------------------------- */

static int wait_ms(const rt_loop *l, uint64_t now) {
    uint64_t due = l->sweep_due_ms;
    if (l->curl_due_ms && l->curl_due_ms < due) due = l->curl_due_ms;
    return due <= now ? 0 : (int)(due - now);
}

static void round_once(rt_loop *l) {
    struct epoll_event evs[LOOP_EVENTS_MAX];
    int n = epoll_wait(l->epfd, evs, LOOP_EVENTS_MAX, wait_ms(l, rt_now_ms()));
    int running = 0;
    for (int i = 0; i < n; i++) {
        if (evs[i].data.fd == l->wakefd) {
            uint64_t v;
            ssize_t r = read(l->wakefd, &v, sizeof v);
            (void)r;
            continue;
        }
        int what = 0;
        if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLRDHUP)) what |= CURL_CSELECT_IN;
        if (evs[i].events & EPOLLOUT) what |= CURL_CSELECT_OUT;
        if (evs[i].events & EPOLLERR) what |= CURL_CSELECT_ERR;
        curl_multi_socket_action(l->multi, evs[i].data.fd, what, &running);
    }
    uint64_t now = rt_now_ms();
    if (l->curl_due_ms && now >= l->curl_due_ms) {
        l->curl_due_ms = 0;
        curl_multi_socket_action(l->multi, CURL_SOCKET_TIMEOUT, 0, &running);
    }
    harvest(l);
    take_poked(l);
    if (now >= l->sweep_due_ms) {
        sweep(l, now);
        l->sweep_due_ms = now + RT_LOOP_SWEEP_MS;
    }
    step_marked(l);
    harvest(l); /* a step may have finished a transfer (curl_easy_pause) */
    step_marked(l);
}

static void *loop_main(void *arg) {
    rt_loop *l = arg;
    while (!atomic_load(&l->stop)) round_once(l);
    return NULL;
}

bool rt_loop_is_own_thread(const rt_loop *l) { return pthread_equal(pthread_self(), l->thread); }

static void loop_free(rt_loop *l) {
    if (l->multi) curl_multi_cleanup(l->multi);
    if (l->wakefd >= 0) close(l->wakefd);
    if (l->epfd >= 0) close(l->epfd);
    pthread_mutex_destroy(&l->mu);
    free(l);
}

pd_err rt_loop_start(rt_loop **out, char *msg, size_t msg_cap) {
    *out = NULL;
    rt_loop *l = calloc(1, sizeof *l);
    if (!l) return pd_errorf(msg, msg_cap, PD_ERR_NOMEM, "out of memory");
    pthread_mutex_init(&l->mu, NULL);
    atomic_init(&l->stop, false);
    l->epfd = epoll_create1(EPOLL_CLOEXEC);
    l->wakefd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    l->multi = rt_client_multi();
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = l->wakefd};
    if (l->epfd < 0 || l->wakefd < 0 || !l->multi ||
        epoll_ctl(l->epfd, EPOLL_CTL_ADD, l->wakefd, &ev) != 0) {
        int e = errno;
        loop_free(l);
        return pd_errorf(msg, msg_cap, PD_ERR_IO, "the router's event loop: %s", strerror(e));
    }
    curl_multi_setopt(l->multi, CURLMOPT_SOCKETFUNCTION, on_socket);
    curl_multi_setopt(l->multi, CURLMOPT_SOCKETDATA, l);
    curl_multi_setopt(l->multi, CURLMOPT_TIMERFUNCTION, on_timer);
    curl_multi_setopt(l->multi, CURLMOPT_TIMERDATA, l);
    l->sweep_due_ms = rt_now_ms() + RT_LOOP_SWEEP_MS;
    l->full_sweep_due_ms = l->sweep_due_ms + RT_LOOP_FULL_SWEEP_MS;
    if (pthread_create(&l->thread, NULL, loop_main, l) != 0) {
        loop_free(l);
        return pd_errorf(msg, msg_cap, PD_ERR_IO, "cannot start the router's event loop thread");
    }
    *out = l;
    return PD_OK;
}

void rt_loop_stop(rt_loop *l) {
    if (!l) return;
    atomic_store(&l->stop, true);
    uint64_t one = 1;
    ssize_t w = write(l->wakefd, &one, sizeof one);
    (void)w;
    pthread_join(l->thread, NULL);
    PD_ASSERT(l->all == NULL && l->poked_head == NULL);
    loop_free(l);
}
