/* gemm.c — the one matrix-multiply entry point (gemm.h): the LoRA layers
 * and the demo transformer's kernels.
 *
 * OpenBLAS's sgemm when the build found OpenBLAS (LK_HAVE_BLAS), otherwise
 * a plain loop nest (correct, slow: it exists so the library still builds
 * and tests without BLAS). OpenBLAS is not linked but loaded with dlopen
 * the first time a product is needed (lk_gemm_prepare): at load time it
 * starts one thread per core and maps a buffer of about 128 MiB for each,
 * and when such a mapping fails (under `ulimit -v`) it retries forever, so
 * linking it made every command hang under an address-space limit, even
 * `--help`, although only training multiplies. Before loading, the address
 * space OpenBLAS will map is reserved once and released (PROT_NONE, no
 * memory touched), so a limit too low is an out-of-memory error instead of
 * a hang, and one warm-up product right after loading has every thread map
 * its buffer while that space is free. */
#include "lora/gemm.h"
#include "lorakit/alloc.h"
#include "lorakit/log.h"
#include "lorakit/status.h"

#include <stddef.h>

#ifdef LK_HAVE_BLAS
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/resource.h>

/* cblas_sgemm's signature and the CBLAS enum values it takes (the CBLAS
 * standard's: CblasRowMajor 101, CblasNoTrans 111, CblasTrans 112). */
typedef void (*sgemm_fn)(int order, int ta, int tb, int M, int N, int K, float alpha, const float *A, int lda,
                         const float *B, int ldb, float beta, float *C, int ldc);
enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112 };

#ifndef LK_OPENBLAS_SONAME
#define LK_OPENBLAS_SONAME "libopenblas.so.0"
#endif
#ifndef LK_OPENBLAS_PATH
#define LK_OPENBLAS_PATH LK_OPENBLAS_SONAME
#endif

/* OpenBLAS's per-thread buffer (BUFFER_SIZE 128 MiB on x86-64, plus a
 * guard page, as seen mapped at load) and a thread's stack. */
#define OB_BUFFER_BYTES ((size_t)128 << 20)
#define OB_THREAD_STACK ((size_t)8 << 20)

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static sgemm_fn g_sgemm;
static lk_status g_status;
static char g_why[512];

/* The threads OpenBLAS will start: its environment variables in its own
 * order of precedence, else the CPUs this process may run on. */
static long ob_threads(void) {
    static const char *const vars[] = {"OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        long n = v ? strtol(v, NULL, 10) : 0;
        if (n > 0) return n;
    }
    cpu_set_t set;
    if (!sched_getaffinity(0, sizeof set, &set) && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    return 1;
}

static void load(void) {
    long nt = ob_threads();
    if (nt > 1024) nt = 1024;
    size_t need = (size_t)nt * (OB_BUFFER_BYTES + OB_THREAD_STACK) + OB_BUFFER_BYTES;
    void *probe = mmap(NULL, need, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (probe == MAP_FAILED) {
        struct rlimit rl;
        char lim[64] = "unlimited";
        if (!getrlimit(RLIMIT_AS, &rl) && rl.rlim_cur != RLIM_INFINITY)
            snprintf(lim, sizeof lim, "%llu MiB", (unsigned long long)(rl.rlim_cur >> 20));
        g_status = LK_ERR_NOMEM;
        snprintf(g_why, sizeof g_why,
                 "out of memory: OpenBLAS (training's matrix products) needs about %zu MiB of address space for "
                 "its %ld threads' buffers, and this process cannot map that (address-space limit, ulimit -v: %s); "
                 "raise the limit or set OPENBLAS_NUM_THREADS lower",
                 need >> 20, nt, lim);
        return;
    }
    munmap(probe, need);
    void *h = dlopen(LK_OPENBLAS_SONAME, RTLD_NOW | RTLD_LOCAL);
    if (!h) h = dlopen(LK_OPENBLAS_PATH, RTLD_NOW | RTLD_LOCAL);
    if (h) g_sgemm = (sgemm_fn)dlsym(h, "cblas_sgemm");
    if (g_sgemm) { /* one product large enough for every thread, so their buffers are mapped now, while the
                      probe says the space is there, not at some later product after the model took it */
        enum { W = 256 };
        float *m = lk_calloc((size_t)3 * W * W, sizeof *m);
        if (m) g_sgemm(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_NO_TRANS, W, W, W, 1.0f, m, W, m + W * W, W, 0.0f,
                       m + 2 * W * W, W);
        lk_free(m);
    }
    if (!g_sgemm) {
        const char *e = dlerror();
        lk_log(LK_LOG_WARN, "OpenBLAS could not be loaded (%s); matrix products use lorakit's plain loops (slow)",
               e ? e : "no cblas_sgemm");
    }
}

lk_status lk_gemm_prepare(void) {
    pthread_once(&g_once, load);
    return g_status ? lk_error(g_status, "%s", g_why) : LK_OK;
}
#else
lk_status lk_gemm_prepare(void) { return LK_OK; }
#endif

void lk_sgemm(int transA, int transB, int M, int N, int K, float alpha, const float *A, int lda,
              const float *B, int ldb, float beta, float *C, int ldc) {
    if (M <= 0 || N <= 0) return;
#ifdef LK_HAVE_BLAS
    pthread_once(&g_once, load);
    if (K > 0 && g_sgemm) {
        g_sgemm(CBLAS_ROW_MAJOR, transA ? CBLAS_TRANS : CBLAS_NO_TRANS, transB ? CBLAS_TRANS : CBLAS_NO_TRANS, M, N,
                K, alpha, A, lda, B, ldb, beta, C, ldc);
        return;
    }
#endif
    for (int i = 0; i < M; i++) {
        float *c = C + (size_t)i * ldc;
        for (int j = 0; j < N; j++) {
            float acc = 0.0f;
            for (int k = 0; k < K; k++) {
                float a = transA ? A[(size_t)k * lda + i] : A[(size_t)i * lda + k];
                float b = transB ? B[(size_t)j * ldb + k] : B[(size_t)k * ldb + j];
                acc += a * b;
            }
            c[j] = alpha * acc + (beta == 0.0f ? 0.0f : beta * c[j]);
        }
    }
}
