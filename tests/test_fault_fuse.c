/* test_fault_fuse.c — lk_fuse_file under injected faults: every allocation
 * failing in turn, and the base checkpoint truncated after it was opened.
 *
 * Promise under test (DESIGN.md, "a failing call leaves ... exactly as it
 * was"): a failed fuse returns a clean status with a message, leaves no file
 * at the output path and no temporary file beside it, and never writes the
 * base. The CLI-level I/O faults (unwritable directory, disk full) are in
 * tests/fault_fuse.sh.
 *
 * Expectations are independent of the fuse code: the successful result is
 * compared with a double-precision W + sum s*c*B@A computed here, and every
 * failed attempt with the absence of files and the saved base bytes.
 *
 * The truncation hook: this executable defines mmap(), which the static
 * library's calls bind to ahead of libc's; it forwards to the real mmap and,
 * when the mapped file is the armed one, truncates that file to half its size
 * right after the mapping exists — i.e. after lk_st_open, before the reads.
 * (Until 7a55d15 the fuse read the base through that mapping and died of
 * SIGBUS here; it now preads and reports LK_ERR_IO.) */
#include <dlfcn.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <dirent.h>

#include "testutil.h"

/* ------------------------------------------------------------ mmap hook */

static struct {
    int armed, fired;
    dev_t dev;
    ino_t ino;
    char path[512];
} g_trunc;

void *mmap(void *addr, size_t len, int prot, int flags, int fd, off_t off) {
    static void *(*real)(void *, size_t, int, int, int, off_t);
    if (!real) real = (void *(*)(void *, size_t, int, int, int, off_t))dlsym(RTLD_NEXT, "mmap");
    void *p = real(addr, len, prot, flags, fd, off);
    struct stat sb;
    if (g_trunc.armed && p != MAP_FAILED && fd >= 0 && fstat(fd, &sb) == 0 &&
        sb.st_dev == g_trunc.dev && sb.st_ino == g_trunc.ino) {
        g_trunc.armed = 0;
        g_trunc.fired = 1;
        if (truncate(g_trunc.path, sb.st_size / 2) != 0) perror("truncate");
    }
    return p;
}

/* ------------------------------------------------------------ fixtures */

#define NO 24 /* out */
#define NI 40 /* in */
#define NR 4  /* rank */

typedef struct {
    char *dir, *base, *ad_diff, *ad_peft, *out;
    float w_q[NO * NI], w_v[NO * NI], norm[NI];
    float a1[NR * NI], b1[NO * NR], a2[NR * NI], b2[NO * NR], a3[NR * NI], b3[NO * NR];
    void *base_bytes;
    size_t base_len;
} fixture;

static void fill(float *x, size_t n, tu_rng *r, float amp) {
    for (size_t i = 0; i < n; i++) x[i] = tu_uniform(r, -amp, amp);
}

static lk_tensor view(const char *name, float *data, int ndim, int64_t d0, int64_t d1) {
    lk_tensor t = {.name = name, .dtype = LK_DTYPE_F32, .ndim = ndim, .shape = {d0, d1}, .data = data};
    t.nbytes = (size_t)d0 * (ndim == 2 ? (size_t)d1 : 1) * sizeof(float);
    return t;
}

