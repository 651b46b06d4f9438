/* cmd_convert.c — `lorakit convert IN -o OUT --format kohya|peft|diffusers`:
 * a front-end over lk_convert. */
#include <stdio.h>
#include <string.h>

#include "algebra_cli.h"
#include "cli.h"

static const char *const CONVERT_USAGE =
    "usage: lorakit convert IN -o OUT --format kohya|peft|diffusers|comfyui [--base CKPT] [--json]\n"
    "       [--report R.json]\n\n"
    "Writes the same LoRA in another format's naming and alpha convention. The\n"
    "factors' bytes are copied as they are and each module's scale is carried as\n"
    "an alpha the target reads back exactly (kohya: an F32 .alpha per module;\n"
    "PEFT: lora_alpha, alpha_pattern, rank_pattern, use_rslora kept; diffusers:\n"
    "lora_adapter_metadata), so `lorakit fuse BASE -l OUT` gives the bytes of\n"
    "`lorakit fuse BASE -l IN`. What a target cannot carry exactly is refused by\n"
    "name, never folded into the factors: an alpha that is no F32 value (kohya),\n"
    "kohya underscore names as PEFT or diffusers names without --base (where the\n"
    "dots go is the model's), a module on rows of a fused weight (with --base),\n"
    "LoHa / LoKr / Tucker (resize gives their exact low-rank form), DoRA, biases,\n"
    "modules_to_save. comfyui: the names ComfyUI's loader reads natively\n"
    "(diffusion_model.<key>.lora_A/.lora_B.weight + an F32 .alpha; kohya names and\n"
    "text_encoder.* kept).\n\n"
    "options:\n"
    "  -o, --out OUT          a .safetensors file, or a folder for PEFT\n"
    "  --format F             kohya, peft, diffusers or comfyui (default: the input's)\n"
    "  --base CKPT            resolve the module names against CKPT (as fuse does) and\n"
    "                         write each under the model key it lands on\n"
    "  --report FILE.json     write the report (JSON) to FILE.json\n"
    "  --json                 print the report on stdout\n"
    "  -h, --help             this text\n";

int lk_cmd_convert(int argc, char **argv) {
    if (lk_cli_wants_help(argc, argv)) {
        fputs(CONVERT_USAGE, stdout);
        return LK_EXIT_OK;
    }
    lk_alg_cli c = {0};
    const char *in = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int r = 0;
        if (!strcmp(a, "-o") || !strcmp(a, "--out") || !strcmp(a, "--format") || !strcmp(a, "--json") ||
            !strcmp(a, "--report"))
            r = lk_alg_cli_option("convert", argc, argv, &i, &c);
        if (!strcmp(a, "--base")) {
            if (i + 1 >= argc) return lk_cli_usage("convert", "--base needs a checkpoint");
            c.o.base = argv[++i];
            continue;
        }
        if (r < 0) return LK_EXIT_USAGE;
        if (r > 0) continue;
        if (a[0] == '-' && a[1]) return lk_cli_usage("convert", "unknown option '%s'", a);
        if (in) return lk_cli_usage("convert", "one IN expected, got '%s' and '%s'", in, a);
        in = a;
    }
    if (!in) return lk_cli_usage("convert", "missing IN");
    if (!c.out) return lk_cli_usage("convert", "missing -o OUT");
    char *report = NULL;
    lk_status s = lk_convert(in, c.out, &c.o, &report);
    return lk_alg_cli_finish(&c, s, report);
}
