/*
 * The pdserve subcommands. Each takes the arguments after its name
 * (argv[0] is the subcommand name) and returns the process exit code.
 */
#ifndef PDSERVE_CLI_COMMANDS_H
#define PDSERVE_CLI_COMMANDS_H

int cli_cmd_sim(int argc, char **argv);
int cli_cmd_model(int argc, char **argv);
int cli_cmd_generate(int argc, char **argv);
int cli_cmd_serve(int argc, char **argv);
int cli_cmd_prefill(int argc, char **argv);
int cli_cmd_decode(int argc, char **argv);
int cli_cmd_run(int argc, char **argv);
int cli_cmd_router(int argc, char **argv);
int cli_cmd_bench(int argc, char **argv);

#endif