static int setup(void **state) {
    fixture *f = calloc(1, sizeof *f);
    tu_rng r = {42};
    fill(f->w_q, NO * NI, &r, 1.0f);
    fill(f->w_v, NO * NI, &r, 1.0f);
    fill(f->norm, NI, &r, 1.0f);
    fill(f->a1, NR * NI, &r, 0.5f);
    fill(f->b1, NO * NR, &r, 0.5f);
    fill(f->a2, NR * NI, &r, 0.5f);
    fill(f->b2, NO * NR, &r, 0.5f);
    fill(f->a3, NR * NI, &r, 0.5f);
    fill(f->b3, NO * NR, &r, 0.5f);
    f->dir = tu_mkdtemp();
    f->base = tu_path(f->dir, "base.safetensors");
    f->ad_diff = tu_path(f->dir, "style.safetensors");
    f->ad_peft = tu_path(f->dir, "peft");
    f->out = tu_path(f->dir, "out.safetensors");

    lk_tensor base[3] = {view("blocks.0.attn.to_q.weight", f->w_q, 2, NO, NI),
                         view("blocks.0.attn.to_v.weight", f->w_v, 2, NO, NI),
                         view("blocks.0.norm.weight", f->norm, 1, NI, 0)};
    assert_int_equal(lk_st_save(f->base, base, 3, NULL, 0), LK_OK);
    f->base_bytes = tu_read_file(f->base, &f->base_len);

    /* diffusers: to_q and to_v, alpha tensor 2 on to_q (scale 2/4). */
    float alpha = 2.0f;
    lk_tensor diff[5] = {view("transformer.blocks.0.attn.to_q.lora_A.weight", f->a1, 2, NR, NI),
                         view("transformer.blocks.0.attn.to_q.lora_B.weight", f->b1, 2, NO, NR),
                         view("transformer.blocks.0.attn.to_q.alpha", &alpha, 0, 1, 0),
                         view("transformer.blocks.0.attn.to_v.lora_A.weight", f->a2, 2, NR, NI),
                         view("transformer.blocks.0.attn.to_v.lora_B.weight", f->b2, 2, NO, NR)};
    diff[2].nbytes = sizeof(float);
    assert_int_equal(lk_st_save(f->ad_diff, diff, 5, NULL, 0), LK_OK);

    /* PEFT folder: to_q only, lora_alpha 8, r 4 (scale 2). */
    assert_int_equal(mkdir(f->ad_peft, 0755), 0);
    char *st = tu_path(f->ad_peft, "adapter_model.safetensors");
    char *cfg = tu_path(f->ad_peft, "adapter_config.json");
    lk_tensor peft[2] = {view("base_model.model.blocks.0.attn.to_q.lora_A.weight", f->a3, 2, NR, NI),
                         view("base_model.model.blocks.0.attn.to_q.lora_B.weight", f->b3, 2, NO, NR)};
    assert_int_equal(lk_st_save(st, peft, 2, NULL, 0), LK_OK);
    const char *json = "{\"peft_type\": \"LORA\", \"r\": 4, \"lora_alpha\": 8, \"use_rslora\": false,"
                       " \"target_modules\": [\"to_q\"], \"bias\": \"none\"}";
    assert_int_equal(tu_write_file(cfg, json, strlen(json)), 0);
    free(st);
    free(cfg);
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    tu_rmtree(f->dir);
    free(f->dir);
    free(f->base);
    free(f->ad_diff);
    free(f->ad_peft);
    free(f->out);
    free(f->base_bytes);
    free(f);
    return 0;
}

/* The directory holds exactly the inputs: no output, no temporary. */
static void assert_dir_clean(const fixture *f) {
    DIR *d = opendir(f->dir);
    assert_non_null(d);
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        const char *n = e->d_name;
        if (!strcmp(n, ".") || !strcmp(n, "..") || !strcmp(n, "base.safetensors") ||
            !strcmp(n, "style.safetensors") || !strcmp(n, "peft") ||
            !strcmp(n, "trunc.safetensors"))
            continue;
        fail_msg("left behind in the output directory: %s", n);
    }
    closedir(d);
}

static void assert_base_intact(const fixture *f) {
    size_t n;
    void *now = tu_read_file(f->base, &n);
    assert_non_null(now);
    assert_int_equal(n, f->base_len);
    assert_memory_equal(now, f->base_bytes, n);
    free(now);
}

/* Double-precision reference: W + sum_t s_t * c_t * B_t @ A_t, rounded to f32. */
static void reference(float *dst, const float *w, const float *const *as, const float *const *bs,
                      const double *scales, int nt) {
    for (int o = 0; o < NO; o++)
        for (int i = 0; i < NI; i++) {
            double acc = w[o * NI + i];
            for (int t = 0; t < nt; t++) {
                double d = 0;
                for (int k = 0; k < NR; k++) d += (double)bs[t][o * NR + k] * as[t][k * NI + i];
                acc += scales[t] * d;
            }
            dst[o * NI + i] = (float)acc;
        }
}

static void assert_fused_output(const fixture *f) {
    lk_st *st;
    assert_int_equal(lk_st_open(f->out, &st), LK_OK);
    float ref_q[NO * NI], ref_v[NO * NI];
    /* style at 0.5: to_q c = 2/4, to_v c = 4/4 (no alpha tensor: alpha = r);
     * peft at 1.0: to_q c = 8/4. */
    const float *aq[2] = {f->a1, f->a3}, *bq[2] = {f->b1, f->b3};
    const double sq[2] = {0.5 * 0.5, 1.0 * 2.0};
    reference(ref_q, f->w_q, aq, bq, sq, 2);
    const float *av[1] = {f->a2}, *bv[1] = {f->b2};
    const double sv[1] = {0.5 * 1.0};
    reference(ref_v, f->w_v, av, bv, sv, 1);
    const struct {
        const char *name;
        const float *ref;
        size_t n;
    } want[3] = {{"blocks.0.attn.to_q.weight", ref_q, NO * NI},
                 {"blocks.0.attn.to_v.weight", ref_v, NO * NI},
                 {"blocks.0.norm.weight", f->norm, NI}};
    assert_int_equal(lk_st_count(st), 3);
    for (int k = 0; k < 3; k++) {
        long i = lk_st_find(st, want[k].name);
        assert_true(i >= 0);
        const float *got = lk_st_tensor(st, (size_t)i)->data;
        for (size_t j = 0; j < want[k].n; j++)
            /* fp32 accumulation vs double: a few ulp on values of order 1. */
            assert_true(fabsf(got[j] - want[k].ref[j]) <= 1e-5f * (1.0f + fabsf(want[k].ref[j])));
    }
    lk_st_close(st);
}

