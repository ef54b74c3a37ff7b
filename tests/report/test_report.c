/* The bench report: results JSON built here, report.html written and read
 * back. Each case's page is kept under $PD_REPORT_KEEP/<case>/ (ctest sets
 * it) so that report_cases parses every one of them as XML. */
#include <math.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../test_util.h"
#include "pdserve/report.h"

static char scratch[256];

static const char *case_dir(const char *name, char *buf, size_t cap) {
    const char *keep = getenv("PD_REPORT_KEEP");
    if (!keep) {
        if (!scratch[0]) {
            snprintf(scratch, sizeof(scratch), "/tmp/pd_report_test_XXXXXX");
            assert_non_null(mkdtemp(scratch));
        }
        keep = scratch;
    }
    mkdir(keep, 0777);
    snprintf(buf, cap, "%s/%s", keep, name);
    return buf;
}

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
    buf[n] = '\0';
    fclose(f);
    return buf;
}

/* Writes the report of r under case `name`, expecting success; returns the page. */
static char *render(const char *name, json_t *r) {
    char dir[512], path[600], err[256] = "";
    case_dir(name, dir, sizeof(dir));
    int rc = pd_report_write(r, dir, err, sizeof(err));
    if (rc) fail_msg("%s: %s", name, err);
    snprintf(path, sizeof(path), "%s/report.html", dir);
    char *text = slurp(path);
    assert_non_null(text);
    json_decref(r);
    return text;
}

/* ---- building results ---------------------------------------------------------------------- */

static json_t *num_or_null(double v) { return isnan(v) ? json_null() : json_real(v); }

static json_t *request(int i, const char *outcome, double start, double end, double ttft) {
    char rid[32];
    snprintf(rid, sizeof(rid), "bench-1-%d", i);
    return json_pack("{s:i, s:s, s:f, s:f, s:o, s:s, s:n, s:i, s:i, s:i, s:i, s:s}", "index", i,
                     "rid", rid, "start_s", start, "end_s", end, "ttft_s", num_or_null(ttft),
                     "outcome", outcome, "abort", "status", 200, "input_len", 100, "output_len", 8,
                     "cached_tokens", 0, "error", "");
}

static json_t *pool(const char *name, int total, int req, int cache, int quar) {
    return json_pack("{s:s, s:s, s:i, s:i, s:i, s:i, s:i, s:i}", "name", name, "kind", name,
                     "total", total, "free", total - req - cache - quar, "req", req,
                     "cache_evictable", cache, "cache_protected", 0, "quarantine", quar);
}

/* A node sampled at t = 0, 1, 2, 3 with kv's req band at 0, 40, 40, `req_end`. */
static json_t *node(int req_end, bool passed) {
    json_t *samples = json_array();
    const int reqs[] = {0, 40, 40, req_end};
    for (int s = 0; s < 4; s++) {
        json_t *pools = json_pack("[o, o]", pool("kv", 256, reqs[s], 16 * s, 0),
                                  pool("mamba", 8, s == 1 ? 2 : 0, 0, 0));
        json_array_append_new(samples, json_pack("{s:f, s:o}", "t_s", (double)s, "pools", pools));
    }
    json_t *last = json_array_get(json_object_get(json_array_get(samples, 3), "pools"), 0);
    json_t *idle = json_pack("{s:b, s:f, s:s, s:[O]}", "passed", passed, "waited_s", 0.3, "problem",
                             passed ? "" : "kv: 12 units held by requests", "pools", last);
    return json_pack("{s:s, s:s, s:o, s:o}", "url", "http://127.0.0.1:30001", "role", "prefill",
                     "samples", samples, "idle_check", idle);
}

/* A complete, valid results object: n requests, the first `aborted` of
 * them aborted, a timeline, aborts of each kind and one node. */
