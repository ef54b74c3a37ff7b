/* Strict mode with two nodes in one process (`pdserve run --strict`): each
 * node's ownership check writes its report into that node's own buffer, so
 * the two scheduler threads never share memory through it and one node's
 * report never shows the other's findings.
 *
 * Each node gets a distinct, deliberate leak — one KV page held by an owner
 * the engine never heard of (a number that names the node) — so each report
 * has content that can only come from its own engine. The nodes are created
 * but not started: the test thread stands in for their scheduler threads. */
#include <pthread.h>
#include <stdio.h>

#include "../test_util.h"
#include "node_internal.h"
#include "pdserve/ledger.h"

#define CHECKS_PER_THREAD 200

typedef struct strict_node {
    pd_node *n;
    pd_owner owner;          /* the unknown owner of its leaked page */
    uint32_t page;
    char mine[32];           /* owner as the report prints it */
    char theirs[32];         /* the other node's owner */
    bool report_ok;          /* threads: every report was its own */
} strict_node;

static void node_with_leak(strict_node *s, pd_node_role role, pd_owner owner) {
    pd_node_config cfg;
    pd_node_config_default(&cfg, role);
    cfg.strict = true;
    cfg.max_total_tokens = 512;
    cfg.max_running_requests = 4;
    cfg.max_queued_requests = 8;
    char msg[256] = "";
    pd_err err = pd_node_create(&s->n, &cfg, msg, sizeof msg);
    if (err) fail_msg("pd_node_create: %s", msg);
    s->owner = owner;
    pd_ledger *l = pd_engine_ledger(node_engine(s->n));
    assert_ok(pd_ledger_alloc(l, 0, 1, owner, &s->page));
}

static void node_free_leak(strict_node *s) {
    pd_ledger *l = pd_engine_ledger(node_engine(s->n));
    assert_ok(pd_ledger_free(l, 0, &s->page, 1, PD_UNIT_REQ, s->owner));
    assert_string_equal(node_strict_check(s->n), "");
    pd_node_destroy(s->n);
}

/* The report names an unknown owner as "owner <decimal id>". */
static void name_owners(strict_node *a, strict_node *b) {
    snprintf(a->mine, sizeof a->mine, "owner %llu", (unsigned long long)a->owner);
    snprintf(b->mine, sizeof b->mine, "owner %llu", (unsigned long long)b->owner);
    snprintf(a->theirs, sizeof a->theirs, "%s", b->mine);
    snprintf(b->theirs, sizeof b->theirs, "%s", a->mine);
}

static bool report_is_own(const strict_node *s, const char *report) {
    return strstr(report, "violation") && strstr(report, s->mine) && !strstr(report, s->theirs);
}

/* Checks of A then B, A's report read after B's check: a report shared
 * between nodes would now hold B's findings (or be torn between the two). */
static void each_node_keeps_its_own_strict_report(void **state) {
    (void)state;
    strict_node a = {0}, b = {0};
    node_with_leak(&a, PD_NODE_SERVE, 0xA0A0A0A0A0ull);
    node_with_leak(&b, PD_NODE_SERVE, 0xB0B0B0B0B0ull);
    name_owners(&a, &b);
    const char *ra = node_strict_check(a.n);
    if (!report_is_own(&a, ra)) fail_msg("A's report is not A's:\n%s", ra);
    const char *rb = node_strict_check(b.n);
    if (!report_is_own(&b, rb)) fail_msg("B's report is not B's:\n%s", rb);
    if (!report_is_own(&a, ra)) fail_msg("A's report was overwritten by B's check:\n%s", ra);
    node_free_leak(&a);
    node_free_leak(&b);
}

static void *check_repeatedly(void *arg) {
    strict_node *s = arg;
    s->report_ok = true;
    for (int i = 0; i < CHECKS_PER_THREAD && s->report_ok; i++)
        s->report_ok = report_is_own(s, node_strict_check(s->n));
    return NULL;
}

/* The two scheduler threads of `pdserve run --strict`, checking at once. */
static void concurrent_strict_checks_do_not_mix_reports(void **state) {
    (void)state;
    strict_node a = {0}, b = {0};
    node_with_leak(&a, PD_NODE_SERVE, 0xA1A1A1A1A1ull);
    node_with_leak(&b, PD_NODE_SERVE, 0xB1B1B1B1B1ull);
    name_owners(&a, &b);
    pthread_t ta, tb;
    assert_int_equal(pthread_create(&ta, NULL, check_repeatedly, &a), 0);
    assert_int_equal(pthread_create(&tb, NULL, check_repeatedly, &b), 0);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    assert_true(a.report_ok);
    assert_true(b.report_ok);
    node_free_leak(&a);
    node_free_leak(&b);
}

typedef struct violations_seen {
    int calls;
    pd_node_role role;
    bool report_ok; /* every report handed on was the node's own */
    const strict_node *s;
} violations_seen;

static void record_violation(void *ctx, pd_node_role role, const char *report) {
    violations_seen *v = ctx;
    v->calls++;
    v->role = role;
    if (!report_is_own(v->s, report)) v->report_ok = false;
}

/* The node prints nothing: a failed check's report goes to the caller's
 * on_violation, for the first three failures only; the checks go on failing
 * (and being counted) after that. */
static void failed_checks_reach_on_violation_three_times(void **state) {
    (void)state;
    strict_node a = {0}, b = {0};
    violations_seen seen = {.report_ok = true, .s = &a};
    pd_node_config cfg;
    pd_node_config_default(&cfg, PD_NODE_DECODE);
    cfg.strict = true;
    cfg.max_total_tokens = 512;
    cfg.max_running_requests = 4;
    cfg.max_queued_requests = 8;
    cfg.transfer_backend = "ucx";
    cfg.on_violation = record_violation;
    cfg.on_violation_ctx = &seen;
    char msg[256] = "";
    if (pd_node_create(&a.n, &cfg, msg, sizeof msg)) fail_msg("pd_node_create: %s", msg);
    a.owner = 0xC0C0C0C0C0ull;
    b.owner = 0xD0D0D0D0D0ull;
    assert_ok(pd_ledger_alloc(pd_engine_ledger(node_engine(a.n)), 0, 1, a.owner, &a.page));
    name_owners(&a, &b);
    for (int i = 0; i < 5; i++) assert_true(report_is_own(&a, node_strict_check(a.n)));
    assert_int_equal(seen.calls, 3);
    assert_int_equal(seen.role, PD_NODE_DECODE);
    assert_true(seen.report_ok);
    node_free_leak(&a);
    assert_int_equal(seen.calls, 3); /* a passing check hands nothing on */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(each_node_keeps_its_own_strict_report),
        cmocka_unit_test(concurrent_strict_checks_do_not_mix_reports),
        cmocka_unit_test(failed_checks_reach_on_violation_three_times),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
