/*
 * pdserve bench's report: one self-contained report.html drawn from the
 * results JSON (docs/bench-serving.md; the schema's fields are read, never
 * recomputed, except the curves drawn from the per-request data).
 *
 * The page is XHTML: well-formed XML (an XML parser reads it, and the tests
 * parse it with one), inline CSS and inline SVG, no script, no network, no
 * external font. Every string that came from the JSON (urls, rids, errors)
 * is escaped. Charts carry stable ids a test can find:
 *
 *   cdf-ttft, cdf-itl, cdf-e2e     latency CDFs (log-scale x past a 100x spread)
 *   timeline                       requests/s, output tokens/s, concurrency over
 *                                  time, with the aborts marked
 *   pools-<node>-<pool>            a node's pool units by ledger state over time
 *                                  (free / req / cache / quarantine), the idle
 *                                  check marked: a leak is a band that stays
 *
 * A chart without data says "no data". Each CDF has at most 500 points, so
 * a run of 100,000 requests still gives a page a browser opens at once.
 */
#ifndef PDSERVE_REPORT_H
#define PDSERVE_REPORT_H

#include <stddef.h>

#include <jansson.h>

#include "pdserve/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Writes DIR/report.html from `results` (the JSON `pdserve bench
 * --output-file` writes), creating DIR if it does not exist (one level: its
 * parent must). Bad input — a required field missing, a field of the wrong
 * type — is PD_ERR_PARSE with err naming the field ("pdserve.requests[3].
 * end_s: expected a number, found a string"); a directory or file that
 * cannot be written is PD_ERR_IO naming the path. On error no report.html is
 * left behind (an earlier one stays as it was). Returns 0 (PD_OK) on success. */
int pd_report_write(const json_t *results, const char *dir, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif

#endif
