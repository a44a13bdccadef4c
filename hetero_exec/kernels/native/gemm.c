/* float32 GEMM on weights packed once (AVX-512F), for the cpu provider's products with a
 * constant operand: MatMul / Gemm / FusedMatMul (weights on the right) and Conv's
 * pointwise path (weights on the left; conv.c has the other convolutions). Built on
 * first use by native/packed_gemm.py; numpy's BLAS stays the path everywhere else.
 *
 * Why: a BLAS packs both operands on every call. For a product of a few rows by a large
 * weight (an MLP at batch 8, a transformer at batch 1) that packing is most of the call
 * (OpenBLAS: 0.30 ms of a [8, 1024] x [1024, 1024] product at 2 threads, onnxruntime,
 * which packs its weights once, 0.11-0.17 ms). Packing the weights once, and adding bias,
 * residual and Relu/Clip as the tile is stored, saves that and the epilogue's pass.
 *
 * The micro-tile is MR rows x 32 columns (two zmm registers a row), accumulated over a
 * block of K, as in BLIS/GotoBLAS: one operand is broadcast a value at a time, the other
 * loaded 32 floats at a time.
 *   right (Y = A @ B): B packed in panels of 32 columns (K x 32 floats each); A's rows
 *     are broadcast from where they lie (lda).
 *   left (Y = W @ X): W packed in blocks of 12 rows (K x 12 floats each); X (K x L per
 *     image, NCHW) copied a 32-column panel at a time into a scratch buffer, which also
 *     zero-fills the ragged last panel.
 */
#include "he.h"

static inline __attribute__((always_inline)) void
tile(const int mr, int K, const float *a, long ars, long aks, const float *b, long bks,
     float *c, long ldc, __mmask16 m0, __mmask16 m1, const store_t *s)
{
    __m512 acc0[MR_LEFT], acc1[MR_LEFT];
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) {
        acc0[r] = _mm512_setzero_ps();
        acc1[r] = _mm512_setzero_ps();
    }
    for (int k = 0; k < K; k++) {
        __m512 b0 = _mm512_loadu_ps(b), b1 = _mm512_loadu_ps(b + 16);
#pragma GCC unroll 12
        for (int r = 0; r < mr; r++) {
            __m512 av = _mm512_set1_ps(a[r * ars]);
            acc0[r] = _mm512_fmadd_ps(av, b0, acc0[r]);
            acc1[r] = _mm512_fmadd_ps(av, b1, acc1[r]);
        }
        a += aks;
        b += bks;
    }
    __m512 cb0 = _mm512_setzero_ps(), cb1 = _mm512_setzero_ps();
    if (s->last && s->cbias) {
        cb0 = _mm512_maskz_loadu_ps(m0, s->cbias);
        cb1 = _mm512_maskz_loadu_ps(m1, s->cbias + 16);
    }
    const __m512 zero = _mm512_setzero_ps(), lo = _mm512_set1_ps(s->lo), hi = _mm512_set1_ps(s->hi);
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) {
        float *cr = c + r * ldc;
        __m512 v0 = acc0[r], v1 = acc1[r];
        if (s->accumulate) {
            v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, cr));
            v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, cr + 16));
        }
        if (s->last) {
            if (s->rbias) {
                __m512 rb = _mm512_set1_ps(s->rbias[r]);
                v0 = _mm512_add_ps(v0, rb);
                v1 = _mm512_add_ps(v1, rb);
            }
            v0 = _mm512_add_ps(v0, cb0);
            v1 = _mm512_add_ps(v1, cb1);
            if (s->z) {
                const float *zr = s->z + r * s->ldz;
                v0 = _mm512_add_ps(v0, _mm512_maskz_loadu_ps(m0, zr));
                v1 = _mm512_add_ps(v1, _mm512_maskz_loadu_ps(m1, zr + 16));
            }
            /* max/min return their second operand when either is NaN: NaN stays NaN */
            if (s->act == ACT_RELU) {
                v0 = _mm512_max_ps(zero, v0);
                v1 = _mm512_max_ps(zero, v1);
            } else if (s->act == ACT_CLIP) {
                v0 = _mm512_min_ps(hi, _mm512_max_ps(lo, v0));
                v1 = _mm512_min_ps(hi, _mm512_max_ps(lo, v1));
            }
        }
        _mm512_mask_storeu_ps(cr, m0, v0);
        _mm512_mask_storeu_ps(cr + 16, m1, v1);
    }
}

