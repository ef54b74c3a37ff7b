/*
 * pd_report_write: the results JSON of `pdserve bench` as one report.html.
 *
 * The page is written to report.html.tmp and renamed over report.html only
 * once complete, so a failed write never leaves half a page, and a reader
 * never sees one. It is XHTML (well-formed XML): void elements closed,
 * only XML's five entities, every string from the JSON escaped by
 * rpt_put_esc, and the SVGs in their own namespace. Nothing on the page
 * loads anything: no script, no link, no font, no image.
 *
 * Order: what was run, the idle check (first and loud when it failed: a
 * benchmark that leaks is the one thing this report must not let pass
 * unseen), the summary, the latency CDFs, the timeline, each node's pools,
 * and the requests that failed.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "report.h"

#define ESC_BYTES_MAX 500

/* ---- output ------------------------------------------------------------------------------ */

void rpt_put(FILE *f, const char *s) { fputs(s, f); }

void rpt_putf(FILE *f, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof(buf), fmt, ap);
    va_end(ap);
    PD_ASSERTF(n >= 0 && (size_t)n < sizeof(buf), "report line of %d bytes", n);
    fwrite(buf, 1, (size_t)n, f);
}

/* XML 1.0 allows no control character but tab, newline and return, and
 * not U+FFFE / U+FFFF: those become U+FFFD. */
static void put_esc_char(FILE *f, const unsigned char *s, size_t *i) {
    unsigned char ch = s[*i];
    switch (ch) {
    case '<': fputs("&lt;", f); return;
    case '>': fputs("&gt;", f); return;
    case '&': fputs("&amp;", f); return;
    case '"': fputs("&quot;", f); return;
    case '\'': fputs("&#39;", f); return;
    default: break;
    }
    if ((ch < 0x20 && ch != '\t' && ch != '\n' && ch != '\r') || ch == 0x7f) {
        fputs("\xEF\xBF\xBD", f);
    } else if (ch == 0xEF && s[*i + 1] == 0xBF && (s[*i + 2] == 0xBE || s[*i + 2] == 0xBF)) {
        fputs("\xEF\xBF\xBD", f);
        *i += 2;
    } else {
        fputc(ch, f);
    }
}

void rpt_put_esc(FILE *f, const char *s, size_t max_bytes) {
    if (!s) return;
    if (max_bytes > ESC_BYTES_MAX) max_bytes = ESC_BYTES_MAX;
    size_t len = strnlen(s, max_bytes + 1), cut = len > max_bytes;
    if (cut) {
        len = max_bytes;
        while (len > 0 && ((unsigned char)s[len] & 0xC0) == 0x80) len--;
    }
    /* Valid UTF-8 only (jansson checks its strings, but not every caller
     * builds them through it): a broken byte becomes U+FFFD. */
    char clean[3 * ESC_BYTES_MAX + 1];
    pd_utf8_sanitize(s, len, clean, sizeof(clean));
    const unsigned char *u = (const unsigned char *)clean;
    for (size_t i = 0; u[i]; i++) put_esc_char(f, u, &i);
    if (cut) fputs("\xE2\x80\xA6", f);
}

/* A number for a table cell; null (NAN) is a dash. */
static void put_num(FILE *f, double v, int decimals, const char *unit) {
    if (isnan(v)) rpt_put(f, "\xE2\x80\x94");
    else rpt_putf(f, "%.*f%s", decimals, v, unit ? unit : "");
}

static void row_text(FILE *f, const char *label, const char *value) {
    rpt_putf(f, "<tr><th>%s</th><td>", label);
    if (value) rpt_put_esc(f, value, 300);
    else rpt_put(f, "\xE2\x80\x94");
    rpt_put(f, "</td></tr>\n");
}

static void row_num(FILE *f, const char *label, double v, int decimals, const char *unit) {
    rpt_putf(f, "<tr><th>%s</th><td>", label);
    put_num(f, v, decimals, unit);
    rpt_put(f, "</td></tr>\n");
}

/* ---- the page ---------------------------------------------------------------------------- */

