/* report_render RESULTS.json DIR: writes DIR/report.html (pd_report_write),
 * for the report's ctests and for looking at a report by hand. */
#include <stdio.h>

#include "pdserve/report.h"

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: report_render RESULTS.json DIR\n");
        return 2;
    }
    json_error_t jerr;
    json_t *results = json_load_file(argv[1], 0, &jerr);
    if (!results) {
        fprintf(stderr, "report_render: %s:%d: %s\n", argv[1], jerr.line, jerr.text);
        return 1;
    }
    char err[512];
    int rc = pd_report_write(results, argv[2], err, sizeof(err));
    json_decref(results);
    if (rc) {
        fprintf(stderr, "report_render: %s\n", err);
        return 1;
    }
    printf("%s/report.html\n", argv[2]);
    return 0;
}
