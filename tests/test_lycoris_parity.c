/* test_lycoris_parity.c — adapters written by the real `lycoris-lora` 4.1.3
 * and `peft` 0.21 on a tiny diffusers UNet (linear, 1x1 and 3x3 convs,
 * norms) fuse exactly as LyCORIS's forward pass (and PEFT's merge) apply
 * them; the algorithms lorakit does not fuse are refused by name; malformed
 * factor shapes are refused naming the key.
 *
 * Oracle: tests/fixtures/lycoris/, made by make_lycoris_fixtures.py. Each
 * expectation is the float64 fused tensor computed by LyCORIS's own module
 * code as its forward() applies the file (PEFT: merge_and_unload), from the
 * file's tensors on a float64 copy of the rounded base, and cross-checked by
 * the script against the published formulas recomputed in numpy from the
 * file alone (agreement to 1e-12 relative). Strength s multiplies the delta
 * (LyCORIS's multiplier); for DoRA and set_weight at s != 1 the expectation
 * is lorakit's documented W + s (W_dora - W) (LyCORIS's forward gives
 * V + s (W_dora - V) with V = W + c delta). The manifest is
 * fixtures/lycoris/cases.h.
 *
 * Checks, per case x base (BF16, F16, F32, and FP8 for LoCon/LoKr):
 *  - every tensor the adapter changes within 1 ulp of its dtype of the
 *    float64 expectation (the canonical arithmetic: one rounding of
 *    W + s c delta, the delta's chain at the accumulator's precision). FP8
 *    weights (base_fp8: plain, per-tensor and per-channel weight_scale) are
 *    decoded as code x the output's scale and must be within 1 FP8 ulp at
 *    that scale (README's FP8 rule: correctly rounded for the fp32 delta, so
 *    1 ulp of the exact value), and the rescaled scale must be LTX-2's
 *    formula on the expectation's amax (to a relative 1e-6: lorakit takes the
 *    amax of its own fused values);
 *  - every other tensor byte-identical to the base;
 *  - lk_fuse_tensors (in place, one thread) gives the same digest as the
 *    file fuse (all threads);
 *  - refusals (IA3, OFT, BOFT, GLoRA) and malformed shapes: the fuse fails,
 *    writes no output, and the message contains the algorithm (or the
 *    factor's key) as a word outside the adapter's path, names the module
 *    (kohya or diffusers name), and for a malformed factor gives its shape
 *    as the file has it (the issue asks for both shapes; the other one, the
 *    weight's or the product's, depends on how the check is phrased, so only
 *    this one is required).
 *
 * Cases whose algorithm lorakit does not fuse yet are listed in lk_not_yet[]
 * and SKIPPED with the reason; remove an entry when its algorithm lands
 * (an entry is a case name, or name@base for one base: "lokr_conv@fp8").
 * LK_TEST_NOT_YET=1 in the environment runs them all. */
#include "adapter_ref.h"

#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lorakit/dtype.h"
#include "lorakit/fuse.h"
#include "lorakit/safetensors.h"

#define FX LK_TEST_SRC_DIR "/tests/fixtures/lycoris"

#include "fixtures/lycoris/cases.h"

/* Not fused (or not refused by name) yet: skipped with the reason. The
 * implementer of issue 18 removes entries as the algorithms land. */
static const struct {
    const char *what;
    const char *why;
} lk_not_yet[] = {
    /* every case runs since issue 18 landed; the list ends at the NULL entry */
    {NULL, NULL},
};

#define NCASES (sizeof lyco_cases / sizeof lyco_cases[0])

#define g_dir ar_dir /* the group's temporary folder (ar_setup_dir) */

/* "bf16" from "base_bf16.safetensors". */
static void base_tag(const lyco_case *c, char *tag, size_t n) {
    const char *p = c->base + strlen("base_");
    size_t len = strcspn(p, ".");
    snprintf(tag, n, "%.*s", (int)len, p);
}

static const char *not_yet(const lyco_case *c) {
    if (getenv("LK_TEST_NOT_YET")) return NULL; /* run the not-yet cases too (to see which pass) */
    char tag[16], full[128];
    base_tag(c, tag, sizeof tag);
    snprintf(full, sizeof full, "%s@%s", c->name, tag);
    for (size_t i = 0; lk_not_yet[i].what; i++)
        if (!strcmp(lk_not_yet[i].what, c->name) || !strcmp(lk_not_yet[i].what, full)) return lk_not_yet[i].why;
    return NULL;
}

static void run_fuse(const lyco_case *c) {
    char base[512], adapter[512], out[512], exp[512];
    snprintf(base, sizeof base, FX "/%s", c->base);
    snprintf(adapter, sizeof adapter, FX "/%s", c->adapter);
    snprintf(out, sizeof out, "%s/out.safetensors", g_dir);
    snprintf(exp, sizeof exp, FX "/%s", c->expected);
    lk_fuse_input in = {adapter, c->strength, LK_FORMAT_AUTO};
    lk_fuse_stats st;
    if (lk_fuse_file(base, &in, 1, out, NULL, &st))
        fail_msg("%s (%s) on %s s=%g: %s", c->name, c->algo, c->base, c->strength, lk_last_error());
    char label[256];
    snprintf(label, sizeof label, "%s (%s) on %s s=%g", c->name, c->algo, c->base, c->strength);
    size_t changed;
    double worst = ar_check_expected(label, "LyCORIS's forward", base, out, exp, &changed);
    assert_int_equal(st.tensors_fused, changed);
    /* The in-place form (lk_fuse_tensors, one thread) gives the same bytes
     * as the file fuse (all threads). */
    lk_fuse_file_opts one = {.fuse = {.threads = 1}};
    lk_fuse_stats ts;
    ar_check_in_place(label, base, out, &in, 1, &one, &ts);
    assert_int_equal(ts.tensors_fused, changed);
    print_message("%-14s %-22s s=%-4g %2zu tensors, worst %.3f ulp\n", c->name, c->base, c->strength,
                  changed, worst);
    remove(out);
}

