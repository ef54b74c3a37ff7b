/*
 * The load generator without a network: the datasets' statistics (lengths,
 * arrival gaps, abort fractions), --slo parsing, and the results' figures
 * over a known set of requests (numpy's percentile convention).
 */
#include <jansson.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "pdserve/loadgen.h"

static pd_lg_dataset build(pd_lg_dataset_config *c) {
    pd_lg_dataset d;
    char err[256];
    assert_int_equal(pd_lg_dataset_build(c, &d, err, sizeof(err)), PD_OK);
    return d;
}

static void test_random_lengths_and_aborts(void **state) {
    (void)state;
    pd_lg_dataset_config c;
    pd_lg_dataset_config_default(&c);
    c.num_prompts = 10000;
    c.input_len = 100;
    c.output_len = 40;
    c.range_ratio = 0.25;
    c.abort_fraction = 0.3;
    c.vocab = 1000;
    c.token_min = 10;
    pd_lg_dataset d = build(&c);
    uint32_t aborts = 0, closes = 0, lo_in = 1000, hi_in = 0;
    for (uint32_t i = 0; i < d.n; i++) {
        const pd_lg_request *r = &d.reqs[i];
        lo_in = r->input_len < lo_in ? r->input_len : lo_in;
        hi_in = r->input_len > hi_in ? r->input_len : hi_in;
        assert_true(r->output_len >= 10 && r->output_len <= 40);
        assert_int_equal(r->n_ids, r->input_len);
        for (uint32_t k = 0; k < r->n_ids; k++) assert_true(r->ids[k] >= 10 && r->ids[k] < 1000);
        if (r->abort != PD_LG_ABORT_NONE) {
            aborts++;
            closes += r->abort == PD_LG_ABORT_CLOSE;
            assert_true(r->abort_after_s >= c.abort_min_s && r->abort_after_s <= c.abort_max_s);
        }
        assert_true(r->arrival_s == 0); /* no rate: all at once */
    }
    assert_int_equal(lo_in, 25);
    assert_int_equal(hi_in, 100);
    assert_true(aborts > 2800 && aborts < 3200);
    assert_true(closes > aborts * 4 / 10 && closes < aborts * 6 / 10); /* mixed: half each */
    pd_lg_dataset_free(&d);
}

/* Gaps have mean 1/rate and squared coefficient of variation 1/burstiness
 * (gamma with shape b): Poisson at 1, burstier below. */
static void check_gaps(double rate, double burstiness) {
    pd_lg_dataset_config c;
    pd_lg_dataset_config_default(&c);
    c.num_prompts = 20000;
    c.input_len = 4;
    c.request_rate = rate;
    c.burstiness = burstiness;
    pd_lg_dataset d = build(&c);
    double prev = 0, sum = 0, sq = 0;
    for (uint32_t i = 0; i < d.n; i++) {
        double g = d.reqs[i].arrival_s - prev;
        assert_true(g >= 0);
        prev = d.reqs[i].arrival_s;
        sum += g;
        sq += g * g;
    }
    double mean = sum / d.n, var = sq / d.n - mean * mean, cv2 = var / (mean * mean);
    assert_true(fabs(mean * rate - 1) < 0.03);
    assert_true(fabs(cv2 * burstiness - 1) < 0.1);
    pd_lg_dataset_free(&d);
}

static void test_arrivals(void **state) {
    (void)state;
    check_gaps(10, 1.0);
    check_gaps(200, 0.5);
    check_gaps(3, 4.0);
}

static void test_shared_prefix_and_turns(void **state) {
    (void)state;
    pd_lg_dataset_config c;
    pd_lg_dataset_config_default(&c);
    c.kind = PD_LG_SHARED_PREFIX;
    c.num_prompts = 200;
    c.gsp_groups = 4;
    c.gsp_system_len = 32;
    pd_lg_dataset d = build(&c);
    int32_t firsts[8][32];
    uint32_t distinct = 0;
    for (uint32_t i = 0; i < d.n; i++) {
        const pd_lg_request *r = &d.reqs[i];
        assert_int_equal(r->seg[0].role, PD_LG_SYSTEM);
        assert_int_equal(r->seg[0].len, 32);
        bool seen = false;
        for (uint32_t k = 0; k < distinct && !seen; k++)
            seen = !memcmp(firsts[k], r->ids, sizeof(firsts[k]));
        if (!seen) {
            assert_true(distinct < 8);
            memcpy(firsts[distinct++], r->ids, sizeof(firsts[0]));
        }
    }
    assert_int_equal(distinct, 4);
    pd_lg_dataset_free(&d);

    c.kind = PD_LG_MULTI_TURN;
    c.num_prompts = 12;
    c.turns = 3;
    d = build(&c);
    for (uint32_t i = 0; i < d.n; i++) {
        const pd_lg_request *r = &d.reqs[i];
        if (i % 3 == 0) {
            assert_int_equal(r->prev, -1);
            continue;
        }
        const pd_lg_request *p = &d.reqs[r->prev];
        assert_int_equal(r->prev, (int32_t)i - 1);
        assert_true(r->n_ids > p->n_ids + p->output_len);
        assert_memory_equal(r->ids, p->ids, p->n_ids * sizeof(int32_t));
        assert_int_equal(r->seg[r->n_seg - 2].role, PD_LG_ASSISTANT);
        assert_int_equal(r->seg[r->n_seg - 2].len, p->output_len);
    }
    pd_lg_dataset_free(&d);
}

