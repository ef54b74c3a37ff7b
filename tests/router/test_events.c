/* The event-driven router (issue 13): hundreds of live streams are held by
 * a fixed set of threads, not one per request, and each client's hang-up
 * still aborts its request at both workers; a router configured for more
 * connections than the open-file limit allows is refused with a message
 * that names the limit and what to do. */
#define _GNU_SOURCE
#include <dirent.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../test_util.h"
#include "test_client.h"

#define WAIT_MS 20000
#define STREAMS 200
#define ABORTS 50

/* Threads of this process named `name` (the name a thread inherits from
 * the thread that created it). */
static size_t threads_named(const char *name) {
    DIR *d = opendir("/proc/self/task");
    PD_ASSERT(d != NULL);
    size_t n = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char path[300], comm[64] = "";
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue; /* the thread just ended */
        if (fgets(comm, sizeof comm, f)) comm[strcspn(comm, "\n")] = '\0';
        fclose(f);
        n += strcmp(comm, name) == 0;
    }
    closedir(d);
    return n;
}

static void hundreds_of_streams_live_on_a_fixed_set_of_threads(void **state) {
    (void)state;
    /* The fake workers' threads (one per connection) are named "fake"; the
     * router's threads, and any they start, are named "router". */
    pthread_setname_np(pthread_self(), "fake");
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    fw_set(d, &(fw_behaviour){.tokens = 1000, .delay_ms = 50});
    pthread_setname_np(pthread_self(), "router");
    pd_router_config cfg;
    tk_config(&cfg);
    cfg.connections_max = cfg.connections_per_ip = 2 * STREAMS;
    pd_router *r = tk_router(&p, 1, &d, 1, &cfg);
    size_t idle_threads = threads_named("router");

    int fds[STREAMS];
    for (int i = 0; i < STREAMS; i++) {
        char body[128];
        snprintf(body, sizeof body, "{\"text\": \"x\", \"stream\": true, \"rid\": \"ev-%d\"}", i);
        fds[i] = tc_raw_post(pd_router_port(r), "/generate", body);
    }
    for (int i = 0; i < STREAMS; i++) assert_true(tc_raw_read_until(fds[i], "data:", WAIT_MS));
    /* Every stream is live at once: the router holds them all. */
    assert_int_equal(fw_live_count(d), STREAMS);
    size_t live_threads = threads_named("router");
    assert_true(live_threads <= idle_threads);

    for (int i = 0; i < STREAMS; i++) close(fds[i]);
    for (int i = 0; i < STREAMS; i++) {
        char rid[32];
        snprintf(rid, sizeof rid, "ev-%d", i);
        assert_true(fw_wait_got_abort(d, rid, WAIT_MS));
    }
    assert_true(fw_wait_live_count(d, 0, WAIT_MS));
    assert_true(tk_wait_idle(r, WAIT_MS));
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

/* Polls until fw's abort peak reaches n; false after timeout_ms. */
static bool wait_abort_peak(fake_worker *fw, size_t n, int timeout_ms) {
    uint64_t until = tk_now_ms() + (uint64_t)timeout_ms;
    while (fw_abort_peak(fw) < n && tk_now_ms() < until) tk_sleep_ms(5);
    return fw_abort_peak(fw) >= n;
}

/* A burst of router-level /abort_request calls against slow workers: every
 * one reaches the workers at once, each call a transfer on an upstream loop,
 * and the router starts no thread for them (the admin pool that ran them
 * before issue 13's last step told the workers 4 at a time). Each is still
 * answered only after the workers answered: decode nodes, then prefill. */
static void abort_burst_against_slow_workers_runs_on_the_loops(void **state) {
    (void)state;
    pthread_setname_np(pthread_self(), "fake");
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    fw_behaviour slow = {.abort_delay_ms = 1500};
    fw_set(p, &slow);
    fw_set(d, &slow);
    pthread_setname_np(pthread_self(), "router");
    pd_router_config cfg;
    tk_config(&cfg);
    cfg.connections_max = cfg.connections_per_ip = 4 * ABORTS;
    pd_router *r = tk_router(&p, 1, &d, 1, &cfg);
    size_t idle_threads = threads_named("router");

    int fds[ABORTS];
    for (int i = 0; i < ABORTS; i++) {
        char body[64];
        snprintf(body, sizeof body, "{\"rid\": \"gone-%d\"}", i);
        fds[i] = tc_raw_post(pd_router_port(r), "/abort_request", body);
    }
    /* All at the decode node at once, none at the prefill node yet. */
    assert_true(wait_abort_peak(d, ABORTS, WAIT_MS));
    assert_int_equal(fw_abort_count(p), 0);
    assert_true(threads_named("router") <= idle_threads);
    assert_true(wait_abort_peak(p, ABORTS, WAIT_MS));
    for (int i = 0; i < ABORTS; i++) {
        char needle[64];
        snprintf(needle, sizeof needle, "no live request has rid gone-%d", i);
        assert_true(tc_raw_read_until(fds[i], needle, WAIT_MS));
        close(fds[i]);
    }
    assert_int_equal(fw_abort_count(d), ABORTS);
    assert_int_equal(fw_abort_count(p), ABORTS);
    assert_true(threads_named("router") <= idle_threads);
    pd_router_destroy(r);
    fw_stop(p);
    fw_stop(d);
}

/* A router stopped while admin batches are in flight on its loops waits for
 * them (bounded by their timeouts) before the loops go: nothing they touch
 * is freed under them (ASan's to judge), and the workers were still told. */
static void stop_with_abort_batches_in_flight_waits_for_them(void **state) {
    (void)state;
    fake_worker *p = fw_start("prefill"), *d = fw_start("decode");
    fw_behaviour slow = {.abort_delay_ms = 500};
    fw_set(p, &slow);
    fw_set(d, &slow);
    pd_router_config cfg;
    tk_config(&cfg);
    pd_router *r = tk_router(&p, 1, &d, 1, &cfg);
    int fds[8];
    for (int i = 0; i < 8; i++)
        fds[i] = tc_raw_post(pd_router_port(r), "/abort_request", "{\"abort_all\": true}");
    assert_true(wait_abort_peak(d, 8, WAIT_MS));
    pd_router_destroy(r); /* the prefill stage is still to come */
    assert_int_equal(fw_abort_count(d), 8);
    assert_int_equal(fw_abort_count(p), 8);
    for (int i = 0; i < 8; i++) close(fds[i]);
    fw_stop(p);
    fw_stop(d);
}

/* In a child process: lowering the hard limit cannot be undone. */
static void open_file_limit_too_low_is_refused_with_a_clear_message(void **state) {
    (void)state;
    int pipefd[2];
    PD_ASSERT(pipe(pipefd) == 0);
    pid_t pid = fork();
    PD_ASSERT(pid >= 0);
    if (pid == 0) {
        close(pipefd[0]);
        struct rlimit rl = {.rlim_cur = 256, .rlim_max = 256};
        if (setrlimit(RLIMIT_NOFILE, &rl) != 0) _exit(3);
        pd_router_config cfg;
        tk_config(&cfg);
        cfg.prefill[0] = "http://127.0.0.1:1";
        cfg.decode[0] = "http://127.0.0.1:2";
        cfg.prefill_count = cfg.decode_count = 1;
        cfg.connections_max = 1000;
        cfg.connections_per_ip = 100;
        pd_router *r = NULL;
        char msg[512] = "";
        if (pd_router_create(&r, &cfg, msg, sizeof msg) != PD_OK) _exit(4);
        pd_err err = pd_router_start(r, msg, sizeof msg);
        (void)!write(pipefd[1], msg, strlen(msg));
        pd_router_destroy(r);
        _exit(err == PD_ERR_INVALID ? 0 : 5);
    }
    close(pipefd[1]);
    char msg[512] = "";
    size_t len = 0;
    ssize_t n;
    while (len + 1 < sizeof msg && (n = read(pipefd[0], msg + len, sizeof msg - 1 - len)) > 0)
        len += (size_t)n;
    msg[len] = '\0';
    close(pipefd[0]);
    int status = 0;
    PD_ASSERT(waitpid(pid, &status, 0) == pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
    assert_non_null(strstr(msg, "RLIMIT_NOFILE) is 256"));
    assert_non_null(strstr(msg, "1000 client connections"));
    /* One descriptor per client connection; the one decode node's 4 feeds
     * (one per upstream loop) and 64 spare apart: (256 - 4 - 64) / 1. */
    assert_non_null(strstr(msg, "4 stream feeds"));
    assert_non_null(strstr(msg, "--max-connections to 188"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(hundreds_of_streams_live_on_a_fixed_set_of_threads),
        cmocka_unit_test(abort_burst_against_slow_workers_runs_on_the_loops),
        cmocka_unit_test(stop_with_abort_batches_in_flight_waits_for_them),
        cmocka_unit_test(open_file_limit_too_low_is_refused_with_a_clear_message),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
