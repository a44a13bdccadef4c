/* The BLAS's own GEMM (numpy's OpenBLAS, held at one thread), split over workers.c's
 * threads: one pool for every split of a run.
 *
 * Why: with OpenBLAS splitting its products on its own workers and our kernels splitting
 * on these, a 2-core machine has two pools of spinning threads. After a product
 * OpenBLAS's worker spins on while our worker takes the next depthwise conv or epilogue
 * part, and the two share a core: ConvNeXt's runs at batch 1 flipped between 5.3 and
 * 7.8 ms by where the scheduler had put the threads. Here the product's parts are plain
 * one-thread BLAS calls on our workers, which spin between parts anyway.
 *
 * A call is C = A @ B over `batch` matrices (row-major), each operand with a byte stride
 * between matrices (0: one matrix broadcast to every item) and a transposed flag (the
 * matrix is stored as its transpose, leading dimension ld). It is cut by matrices, or, for
 * one matrix, by blocks of rows or of columns of C, whichever side is longer. */
#include "kernels.h"

enum { CBLAS_ROW_MAJOR = 101, CBLAS_NO_TRANS = 111, CBLAS_TRANS = 112 };

/* cblas_?gemm with 32- or 64-bit integers (OpenBLAS built with INTERFACE64: numpy's) */
typedef void (*sgemm32_fn)(int, int, int, int, int, int, float, const float *, int,
                           const float *, int, float, float *, int);
typedef void (*sgemm64_fn)(int, int, int, long, long, long, float, const float *, long,
                           const float *, long, float, float *, long);
typedef void (*dgemm32_fn)(int, int, int, int, int, int, double, const double *, int,
                           const double *, int, double, double *, int);
typedef void (*dgemm64_fn)(int, int, int, long, long, long, double, const double *, long,
                           const double *, long, double, double *, long);
typedef void (*sgemv32_fn)(int, int, int, int, float, const float *, int, const float *, int,
                           float, float *, int);
typedef void (*sgemv64_fn)(int, int, long, long, float, const float *, long, const float *, long,
                           float, float *, long);
typedef void (*dgemv32_fn)(int, int, int, int, double, const double *, int, const double *, int,
                           double, double *, int);
typedef void (*dgemv64_fn)(int, int, long, long, double, const double *, long, const double *,
                           long, double, double *, long);

typedef struct {
    void *fn, *gemv; /* cblas_?gemm, cblas_?gemv */
    int ilp64, dbl;  /* 64-bit BLAS integers; float64 */
    int ta, tb;      /* A or B stored transposed */
    long M, N, K;
    const char *A;
    long lda, sa;    /* sa, sb, sc: bytes from one matrix to the next */
    const char *B;
    long ldb, sb;
    char *C;
    long ldc, sc;
    int mode;        /* BY_* */
    int unit;        /* rows or columns an item */
    long parts;      /* BY_K: the parts; part i > 0 writes its sums to scratch row i - 1 */
    char *scratch;
} blas_args;

enum { BY_MATRICES = 0, BY_ROWS = 1, BY_COLS = 2, BY_K = 3 };

/* y = op(A) x: a (rows x cols) matrix stored row-major at lda, transposed if `trans`,
 * x and y at strides incx and incy */
static void gemv(const blas_args *a, int trans, long rows, long cols, const char *A, long lda,
                 const char *x, long incx, char *y, long incy)
{
    int t = trans ? CBLAS_TRANS : CBLAS_NO_TRANS;
    if (a->dbl) {
        if (a->ilp64)
            ((dgemv64_fn)a->gemv)(CBLAS_ROW_MAJOR, t, rows, cols, 1.0, (const double *)A, lda,
                                  (const double *)x, incx, 0.0, (double *)y, incy);
        else
            ((dgemv32_fn)a->gemv)(CBLAS_ROW_MAJOR, t, (int)rows, (int)cols, 1.0,
                                  (const double *)A, (int)lda, (const double *)x, (int)incx,
                                  0.0, (double *)y, (int)incy);
    } else {
        if (a->ilp64)
            ((sgemv64_fn)a->gemv)(CBLAS_ROW_MAJOR, t, rows, cols, 1.0f, (const float *)A, lda,
                                  (const float *)x, incx, 0.0f, (float *)y, incy);
        else
            ((sgemv32_fn)a->gemv)(CBLAS_ROW_MAJOR, t, (int)rows, (int)cols, 1.0f,
                                  (const float *)A, (int)lda, (const float *)x, (int)incx,
                                  0.0f, (float *)y, (int)incy);
    }
}

/* one BLAS call: rows m x columns n of one matrix product, from the given corners. A
 * single row or column is a matrix-vector product: OpenBLAS's GEMM does not forward
 * those to its GEMV (3x slower at 1 x 1024 x 1024), as numpy's matmul does. */