static lk_status fuse(const fixture *f) {
    lk_fuse_input in[2] = {{f->ad_diff, 0.5f, LK_FORMAT_AUTO}, {f->ad_peft, 1.0f, LK_FORMAT_AUTO}};
    lk_fuse_file_opts o = {.fuse = {.threads = 1}};
    lk_fuse_stats stats;
    return lk_fuse_file(f->base, in, 2, f->out, &o, &stats);
}

/* Fails allocation k = 1, 2, ... of one whole fuse until a fuse needs fewer
 * than k allocations, i.e. until every allocation has failed once. */
static void test_fuse_every_allocation_fails(void **state) {
    fixture *f = *state;
    unsigned long k, absorbed = 0;
    for (k = 1;; k++) {
        lk_alloc_fail_at(k);
        lk_status s = fuse(f);
        unsigned long made = lk_alloc_count();
        lk_alloc_fail_at(0);
        if (made < k) {
            if (s != LK_OK) fail_msg("fuse failed with no injected failure: %s", lk_last_error());
            break;
        }
        if (s == LK_OK) {
            /* An optional allocation (the writer's best-effort directory
             * fsync after the rename) may fail without failing the fuse:
             * acceptable only if the output is complete and correct. */
            assert_fused_output(f);
            assert_base_intact(f);
            unlink(f->out);
            absorbed++;
            continue;
        }
        if (s != LK_ERR_NOMEM)
            fail_msg("allocation %lu of %lu failed: want LK_ERR_NOMEM, got %s: %s", k, made,
                     lk_status_str(s), lk_last_error());
        assert_true(lk_last_error()[0] != '\0');
        assert_false(tu_exists(f->out));
        assert_dir_clean(f);
        assert_base_intact(f);
    }
    print_message("fuse: each of %lu allocations failed in turn: %lu clean LK_ERR_NOMEM, %lu absorbed "
                  "with a correct output\n", k - 1, k - 1 - absorbed, absorbed);
    assert_true(absorbed <= 1);
    assert_true(k > 5); /* the sweep really walked the fuse */
    assert_fused_output(f);
    assert_base_intact(f);
    unlink(f->out);
}

/* The base shrinks to half its size right after the fuse maps it. Runs in a
 * child so that a SIGBUS is observed instead of killing the test runner. */
static void test_fuse_base_truncated_after_open(void **state) {
    fixture *f = *state;
    char *copy = tu_path(f->dir, "trunc.safetensors");
    assert_int_equal(tu_write_file(copy, f->base_bytes, f->base_len), 0);
    struct stat sb;
    assert_int_equal(stat(copy, &sb), 0);
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* cmocka traps these in the parent's test runner; the child must die
         * of them so the parent sees what really happened. */
        signal(SIGBUS, SIG_DFL);
        signal(SIGSEGV, SIG_DFL);
        signal(SIGILL, SIG_DFL);
        signal(SIGFPE, SIG_DFL);
        g_trunc.dev = sb.st_dev;
        g_trunc.ino = sb.st_ino;
        snprintf(g_trunc.path, sizeof g_trunc.path, "%s", copy);
        g_trunc.armed = 1;
        lk_fuse_input in[1] = {{f->ad_diff, 0.5f, LK_FORMAT_AUTO}};
        lk_fuse_file_opts o = {.fuse = {.threads = 1}};
        lk_status s = lk_fuse_file(copy, in, 1, f->out, &o, NULL);
        if (!g_trunc.fired) _exit(3); /* the reader no longer maps: update the hook */
        if (s == LK_OK) _exit(4);
        fprintf(stderr, "truncated base refused: %s: %s\n", lk_status_str(s), lk_last_error());
        _exit(lk_last_error()[0] ? 0 : 5);
    }
    int st;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    /* Whatever happened, the final output name must not exist. */
    assert_false(tu_exists(f->out));
    if (WIFSIGNALED(st))
        fail_msg("fuse killed by signal %d (%s) reading a base truncated after open", WTERMSIG(st),
                 strsignal(WTERMSIG(st)));
    assert_true(WIFEXITED(st));
    if (WEXITSTATUS(st) == 3) fail_msg("the truncation hook never fired (base not mmapped?)");
    if (WEXITSTATUS(st) == 4) fail_msg("fuse of a truncated base succeeded");
    assert_int_equal(WEXITSTATUS(st), 0);
    assert_dir_clean(f);
    unlink(copy);
    free(copy);
}

int main(void) {
    lk_log_set_level(LK_LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fuse_every_allocation_fails),
        cmocka_unit_test(test_fuse_base_truncated_after_open),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