/* the tile for 1..12 rows, each with its row loops unrolled at compile time */
static void tile_rows(int mr, int K, const float *a, long ars, long aks, const float *b,
                      long bks, float *c, long ldc, __mmask16 m0, __mmask16 m1,
                      const store_t *s)
{
#define T(n) case n: tile(n, K, a, ars, aks, b, bks, c, ldc, m0, m1, s); break;
    switch (mr) {
        T(1) T(2) T(3) T(4) T(5) T(6) T(7) T(8) T(9) T(10) T(11)
        default: tile(12, K, a, ars, aks, b, bks, c, ldc, m0, m1, s); break;
    }
#undef T
}

/* ------------------------------------------------------------------ weights on the right */

long he_pack_right_size(int K, int N) { return (long)((N + NR - 1) / NR) * NR * K; }

/* B (K x N) read at B[k * rs + n * cs] (a transposed B is cs = K, rs = 1) */
void he_pack_right(int K, int N, const float *B, long rs, long cs, float *out)
{
    for (int j0 = 0; j0 < N; j0 += NR)
        for (int k = 0; k < K; k++)
            for (int c = 0; c < NR; c++)
                *out++ = j0 + c < N ? B[(long)k * rs + (long)(j0 + c) * cs] : 0.0f;
}

/* Y[m0:m1, panels p0:p1] = act(A @ B + bias + Z); A (M x K) row-major (lda), Bp packed,
 * bias (N,) or NULL, Z of Y's layout (ldz) or NULL */
static void he_gemm_right(int N, int K, const float *A, long lda, const float *Bp, float *Y,
                          long ldy, int m0, int m1, int p0, int p1, const float *bias,
                          const float *z, long ldz, int act, float lo, float hi)
{
    for (int k0 = 0; k0 < K; k0 += KC) {
        int kc = K - k0 < KC ? K - k0 : KC;
        store_t s = store_for(k0, kc, K, 0, act, lo, hi);
        for (int i0 = m0; i0 < m1; i0 += MC) {
            int i1 = i0 + MC < m1 ? i0 + MC : m1;
            for (int p = p0; p < p1; p++) {
                int j = p * NR, nr = N - j < NR ? N - j : NR;
                __mmask16 mk0, mk1;
                col_masks(nr, &mk0, &mk1);
                const float *bp = Bp + (long)p * NR * K + (long)k0 * NR;
                for (int i = i0; i < i1; i += MR_RIGHT) {
                    int mr = i1 - i < MR_RIGHT ? i1 - i : MR_RIGHT;
                    s.cbias = bias ? bias + j : 0;
                    s.z = z ? z + (long)i * ldz + j : 0;
                    s.ldz = ldz;
                    tile_rows(mr, kc, A + (long)i * lda + k0, lda, 1, bp, NR,
                              Y + (long)i * ldy + j, ldy, mk0, mk1, &s);
                }
            }
        }
    }
}

/* ------------------------------------------------------------------- weights on the left */

long he_pack_left_size(int M, int K) { return (long)((M + MR_LEFT - 1) / MR_LEFT) * MR_LEFT * K; }

/* W (M x K) read at W[m * rs + k * cs] */
void he_pack_left(int M, int K, const float *W, long rs, long cs, float *out)
{
    for (int i0 = 0; i0 < M; i0 += MR_LEFT)
        for (int k = 0; k < K; k++)
            for (int r = 0; r < MR_LEFT; r++)
                *out++ = i0 + r < M ? W[(long)(i0 + r) * rs + (long)k * cs] : 0.0f;
}

/* Per image n: rows [m0, m1) of Y_n (M x L) = act(W @ X_n + bias + Z_n), X_n (K x L) at
 * X + n * xs with rows ldx apart, Y_n and Z_n at n * ys with rows L apart (NCHW). Work
 * items t in [t0, t1) are (image, 32-column panel) pairs: t = n * panels + panel; m0 is a
 * multiple of MR_LEFT. Returns 0, or -1 when the panel's scratch could not be allocated. */
