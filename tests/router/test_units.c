/* The router's pieces without sockets: worker URL parsing, the two
 * policies over candidate snapshots and the health hysteresis of the worker
 * table. (The error body is the http layer's: tests/http.) */
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>

#include "../test_util.h"
#include "loop.h"
#include "policy.h"
#include "workers.h"

static void worker_urls_parse_with_optional_bootstrap_port(void **state) {
    (void)state;
    pd_router_url u;
    char msg[256];
    assert_ok(pd_router_url_parse("http://127.0.0.1:30001", true, &u, msg, sizeof msg));
    assert_string_equal(u.base, "http://127.0.0.1:30001");
    assert_string_equal(u.host, "127.0.0.1");
    assert_int_equal(u.port, 30001);
    assert_int_equal(u.bootstrap_port, 0);

    assert_ok(pd_router_url_parse("http://node-a:30001/@9000", true, &u, msg, sizeof msg));
    assert_string_equal(u.base, "http://node-a:30001");
    assert_string_equal(u.host, "node-a");
    assert_int_equal(u.bootstrap_port, 9000);

    assert_ok(pd_router_url_parse("http://[::1]:8080", false, &u, msg, sizeof msg));
    assert_string_equal(u.base, "http://[::1]:8080");
    assert_string_equal(u.host, "::1");

    const char *bad[] = {"127.0.0.1:30001",       "https://h:1",         "http://h",
                         "http://h:0",            "http://h:65536",      "http://:80",
                         "http://h:80/generate",  "http://u@h:80",       "http://h:80@",
                         "http://h:80@0",         "http://h:80@x",       "http://::1:80",
                         "http://h:8a",           "",                    "http://h:80@1@2"};
    for (size_t i = 0; i < PD_ARRAY_LEN(bad); i++) {
        msg[0] = '\0';
        assert_err(pd_router_url_parse(bad[i], true, &u, msg, sizeof msg), PD_ERR_INVALID);
        assert_true(strlen(msg) > 0);
    }
    /* A decode node has no bootstrap port. */
    assert_err(pd_router_url_parse("http://h:80@9000", false, &u, msg, sizeof msg), PD_ERR_INVALID);
    assert_non_null(strstr(msg, "prefill"));
}

static void round_robin_visits_each_healthy_worker_once_per_turn(void **state) {
    (void)state;
    rt_candidate c[3] = {{true, 5}, {true, 0}, {true, 9}};
    size_t cursor = 0;
    assert_int_equal(rt_policy_pick(PD_ROUTER_ROUND_ROBIN, c, 3, &cursor), 0);
    assert_int_equal(rt_policy_pick(PD_ROUTER_ROUND_ROBIN, c, 3, &cursor), 1);
    assert_int_equal(rt_policy_pick(PD_ROUTER_ROUND_ROBIN, c, 3, &cursor), 2);
    assert_int_equal(rt_policy_pick(PD_ROUTER_ROUND_ROBIN, c, 3, &cursor), 0);
    c[1].healthy = false;
    assert_int_equal(rt_policy_pick(PD_ROUTER_ROUND_ROBIN, c, 3, &cursor), 2);
    assert_int_equal(rt_policy_pick(PD_ROUTER_ROUND_ROBIN, c, 3, &cursor), 0);
    c[0].healthy = c[2].healthy = false;
    assert_int_equal(rt_policy_pick(PD_ROUTER_ROUND_ROBIN, c, 3, &cursor), RT_PICK_NONE);
    assert_int_equal(rt_policy_pick(PD_ROUTER_ROUND_ROBIN, c, 0, &cursor), RT_PICK_NONE);
}

/* random never picks an unhealthy worker and reaches every healthy one;
 * power_of_two, drawing two, takes the loaded worker only when both draws
 * land on it (about a quarter of the time with two workers), random about
 * half the time. The draws are a fixed stream, so the counts are exact. */
