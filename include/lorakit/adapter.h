/* lorakit/adapter.h — loading LoRA adapters in every common format.
 *
 * lk_adapter_open reads a file or PEFT folder, detects (or is told) the
 * format, reads adapter_config.json where there is one, and pairs lora_A /
 * lora_B per module with its rank, alpha and scale. lk_adapter_resolve then
 * maps every module onto a model weight key and checks shapes, so a fuse or a
 * swap is fully validated before anything is written. The factors are
 * copied into memory at open (read with pread, never through the mmap, so an
 * adapter file changed on disk later cannot crash the process) and stay
 * valid until lk_adapter_free. */
#ifndef LORAKIT_ADAPTER_H
#define LORAKIT_ADAPTER_H

#include <stddef.h>
#include "lorakit/status.h"
#include "lorakit/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum lk_adapter_format {
    LK_FORMAT_AUTO = 0,
    LK_FORMAT_PEFT,      /* base_model.model.<m>.lora_A.weight (+ adapter_config.json) */
    LK_FORMAT_DIFFUSERS, /* [transformer.|unet.|diffusion_model.]<m>.lora_A.weight, <m>.alpha */
    LK_FORMAT_KOHYA,     /* lora_unet_<m_>.lora_down.weight / lora_up / alpha */
    LK_FORMAT_FASTVIDEO, /* <m>.lora_A / <m>.lora_B (no .weight) */
    LK_FORMAT_COUNT
} lk_adapter_format;

/* "peft", "diffusers", "kohya", "fastvideo" ("auto" for AUTO). */
const char *lk_adapter_format_name(lk_adapter_format f);
/* Parses a name as above; returns LK_ERR_ARG naming the valid ones. */
lk_status lk_adapter_format_parse(const char *name, lk_adapter_format *out);

/* Where alpha comes from when a file (no adapter_config.json) holds more than
 * one source. The rules (README, "fuse"):
 *   AUTO      a module's `.alpha` tensor, else diffusers' lora_adapter_metadata,
 *             else r (as diffusers, ComfyUI and A1111 read kohya files: kohya's
 *             ss_network_alpha metadata is not used, and one warning names it
 *             and the ranks when it differs); a module with both an `.alpha`
 *             tensor and lora_adapter_metadata that disagree is LK_ERR_CONFIG
 *             naming both values (diffusers refuses such a file).
 *   TENSORS   the `.alpha` tensors, else r; the file's metadata is ignored.
 *   METADATA  lora_adapter_metadata, else ss_network_alpha, else the
 *             `.alpha` tensor, else r.
 * A PEFT adapter with an adapter_config.json always takes its config's. */
typedef enum lk_alpha_from {
    LK_ALPHA_AUTO = 0,
    LK_ALPHA_TENSORS,
    LK_ALPHA_METADATA,
    LK_ALPHA_COUNT
} lk_alpha_from;

/* "auto", "tensors", "metadata". */
const char *lk_alpha_from_name(lk_alpha_from a);
/* Parses a name as above; LK_ERR_ARG naming the value and the valid ones. */
lk_status lk_alpha_from_parse(const char *name, lk_alpha_from *out);

/* Whose rules decide what a file means where the tools disagree (DoRA's norm
 * and epsilon, set_weight at strength != 1, alpha 0, alpha in metadata,
 * OFT/BOFT strength and constraint; the README's conventions table lists
 * every point). LK_CONVENTION_LORAKIT (0) is lorakit's documented default;
 * the others reproduce ComfyUI's loader, LyCORIS's network forward and
 * PEFT's merge. Part of what the tracker's ranks agree on. */
typedef enum lk_convention {
    LK_CONVENTION_LORAKIT = 0,
    LK_CONVENTION_COMFYUI,
    LK_CONVENTION_LYCORIS,
    LK_CONVENTION_PEFT,
    LK_CONVENTION_COUNT
} lk_convention;

/* "lorakit", "comfyui", "lycoris", "peft". */
const char *lk_convention_name(lk_convention c);
/* Parses a name as above; LK_ERR_ARG naming the value and the valid ones. */
lk_status lk_convention_parse(const char *name, lk_convention *out);

