/* The scenario language (docs/simulator.md): any text is either refused
 * with a message or replayed; nothing crashes, and the simulator's own
 * checks hold on whatever it replays (a violation is a finding too). */
#include <stdlib.h>
#include <string.h>

#include "fuzz.h"
#include "pdserve/sim.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size > 4096) return 0;
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    pd_sim_result res;
    char buf[8192];
    pd_strbuf report;
    pd_strbuf_init(&report, buf, sizeof(buf));
    pd_sim_scenario(text, "fuzz", NULL, NULL, &res, &report);
    free(text);
    return 0;
}
