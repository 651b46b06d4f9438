/* demo_swap.c — step 3 of `lorakit demo`: a hot-swap group over the base
 * model, run under mpirun (`lorakit demo --swap-stage DIR ...`, started by
 * the demo itself).
 *
 * Every rank loads the base into the small transformer and hands the
 * model's OWN parameter memory to an lk_tracker (lk_weights_wrap), so the
 * accuracies printed after each swap come from running the model on exactly
 * the bytes the tracker fused and broadcast. After each step the ranks
 * compare digests of their working weights, evaluate every task (examples
 * sharded over the ranks), and rank 0 prints the step and, at the end, the
 * table with the demo's checks, one of which fuses the same set offline
 * (lk_fuse_file, as `lorakit fuse`) and compares digests with the hot-swap
 * (the design's determinism promise); it also writes DIR/demo_results.txt
 * (key=value lines) for the ctest that runs `demo --quick`. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "demo.h"
#include "io/out_file.h"

#define N_EVAL_TASKS 3
#define MAX_STEPS 5

typedef struct step_result {
    char label[64];
    double ms;
    uint64_t bytes;
    int agree;
    char digest[LK_DIGEST_HEX];
    double acc[N_EVAL_TASKS];
} step_result;

/* Accuracy on `count` held-out examples, sharded over the ranks; rank 0's
 * first answer (example 0) is returned in first_answer. */
static lk_status eval_task(lk_model *m, lk_comm *w, lk_task_kind k, int digits, int count,
                           double *acc, int *first_answer) {
    int rank = lk_comm_rank(w), K = lk_comm_size(w);
    int per = (count + K - 1) / K;
    int lo = rank * per, hi = lo + per > count ? count : lo + per;
    lk_task_eval ev = {0, 0, 0.0};
    lk_status st = LK_OK;
    int *ans = NULL;
    if (hi > lo) {
        ans = malloc(sizeof(int) * (size_t)(hi - lo) * digits);
        if (!ans) return lk_error(LK_ERR_NOMEM, "demo: out of memory");
        st = lk_task_evaluate(m, k, digits, LK_DEMO_EVAL_SEED, (uint64_t)lo, hi - lo, 250, &ev,
                              ans);
        if (!st && rank == 0) memcpy(first_answer, ans, sizeof(int) * digits);
    }
    free(ans);
    uint64_t c[2] = {(uint64_t)ev.correct, st ? 1u : 0u};
    lk_status cs = lk_comm_allreduce_u64(w, c, 2, LK_REDUCE_SUM);
    if (st) return st;
    if (cs) return cs;
    if (c[1]) return lk_error(LK_ERR_MISMATCH, "demo: evaluation failed on another rank");
    *acc = (double)c[0] / count;
    return LK_OK;
}

static lk_status digests_agree(lk_weights *wts, lk_comm *w, char hex[LK_DIGEST_HEX], int *agree) {
    lk_status st = lk_weights_digest(wts, hex);
    if (st) return st;
    int K = lk_comm_size(w);
    char *all = malloc((size_t)K * LK_DIGEST_HEX);
    if (!all) return lk_error(LK_ERR_NOMEM, "demo: out of memory");
    st = lk_comm_allgather(w, hex, LK_DIGEST_HEX, all);
    *agree = 1;
    for (int r = 0; !st && r < K; r++)
        if (memcmp(all + (size_t)r * LK_DIGEST_HEX, hex, LK_DIGEST_HEX)) *agree = 0;
    free(all);
    return st;
}

static void fmt_bytes(uint64_t b, char *buf, size_t cap) {
    if (b >= 1u << 20) snprintf(buf, cap, "%.2f MiB", (double)b / (1u << 20));
    else snprintf(buf, cap, "%.1f KiB", (double)b / 1024.0);
}

static const char *yes(int v) { return v ? "yes" : "NO"; }

/* What `lorakit fuse BASE -l ADAPTER:STRENGTH -o OUT` writes, digested: the
 * design promises the same bytes as the distributed hot-swap of that set. */
