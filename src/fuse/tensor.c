/* tensor.c — lk_fuse_tensor, the entry every caller uses (lk_fuse_file, the
 * hot-swap tracker, adapter export): a term list of LoRA terms only, or one
 * with terms on row slices, goes to the kernel (kernel.c); one with LoHa,
 * LoKr or dense terms to the row driver (terms.c), which builds on the
 * kernel's delta chain; an OFT / BOFT rotation to oft.c, and GLoRA's
 * W a1 a2 terms become LoRA terms made from the weight (oft.c). Kept apart so that both are leaves of this
 * dispatch: neither calls back into the other's caller. */
#include "lorakit/fuse.h"
#include "fuse/fuse.h"
#include "lorakit/alloc.h"


/* Terms that read the weight (oft.c): an OFT rotation alone, or GLoRA's
 * W a1 a2 turned into LoRA terms from the weight's values. */
static lk_status fuse_wterms(void *w_out, const void *w_in, lk_dtype dtype, int64_t out, int64_t in,
                             const lk_fuse_term *terms, size_t n_terms, const lk_fuse_opts *opts, const char *name) {
    lk_status s = lk_fuse_check_weight(w_out, w_in, dtype, out, in, name);
    if (s) return s;
    const lk_fuse_term *oft = NULL;
    size_t live = 0;
    for (size_t t = 0; t < n_terms; t++) {
        live += terms[t].scale != 0.0;
        if (terms[t].scale != 0.0 && terms[t].kind == LK_TERM_OFT) oft = &terms[t];
    }
    if (oft && live == 1) return lk_fuse_tensor_oft(w_out, w_in, dtype, out, in, oft, opts, name);
    const size_t numel = (size_t)out * (size_t)in;
    float *w = oft ? NULL : lk_malloc(numel * sizeof *w);
    if (!oft && !w) return lk_error(LK_ERR_NOMEM, "%s: out of memory for the weight's values", name);
    if (w) lk_to_f32(w, w_in, dtype, numel);
    const lk_fuse_term *xt;
    void *mem;
    s = lk_fuse_expand_wterms(w, out, in, terms, n_terms, &xt, &mem, name);
    lk_free(w);
    if (!s) s = lk_fuse_tensor(w_out, w_in, dtype, out, in, xt, n_terms, opts, name);
    lk_free(mem);
    return s;
}

lk_status lk_fuse_tensor(void *w_out, const void *w_in, lk_dtype dtype, int64_t out, int64_t in,
                         const lk_fuse_term *terms, size_t n_terms, const lk_fuse_opts *opts,
                         const char *name) {
    if (!name) name = "(tensor)";
    lk_status cs = lk_cancel_check(opts ? opts->cancel : NULL, name); /* a cancellation point per tensor */
    if (cs) return cs;
    if (lk_fuse_wterms(terms, n_terms)) return fuse_wterms(w_out, w_in, dtype, out, in, terms, n_terms, opts, name);
    int sliced = 0, lora_only = 1;
    for (size_t t = 0; terms && t < n_terms; t++) {
        sliced |= lk_fuse_term_sliced(&terms[t]);
        lora_only &= terms[t].kind == LK_TERM_LORA;
    }
    /* row-sliced terms are LoRA only (the kernel refuses the others) */
    if (lora_only || sliced) return lk_fuse_tensor_lora(w_out, w_in, dtype, out, in, terms, n_terms, opts, name);
    lk_status s = lk_fuse_check_weight(w_out, w_in, dtype, out, in, name);
    return s ? s : lk_fuse_tensor_terms(w_out, w_in, dtype, out, in, terms, n_terms, opts, name);
}

