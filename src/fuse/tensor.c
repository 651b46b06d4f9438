/* tensor.c — lk_fuse_tensor, the entry every caller uses (lk_fuse_file, the
 * hot-swap tracker, adapter export): a term list of LoRA terms only, or one
 * with terms on row slices, goes to the kernel (kernel.c); one with LoHa,
 * LoKr or dense terms to the row driver (terms.c), which builds on the
 * kernel's delta chain. Kept apart so that both are leaves of this
 * dispatch: neither calls back into the other's caller. */
#include "lorakit/fuse.h"
#include "fuse/fuse.h"

lk_status lk_fuse_tensor(void *w_out, const void *w_in, lk_dtype dtype, int64_t out, int64_t in,
                         const lk_fuse_term *terms, size_t n_terms, const lk_fuse_opts *opts,
                         const char *name) {
    if (!name) name = "(tensor)";
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
