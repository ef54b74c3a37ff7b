/*
 * The report's charts, as inline SVG: latency CDFs, the timeline, and each
 * node's pools by ledger state.
 *
 * A chart is a frame (the plot area in pixels and the data ranges it maps)
 * plus axes with "nice" ticks (1, 2 or 5 times a power of ten; decades on a
 * log axis). Coordinates are written with one decimal: a 1,200-pixel chart
 * needs no more, and the page stays small. Colours are attributes, not CSS,
 * so a chart copied out of the page keeps them.
 */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "report.h"

#define C_REQ "#4e79a7"
#define C_CACHE "#59a14f"
#define C_QUAR "#e15759"
#define C_FREE "#dcdcdc"
#define C_ABORT_REQ "#f28e2b"
#define C_ABORT_CLOSE "#9c6ade"
#define C_ABORT_ALL "#d62728"
#define C_GRID "#e4e4e4"
#define C_AXIS "#555555"

typedef struct frame {
    double left, top, w, h; /* the plot area, px */
    double x_lo, x_hi, y_lo, y_hi;
    bool x_log;
} frame;

static double fx(const frame *f, double v) {
    double t;
    if (f->x_log) {
        double lv = log10(v > f->x_lo ? v : f->x_lo);
        t = (lv - log10(f->x_lo)) / (log10(f->x_hi) - log10(f->x_lo));
    } else {
        t = (v - f->x_lo) / (f->x_hi - f->x_lo);
    }
    return f->left + (t < 0 ? 0 : t > 1 ? 1 : t) * f->w;
}

static double fy(const frame *f, double v) {
    double t = (v - f->y_lo) / (f->y_hi - f->y_lo);
    return f->top + f->h - (t < 0 ? 0 : t > 1 ? 1 : t) * f->h;
}

#define TICKS_MAX 64 /* per axis: bounds every tick loop, whatever the input's scale */

/* 1, 2 or 5 times a power of ten, about range/target; never 0 (a range
 * deep in the denormals would make the power of ten 0). */
static double nice_step(double range, int target) {
    if (!(range > 0)) return 1;
    double raw = range / target, mag = pow(10, floor(log10(raw))), r = raw / mag;
    if (!(mag > 0) || !isfinite(r)) return range;
    return (r < 1.5 ? 1 : r < 3 ? 2 : r < 7 ? 5 : 10) * mag;
}

/* The smallest multiple of a nice step at or above v (an axis's top). */
static double nice_ceil(double v) {
    if (!(v > 0)) return 1;
    double step = nice_step(v, 5);
    return ceil(v / step - 1e-9) * step;
}

static void fmt_tick(char *buf, size_t cap, double v) {
    double a = fabs(v);
    if (a >= 1e6) snprintf(buf, cap, "%gM", v / 1e6);
    else if (a >= 1e4) snprintf(buf, cap, "%gk", v / 1e3);
    else snprintf(buf, cap, "%g", fabs(v) < 1e-12 ? 0.0 : v);
}

static void svg_open(FILE *f, const char *id, double w, double h, const char *title) {
    rpt_put(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" class=\"chart\" id=\"");
    rpt_put_esc(f, id, 200);
    rpt_putf(f, "\" width=\"%.0f\" height=\"%.0f\" viewBox=\"0 0 %.0f %.0f\">\n", w, h, w, h);
    rpt_put(f, "<text x=\"10\" y=\"18\" class=\"title\" font-weight=\"bold\">");
    rpt_put_esc(f, title, 300);
    rpt_put(f, "</text>\n");
}

static void no_data(FILE *f, const frame *fr) {
    rpt_putf(f,
             "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"#fafafa\" "
             "stroke=\"" C_GRID "\"/>\n",
             fr->left, fr->top, fr->w, fr->h);
    rpt_putf(f,
             "<text class=\"nodata\" x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" "
             "fill=\"#888888\">no data</text>\n",
             fr->left + fr->w / 2, fr->top + fr->h / 2);
}