static const char css[] =
    "body{font-family:sans-serif;margin:20px 28px;color:#222;max-width:1240px}"
    "h1{margin:0 0 6px}h2{margin:26px 0 8px;border-bottom:1px solid #ddd}"
    "table{border-collapse:collapse;margin:4px 16px 8px 0;font-size:14px}"
    "th,td{border:1px solid #ddd;padding:3px 8px;text-align:left}"
    "td.n{text-align:right;font-variant-numeric:tabular-nums}"
    "th{background:#f5f5f5;font-weight:600}"
    ".row{display:flex;flex-wrap:wrap;gap:8px;align-items:flex-start}"
    ".tables{display:flex;flex-wrap:wrap;align-items:flex-start}"
    ".fail{background:#d62728;color:#fff;padding:12px 16px;font-size:18px;font-weight:bold}"
    ".pass{color:#2a7d2a;font-weight:bold}.bad{color:#d62728;font-weight:bold}"
    "svg.chart{border:1px solid #e8e8e8;background:#fff}"
    "svg text{font-family:sans-serif;font-size:12px;fill:#333}"
    "svg text.title{font-size:14px}svg text.tick{font-size:11px;fill:#666}"
    ".foot{color:#888;font-size:12px;margin-top:24px}";

static void page_head(FILE *f) {
    rpt_put(f,
            "<!DOCTYPE html>\n<html xmlns=\"http://www.w3.org/1999/xhtml\" lang=\"en\">\n"
            "<head>\n<meta charset=\"utf-8\"/>\n<title>pdserve bench report</title>\n<style>");
    rpt_put(f, css);
    rpt_put(f, "</style>\n</head>\n<body>\n<h1>pdserve bench</h1>\n");
}

/* "TTFT 200 ms, TPOT 50 ms": the limits goodput counts against. */
static void slo_row(FILE *f, const rpt_model *m) {
    static const char *const names[RPT_METRICS] = {"TTFT", "TPOT", "ITL", "E2E"};
    rpt_put(f, "<tr><th>SLOs (goodput)</th><td>");
    bool any = false;
    for (int i = 0; i < RPT_METRICS; i++) {
        if (isnan(m->slo_ms[i])) continue;
        rpt_putf(f, "%s%s \xE2\x89\xA4 %g ms", any ? ", " : "", names[i], m->slo_ms[i]);
        any = true;
    }
    if (!any) rpt_put(f, m->has_slo ? "none set" : "none (no --slo)");
    rpt_put(f, "</td></tr>\n");
}

static void run_table(FILE *f, const rpt_model *m) {
    rpt_put(f, "<h2>What was run</h2>\n<table id=\"run\">\n");
    row_text(f, "url", m->url);
    row_text(f, "endpoint", m->endpoint);
    row_text(f, "backend", m->backend);
    row_text(f, "dataset", m->dataset);
    if (isnan(m->request_rate)) row_text(f, "request rate", "as fast as possible");
    else row_num(f, "request rate", m->request_rate, 2, " req/s");
    row_num(f, "burstiness", m->burstiness, 2, NULL);
    if (isnan(m->max_concurrency)) row_text(f, "max concurrency", "unlimited");
    else row_num(f, "max concurrency", m->max_concurrency, 0, NULL);
    slo_row(f, m);
    row_num(f, "seed", m->seed, 0, NULL);
    row_num(f, "duration", m->duration, 2, " s");
    row_num(f, "requests measured", m->num_prompts, 0, NULL);
    rpt_put(f, "</table>\n");
}

static void counts_table(FILE *f, const rpt_model *m) {
    rpt_put(f, "<table id=\"summary\">\n");
    row_num(f, "completed", m->completed, 0, NULL);
    row_num(f, "aborted", m->aborted, 0, NULL);
    row_num(f, "failed", m->failed, 0, NULL);
    row_num(f, "refused", m->refused, 0, NULL);
    row_num(f, "input tokens", m->total_input_tokens, 0, NULL);
    row_num(f, "output tokens", m->total_output_tokens, 0, NULL);
    row_num(f, "cache-hit tokens", m->cache_hit_tokens, 0, NULL);
    row_num(f, "request throughput", m->request_throughput, 2, " req/s");
    row_num(f, "input throughput", m->input_throughput, 1, " tok/s");
    row_num(f, "output throughput", m->output_throughput, 1, " tok/s");
    row_num(f, "total throughput", m->total_throughput, 1, " tok/s");
    row_num(f, "goodput (every SLO met)", m->goodput, 2, " req/s");
    row_num(f, "good requests", m->good_requests, 0, NULL);
    row_num(f, "mean concurrency", m->concurrency, 2, NULL);
    rpt_put(f, "</table>\n");
}

static void latency_table(FILE *f, const rpt_model *m) {
    static const char *const names[RPT_METRICS] = {"TTFT", "TPOT", "ITL", "E2E"};
    rpt_put(f,
            "<table id=\"latency\">\n<tr><th>ms</th><th>mean</th><th>median</th><th>p90</th>"
            "<th>p99</th><th>max</th></tr>\n");
    for (int i = 0; i < RPT_METRICS; i++) {
        rpt_putf(f, "<tr><th>%s</th>", names[i]);
        for (int s = 0; s < RPT_STATS; s++) {
            rpt_put(f, "<td class=\"n\">");
            put_num(f, m->stat[i][s], 2, NULL);
            rpt_put(f, "</td>");
        }
        rpt_put(f, "</tr>\n");
    }
    rpt_put(f, "</table>\n</div>\n");
}