static void random_and_power_of_two_pick_healthy_workers(void **state) {
    (void)state;
    rt_candidate c[3] = {{true, 0}, {false, 0}, {true, 100}};
    size_t hits[2][3] = {{0}}, cursor[2] = {0, 0};
    pd_router_policy pol[2] = {PD_ROUTER_RANDOM, PD_ROUTER_POWER_OF_TWO};
    for (int p = 0; p < 2; p++)
        for (int i = 0; i < 1000; i++) hits[p][rt_policy_pick(pol[p], c, 3, &cursor[p])]++;
    for (int p = 0; p < 2; p++) assert_int_equal(hits[p][1], 0);
    assert_true(hits[0][2] > 400 && hits[0][2] < 600);
    assert_true(hits[1][2] > 150 && hits[1][2] < 350);
    rt_candidate none[2] = {{false, 0}, {false, 0}};
    assert_int_equal(rt_policy_pick(PD_ROUTER_RANDOM, none, 2, &cursor[0]), RT_PICK_NONE);
    pd_router_policy parsed;
    assert_int_equal(pd_router_policy_parse("power_of_two", &parsed), PD_OK);
    assert_int_equal(parsed, PD_ROUTER_POWER_OF_TWO);
    assert_string_equal(pd_router_policy_name(PD_ROUTER_RANDOM), "random");
}

static void least_load_picks_fewest_in_flight_and_rotates_ties(void **state) {
    (void)state;
    rt_candidate c[3] = {{true, 2}, {true, 1}, {true, 3}};
    size_t cursor = 0;
    assert_int_equal(rt_policy_pick(PD_ROUTER_LEAST_LOAD, c, 3, &cursor), 1);
    c[1].in_flight = 2; /* now 0 and 1 tie at 2: the one at or after the cursor (2) wraps to 0 */
    assert_int_equal(rt_policy_pick(PD_ROUTER_LEAST_LOAD, c, 3, &cursor), 0);
    assert_int_equal(rt_policy_pick(PD_ROUTER_LEAST_LOAD, c, 3, &cursor), 1);
    c[2].in_flight = 0;
    c[2].healthy = false; /* the least loaded is unhealthy: never picked */
    assert_int_not_equal(rt_policy_pick(PD_ROUTER_LEAST_LOAD, c, 3, &cursor), 2);
}

static void worker_leaves_after_two_failed_probes_and_returns_after_one(void **state) {
    (void)state;
    pd_router_config cfg;
    pd_router_config_default(&cfg);
    cfg.prefill[0] = "http://127.0.0.1:1@7000";
    cfg.prefill_count = 1;
    cfg.decode[0] = "http://127.0.0.1:2";
    cfg.decode[1] = "http://127.0.0.1:3";
    cfg.decode_count = 2;
    rt_workers t;
    char msg[256];
    assert_ok(rt_workers_init(&t, &cfg, msg, sizeof msg));
    assert_int_equal(t.w[0].url.bootstrap_port, 7000);
    assert_true(rt_workers_have_pair(&t));
    assert_false(rt_workers_probe(&t, 0, false)); /* one failure: still in */
    assert_true(t.w[0].healthy);
    assert_true(rt_workers_probe(&t, 0, false)); /* two: out */
    assert_false(t.w[0].healthy);
    assert_false(rt_workers_have_pair(&t));
    size_t p, d;
    assert_err(rt_workers_pick(&t, &p, &d), PD_ERR_NOTFOUND);
    assert_true(rt_workers_probe(&t, 0, true)); /* one success: back */
    assert_ok(rt_workers_pick(&t, &p, &d));
    assert_int_equal(p, 0);
    assert_int_equal(t.w[p].in_flight, 1);
    assert_int_equal(t.w[d].in_flight, 1);
    rt_workers_release(&t, p, false);
    rt_workers_release(&t, d, true);
    assert_int_equal(t.w[d].failures_total, 1);
    assert_int_equal(t.w[d].in_flight, 0);
    rt_workers_destroy(&t);

    /* Duplicates and empty roles are refused. */
    cfg.decode[1] = "http://127.0.0.1:2";
    assert_err(rt_workers_init(&t, &cfg, msg, sizeof msg), PD_ERR_INVALID);
    assert_non_null(strstr(msg, "twice"));
    cfg.decode_count = 0;
    assert_err(rt_workers_init(&t, &cfg, msg, sizeof msg), PD_ERR_INVALID);
}