static void x_tick(FILE *f, const frame *fr, double v, bool label, bool minor) {
    double x = fx(fr, v);
    rpt_putf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\"/>\n", x,
             fr->top, x, fr->top + fr->h, minor ? "#f2f2f2" : C_GRID);
    if (!label) return;
    char t[32];
    fmt_tick(t, sizeof(t), v);
    rpt_putf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" class=\"tick\">%s</text>\n", x,
             fr->top + fr->h + 14, t);
}

static void x_ticks(FILE *f, const frame *fr, bool labels) {
    if (fr->x_log) {
        double d = floor(log10(fr->x_lo));
        for (int n = 0; n < TICKS_MAX && d <= ceil(log10(fr->x_hi)); n++, d++) {
            double v = pow(10, d);
            for (int k = 2; k < 10 && v * k < fr->x_hi; k++)
                if (v * k > fr->x_lo) x_tick(f, fr, v * k, false, true);
            if (v >= fr->x_lo * 0.999 && v <= fr->x_hi * 1.001) x_tick(f, fr, v, labels, false);
        }
        return;
    }
    double step = nice_step(fr->x_hi - fr->x_lo, 8);
    double v = ceil(fr->x_lo / step) * step;
    for (int n = 0; n < TICKS_MAX && v <= fr->x_hi + step * 1e-6; n++, v += step)
        x_tick(f, fr, v, labels, false);
}

static void y_ticks(FILE *f, const frame *fr, bool percent) {
    double step = nice_step(fr->y_hi - fr->y_lo, 4);
    double v = ceil(fr->y_lo / step) * step;
    for (int n = 0; n < TICKS_MAX && v <= fr->y_hi + step * 1e-6; n++, v += step) {
        double y = fy(fr, v);
        char t[32];
        if (percent) snprintf(t, sizeof(t), "%g%%", round(v * 100));
        else fmt_tick(t, sizeof(t), v);
        rpt_putf(f,
                 "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"" C_GRID
                 "\"/>\n<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\" class=\"tick\">%s"
                 "</text>\n",
                 fr->left, y, fr->left + fr->w, y, fr->left - 4, y + 4, t);
    }
}

/* Grid, ticks and the axis lines; x_label NULL: no x labels (a panel
 * above another that carries them). */
static void axes(FILE *f, const frame *fr, const char *x_label, const char *y_label, bool percent) {
    x_ticks(f, fr, x_label != NULL);
    y_ticks(f, fr, percent);
    rpt_putf(f, "<path d=\"M%.1f %.1fV%.1fH%.1f\" fill=\"none\" stroke=\"" C_AXIS "\"/>\n",
             fr->left, fr->top, fr->top + fr->h, fr->left + fr->w);
    if (x_label) {
        rpt_putf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" class=\"axis\">",
                 fr->left + fr->w / 2, fr->top + fr->h + 32);
        rpt_put_esc(f, x_label, 200);
        rpt_put(f, "</text>\n");
    }
    double yc = fr->top + fr->h / 2;
    rpt_putf(f,
             "<text x=\"14\" y=\"%.1f\" text-anchor=\"middle\" class=\"axis\" "
             "transform=\"rotate(-90 14 %.1f)\">",
             yc, yc);
    rpt_put_esc(f, y_label, 200);
    rpt_put(f, "</text>\n");
}

/* ---- latency CDFs ------------------------------------------------------------------------ */

/* Log x when the positive values spread over more than 100x. */
static void cdf_range(const rpt_vec *ms, frame *fr) {
    double hi = ms->v[ms->n - 1], lo_pos = 0;
    for (size_t i = 0; i < ms->n && !(lo_pos > 0); i++) lo_pos = ms->v[i];
    fr->x_log = lo_pos > 0 && hi / lo_pos > 100;
    if (fr->x_log) {
        fr->x_lo = pow(10, floor(log10(lo_pos)));
        fr->x_hi = pow(10, ceil(log10(hi)));
    } else {
        fr->x_lo = 0;
        fr->x_hi = nice_ceil(hi);
    }
    fr->y_lo = 0;
    fr->y_hi = 1;
}

/* Dashed lines at p50, p90 and p99, labelled at the left end: a CDF is
 * below its line left of the value, so the label never sits on the curve. */
