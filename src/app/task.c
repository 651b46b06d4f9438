/* task.c — the generated digit tasks (see task.h).
 *
 * Examples come from a counter-based generator keyed by (seed, index) rather
 * than a running stream so that data-parallel ranks, and runs at different
 * rank counts, see exactly the same global batch without sharing state. */
#include <stdio.h>
#include <string.h>

#include "lorakit/alloc.h"
#include "app/model.h"
#include "app/task.h"

static const char *const k_names[LK_TASK_COUNT] = {"copy", "reverse", "sort", "increment"};

const char *lk_task_name(lk_task_kind k) {
    return (unsigned)k < LK_TASK_COUNT ? k_names[k] : "?";
}

lk_status lk_task_from_name(const char *name, lk_task_kind *out) {
    for (int i = 0; i < LK_TASK_COUNT; i++)
        if (name && !strcmp(name, k_names[i])) {
            *out = (lk_task_kind)i;
            return LK_OK;
        }
    return lk_error(LK_ERR_CONFIG, "unknown task \"%s\" (valid: copy, reverse, sort, increment)",
                    name ? name : "(null)");
}

int lk_task_train_len(int n_digits) { return 2 * n_digits; }

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void lk_task_example(lk_task_kind k, int n, uint64_t seed, uint64_t index, int *tokens) {
    uint64_t base = mix64(seed * 0x9E3779B97F4A7C15ull + 0x7461736Bull) ^ index;
    for (int i = 0; i < n; i++)
        tokens[i] = (int)(mix64(base * 0x9E3779B97F4A7C15ull + (uint64_t)i + 1) % 10u);
    tokens[n] = LK_TASK_SEP;
    int *ans = tokens + n + 1;
    switch (k) {
    case LK_TASK_REVERSE:
        for (int i = 0; i < n; i++) ans[i] = tokens[n - 1 - i];
        break;
    case LK_TASK_SORT: {
        int hist[10] = {0};
        for (int i = 0; i < n; i++) hist[tokens[i]]++;
        int j = 0;
        for (int d = 0; d < 10; d++)
            for (int c = 0; c < hist[d]; c++) ans[j++] = d;
        break;
    }
    case LK_TASK_INCREMENT:
        for (int i = 0; i < n; i++) ans[i] = (tokens[i] + 1) % 10;
        break;
    default: /* copy */
        for (int i = 0; i < n; i++) ans[i] = tokens[i];
        break;
    }
}

lk_status lk_task_batch(lk_task_kind k, int n, uint64_t seed, uint64_t index0, int B,
                        int *inputs, int *targets) {
    if (n <= 0 || n > LK_TASK_MAX_DIGITS || B < 0 || (unsigned)k >= LK_TASK_COUNT)
        return lk_error(LK_ERR_ARG, "task batch: n = %d digits (1..%d), B = %d", n,
                        LK_TASK_MAX_DIGITS, B);
    int T = 2 * n;
    int tok[2 * LK_TASK_MAX_DIGITS + 1];
    for (int b = 0; b < B; b++) {
        lk_task_example(k, n, seed, index0 + (uint64_t)b, tok);
        for (int t = 0; t < T; t++) {
            inputs[(size_t)b * T + t] = tok[t];
            /* position t predicts token t+1; the answer starts at n+1 */
            targets[(size_t)b * T + t] = t >= n ? tok[t + 1] : -1;
        }
    }
    return LK_OK;
}

void lk_task_format(const int *tokens, int len, char *buf, size_t cap) {
    size_t o = 0;
    if (!cap) return;
    buf[0] = 0;
    for (int i = 0; i < len && o + 3 < cap; i++) {
        int t = tokens[i];
        char ch = t >= 0 && t <= 9 ? (char)('0' + t) : t == LK_TASK_SEP ? '|' : '?';
        if (i) buf[o++] = ' ';
        buf[o++] = ch;
    }
    buf[o] = 0;
}

lk_status lk_task_evaluate(lk_model *m, lk_task_kind k, int n, uint64_t seed, uint64_t index0,
                           int count, int batch, lk_task_eval *out, int *answers) {
    if (!m || !out || n <= 0 || n > LK_TASK_MAX_DIGITS || count <= 0 || batch <= 0 ||
        (unsigned)k >= LK_TASK_COUNT)
        return lk_error(LK_ERR_ARG, "task evaluate: bad arguments (n = %d, count = %d, batch = %d)",
                        n, count, batch);
    if (batch > count) batch = count;
    int P = n + 1;
    int *prompts = lk_malloc((size_t)batch * P * sizeof(int));
    int *gen = lk_malloc((size_t)batch * n * sizeof(int));
    int tok[2 * LK_TASK_MAX_DIGITS + 1];
    lk_status st = LK_OK;
    if (!prompts || !gen) {
        st = lk_error(LK_ERR_NOMEM, "task evaluate: out of memory");
        goto done;
    }
    int correct = 0;
    for (int start = 0; start < count; start += batch) {
        int bs = count - start < batch ? count - start : batch;
        for (int b = 0; b < bs; b++) {
            lk_task_example(k, n, seed, index0 + (uint64_t)(start + b), tok);
            memcpy(prompts + (size_t)b * P, tok, (size_t)P * sizeof(int));
        }
        if ((st = lk_model_generate(m, prompts, bs, P, n, gen))) goto done;
        for (int b = 0; b < bs; b++) {
            lk_task_example(k, n, seed, index0 + (uint64_t)(start + b), tok);
            const int *g = gen + (size_t)b * n;
            if (!memcmp(g, tok + P, (size_t)n * sizeof(int))) correct++;
            if (answers) memcpy(answers + (size_t)(start + b) * n, g, (size_t)n * sizeof(int));
        }
    }
    out->total = count;
    out->correct = correct;
    out->accuracy = (double)correct / count;
done:
    lk_free(prompts);
    lk_free(gen);
    return st;
}
