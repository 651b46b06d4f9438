/* algebra/algebra_int.h — what the algebra layer's files share (internal). */
#ifndef LK_ALGEBRA_INT_H
#define LK_ALGEBRA_INT_H

#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "lorakit/adapter.h"
#include "lorakit/algebra.h"

/* 1 when module m has an exact low-rank form (lowrank.c); else 0 with *why
 * the reason (a phrase after the module's name). */
int lk_alg_lowrank_supported(const lk_lora_module *m, const char **why);
/* The rank of m's low-rank form (LoHa r1 r2, LoKr p1 p2). */
size_t lk_alg_lowrank_rank(const lk_lora_module *m);
/* m's delta times coef as U (out x r panel at U) and V (r rows of N at V),
 * r = lk_alg_lowrank_rank(m). */
lk_status lk_alg_lowrank_put(const lk_lora_module *m, double coef, double *U, size_t out, double *V, size_t N);

/* One input term of an output module. */
typedef struct lk_alg_term {
    const lk_lora_module *m;
    double coef;   /* strength x the module's scale */
    size_t input;  /* its input's canonical index */
} lk_alg_term;

/* One output module: its terms, then (lk_alg_module_run) its factors as
 * written and its report. */
typedef struct lk_alg_module {
    const char *name;
    const char *stem;          /* the first term's key stem (its component prefix kept: diffusers names) */
    size_t out, N;
    int64_t tail[LK_MAX_DIMS]; /* the delta's dims after the first ([in, kh, kw] or [N]) */
    int ntail;
    int conv;                  /* a kernel of more than one element */
    lk_alg_term *terms;
    size_t n_terms;
    /* results */
    size_t rank;
    void *b_bytes, *a_bytes;   /* B [out, rank], A [rank, tail...] in the output dtype */
    double norm2, err2, opt2;  /* ||X||_F^2, ||X - Y||_F^2 (Y as written), the optimum's */
    double spec, err_spec;     /* ||X||_2, ||X - Y||_2 */
    int sweeps;
} lk_alg_module;

/* The truncation and output dtype every module of a run uses. */
typedef struct lk_alg_run {
    const lk_algebra_opts *o;
    lk_dtype dtype;
    double alpha;              /* the file's one alpha */
    int exact;                 /* no truncation: ranks concatenated */
} lk_alg_run;

/* Computes module x (thread-safe; touches only x). */
lk_status lk_alg_module_run(const lk_alg_run *run, lk_alg_module *x);
void lk_alg_module_free(lk_alg_module *x);

/* Rounds v once into dtype d (F32, F16, BF16) at dst[i]; returns the
 * rounded value, or an infinity when it overflows. */
double lk_alg_round_store(double v, lk_dtype d, void *dst, size_t i);

/* One input, opened. */
typedef struct lk_alg_input {
    const char *path;
    double strength;
    lk_adapter *a;     /* NULL for extract's checkpoints (path is then the file) */
    char digest[64];   /* tensors' digest [-config hash]: the canonical order */
} lk_alg_input;

/* A whole run. */
typedef struct lk_alg_ctx {
    const char *op, *out;
    const lk_algebra_opts *o;
    lk_alg_input *in;  /* canonical order */
    size_t n_in;
    lk_alg_module *mods; /* by name */
    size_t n_mods;
    lk_alg_run run;
    lk_algebra_format format; /* as written */
    double seconds;
    const char *options_extra; /* NULL, or a JSON object merged into "options" (record and report) */
} lk_alg_ctx;

/* Writes ctx's output (write.c): names, tensors, alpha and metadata in the
 * output format; nothing on failure. */
lk_status lk_alg_write(lk_alg_ctx *ctx);
/* Module m's name in format f (lk_malloc'd), or NULL with *err set (a
 * kohya underscore name in another format: LK_ERR_UNSUPPORTED). stem (may
 * be NULL): the key stem m was read from; diffusers keeps its component
 * prefix (unet., transformer.), which diffusers' loaders select by. */
char *lk_alg_out_name(lk_algebra_format f, const char *m, const char *stem, lk_status *err);
/* The factor keys after "<name>." in format f (kohya's lora_down / lora_up
 * for kohya and for kohya-named ComfyUI modules, else lora_A / lora_B) and
 * whether an F32 "<name>.alpha" tensor is written (kohya, ComfyUI). */
void lk_alg_key_names(lk_algebra_format f, const char *name, const char **down, const char **up, int *alpha);
/* The digest that orders an input (merge.c): its tensors' content digest
 * and its adapter_config.json's hash, "<hex>[-<hex16>]". */
lk_status lk_alg_input_digest(const lk_adapter *a, char *hex, size_t cap);
/* want, or for AUTO the format a's is written as. */
lk_algebra_format lk_alg_format_of(lk_algebra_format want, const lk_adapter *a);
/* A PEFT folder: put_st(ctx, path) writes its safetensors, then text is its
 * adapter_config.json; both or neither, no input replaced. */
lk_status lk_alg_write_peft_dir(const char *dir, lk_adapter *const *ins, size_t n_in, const char *text,
                                lk_status (*put_st)(const void *ctx, const char *path), const void *ctx);
/* Runs fn(ctx, i) for i in 0..n-1 over o->threads threads (0: all cores),
 * each item wholly on one thread; progress through o->on_progress; the
 * lowest failing item's error is returned (pool.c). */
lk_status lk_alg_pool(size_t n, const lk_algebra_opts *o, lk_status (*fn)(void *ctx, size_t i), void *ctx);
/* diffusers' lora_adapter_metadata from a LoraConfig dict whose module
 * names are the file's: packed per pipeline component ("unet.r",
 * "unet.target_modules" without the prefix, ...) when every name has one
 * (unet., transformer., text_encoder[_2|_3].), as diffusers' pipeline loaders
 * read it; else a copy (a model-level file). NULL without memory. */
json_t *lk_alg_diffusers_meta(const json_t *cfg);
/* The report as JSON text (lk_free). */
lk_status lk_alg_report(const lk_alg_ctx *ctx, char **json);

#endif