static json_t *results(int n, int aborted) {
    json_t *reqs = json_array(), *itls = json_array();
    for (int i = 0; i < n; i++) {
        bool ab = i < aborted;
        double start = i * 0.01, end = start + 0.05 + 0.002 * i;
        json_array_append_new(
            reqs,
            request(i, ab ? "aborted" : "completed", start, end, ab ? NAN : 0.01 + 0.0001 * i));
        json_array_append_new(itls, json_pack("[f, f, f]", 0.002, 0.003, 0.002 + 0.00001 * i));
    }
    json_t *timeline = json_pack("{s:f, s:[f,f,f], s:[f,f,f], s:[f,f,f], s:[f,f,f]}", "interval_s",
                                 0.25, "t_s", 0.25, 0.5, 0.75, "requests_done_per_s", 4.0, 8.0, 2.0,
                                 "output_tokens_per_s", 32.0, 64.0, 16.0, "concurrency", 2.0, 3.0,
                                 0.0);
    json_t *aborts = json_pack("[{s:f, s:s, s:s}, {s:f, s:s, s:s}, {s:f, s:s, s:n}]", "t_s", 0.1,
                               "kind", "request", "rid", "bench-1-0", "t_s", 0.2, "kind", "close",
                               "rid", "bench-1-1", "t_s", 0.3, "kind", "all", "rid");
    json_t *pd = json_pack("{s:s, s:s, s:s, s:o, s:o, s:o, s:[o], s:b}", "version", "0.1.0", "url",
                           "http://127.0.0.1:30000", "endpoint", "/generate", "requests", reqs,
                           "timeline", timeline, "aborts", aborts, "nodes", node(0, true),
                           "idle_check_passed", 1);
    json_t *r = json_pack("{s:s, s:s, s:f, s:f, s:n, s:i, s:f, s:i, s:i, s:i, s:i, s:i}", "backend",
                          "pdserve-generate", "dataset_name", "random", "request_rate", 12.5,
                          "burstiness", 1.0, "max_concurrency", "seed", 1, "duration", 1.0,
                          "num_prompts", n, "completed", n - aborted, "aborted", aborted, "failed",
                          0, "refused", 0);
    assert_non_null(r);
    json_object_set_new(r, "mean_ttft_ms", json_real(12.5));
    json_object_set_new(
        r, "slo",
        json_pack("{s:i, s:n, s:n, s:f}", "ttft_ms", 200, "tpot_ms", "itl_ms", "e2e_ms", 1500.0));
    json_object_set_new(r, "p99_e2e_latency_ms", json_null());
    json_object_set_new(r, "itls", itls);
    json_object_set_new(r, "pdserve", pd);
    return r;
}

static json_t *pd_of(json_t *r) { return json_object_get(r, "pdserve"); }

/* The svg element with this id, as a string up to its end (for checks
 * inside one chart). Returns a malloc'ed copy. */
static char *chart(const char *page, const char *id) {
    char needle[128];
    snprintf(needle, sizeof(needle), "id=\"%s\"", id);
    const char *at = strstr(page, needle);
    if (!at) fail_msg("no chart with id %s", id);
    const char *end = strstr(at, "</svg>");
    assert_non_null(end);
    size_t n = (size_t)(end - at);
    char *out = malloc(n + 1);
    assert_non_null(out);
    memcpy(out, at, n);
    out[n] = '\0';
    return out;
}

static void assert_no_nan(const char *page) {
    assert_null(strstr(page, "nan"));
    assert_null(strstr(page, "inf\""));
    assert_null(strstr(page, " inf"));
}

/* ---- cases -------------------------------------------------------------------------------- */

static void full_run_draws_every_chart(void **state) {
    (void)state;
    char *page = render("full", results(20, 5));
    const char *ids[] = {"cdf-ttft", "cdf-itl",    "cdf-e2e",
                         "timeline", "pools-0-kv", "pools-0-mamba"};
    for (size_t i = 0; i < PD_ARRAY_LEN(ids); i++) {
        char *c = chart(page, ids[i]);
        assert_null(strstr(c, "no data"));
        assert_true(strstr(c, "<polyline") || strstr(c, "<path"));
        free(c);
    }
    char *tl = chart(page, "timeline");
    assert_non_null(strstr(tl, "class=\"abort-request\""));
    assert_non_null(strstr(tl, "class=\"abort-close\""));
    assert_non_null(strstr(tl, "class=\"abort-all\""));
    free(tl);
    char *kv = chart(page, "pools-0-kv");
    assert_non_null(strstr(kv, "class=\"band-req\""));
    assert_non_null(strstr(kv, "idle check passed"));
    free(kv);
    assert_null(strstr(page, "IDLE CHECK FAILED"));
    assert_non_null(strstr(page, "<td>http://127.0.0.1:30000</td>"));
    assert_non_null(strstr(page, "<td>TTFT \xE2\x89\xA4 200 ms, E2E \xE2\x89\xA4 1500 ms</td>"));
    assert_no_nan(page);
    free(page);
}

