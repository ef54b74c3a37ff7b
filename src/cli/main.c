/*
 * pdserve — one binary, one subcommand per job.
 */
#include <stdio.h>
#include <string.h>

#include "commands.h"
#include "pdserve/base.h"

typedef struct command {
    const char *name;
    int (*run)(int argc, char **argv);
    const char *summary;
} command;

static const command commands[] = {
    {"run", cli_cmd_run, "the embedded default: router + prefill + decode in one process"},
    {"serve", cli_cmd_serve, "a colocated server: prefill and decode in one engine"},
    {"prefill", cli_cmd_prefill, "a prefill node of a disaggregated deployment"},
    {"decode", cli_cmd_decode, "a decode node of a disaggregated deployment"},
    {"sim", cli_cmd_sim,
     "deterministic simulator: random runs, swarms, exploration, scenario replay"},
    {"model", cli_cmd_model, "model tools: `model init` writes a model directory"},
    {"generate", cli_cmd_generate, "offline generation with the tiny hybrid model"},
    {"router", cli_cmd_router, "HTTP router: pairs each request with a prefill and a decode node"},
    {"bench", cli_cmd_bench,
     "load a deployment: TTFT, ITL, throughput, aborts; checks the nodes end idle and clean"},
};

static void usage(FILE *to) {
    fprintf(to,
            "usage: pdserve <command> [options]   "
            "(pdserve <command> --help for its options; --version)\n\n");
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
        fprintf(to, "  %-10s %s\n", commands[i].name, commands[i].summary);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    /* --version, alone or after any command: no option takes it as a value. */
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--version")) {
            printf("pdserve %s\n", PD_VERSION);
            return 0;
        }
    for (size_t i = 0; i < sizeof(commands) / sizeof(commands[0]); i++)
        if (!strcmp(argv[1], commands[i].name)) return commands[i].run(argc - 1, argv + 1);
    fprintf(stderr, "pdserve: unknown command '%s'\n\n", argv[1]);
    usage(stderr);
    return 2;
}
