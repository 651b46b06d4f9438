/* cmd_digest.c — `lorakit digest FILE`: the content digest (DESIGN.md):
 * XXH3-128 over the tensors in name order, metadata excluded, printed as 32
 * lowercase hex digits. Two files holding equal tensors give equal digests
 * whatever their layout or metadata. */
#include <stdio.h>
#include <string.h>

#include "cli.h"

static const char *const DIGEST_USAGE =
    "usage: lorakit digest FILE|INDEX|DIR\n\n"
    "Prints the content digest of a checkpoint (a safetensors file, or a\n"
    "sharded set given by its *.safetensors.index*.json or its folder; the\n"
    "digest is over all shards' tensors): XXH3-128 over, for each\n"
    "tensor in byte-wise sorted name order, the name, a NUL, the dtype, a NUL,\n"
    "the shape as little-endian i64s, then the raw bytes; 32 lowercase hex\n"
    "digits. Metadata and tensor order in the file do not matter.\n\n"
    "options:\n"
    "  -h, --help this text\n";

int lk_cmd_digest(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        fputs(DIGEST_USAGE, stdout);
        return LK_EXIT_OK;
    }
    const char *path = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--") && i + 2 == argc && !path) path = argv[++i];
        else if (argv[i][0] == '-' && argv[i][1]) return lk_cli_usage("digest", "unknown option '%s'", argv[i]);
        else if (path) return lk_cli_usage("digest", "one FILE expected, got '%s' and '%s'", path, argv[i]);
        else path = argv[i];
    }
    if (!path) return lk_cli_usage("digest", "missing FILE");
    lk_ckpt *ck;
    if (lk_ckpt_open(path, &ck) != LK_OK) return lk_cli_fail();
    char hex[LK_DIGEST_HEX];
    lk_status s = lk_digest_ckpt(ck, hex);
    lk_ckpt_close(ck);
    if (s != LK_OK) return lk_cli_fail();
    printf("%s\n", hex);
    return LK_EXIT_OK;
}
