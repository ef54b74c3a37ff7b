/*
 * args.h — what every subcommand's option parser shares: strict number
 * parsing, the split of "--opt VALUE" / "--opt=VALUE", the message for an
 * unknown option, and the log level.
 */
#ifndef PDSERVE_CLI_ARGS_H
#define PDSERVE_CLI_ARGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

/* A decimal integer in [lo, hi]: no sign, no trailing text, no overflow. */
bool cli_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out);
/* A finite number in [lo, hi], nothing after it. */
bool cli_float(const char *s, float lo, float hi, float *out);
/* Splits argv[*i] into the option's name and its value: "--opt=VALUE" (only
 * for arguments starting with "--"), or "--opt VALUE" taking argv[*i + 1]
 * (and advancing *i). Returns the value, or NULL when none follows. */
const char *cli_option(int argc, char **argv, int *i, char *name, size_t cap);

/* An unknown option of `pdserve cmd`, said in one line on stderr: its name,
 * then a hint when there is one. A known spelling of something else (an
 * SGLang flag pdserve does not have, another command's option) gets what to
 * do instead; elsewhere (NULL or e.g. "the node commands") names where else
 * it is an option; otherwise a near miss of an option listed in help (the
 * command's --help text, NULL for none) gets "did you mean". Returns 2. */
int cli_unknown_option(const char *cmd, const char *name, const char *help, const char *elsewhere);
/* The same with the help text printed by usage. */
int cli_unknown_option_usage(const char *cmd, const char *name, void (*usage)(FILE *to),
                             const char *elsewhere);

/* --log-level: what the CLI prints while it serves. Usage errors and
 * --help are not logs and always print. */
typedef enum cli_log_level {
    CLI_LOG_DEBUG,
    CLI_LOG_INFO, /* the default */
    CLI_LOG_WARNING,
    CLI_LOG_ERROR,
} cli_log_level;
#define CLI_LOG_LEVELS "debug, info, warning (or warn) or error"
/* Sets the level by name (any case); false for an unknown name. */
bool cli_log_level_set(const char *name);
cli_log_level cli_log_level_get(void);
/* Prints one line when level is at or above the level set: debug and info
 * on stdout, warning and error on stderr; flushed at once. */
#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
void cli_log(cli_log_level level, const char *fmt, ...);

#endif