static void create_refuses_bad_configurations(void **state) {
    (void)state;
    pd_router_config cfg;
    pd_router_config_default(&cfg);
    pd_router *r = NULL;
    char msg[256];
    assert_err(pd_router_create(&r, &cfg, msg, sizeof msg), PD_ERR_INVALID); /* no workers */
    cfg.prefill[0] = "http://127.0.0.1:1";
    cfg.decode[0] = "ftp://127.0.0.1:2";
    cfg.prefill_count = cfg.decode_count = 1;
    assert_err(pd_router_create(&r, &cfg, msg, sizeof msg), PD_ERR_INVALID);
    assert_non_null(strstr(msg, "ftp://"));
    cfg.decode[0] = "http://127.0.0.1:2";
    cfg.health_interval_ms = 0;
    assert_err(pd_router_create(&r, &cfg, msg, sizeof msg), PD_ERR_INVALID);
    assert_null(r);
    cfg.health_interval_ms = 1000;
    assert_ok(pd_router_create(&r, &cfg, msg, sizeof msg));
    pd_router_destroy(r); /* never started: fine */
    pd_router_policy pol;
    assert_ok(pd_router_policy_parse("least_load", &pol));
    assert_int_equal(pol, PD_ROUTER_LEAST_LOAD);
    assert_ok(pd_router_policy_parse("random", &pol));
    assert_err(pd_router_policy_parse("fastest", &pol), PD_ERR_INVALID);
}

/* ---- the loop: a task forgotten while another thread pokes it ---------------- */

/* A forward that ends as its client hangs up: its step forgets the task on
 * the loop thread while the server's thread pokes it. A poke after the
 * forget is allowed (the owner drops it with a second forget, as
 * rt_fwd_destroy does); the forget must neither race with it nor fail its
 * own assertion on it (it read the poked flag after letting the lock go:
 * ThreadSanitizer, make tsan, reported the race in test_node_stream_feed). */
typedef struct poked_task {
    rt_task t; /* first: the step gets the task */
    rt_loop *l;
    atomic_uint steps;
    atomic_bool stop;
} poked_task;

static void forget_step(rt_task *t) {
    poked_task *p = (poked_task *)t;
    rt_loop_forget(p->l, t);
    atomic_fetch_add(&p->steps, 1);
}

static void *poker(void *arg) {
    poked_task *p = arg;
    while (!atomic_load(&p->stop)) rt_loop_poke(p->l, &p->t);
    return NULL;
}

static void forget_holds_against_a_poke_from_another_thread(void **state) {
    (void)state;
    char msg[256];
    poked_task p = {.t = {.step = forget_step}};
    assert_ok(rt_loop_start(&p.l, msg, sizeof msg));
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, poker, &p), 0);
    /* until the loop stepped (and forgot) the task many times */
    struct timespec nap = {0, 1000000};
    for (int i = 0; i < 5000 && atomic_load(&p.steps) < 2000; i++) nanosleep(&nap, NULL);
    atomic_store(&p.stop, true);
    pthread_join(th, NULL);
    assert_true(atomic_load(&p.steps) > 0);
    /* the pokes that came after the last forget: one more step forgets them */
    unsigned seen = atomic_load(&p.steps);
    rt_loop_poke(p.l, &p.t);
    for (int i = 0; i < 5000 && atomic_load(&p.steps) == seen; i++) nanosleep(&nap, NULL);
    assert_true(atomic_load(&p.steps) > seen);
    rt_loop_stop(p.l); /* every task forgotten */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(worker_urls_parse_with_optional_bootstrap_port),
        cmocka_unit_test(round_robin_visits_each_healthy_worker_once_per_turn),
        cmocka_unit_test(least_load_picks_fewest_in_flight_and_rotates_ties),
        cmocka_unit_test(random_and_power_of_two_pick_healthy_workers),
        cmocka_unit_test(worker_leaves_after_two_failed_probes_and_returns_after_one),
        cmocka_unit_test(create_refuses_bad_configurations),
        cmocka_unit_test(forget_holds_against_a_poke_from_another_thread),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