static lk_status offline_fuse_digest(const char *base, const char *adapter, double strength,
                                     const char *out, char hex[LK_DIGEST_HEX]) {
    lk_fuse_input in = {adapter, strength, LK_FORMAT_AUTO};
    lk_fuse_file_opts fo;
    memset(&fo, 0, sizeof fo);
    fo.fuse.threads = 1;
    lk_status st = lk_fuse_file(base, &in, 1, out, &fo, NULL);
    if (st) return st;
    lk_st *f;
    if ((st = lk_st_open(out, &f))) return st;
    st = lk_digest_st(f, hex);
    lk_st_close(f);
    return st;
}

int lk_demo_swap_stage(const lk_demo_opts *o) {
    lk_comm *w = NULL;
    if (lk_comm_world(NULL, NULL, &w)) return lk_cli_fail();
    int rank = lk_comm_rank(w), K = lk_comm_size(w);
    char base[LK_DEMO_PATH + 64], adapter[2][LK_DEMO_PATH + 64];
    snprintf(base, sizeof base, "%s/base/model.safetensors", o->out);
    snprintf(adapter[0], sizeof adapter[0], "%s/%s", o->out, lk_task_name(o->tasks[0]));
    snprintf(adapter[1], sizeof adapter[1], "%s/%s", o->out, lk_task_name(o->tasks[1]));
    const lk_task_kind eval_tasks[N_EVAL_TASKS] = {LK_TASK_COPY, o->tasks[0], o->tasks[1]};

    lk_model *m = NULL;
    lk_weights *wts = NULL;
    lk_tracker *tr = NULL;
    lk_tensor *views = NULL;
    step_result res[MAX_STEPS];
    char file_digest[LK_DIGEST_HEX] = "";
    int rc = LK_EXIT_FAIL, n_done = 0;
    memset(res, 0, sizeof res);

    lk_status st = lk_model_load(base, &m);
    if (!st) {
        views = calloc(lk_model_param_count(m), sizeof *views);
        if (!views) st = lk_error(LK_ERR_NOMEM, "demo: out of memory");
    }
    if (!st) {
        lk_model_tensors(m, views);
        st = lk_weights_wrap(views, lk_model_param_count(m), &wts);
    }
    if (!st) {
        lk_st *f;
        st = lk_st_open(base, &f);
        if (!st) {
            st = lk_digest_st(f, file_digest);
            lk_st_close(f);
        }
    }
    if (st) {
        fprintf(stderr, "lorakit: rank %d: %s\n", rank, lk_last_error());
        goto done;
    }
    lk_tracker_opts topts = LK_TRACKER_OPTS_DEFAULT;
    topts.threads = 1; /* one core per rank */
    if ((st = lk_tracker_create(w, wts, &topts, &tr))) {
        fprintf(stderr, "lorakit: rank %d: %s\n", rank, lk_last_error());
        goto done;
    }
    if (rank == 0) {
        printf("\n== 3. hot-swap group: %d rank%s, each running the model on its working "
               "weights ==\n", K, K == 1 ? "" : "s");
        printf("base %s (digest %s)\n", base, file_digest);
        fflush(stdout);
    }

    /* the plan: no adapter, A at 1.0, B at 1.0, A at 0.5, reset */
    const struct { int which; float s; } plan[MAX_STEPS] = {
        {-1, 0.0f}, {0, 1.0f}, {1, 1.0f}, {0, 0.5f}, {-2, 0.0f}};
    for (int i = 0; i < MAX_STEPS; i++) {
        step_result *r = &res[i];
        lk_tracker_stats ts;
        memset(&ts, 0, sizeof ts);
        if (plan[i].which == -1) {
            snprintf(r->label, sizeof r->label, "no adapter");
            st = lk_tracker_apply(tr, NULL, 0, &ts);
        } else if (plan[i].which == -2) {
            snprintf(r->label, sizeof r->label, "reset");
            st = lk_tracker_reset(tr, &ts);
        } else {
            lk_fuse_input in = {adapter[plan[i].which], plan[i].s, LK_FORMAT_AUTO};
            snprintf(r->label, sizeof r->label, "%s at %.1f", lk_task_name(o->tasks[plan[i].which]),
                     plan[i].s);
            st = lk_tracker_apply(tr, &in, 1, &ts);
        }
        if (st) {
            fprintf(stderr, "lorakit: rank %d: step %d (%s): %s\n", rank, i + 1, r->label,
                    lk_last_error());
            goto done;
        }
        r->ms = ts.seconds * 1e3;
        r->bytes = ts.bytes_broadcast;
        /* each owner fuses/restores its own keys: show the group's totals */
        uint64_t keys[2] = {ts.keys_fused, ts.keys_restored};
        if ((st = lk_comm_allreduce_u64(w, keys, 2, LK_REDUCE_SUM))) goto done;
        if ((st = digests_agree(wts, w, r->digest, &r->agree))) goto done;
        int first[N_EVAL_TASKS][LK_TASK_MAX_DIGITS];
        for (int t = 0; t < N_EVAL_TASKS; t++)
            if ((st = eval_task(m, w, eval_tasks[t], o->digits, o->eval, &r->acc[t], first[t])))
                goto done;
        n_done = i + 1;
        if (rank == 0) {
            char b[32];
            fmt_bytes(r->bytes, b, sizeof b);
            printf("\n[%d/%d] %s\n", i + 1, MAX_STEPS, r->label);
            printf("  swap %.2f ms: %llu keys fused, %llu restored (by their owners), %s "
                   "broadcast; ranks agree: %s (digest %.12s...)\n",
                   r->ms, (unsigned long long)keys[0], (unsigned long long)keys[1], b,
                   yes(r->agree), r->digest);
            printf("  accuracy (%d held-out examples each):", o->eval);
            for (int t = 0; t < N_EVAL_TASKS; t++)
                printf("  %s %.1f%%", lk_task_name(eval_tasks[t]), 100.0 * r->acc[t]);
            printf("\n");
            for (int t = 1; t < N_EVAL_TASKS; t++) {
                int tok[2 * LK_TASK_MAX_DIGITS + 1];
                char p[160], a[160];
                lk_task_example(eval_tasks[t], o->digits, LK_DEMO_EVAL_SEED, 0, tok);
                lk_task_format(tok, o->digits, p, sizeof p);
                lk_task_format(first[t], o->digits, a, sizeof a);
                int ok = !memcmp(first[t], tok + o->digits + 1, sizeof(int) * o->digits);
                printf("  %-9s %s | %s   %s\n", lk_task_name(eval_tasks[t]), p, a,
                       ok ? "(right)" : "(wrong)");
            }
            fflush(stdout);
        }
    }
    rc = LK_EXIT_OK;

done:
    if (st && rc == LK_EXIT_FAIL && rank == 0 && lk_last_error()[0])
        fprintf(stderr, "lorakit: %s\n", lk_last_error());
    if (rank == 0 && n_done == MAX_STEPS) {
        int reset_exact = !strcmp(res[4].digest, file_digest);
        /* the offline path: fuse the step-4 set into a file, compare digests */
        char fused[LK_DEMO_PATH + 64], off_digest[LK_DIGEST_HEX] = "";
        snprintf(fused, sizeof fused, "%s/fused_%s_0.5.safetensors", o->out,
                 lk_task_name(o->tasks[0]));
        if (offline_fuse_digest(base, adapter[0], 0.5f, fused, off_digest))
            fprintf(stderr, "lorakit: offline fuse: %s\n", lk_last_error());
        int offline_same = !strcmp(off_digest, res[3].digest);
        int all_agree = 1;
        for (int i = 0; i < MAX_STEPS; i++) all_agree &= res[i].agree;
        printf("\n== 4. summary ==\n");
        printf("%-16s %10s %12s %6s", "step", "swap ms", "broadcast", "agree");
        for (int t = 0; t < N_EVAL_TASKS; t++) printf(" %10s", lk_task_name(eval_tasks[t]));
        printf("\n");
        for (int i = 0; i < MAX_STEPS; i++) {
            char b[32];
            fmt_bytes(res[i].bytes, b, sizeof b);
            printf("%-16s %10.2f %12s %6s", res[i].label, res[i].ms, b, yes(res[i].agree));
            for (int t = 0; t < N_EVAL_TASKS; t++) printf(" %9.1f%%", 100.0 * res[i].acc[t]);
            printf("\n");
        }
        double a0 = res[1].acc[1], a1 = res[2].acc[2];
        double b0 = res[0].acc[1], b1 = res[0].acc[2];
        double min_acc = o->min_acc, max_base = o->max_base;
        int ok0 = a0 >= min_acc, ok1 = a1 >= min_acc, okb = b0 < max_base && b1 < max_base;
        printf("\nchecks:\n");
        printf("  %-8s adapter on %-9s %6.1f%%  (expected >= %.0f%%)  %s\n",
               lk_task_name(o->tasks[0]), lk_task_name(o->tasks[0]), 100 * a0, 100 * min_acc,
               ok0 ? "PASS" : "FAIL");
        printf("  %-8s adapter on %-9s %6.1f%%  (expected >= %.0f%%)  %s\n",
               lk_task_name(o->tasks[1]), lk_task_name(o->tasks[1]), 100 * a1, 100 * min_acc,
               ok1 ? "PASS" : "FAIL");
        printf("  base on %s %.1f%% and %s %.1f%%  (expected < %.0f%%)  %s\n",
               lk_task_name(o->tasks[0]), 100 * b0, lk_task_name(o->tasks[1]), 100 * b1,
               100 * max_base, okb ? "PASS" : "FAIL");
        printf("  reset restores the base bit for bit (digest %s)  %s\n", res[4].digest,
               reset_exact ? "PASS" : "FAIL");
        printf("  all ranks held identical weights after every step  %s\n",
               all_agree ? "PASS" : "FAIL");
        printf("  offline `lorakit fuse` of %s at 0.5 wrote the same bytes as the hot-swap "
               "(%s)  %s\n", lk_task_name(o->tasks[0]), fused, offline_same ? "PASS" : "FAIL");
        fflush(stdout);
        char path[LK_DEMO_PATH + 32];
        snprintf(path, sizeof path, "%s/demo_results.txt", o->out);
        char *text = NULL;
        size_t len = 0;
        FILE *f = open_memstream(&text, &len);
        if (f) {
            fprintf(f, "ranks=%d\ntask_a=%s\ntask_b=%s\n", K, lk_task_name(o->tasks[0]),
                    lk_task_name(o->tasks[1]));
            fprintf(f, "adapter_a_acc=%.4f\nadapter_b_acc=%.4f\nbase_a_acc=%.4f\n"
                       "base_b_acc=%.4f\nhalf_a_acc=%.4f\nreset_a_acc=%.4f\n",
                    a0, a1, b0, b1, res[3].acc[1], res[4].acc[1]);
            fprintf(f, "reset_bit_exact=%d\nranks_agree=%d\nbase_digest=%s\nreset_digest=%s\n",
                    reset_exact, all_agree, file_digest, res[4].digest);
            fprintf(f, "offline_fuse_same=%d\nhalf_a_digest=%s\noffline_digest=%s\n",
                    offline_same, res[3].digest, off_digest);
            for (int i = 0; i < MAX_STEPS; i++) fprintf(f, "swap_ms_%d=%.3f\n", i + 1, res[i].ms);
            if (fclose(f) == 0 && lk_out_file_write(path, text, len))
                fprintf(stderr, "lorakit: warning: %s\n", lk_last_error());
            free(text);
        }
        if (!(ok0 && ok1 && okb && reset_exact && all_agree && offline_same)) rc = LK_EXIT_FAIL;
    }
    lk_tracker_free(tr);
    lk_weights_free(wts);
    free(views);
    lk_model_free(m);
    lk_comm_free(w);
    return rc;
}