static void test_slo_parse(void **state) {
    (void)state;
    pd_lg_slo s;
    char err[256];
    assert_true(pd_lg_slo_parse("ttft=200ms,tpot=0.05s,e2e=2s", &s, err, sizeof(err)));
    assert_true(s.ttft_ms == 200 && fabs(s.tpot_ms - 50) < 1e-9 && s.e2e_ms == 2000);
    assert_true(s.itl_ms == 0);
    const char *bad[] = {"ttft=", "ttft=5", "ttft=-1ms", "x=1ms", "ttft", "ttft=1h", "ttft=nanms"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        err[0] = '\0';
        assert_false(pd_lg_slo_parse(bad[i], &s, err, sizeof(err)));
        assert_true(err[0] != '\0');
    }
}

/* 100 completed requests with E2E 1..100 ms, TTFT half of it, 3 tokens;
 * 10 aborted ones that must not move the latency figures. */
static void test_results_figures(void **state) {
    (void)state;
    pd_lg_dataset_config dc;
    pd_lg_dataset_config_default(&dc);
    dc.num_prompts = 110;
    pd_lg_dataset d = build(&dc);
    pd_lg_run_config rc;
    pd_lg_run_config_default(&rc);
    pd_lg_results r = {.n = d.n, .duration_s = 2.0};
    r.r = calloc(d.n, sizeof(pd_lg_result));
    double itl[2] = {0.001, 0.003};
    for (uint32_t i = 0; i < d.n; i++) {
        pd_lg_result *x = &r.r[i];
        double e2e = (i % 100 + 1) / 1000.0;
        *x = (pd_lg_result){.outcome = i < 100 ? PD_LG_COMPLETED : PD_LG_ABORTED,
                            .start_s = 0,
                            .end_s = i < 100 ? e2e : 5.0,
                            .ttft_s = e2e / 2,
                            .prompt_tokens = 10,
                            .output_tokens = 3,
                            .cached_tokens = 4,
                            .itl = itl,
                            .n_itl = 2,
                            .abort_at_s = -1};
    }
    pd_lg_slo slo = {.e2e_ms = 50};
    json_t *o = pd_lg_results_json(&rc, &dc, &d, &r, &slo);
    assert_int_equal(json_integer_value(json_object_get(o, "completed")), 100);
    assert_int_equal(json_integer_value(json_object_get(o, "aborted")), 10);
    assert_int_equal(json_integer_value(json_object_get(o, "num_prompts")), 110);
    assert_int_equal(json_integer_value(json_object_get(o, "total_output_tokens")), 300);
    assert_int_equal(json_integer_value(json_object_get(o, "cache_hit_tokens")), 400);
    assert_int_equal(json_integer_value(json_object_get(o, "good_requests")), 50);
    struct {
        const char *k;
        double v;
    } want[] = {{"mean_e2e_latency_ms", 50.5}, {"median_e2e_latency_ms", 50.5},
                {"p90_e2e_latency_ms", 90.1},  {"p99_e2e_latency_ms", 99.01},
                {"max_e2e_latency_ms", 100},   {"std_e2e_latency_ms", 28.86607},
                {"median_ttft_ms", 25.25},     {"median_itl_ms", 2.0},
                {"max_itl_ms", 3.0},           {"request_throughput", 50.0},
                {"output_throughput", 150.0}};
    for (size_t k = 0; k < sizeof(want) / sizeof(want[0]); k++) {
        double got = json_number_value(json_object_get(o, want[k].k));
        if (fabs(got - want[k].v) > 1e-4)
            fail_msg("%s: %.6f, want %.6f", want[k].k, got, want[k].v);
    }
    /* TPOT: (e2e - ttft) / (3 - 1) = e2e / 4 */
    assert_true(fabs(json_number_value(json_object_get(o, "max_tpot_ms")) - 25.0) < 1e-9);
    json_decref(o);
    for (uint32_t i = 0; i < d.n; i++) r.r[i].itl = NULL;
    pd_lg_results_free(&r);
    pd_lg_dataset_free(&d);
}

static void test_bad_configs(void **state) {
    (void)state;
    pd_lg_dataset_config c;
    pd_lg_dataset d;
    char err[256];
    pd_lg_dataset_config_default(&c);
    c.vocab = 1;
    assert_int_not_equal(pd_lg_dataset_build(&c, &d, err, sizeof(err)), PD_OK);
    assert_non_null(strstr(err, "vocabulary"));
    pd_lg_dataset_config_default(&c);
    c.kind = PD_LG_TRACE;
    c.path = "/nonexistent/trace.jsonl";
    assert_int_equal(pd_lg_dataset_build(&c, &d, err, sizeof(err)), PD_ERR_IO);
    assert_non_null(strstr(err, "/nonexistent/trace.jsonl"));
    c.kind = PD_LG_SHAREGPT;
    c.text = true;
    assert_int_equal(pd_lg_dataset_build(&c, &d, err, sizeof(err)), PD_ERR_PARSE);
    assert_non_null(strstr(err, "/nonexistent/trace.jsonl"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_lengths_and_aborts), cmocka_unit_test(test_arrivals),
        cmocka_unit_test(test_shared_prefix_and_turns),   cmocka_unit_test(test_slo_parse),
        cmocka_unit_test(test_results_figures),           cmocka_unit_test(test_bad_configs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