static void cdf_marks(FILE *f, const frame *fr, const rpt_vec *ms) {
    static const double qs[] = {0.5, 0.9, 0.99};
    static const char *const names[] = {"p50", "p90", "p99"};
    for (int i = 0; i < 3; i++) {
        double y = fy(fr, qs[i]);
        size_t idx = (size_t)ceil(qs[i] * (double)ms->n) - 1;
        double v = ms->v[idx < ms->n ? idx : ms->n - 1];
        rpt_putf(f,
                 "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#bbbbbb\" "
                 "stroke-dasharray=\"3 3\"/>\n<text x=\"%.1f\" y=\"%.1f\" class=\"tick\">%s "
                 "%.*f ms</text>\n",
                 fr->left, y, fr->left + fr->w, y, fr->left + 4, y - 3, names[i],
                 fabs(v) >= 100      ? 0
                     : fabs(v) >= 10 ? 1
                                     : 2,
                 v);
    }
}

void rpt_svg_cdf(FILE *f, const char *id, const char *title, const char *what, const rpt_vec *ms) {
    frame fr = {.left = 56, .top = 30, .w = 330, .h = 210};
    char head[128], xl[96];
    snprintf(head, sizeof(head), "%s (n = %zu)", title, ms->n);
    svg_open(f, id, 400, 290, head);
    if (ms->n == 0) {
        no_data(f, &fr);
        rpt_put(f, "</svg>\n");
        return;
    }
    cdf_range(ms, &fr);
    snprintf(xl, sizeof(xl), "%s (ms%s)", what, fr.x_log ? ", log scale" : "");
    axes(f, &fr, xl, "fraction of values", true);
    cdf_marks(f, &fr, ms);
    /* At most RPT_CDF_POINTS points: the value at evenly spaced ranks. */
    size_t pts = ms->n < RPT_CDF_POINTS ? ms->n : RPT_CDF_POINTS;
    rpt_putf(f,
             "<polyline class=\"cdf\" fill=\"none\" stroke=\"" C_REQ "\" stroke-width=\"2\" "
             "points=\"%.1f,%.1f",
             fx(&fr, ms->v[0]), fy(&fr, 0));
    for (size_t k = 0; k < pts; k++) {
        size_t idx = pts == ms->n ? k : (size_t)llround((double)k * (ms->n - 1) / (pts - 1));
        rpt_putf(f, " %.1f,%.1f", fx(&fr, ms->v[idx]), fy(&fr, (double)(idx + 1) / ms->n));
    }
    rpt_put(f, "\"/>\n</svg>\n");
}

/* ---- the timeline ------------------------------------------------------------------------ */

static double series_max(const double *v, size_t n) {
    double mx = 0;
    for (size_t i = 0; i < n; i++)
        if (v[i] > mx) mx = v[i];
    return mx;
}

static void polyline(FILE *f, const frame *fr, const double *t, const double *v, size_t n,
                     const char *cls, const char *color) {
    rpt_putf(f,
             "<polyline class=\"%s\" fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" "
             "points=\"",
             cls, color);
    bool first = true;
    for (size_t i = 0; i < n; i++) {
        if (isnan(v[i])) continue;
        rpt_putf(f, "%s%.1f,%.1f", first ? "" : " ", fx(fr, t[i]), fy(fr, v[i]));
        first = false;
    }
    rpt_put(f, "\"/>\n");
}

/* The aborts of one kind as one path: short ticks at the panel's top
 * (requests above closes), or a dashed line through it (abort-all). */
static void abort_marks(FILE *f, const frame *fr, const rpt_model *m, int kind) {
    static const char *const cls[] = {"abort-request", "abort-close", "abort-all"};
    static const char *const color[] = {C_ABORT_REQ, C_ABORT_CLOSE, C_ABORT_ALL};
    if (!m->abort_count[kind]) return;
    double y0 = kind == RPT_ABORT_ALL ? fr->top : fr->top + (kind == RPT_ABORT_CLOSE ? 12 : 0);
    double len = kind == RPT_ABORT_ALL ? fr->h : 10;
    rpt_putf(f, "<path class=\"%s\" stroke=\"%s\" stroke-width=\"%s\"%s fill=\"none\" d=\"",
             cls[kind], color[kind], kind == RPT_ABORT_ALL ? "1.5" : "2",
             kind == RPT_ABORT_ALL ? " stroke-dasharray=\"4 3\"" : "");
    for (size_t i = 0; i < m->aborts_n; i++)
        if (m->abort_kind[i] == kind)
            rpt_putf(f, "M%.1f %.1fv%.0f", fx(fr, m->abort_t[i]), y0, len);
    rpt_put(f, "\"/>\n");
}