static void no_requests_says_no_data(void **state) {
    (void)state;
    json_t *r = results(0, 0);
    json_object_del(pd_of(r), "timeline");
    json_object_del(pd_of(r), "aborts");
    json_object_set_new(pd_of(r), "nodes", json_array());
    json_object_set_new(pd_of(r), "idle_check_passed", json_null());
    json_object_set_new(r, "duration", json_real(0));
    char *page = render("empty", r);
    const char *ids[] = {"cdf-ttft", "cdf-itl", "cdf-e2e", "timeline"};
    for (size_t i = 0; i < PD_ARRAY_LEN(ids); i++) {
        char *c = chart(page, ids[i]);
        assert_non_null(strstr(c, "no data"));
        assert_null(strstr(c, "<polyline"));
        free(c);
    }
    assert_non_null(strstr(page, "Not checked"));
    assert_no_nan(page);
    free(page);
}

static void all_aborted_has_no_latency_curves_but_aborts(void **state) {
    (void)state;
    json_t *r = results(10, 10);
    json_object_set_new(r, "itls", json_array());
    char *page = render("all_aborted", r);
    char *ttft = chart(page, "cdf-ttft"), *e2e = chart(page, "cdf-e2e");
    assert_non_null(strstr(ttft, "no data"));
    assert_non_null(strstr(e2e, "no data"));
    assert_non_null(strstr(page, "class=\"abort-request\""));
    assert_no_nan(page);
    free(ttft);
    free(e2e);
    free(page);
}

static void leak_is_loud_and_names_the_pool(void **state) {
    (void)state;
    json_t *r = results(8, 2);
    json_t *nodes = json_pack("[o, o]", node(0, true), node(12, false));
    json_object_set_new(pd_of(r), "nodes", nodes);
    json_object_set_new(pd_of(r), "idle_check_passed", json_false());
    char *page = render("leak", r);
    const char *banner = strstr(page, "id=\"idle-failed\"");
    assert_non_null(banner);
    /* The banner comes before any chart, names node 1 and its pool kv. */
    assert_true(banner < strstr(page, "<svg"));
    assert_non_null(strstr(banner, "node 1 (prefill)"));
    assert_non_null(strstr(banner, "kv (req 12, quarantine 0)"));
    char *kv1 = chart(page, "pools-1-kv"), *kv0 = chart(page, "pools-0-kv");
    assert_non_null(strstr(kv1, "idle check FAILED: 12 held (req 12, quarantine 0)"));
    assert_non_null(strstr(kv0, "idle check passed"));
    free(kv1);
    free(kv0);
    free(page);
}

static void strings_from_the_json_are_escaped(void **state) {
    (void)state;
    json_t *r = results(4, 0);
    json_t *pd = pd_of(r);
    json_object_set_new(pd, "url", json_string("http://h/?a=1&b=<2>\"q'"));
    json_t *q = json_array_get(json_object_get(pd, "requests"), 3);
    json_object_set_new(q, "outcome", json_string("failed"));
    json_object_set_new(q, "rid", json_string("r<&>\"'"));
    json_object_set_new(q, "error", json_string("HTTP 503: <html> & \"x\" \x01"));
    json_t *n0 = json_array_get(json_object_get(pd, "nodes"), 0);
    json_object_set_new(n0, "url", json_string("http://n/<script>"));
    json_t *s0 = json_array_get(json_object_get(n0, "samples"), 0);
    json_object_set_new(json_array_get(json_object_get(s0, "pools"), 0), "name",
                        json_string("kv<&>"));
    char *page = render("escaped", r);
    assert_non_null(strstr(page, "http://h/?a=1&amp;b=&lt;2&gt;&quot;q&#39;"));
    assert_non_null(strstr(page, "r&lt;&amp;&gt;&quot;&#39;"));
    assert_non_null(strstr(page, "HTTP 503: &lt;html&gt; &amp; &quot;x&quot; \xEF\xBF\xBD"));
    assert_non_null(strstr(page, "http://n/&lt;script&gt;"));
    assert_non_null(strstr(page, "id=\"pools-0-kv___\""));
    assert_null(strstr(page, "<script"));
    assert_null(strstr(page, "<2>"));
    assert_null(strstr(page, "<html>"));
    free(page);
}

static void nulls_where_the_schema_allows_them(void **state) {
    (void)state;
    json_t *r = results(6, 1);
    json_t *pd = pd_of(r);
    json_object_set_new(r, "request_rate", json_null());
    json_object_set_new(r, "goodput", json_null());
    json_object_set_new(r, "good_requests", json_null());
    json_object_set_new(r, "slo", json_null());
    json_object_set_new(r, "seed", json_null());
    json_object_set_new(pd, "idle_check_passed", json_null());
    json_t *q = json_array_get(json_object_get(pd, "requests"), 2);
    json_object_set_new(q, "ttft_s", json_null());
    json_object_set_new(q, "status", json_null());
    json_object_set_new(json_array_get(json_object_get(pd, "nodes"), 0), "idle_check", json_null());
    json_t *conc = json_object_get(json_object_get(pd, "timeline"), "concurrency");
    json_array_set_new(conc, 1, json_null());
    json_array_set_new(json_object_get(r, "itls"), 0, json_null());
    char *page = render("nulls", r);
    assert_non_null(strstr(page, "as fast as possible"));
    assert_non_null(strstr(page, "none (no --slo)"));
    assert_non_null(strstr(page, "not checked"));
    assert_non_null(strstr(page, "(n = 4)")); /* TTFT: 5 completed, one without */
    assert_no_nan(page);
    free(page);
}