/* How an adapter is read; all zero = auto-detected format, LK_ALPHA_AUTO,
 * lorakit's conventions, no alpha from the caller.
 * has_alpha = 1: alpha (finite) is the caller's alpha for every module
 * scaled by alpha / r that the file leaves at the default alpha = r (no
 * adapter_config.json, `.alpha` tensor or metadata alpha for it; a
 * FastVideo-legacy file, say): its alpha_source is then "caller". A module
 * whose file does give an alpha that differs is LK_ERR_CONFIG naming both
 * values (never silently one of them). */
typedef struct lk_adapter_opts {
    lk_adapter_format format;
    lk_alpha_from alpha_from;
    lk_convention convention;
    int has_alpha;
    double alpha;
} lk_adapter_opts;

/* The algorithm of an adapter module (LyCORIS names where LyCORIS has it). */
typedef enum lk_algo {
    LK_ALGO_LORA = 0, /* lora_A/lora_B, lora_down/lora_up: linear, conv (LoCon), Tucker (lora_mid) */
    LK_ALGO_LOHA,     /* hada_w1_a/_b, hada_w2_a/_b (+ hada_t1/_t2): (w1a w1b) * (w2a w2b) */
    LK_ALGO_LOKR,     /* lokr_w1 or lokr_w1_a/_b, lokr_w2 or lokr_w2_a/_b (+ lokr_t2): kron(w1, w2) */
    LK_ALGO_FULL,     /* diff (+ diff_b): a dense weight delta */
    LK_ALGO_NORM,     /* w_norm (+ b_norm): LyCORIS norm on a norm layer's weight and bias */
    LK_ALGO_SET,      /* set_weight: the weight replaced whole */
    LK_ALGO_OFT,      /* oft_blocks [n, b, b] (+ rescale): LyCORIS diag-oft, a rotation of the weight's rows */
    LK_ALGO_BOFT,     /* oft_blocks [m, n, b, b] (+ rescale): LyCORIS boft, m butterfly stages */
    LK_ALGO_GLORA,    /* a1.weight, a2.weight, b1.weight, b2.weight: W a1 a2 + b1 b2 (LyCORIS glora) */
    LK_ALGO_COUNT
} lk_algo;

/* "lora", "loha", "lokr", "full", "norm", "set_weight", "oft", "boft", "glora". */
const char *lk_algo_name(lk_algo a);

/* PEFT's OFT (peft_type "OFT", key <m>.oft_R.weight [n, b (b - 1) / 2]):
 * the OFTConfig fields its merge reads (README "PEFT's OFT files"). */
typedef struct lk_oft_peft {
    int coft;          /* project each block's Q to Frobenius norm <= eps' (eps' = eps / sqrt(n) in float32) */
    double eps;
    int neumann_terms; /* 0: the exact Cayley (I - Q)(I + Q)^-1; t >= 1: PEFT's truncated series of t terms */
    int boft;          /* 1: PEFT's BOFT (boft_R [1, n, b, b] + boft_s): the exact Cayley of 0.5 (X - X^T), rows x boft_s */
    int block_share;   /* 1: one block for all (oft_R.weight [1, ...]); 0: one per b columns; -1: not known (no config) */
} lk_oft_peft;

/* Tensors of a module, at most this many (lk_lora_module_tensors). */
#define LK_MODULE_MAX_TENSORS 16