static void node_name(FILE *f, const rpt_node *n, size_t i) {
    rpt_putf(f, "node %zu", i);
    if (n->role) {
        rpt_put(f, " (");
        rpt_put_esc(f, n->role, 40);
        rpt_put(f, ")");
    }
    if (n->url) {
        rpt_put(f, " ");
        rpt_put_esc(f, n->url, 200);
    }
}

/* The banner: one line per node whose idle check failed, naming its pools. */
static void idle_banner(FILE *f, const rpt_model *m) {
    bool any = m->idle_check_passed == 0;
    for (size_t i = 0; i < m->nodes_n; i++) any |= m->nodes[i].idle == 0;
    if (!any) return;
    rpt_put(f,
            "<div class=\"fail\" id=\"idle-failed\">IDLE CHECK FAILED: the run left "
            "resources held.");
    for (size_t i = 0; i < m->nodes_n; i++) {
        const rpt_node *n = &m->nodes[i];
        if (n->idle != 0) continue;
        rpt_put(f, "<br/>");
        node_name(f, n, i);
        rpt_put(f, ": ");
        rpt_put_esc(f, n->held[0] ? n->held : "no pool counts held units", 300);
        if (n->idle_problem && n->idle_problem[0]) {
            rpt_put(f, " \xE2\x80\x94 ");
            rpt_put_esc(f, n->idle_problem, 300);
        }
    }
    rpt_put(f, "</div>\n");
}

static void idle_table(FILE *f, const rpt_model *m) {
    rpt_put(f, "<h2>Idle check</h2>\n");
    if (m->idle_check_passed < 0 && m->nodes_n == 0) {
        rpt_put(f, "<p id=\"idle\">Not checked (no --check-node).</p>\n");
        return;
    }
    rpt_put(f,
            "<table id=\"idle\">\n<tr><th>node</th><th>verdict</th><th>waited</th>"
            "<th>still held</th><th>problem</th></tr>\n");
    for (size_t i = 0; i < m->nodes_n; i++) {
        const rpt_node *n = &m->nodes[i];
        rpt_put(f, "<tr><td>");
        node_name(f, n, i);
        rpt_putf(f, "</td><td class=\"%s\">%s</td><td class=\"n\">",
                 n->idle == 1       ? "pass"
                     : n->idle == 0 ? "bad"
                                    : "",
                 n->idle == 1       ? "passed"
                     : n->idle == 0 ? "FAILED"
                                    : "not checked");
        put_num(f, n->idle_waited_s, 2, " s");
        rpt_put(f, "</td><td>");
        rpt_put_esc(f, n->held, 300);
        rpt_put(f, "</td><td>");
        rpt_put_esc(f, n->idle_problem, 300);
        rpt_put(f, "</td></tr>\n");
    }
    rpt_put(f, "</table>\n");
}

static void charts(FILE *f, const rpt_model *m) {
    rpt_put(f, "<h2>Latency</h2>\n<div class=\"row\">\n");
    rpt_svg_cdf(f, "cdf-ttft", "TTFT, completed requests", "time to first token", &m->ttft_ms);
    rpt_svg_cdf(f, "cdf-itl", "ITL, every gap", "inter-token latency", &m->itl_ms);
    rpt_svg_cdf(f, "cdf-e2e", "E2E, completed requests", "end-to-end latency", &m->e2e_ms);
    rpt_put(f, "</div>\n<h2>Throughput, concurrency and aborts over time</h2>\n");
    rpt_svg_timeline(f, m);
    rpt_put(f, "<h2>Pool units by ledger state</h2>\n");
    if (!m->nodes_n) rpt_put(f, "<p>No node was watched (--check-node).</p>\n");
    for (size_t i = 0; i < m->nodes_n; i++) {
        const rpt_node *n = &m->nodes[i];
        rpt_put(f, "<h3>");
        node_name(f, n, i);
        rpt_putf(f, ": %zu samples</h3>\n<div class=\"row\">\n", n->samples);
        if (!n->pools) {
            rpt_putf(f,
                     "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" "
                     "id=\"pools-%zu\" width=\"600\" height=\"60\"><text class=\"nodata\" "
                     "x=\"20\" y=\"34\">no data: no pool was sampled</text></svg>\n",
                     i);
        }
        for (size_t p = 0; p < n->pools; p++) rpt_svg_pool(f, n, i, p);
        if (n->pools_dropped) rpt_putf(f, "<p>%zu more pools not drawn.</p>\n", n->pools_dropped);
        rpt_put(f, "</div>\n");
    }
}

