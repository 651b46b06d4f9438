/* cmd_config.c — `lorakit config check CONFIG.yaml [--role ROLE]`: resolves
 * the `models.<role>.lora` block of every role (or one) with the training
 * rules of src/lora/config.c and prints one line per role, so a config can
 * be validated before a run is launched. Exit 1 if any role is invalid. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "lora/config.h"

static const char *const CONFIG_USAGE =
    "usage: lorakit config check CONFIG.yaml [--role ROLE]\n\n"
    "Checks the LoRA block `models.<role>.lora` of each role in a training\n"
    "config and prints the resolved settings, one line per role:\n"
    "  ROLE: lora enabled: rank R, alpha A, targets [...]\n"
    "  ROLE: lora disabled (rank R set but enable is false: not applied)\n"
    "  ROLE: lora not configured\n"
    "An invalid block is reported as \"lorakit: FILE:LINE: models.ROLE.lora.KEY:\n"
    "...\" and the exit code is 1; unknown keys are a warning on stderr.\n\n"
    "Rules: enable defaults to false; enable true needs an integer rank > 0;\n"
    "rank must be an integer; rank with enable false is ignored; alpha\n"
    "defaults to rank; target_modules defaults to q_proj k_proj v_proj o_proj\n"
    "to_q to_k to_v to_out to_qkv to_gate_compress (substring match).\n\n"
    "options:\n"
    "  --role ROLE   check only this role (an error if it does not exist)\n"
    "  -h, --help    this text\n";

static int check_role(const lk_ydoc *doc, const char *role) {
    lk_lora_config cfg;
    if (lk_lora_config_from_doc(doc, role, &cfg) != LK_OK) return lk_cli_fail();
    char line[2048];
    lk_lora_config_describe(&cfg, line, sizeof line);
    printf("%s: %s\n", role, line);
    lk_lora_config_clear(&cfg);
    return LK_EXIT_OK;
}

int lk_cmd_config(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        fputs(CONFIG_USAGE, stdout);
        return LK_EXIT_OK;
    }
    if (argc < 2) return lk_cli_usage("config", "missing subcommand (config check CONFIG.yaml)");
    if (strcmp(argv[1], "check")) return lk_cli_usage("config", "unknown subcommand '%s'", argv[1]);
    const char *path = NULL, *role = NULL;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "--role")) {
            if (i + 1 >= argc) return lk_cli_usage("config", "--role needs a value");
            role = argv[++i];
        } else if (argv[i][0] == '-' && argv[i][1]) {
            return lk_cli_usage("config", "unknown option '%s'", argv[i]);
        } else if (!path) {
            path = argv[i];
        } else {
            return lk_cli_usage("config", "more than one CONFIG file given");
        }
    }
    if (!path) return lk_cli_usage("config", "missing CONFIG.yaml");
    /* the file is read and parsed once, every role checked on that tree */
    lk_ydoc *doc;
    if (lk_ydoc_load(path, &doc) != LK_OK) return lk_cli_fail();
    int rc = LK_EXIT_OK;
    if (role) {
        rc = check_role(doc, role);
    } else {
        char **roles;
        size_t n;
        if (lk_lora_config_roles_doc(doc, &roles, &n) != LK_OK) {
            lk_ydoc_free(doc);
            return lk_cli_fail();
        }
        if (n == 0) printf("no roles under models: lora not configured\n");
        for (size_t i = 0; i < n; i++)
            if (check_role(doc, roles[i]) != LK_EXIT_OK) rc = LK_EXIT_FAIL;
        lk_lora_roles_free(roles, n);
    }
    lk_ydoc_free(doc);
    return rc;
}