typedef struct lk_lora_module {
    const char *module; /* module name as derived from the adapter's keys */
    const char *target; /* model weight key ("<m>.weight"); NULL until resolved
                           or when unmatched */
    int rank;
    double alpha;       /* as read (a double: PEFT's lora_alpha is a Python number) */
    double scale;       /* alpha / rank, or alpha / sqrt(rank) with rsLoRA (double: PEFT's scaling is a Python float) */
    lk_tensor A;        /* rank x in  (lora_A / lora_down) */
    lk_tensor B;        /* out x rank (lora_B / lora_up) */
    /* Where alpha came from: "config" (lora_alpha), "alpha_pattern \"<key>\"",
     * ".alpha tensor", "metadata lora_adapter_metadata", "metadata
     * alpha_pattern \"<key>\"", "metadata ss_network_alpha", "caller" (the
     * opener's lk_adapter_opts.alpha) or "default r". */
    const char *alpha_source;
    lk_tensor magnitude;     /* DoRA: lora_magnitude_vector, [out]; data NULL when not DoRA */
    lk_tensor bias;          /* lora_bias: lora_B.bias, [out]; data NULL when absent */
    const char *bias_target; /* the model's "<m>.bias" once resolved (bias set), else NULL;
                                for full / norm modules bias holds diff_b / b_norm */
    lk_algo algo;
    int64_t out, in;      /* the delta's rows and elements per row (in x kh x kw for a conv) */
    /* The factors as the file holds them (data NULL when absent): LoCon's
     * Tucker core lora_mid [r, r, kh, kw]; LoHa hada_w1_a, _b, hada_w2_a, _b,
     * hada_t1, _t2 and LoKr lokr_w1_a, _b, lokr_w2_a, _b, lokr_t2 (in t2),
     * lokr_w1, lokr_w2; full's diff, norm's w_norm, set_weight's tensor;
     * OFT / BOFT oft_blocks in w1 and rescale in w2; GLoRA a1, a2, b1, b2
     * in w1a, w1b, w2a, w2b (alpha: OFT / BOFT's constraint as read);
     * PEFT's OFT: oft_R.weight (2-D) in w1 and its options in oft_peft. */
    lk_tensor mid, w1a, w1b, w2a, w2b, t1, t2, w1, w2, dense;
    lk_tensor dora_scale; /* kohya / LyCORIS DoRA magnitude, [out, 1, ...] or [1, in, ...] */
    /* After lk_adapter_resolve: the delta's 2-D factors as the fuse kernel
     * takes them (conv factors reshaped, Tucker cores folded in fp64 into
     * an F64 "A", transposed copies where needed). LoRA: k[0] = A (r x N),
     * k[1] = B (out x r), N = the weight's elements per output row. LoHa:
     * k[0], k[1] the first product, k[2], k[3] the second. LoKr: w1 = k[1]
     * @ k[0] (k[0].data NULL: k[1] is w1 itself), w2 likewise from k[3],
     * k[2]. full / norm / set_weight: k[1] = the tensor. */
    lk_tensor k[4];
    lk_oft_peft oft_peft;
} lk_lora_module;

/* The module's own tensors from the file (factors, cores, alpha excluded,
 * DoRA magnitudes, biases) into out[0 .. LK_MODULE_MAX_TENSORS); returns
 * the count. */
size_t lk_lora_module_tensors(const lk_lora_module *m, const lk_tensor **out);

/* A tensor the adapter replaces whole (PEFT's modules_to_save, and the
 * biases saved with bias = "all" / "lora_only"). */
typedef struct lk_adapter_tensor {
    const char *key;    /* as named in the adapter file */
    const char *target; /* model key; NULL until resolved or when unmatched */
    const char *why;    /* "modules_to_save" or "bias" */
    lk_tensor t;
} lk_adapter_tensor;

typedef struct lk_adapter lk_adapter;

lk_status lk_adapter_open(const char *path, lk_adapter_format format, lk_adapter **out);
/* The same with every reading option (opts NULL: all defaults). */
lk_status lk_adapter_open_opts(const char *path, const lk_adapter_opts *opts, lk_adapter **out);

/* An adapter held in memory: the image of its safetensors file and, for a
 * PEFT adapter, the text of its adapter_config.json (NULL: none; read as if
 * it lay beside the file). label stands for the path in every message and
 * summary (the Python package makes it from a digest of the bytes and the
 * config, so two different adapters never share one). */
typedef struct lk_adapter_source {
    const char *label;
    const void *bytes;
    size_t n;
    const char *config_json;
} lk_adapter_source;

/* lk_adapter_open_opts over an in-memory source (the bytes are copied; opts
 * NULL: all defaults). */
lk_status lk_adapter_open_mem(const lk_adapter_source *src, const lk_adapter_opts *opts, lk_adapter **out);
void lk_adapter_free(lk_adapter *a);

