/*
 * Progress lines: see include/pdserve/progress.h.
 *
 * The reporter is a few numbers and two fixed buffers. An update that is not
 * due costs one clock read; one that is due formats into p->line and writes
 * it with one fwrite. The TTY line is padded with spaces over what it
 * replaces, so a shorter line leaves no tail of the longer one (no terminal
 * escape sequences needed).
 */
#include "pdserve/progress.h"

#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pdserve/base.h"

#define PLAIN_INTERVAL_S_DEFAULT 10.0
#define TTY_INTERVAL_S_DEFAULT 0.1
#define RATE_WINDOW_S_DEFAULT 5.0

double pd_progress_monotonic_s(void *ctx) {
    (void)ctx;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static bool stream_is_tty(FILE *out) {
    int fd = fileno(out);
    return fd >= 0 && isatty(fd);
}

void pd_progress_init(pd_progress *p, const pd_progress_options *o) {
    PD_ASSERT(p && o && o->out);
    PD_ASSERT(o->plain_interval_s >= 0 && o->tty_interval_s >= 0 && o->rate_window_s >= 0);
    memset(p, 0, sizeof(*p));
    p->out = o->out;
    p->label = o->label;
    p->unit = o->unit ? o->unit : "items";
    p->total = o->total;
    p->tty = o->style == PD_PROGRESS_TTY || (o->style == PD_PROGRESS_AUTO && stream_is_tty(o->out));
    double plain = o->plain_interval_s > 0 ? o->plain_interval_s : PLAIN_INTERVAL_S_DEFAULT;
    double tty = o->tty_interval_s > 0 ? o->tty_interval_s : TTY_INTERVAL_S_DEFAULT;
    p->interval_s = p->tty ? tty : plain;
    p->columns = o->tty_columns;
    p->rate_window_s = o->rate_window_s > 0 ? o->rate_window_s : RATE_WINDOW_S_DEFAULT;
    p->clock = o->clock ? o->clock : pd_progress_monotonic_s;
    p->clock_ctx = o->clock_ctx;
    p->start_s = p->clock(p->clock_ctx);
    p->last_print_s = p->start_s;
    p->rate_at_s = p->start_s;
    p->rate = -1.0;
}

static bool due_at(const pd_progress *p, double now_s) {
    return !p->finished && now_s - p->last_print_s >= p->interval_s;
}

bool pd_progress_due(const pd_progress *p) { return due_at(p, p->clock(p->clock_ctx)); }

static void set_extra(pd_progress *p, const char *extra) {
    if (!extra) return;
    size_t n = strnlen(extra, sizeof(p->extra) - 1);
    memcpy(p->extra, extra, n);
    p->extra[n] = '\0';
}

/* "m:ss" under an hour, "h:mm:ss" above; negative or absurd values clamp. */
static void format_duration(pd_strbuf *sb, double s) {
    if (!(s >= 0)) s = 0;
    if (s > 359999.0) s = 359999.0; /* 99:59:59 */
    unsigned long t = (unsigned long)(s + 0.5);
    if (t >= 3600) pd_strbuf_printf(sb, "%lu:%02lu:%02lu", t / 3600, t / 60 % 60, t % 60);
    else pd_strbuf_printf(sb, "%lu:%02lu", t / 60, t % 60);
}

/* The smoothed rate: an exponential average whose weight follows the time
 * since the last sample, so it means the same at 10 Hz and every 10 s. The
 * window is no longer than the run so far: early on the rate is the average
 * since the start, not the first sample's slowly forgotten. */
static void update_rate(pd_progress *p, double now_s) {
    double dt = now_s - p->rate_at_s;
    if (dt <= 0) return;
    double inst = (double)(p->done - p->rate_done) / dt;
    double window = PD_MIN(p->rate_window_s, p->rate_at_s - p->start_s);
    if (p->rate < 0) p->rate = inst;
    else p->rate += dt / (dt + window) * (inst - p->rate);
    p->rate_at_s = now_s;
    p->rate_done = p->done;
}

static void append_count(pd_progress *p, pd_strbuf *sb) {
    if (p->label) pd_strbuf_printf(sb, "%s: ", p->label);
    pd_strbuf_printf(sb, "%llu", (unsigned long long)p->done);
    if (p->total) {
        double pct = 100.0 * (double)p->done / (double)p->total;
        pd_strbuf_printf(sb, "/%llu %s (%.1f%%)", (unsigned long long)p->total, p->unit, pct);
    } else {
        pd_strbuf_printf(sb, " %s", p->unit);
    }
}

static void format_running(pd_progress *p, pd_strbuf *sb, double now_s) {
    double elapsed = now_s - p->start_s;
    append_count(p, sb);
    pd_strbuf_printf(sb, ", %.1f/s, elapsed ", p->rate > 0 ? p->rate : 0.0);
    format_duration(sb, elapsed);
    if (p->total && p->done > 0 && p->done < p->total && elapsed > 0) {
        double avg = (double)p->done / elapsed;
        pd_strbuf_append(sb, ", ETA ");
        format_duration(sb, (double)(p->total - p->done) / avg);
    }
    if (p->extra[0]) pd_strbuf_printf(sb, ", %s", p->extra);
}

static void format_final(pd_progress *p, pd_strbuf *sb, double now_s) {
    double elapsed = now_s - p->start_s;
    append_count(p, sb);
    pd_strbuf_append(sb, " done in ");
    format_duration(sb, elapsed);
    double avg = elapsed > 0 ? (double)p->done / elapsed : 0.0;
    pd_strbuf_printf(sb, ", %.1f %s/s", avg, p->unit);
    if (p->extra[0]) pd_strbuf_printf(sb, ", %s", p->extra);
}

/* Writes p->line: on a TTY over the previous line, else as a line of its own.
 * A TTY line wider than the terminal would wrap, and '\r' would then rewrite
 * only its last row: it is cut to the width (on a UTF-8 character boundary). */
static void emit(pd_progress *p, size_t len, bool last) {
    if (p->tty && p->columns > 1 && len > p->columns - 1) {
        len = p->columns - 1;
        while (len > 0 && ((unsigned char)p->line[len] & 0xC0) == 0x80) len--;
    }
    if (p->tty) {
        fputc('\r', p->out);
        fwrite(p->line, 1, len, p->out);
        for (size_t i = len; i < p->shown_len; i++) fputc(' ', p->out);
        p->shown_len = len;
        if (last) fputc('\n', p->out);
    } else {
        fwrite(p->line, 1, len, p->out);
        fputc('\n', p->out);
    }
    fflush(p->out);
    p->lines++;
}

bool pd_progress_update(pd_progress *p, uint64_t done, const char *extra) {
    PD_ASSERT(p->out);
    if (p->finished) return false;
    PD_ASSERTF(done >= p->done, "progress went back from %llu to %llu", (unsigned long long)p->done,
               (unsigned long long)done);
    p->done = done;
    set_extra(p, extra);
    double now_s = p->clock(p->clock_ctx);
    if (!due_at(p, now_s)) return false;
    update_rate(p, now_s);
    pd_strbuf sb;
    pd_strbuf_init(&sb, p->line, sizeof(p->line));
    format_running(p, &sb, now_s);
    emit(p, sb.len, false);
    p->last_print_s = now_s;
    return true;
}

void pd_progress_finish(pd_progress *p, uint64_t done, const char *extra) {
    PD_ASSERT(p->out);
    if (p->finished) return;
    PD_ASSERT(done >= p->done);
    p->done = done;
    set_extra(p, extra);
    double now_s = p->clock(p->clock_ctx);
    pd_strbuf sb;
    pd_strbuf_init(&sb, p->line, sizeof(p->line));
    format_final(p, &sb, now_s);
    emit(p, sb.len, true);
    p->finished = true;
    p->last_print_s = now_s;
}