static int he_gemm_left(int M, int K, int L, const float *Wp, const float *X, long ldx,
                        long xs, float *Y, long ys, int t0, int t1, int m0, int m1,
                        const float *bias, const float *z, int act, float lo, float hi)
{
    float *panel = (float *)aligned_alloc(64, (size_t)K * NR * sizeof(float) + 64);
    if (!panel)
        return -1;
    int panels = (L + NR - 1) / NR;
    for (int t = t0; t < t1; t++) {
        int n = t / panels, j = (t % panels) * NR, nr = L - j < NR ? L - j : NR;
        __mmask16 mk0, mk1;
        col_masks(nr, &mk0, &mk1);
        const float *xp = X + (long)n * xs + j;
        for (int k = 0; k < K; k++) {
            _mm512_store_ps(panel + k * NR, _mm512_maskz_loadu_ps(mk0, xp + (long)k * ldx));
            _mm512_store_ps(panel + k * NR + 16, _mm512_maskz_loadu_ps(mk1, xp + (long)k * ldx + 16));
        }
        float *yp = Y + (long)n * ys + j;
        for (int k0 = 0; k0 < K; k0 += KC) {
            int kc = K - k0 < KC ? K - k0 : KC;
            store_t s = store_for(k0, kc, K, 0, act, lo, hi);
            for (int i0 = m0; i0 < m1; i0 += MR_LEFT) {
                int mr = m1 - i0 < MR_LEFT ? m1 - i0 : MR_LEFT;
                s.rbias = bias ? bias + i0 : 0;
                s.z = z ? z + (long)n * ys + (long)i0 * L + j : 0;
                s.ldz = L;
                tile_rows(mr, kc, Wp + (long)i0 * K + (long)k0 * MR_LEFT, 1, MR_LEFT,
                          panel + (long)k0 * NR, NR, yp + (long)i0 * L, L, mk0, mk1, &s);
            }
        }
    }
    free(panel);
    return 0;
}

/* ------------------------------------------------------------------ split over the workers */

typedef struct {
    int N, K, M;
    const float *A;
    long lda;
    const float *Bp;
    float *Y;
    long ldy;
    const float *bias, *z;
    long ldz;
    int act;
    float lo, hi;
    int by_rows, panels;
} right_args;

static void right_task(void *p, int i0, int i1)
{
    right_args *a = (right_args *)p;
    if (a->by_rows) {
        int m1 = i1 * MR_RIGHT < a->M ? i1 * MR_RIGHT : a->M;
        he_gemm_right(a->N, a->K, a->A, a->lda, a->Bp, a->Y, a->ldy, i0 * MR_RIGHT, m1, 0,
                      a->panels, a->bias, a->z, a->ldz, a->act, a->lo, a->hi);
    } else {
        he_gemm_right(a->N, a->K, a->A, a->lda, a->Bp, a->Y, a->ldy, 0, a->M, i0, i1, a->bias,
                      a->z, a->ldz, a->act, a->lo, a->hi);
    }
}

/* he_gemm_right over all of Y, in `parts` parts: by row tiles for many rows, else by
 * panels (each part reading its share of the weight) */
void he_gemm_right_mt(int M, int N, int K, const float *A, long lda, const float *Bp, float *Y,
                      long ldy, const float *bias, const float *z, long ldz, int act, float lo,
                      float hi, int parts)
{
    right_args a = {N, K, M, A, lda, Bp, Y, ldy, bias, z, ldz, act, lo, hi, 0, (N + NR - 1) / NR};
    a.by_rows = M >= 8 * MR_RIGHT;
    he_parallel(right_task, &a, a.by_rows ? (M + MR_RIGHT - 1) / MR_RIGHT : a.panels, parts);
}

typedef struct {
    int M, K, L;
    const float *Wp, *X;
    long ldx, xs;
    float *Y;
    long ys;
    const float *bias, *z;
    int act;
    float lo, hi;
    int items, by_rows, failed;
} left_args;

static void left_task(void *p, int i0, int i1)
{
    left_args *a = (left_args *)p;
    int t0 = i0, t1 = i1, m0 = 0, m1 = a->M;
    if (a->by_rows) { /* every (image, panel) pair, on this part's blocks of rows */
        t0 = 0, t1 = a->items;
        m0 = i0 * MR_LEFT, m1 = i1 * MR_LEFT < a->M ? i1 * MR_LEFT : a->M;
    }
    if (he_gemm_left(a->M, a->K, a->L, a->Wp, a->X, a->ldx, a->xs, a->Y, a->ys, t0, t1, m0, m1,
                     a->bias, a->z, a->act, a->lo, a->hi))
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
}

/* he_gemm_left over `items` (image, panel) pairs in `parts` parts, cut by those pairs, or
 * with `by_rows` by blocks of the weight's rows (fewer pairs than parts to share: a small
 * plane at batch 1, where each part then copies the same panels): 0, or -1 when a
 * panel's scratch could not be allocated */
int he_gemm_left_mt(int M, int K, int L, const float *Wp, const float *X, long ldx, long xs,
                    float *Y, long ys, int items, const float *bias, const float *z, int act,
                    float lo, float hi, int by_rows, int parts)
{
    left_args a = {M, K, L, Wp, X, ldx, xs, Y, ys, bias, z, act, lo, hi, items, by_rows, 0};
    he_parallel(left_task, &a, by_rows ? (M + MR_LEFT - 1) / MR_LEFT : items, parts);
    return a.failed ? -1 : 0;
}
