/*
 * pdserve sim — the deterministic simulator's command line.
 *
 * A crash is a report. Random runs (--seed, --seeds) run in a child process
 * that writes, on a page shared with its parent, the seed it is running and
 * the totals of the seeds it has finished. If the child dies — a failed
 * PD_ASSERT (abort), a signal, a sanitizer report (exit status 1 by default)
 * — while a seed is marked running, the parent names that seed, its
 * configuration (pd_sim_seed_config, which runs nothing) and the line that
 * reproduces it, then prints the usual summary and exits 1: a crash stops the
 * run exactly as a violation does. Without a crash, the output is the one an
 * in-process run would print, byte for byte: the child prints what it always
 * printed, flushes, and the parent prints the summary after it has exited.
 *
 * Each option applies to some modes only (sim_opts below); one given to a
 * mode that would ignore it is refused with exit 2, so a run is never silently
 * something else than what its command line says.
 */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/prctl.h>
#endif

#include "args.h"
#include "commands.h"
#include "pdserve/progress.h"
#include "pdserve/sim.h"

#define REPORT_BYTES_MAX (1u << 20)
#define REQUESTS_MAX 100000u

static void usage(FILE *to) {
    fprintf(to,
            "usage: pdserve sim MODE [options]\n"
            "\n"
            "modes (one of):\n"
            "  --seed S            one random run; JSON summary on stdout\n"
            "  --seeds A..B        swarm: seeds A to B, each with its own configuration\n"
            "  --scenario FILE...  replay scenario files; exit 0 only if every expect holds\n"
            "  --explore           every schedule of a small configuration (two requests of\n"
            "                      three chunks, overlap on, one abort, one bootstrap failure,\n"
            "                      one transfer failure, one decode abort after commit), plain,\n"
            "                      optimistic and with failing transport aborts, on the\n"
            "                      synthetic model\n"
            "\n"
            "options, and the modes they apply to (elsewhere they are refused):\n"
            "  --requests N        --seed, --seeds: requests per random run (default 50)\n"
            "  --faults LIST       --seed, --seeds: all | none | comma list of abort,\n"
            "                      bootstrap, hold, xfer, abort-error, kill, dup, oversize,\n"
            "                      reuse (default all)\n"
            "  --config \"...\"      --seed, --seeds, --scenario: a scenario config line\n"
            "                      overriding the defaults, e.g.\n"
            "                      \"config page_size=1 chunk=3 mamba=off\"\n"
            "  --model synth|tiny  --seed, --seeds, --scenario: the executor, the synthetic\n"
            "                      model (default, fast) or the tiny hybrid model's real\n"
            "                      forward pass\n"
            "  --trace FILE        --seed, --seeds, --scenario: write every executed line\n"
            "                      (a replayable scenario)\n"
            "  --quiet             --seed, --seeds: print only the final summary\n"
            "  --progress MODE     --seeds: auto (default: one line rewritten in place on a\n"
            "                      terminal, a plain line every 10 s elsewhere), tty, plain\n"
            "                      or off; on stderr: seeds done, seeds/s, ETA, failures\n"
            "  --limit N           --explore: stop after N schedules\n"
            "\n"
            "On a violation the run stops, prints the seed, the configuration and its last\n"
            "lines as a scenario, and exits 1. A crash of a random run (assertion, signal,\n"
            "sanitizer report) stops it the same way: the seed, its configuration and the\n"
            "line that reproduces it, exit 1. Exit 2 means bad usage.\n");
}

/* ---- options ----------------------------------------------------------------------------- */

enum sim_mode { MODE_NONE, MODE_SEED, MODE_SEEDS, MODE_SCENARIO, MODE_EXPLORE };

#define IN(m) (1u << (m))
#define RANDOM_MODES (IN(MODE_SEED) | IN(MODE_SEEDS))

/* What each mode does, for the message that refuses an option it ignores. */
static const char *const mode_what[] = {
    [MODE_SEED] = "--seed runs one random run",
    [MODE_SEEDS] = "--seeds runs a swarm of random runs",
    [MODE_SCENARIO] = "--scenario replays files that make their own requests and faults",
    [MODE_EXPLORE] = "--explore runs its own fixed configuration on the synthetic model, "
                     "without a trace",
};