static void cdf_of_many_requests_is_downsampled(void **state) {
    (void)state;
    json_t *r = results(0, 0);
    json_t *reqs = json_object_get(pd_of(r), "requests");
    for (int i = 0; i < 100000; i++) /* e2e from 1 ms to 1 s: a 1000x spread */
        json_array_append_new(reqs, request(i, "completed", 0, 0.001 + i * 0.00001, 0.0005));
    char *page = render("many", r);
    char *e2e = chart(page, "cdf-e2e"), *ttft = chart(page, "cdf-ttft");
    const char *pts = strstr(e2e, "points=\"");
    assert_non_null(pts);
    size_t points = 1;
    for (const char *s = pts; *s && *s != '/'; s++) points += *s == ' ';
    assert_in_range(points, 400, 501);
    assert_non_null(strstr(e2e, "log scale"));
    assert_non_null(strstr(e2e, "(n = 100000)"));
    assert_null(strstr(ttft, "log scale")); /* one value: no spread */
    free(e2e);
    free(ttft);
    free(page);
}

/* The curve climbs: its points' x and y never go back, whatever order the
 * values came in (here shuffled, with repeats, zeros and one negative). */
static void cdf_points_never_go_back(void **state) {
    (void)state;
    json_t *r = results(0, 0);
    json_t *reqs = json_object_get(pd_of(r), "requests");
    uint64_t x = test_seed(7);
    for (int i = 0; i < 3000; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        double e2e = i == 5 ? -0.002 : i % 100 == 0 ? 0 : (double)(x >> 40) / 1e7;
        json_array_append_new(reqs, request(i, "completed", 1.0, 1.0 + e2e, 0.001 * (i % 7)));
    }
    char *page = render("shuffled", r);
    const char *ids[] = {"cdf-e2e", "cdf-ttft"};
    for (size_t c = 0; c < PD_ARRAY_LEN(ids); c++) {
        char *svg = chart(page, ids[c]);
        const char *p = strstr(strstr(svg, "class=\"cdf\""), "points=\"") + 8;
        double px = -1, py = 1e9;
        int n = 0, used;
        for (double qx, qy; sscanf(p, "%lf,%lf%n", &qx, &qy, &used) == 2; p += used, n++) {
            assert_true(qx >= px);
            assert_true(qy <= py); /* SVG's y grows downwards */
            px = qx;
            py = qy;
        }
        assert_int_equal(n, 501);
        free(svg);
    }
    free(page);
}

/* Values at the ends of what a double holds, times that go backwards, a
 * timeline shorter than a denormal: the page is still written, bounded,
 * with no NaN in it. */
static void extreme_values_stay_drawable(void **state) {
    (void)state;
    json_t *r = results(0, 0);
    json_t *pd = pd_of(r), *reqs = json_object_get(pd, "requests");
    json_array_append_new(reqs, request(0, "completed", 0, 1e300, 1e-300));
    json_array_append_new(reqs, request(1, "completed", 5, 1, 4.9e-324));
    json_array_append_new(reqs, request(2, "completed", 0, 0, 0));
    json_object_set_new(r, "duration", json_real(4.9e-324));
    json_t *tl = json_object_get(pd, "timeline");
    json_object_set_new(tl, "t_s", json_pack("[f, f, f]", 4.9e-324, 1e-323, 2e-323));
    json_object_set_new(tl, "concurrency", json_pack("[f, f, f]", -1e308, 1e308, 0.0));
    json_object_set_new(pd, "aborts", json_pack("[{s:f, s:s}]", "t_s", -5.0, "kind", "all"));
    json_object_set_new(r, "itls", json_pack("[[f, f, f]]", 0.0, 1e-310, 1e308));
    /* Samples all at one time far from 0, where t + 1 == t. */
    json_t *samples = json_object_get(json_array_get(json_object_get(pd, "nodes"), 0), "samples");
    for (size_t i = 0; i < json_array_size(samples); i++)
        json_object_set_new(json_array_get(samples, i), "t_s", json_real(1e20));
    char *page = render("extreme", r);
    assert_no_nan(page);
    assert_true(strlen(page) < 400000);
    free(page);
}

