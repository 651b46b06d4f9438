/* inspect_adapter.h — the adapter branch of `lorakit inspect`. */
#ifndef LORAKIT_INSPECT_ADAPTER_H
#define LORAKIT_INSPECT_ADAPTER_H

/* Prints an adapter (file or PEFT folder): detected format, module count,
 * rank / alpha / scale grouped, and with json one object on stdout.
 * Returns an exit code. */
int lk_inspect_adapter(const char *path, int json);

#endif
