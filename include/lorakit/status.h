/* lorakit/status.h — status codes and the thread-local error message.
 *
 * Every fallible lorakit function returns lk_status. On failure the reason,
 * naming the file, key and values involved, is available from lk_last_error()
 * on the same thread until the next failure overwrites it. */
#ifndef LORAKIT_STATUS_H
#define LORAKIT_STATUS_H

#ifdef __cplusplus
extern "C" {
#endif

typedef enum lk_status {
    LK_OK = 0,
    LK_ERR_ARG,         /* bad argument from the caller */
    LK_ERR_IO,          /* open/read/write/rename/mmap failed */
    LK_ERR_FORMAT,      /* malformed file (safetensors, JSON, YAML, adapter) */
    LK_ERR_NOMEM,       /* allocation failed */
    LK_ERR_SHAPE,       /* shapes or ranks disagree */
    LK_ERR_DTYPE,       /* dtype not supported for this operation */
    LK_ERR_UNMATCHED,   /* adapter module matches no model weight */
    LK_ERR_NONFINITE,   /* NaN/Inf where a finite value is required */
    LK_ERR_MISMATCH,    /* ranks disagree on a cooperative request */
    LK_ERR_STATE,       /* operation not allowed in the current state */
    LK_ERR_COMM,        /* communication backend failure */
    LK_ERR_UNSUPPORTED, /* valid input lorakit does not handle */
    LK_ERR_CONFIG,      /* invalid configuration value */
    LK_ERR_TIMEOUT,     /* a collective outlived the communicator's timeout */
    LK_ERR_CANCELLED,   /* the caller cancelled the call (lorakit/cancel.h); nothing changed */
    LK_STATUS_COUNT
} lk_status;

/* Short constant name of a status, e.g. "LK_ERR_FORMAT". */
const char *lk_status_str(lk_status s);

/* The message of the last failure on this thread ("" if none). */
const char *lk_last_error(void);

/* Records a failure message (printf-style) and returns s, so callers can
 * write `return lk_error(LK_ERR_FORMAT, "%s: ...", path);`. */
lk_status lk_error(lk_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Prepends "prefix: " to the current message (for adding context such as a
 * file name while an error propagates). Returns s. */
lk_status lk_error_prefix(lk_status s, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 2, 3)))
#endif
    ;

/* Clears the current message (and its path and key). */
void lk_error_clear(void);

/* Where the current failure is, when the code that failed knew it: the file
 * (a checkpoint or adapter path, an in-memory adapter's label) and the
 * tensor key (a model weight, an adapter's module or tensor) the message is
 * about; "" when not known. lk_error() clears both; lk_error_at() records
 * them for the current failure, each only when given (non-NULL, non-empty)
 * and not recorded yet, so the innermost code that knows wins. Returns s. */
lk_status lk_error_at(lk_status s, const char *path, const char *key);
const char *lk_last_error_path(void);
const char *lk_last_error_key(void);

/* A number as messages and JSON show it: the shortest "%.*g" decimal that
 * reads back (strtod) as exactly v, whole numbers below 1e17 in plain
 * digits ("0.7", "0.30000000000000004", "2147483648", "1e40", "1e-05" as
 * "1e-5": no "+" or leading zeros in the exponent). Writes
 * into buf (at least LK_NUM_STR_MAX bytes) and returns it. */
#define LK_NUM_STR_MAX 32
const char *lk_num_str(double v, char *buf);

#ifdef __cplusplus
}
#endif
#endif
