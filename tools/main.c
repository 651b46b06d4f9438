/* main.c — the lorakit command-line entry: dispatches to tools/cmd_<name>.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

#ifndef LK_VERSION
#define LK_VERSION "0.0.0"
#endif

static const struct {
    const char *name;
    const char *summary;
    int (*fn)(int, char **);
} g_cmds[] = {
#define LK_CMD(name, summary) {#name, summary, lk_cmd_##name},
#include "commands.def"
#undef LK_CMD
};

static void usage(FILE *f) {
    fprintf(f, "usage: lorakit <command> [options]\n\n"
               "LoRA adapters on transformer checkpoints: fuse, hot-swap, train.\n\ncommands:\n");
    for (size_t i = 0; i < sizeof g_cmds / sizeof g_cmds[0]; i++)
        fprintf(f, "  %-10s %s\n", g_cmds[i].name, g_cmds[i].summary);
    fprintf(f, "\n'lorakit <command> --help' describes a command.\n"
               "Exit codes: 0 success, 1 the operation failed, 2 bad usage.\n"
               "Log level: LORAKIT_LOG=error|warn|info|debug.\n");
}

int main(int argc, char **argv) {
    /* an interrupted output leaves no temporary behind (lorakit/safetensors.h) */
    if (lk_temp_cleanup_on_signals() != LK_OK) return lk_cli_fail();
    if (argc < 2) {
        usage(stderr);
        return LK_EXIT_USAGE;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return LK_EXIT_OK;
    }
    if (!strcmp(argv[1], "--version") || !strcmp(argv[1], "-V")) {
        printf("lorakit %s\n", LK_VERSION);
        return LK_EXIT_OK;
    }
    for (size_t i = 0; i < sizeof g_cmds / sizeof g_cmds[0]; i++)
        if (!strcmp(argv[1], g_cmds[i].name)) return g_cmds[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "lorakit: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return LK_EXIT_USAGE;
}