static void gemm(const blas_args *a, const char *A, const char *B, char *C, long m, long n)
{
    int ta = a->ta ? CBLAS_TRANS : CBLAS_NO_TRANS, tb = a->tb ? CBLAS_TRANS : CBLAS_NO_TRANS;
    if (m <= 0 || n <= 0)
        return;
    if (a->M == 1) { /* C (1 x n) = A's row (K) @ B: y = B^T x */
        long inca = a->ta ? a->lda : 1;
        if (a->tb) /* B^T stored (n x K) */
            gemv(a, 0, n, a->K, B, a->ldb, A, inca, C, 1);
        else
            gemv(a, 1, a->K, n, B, a->ldb, A, inca, C, 1);
        return;
    }
    if (a->N == 1) { /* C (m x 1) = A @ B's column (K) */
        long incb = a->tb ? 1 : a->ldb;
        if (a->ta) /* A^T stored (K x m) */
            gemv(a, 1, a->K, m, A, a->lda, B, incb, C, a->ldc);
        else
            gemv(a, 0, m, a->K, A, a->lda, B, incb, C, a->ldc);
        return;
    }
    if (a->dbl) {
        if (a->ilp64)
            ((dgemm64_fn)a->fn)(CBLAS_ROW_MAJOR, ta, tb, m, n, a->K, 1.0, (const double *)A,
                                a->lda, (const double *)B, a->ldb, 0.0, (double *)C, a->ldc);
        else
            ((dgemm32_fn)a->fn)(CBLAS_ROW_MAJOR, ta, tb, (int)m, (int)n, (int)a->K, 1.0,
                                (const double *)A, (int)a->lda, (const double *)B, (int)a->ldb,
                                0.0, (double *)C, (int)a->ldc);
    } else {
        if (a->ilp64)
            ((sgemm64_fn)a->fn)(CBLAS_ROW_MAJOR, ta, tb, m, n, a->K, 1.0f, (const float *)A,
                                a->lda, (const float *)B, a->ldb, 0.0f, (float *)C, a->ldc);
        else
            ((sgemm32_fn)a->fn)(CBLAS_ROW_MAJOR, ta, tb, (int)m, (int)n, (int)a->K, 1.0f,
                                (const float *)A, (int)a->lda, (const float *)B, (int)a->ldb,
                                0.0f, (float *)C, (int)a->ldc);
    }
}

static void blas_task(void *p, int i0, int i1)
{
    const blas_args *a = (const blas_args *)p;
    long es = a->dbl ? 8 : 4;
    if (a->mode == BY_MATRICES) {
        for (long i = i0; i < i1; i++)
            gemm(a, a->A + i * a->sa, a->B + i * a->sb, a->C + i * a->sc, a->M, a->N);
        return;
    }
    if (a->mode == BY_K) { /* one row of A: this part's share of the sum over k */
        long k0 = a->K * i0 / a->parts, k1 = a->K * i1 / a->parts;
        const char *x = a->A + k0 * es * (a->ta ? a->lda : 1);
        char *y = i0 ? a->scratch + (i0 - 1) * a->N * es : a->C;
        long inc = a->ta ? a->lda : 1;
        if (a->tb) /* B^T stored (N x K): its columns k0..k1 */
            gemv(a, 0, a->N, k1 - k0, a->B + k0 * es, a->ldb, x, inc, y, 1);
        else
            gemv(a, 1, k1 - k0, a->N, a->B + k0 * a->ldb * es, a->ldb, x, inc, y, 1);
        return;
    }
    long r0 = (long)i0 * a->unit, r1 = (long)i1 * a->unit;
    if (a->mode == BY_ROWS) {
        if (r1 > a->M)
            r1 = a->M;
        /* rows r0.. of A: its row r0 (stored transposed: its column r0) */
        const char *A = a->A + r0 * es * (a->ta ? 1 : a->lda);
        gemm(a, A, a->B, a->C + r0 * a->ldc * es, r1 - r0, a->N);
    } else {
        if (r1 > a->N)
            r1 = a->N;
        const char *B = a->B + r0 * es * (a->tb ? a->ldb : 1);
        gemm(a, a->A, B, a->C + r0 * es, a->M, r1 - r0);
    }
}

/* C = A @ B over `batch` matrices in `parts` parts (see the top of this file); a single
 * matrix's rows or columns are cut in blocks of `unit` */
void he_blas_gemm_mt(void *fn, void *gemv, int ilp64, int dbl, int ta, int tb, long batch, long M, long N,
                     long K, const void *A, long lda, long sa, const void *B, long ldb, long sb,
                     void *C, long ldc, long sc, int unit, int parts)
{
    blas_args a = {fn, gemv, ilp64, dbl, ta, tb, M, N, K, (const char *)A, lda, sa,
                   (const char *)B, ldb, sb, (char *)C, ldc, sc, BY_MATRICES, unit};
    long n = batch;
    if (batch == 1 && M == 1 && !tb && parts > 1 && K >= N) {
        /* a row times B: each part reads its own rows of B whole and sums into a row of
         * its own (cut by the columns, every part reads a strip of each row: 2x slower per
         * byte here). Zeroed: a split that runs fewer parts leaves some rows unused. */
        long es = dbl ? 8 : 4;
        a.scratch = (char *)calloc((size_t)(parts - 1) * N, es);
        if (a.scratch) {
            a.mode = BY_K;
            a.parts = parts;
            he_parallel(blas_task, &a, parts, parts);
            for (long p = 0; p < parts - 1; p++) {
                if (dbl) {
                    double *y = (double *)C, *t = (double *)a.scratch + p * N;
                    for (long j = 0; j < N; j++)
                        y[j] += t[j];
                } else {
                    float *y = (float *)C, *t = (float *)a.scratch + p * N;
                    for (long j = 0; j < N; j++)
                        y[j] += t[j];
                }
            }
            free(a.scratch);
            return;
        }
    }
    if (batch == 1) {
        a.mode = M >= N ? BY_ROWS : BY_COLS;
        n = ((a.mode == BY_ROWS ? M : N) + unit - 1) / unit;
    }
    he_parallel(blas_task, &a, (int)n, parts);
}
