/* Option parsing shared by pdserve prefill, decode, serve and run. */
#ifndef PDSERVE_CLI_NODE_OPTIONS_H
#define PDSERVE_CLI_NODE_OPTIONS_H

#include <stdio.h>

#include "pdserve/node.h"

/* The node commands. Which options apply follows the role a command runs:
 * serve with --disaggregation-mode prefill is CLI_NODE_PREFILL. */
typedef enum cli_node_cmd {
    CLI_NODE_SERVE,
    CLI_NODE_PREFILL,
    CLI_NODE_DECODE,
    CLI_NODE_RUN,
} cli_node_cmd;

/* Parses node options from argv[1..] (argv[0]: serve, prefill, decode or
 * run; c->role the command's). Returns 0 (ok), 1 (--help asked) or 2 (bad
 * usage, message printed). On serve, --disaggregation-mode changes c->role
 * and c->port's default. An option that does not apply to the command is
 * refused, never ignored. */
int cli_node_parse(int argc, char **argv, pd_node_config *c);
void cli_node_usage(FILE *to, cli_node_cmd which, const char *cmd, const char *what);
/* True when name (any spelling) is an option of some node command. */
bool cli_node_option_known(const char *name);
/* At --log-level debug: one line with the configuration a node starts with. */
void cli_node_log_config(const char *cmd, const pd_node_config *c);
/* Returns when SIGINT or SIGTERM arrives. */
/* SIGINT and SIGTERM set the stop flag, SIGPIPE is ignored: installed
 * before a server starts, so a signal that comes early still stops it
 * gracefully. */
void cli_catch_stop_signals(void);
/* Installs them (again) and waits for the flag. */
void cli_wait_for_signal(void);

#endif
