/* Placeholder until the tiny hybrid model lands (src/model). */
#include <stdio.h>

#include "commands.h"

int pd_cmd_generate(int argc, char **argv) {
    (void)argc;
    (void)argv;
    fprintf(stderr, "pdserve generate: not available in this build yet\n");
    return 2;
}