/* Options that apply to some modes only; `modes` is a set of IN(MODE_*). */
static const struct sim_opt {
    const char *name;
    uint32_t modes;
    const char *applies;
} sim_opts[] = {
    {"--requests", RANDOM_MODES, "--seed and --seeds"},
    {"--faults", RANDOM_MODES, "--seed and --seeds"},
    {"--config", RANDOM_MODES | IN(MODE_SCENARIO), "--seed, --seeds and --scenario"},
    {"--model", RANDOM_MODES | IN(MODE_SCENARIO), "--seed, --seeds and --scenario"},
    {"--trace", RANDOM_MODES | IN(MODE_SCENARIO), "--seed, --seeds and --scenario"},
    {"--quiet", RANDOM_MODES, "--seed and --seeds"},
    {"--progress", IN(MODE_SEEDS), "--seeds"},
    {"--limit", IN(MODE_EXPLORE), "--explore"},
};
#define SIM_OPTS_COUNT (sizeof(sim_opts) / sizeof(sim_opts[0]))

typedef struct sim_args {
    enum sim_mode mode;
    uint64_t seed_first, seed_last; /* --seed S: both S */
    uint64_t requests, limit;
    const char *faults, *trace_path, *config, *model;
    int progress;   /* a pd_progress_style, or -1: off */
    uint32_t given; /* bit i: sim_opts[i] is on the command line */
    bool quiet, help;
    int first_file, files;
    uint32_t fault_bits;
    char config_buf[1024]; /* --config with --model merged in */
} sim_args;

static int usage_error(const char *msg) {
    fprintf(stderr, "pdserve sim: %s\n", msg);
    return 2;
}

static void note_given(sim_args *a, const char *name) {
    for (uint32_t i = 0; i < SIM_OPTS_COUNT; i++)
        if (!strcmp(sim_opts[i].name, name)) a->given |= 1u << i;
}

static int set_mode(sim_args *a, enum sim_mode m) {
    if (a->mode != MODE_NONE && a->mode != m)
        return usage_error("choose one mode: --seed, --seeds, --scenario or --explore");
    a->mode = m;
    return 0;
}

/* "A..B" with A <= B. */
static bool parse_seed_range(const char *v, uint64_t *first, uint64_t *last) {
    const char *dots = v ? strstr(v, "..") : NULL;
    char left[32];
    size_t n = dots ? (size_t)(dots - v) : 0;
    if (n == 0 || n >= sizeof(left)) return false;
    memcpy(left, v, n);
    left[n] = '\0';
    return cli_u64(left, 0, UINT64_MAX, first) && cli_u64(dots + 2, 0, UINT64_MAX, last) &&
           *first <= *last;
}

static bool parse_progress(const char *v, int *style) {
    static const char *const names[] = {"auto", "tty", "plain"};
    for (int i = 0; v && i < 3; i++) {
        if (strcmp(v, names[i])) continue;
        *style = i == 0 ? PD_PROGRESS_AUTO : i == 1 ? PD_PROGRESS_TTY : PD_PROGRESS_PLAIN;
        return true;
    }
    *style = -1;
    return v && !strcmp(v, "off");
}

/* An option that takes a value; false: not a value it takes. */
static bool parse_value(sim_args *a, const char *name, const char *v) {
    if (!strcmp(name, "--seed")) {
        bool ok = cli_u64(v, 0, UINT64_MAX, &a->seed_first);
        a->seed_last = a->seed_first;
        return ok;
    }
    if (!strcmp(name, "--seeds")) return parse_seed_range(v, &a->seed_first, &a->seed_last);
    if (!strcmp(name, "--requests")) return cli_u64(v, 1, REQUESTS_MAX, &a->requests);
    if (!strcmp(name, "--limit")) return cli_u64(v, 0, UINT64_MAX, &a->limit);
    if (!strcmp(name, "--model") && v && strcmp(v, "tiny") && strcmp(v, "synth")) return false;
    if (!strcmp(name, "--progress")) return parse_progress(v, &a->progress);
    const char **slot = !strcmp(name, "--faults")   ? &a->faults
                        : !strcmp(name, "--trace")  ? &a->trace_path
                        : !strcmp(name, "--config") ? &a->config
                                                    : &a->model;
    *slot = v;
    return v != NULL;
}

static bool is_valued(const char *name) {
    static const char *const valued[] = {"--seed",   "--seeds",  "--requests",
                                         "--limit",  "--faults", "--trace",
                                         "--config", "--model",  "--progress"};
    for (size_t i = 0; i < sizeof(valued) / sizeof(valued[0]); i++)
        if (!strcmp(valued[i], name)) return true;
    return false;
}

