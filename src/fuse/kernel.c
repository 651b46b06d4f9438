/* kernel.c — the one fusion kernel: W_out = W_in + sum_t scale_t * (B_t @ A_t).
 *
 * Shapes: W out x in (F32/F16/BF16), A_t r_t x in, B_t out x r_t (any mix of
 * F32/F16/BF16). Every caller (lk_fuse_file, the hot-swap tracker, adapter
 * export) goes through lk_fuse_tensor, so speed and determinism live here.
 *
 * How: the factors are small, so they are converted to fp32 once per call:
 * Acat (R x in, all A_t stacked in the given term order; also copied into
 * panels of 32 columns), and Bs (out x R, each B_t scaled by its scale_t,
 * rounded to fp32 once). Threads take chunks of 16 rows; within a chunk,
 * for each column tile (A's slice kept near 256 KB, in L2), four rows at a
 * time get their delta in a 4 x 32 register block, acc[j] = Bs[o,0]*A[0,j]
 * + Bs[o,1]*A[1,j] + ... strictly left to right; for BF16 weights the block
 * is added to W and rounded right there in registers, for the other dtypes
 * each row segment of W is read (prefetched during the sums), added in
 * fp32 and rounded once (RNE) into W's dtype. W is read once and written once; the delta exists
 * only four row segments at a time, never out x in. On a 2-vCPU Zen 4 the
 * sums run near the FP pipes' peak (mul and add on separate pipes, so FMA
 * would not be faster); at low rank the W pass dominates.
 *
 * Determinism: every element goes through the same sequence of fp32
 * operations (no FMA contraction: fp-contract is off for this file, so the
 * AVX-512, AVX2 and baseline clones all give the same bits), and the work
 * split (chunks of rows handed out to threads) never changes what is
 * computed for an element, only who computes it. Worker threads copy the
 * caller's floating-point environment (rounding, FTZ/DAZ). Hence the bytes
 * depend only on W, the terms and their order; callers fix the order. */
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC optimize("fp-contract=off")
#endif
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#include "lorakit/fuse.h"
#include "lorakit/alloc.h"
#include "fuse/fuse_internal.h"

#include <fenv.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(LK_NO_CLONES)
#define LK_KCLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define LK_KCLONES
#endif

#define ROWS_PER_CHUNK 16

/* acc[j] = sum_k b[k] * A[k*lda + j], k ascending, j < n. The 4-way unroll
 * keeps acc in a register across four k steps without changing the order
 * of the additions. */
LK_KCLONES static void delta_row(float *restrict acc, const float *restrict A, size_t lda,
                                 const float *restrict b, size_t R, size_t n) {
    for (size_t j = 0; j < n; j++) acc[j] = b[0] * A[j];
    size_t k = 1;
    for (; k + 4 <= R; k += 4) {
        const float *a0 = A + k * lda, *a1 = a0 + lda, *a2 = a1 + lda, *a3 = a2 + lda;
        const float b0 = b[k], b1 = b[k + 1], b2 = b[k + 2], b3 = b[k + 3];
        for (size_t j = 0; j < n; j++) {
            float s = acc[j];
            float p0 = b0 * a0[j];
            s = s + p0;
            float p1 = b1 * a1[j];
            s = s + p1;
            float p2 = b2 * a2[j];
            s = s + p2;
            float p3 = b3 * a3[j];
            acc[j] = s + p3;
        }
    }
    for (; k < R; k++) {
        const float *a = A + k * lda;
        const float bk = b[k];
        for (size_t j = 0; j < n; j++) {
            float p = bk * a[j];
            acc[j] = acc[j] + p;
        }
    }
}

typedef float v16 __attribute__((vector_size(64)));
/* Unaligned 16-float load/store (macros: passing vectors to functions
 * would tie the ABI to the clone's ISA). */
#define LD16(v, p) memcpy(&(v), (p), sizeof(v16))
#define ST16(p, v) memcpy((p), &(v), sizeof(v16))

/* The same sums as delta_row for four rows at once: acc[r*ldc + j] =
 * sum_k b[r*R + k] * A[k*lda + j], k ascending, for r < 4, j < n. A 4 x 32
 * block of sums lives in registers for the whole k loop, so each A value
 * loaded serves four rows; A is read from Ap, a copy of A packed in panels
 * of 32 columns (Ap[(j/32)*R*32 + k*32 + j%32], j a multiple of 32 here),
 * so a block's k loop streams contiguous memory. Columns past the last full
 * panel come from A. Every element still sees exactly the sequence s = p0,
 * s = s + p1, ..., so the bits equal delta_row's. */
