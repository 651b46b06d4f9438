/* lorakit/algebra.h — adapter algebra: merge, resize and convert LoRA
 * adapters, with the exact error of the file written.
 *
 * Every low-rank module (LoRA, conv LoRA, Tucker, LoHa, LoKr) is taken in
 * exact low-rank form U V; a module's terms are stacked, both sides are QR
 * factored and the small R x R core is decomposed by Jacobi SVD, all in
 * f64: the thin SVD of the exact delta in O((out + in) R^2), never a dense
 * out x in matrix. Truncation is then the Eckart-Young optimum. The
 * report's rel_fro is ||X - Y||_F / ||X||_F with X the exact delta and Y
 * the delta of the file as written (its dtype and alpha included), computed
 * in f64 from small factor products. README "Adapter algebra" has the
 * mathematics. */
#ifndef LORAKIT_ALGEBRA_H
#define LORAKIT_ALGEBRA_H

#include <stddef.h>
#include <stdint.h>
#include "lorakit/adapter.h"
#include "lorakit/dtype.h"
#include "lorakit/status.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Output naming and alpha convention. */
typedef enum lk_algebra_format {
    LK_ALG_FORMAT_AUTO = 0, /* the first input's (PEFT, kohya or diffusers) */
    LK_ALG_FORMAT_KOHYA,    /* lora_unet_<m_>.lora_down/.lora_up/.alpha (F32), ss_network_dim/alpha */
    LK_ALG_FORMAT_PEFT,     /* OUT a folder: adapter_model.safetensors + adapter_config.json */
    LK_ALG_FORMAT_DIFFUSERS,/* <m>.lora_A/.lora_B.weight + lora_adapter_metadata */
    LK_ALG_FORMAT_COMFYUI,  /* diffusion_model.<m>.lora_A/.lora_B.weight + <m>.alpha (F32); kohya names kept */
    LK_ALG_FORMAT_COUNT
} lk_algebra_format;

/* "auto", "kohya", "peft", "diffusers", "comfyui". */
const char *lk_algebra_format_name(lk_algebra_format f);
/* Parses a name as above; LK_ERR_ARG naming the valid ones. */
lk_status lk_algebra_format_parse(const char *name, lk_algebra_format *out);

/* Options of merge / resize; all zero: exact (ranks concatenated), the
 * first input's format, the widest input dtype, all cores. */
typedef struct lk_algebra_opts {
    lk_algebra_format format;
    lk_dtype dtype;      /* F32, F16 or BF16; INVALID: the widest of the inputs' factors */
    int rank;            /* > 0: keep at most this many singular values per module */
    double err;          /* > 0: the least rank with relative Frobenius error <= err */
    double fro;          /* > 0: the least rank keeping a fraction >= fro of ||delta||_F */
    double ratio;        /* > 0: keep singular values >= ratio x the largest */
    int max_rank;        /* > 0: cap for err / fro / ratio */
    int conv_rank;       /* > 0: the rank cap for conv modules (kernel > 1x1) instead of rank */
    int threads;         /* 0: all cores; modules are split between threads, the bytes do not depend on it */
    lk_adapter_opts read;/* how the inputs are read */
    /* progress: called after each module, from any thread, serialised */
    void (*on_progress)(void *ctx, size_t done, size_t total);
    void *progress_ctx;
    /* convert: a checkpoint (file, index or folder) the input's module names
     * are resolved against, as lk_fuse resolves them; each is then written
     * under the model key it lands on (kohya names to PEFT / diffusers /
     * ComfyUI names). NULL: names are translated by their spelling alone. */
    const char *base;
} lk_algebra_opts;

typedef struct lk_algebra_input {
    const char *path;
    double strength;
} lk_algebra_input;

/* merge: the adapter whose delta is sum_i strength_i scale_i B_i A_i over
 * the union of modules (matched by name), written to out (a file, or a
 * folder for PEFT). *report (may be NULL) gets the report as JSON text
 * (lk_free): {"operation", "inputs": [{path, strength, digest}], "output",
 * "format", "dtype", "alpha", "options", "rel_fro", "rel_fro_opt",
 * "rel_spec", "modules": [{name, rank, rel_fro, rel_fro_opt, rel_spec}]}.
 * The bytes written do not depend on the order of in[], the thread count
 * or the CPU. Nothing is written on failure. */
lk_status lk_merge(const lk_algebra_input *in, size_t n, const char *out, const lk_algebra_opts *o, char **report);
/* resize: merge of one input at strength 1. */
lk_status lk_resize(const char *in, const char *out, const lk_algebra_opts *o, char **report);

/* convert: the same LoRA in format o->format (AUTO: the input's), factor
 * bytes copied as they are, each module's scale carried as an alpha the
 * target reads back exactly (kohya F32 .alpha, PEFT / diffusers alpha_pattern;
 * rsLoRA kept in PEFT), so lk_fuse of the output gives the input's bytes.
 * What the target cannot carry exactly (an alpha that is no F32 value for
 * kohya, a kohya name for PEFT / diffusers, LoHa / LoKr / Tucker / DoRA /
 * biases / modules_to_save) is refused by name. o's rank options are
 * ignored. *report as lk_merge's (rel_fro 0: nothing is rounded). */
lk_status lk_convert(const char *in, const char *out, const lk_algebra_opts *o, char **report);

/* Options of extract. */
typedef struct lk_extract_opts {
    lk_algebra_opts alg;    /* rank, err (with max_rank), conv_rank, format, dtype, threads, progress */
    uint64_t seed;          /* the test matrix: the counter-based stream (seed, weight name) */
    int oversample;         /* extra sketch columns beyond the rank (0: 8); the block size of --err */
    int power;              /* subspace (power) iterations (-1: 0 ... default 2, see lk_extract) */
    int exact_svd;          /* the exact f64 SVD of every delta instead (slow; small weights, checks) */
    const char *const *include; /* regexes (PCRE2, searched) on weight names: only matching weights */
    size_t n_include;
    const char *const *exclude; /* regexes: weights matching any are not extracted (listed) */
    size_t n_exclude;
} lk_extract_opts;

/* extract: a LoRA of TUNED - BASE (two safetensors checkpoints, single or
 * sharded), one module per changed 2-D or 4-D float weight "<m>.weight"
 * (conv kernels as their [out, in kh kw] unfolding), streamed one weight
 * (per thread) at a time, never a whole model in memory. Each delta D is
 * sketched by randomized subspace iteration (Halko-Martinsson-Tropp):
 * Y = D Omega with Omega uniform from (seed, name), QR after every product,
 * power iterations alternating D^T and D, then the exact f64 SVD of the
 * small Q^T D; with alg.err a blocked adaptive range finder grows Q until
 * the exact residual ||D||^2 - ||Q^T D||^2 meets err. o->power < 0 gives the
 * default (2), 0 none. The report (as lk_merge's, "operation": "extract")
 * has per module rel_fro of the file as written (exact in f64: ||D||^2 -
 * 2 c <D, B A> + c^2 ||B A||^2), rel_fro_opt a proven lower bound of the
 * optimum at that rank (exact with exact_svd; "rel_fro_opt_kind" says
 * which), rel_fro_opt_upper, and the weights unchanged, excluded, not
 * extractable (with the reason) or present in one file only. A shape or
 * dtype mismatch is an error naming the weight and both shapes; nothing is
 * written on failure. The bytes do not depend on the thread count. */
lk_status lk_extract(const char *base, const char *tuned, const char *out, const lk_extract_opts *o, char **report);

#ifdef __cplusplus
}
#endif
#endif
