/* algebra/linalg_prod.h — the two streamed products of linalg.h, written
 * once and included by linalg.c once per (element type, target): before
 * including, define LK_T (double or float), LK_V (a 64-byte GCC vector of
 * LK_T), LK_VL (its lanes), LK_QV (most vectors per tile: the registers the
 * target has), LK_FN(x) (the names) and LK_ATTR (the target attribute).
 *
 * Every output element is one accumulator updated in the order of its sum's
 * index (j for rows, the row for trans) by a multiply then an add (no FMA:
 * -ffp-contract=off), so neither the tile shape, the j blocking, the vector
 * width nor the target changes a bit: the tiles differ between targets only
 * in how many accumulators run side by side. */

typedef LK_T LK_FN(v) __attribute__((vector_size(LK_VL * sizeof(LK_T))));
typedef LK_T LK_FN(vu) __attribute__((vector_size(LK_VL * sizeof(LK_T)), aligned(sizeof(LK_T)), may_alias));
#define LK_V LK_FN(v)
#define LK_LD(p) (*(const LK_FN(vu) *)(p))
#define LK_ST(p, x) (*(LK_FN(vu) *)(p) = (x))

/* rows: R rows x QV vectors of Y from column vector v0, j in [j0, j1); the
 * partial sums are Y's (zero when j0 == 0). */
static inline __attribute__((always_inline)) void LK_FN(rtile)(const LK_T *d, size_t ldd, const LK_T *W, size_t c,
                                                              size_t j0, size_t j1, size_t v0, LK_T *Y, const int R,
                                                              const int QV) {
    LK_V a[4][5];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < QV; v++) {
            if (j0 == 0) a[r][v] = (LK_V){0};
            else a[r][v] = LK_LD(Y + r * c + (v0 + v) * LK_VL);
        }
    for (size_t j = j0; j < j1; j++) {
        LK_V w[5];
        for (int v = 0; v < QV; v++) w[v] = LK_LD(W + j * c + (v0 + v) * LK_VL);
        for (int r = 0; r < R; r++) {
            const LK_T x = d[r * ldd + j];
            for (int v = 0; v < QV; v++) a[r][v] += x * w[v];
        }
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < QV; v++) LK_ST(Y + r * c + (v0 + v) * LK_VL, a[r][v]);
}

/* trans: P's rows j0 .. j0 + J x QV vectors from v0 held in registers while
 * the k rows of d add into them in order. */
static inline __attribute__((always_inline)) void LK_FN(ttile)(const LK_T *d, size_t ldd, size_t k, const LK_T *Q,
                                                              size_t c, size_t j0, size_t v0, LK_T *P, const int J,
                                                              const int QV) {
    LK_V a[4][5];
    for (int jj = 0; jj < J; jj++)
        for (int v = 0; v < QV; v++) a[jj][v] = LK_LD(P + (j0 + jj) * c + (v0 + v) * LK_VL);
    for (size_t r = 0; r < k; r++) {
        LK_V q[5];
        for (int v = 0; v < QV; v++) q[v] = LK_LD(Q + r * c + (v0 + v) * LK_VL);
        for (int jj = 0; jj < J; jj++) {
            const LK_T x = d[r * ldd + j0 + jj];
            for (int v = 0; v < QV; v++) a[jj][v] += x * q[v];
        }
    }
    for (int jj = 0; jj < J; jj++)
        for (int v = 0; v < QV; v++) LK_ST(P + (j0 + jj) * c + (v0 + v) * LK_VL, a[jj][v]);
}

/* One tile of either product (T: trans), QV vectors from v0. */
static inline __attribute__((always_inline)) void LK_FN(tile)(const LK_T *d, size_t ldd, size_t k, const LK_T *W, size_t c,
                                                             size_t j0, size_t j1, size_t v0, LK_T *Y, const int R,
                                                             const int QV, const int T) {
    if (T) LK_FN(ttile)(d, ldd, k, W, c, j0, v0, Y, R, QV);
    else LK_FN(rtile)(d, ldd, W, c, j0, j1, v0, Y, R, QV);
}

/* The column vectors of a tile row (R rows of Y for rows, R rows of P from
 * j0 for trans), LK_QV at a time. */
static inline __attribute__((always_inline)) void LK_FN(cols)(const LK_T *d, size_t ldd, size_t k, const LK_T *W, size_t c,
                                                             size_t j0, size_t j1, LK_T *Y, const int R, const int T) {
    const size_t nv = c / LK_VL;
    for (size_t v0 = 0; v0 < nv; v0 += LK_QV) {
        size_t q = nv - v0 < LK_QV ? nv - v0 : LK_QV;
        switch (q) {
        case 1: LK_FN(tile)(d, ldd, k, W, c, j0, j1, v0, Y, R, 1, T); break;
        case 2: LK_FN(tile)(d, ldd, k, W, c, j0, j1, v0, Y, R, 2, T); break;
        case 3: LK_FN(tile)(d, ldd, k, W, c, j0, j1, v0, Y, R, 3, T); break;
        case 4: LK_FN(tile)(d, ldd, k, W, c, j0, j1, v0, Y, R, 4, T); break;
        default: LK_FN(tile)(d, ldd, k, W, c, j0, j1, v0, Y, R, 5, T); break;
        }
    }
}

/* Y (k x c) = d (k x n, row stride ldd) W (n x c); W's rows in blocks of
 * LK_LA_JB so that a block stays in cache across the k rows. */
LK_ATTR static void LK_FN(rows)(const LK_T *d, size_t ldd, size_t k, size_t n, const LK_T *W, size_t c, LK_T *Y) {
    for (size_t j0 = 0; j0 < n; j0 += LK_LA_JB) {
        size_t j1 = n - j0 < LK_LA_JB ? n : j0 + LK_LA_JB, r0 = 0;
        for (; r0 + 4 <= k; r0 += 4) LK_FN(cols)(d + r0 * ldd, ldd, 4, W, c, j0, j1, Y + r0 * c, 4, 0);
        for (; r0 < k; r0++) LK_FN(cols)(d + r0 * ldd, ldd, 1, W, c, j0, j1, Y + r0 * c, 1, 0);
    }
}

/* P (n x c) += d^T Q (d: k x n, row stride ldd; Q: k x c), rows in order. */
LK_ATTR static void LK_FN(trans)(const LK_T *d, size_t ldd, size_t k, size_t n, const LK_T *Q, size_t c, LK_T *P) {
    size_t j0 = 0;
    for (; j0 + 4 <= n; j0 += 4) LK_FN(cols)(d, ldd, k, Q, c, j0, j0, P, 4, 1);
    for (; j0 < n; j0++) LK_FN(cols)(d, ldd, k, Q, c, j0, j0, P, 1, 1);
}

#undef LK_V
#undef LK_LD
#undef LK_ST