const char *lk_adapter_path(const lk_adapter *a);
lk_adapter_format lk_adapter_get_format(const lk_adapter *a);
size_t lk_adapter_count(const lk_adapter *a);
/* Module i (0 <= i < count), in byte-wise order of the key stems. */
const lk_lora_module *lk_adapter_module(const lk_adapter *a, size_t i);
/* The key stem module i was read from, its wrapper / component prefix kept
 * ("unet.<m>" where module is "<m>"). */
const char *lk_adapter_module_stem(const lk_adapter *a, size_t i);
/* Replaced tensors (modules_to_save, saved biases), in key order. */
size_t lk_adapter_replacement_count(const lk_adapter *a);
const lk_adapter_tensor *lk_adapter_replacement(const lk_adapter *a, size_t i);
/* 1 if the adapter is DoRA (its modules carry lora_magnitude_vector). */
int lk_adapter_dora(const lk_adapter *a);
/* 1 if the adapter uses rsLoRA scaling. */
int lk_adapter_rslora(const lk_adapter *a);
/* The convention it was opened with (lk_adapter_opts.convention). */
lk_convention lk_adapter_convention(const lk_adapter *a);
/* 1 if an adapter_config.json was read (a PEFT folder, or one beside the file). */
int lk_adapter_has_config(const lk_adapter *a);
/* Modules not covered by the config's target_modules (warned about). */
size_t lk_adapter_untargeted(const lk_adapter *a);
/* The safetensors file read (path itself, or the file inside the folder). */
const char *lk_adapter_file(const lk_adapter *a);
/* The adapter_config.json read (the folder's, or the one beside the file),
 * or NULL when none was. */
const char *lk_adapter_config_file(const lk_adapter *a);
/* 1 if path is a folder, or a safetensors file whose keys are all LoRA
 * keys (factors lora_A/lora_B, lora_down/lora_up, .alpha, DoRA magnitudes,
 * lora_B biases), at least one a factor, or a file with an
 * adapter_config.json beside it whose keys are all PEFT's
 * ("base_model.model."); a checkpoint that merely contains some is not.
 * Never sets an error. */
int lk_adapter_looks_like(const char *path);

/* Maps every module onto one of the model's tensors (name + shape only are
 * used) and checks A is r x in, B is out x r against the 2-D weight out x in
 * (which must be F32, F16, BF16 or FP8: F8_E4M3 / F8_E5M2; else
 * LK_ERR_DTYPE). Module <m> targets "<m>.weight", else (a
 * diffusers file) "<prefix>.<m>.weight", else the only key ending in
 * ".<m>.weight"; kohya names match a model key whose dots, as '_', give the
 * name after "lora_unet_" / "lora_te[12]_". Two candidates are an error
 * (LK_ERR_FORMAT), as are two modules targeting one weight.
 * A module with lora_B.bias also needs the model's "<m>.bias" (1-D, out);
 * a replacement maps onto the model key of the same name (else the only
 * key ending in "." + that name) with the same shape; a replaced tensor
 * that a LoRA module of this adapter also targets is an error.
 * Unmatched modules (and replacements) are LK_ERR_UNMATCHED naming the first one, unless
 * allow_unmatched, in which case their count goes to *n_unmatched (may be
 * NULL), they keep target == NULL, and callers skip them. */
lk_status lk_adapter_resolve(lk_adapter *a, const lk_tensor *model, size_t n_model,
                             int allow_unmatched, size_t *n_unmatched);
/* Options of lk_adapter_resolve_opts. */
typedef struct lk_resolve_opts {
    int allow_unmatched;       /* 1: unmatched modules are skipped and counted, but an adapter none of
                                  whose modules lands is still LK_ERR_UNMATCHED (it would change nothing);
                                  LK_RESOLVE_LIST_ALL: not even that (inspect --base lists where nothing lands) */
    const char *arch;          /* family table to use ("flux", "sdxl", ...; "none": no table); NULL: recognised
                                  from the model's keys */
    const char *const *maps;   /* extra name tables (--map FILE), same format as data/families/ */
    size_t n_maps;
    const char *const *tied;   /* n_tied pairs (NAME, KEY), flat: NAME is another name of model key KEY (tied
                                  weights, one tensor under both names, the model holding it once as KEY): a
                                  module naming NAME (NAME = "<module>.weight") lands on KEY when no model key
                                  is NAME */
    size_t n_tied;
    const char *component;     /* a pipeline component ("unet", "transformer", "text_encoder[_2|_3]"): modules
                                  prefixed for another component are left out, and modules that match nothing
                                  are left unmatched without an error (the pipeline checks each landed
                                  somewhere); NULL: the model is the whole base */
} lk_resolve_opts;
#define LK_RESOLVE_LIST_ALL 2

