/* report_render RESULTS.json DIR: writes DIR/report.html (pd_report_write),
 * for the report's ctests and for looking at a report by hand. Prints the
 * page's path, and on stderr the seconds spent reading the JSON and
 * writing the page. */
#include <stdio.h>
#include <time.h>

#include "pdserve/report.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: report_render RESULTS.json DIR\n");
        return 2;
    }
    double t0 = now_s();
    json_error_t jerr;
    json_t *results = json_load_file(argv[1], 0, &jerr);
    if (!results) {
        fprintf(stderr, "report_render: %s:%d: %s\n", argv[1], jerr.line, jerr.text);
        return 1;
    }
    char err[512];
    double t1 = now_s();
    int rc = pd_report_write(results, argv[2], err, sizeof(err));
    double t2 = now_s();
    json_decref(results);
    if (rc) {
        fprintf(stderr, "report_render: %s\n", err);
        return 1;
    }
    fprintf(stderr, "report_render: JSON read in %.3f s, report written in %.3f s\n", t1 - t0,
            t2 - t1);
    printf("%s/report.html\n", argv[2]);
    return 0;
}
