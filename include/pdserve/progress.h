/*
 * Progress lines for long runs (pdserve sim --seeds, pdserve bench).
 *
 * One reporter per run. On a terminal it keeps one line rewritten in place
 * ('\r', padded over the previous text) at most every tty_interval_s; on
 * anything else (a pipe, a log file, ctest) it writes a plain line every
 * plain_interval_s, so a log stays readable. finish() writes the final line
 * whatever the interval, and ends it with '\n'.
 *
 *   sim: 1234/20000 seeds (6.2%), 45.1/s, elapsed 0:27, ETA 6:56, failed seeds 0
 *
 * The rate is the recent one (smoothed over about rate_window_s); the ETA
 * divides what is left by the average rate since the start, which moves less.
 *
 * Time comes from a clock the caller may replace (a test drives it by hand);
 * by default CLOCK_MONOTONIC. An update allocates nothing: the line is built
 * in the reporter's own buffer. Not thread-safe: one thread updates it.
 *
 * The reporter writes to the stream it is given and nowhere else; the
 * command line passes stderr, so that stdout keeps only results.
 */
#ifndef PDSERVE_PROGRESS_H
#define PDSERVE_PROGRESS_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

#define PD_PROGRESS_LINE_MAX 256
#define PD_PROGRESS_EXTRA_MAX 128

/* Seconds on some monotonic clock. */
typedef double (*pd_progress_clock)(void *ctx);

typedef enum pd_progress_style {
    PD_PROGRESS_AUTO = 0, /* isatty(fileno(out)) picks one of the two below */
    PD_PROGRESS_TTY,      /* one line rewritten in place */
    PD_PROGRESS_PLAIN,    /* a line every plain_interval_s */
} pd_progress_style;

typedef struct pd_progress_options {
    FILE *out;               /* required: where the lines go (the CLI: stderr) */
    const char *label;       /* "sim", "bench"; NULL: none */
    const char *unit;        /* "seeds", "requests"; NULL: "items" */
    uint64_t total;          /* 0: unknown (no percentage, no ETA) */
    pd_progress_style style; /* 0: AUTO */
    double plain_interval_s; /* 0: 10 s */
    double tty_interval_s;   /* 0: 0.1 s */
    double rate_window_s;    /* 0: 5 s */
    size_t tty_columns;      /* TTY: the terminal's width, lines cut to it; 0: not cut */
    pd_progress_clock clock; /* NULL: CLOCK_MONOTONIC */
    void *clock_ctx;
} pd_progress_options;

typedef struct pd_progress {
    FILE *out;
    const char *label, *unit;
    uint64_t total, done;
    bool tty, finished;
    double interval_s, rate_window_s;
    pd_progress_clock clock;
    void *clock_ctx;
    double start_s, last_print_s; /* last_print_s < start_s: nothing printed yet */
    double rate_at_s;             /* when `rate` was last updated */
    uint64_t rate_done;           /* `done` then */
    double rate;                  /* units/s, smoothed; < 0 until measured */
    uint32_t lines;               /* lines written (TTY: rewrites) */
    size_t columns;               /* TTY lines are cut to columns - 1; 0: not cut */
    size_t shown_len;             /* TTY: length of the line on screen */
    char extra[PD_PROGRESS_EXTRA_MAX];
    char line[PD_PROGRESS_LINE_MAX];
} pd_progress;

/* Starts the clock. Writes nothing. */
void pd_progress_init(pd_progress *p, const pd_progress_options *o);

/* True when an update now would write (lets a caller skip formatting its
 * extra text, e.g. a percentile, when nothing would be shown). */
bool pd_progress_due(const pd_progress *p);

/* Records `done` (absolute, never decreasing) and, when extra is not NULL,
 * the caller's text for the end of the line ("p50 TTFT 12.3 ms, errors 2";
 * cut to PD_PROGRESS_EXTRA_MAX - 1 bytes). Writes a line when one is due.
 * Returns true when it wrote. */
bool pd_progress_update(pd_progress *p, uint64_t done, const char *extra);

/* The final line, always written, ending with '\n'. Updates after it are
 * ignored; a second finish writes nothing. */
void pd_progress_finish(pd_progress *p, uint64_t done, const char *extra);

/* The clock pd_progress uses by default: CLOCK_MONOTONIC, in seconds. */
double pd_progress_monotonic_s(void *ctx);

#ifdef __cplusplus
}
#endif

#endif
