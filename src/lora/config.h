/* lora/config.h — the `models.<role>.lora` block from an already parsed
 * YAML document (internal, not installed), so a caller holding the tree of a
 * training config (app/train.c, the CLI's `config check`) reads the file
 * once. The public lk_lora_config_load/parse/roles are these over
 * lk_ydoc_load/lk_ydoc_parse. */
#ifndef LK_LORA_CONFIG_H
#define LK_LORA_CONFIG_H

#include "io/yaml_doc.h"
#include "lorakit/lora.h"

/* lk_lora_config_parse's rules over d. */
lk_status lk_lora_config_from_doc(const lk_ydoc *d, const char *role, lk_lora_config *out);
/* lk_lora_config_roles over d. */
lk_status lk_lora_config_roles_doc(const lk_ydoc *d, char ***roles, size_t *n);

#endif