/* The sums of one 4 x 32 block into v16 c[4][2]: row r, columns j .. j+31,
 * k ascending (shared by delta_4rows and fused_4rows_bf16). */
#define LK_BLOCK_4X32(c, Ap, b, R, j)                                                   \
    do {                                                                               \
        const float *a_ = (Ap) + (j) * (R);                                            \
        v16 x0_, x1_;                                                                  \
        LD16(x0_, a_);                                                                 \
        LD16(x1_, a_ + 16);                                                            \
        for (int r_ = 0; r_ < 4; r_++) {                                               \
            c[r_][0] = (b)[r_ * (R)] * x0_;                                            \
            c[r_][1] = (b)[r_ * (R)] * x1_;                                            \
        }                                                                              \
        for (size_t k_ = 1; k_ < (R); k_++) {                                          \
            a_ = (Ap) + (j) * (R) + k_ * 32;                                           \
            LD16(x0_, a_);                                                             \
            LD16(x1_, a_ + 16);                                                        \
            for (int r_ = 0; r_ < 4; r_++) {                                           \
                const float e_ = (b)[r_ * (R) + k_];                                   \
                c[r_][0] = c[r_][0] + e_ * x0_;                                        \
                c[r_][1] = c[r_][1] + e_ * x1_;                                        \
            }                                                                          \
        }                                                                              \
    } while (0)

LK_KCLONES static void delta_4rows(float *restrict acc, size_t ldc, const float *restrict A, size_t lda,
                                   const float *restrict Ap, const float *restrict b, size_t R, size_t n) {
    size_t j = 0;
    for (; j + 32 <= n; j += 32) {
        v16 c[4][2];
        LK_BLOCK_4X32(c, Ap, b, R, j);
        for (int r = 0; r < 4; r++) {
            ST16(acc + r * ldc + j, c[r][0]);
            ST16(acc + r * ldc + j + 16, c[r][1]);
        }
    }
    for (; j < n; j++)
        for (size_t r = 0; r < 4; r++) {
            const float *br = b + r * R;
            float sum = br[0] * A[j];
            for (size_t k = 1; k < R; k++) {
                float p = br[k] * A[k * lda + j];
                sum = sum + p;
            }
            acc[r * ldc + j] = sum;
        }
}

typedef uint32_t v16u __attribute__((vector_size(64)));
#if defined(__clang__) || __GNUC__ >= 12
#define LK_SHUF(v, ...) __builtin_shufflevector((v), (v), __VA_ARGS__)
#else
#define LK_SHUF(v, ...) __builtin_shuffle((v), (v16u){__VA_ARGS__})
#endif
typedef uint16_t v16h __attribute__((vector_size(32)));

/* BF16 weights, the common case: delta_4rows' sums for each full 4 x 32
 * block are added to W and rounded while still in registers, so W is read
 * and written once with no trip through acc. The rounding is dtype.c's
 * f32 -> bf16 (RNE; NaN kept, quiet bit when the kept payload is 0), in
 * vector form: tests/test_fuse_kernel.c checks the bits against
 * lk_from_f32. A block in which some finite weight would become
 * non-finite is not written: its sums go to acc and its column is
 * returned, for the caller to finish on the checked path. Returns n when
 * every full block is done. win and wout may be the same memory. */