/* argv[*i], an option taking a value ("--opt VALUE" or "--opt=VALUE"). */
static int parse_valued(sim_args *a, int argc, char **argv, int *i) {
    char name[64];
    const char *v = cli_option(argc, argv, i, name, sizeof(name));
    if (!is_valued(name)) return cli_unknown_option_usage("sim", name, usage, NULL);
    if (!strcmp(name, "--seed") && set_mode(a, MODE_SEED)) return 2;
    if (!strcmp(name, "--seeds") && set_mode(a, MODE_SEEDS)) return 2;
    note_given(a, name);
    if (parse_value(a, name, v)) return 0;
    fprintf(stderr, "pdserve sim: option %s needs a valid value%s%s\n", name, v ? ", got " : "",
            v ? v : "");
    return 2;
}

/* --scenario FILE...: the files are the arguments up to the next option. */
static int parse_scenario(sim_args *a, int argc, char **argv, int *i) {
    if (set_mode(a, MODE_SCENARIO)) return 2;
    a->first_file = *i + 1;
    a->files = 0;
    while (*i + 1 < argc && strncmp(argv[*i + 1], "--", 2)) {
        ++*i;
        a->files++;
    }
    return a->files ? 0 : usage_error("option --scenario needs at least one file");
}

/* 0: parsed (a->help set for --help); otherwise the exit code. */
static int parse_line(sim_args *a, int argc, char **argv) {
    int rc = 0;
    for (int i = 1; i < argc && !rc && !a->help; i++) {
        const char *arg = argv[i];
        if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
            a->help = true;
        } else if (!strcmp(arg, "--scenario")) {
            rc = parse_scenario(a, argc, argv, &i);
        } else if (!strcmp(arg, "--explore")) {
            rc = set_mode(a, MODE_EXPLORE);
        } else if (!strcmp(arg, "--quiet")) {
            note_given(a, arg);
            a->quiet = true;
        } else {
            rc = parse_valued(a, argc, argv, &i);
        }
    }
    return rc;
}

/* Refuses an option the mode would ignore, then checks the values that need
 * more than a look: the fault list and the config line. */
static int check_args(sim_args *a) {
    for (uint32_t i = 0; i < SIM_OPTS_COUNT; i++) {
        if (!(a->given & (1u << i)) || (sim_opts[i].modes & IN(a->mode))) continue;
        fprintf(stderr, "pdserve sim: %s; %s is not supported with it (it applies to %s)\n",
                mode_what[a->mode], sim_opts[i].name, sim_opts[i].applies);
        return 2;
    }
    char msg[256];
    if (pd_sim_parse_faults(a->faults, &a->fault_bits, msg, sizeof(msg)) != PD_OK)
        return usage_error(msg);
    if (a->model) {
        snprintf(a->config_buf, sizeof(a->config_buf), "%s model=%s",
                 a->config ? a->config : "config", a->model);
        a->config = a->config_buf;
    }
    if (a->config && strncmp(a->config, "config", 6) != 0)
        return usage_error("--config takes a scenario config line: \"config key=value ...\"");
    return 0;
}

/* 0: parsed and valid (a->help set for --help); otherwise the exit code. */
static int parse_args(int argc, char **argv, sim_args *a) {
    *a = (sim_args){.requests = 50, .faults = "all"};
    int rc = parse_line(a, argc, argv);
    if (rc || a->help) return rc;
    if (a->mode == MODE_NONE) {
        usage(stderr);
        return 2;
    }
    return check_args(a);
}

/* ---- random runs: --seed and --seeds ----------------------------------------------------- */

static void print_result(const pd_sim_result *r) {
    printf("{\"seed\":%llu,\"requests\":%u,\"finished\":%u,\"aborted\":%u,\"failed\":%u,"
           "\"rejected\":%u,\"violations\":%u,\"steps\":%llu,\"events\":%llu}\n",
           (unsigned long long)r->seed, r->requests, r->finished, r->aborted, r->failed,
           r->rejected, r->violations, (unsigned long long)r->steps,
           (unsigned long long)r->events);
}

static void print_summary(const sim_args *a, const pd_sim_result *t, uint64_t failed_seeds) {
    printf("{\"seeds\":%llu,\"failed_seeds\":%llu,\"requests\":%u,\"finished\":%u,"
           "\"aborted\":%u,\"failed\":%u,\"rejected\":%u,\"violations\":%llu,\"steps\":%llu}\n",
           (unsigned long long)(a->seed_last - a->seed_first + 1),
           (unsigned long long)failed_seeds, t->requests, t->finished, t->aborted, t->failed,
           t->rejected, (unsigned long long)failed_seeds, (unsigned long long)t->steps);
}

