/* Option parsing shared by pdserve prefill, decode, serve and run. */
#ifndef PDSERVE_CLI_NODE_OPTIONS_H
#define PDSERVE_CLI_NODE_OPTIONS_H

#include <stdio.h>

#include "pdserve/node.h"

/* Parses node options from argv[1..]. Returns 0 (ok), 1 (--help asked) or 2
 * (bad usage, message printed). With consumed_until, stops at the first
 * unknown option and reports its index instead of failing. */
int cli_node_parse(int argc, char **argv, pd_node_config *c, int *consumed_until);
void cli_node_usage(FILE *to, const char *cmd, const char *what);
/* Returns when SIGINT or SIGTERM arrives. */
void cli_wait_for_signal(void);

#endif