static void failures_table(FILE *f, const rpt_model *m) {
    if (!m->failures_total) return;
    rpt_putf(f,
             "<h2>Failed and refused requests</h2>\n<p>%zu in all%s.</p>\n"
             "<table id=\"failures\">\n<tr><th>index</th><th>rid</th><th>outcome</th>"
             "<th>status</th><th>error</th></tr>\n",
             m->failures_total, m->failures_total > m->failures_n ? ", the first shown" : "");
    for (size_t i = 0; i < m->failures_n; i++) {
        const json_t *q = m->failures[i];
        rpt_put(f, "<tr><td class=\"n\">");
        const json_t *index = json_object_get(q, "index");
        put_num(f, json_is_number(index) ? json_number_value(index) : NAN, 0, NULL);
        rpt_put(f, "</td><td>");
        rpt_put_esc(f, json_string_value(json_object_get(q, "rid")), 100);
        rpt_put(f, "</td><td>");
        rpt_put_esc(f, json_string_value(json_object_get(q, "outcome")), 20);
        rpt_put(f, "</td><td class=\"n\">");
        const json_t *status = json_object_get(q, "status");
        put_num(f, json_is_number(status) ? json_number_value(status) : NAN, 0, NULL);
        rpt_put(f, "</td><td>");
        rpt_put_esc(f, json_string_value(json_object_get(q, "error")), 300);
        rpt_put(f, "</td></tr>\n");
    }
    rpt_put(f, "</table>\n");
}

static void page(FILE *f, const rpt_model *m) {
    page_head(f);
    idle_banner(f, m);
    run_table(f, m);
    rpt_put(f, "<h2>Summary</h2>\n<div class=\"tables\">\n");
    counts_table(f, m);
    latency_table(f, m);
    idle_table(f, m);
    charts(f, m);
    failures_table(f, m);
    rpt_put(f, "<p class=\"foot\">pdserve ");
    rpt_put_esc(f, m->version ? m->version : PD_VERSION, 40);
    rpt_put(f, " bench report, drawn from the results JSON.</p>\n</body>\n</html>\n");
}

/* ---- the file ---------------------------------------------------------------------------- */

static pd_err make_dir(const char *dir, char *err, size_t errlen) {
    if (mkdir(dir, 0777) == 0) return PD_OK;
    int e = errno;
    struct stat st;
    if (e == EEXIST && stat(dir, &st) == 0 && S_ISDIR(st.st_mode)) return PD_OK;
    return pd_errorf(err, errlen, PD_ERR_IO, "cannot create the report directory %s: %s", dir,
                     e == EEXIST ? "it exists and is not a directory" : strerror(e));
}

int pd_report_write(const json_t *results, const char *dir, char *err, size_t errlen) {
    if (!dir || !dir[0]) return pd_errorf(err, errlen, PD_ERR_INVALID, "no report directory");
    rpt_model m;
    pd_err rc = rpt_extract(results, &m, err, errlen);
    if (rc == PD_OK) rc = make_dir(dir, err, errlen);
    size_t plen = strlen(dir) + sizeof("/report.html.tmp");
    char *path = rc == PD_OK ? malloc(2 * plen) : NULL;
    if (rc == PD_OK && !path) rc = pd_errorf(err, errlen, PD_ERR_NOMEM, "out of memory");
    FILE *f = NULL;
    if (rc == PD_OK) {
        char *tmp = path + plen;
        snprintf(path, plen, "%s/report.html", dir);
        snprintf(tmp, plen, "%s/report.html.tmp", dir);
        if (!(f = fopen(tmp, "w")))
            rc = pd_errorf(err, errlen, PD_ERR_IO, "cannot write %s: %s", tmp, strerror(errno));
    }
    if (f) {
        char *tmp = path + plen;
        page(f, &m);
        bool bad = fflush(f) != 0 || ferror(f);
        int e = errno;
        bad |= fclose(f) != 0;
        if (!bad && rename(tmp, path) != 0) {
            bad = true;
            e = errno;
        }
        if (bad) {
            unlink(tmp);
            rc = pd_errorf(err, errlen, PD_ERR_IO, "cannot write %s: %s", path, strerror(e));
        }
    }
    free(path);
    rpt_model_free(&m); /* a failed extraction left it empty */
    return rc;
}