static void timeline_legend(FILE *f, const rpt_model *m) {
    static const char *const label[] = {"request aborted (/abort_request)", "connection closed",
                                        "abort-all burst"};
    static const char *const color[] = {C_ABORT_REQ, C_ABORT_CLOSE, C_ABORT_ALL};
    for (int k = 0; k < RPT_ABORT_KINDS; k++) {
        double x = 300 + k * 300;
        rpt_putf(f,
                 "<rect x=\"%.0f\" y=\"8\" width=\"12\" height=\"12\" fill=\"%s\"/>"
                 "<text x=\"%.0f\" y=\"18\" class=\"legend\">%s (%zu)</text>\n",
                 x, color[k], x + 16, label[k], m->abort_count[k]);
    }
}

static double timeline_end(const rpt_model *m) {
    double end = m->duration > 0 ? m->duration : 0;
    if (m->tl_n && m->tl_t[m->tl_n - 1] > end) end = m->tl_t[m->tl_n - 1];
    for (size_t i = 0; i < m->aborts_n; i++)
        if (m->abort_t[i] > end) end = m->abort_t[i];
    return end > 0 ? end : 1;
}

void rpt_svg_timeline(FILE *f, const rpt_model *m) {
    static const char *const names[] = {"requests completed per second", "output tokens per second",
                                        "requests in flight"};
    static const char *const cls[] = {"series-rps", "series-tps", "series-concurrency"};
    static const char *const color[] = {C_REQ, C_CACHE, "#76b7b2"};
    const double *series[] = {m->tl_rps, m->tl_tps, m->tl_conc};
    svg_open(f, "timeline", 1220, 600, "Over time");
    timeline_legend(f, m);
    for (int p = 0; p < 3; p++) {
        frame fr = {.left = 70, .top = 50 + p * 180, .w = 1120, .h = 140, .x_hi = timeline_end(m)};
        bool last = p == 2;
        rpt_putf(f, "<text x=\"%.0f\" y=\"%.0f\" class=\"panel\">%s</text>\n", fr.left, fr.top - 6,
                 names[p]);
        if (!m->tl_n) {
            no_data(f, &fr);
        } else {
            /* Headroom above the highest value for the abort ticks. */
            fr.y_hi = nice_ceil(1.15 * series_max(series[p], m->tl_n));
            axes(f, &fr, last ? "time since the start (s)" : NULL,
                 p == 0       ? "req/s"
                     : p == 1 ? "tok/s"
                              : "requests",
                 false);
            polyline(f, &fr, m->tl_t, series[p], m->tl_n, cls[p], color[p]);
        }
        for (int k = 0; k < RPT_ABORT_KINDS; k++) abort_marks(f, &fr, m, k);
    }
    rpt_put(f, "</svg>\n");
}

/* ---- a node's pool by ledger state ------------------------------------------------------ */

static double val0(const double *v, size_t i) { return isnan(v[i]) ? 0 : v[i]; }

/* The band between the stack's level `below` and `below + layer`, one path. */
static void band(FILE *f, const frame *fr, const rpt_node *n, const double *const layers[4],
                 int which, const char *cls, const char *color) {
    rpt_putf(f, "<path class=\"%s\" fill=\"%s\" stroke=\"none\" d=\"", cls, color);
    for (size_t i = 0; i < n->samples; i++) {
        double top = 0;
        for (int l = 0; l <= which; l++) top += val0(layers[l], i);
        rpt_putf(f, "%s%.1f %.1f", i ? "L" : "M", fx(fr, n->t_s[i]), fy(fr, top));
    }
    for (size_t i = n->samples; i-- > 0;) {
        double bottom = 0;
        for (int l = 0; l < which; l++) bottom += val0(layers[l], i);
        rpt_putf(f, "L%.1f %.1f", fx(fr, n->t_s[i]), fy(fr, bottom));
    }
    rpt_put(f, "Z\"/>\n");
}