/* The configuration goes on the line whenever it is not --seed's default:
 * the swarm derives one per seed, and --config / --model change it. */
static void print_reproduce(const sim_args *a, uint64_t seed, const char *config) {
    bool with_config = a->mode == MODE_SEEDS || a->config;
    fprintf(stderr, "# reproduce: pdserve sim --seed %llu --requests %llu --faults %s%s%s%s\n",
            (unsigned long long)seed, (unsigned long long)a->requests, a->faults,
            with_config ? " --config \"" : "", with_config ? config : "",
            with_config ? "\"" : "");
}

static void add_result(pd_sim_result *t, const pd_sim_result *r) {
    t->requests += r->requests;
    t->finished += r->finished;
    t->aborted += r->aborted;
    t->failed += r->failed;
    t->rejected += r->rejected;
    t->steps += r->steps;
    t->events += r->events;
}

/* What the child running the seeds tells its parent; only the child writes
 * it. `in_seed` is 1 from the start of seed `running` to its end, so a child
 * that dies with it set died in that seed. The parent reads the page after
 * waitpid; volatile keeps every store in the child's program order. */
typedef struct seed_page {
    uint64_t running;
    uint32_t in_seed;
    uint32_t done;  /* 1: the child ran to its end and exits with `rc` */
    int rc;
    uint64_t seeds_done, failed_seeds;
    pd_sim_result total; /* of the seeds that passed */
    char first_violation[512]; /* of seed `running`: what a crash may have followed */
} seed_page;

/* Keeps the running seed's first violation on the page: an assertion that
 * a violation leads to kills the child before its report is printed. */
static void keep_violation(void *ctx, const char *msg) {
    volatile seed_page *pg = ctx;
    if (pg->first_violation[0]) return;
    size_t n = strnlen(msg, sizeof(pg->first_violation) - 1);
    for (size_t i = 0; i < n; i++) pg->first_violation[i] = msg[i] == '\n' ? ' ' : msg[i];
    pg->first_violation[n] = 0;
}

/* Runs the seeds and prints what an in-process run prints, but the summary. */
static int run_seeds(const sim_args *a, FILE *trace, volatile seed_page *pg, pd_strbuf *report) {
    pd_sim_options o = {.requests = (uint32_t)a->requests, .faults = a->fault_bits,
                        .trace = trace, .vary = a->mode == MODE_SEEDS, .config = a->config,
                        .on_violation = keep_violation, .violation_ctx = (void *)pg};
    pd_sim_result total = {0};
    for (uint64_t s = a->seed_first;; s++) {
        o.seed = s;
        pd_sim_result r;
        pd_strbuf_reset(report);
        pg->running = s;
        pg->first_violation[0] = 0;
        pg->in_seed = 1;
        pd_err err = pd_sim_random(&o, &r, report);
        pg->in_seed = 0;
        if (a->mode == MODE_SEED || (!a->quiet && err)) print_result(&r);
        if (err) {
            fprintf(stderr, "%s", report->data);
            print_reproduce(a, s, r.config);
            pg->failed_seeds = 1;
            return 1;
        }
        add_result(&total, &r);
        pg->total = total;
        pg->seeds_done++;
        if (s == a->seed_last) break;
    }
    return 0;
}

static const char *signal_name(int sig) {
    switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGFPE: return "SIGFPE";
    case SIGILL: return "SIGILL";
    case SIGABRT: return "SIGABRT";
    case SIGKILL: return "SIGKILL";
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGPIPE: return "SIGPIPE";
    case SIGTRAP: return "SIGTRAP";
    default: return strsignal(sig);
    }
}

