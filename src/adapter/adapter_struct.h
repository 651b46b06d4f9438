/* adapter_struct.h — the lk_adapter object, shared by adapter.c and
 * resolve.c only (other modules use the accessors in lorakit/adapter.h). */
#ifndef LK_ADAPTER_STRUCT_H
#define LK_ADAPTER_STRUCT_H

#include "lorakit/adapter.h"
#include "lorakit/safetensors.h"
#include "adapter/adapter_internal.h"

struct lk_adapter {
    char *path;             /* as given: file or folder */
    char *file;             /* the safetensors file read */
    lk_adapter_format format;
    int has_config, rslora;
    lk_peft_config cfg;     /* valid when has_config */
    lk_st *st;              /* the file; owns the tensor names */
    void *factors;          /* every module's A and B, copied at open */
    size_t n;               /* modules, sorted by stem */
    lk_lora_module *mods;
    char **names, **stems, **targets; /* owned strings behind mods[i] */
    size_t *by_target;      /* resolved modules sorted by target */
    size_t n_by_target;
    size_t n_untargeted;    /* modules outside target_modules */
};

/* The name of a factor in the adapter's format: A (b = 0) or B (b = 1). */
static inline const char *lk_adapter_factor_name(const lk_adapter *a, int b) {
    if (a->format == LK_FORMAT_KOHYA) return b ? "lora_up" : "lora_down";
    return b ? "lora_B" : "lora_A";
}

#endif