/* lk_adapter_resolve across checkpoint layouts (README "Model families and
 * layouts"): when no key matches as above, the module's name without its
 * wrapper / component prefixes (transformer., unet., text_encoder[_2]., ...,
 * kohya's lora_unet_ / lora_te[12]_ / lora_transformer_, lycoris_) is looked
 * up among the model's key names without theirs (model.diffusion_model., an
 * SD single file's text-encoder wrappers, ...), then among the other naming
 * given by the model family's table (diffusers <-> original), which may place
 * a module on rows of a fused weight or split it over several weights.
 * Modules of a component (text_encoder., lora_te1_, ...) the base does not
 * hold are reported in one warning per component and skipped. */
lk_status lk_adapter_resolve_opts(lk_adapter *a, const lk_tensor *model, size_t n_model, const lk_resolve_opts *o,
                                  size_t *n_unmatched);

/* Reads and checks the name tables o names (o->arch, o->maps) against the
 * model's keys as lk_adapter_resolve_opts does before it resolves anything:
 * an unknown --arch, a missing or malformed --map file is the error resolve
 * would give (naming the file and line). LK_OK when o names no table. For
 * callers that keep the options for later resolves (the hot-swap tracker),
 * so a bad table is refused up front. label: prefix of errors. */
lk_status lk_resolve_tables_check(const lk_tensor *model, size_t n_model, const lk_resolve_opts *o, const char *label);

/* Where one module lands: rows [row0, row0 + rows) of the model weight
 * `target` get B's rows [b_row0, b_row0 + rows) times A (B is that view). A
 * module on a whole weight has one placement with row0 = b_row0 = 0. */
typedef struct lk_adapter_placement {
    const lk_lora_module *module;
    const char *target;
    int64_t row0, b_row0, rows;
    int whole;          /* rows are all of the weight's rows and all of B's */
    const char *rule;   /* how the name was matched: "exact", "suffix", "kohya form", "prefix",
                           "family NAME (FILE:LINE)", "--map (FILE:LINE)" */
    lk_tensor B;        /* rows b_row0.. of the module's B (a view) */
} lk_adapter_placement;
/* Placements on model key `target` (sorted by row0): *out gets the first. */
size_t lk_adapter_placements(const lk_adapter *a, const char *target, const lk_adapter_placement **out);
/* Every placement, sorted by (target, row0). */
size_t lk_adapter_placement_count(const lk_adapter *a);
const lk_adapter_placement *lk_adapter_placement_at(const lk_adapter *a, size_t i);
/* The most placements one model key gets from one adapter (>= 1), and the
 * bound resolve enforces: lk_fuse_key_plan needs a term capacity of
 * LK_ADAPTER_MAX_SLICES per adapter. */
#define LK_ADAPTER_MAX_SLICES 8
/* The family table the last resolve used (name), or NULL. */
const char *lk_adapter_family(const lk_adapter *a);

/* The module targeting model key `target` with its whole weight, or NULL (after resolve). */
const lk_lora_module *lk_adapter_find_target(const lk_adapter *a, const char *target);
/* The module whose lora_B.bias adds to model key `target` ("<m>.bias"), or NULL. */
const lk_lora_module *lk_adapter_find_bias_target(const lk_adapter *a, const char *target);
/* The replacement for model key `target`, or NULL (after resolve). */
const lk_adapter_tensor *lk_adapter_find_replacement(const lk_adapter *a, const char *target);

#ifdef __cplusplus
}
#endif
#endif
