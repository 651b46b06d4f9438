/* cmd_fuse.c — `lorakit fuse BASE -l ADAPTER[:STRENGTH] ... -o OUT`.
 *
 * A thin front-end over lk_fuse_file: argument parsing, a progress bar on
 * stderr when stderr is a terminal (the library never prints; it reports
 * progress through a callback), and a summary (text or one JSON object).
 * All validation and the atomic write are the library's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli.h"

static const char *const FUSE_USAGE =
    "usage: lorakit fuse BASE -l ADAPTER[:STRENGTH][:alpha=A] [-l ...] -o OUT [options]\n\n"
    "Fuses LoRA adapters into a safetensors checkpoint and writes a new one:\n"
    "W <- W + sum_i strength_i * scale_i * (B_i @ A_i): the delta an FMA chain\n"
    "in a fixed order (fp32 for BF16/F16/FP8 weights, fp64 for F32 weights),\n"
    "W + delta rounded once (round-to-nearest-even) into the weight's dtype\n"
    "(F32, F16, BF16; FP8 F8_E4M3/F8_E5M2, plain or with a <m>.weight_scale or ComfyUI\n"
    "<m>.scale_weight: decoded exactly, divided by the new or kept scale and\n"
    "rounded once). scale = alpha / r (alpha / sqrt(r) with rsLoRA). ADAPTER is a PEFT\n"
    "folder (adapter_config.json + adapter_model.safetensors) or a .safetensors\n"
    "file in PEFT, diffusers/ComfyUI/LTX, kohya or FastVideo form (detected).\n"
    "BASE is a .safetensors file, a sharded set's *.safetensors.index*.json,\n"
    "a folder holding one of them, or a diffusers pipeline folder\n"
    "(model_index.json: modules go to unet/, transformer/, text_encoder[_2|_3]/\n"
    "by their prefix; OUT a pipeline folder: new, empty, or one lorakit wrote,\n"
    "replaced whole; never BASE, a folder holding it or one inside it; other\n"
    "files copied). A sharded BASE with OUT a folder (new,\n"
    "empty, or one lorakit wrote, replaced whole) keeps its layout: the same\n"
    "shard and index names, a new index\n"
    "(total_size recomputed, lorakit.fused added), the folder's other small\n"
    "files (config.json, ...) copied; the whole folder appears only when\n"
    "complete. OUT ending in .safetensors writes one file.\n"
    "Every adapter is validated before anything is written; untouched and\n"
    "non-float tensors are copied byte for byte; metadata is kept, plus\n"
    "\"lorakit.fused\" recording the adapters. The output is written atomically\n"
    "(a temporary file renamed into place): on any error no OUT is written (a\n"
    "file already at OUT is left as it was). The result does not depend on\n"
    "--threads or on the order of the -l options.\n\n"
    "options:\n"
    "  -l, --lora ADAPTER[:STRENGTH][:alpha=A]  an adapter; STRENGTH defaults to\n"
    "                         1.0 and may be negative or 0 (repeatable, at least one).\n"
    "                         It is used as the double typed (0.7 is 0.7, not\n"
    "                         the float 0.699999988) and must be finite; text\n"
    "                         after the last ':' that starts like a number is\n"
    "                         a strength and must parse whole. alpha=A: the\n"
    "                         alpha the adapter was trained with, for a file that\n"
    "                         gives none (a FastVideo-legacy file); a file alpha\n"
    "                         that differs is an error. Without one anywhere,\n"
    "                         alpha = r with a warning\n"
    "  -o, --out OUT          output file, or folder for a sharded BASE; never\n"
    "                         an input (a base file, shard or index, an adapter\n"
    "                         or its config, by any path) nor a device, FIFO or\n"
    "                         socket. A terminating signal (INT, TERM, HUP,\n"
    "                         PIPE, XFSZ, QUIT, ALRM, USR1, ...) removes the\n"
    "                         temporary; one left by a killed run is\n"
    "                         removed by the next run writing OUT\n"
    "  --threads N            fusion threads (default 0 = all cores)\n"
    LK_CLI_DEVICE_HELP
    "  --format F             read the adapters as F: auto (default), peft,\n"
    "                         diffusers, kohya, fastvideo\n"
    "  --arch NAME            the model family table that maps diffusers names onto\n"
    "                         the original single-file names (flux, sd1, sdxl, ...;\n"
    "                         \"none\": no table); default: recognised from BASE's keys\n"
    "  --map FILE             an extra name table in the same format (README \"Model\n"
    "                         families and layouts\"; repeatable)\n"
    "  --tie NAME=KEY         NAME is another name of BASE's tensor KEY (tied\n"
    "                         weights saved once, e.g. a transformers model with\n"
    "                         tie_word_embeddings: --tie lm_head.weight=\n"
    "                         model.embed_tokens.weight): a module naming NAME is\n"
    "                         fused into KEY (repeatable)\n"
    LK_CLI_ALPHA_FROM_HELP
    LK_CLI_CONVENTION_HELP
    "  --allow-unmatched      skip adapter modules that match no model weight\n"
    "                         (one warning with the count) instead of failing\n"
    "  --allow-nonfinite      keep Inf/NaN values created by fusion instead of\n"
    "                         failing\n"
    LK_CLI_FP8_HELP
    "  --json                 print one JSON object: {base, out, adapters:\n"
    "                         [{path, strength}], tensors_total, tensors_fused,\n"
    "                         modules_unmatched, convention, seconds}\n"
    "  -h, --help             this text\n";

typedef struct bar {
    int last; /* last drawn permille, -1 before the first */
} bar;

