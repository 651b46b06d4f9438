/* fuzz_plan.c — libFuzzer target: the `lorakit swap` plan parser
 * (include/lorakit/plan.h).
 *
 * The input is the plan's YAML text, parsed from memory (not NUL-terminated)
 * with a base directory, and through lk_plan_load from a scratch file, which
 * must agree with the in-memory parse given the file's directory. An
 * accepted plan obeys plan.h: within the size limits, bucket_mb 0 (unset) or
 * positive, every adapter with a non-empty path that is absolute or under
 * the base directory, a finite strength and a valid format, every step with
 * a line number. A refusal is a clean error.
 *
 * The plan parser walks the tree of the YAML front-end (src/io/yaml_doc.h,
 * fuzzed on its own by fuzz_yaml). The file path runs only for accepted
 * plans and one input in eight, so the parser itself gets the throughput. */
#include <math.h>

#include "fuzz_common.h"

static void fz_plan_check(const lk_plan *p, const char *base) {
    FZ_CHECK(p->n_steps <= LK_PLAN_MAX_ENTRIES);
    FZ_CHECK(p->bucket_mb >= 0 && p->bucket_mb <= LK_KNOB_SWAP_BUCKET_MB_MAX);
    FZ_CHECK(p->no_lora_swap == 0 || p->no_lora_swap == 1);
    FZ_CHECK(p->n_steps == 0 || p->steps != NULL);
    size_t total = 0, blen = strlen(base);
    for (size_t i = 0; i < p->n_steps; i++) {
        const lk_plan_step *s = &p->steps[i];
        FZ_CHECK(s->line >= 1);
        FZ_CHECK(s->n == 0 || s->loras != NULL);
        total += s->n;
        for (size_t j = 0; j < s->n; j++) {
            const lk_fuse_input *in = &s->loras[j];
            FZ_CHECK(in->path != NULL && in->path[0] != '\0');
            fz_touch(in->path, strlen(in->path));
            FZ_CHECK(in->path[0] == '/' || (!strncmp(in->path, base, blen) && in->path[blen] == '/'));
            FZ_CHECK(isfinite(in->strength));
            FZ_CHECK((int)in->format >= LK_FORMAT_AUTO && in->format < LK_FORMAT_COUNT);
        }
    }
    FZ_CHECK(total <= LK_PLAN_MAX_ENTRIES);
    FZ_CHECK(p->arch == NULL || p->arch[0] != '\0'); /* arch / maps: unset, or non-empty names */
    FZ_CHECK(p->n_maps == 0 || p->maps != NULL);
    for (size_t i = 0; i < p->n_maps; i++) {
        FZ_CHECK(p->maps[i] != NULL && p->maps[i][0] != '\0');
        fz_touch(p->maps[i], strlen(p->maps[i]));
        FZ_CHECK(p->maps[i][0] == '/' || (!strncmp(p->maps[i], base, blen) && p->maps[i][blen] == '/'));
    }
}

static void fz_plan(const uint8_t *data, size_t size) {
    lk_plan *p = NULL;
    lk_status s = lk_plan_parse((const char *)data, size, "fuzz.yaml", "base", &p);
    if (s != LK_OK) {
        fz_clean_error(s);
        FZ_CHECK(p == NULL);
    } else {
        fz_plan_check(p, "base");
    }

    if (s != LK_OK && (size & 7) != 0) {
        lk_plan_free(p);
        return;
    }
    const char *path = fz_write_tmp("plan.yaml", data, size);
    lk_plan *q = NULL;
    lk_status s2 = lk_plan_load(path, &q);
    if (s2 != LK_OK) {
        fz_clean_error(s2);
        FZ_CHECK(q == NULL);
    } else {
        fz_plan_check(q, fz_tmpdir());
    }
    if (s != LK_ERR_NOMEM && s2 != LK_ERR_NOMEM) {
        FZ_CHECK((s == LK_OK) == (s2 == LK_OK));
        if (s == LK_OK) {
            FZ_CHECK(p->n_steps == q->n_steps && p->bucket_mb == q->bucket_mb &&
                     p->no_lora_swap == q->no_lora_swap);
            for (size_t i = 0; i < p->n_steps; i++) {
                FZ_CHECK(p->steps[i].n == q->steps[i].n);
                for (size_t j = 0; j < p->steps[i].n; j++)
                    FZ_CHECK(p->steps[i].loras[j].strength == q->steps[i].loras[j].strength);
            }
        }
    }
    lk_plan_free(p);
    lk_plan_free(q);
}

LK_FUZZ_MAIN(fz_plan)
