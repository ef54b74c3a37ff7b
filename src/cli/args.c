#include "args.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

bool cli_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out) {
    if (!s || !*s || *s == '-' || *s == '+') return false;
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

bool cli_float(const char *s, float lo, float hi, float *out) {
    if (!s || !*s) return false;
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || *end || !isfinite(v) || v < lo || v > hi) return false;
    *out = v;
    return true;
}

const char *cli_option(int argc, char **argv, int *i, char *name, size_t cap) {
    const char *a = argv[*i];
    const char *eq = strchr(a, '=');
    if (!strncmp(a, "--", 2) && eq && (size_t)(eq - a) < cap) {
        memcpy(name, a, (size_t)(eq - a));
        name[eq - a] = '\0';
        return eq + 1;
    }
    snprintf(name, cap, "%s", a);
    return *i + 1 < argc ? argv[++*i] : NULL;
}

/* ---- unknown options ------------------------------------------------------------------ */

/* Spellings people bring from SGLang, sgl-router or another pdserve command,
 * with what to do instead. Only looked at for a name the command does not
 * know, so "an option of X" is true wherever it prints. */
static const struct {
    const char *flag, *hint;
} known_elsewhere[] = {
    {"--tp-size", "pdserve runs one engine per process: no tensor parallelism"},
    {"--tp", "pdserve runs one engine per process: no tensor parallelism"},
    {"--dp-size", "pdserve runs one engine per process: start more nodes behind pdserve router"},
    {"--dp", "pdserve runs one engine per process: start more nodes behind pdserve router"},
    {"--nnodes", "one engine per process: start more nodes behind pdserve router"},
    {"--dist-init-addr", "one engine per process: start more nodes behind pdserve router"},
    {"--mem-fraction-static", "the KV pool is sized in tokens: --max-total-tokens"},
    {"--max-prefill-tokens", "prompt tokens per forward are --chunked-prefill-size"},
    {"--tokenizer-path", "the tokenizer is the model directory's tokenizer.json (--model-path)"},
    {"--trust-remote-code", "pdserve runs its own hybrid model only; no remote code"},
    {"--dtype", "the weights' dtype is chosen when the model is written: pdserve model init"},
    {"--disaggregation-ib-device", "UCX chooses the devices: set UCX_NET_DEVICES"},
    {"--worker-urls", "pdserve router pairs prefill and decode nodes: --prefill URL --decode URL"},
    {"--prefill", "an option of pdserve router"},
    {"--decode", "an option of pdserve router"},
    {"--pd-disaggregation", "an option of pdserve router"},
    {"--policy", "an option of pdserve router"},
    {"--bootstrap-port",
     "a prefill node's bootstrap port is --disaggregation-bootstrap-port (--bootstrap-port is "
     "pdserve router's)"},
    {"--prefill-port", "an option of pdserve run"},
    {"--decode-port", "an option of pdserve run"},
    {"--no-router", "an option of pdserve run"},
    {"--prompt", "an option of pdserve generate"},
};

/* Optimal string alignment distance (edits and swaps of neighbours), capped:
 * anything over `cap` is cap + 1. Names are short (< 64 bytes). */
static size_t edit_distance(const char *a, const char *b, size_t cap) {
    size_t n = strlen(a), m = strlen(b);
    if (n >= 64 || m >= 64) return cap + 1;
    size_t d[64][64];
    for (size_t i = 0; i <= n; i++) d[i][0] = i;
    for (size_t j = 0; j <= m; j++) d[0][j] = j;
    for (size_t i = 1; i <= n; i++)
        for (size_t j = 1; j <= m; j++) {
            size_t best = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
            if (d[i - 1][j] + 1 < best) best = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < best) best = d[i][j - 1] + 1;
            if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] &&
                d[i - 2][j - 2] + 1 < best)
                best = d[i - 2][j - 2] + 1;
            d[i][j] = best;
        }
    return d[n][m] > cap ? cap + 1 : d[n][m];
}

/* The option of help closest to name: a typo (a few edits) or a name cut
 * short (a prefix of at least 6 bytes). Options are the lines of help that
 * start, after spaces, with "--". Writes it to out ("" when none). */
static void closest_option(const char *help, const char *name, char *out, size_t cap) {
    out[0] = '\0';
    size_t len = strlen(name), near = len <= 10 ? 2 : 3, best = near + 1;
    for (const char *line = help; line && *line;) {
        const char *p = line;
        while (*p == ' ') p++;
        if (p > line && !strncmp(p, "--", 2)) {
            char opt[64];
            size_t k = strcspn(p, " =[\n");
            snprintf(opt, sizeof opt, "%.*s", (int)(k < 63 ? k : 63), p);
            size_t d = edit_distance(name, opt, near);
            if (d > near && len >= 6 && !strncmp(opt, name, len)) d = near; /* cut short */
            if (d < best) {
                best = d;
                snprintf(out, cap, "%s", opt);
            }
        }
        line = strchr(line, '\n');
        if (line) line++;
    }
}

int cli_unknown_option(const char *cmd, const char *name, const char *help, const char *elsewhere) {
    char opt[64];
    const char *hint = NULL;
    for (size_t i = 0; i < sizeof known_elsewhere / sizeof known_elsewhere[0]; i++)
        if (!strcmp(name, known_elsewhere[i].flag)) hint = known_elsewhere[i].hint;
    if (!hint && help) closest_option(help, name, opt, sizeof opt);
    fprintf(stderr, "pdserve %s: unknown option '%s'", cmd, name);
    if (hint) fprintf(stderr, ": %s", hint);
    else if (elsewhere) fprintf(stderr, ": an option of %s", elsewhere);
    else if (help && opt[0]) fprintf(stderr, "; did you mean %s?", opt);
    fprintf(stderr, " (see pdserve %s --help)\n", cmd);
    return 2;
}

int cli_unknown_option_usage(const char *cmd, const char *name, void (*usage)(FILE *to),
                             const char *elsewhere) {
    char *help = NULL;
    size_t len = 0;
    FILE *m = open_memstream(&help, &len);
    if (m) {
        usage(m);
        fclose(m);
    }
    int rc = cli_unknown_option(cmd, name, help, elsewhere);
    free(help);
    return rc;
}

/* ---- the log level -------------------------------------------------------------------- */

/* The CLI's one setting for the whole process, written while parsing. */
static cli_log_level log_level = CLI_LOG_INFO;

bool cli_log_level_set(const char *name) {
    static const struct {
        const char *name;
        cli_log_level level;
    } names[] = {{"debug", CLI_LOG_DEBUG},
                 {"info", CLI_LOG_INFO},
                 {"warning", CLI_LOG_WARNING},
                 {"warn", CLI_LOG_WARNING},
                 {"error", CLI_LOG_ERROR}};
    for (size_t i = 0; name && i < sizeof names / sizeof names[0]; i++)
        if (!strcasecmp(name, names[i].name)) {
            log_level = names[i].level;
            return true;
        }
    return false;
}

cli_log_level cli_log_level_get(void) { return log_level; }

void cli_log(cli_log_level level, const char *fmt, ...) {
    if (level < log_level) return;
    FILE *to = level >= CLI_LOG_WARNING ? stderr : stdout;
    va_list ap;
    va_start(ap, fmt);
    vfprintf(to, fmt, ap);
    va_end(ap);
    fputc('\n', to);
    fflush(to);
}
