/*
 * pdserve sim — the deterministic simulator's command line.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "commands.h"
#include "pdserve/sim.h"

static void usage(FILE *to) {
    fprintf(to,
            "usage: pdserve sim MODE [options]\n"
            "\n"
            "modes:\n"
            "  --seed S            one random run; JSON summary on stdout\n"
            "  --seeds A..B        swarm: seeds A to B, each with its own configuration\n"
            "  --scenario FILE...  replay scenario files; exit 0 only if every expect holds\n"
            "  --explore           every schedule of a small configuration (two requests of\n"
            "                      three chunks, overlap on, one abort, one bootstrap failure,\n"
            "                      one transfer failure)\n"
            "\n"
            "options:\n"
            "  --requests N        requests per random run (default 50)\n"
            "  --faults LIST       all | none | comma list of abort, bootstrap, hold, xfer,\n"
            "                      abort-error, kill, dup, oversize (default all)\n"
            "  --config \"...\"      a scenario config line overriding the defaults,\n"
            "                      e.g. \"config page_size=1 chunk=3 mamba=off\"\n"
            "  --model synth|tiny  the executor: the synthetic model (default, fast) or the\n"
            "                      tiny hybrid model's real forward pass\n"
            "  --trace FILE        write every executed line (a replayable scenario)\n"
            "  --limit N           --explore: stop after N schedules\n"
            "  --quiet             --seeds: print only the final summary\n"
            "\n"
            "On a violation the run stops, prints the seed, the configuration and its last\n"
            "lines as a scenario, and exits 1. Exit 2 means bad usage.\n");
}

static void print_result(const pd_sim_result *r) {
    printf("{\"seed\":%llu,\"requests\":%u,\"finished\":%u,\"aborted\":%u,\"failed\":%u,"
           "\"rejected\":%u,\"violations\":%u,\"steps\":%llu,\"events\":%llu}\n",
           (unsigned long long)r->seed, r->requests, r->finished, r->aborted, r->failed, r->rejected,
           r->violations, (unsigned long long)r->steps, (unsigned long long)r->events);
}

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
            if (!nb) {
                free(buf);
                buf = NULL;
            }
            buf = nb;
        }
    }
    fclose(f);
    if (buf) buf[len] = 0;
    return buf;
}

static bool parse_u64(const char *s, uint64_t *out) {
    if (!s || !*s) return false;
    char *end;
    unsigned long long v = strtoull(s, &end, 0);
    if (*end) return false;
    *out = v;
    return true;
}

int pd_cmd_sim(int argc, char **argv) {
    enum { NONE, SEED, SEEDS, SCENARIO, EXPLORE } mode = NONE;
    uint64_t seed = 0, seed_a = 0, seed_b = 0, limit = 0, requests = 50;
    const char *faults = "all", *trace_path = NULL, *config = NULL, *model = NULL;
    bool quiet = false;
    int first_file = 0, n_files = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        } else if (!strcmp(a, "--seed")) {
            if (!parse_u64(v, &seed)) goto bad;
            mode = SEED;
            i++;
        } else if (!strcmp(a, "--seeds")) {
            const char *dots = v ? strstr(v, "..") : NULL;
            if (!dots) goto bad;
            char left[32];
            size_t ll = (size_t)(dots - v);
            if (ll == 0 || ll >= sizeof(left)) goto bad;
            memcpy(left, v, ll);
            left[ll] = 0;
            if (!parse_u64(left, &seed_a) || !parse_u64(dots + 2, &seed_b) || seed_b < seed_a) goto bad;
            mode = SEEDS;
            i++;
        } else if (!strcmp(a, "--scenario")) {
            mode = SCENARIO;
            first_file = i + 1;
            while (i + 1 < argc && strncmp(argv[i + 1], "--", 2)) {
                i++;
                n_files++;
            }
            if (n_files == 0) goto bad;
        } else if (!strcmp(a, "--explore")) {
            mode = EXPLORE;
        } else if (!strcmp(a, "--requests")) {
            if (!parse_u64(v, &requests) || requests == 0 || requests > 100000) goto bad;
            i++;
        } else if (!strcmp(a, "--faults")) {
            if (!v) goto bad;
            faults = v;
            i++;
        } else if (!strcmp(a, "--trace")) {
            if (!v) goto bad;
            trace_path = v;
            i++;
        } else if (!strcmp(a, "--config")) {
            if (!v) goto bad;
            config = v;
            i++;
        } else if (!strcmp(a, "--model")) {
            if (!v || (strcmp(v, "tiny") && strcmp(v, "synth"))) goto bad;
            model = v;
            i++;
        } else if (!strcmp(a, "--limit")) {
            if (!parse_u64(v, &limit)) goto bad;
            i++;
        } else if (!strcmp(a, "--quiet")) {
            quiet = true;
        } else {
            fprintf(stderr, "pdserve sim: unknown option '%s'\n", a);
            usage(stderr);
            return 2;
        }
        continue;
    bad:
        fprintf(stderr, "pdserve sim: option %s needs a valid value%s%s\n", a, v ? ", got " : "", v ? v : "");
        return 2;
    }
    if (mode == NONE) {
        usage(stderr);
        return 2;
    }
    uint32_t fault_bits;
    char msg[256];
    if (pd_sim_parse_faults(faults, &fault_bits, msg, sizeof(msg)) != PD_OK) {
        fprintf(stderr, "pdserve sim: %s\n", msg);
        return 2;
    }
    char config_buf[1024];
    if (model) {
        snprintf(config_buf, sizeof(config_buf), "%s model=%s", config ? config : "config", model);
        config = config_buf;
    }
    if (config && strncmp(config, "config", 6) != 0) {
        fprintf(stderr, "pdserve sim: --config takes a scenario config line: \"config key=value ...\"\n");
        return 2;
    }
    FILE *trace = NULL;
    if (trace_path && !(trace = fopen(trace_path, "w"))) {
        fprintf(stderr, "pdserve sim: cannot write %s\n", trace_path);
        return 2;
    }
    size_t report_cap = 1 << 20;
    char *report_buf = malloc(report_cap);
    pd_strbuf report;
    pd_strbuf_init(&report, report_buf, report_cap);
    int rc = 0;
    if (mode == SEED || mode == SEEDS) {
        pd_sim_options o = {.requests = (uint32_t)requests, .faults = fault_bits, .trace = trace,
                            .vary = mode == SEEDS, .config = config};
        uint64_t a = mode == SEED ? seed : seed_a, b = mode == SEED ? seed : seed_b;
        pd_sim_result total = {0};
        uint64_t failed_seeds = 0;
        for (uint64_t s = a; s <= b; s++) {
            o.seed = s;
            pd_sim_result r;
            pd_strbuf_reset(&report);
            pd_err err = pd_sim_random(&o, &r, &report);
            if (mode == SEED || (!quiet && err)) print_result(&r);
            if (err) {
                fprintf(stderr, "%s", report_buf);
                fprintf(stderr, "# reproduce: pdserve sim --seed %llu --requests %llu --faults %s%s%s%s\n",
                        (unsigned long long)s, (unsigned long long)requests, faults,
                        mode == SEEDS ? " --config \"" : "", mode == SEEDS ? r.config : "",
                        mode == SEEDS ? "\"" : "");
                failed_seeds++;
                rc = 1;
                break;
            }
            total.requests += r.requests;
            total.finished += r.finished;
            total.aborted += r.aborted;
            total.failed += r.failed;
            total.rejected += r.rejected;
            total.steps += r.steps;
            total.events += r.events;
        }
        if (mode == SEEDS)
            printf("{\"seeds\":%llu,\"failed_seeds\":%llu,\"requests\":%u,\"finished\":%u,\"aborted\":%u,"
                   "\"failed\":%u,\"rejected\":%u,\"violations\":%llu,\"steps\":%llu}\n",
                   (unsigned long long)(b - a + 1), (unsigned long long)failed_seeds, total.requests,
                   total.finished, total.aborted, total.failed, total.rejected,
                   (unsigned long long)failed_seeds, (unsigned long long)total.steps);
    } else if (mode == SCENARIO) {
        int failed = 0;
        for (int f = 0; f < n_files; f++) {
            const char *path = argv[first_file + f];
            char *text = read_file(path);
            if (!text) {
                fprintf(stderr, "FAIL %s: cannot read the file\n", path);
                failed++;
                continue;
            }
            pd_sim_result r;
            pd_strbuf_reset(&report);
            pd_err err = pd_sim_scenario(text, path, config, trace, &r, &report);
            free(text);
            if (err) {
                printf("FAIL %s\n", path);
                fprintf(stderr, "%s", report_buf);
                failed++;
            } else {
                printf("PASS %s (%llu steps, %u requests: %u finished, %u aborted, %u failed, %u rejected)\n",
                       path, (unsigned long long)r.steps, r.requests, r.finished, r.aborted, r.failed, r.rejected);
            }
        }
        printf("%d passed, %d failed\n", n_files - failed, failed);
        rc = failed ? 1 : 0;
    } else {
        pd_sim_explore_result r;
        pd_err err = pd_sim_explore(limit, &r, &report);
        printf("{\"schedules\":%llu,\"violations\":%llu,\"max_choices\":%u%s}\n",
               (unsigned long long)r.schedules, (unsigned long long)r.violations, r.max_choices,
               limit && r.schedules >= limit ? ",\"limited\":true" : "");
        if (err) {
            fprintf(stderr, "%s", report_buf);
            rc = 1;
        }
    }
    free(report_buf);
    if (trace) fclose(trace);
    return rc;
}
