/* cli.h — shared helpers of the lorakit subcommands.
 * Exit codes: 0 success, 1 the operation failed, 2 bad usage. Every error is
 * printed once, as "lorakit: <message>" on stderr. */
#ifndef LORAKIT_CLI_H
#define LORAKIT_CLI_H

#include "lorakit/lorakit.h"
#include "app/model.h"
#include "app/task.h"

#define LK_EXIT_OK 0
#define LK_EXIT_FAIL 1
#define LK_EXIT_USAGE 2

/* Each subcommand: int lk_cmd_<name>(int argc, char **argv), argv[0] is the
 * subcommand's name. Declared from commands.def. */
#define LK_CMD(name, summary) int lk_cmd_##name(int argc, char **argv);
#include "commands.def"
#undef LK_CMD

/* Prints "lorakit: <lk_last_error()>" and returns LK_EXIT_FAIL. */
int lk_cli_fail(void);
/* Prints "lorakit: <msg>" plus a hint to --help; returns LK_EXIT_USAGE. */
int lk_cli_usage(const char *cmd, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* 1 if argv holds -h or --help. */
int lk_cli_wants_help(int argc, char **argv);
/* Parses a strictly decimal int / double; returns 0 on failure. */
int lk_cli_parse_int(const char *s, long *out);
int lk_cli_parse_double(const char *s, double *out);

#endif
