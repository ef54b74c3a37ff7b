/* Placeholder until the simulator lands (src/sim). */
#include <stdio.h>

#include "commands.h"

int pd_cmd_sim(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "pdserve sim: not available in this build yet\n");
    return 2;
}
