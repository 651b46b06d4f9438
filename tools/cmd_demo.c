/* cmd_demo.c — `lorakit demo [--out DIR]`: a first, small demonstration of
 * the foundation (to be replaced by the end-to-end demo): it writes a small
 * checkpoint with mixed dtypes, shows `inspect` and `digest` on it, then
 * writes the same tensors in another order with other metadata and shows
 * that the digest is unchanged, and that changing one byte changes it. The
 * outputs shown are those of the real subcommands, run in-process. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "cli.h"

static const char *const DEMO_USAGE =
    "usage: lorakit demo [--out DIR]\n\n"
    "Writes a small checkpoint (F32, BF16, F16 and I64 tensors, with metadata)\n"
    "into DIR (default ./lorakit-demo), then shows 'lorakit inspect' and\n"
    "'lorakit digest' on it and on a reordered copy.\n\n"
    "options:\n"
    "  --out DIR  output folder (created if missing)\n"
    "  -h, --help this text\n";

enum { D = 8, R = 4 };

static int run_cmd(const char *name, int (*fn)(int, char **), const char *arg1, const char *arg2) {
    char *argv[4] = {(char *)name, (char *)arg1, (char *)arg2, NULL};
    printf("\n$ lorakit %s %s%s%s\n", name, arg1, arg2 ? " " : "", arg2 ? arg2 : "");
    fflush(stdout);
    int rc = fn(arg2 ? 3 : 2, argv);
    fflush(stdout);
    return rc;
}

/* Writes the demo tensors in the given order; flip != 0 changes one byte. */
static lk_status write_ckpt(const char *path, const int *order, const char *const *meta, size_t n_meta, int flip) {
    static float w[D * D], b[D];
    static uint16_t wb[D * D], a[R * D];
    static int64_t step[1];
    for (int i = 0; i < D * D; i++) w[i] = sinf(0.1f * (float)i);
    for (int i = 0; i < D; i++) b[i] = 0.01f * (float)i;
    lk_from_f32(wb, w, LK_DTYPE_BF16, D * D);
    for (int i = 0; i < R * D; i++) a[i] = lk_f32_to_f16(0.5f - 0.03f * (float)i);
    step[0] = 1000;
    if (flip) ((unsigned char *)b)[5] ^= 1;
    const lk_tensor all[5] = {
        {.name = "blocks.0.attn.to_q.weight", .dtype = LK_DTYPE_F32, .ndim = 2, .shape = {D, D}, .nbytes = sizeof w, .data = w},
        {.name = "blocks.0.attn.to_q.bias", .dtype = LK_DTYPE_F32, .ndim = 1, .shape = {D}, .nbytes = sizeof b, .data = b},
        {.name = "blocks.0.attn.to_k.weight", .dtype = LK_DTYPE_BF16, .ndim = 2, .shape = {D, D}, .nbytes = sizeof wb, .data = wb},
        {.name = "blocks.0.attn.to_v.lora_A", .dtype = LK_DTYPE_F16, .ndim = 2, .shape = {R, D}, .nbytes = sizeof a, .data = a},
        {.name = "step", .dtype = LK_DTYPE_I64, .ndim = 0, .nbytes = sizeof step, .data = step},
    };
    lk_tensor t[5];
    for (int i = 0; i < 5; i++) t[i] = all[order[i]];
    return lk_st_save(path, t, 5, meta, n_meta);
}

int lk_cmd_demo(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        fputs(DEMO_USAGE, stdout);
        return LK_EXIT_OK;
    }
    const char *out = "lorakit-demo";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--out") && i + 1 < argc) out = argv[++i];
        else return lk_cli_usage("demo", "unexpected argument '%s'", argv[i]);
    }
    if (mkdir(out, 0777) != 0 && errno != EEXIST) {
        lk_error(LK_ERR_IO, "%s: cannot create folder: %s", out, strerror(errno));
        return lk_cli_fail();
    }
    size_t l = strlen(out) + 32;
    char *p1 = malloc(l), *p2 = malloc(l), *p3 = malloc(l);
    if (!p1 || !p2 || !p3) {
        free(p1); free(p2); free(p3);
        lk_error(LK_ERR_NOMEM, "out of memory");
        return lk_cli_fail();
    }
    snprintf(p1, l, "%s/base.safetensors", out);
    snprintf(p2, l, "%s/reordered.safetensors", out);
    snprintf(p3, l, "%s/changed.safetensors", out);
    static const int o1[5] = {0, 1, 2, 3, 4}, o2[5] = {4, 3, 2, 1, 0};
    const char *m1[] = {"format", "pt", "producer", "lorakit demo"};
    const char *m2[] = {"note", "same tensors, other order and metadata"};
    int rc = LK_EXIT_FAIL;
    printf("lorakit demo: writing a small checkpoint into %s/\n", out);
    if (write_ckpt(p1, o1, m1, 2, 0) || write_ckpt(p2, o2, m2, 1, 0) || write_ckpt(p3, o1, m1, 2, 1)) {
        rc = lk_cli_fail();
        goto done;
    }
    if ((rc = run_cmd("inspect", lk_cmd_inspect, p1, NULL))) goto done;
    if ((rc = run_cmd("digest", lk_cmd_digest, p1, NULL))) goto done;
    printf("\n# the same tensors declared in reverse order, with other metadata: same digest\n");
    if ((rc = run_cmd("digest", lk_cmd_digest, p2, NULL))) goto done;
    printf("\n# one byte of blocks.0.attn.to_q.bias changed: another digest\n");
    if ((rc = run_cmd("digest", lk_cmd_digest, p3, NULL))) goto done;
    if ((rc = run_cmd("inspect", lk_cmd_inspect, p1, "--json"))) goto done;
    printf("\nlorakit demo: done (files in %s/)\n", out);
done:
    free(p1);
    free(p2);
    free(p3);
    return rc;
}