static void pool_legend(FILE *f) {
    static const char *const label[] = {"held (req)", "cached", "quarantined", "free"};
    static const char *const color[] = {C_REQ, C_CACHE, C_QUAR, C_FREE};
    for (int k = 0; k < 4; k++) {
        double x = 50 + k * 88;
        rpt_putf(f,
                 "<rect x=\"%.0f\" y=\"254\" width=\"12\" height=\"12\" fill=\"%s\"/>"
                 "<text x=\"%.0f\" y=\"264\" class=\"legend\">%s</text>\n",
                 x, color[k], x + 16, label[k]);
    }
}

/* The idle check, at the last sample (the pools it reports are that
 * sample's): a line, its verdict, and what the pool still holds. */
static void idle_mark(FILE *f, const frame *fr, const rpt_node *n, const rpt_pool_series *p) {
    if (n->idle < 0 || !n->samples) return;
    size_t last = n->samples - 1;
    double x = fx(fr, n->t_s[last]), held = val0(p->req, last) + val0(p->quarantine, last);
    const char *color = n->idle ? "#2a7d2a" : C_ABORT_ALL;
    rpt_putf(f,
             "<line class=\"idle-check\" x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" "
             "stroke=\"%s\" stroke-width=\"2\" stroke-dasharray=\"5 3\"/>\n",
             x, fr->top - 4, x, fr->top + fr->h, color);
    rpt_putf(f,
             "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\" fill=\"%s\" "
             "font-weight=\"bold\" class=\"legend\">idle check %s",
             x - 4, fr->top + 10, color, n->idle ? "passed" : "FAILED");
    if (held > 0)
        rpt_putf(f, ": %.0f held (req %.0f, quarantine %.0f)", held, val0(p->req, last),
                 val0(p->quarantine, last));
    rpt_put(f, "</text>\n");
}

static void pool_id(char *buf, size_t cap, size_t node, const char *name) {
    int n = snprintf(buf, cap, "pools-%zu-", node);
    size_t at = n > 0 ? (size_t)n : 0;
    for (const char *s = name; *s && at + 1 < cap; s++) {
        char ch = *s;
        bool keep = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
            (ch >= '0' && ch <= '9') || ch == '-' || ch == '_';
        buf[at++] = keep ? ch : '_';
    }
    buf[at < cap ? at : cap - 1] = '\0';
}

void rpt_svg_pool(FILE *f, const rpt_node *n, size_t node_index, size_t pool_index) {
    const rpt_pool_series *p = &n->pool[pool_index];
    char id[96], title[200];
    pool_id(id, sizeof(id), node_index, p->name);
    double total = n->samples ? series_max(p->total, n->samples) : 0;
    snprintf(title, sizeof(title), "pool %.40s%s%.24s%s: %.0f units", p->name, p->kind ? " (" : "",
             p->kind ? p->kind : "", p->kind ? ")" : "", total);
    svg_open(f, id, 400, 272, title);
    frame fr = {.left = 56, .top = 34, .w = 330, .h = 180};
    if (!n->samples) {
        no_data(f, &fr);
        rpt_put(f, "</svg>\n");
        return;
    }
    fr.x_lo = n->t_s[0];
    fr.x_hi = n->t_s[n->samples - 1];
    if (!(fr.x_hi > fr.x_lo)) /* one time: a span wide enough to differ from it */
        fr.x_hi = fr.x_lo + fmax(1.0, fabs(fr.x_lo) * 1e-6);
    fr.y_hi = total > 0 ? total : 1; /* the stack fills the chart: free is on top */
    const double *const layers[4] = {p->req, p->cache, p->quarantine, p->free};
    static const char *const cls[] = {"band-req", "band-cache", "band-quarantine", "band-free"};
    static const char *const color[] = {C_REQ, C_CACHE, C_QUAR, C_FREE};
    for (int l = 0; l < 4; l++) band(f, &fr, n, layers, l, cls[l], color[l]);
    axes(f, &fr, "time since the start (s)", "units", false);
    idle_mark(f, &fr, n, p);
    pool_legend(f);
    rpt_put(f, "</svg>\n");
}