LK_KCLONES static size_t fused_4rows_bf16(const unsigned char *win, unsigned char *wout, size_t ldw,
                                          float *restrict acc, size_t ldc, const float *restrict Ap,
                                          const float *restrict b, size_t R, size_t j, size_t n, uint32_t lim) {
    for (; j + 32 <= n; j += 32) {
        v16 c[4][2];
        LK_BLOCK_4X32(c, Ap, b, R, j);
        v16u res[4][2], bad = {0};
        for (int r = 0; r < 4; r++)
            for (int h = 0; h < 2; h++) {
                v16h w16;
                memcpy(&w16, win + r * ldw + (j + 16 * (size_t)h) * 2, sizeof w16);
                v16u u = __builtin_convertvector(w16, v16u) << 16;
                v16 x, sum;
                memcpy(&x, &u, sizeof x);
                sum = x + c[r][h];
                memcpy(&res[r][h], &sum, sizeof sum);
                bad |= (v16u)((u & 0x7fffffffu) < 0x7f800000u) & (v16u)((res[r][h] & 0x7fffffffu) >= lim);
            }
        /* horizontal OR in four shuffles (no lane-by-lane extraction) */
        bad |= LK_SHUF(bad, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
        bad |= LK_SHUF(bad, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
        bad |= LK_SHUF(bad, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
        bad |= LK_SHUF(bad, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0);
        if (bad[0]) {
            for (int r = 0; r < 4; r++) {
                ST16(acc + r * ldc + j, c[r][0]);
                ST16(acc + r * ldc + j + 16, c[r][1]);
            }
            return j;
        }
        for (int r = 0; r < 4; r++)
            for (int h = 0; h < 2; h++) {
                v16u u = res[r][h], t = u >> 16;
                v16u rn = (u + 0x7fffu + (t & 1u)) >> 16;
                v16u nan = (v16u)((u & 0x7fffffffu) > 0x7f800000u);
                v16u q = t | ((v16u)((t & 0x7fu) == 0u) & 0x40u);
                v16h o16 = __builtin_convertvector((nan & q) | (~nan & rn), v16h);
                memcpy(wout + r * ldw + (j + 16 * (size_t)h) * 2, &o16, sizeof o16);
            }
    }
    return n;
}

/* |r| bits at or above lim round to Inf (or are NaN) in the weight dtype. */
static uint32_t overflow_bits(lk_dtype dt) {
    switch (dt) {
    case LK_DTYPE_F16: return 0x477ff000u;  /* 65520.0f */
    case LK_DTYPE_BF16: return 0x7f7f8000u; /* halfway to Inf, ties to the even Inf */
    default: return 0x7f800000u;
    }
}

/* w[j] += acc[j]; returns 1 when some finite w gives a result that is, or
 * rounds to, a non-finite value in the weight dtype. */
LK_KCLONES static int add_delta(float *restrict w, const float *restrict acc, size_t n, uint32_t lim) {
    uint32_t bad = 0;
    for (size_t j = 0; j < n; j++) {
        float x = w[j];
        float r = x + acc[j];
        uint32_t ux, ur;
        memcpy(&ux, &x, 4);
        memcpy(&ur, &r, 4);
        bad |= ((ux & 0x7fffffffu) < 0x7f800000u) & ((ur & 0x7fffffffu) >= lim);
        w[j] = r;
    }
    return bad != 0;
}

/* As add_delta, reading W straight from its bytes (BF16 widens by a
 * shift, F32 as is) into w: one pass instead of convert-then-add. The same
 * fp32 addition, hence the same bits. Loads go through memcpy: tensors in
 * a safetensors mmap need not be aligned to their element size. */
#define LK_ADD_FROM(NAME, T, WIDEN)                                                                   \
    LK_KCLONES static int NAME(float *restrict w, const unsigned char *restrict src,                \
                               const float *restrict acc,                                           \
                               size_t n, uint32_t lim) {                                            \
        uint32_t bad = 0;                                                                           \
        for (size_t j = 0; j < n; j++) {                                                            \
            T v;                                                                                    \
            memcpy(&v, src + j * sizeof(T), sizeof(T));                                             \
            uint32_t ux = WIDEN(v), ur;                                                             \
            float x, r;                                                                             \
            memcpy(&x, &ux, 4);                                                                     \
            r = x + acc[j];                                                                         \
            memcpy(&ur, &r, 4);                                                                     \
            bad |= ((ux & 0x7fffffffu) < 0x7f800000u) & ((ur & 0x7fffffffu) >= lim);               \
            w[j] = r;                                                                               \
        }                                                                                           \
        return bad != 0;                                                                            \
    }
#define LK_WIDEN_BF16(h) ((uint32_t)(h) << 16)
#define LK_WIDEN_F32(u) (u)
LK_ADD_FROM(add_from_bf16, uint16_t, LK_WIDEN_BF16)
LK_ADD_FROM(add_from_f32, uint32_t, LK_WIDEN_F32)

typedef struct kjob {
    void *w_out;
    const void *w_in;
    lk_dtype dt;
    size_t esz, out, in, R, nc, n_chunks;
    uint32_t lim;
    const float *A;  /* R x in */
    const float *Ap; /* A in panels of 32 columns (see delta_4rows) */
    const float *Bs; /* out x R */
    float *scratch;  /* per worker: acc[4][nc] + w[nc] */
    atomic_size_t next;
    fenv_t env;
} kjob;

typedef struct kworker {
    kjob *job;
    float *acc, *w;
    size_t bad_at; /* first element index o*in+j that became non-finite, or SIZE_MAX */
    float bad_w, bad_r;
} kworker;

/* W[o, j0 .. j0+n) += acc, rounded once into w_out; notes the first
 * element that became non-finite. */
static void finish_row(kworker *wk, size_t o, size_t j0, size_t n, const float *acc) {
    kjob *jb = wk->job;
    size_t off = o * jb->in + j0;
    const void *src = (const char *)jb->w_in + off * jb->esz;
    int bad;
    if (jb->dt == LK_DTYPE_BF16) {
        bad = add_from_bf16(wk->w, src, acc, n, jb->lim);
    } else if (jb->dt == LK_DTYPE_F32) {
        bad = add_from_f32(wk->w, src, acc, n, jb->lim);
    } else {
        lk_to_f32(wk->w, src, jb->dt, n);
        bad = add_delta(wk->w, acc, n, jb->lim);
    }
    if (bad && off < wk->bad_at) {
        /* Rare path: find the first offender for the message. */
        for (size_t j = 0; j < n && off + j < wk->bad_at; j++) {
            float orig;
            lk_to_f32(&orig, (const char *)jb->w_in + (off + j) * jb->esz, jb->dt, 1);
            uint16_t h;
            float rounded = wk->w[j];
            if (jb->dt != LK_DTYPE_F32) {
                lk_from_f32(&h, &rounded, jb->dt, 1);
                lk_to_f32(&rounded, &h, jb->dt, 1);
            }
            if (isfinite(orig) && !isfinite(rounded)) {
                wk->bad_at = off + j;
                wk->bad_w = orig;
                wk->bad_r = rounded;
            }
        }
    }
    lk_from_f32((char *)jb->w_out + off * jb->esz, wk->w, jb->dt, n);
}

static void run_worker(kworker *wk) {
    kjob *jb = wk->job;
    const size_t in = jb->in, R = jb->R, nc = jb->nc;
    for (;;) {
        size_t c = atomic_fetch_add_explicit(&jb->next, 1, memory_order_relaxed);
        if (c >= jb->n_chunks) break;
        size_t o0 = c * ROWS_PER_CHUNK;
        size_t o1 = o0 + ROWS_PER_CHUNK < jb->out ? o0 + ROWS_PER_CHUNK : jb->out;
        for (size_t j0 = 0; j0 < in; j0 += nc) {
            size_t n = in - j0 < nc ? in - j0 : nc, o = o0;
            for (; o + 4 <= o1; o += 4) {
                /* Ask for these rows of W now; they arrive while the sums
                 * are computed instead of stalling the add pass. */
                for (size_t r = 0; r < 4 && jb->dt != LK_DTYPE_BF16; r++) {
                    const char *p = (const char *)jb->w_in + ((o + r) * in + j0) * jb->esz;
                    for (size_t b = 0; b < n * jb->esz; b += 64) __builtin_prefetch(p + b, 0, 2);
                }
                if (jb->dt == LK_DTYPE_BF16) {
                    const size_t n32 = n & ~(size_t)31, ldw = in * 2, base = (o * in + j0) * 2;
                    size_t j = 0;
                    while ((j = fused_4rows_bf16((const unsigned char *)jb->w_in + base, (unsigned char *)jb->w_out + base,
                                                 ldw, wk->acc, nc, jb->Ap + j0 * R, jb->Bs + o * R, R, j, n32,
                                                 jb->lim)) < n32) {
                        for (size_t r = 0; r < 4; r++) finish_row(wk, o + r, j0 + j, 32, wk->acc + r * nc + j);
                        j += 32;
                    }
                    if (n32 < n) {
                        delta_4rows(wk->acc, nc, jb->A + j0 + n32, in, jb->Ap, jb->Bs + o * R, R, n - n32);
                        for (size_t r = 0; r < 4; r++) finish_row(wk, o + r, j0 + n32, n - n32, wk->acc + r * nc);
                    }
                    continue;
                }
                delta_4rows(wk->acc, nc, jb->A + j0, in, jb->Ap + j0 * R, jb->Bs + o * R, R, n);
                for (size_t r = 0; r < 4; r++) finish_row(wk, o + r, j0, n, wk->acc + r * nc);
            }
            for (; o < o1; o++) {
                delta_row(wk->acc, jb->A + j0, in, jb->Bs + o * R, R, n);
                finish_row(wk, o, j0, n, wk->acc);
            }
        }
    }
}

static void *thread_main(void *arg) {
    kworker *wk = arg;
    fesetenv(&wk->job->env);
    run_worker(wk);
    return NULL;
}

int lk_fuse_default_threads(void) {
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    if (n > LK_FUSE_MAX_THREADS) n = LK_FUSE_MAX_THREADS;
    return (int)n;
}

static lk_status check_factor(const lk_tensor *t, const char *what, const char *name, size_t ti) {
    if (!t) return lk_error(LK_ERR_ARG, "%s: term %zu: %s is NULL", name, ti, what);
    if (!lk_dtype_is_fusable(t->dtype))
        return lk_error(LK_ERR_DTYPE, "%s: term %zu: %s has dtype %s; only F32, F16 and BF16 can be fused",
                        name, ti, what, lk_dtype_name(t->dtype));
    if (t->ndim != 2)
        return lk_error(LK_ERR_SHAPE, "%s: term %zu: %s has %d dimensions, expected 2", name, ti, what, t->ndim);
    if (t->shape[0] <= 0 || t->shape[1] <= 0)
        return lk_error(LK_ERR_SHAPE, "%s: term %zu: %s is %lldx%lld", name, ti, what,
                        (long long)t->shape[0], (long long)t->shape[1]);
    if (!t->data) return lk_error(LK_ERR_ARG, "%s: term %zu: %s has no data", name, ti, what);
    return LK_OK;
}

lk_status lk_fuse_tensor(void *w_out, const void *w_in, lk_dtype dtype, int64_t out, int64_t in,
                         const lk_fuse_term *terms, size_t n_terms, const lk_fuse_opts *opts,
                         const char *name) {
    if (!name) name = "(tensor)";
    if (!w_out || !w_in) return lk_error(LK_ERR_ARG, "%s: NULL weight buffer", name);
    if (!lk_dtype_is_fusable(dtype))
        return lk_error(LK_ERR_DTYPE, "%s: weight dtype %s cannot be fused (only F32, F16, BF16)", name,
                        lk_dtype_name(dtype));
    if (out <= 0 || in <= 0)
        return lk_error(LK_ERR_SHAPE, "%s: weight shape %lldx%lld", name, (long long)out, (long long)in);
    if (n_terms && !terms) return lk_error(LK_ERR_ARG, "%s: NULL terms", name);
    const size_t esz = lk_dtype_size(dtype), O = (size_t)out, I = (size_t)in;
    size_t numel, wbytes;
    if ((uint64_t)out > SIZE_MAX || (uint64_t)in > SIZE_MAX || !lk_checked_mul(O, I, &numel) ||
        !lk_checked_mul(numel, esz, &wbytes))
        return lk_error(LK_ERR_SHAPE, "%s: weight %lldx%lld is too large", name, (long long)out, (long long)in);

    /* Validate everything first; count the total rank R of the non-zero terms. */
    size_t R = 0;
    for (size_t t = 0; t < n_terms; t++) {
        lk_status s;
        if ((s = check_factor(terms[t].A, "A", name, t)) || (s = check_factor(terms[t].B, "B", name, t)))
            return s;
        const lk_tensor *A = terms[t].A, *B = terms[t].B;
        if (A->shape[1] != in || B->shape[0] != out || B->shape[1] != A->shape[0])
            return lk_error(LK_ERR_SHAPE, "%s: term %zu: A is %lldx%lld and B is %lldx%lld but the weight is %lldx%lld",
                            name, t, (long long)A->shape[0], (long long)A->shape[1], (long long)B->shape[0],
                            (long long)B->shape[1], (long long)out, (long long)in);
        if (!isfinite(terms[t].scale))
            return lk_error(LK_ERR_NONFINITE, "%s: term %zu: scale is %g", name, t, (double)terms[t].scale);
        if (terms[t].scale != 0.0f && !lk_checked_add(R, (size_t)A->shape[0], &R))
            return lk_error(LK_ERR_SHAPE, "%s: total rank overflows", name);
    }
    if (R == 0) { /* nothing to add: the bytes stay exactly as they are */
        if (w_out != w_in) memmove(w_out, w_in, wbytes);
        return LK_OK;
    }

    int threads = opts && opts->threads > 0 ? opts->threads : lk_fuse_default_threads();
    if (threads > LK_FUSE_MAX_THREADS) threads = LK_FUSE_MAX_THREADS;
    size_t n_chunks = (O + ROWS_PER_CHUNK - 1) / ROWS_PER_CHUNK;
    if ((size_t)threads > n_chunks) threads = (int)n_chunks;
    /* Column tile: keep the R x nc slice of A near 256 KB so it stays in L2
     * while a chunk's rows run over it; a multiple of 32 floats. */
    size_t nc = (65536 / R) & ~(size_t)31;
    if (nc < 64) nc = 64;
    if (nc > I) nc = I;

    size_t a_n, b_n, s_n, tot;
    const size_t I32 = I & ~(size_t)31; /* columns in full panels */
    if (!lk_checked_mul(R, I, &a_n) || !lk_checked_mul(O, R, &b_n) || !lk_checked_add(a_n, a_n, &tot) ||
        !lk_checked_mul((size_t)threads * 5, nc, &s_n) || !lk_checked_add(tot, b_n, &tot) ||
        !lk_checked_add(tot, s_n, &tot) || !lk_checked_mul(tot, sizeof(float), &tot))
        return lk_error(LK_ERR_SHAPE, "%s: factors too large", name);
    float *mem = lk_malloc(tot);
    kworker *wks = lk_calloc((size_t)threads, sizeof *wks);
    pthread_t *tids = lk_calloc((size_t)threads, sizeof *tids);
    if (!mem || !wks || !tids) {
        lk_free(mem);
        lk_free(wks);
        lk_free(tids);
        return lk_error(LK_ERR_NOMEM, "%s: out of memory for the fusion factors (%zu bytes)", name, tot);
    }
    float *Acat = mem, *Bs = mem + a_n, *Ap = Bs + b_n;
    size_t koff = 0;
    for (size_t t = 0; t < n_terms; t++) {
        if (terms[t].scale == 0.0f) continue;
        const lk_tensor *A = terms[t].A, *B = terms[t].B;
        size_t r = (size_t)A->shape[0];
        lk_to_f32(Acat + koff * I, A->data, A->dtype, r * I);
        const size_t besz = lk_dtype_size(B->dtype);
        const float sc = terms[t].scale;
        for (size_t o = 0; o < O; o++) {
            float *row = Bs + o * R + koff;
            lk_to_f32(row, (const char *)B->data + o * r * besz, B->dtype, r);
            for (size_t k = 0; k < r; k++) row[k] = sc * row[k];
        }
        koff += r;
    }

    for (size_t jb = 0; jb < I32; jb += 32)
        for (size_t k = 0; k < R; k++) memcpy(Ap + jb * R + k * 32, Acat + k * I + jb, 32 * sizeof(float));

    kjob job = {.w_out = w_out, .w_in = w_in, .dt = dtype, .esz = esz, .out = O, .in = I, .R = R,
                .nc = nc, .n_chunks = n_chunks, .lim = overflow_bits(dtype), .A = Acat, .Ap = Ap, .Bs = Bs, .scratch = Ap + a_n};
    atomic_init(&job.next, 0);
    fegetenv(&job.env);
    for (int t = 0; t < threads; t++) {
        wks[t].job = &job;
        wks[t].acc = job.scratch + (size_t)t * 5 * nc; /* 4 rows of sums */
        wks[t].w = wks[t].acc + 4 * nc;
        wks[t].bad_at = SIZE_MAX;
    }
    /* Threads that fail to start simply leave their share to the others. */
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&tids[t], NULL, thread_main, &wks[t]) != 0) break;
        started = t;
    }
    run_worker(&wks[0]);
    for (int t = 1; t <= started; t++) pthread_join(tids[t], NULL);

    size_t bad_at = SIZE_MAX;
    float bw = 0, br = 0;
    for (int t = 0; t <= started; t++)
        if (wks[t].bad_at < bad_at) {
            bad_at = wks[t].bad_at;
            bw = wks[t].bad_w;
            br = wks[t].bad_r;
        }
    lk_free(mem);
    lk_free(wks);
    lk_free(tids);
    if (bad_at != SIZE_MAX && !(opts && opts->allow_nonfinite))
        return lk_error(LK_ERR_NONFINITE,
                        "%s: fusion made element [%zu, %zu] non-finite (weight %g became %g); "
                        "allow_nonfinite (--allow-nonfinite) keeps it",
                        name, bad_at / I, bad_at % I, (double)bw, (double)br);
    return LK_OK;
}
