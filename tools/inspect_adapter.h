/* inspect_adapter.h — the adapter branch of `lorakit inspect`. */
#ifndef LORAKIT_INSPECT_ADAPTER_H
#define LORAKIT_INSPECT_ADAPTER_H

#include <jansson.h>

/* Prints an adapter (file or PEFT folder): detected format, module count,
 * rank / alpha / scale grouped, and with json one object on stdout.
 * Returns an exit code. */
int lk_inspect_adapter(const char *path, int json);

/* Prints a JSON value (consumed) on one line; a NULL value (jansson refuses
 * a string that is not UTF-8 as well as a failed allocation) is a failure
 * with a message. Returns an exit code. Defined in cmd_inspect.c. */
int lk_inspect_print_json(json_t *o);

#endif