static int report_error(json_t *r, const char *dir, char *err, size_t cap) {
    int rc = pd_report_write(r, dir, err, cap);
    json_decref(r);
    return rc;
}

static void bad_input_names_the_field(void **state) {
    (void)state;
    char dir[512], err[256];
    case_dir("bad", dir, sizeof(dir));
    json_t *r = results(3, 0);
    json_object_del(r, "completed");
    assert_err(report_error(r, dir, err, sizeof(err)), PD_ERR_PARSE);
    assert_string_equal(err, "completed: missing (required)");
    r = results(3, 0);
    json_object_set_new(r, "duration", json_string("12"));
    assert_err(report_error(r, dir, err, sizeof(err)), PD_ERR_PARSE);
    assert_string_equal(err, "duration: expected a number, found a string");
    r = results(3, 0);
    json_object_del(json_array_get(json_object_get(pd_of(r), "requests"), 1), "end_s");
    assert_err(report_error(r, dir, err, sizeof(err)), PD_ERR_PARSE);
    assert_string_equal(err, "pdserve.requests[1].end_s: missing (required)");
    r = results(3, 0);
    json_t *n0 = json_array_get(json_object_get(pd_of(r), "nodes"), 0);
    json_t *s1 = json_array_get(json_object_get(n0, "samples"), 1);
    json_object_set_new(json_array_get(json_object_get(s1, "pools"), 0), "free", json_true());
    assert_err(report_error(r, dir, err, sizeof(err)), PD_ERR_PARSE);
    assert_string_equal(err,
                        "pdserve.nodes[0].samples[1].pools[0].free: expected a number, found a "
                        "boolean");
    r = results(3, 0);
    json_array_set_new(json_object_get(r, "itls"), 2, json_string("x"));
    assert_err(report_error(r, dir, err, sizeof(err)), PD_ERR_PARSE);
    assert_string_equal(err, "itls[2]: expected an array, found a string");
    r = results(3, 0);
    json_object_set_new(json_object_get(pd_of(r), "timeline"), "concurrency", json_array());
    assert_err(report_error(r, dir, err, sizeof(err)), PD_ERR_PARSE);
    assert_string_equal(err, "pdserve.timeline.concurrency: 0 values, but t_s has 3");
    assert_err(report_error(json_array(), dir, err, sizeof(err)), PD_ERR_PARSE);
    assert_string_equal(err, "results: expected an object, found an array");
    /* Nothing was written for bad input. */
    char path[600];
    snprintf(path, sizeof(path), "%s/report.html", dir);
    assert_int_equal(access(path, F_OK), -1);
}

static void unwritable_dir_is_named(void **state) {
    (void)state;
    char dir[512], file[600], sub[700], err[512];
    case_dir("unwritable", dir, sizeof(dir));
    mkdir(dir, 0777);
    snprintf(file, sizeof(file), "%s/plain_file", dir);
    FILE *f = fopen(file, "w");
    assert_non_null(f);
    fclose(f);
    snprintf(sub, sizeof(sub), "%s/sub", file);
    assert_err(report_error(results(2, 0), sub, err, sizeof(err)), PD_ERR_IO);
    assert_non_null(strstr(err, "cannot create the report directory"));
    assert_non_null(strstr(err, sub));
    assert_err(report_error(results(2, 0), file, err, sizeof(err)), PD_ERR_IO);
    assert_non_null(strstr(err, "it exists and is not a directory"));
    snprintf(sub, sizeof(sub), "%s/no/such/parent", dir);
    assert_err(report_error(results(2, 0), sub, err, sizeof(err)), PD_ERR_IO);
    assert_non_null(strstr(err, sub));
    assert_err(report_error(results(2, 0), "", err, sizeof(err)), PD_ERR_INVALID);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(full_run_draws_every_chart),
        cmocka_unit_test(no_requests_says_no_data),
        cmocka_unit_test(all_aborted_has_no_latency_curves_but_aborts),
        cmocka_unit_test(leak_is_loud_and_names_the_pool),
        cmocka_unit_test(strings_from_the_json_are_escaped),
        cmocka_unit_test(nulls_where_the_schema_allows_them),
        cmocka_unit_test(cdf_of_many_requests_is_downsampled),
        cmocka_unit_test(cdf_points_never_go_back),
        cmocka_unit_test(extreme_values_stay_drawable),
        cmocka_unit_test(bad_input_names_the_field),
        cmocka_unit_test(unwritable_dir_is_named),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