/* The child died before it reached its end: name the seed it was in. */
static void report_crash(const sim_args *a, const seed_page *pg, int status) {
    char how[64];
    int sig = WIFSIGNALED(status) ? WTERMSIG(status) : 0;
    if (sig)
        snprintf(how, sizeof(how), "signal %d: %s", sig, signal_name(sig));
    else
        snprintf(how, sizeof(how), "exit status %d", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    if (!pg->in_seed) {
        fprintf(stderr, "pdserve sim: the run died outside any seed (%s), after %llu seed(s)\n",
                how, (unsigned long long)pg->seeds_done);
        return;
    }
    pd_sim_options o = {.seed = pg->running, .requests = (uint32_t)a->requests,
                        .faults = a->fault_bits, .vary = a->mode == MODE_SEEDS,
                        .config = a->config};
    char config[480];
    bool named = pd_sim_seed_config(&o, config, sizeof(config)) == PD_OK;
    fprintf(stderr, "seed %llu crashed (%s)\n", (unsigned long long)pg->running, how);
    if (pg->first_violation[0])
        fprintf(stderr, "# its first violation, before the crash: %s\n", pg->first_violation);
    fprintf(stderr, "%s%s\n", named ? "" : "# the configuration cannot be named: ", config);
    if (a->trace_path) fprintf(stderr, "# its last lines: %s\n", a->trace_path);
    print_reproduce(a, pg->running, config);
}

/* The child: never returns. Leaves through exit(), not _exit(), so that a
 * sanitizer build still checks the seeds for leaks at the end; the parent
 * flushed its stdio before the fork and registers no atexit handler, so
 * nothing of the parent's runs twice. */
static void seeds_child(const sim_args *a, FILE *trace, volatile seed_page *pg,
                        pd_strbuf *report, pid_t parent) {
#ifdef __linux__
    /* Dies with its parent: a killed run leaves no orphan running seeds. */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
#endif
    (void)parent;
    int rc = run_seeds(a, trace, pg, report);
    fflush(NULL);
    pg->rc = rc;
    pg->done = 1;
    exit(rc);
}

static int wait_child(pid_t pid, int *status) {
    for (;;) {
        if (waitpid(pid, status, 0) == pid) return 0;
        if (errno != EINTR) return -1;
    }
}

/* The progress line's tail: failures so far (the run stops at the first);
 * at the end, with the requests of the seeds that passed. `crashed`: the
 * child died in a seed, which the page cannot say. */
static void progress_extra(char *buf, size_t cap, const volatile seed_page *pg, bool end,
                           bool crashed) {
    unsigned long long failed = pg->failed_seeds + crashed;
    if (!end) {
        snprintf(buf, cap, "failed seeds %llu", failed);
        return;
    }
    const char *why = crashed ? " (crashed)" : failed ? " (stopped)" : "";
    snprintf(buf, cap, "failed seeds %llu%s, requests %u (aborted %u, failed %u, rejected %u)",
             failed, why, pg->total.requests, pg->total.aborted, pg->total.failed,
             pg->total.rejected);
}

/* Waits for the child as wait_child does, showing on stderr how far it is
 * (seeds done, from the page it writes) while it runs, and a final line
 * once it has ended. The page is read while the child writes it: a count a
 * step behind is harmless in a progress line. */
static int wait_child_progress(const sim_args *a, pid_t pid, volatile seed_page *pg, int *status) {
    pd_progress p;
    uint64_t total = a->seed_last - a->seed_first + 1; /* 0 (wrapped): unknown */
    struct winsize ws = {0};
    size_t columns = ioctl(STDERR_FILENO, TIOCGWINSZ, &ws) == 0 ? ws.ws_col : 0;
    pd_progress_init(&p,
                     &(pd_progress_options){.out = stderr,
                                            .label = "sim",
                                            .unit = "seeds",
                                            .total = total,
                                            .style = a->progress,
                                            .tty_columns = columns});
    char extra[PD_PROGRESS_EXTRA_MAX];
    for (;;) {
        pid_t got = waitpid(pid, status, WNOHANG);
        if (got == pid) break;
        if (got < 0 && errno != EINTR) return -1;
        if (pd_progress_due(&p)) {
            progress_extra(extra, sizeof(extra), pg, false, false);
            pd_progress_update(&p, pg->seeds_done, extra);
        }
        nanosleep(&(struct timespec){.tv_nsec = 20 * 1000 * 1000}, NULL);
    }
    progress_extra(extra, sizeof(extra), pg, true, !(WIFEXITED(*status) && pg->done));
    pd_progress_finish(&p, pg->seeds_done, extra);
    return 0;
}

static int wait_seeds(const sim_args *a, pid_t pid, volatile seed_page *pg, int *status) {
    if (a->mode != MODE_SEEDS || a->progress < 0) return wait_child(pid, status);
    return wait_child_progress(a, pid, pg, status);
}

/* Forks the child that runs the seeds, waits for it, and reports either what
 * it ran or how it crashed. Returns the exit code. */
static int run_random(const sim_args *a, FILE *trace, pd_strbuf *report) {
    volatile seed_page *pg =
        mmap(NULL, sizeof(seed_page), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (pg == MAP_FAILED) {
        fprintf(stderr, "pdserve sim: cannot map a page to share with the run: %s\n",
                strerror(errno));
        return 1;
    }
    fflush(NULL);
    pid_t parent = getpid();
    pid_t pid = fork();
    if (pid == 0) seeds_child(a, trace, pg, report, parent);
    int status = 0, rc = 1;
    if (pid < 0 || wait_seeds(a, pid, pg, &status)) {
        fprintf(stderr, "pdserve sim: cannot run the seeds: %s\n", strerror(errno));
        munmap((void *)pg, sizeof(seed_page));
        return 1;
    }
    seed_page seen = *pg;
    munmap((void *)pg, sizeof(seed_page));
    PD_ASSERT(seen.seeds_done == 0 || seen.seeds_done - 1 <= a->seed_last - a->seed_first);
    if (WIFEXITED(status) && seen.done && WEXITSTATUS(status) == seen.rc) {
        rc = seen.rc;
    } else {
        report_crash(a, &seen, status);
        seen.failed_seeds = 1;
    }
    PD_ASSERT(rc == 0 || seen.failed_seeds == 1);
    if (a->mode == MODE_SEEDS) print_summary(a, &seen.total, seen.failed_seeds);
    return rc;
}

/* ---- scenarios and exploration ----------------------------------------------------------- */

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + len, 1, cap - len - 1, f)) > 0) {
        len += got;
        if (len + 1 == cap) {
            char *nb = realloc(buf, cap *= 2);
            if (!nb) free(buf);
            buf = nb;
        }
    }
    fclose(f);
    if (buf) buf[len] = 0;
    return buf;
}

