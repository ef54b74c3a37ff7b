/*
 * args.h — what every subcommand's option parser shares: strict number
 * parsing and the split of "--opt VALUE" / "--opt=VALUE".
 */
#ifndef PDSERVE_CLI_ARGS_H
#define PDSERVE_CLI_ARGS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* A decimal integer in [lo, hi]: no sign, no trailing text, no overflow. */
bool cli_u64(const char *s, uint64_t lo, uint64_t hi, uint64_t *out);
/* A finite number in [lo, hi], nothing after it. */
bool cli_float(const char *s, float lo, float hi, float *out);
/* Splits argv[*i] into the option's name and its value: "--opt=VALUE" (only
 * for arguments starting with "--"), or "--opt VALUE" taking argv[*i + 1]
 * (and advancing *i). Returns the value, or NULL when none follows. */
const char *cli_option(int argc, char **argv, int *i, char *name, size_t cap);

#endif