static void draw_bar(void *ctx, uint64_t done, uint64_t total, size_t td, size_t tt) {
    bar *b = ctx;
    int pm = total ? (int)(done * 1000 / total) : 1000;
    if (pm == b->last && td != tt) return;
    b->last = pm;
    char cells[41];
    int fill = pm * 40 / 1000;
    for (int i = 0; i < 40; i++) cells[i] = i < fill ? '#' : '.';
    cells[40] = '\0';
    fprintf(stderr, "\rfusing [%s] %3d%% %zu/%zu tensors", cells, pm / 10, td, tt);
    if (td == tt) fputc('\n', stderr);
    fflush(stderr);
}

/* Does the text after the last ':' of -l ADAPTER:STRENGTH look like a
 * strength (so that it must parse as one)? Empty, or, after a sign, a digit,
 * a '.', or an Inf/NaN word; never with a '/' (a folder name such as
 * "run:1/adapter" is a path). */
static int looks_like_strength(const char *t) {
    if (strchr(t, '/')) return 0;
    if (*t == '+' || *t == '-') t++;
    return !*t || (*t >= '0' && *t <= '9') || *t == '.' || !strncasecmp(t, "inf", 3) || !strncasecmp(t, "nan", 3);
}

/* "path[:strength]": the strength is what follows the last ':' when that
 * looks like a number, and then it must be one (finite, all of it:
 * lk_fuse_strength_parse), unless the whole argument names an existing file
 * or folder ("a:2024.safetensors"); otherwise the whole argument is the
 * path. Returns 0 with a usage error printed when it is not usable. */
