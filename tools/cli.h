/* cli.h — the lorakit subcommands (tools/cmd_<name>.c, listed in
 * commands.def) and what they share: the library, the demo application
 * (src/app) and cli_util.h (exit codes, error reporting, parsing). */
#ifndef LK_TOOLS_CLI_H
#define LK_TOOLS_CLI_H

#include "lorakit/lorakit.h"
#include "cli_util.h"
#include "app/model.h"
#include "app/task.h"

/* Each subcommand: int lk_cmd_<name>(int argc, char **argv), argv[0] is the
 * subcommand's name. Declared from commands.def. */
#define LK_CMD(name, summary) int lk_cmd_##name(int argc, char **argv);
#include "commands.def"
#undef LK_CMD

#endif