static int run_scenarios(const sim_args *a, char **argv, FILE *trace, pd_strbuf *report) {
    int failed = 0;
    for (int f = 0; f < a->files; f++) {
        const char *path = argv[a->first_file + f];
        char *text = read_file(path);
        if (!text) {
            fprintf(stderr, "FAIL %s: cannot read the file\n", path);
            failed++;
            continue;
        }
        pd_sim_result r;
        pd_strbuf_reset(report);
        pd_err err = pd_sim_scenario(text, path, a->config, trace, &r, report);
        free(text);
        if (err) {
            printf("FAIL %s\n", path);
            fprintf(stderr, "%s", report->data);
            failed++;
        } else {
            printf("PASS %s (%llu steps, %u requests: %u finished, %u aborted, %u failed, "
                   "%u rejected)\n",
                   path, (unsigned long long)r.steps, r.requests, r.finished, r.aborted,
                   r.failed, r.rejected);
        }
    }
    printf("%d passed, %d failed\n", a->files - failed, failed);
    return failed ? 1 : 0;
}

static int run_explore(const sim_args *a, pd_strbuf *report) {
    pd_sim_explore_result r;
    pd_err err = pd_sim_explore(a->limit, &r, report);
    printf("{\"schedules\":%llu,\"violations\":%llu,\"max_choices\":%u%s}\n",
           (unsigned long long)r.schedules, (unsigned long long)r.violations, r.max_choices,
           a->limit && r.schedules >= a->limit ? ",\"limited\":true" : "");
    if (err) fprintf(stderr, "%s", report->data);
    return err ? 1 : 0;
}

int cli_cmd_sim(int argc, char **argv) {
    sim_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc || a.help) {
        if (a.help) usage(stdout);
        return rc;
    }
    FILE *trace = NULL;
    if (a.trace_path && !(trace = fopen(a.trace_path, "w"))) {
        fprintf(stderr, "pdserve sim: cannot write %s\n", a.trace_path);
        return 2;
    }
    /* Line by line, so that a crash loses no line of the trace before it. */
    if (trace) setvbuf(trace, NULL, _IOLBF, 0);
    char *report_buf = malloc(REPORT_BYTES_MAX);
    if (!report_buf) {
        fprintf(stderr, "pdserve sim: out of memory\n");
        if (trace) fclose(trace);
        return 1;
    }
    pd_strbuf report;
    pd_strbuf_init(&report, report_buf, REPORT_BYTES_MAX);
    if (a.mode == MODE_SCENARIO) rc = run_scenarios(&a, argv, trace, &report);
    else if (a.mode == MODE_EXPLORE) rc = run_explore(&a, &report);
    else rc = run_random(&a, trace, &report);
    free(report_buf);
    if (trace) fclose(trace);
    return rc;
}