static int parse_lora(char *arg, lk_fuse_input *in) {
    in->path = arg;
    in->strength = 1.0;
    char *c = strrchr(arg, ':');
    struct stat sb;
    if (c && c != arg && !strncmp(c + 1, "alpha=", 6) && stat(arg, &sb) != 0) { /* ...:alpha=A, last */
        if (lk_fuse_strength_parse(c + 7, &in->alpha) != LK_OK) {
            lk_cli_usage("fuse", "-l '%s': alpha: %s", arg, lk_last_error());
            return 0;
        }
        in->has_alpha = 1;
        *c = '\0';
        c = strrchr(arg, ':');
    }
    if (c && c != arg && looks_like_strength(c + 1)) {
        double v;
        if (lk_fuse_strength_parse(c + 1, &v) == LK_OK) {
            *c = '\0';
            in->strength = v;
        } else if (stat(arg, &sb) != 0) {
            lk_cli_usage("fuse", "-l '%s': %s", arg, lk_last_error());
            return 0;
        }
    }
    if (!in->path[0]) {
        lk_cli_usage("fuse", "empty adapter path in '%s'", arg);
        return 0;
    }
    return 1;
}

int lk_cmd_fuse(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        fputs(FUSE_USAGE, stdout);
        return LK_EXIT_OK;
    }
    const char *base = NULL, *out = NULL;
    int json = 0;
    lk_adapter_format fmt = LK_FORMAT_AUTO;
    lk_fuse_file_opts opts = {0};
    int f8;
    lk_fuse_input *in = calloc((size_t)argc, sizeof *in);
    const char **maps = calloc((size_t)argc, sizeof *maps);
    char **tied = calloc(2 * (size_t)argc, sizeof *tied); /* NAME, KEY: one strdup of NAME=KEY, split at '=' */
    opts.maps = maps;
    opts.tied = (const char *const *)tied;
    size_t n = 0;
    int rc = LK_EXIT_USAGE;
    if (!in || !maps || !tied) {
        free(in);
        free(maps);
        free(tied);
        fprintf(stderr, "lorakit: out of memory\n");
        return LK_EXIT_FAIL;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has_val = i + 1 < argc;
        if (!strcmp(a, "-l") || !strcmp(a, "--lora")) {
            if (!has_val) {
                lk_cli_usage("fuse", "%s needs ADAPTER[:STRENGTH]", a);
                goto done;
            }
            if (!parse_lora(argv[++i], &in[n])) goto done;
            n++;
        } else if (!strcmp(a, "-o") || !strcmp(a, "--out")) {
            if (!has_val) {
                lk_cli_usage("fuse", "%s needs a path", a);
                goto done;
            }
            out = argv[++i];
        } else if (!strcmp(a, "--threads")) {
            long t;
            if (!has_val || !lk_cli_parse_int(argv[i + 1], &t) || !lk_knob_in_range(LK_KNOB_THREADS, (double)t)) {
                lk_cli_usage("fuse", "--threads needs a number from %d to %d", LK_KNOB_THREADS_MIN, LK_KNOB_THREADS_MAX);
                goto done;
            }
            opts.fuse.threads = (int)t;
            i++;
        } else if (!strcmp(a, "--format")) {
            if (!has_val) {
                lk_cli_usage("fuse", "--format needs a value");
                goto done;
            }
            if (lk_adapter_format_parse(argv[++i], &fmt) != LK_OK) {
                lk_cli_usage("fuse", "%s", lk_last_error());
                goto done;
            }
        } else if (!strcmp(a, "--arch")) {
            if (!has_val) {
                lk_cli_usage("fuse", "--arch needs a family name");
                goto done;
            }
            opts.arch = argv[++i];
        } else if (!strcmp(a, "--map")) {
            if (!has_val) {
                lk_cli_usage("fuse", "--map needs a table file");
                goto done;
            }
            maps[opts.n_maps++] = argv[++i];
        } else if (!strcmp(a, "--tie")) {
            const char *eq = has_val ? strchr(argv[i + 1], '=') : NULL;
            if (!eq || eq == argv[i + 1] || !eq[1]) {
                lk_cli_usage("fuse", "--tie needs NAME=KEY (a tied name and the base's tensor it stands for), got %s",
                             has_val ? argv[i + 1] : "nothing");
                goto done;
            }
            char *d = strdup(argv[++i]);
            if (!d) {
                fprintf(stderr, "lorakit: out of memory\n");
                rc = LK_EXIT_FAIL;
                goto done;
            }
            d[eq - argv[i]] = '\0';
            tied[2 * opts.n_tied] = d;
            tied[2 * opts.n_tied++ + 1] = d + (eq - argv[i]) + 1;
        } else if (!strcmp(a, "--alpha-from")) {
            if (!has_val) {
                lk_cli_usage("fuse", "--alpha-from needs tensors or metadata");
                goto done;
            }
            if (lk_alpha_from_parse(argv[++i], &opts.alpha_from) != LK_OK) {
                lk_cli_usage("fuse", "%s", lk_last_error());
                goto done;
            }
        } else if (!strcmp(a, "--convention")) {
            if (!has_val || lk_convention_parse(argv[++i], &opts.fuse.convention) != LK_OK) {
                lk_cli_usage("fuse", "%s", has_val ? lk_last_error() : "--convention needs lorakit, comfyui, lycoris or peft");
                goto done;
            }
        } else if (!strcmp(a, "--allow-unmatched")) {
            opts.allow_unmatched = 1;
        } else if (!strcmp(a, "--allow-nonfinite")) {
            opts.fuse.allow_nonfinite = 1;
        } else if (!strcmp(a, "--json")) {
            json = 1;
        } else if ((f8 = lk_cli_fp8_option("fuse", argc, argv, &i, &opts.fuse.fp8)) != 0 ||
                   (f8 = lk_cli_device_option("fuse", argc, argv, &i, &opts.device)) != 0) {
            if (f8 < 0) goto done;
        } else if (a[0] == '-' && a[1]) {
            lk_cli_usage("fuse", "unknown option '%s'", a);
            goto done;
        } else if (base) {
            lk_cli_usage("fuse", "one BASE expected, got '%s' and '%s'", base, a);
            goto done;
        } else {
            base = a;
        }
    }
    if (!base) {
        lk_cli_usage("fuse", "missing BASE");
        goto done;
    }
    if (!n) {
        lk_cli_usage("fuse", "at least one -l ADAPTER[:STRENGTH] is needed");
        goto done;
    }
    if (!out) {
        lk_cli_usage("fuse", "missing -o OUT");
        goto done;
    }
    for (size_t i = 0; i < n; i++) in[i].format = fmt;
    bar b = {-1};
    if (isatty(STDERR_FILENO)) {
        opts.on_progress = draw_bar;
        opts.progress_ctx = &b;
    }
    lk_fuse_stats st;
    if (lk_fuse_file(base, in, n, out, &opts, &st) != LK_OK) {
        if (b.last >= 0) fputc('\n', stderr);
        rc = lk_cli_fail();
        goto done;
    }
    if (json) {
        char *s = lk_fuse_summary_json(base, out, in, n, &st);
        if (!s) { /* OUT is written; only the summary is missing: say so, not exit 0 with no output */
            lk_error(LK_ERR_NOMEM, "%s written, but the --json summary cannot be built (out of memory, or a path "
                     "that is not UTF-8)", out);
            rc = lk_cli_fail();
            goto done;
        }
        printf("%s\n", s);
        lk_free(s);
    } else {
        char dv[LK_DEVICE_STR_MAX];
        printf("fused %zu adapter%s into %zu of %zu tensors -> %s (%.2f s)", n, n == 1 ? "" : "s", st.tensors_fused,
               st.tensors_total, out, st.seconds);
        if (opts.device.kind != LK_DEVICE_CPU)
            printf(" on %s: %zu by the device kernel, %zu on the host path", lk_device_str(opts.device, dv),
                   st.keys_device, st.keys_host_fallback);
        putchar('\n');
    }
    rc = LK_EXIT_OK;
done:
    free(in);
    free(maps);
    for (size_t t = 0; t < opts.n_tied; t++) free(tied[2 * t]);
    free(tied);
    return rc;
}