static int word_char(int ch) { return isalnum(ch) || ch == '_'; }

/* needle occurs in hay as a whole word (case-insensitive), outside any
 * occurrence of the path skip (the adapter's own file name must not count:
 * "ia3.safetensors" does not name IA3). */
static int names_word(const char *hay, const char *needle, const char *skip) {
    size_t n = strlen(needle), ns = strlen(skip);
    for (const char *h = hay; *h; h++) {
        if (ns && !strncmp(h, skip, ns)) {
            h += ns - 1;
            continue;
        }
        size_t k = 0;
        while (k < n && h[k] && tolower((unsigned char)h[k]) == tolower((unsigned char)needle[k])) k++;
        if (k == n && (h == hay || !word_char((unsigned char)h[-1])) && !word_char((unsigned char)h[n])) return 1;
    }
    return 0;
}

static void run_refusal(const lyco_case *c) {
    char base[512], adapter[512], out[512], kohya[512];
    snprintf(base, sizeof base, FX "/%s", c->base);
    snprintf(adapter, sizeof adapter, FX "/%s", c->adapter);
    snprintf(out, sizeof out, "%s/refused.safetensors", g_dir);
    lk_fuse_input in = {adapter, c->strength, LK_FORMAT_AUTO};
    lk_status s = lk_fuse_file(base, &in, 1, out, NULL, NULL);
    if (s == LK_OK) fail_msg("%s: fused, but %s must be refused", c->name, c->word);
    const char *msg = lk_last_error();
    assert_false(tu_exists(out));
    if (!names_word(msg, c->word, adapter))
        fail_msg("%s: the error does not name %s: \"%s\"", c->name, c->word, msg);
    snprintf(kohya, sizeof kohya, "lora_unet_%s", c->module);
    for (char *p = kohya; *p; p++)
        if (*p == '.') *p = '_';
    if (!strstr(msg, c->module) && !strstr(msg, kohya))
        fail_msg("%s: the error names neither %s nor %s: \"%s\"", c->name, c->module, kohya, msg);
    if (c->shape) { /* "4x2", or "[4, 2]" / "(4, 2)" */
        char list[64];
        size_t k = 0;
        for (const char *p = c->shape; *p && k + 3 < sizeof list; p++) {
            if (*p == 'x') {
                list[k++] = ',';
                list[k++] = ' ';
            } else list[k++] = *p;
        }
        list[k] = 0;
        char br[80], pa[80];
        snprintf(br, sizeof br, "[%s]", list);
        snprintf(pa, sizeof pa, "(%s)", list);
        if (!strstr(msg, c->shape) && !strstr(msg, br) && !strstr(msg, pa))
            fail_msg("%s: the error does not give the shape of %s (%s): \"%s\"", c->name, c->word, c->shape, msg);
    }
    print_message("%-14s refused: %s\n", c->name, msg);
}

static void test_case(void **state) {
    const lyco_case *c = *state;
    const char *why = not_yet(c);
    if (why) {
        print_message("%-14s %-22s SKIPPED (not yet): %s\n", c->name, c->base, why);
        skip();
    }
    if (c->kind == LYCO_FUSE) run_fuse(c);
    else run_refusal(c);
}

/* Every lk_not_yet entry names a case of the manifest (a stale entry would
 * skip nothing and hide a typo). */
static void test_not_yet_entries(void **state) {
    (void)state;
    for (size_t i = 0; lk_not_yet[i].what; i++) {
        int found = 0;
        for (size_t k = 0; k < NCASES && !found; k++) {
            char tag[16], full[128];
            base_tag(&lyco_cases[k], tag, sizeof tag);
            snprintf(full, sizeof full, "%s@%s", lyco_cases[k].name, tag);
            found = !strcmp(lk_not_yet[i].what, lyco_cases[k].name) || !strcmp(lk_not_yet[i].what, full);
        }
        if (!found) fail_msg("lk_not_yet[%zu] \"%s\" names no case of fixtures/lycoris/cases.h", i, lk_not_yet[i].what);
    }
}

int main(void) {
    static struct CMUnitTest tests[NCASES + 1];
    static char names[NCASES][160];
    size_t n = 0;
    tests[n++] = (struct CMUnitTest)cmocka_unit_test(test_not_yet_entries);
    for (size_t i = 0; i < NCASES; i++) {
        const lyco_case *c = &lyco_cases[i];
        char tag[16];
        base_tag(c, tag, sizeof tag);
        snprintf(names[i], sizeof names[i], "%s %s s=%g", c->name, tag, c->strength);
        tests[n++] = (struct CMUnitTest){names[i], test_case, NULL, NULL, (void *)c};
    }
    return _cmocka_run_group_tests("test_lycoris_parity", tests, n, ar_setup_dir, ar_teardown_dir);
}
