/* app/task.h — generated sequence tasks for training and evaluating the
 * small transformer (app/model.h); no downloaded data.
 *
 * An example is n digits, a separator, then the answer's n digits:
 *   copy       3 1 4 1 5 | 3 1 4 1 5
 *   reverse    3 1 4 1 5 | 5 1 4 1 3
 *   sort       3 1 4 1 5 | 1 1 3 4 5
 *   increment  3 1 4 1 5 | 4 2 5 2 6      (each digit + 1 mod 10)
 * Tokens: digits 0..9, LK_TASK_SEP = 10 for '|'; vocabulary LK_TASK_VOCAB.
 * Example i of stream `seed` is a pure function of (task, n, seed, i) (a
 * counter-based generator), so a global batch split over any number of ranks
 * holds the same examples. Accuracy = fraction of answers exactly right by
 * greedy decoding. */
#ifndef LK_APP_TASK_H
#define LK_APP_TASK_H

#include <stddef.h>
#include <stdint.h>
#include "lorakit/status.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct lk_model lk_model;

#define LK_TASK_SEP 10
#define LK_TASK_VOCAB 11
#define LK_TASK_MAX_DIGITS 64

typedef enum lk_task_kind {
    LK_TASK_COPY,
    LK_TASK_REVERSE,
    LK_TASK_SORT,
    LK_TASK_INCREMENT,
    LK_TASK_COUNT
} lk_task_kind;

const char *lk_task_name(lk_task_kind k);
/* "copy", "reverse", "sort", "increment". */
lk_status lk_task_from_name(const char *name, lk_task_kind *out);

/* Model positions a task of n digits needs for training: 2n. */
int lk_task_train_len(int n_digits);

/* tokens [2n + 1]: example `index` of stream `seed`; 1 <= n <= LK_TASK_MAX_DIGITS. */
void lk_task_example(lk_task_kind k, int n_digits, uint64_t seed, uint64_t index, int *tokens);

/* A training batch of examples index0 .. index0 + B - 1:
 * inputs [B, 2n] = tokens[0 .. 2n-1], targets [B, 2n] = tokens[1 .. 2n] with
 * the prompt positions set to -1 (only the n answer digits are scored). */
lk_status lk_task_batch(lk_task_kind k, int n_digits, uint64_t seed, uint64_t index0, int B,
                        int *inputs, int *targets);

/* Writes tokens as text ("3 1 4 | 4 1 3") into buf (always terminated). */
void lk_task_format(const int *tokens, int len, char *buf, size_t cap);

typedef struct lk_task_eval {
    int total;
    int correct;
    double accuracy; /* correct / total */
} lk_task_eval;

/* Greedy-decodes examples index0 .. index0 + count - 1 in batches of `batch`
 * and scores exact matches. answers, if not NULL, receives [count, n] tokens. */
lk_status lk_task_evaluate(lk_model *m, lk_task_kind k, int n_digits, uint64_t seed,
                           uint64_t index0, int count, int batch, lk_task_eval *out,
                           int *answers);

#ifdef __cplusplus
}
#endif
#endif
