/* float32 GEMM on weights packed once (each variant of simd.h), for the products with a
 * constant operand: MatMul / Gemm / FusedMatMul (weights on the right) and Conv's
 * pointwise path (weights on the left; conv.c has the other convolutions). Built by
 * setup.py, loaded by native/library.py; numpy's BLAS stays the path everywhere else.
 *
 * Why: a BLAS packs both operands on every call. For a product of a few rows by a large
 * weight (an MLP at batch 8, a transformer at batch 1) that packing is most of the call
 * (OpenBLAS: 0.30 ms of a [8, 1024] x [1024, 1024] product at 2 threads, onnxruntime,
 * which packs its weights once, 0.11-0.17 ms). Packing the weights once, and adding bias,
 * residual and Relu/Clip as the tile is stored, saves that and the epilogue's pass.
 *
 * The tile is MR rows x 32 columns, accumulated over a block of K, as in BLIS/GotoBLAS,
 * in parts of at most TILE_ROWS x TILE_COLS that fit the registers (AVX-512: the whole
 * 12 x 32 tile; AVX2: 6 x 16): one operand is broadcast a value at a time, the other
 * loaded 32 floats at a time.
 *   right (Y = A @ B): B packed in panels of 32 columns (K x 32 floats each); A's rows
 *     are broadcast from where they lie (lda).
 *   left (Y = W @ X): W packed in blocks of 12 rows (K x 12 floats each); X (K x L per
 *     image, NCHW) copied a 32-column panel at a time into a scratch buffer, which also
 *     zero-fills the ragged last panel.
 */
#include "kernels.h"

/* Rows [r0, r0 + R) and columns [j0, j0 + TILE_COLS) of a tile: R x TILE_VECS
 * accumulators over K, then stored through `o` (bias, residual, Relu/Clip on the last K
 * block). R and compress are constants where inlined. */
ALWAYS_INLINE void
tile_part(const int R, int K, const float *a, long ars, long aks, const float *b, long bks,
          const tile_out *o, long ldc, const store_t *s, int r0, int j0, const int compress)
{
    vf acc[TILE_ROWS][TILE_VECS];
    a += r0 * ars;
    b += j0;
#pragma GCC unroll 12
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int v = 0; v < TILE_VECS; v++)
            acc[r][v] = vzero();
    for (int k = 0; k < K; k++) {
        vf bv[TILE_VECS];
#pragma GCC unroll 4
        for (int v = 0; v < TILE_VECS; v++)
            bv[v] = vloadu(b + v * VW);
#pragma GCC unroll 12
        for (int r = 0; r < R; r++) {
            vf av = vset1(a[r * ars]);
#pragma GCC unroll 4
            for (int v = 0; v < TILE_VECS; v++)
                acc[r][v] = vfma(av, bv[v], acc[r][v]);
        }
        a += aks;
        b += bks;
    }
    /* each vector's lanes, its offset in its segment's destination and column bias */
    lanes_t lanes[TILE_VECS];
    int pos[TILE_VECS], plain[TILE_VECS], h[TILE_VECS];
    vf cb[TILE_VECS];
#pragma GCC unroll 4
    for (int v = 0; v < TILE_VECS; v++) {
        int j = j0 + v * VW, sh = j % SEG;
        unsigned seg = o->m[j / SEG];
        h[v] = j / SEG;
        lanes[v] = (seg >> sh) & VMASK;
        plain[v] = !compress || (seg & (seg + 1)) == 0;
        pos[v] = plain[v] ? sh : __builtin_popcount(seg & ((1u << sh) - 1));
        cb[v] = s->last && s->cbias ? vload_lanes(lanes[v], s->cbias + j) : vzero();
    }
    const vf zero = vzero(), lo = vset1(s->lo), hi = vset1(s->hi);
#pragma GCC unroll 12
    for (int r = 0; r < R; r++) {
        long row = (long)(r0 + r);
#pragma GCC unroll 4
        for (int v = 0; v < TILE_VECS; v++) {
            if (!lanes[v])
                continue;
            float *c = o->c[h[v]] + row * ldc + pos[v];
            vf x = acc[r][v];
            if (s->accumulate)
                x = vadd(x, plain[v] ? vload_lanes(lanes[v], c) : vexpand_load(lanes[v], c));
            if (s->last) {
                if (s->rbias)
                    x = vadd(x, vset1(s->rbias[r0 + r]));
                x = vadd(x, cb[v]);
                if (o->z[h[v]]) {
                    const float *zr = o->z[h[v]] + row * s->ldz + pos[v];
                    x = vadd(x, plain[v] ? vload_lanes(lanes[v], zr) : vexpand_load(lanes[v], zr));
                }
                /* max/min return their second operand when either is NaN: NaN stays NaN */
                if (s->act == ACT_RELU)
                    x = vmax(zero, x);
                else if (s->act == ACT_CLIP)
                    x = vmin(hi, vmax(lo, x));
            }
            if (plain[v])
                vstore_lanes(c, lanes[v], x);
            else
                vcompress_store(c, lanes[v], x);
        }
    }
}

/* the lanes of columns [j0, j0 + TILE_COLS) of a tile */
static inline unsigned part_lanes(const tile_out *o, int j0)
{
    if (TILE_COLS >= NR)
        return o->m[0] | o->m[1];
    unsigned seg = o->m[j0 / SEG] >> (j0 % SEG);
    return TILE_COLS >= SEG ? seg : seg & ((1u << TILE_COLS) - 1);
}

/* the tile for 1..MR_LEFT rows: column parts of TILE_COLS, each in row chunks of at most
 * TILE_ROWS (as even as they go), each chunk's loops unrolled at compile time */
#define TILE_ROWS_FN(NAME, COMPRESS)                                                        \
    static void NAME(int mr, int K, const float *a, long ars, long aks, const float *b,     \
                     long bks, const tile_out *o, long ldc, const store_t *s)               \
    {                                                                                       \
        for (int j0 = 0; j0 < NR; j0 += TILE_COLS) {                                        \
            if (TILE_COLS < NR && !part_lanes(o, j0))                                       \
                continue;                                                                   \
            int chunks = (mr + TILE_ROWS - 1) / TILE_ROWS;                                  \
            for (int q = 0, r0 = 0; q < chunks; q++) {                                      \
                int rows = (mr - r0) / (chunks - q);                                        \
                switch (rows) {                                                             \
                case 1: tile_part(1, K, a, ars, aks, b, bks, o, ldc, s, r0, j0, COMPRESS); break; \
                case 2: tile_part(2, K, a, ars, aks, b, bks, o, ldc, s, r0, j0, COMPRESS); break; \
                case 3: tile_part(3, K, a, ars, aks, b, bks, o, ldc, s, r0, j0, COMPRESS); break; \
                case 4: tile_part(4, K, a, ars, aks, b, bks, o, ldc, s, r0, j0, COMPRESS); break; \
                case 5: tile_part(5, K, a, ars, aks, b, bks, o, ldc, s, r0, j0, COMPRESS); break; \
                TILE_ROWS_MORE(COMPRESS)                                                    \
                default: tile_part(TILE_ROWS, K, a, ars, aks, b, bks, o, ldc, s, r0, j0, COMPRESS); \
                         break;                                                             \
                }                                                                           \
                r0 += rows;                                                                 \
            }                                                                               \
        }                                                                                   \
    }
#if TILE_ROWS > 6
#define TILE_ROWS_MORE(COMPRESS)                                                            \
    case 6: tile_part(6, K, a, ars, aks, b, bks, o, ldc, s, r0, j0, COMPRESS); break;        \
    case 7: tile_part(7, K, a, ars, aks, b, bks, o, ldc, s, r0, j0, COMPRESS); break;        \
    case 8: tile_part(8, K, a, ars, aks, b, bks, o, ldc, s, r0, j0, COMPRESS); break;        \
    case 9: tile_part(9, K, a, ars, aks, b, bks, o, ldc, s, r0, j0, COMPRESS); break;        \
    case 10: tile_part(10, K, a, ars, aks, b, bks, o, ldc, s, r0, j0, COMPRESS); break;      \
    case 11: tile_part(11, K, a, ars, aks, b, bks, o, ldc, s, r0, j0, COMPRESS); break;
#else
#define TILE_ROWS_MORE(COMPRESS)
#endif
TILE_ROWS_FN(tile_rows_plain, 0)
TILE_ROWS_FN(tile_rows_compress, 1)

void tile_rows(int mr, int K, const float *a, long ars, long aks, const float *b, long bks,
               const tile_out *o, long ldc, const store_t *s, int compress)
{
    if (compress)
        tile_rows_compress(mr, K, a, ars, aks, b, bks, o, ldc, s);
    else
        tile_rows_plain(mr, K, a, ars, aks, b, bks, o, ldc, s);
}

/* the rows of K a block takes: all of them up to KC_WHOLE, else KC */
static inline int kc_for(int K) { return K <= KC_WHOLE ? K : KC; }

/* the columns of a 32-column panel that hold its first nr: two segments' lanes */
static inline tile_out gemm_out(float *c, const float *z, int nr)
{
    int n1 = nr - SEG;
    tile_out o = {{c, c + SEG}, {z, z ? z + SEG : 0},
                  {nr >= SEG ? 0xFFFFu : nr <= 0 ? 0u : (1u << nr) - 1,
                   n1 >= SEG ? 0xFFFFu : n1 <= 0 ? 0u : (1u << n1) - 1}};
    return o;
}

/* ------------------------------------------------------------------ weights on the right */

/* rows of A a right-hand tile takes: MR_RIGHT (the unit the work is split by, 8), or
 * where a tile part is 6 rows (AVX2, the 4-lane variants) two whole parts, 12: 8 rows
 * made two 4-row parts, whose 8 FMA chains AVX2 runs at the FMA latency's limit (4
 * cycles, 2 FMAs a cycle); 6-row parts have 12 */
#if TILE_ROWS >= MR_RIGHT
#define RIGHT_ROWS MR_RIGHT
#else
#define RIGHT_ROWS (2 * TILE_ROWS)
#endif

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
    const int kb = kc_for(K);
    for (int k0 = 0; k0 < K; k0 += kb) {
        int kc = K - k0 < kb ? K - k0 : kb;
        store_t s = store_for(k0, kc, K, 0, act, lo, hi);
        for (int i0 = m0; i0 < m1; i0 += MC) {
            int i1 = i0 + MC < m1 ? i0 + MC : m1;
            for (int p = p0; p < p1; p++) {
                int j = p * NR, nr = N - j < NR ? N - j : NR;
                const float *bp = Bp + (long)p * NR * K + (long)k0 * NR;
                for (int i = i0; i < i1; i += RIGHT_ROWS) {
                    int mr = i1 - i < RIGHT_ROWS ? i1 - i : RIGHT_ROWS;
                    s.cbias = bias ? bias + j : 0;
                    s.ldz = ldz;
                    tile_out o = gemm_out(Y + (long)i * ldy + j, z ? z + (long)i * ldz + j : 0, nr);
                    tile_rows(mr, kc, A + (long)i * lda + k0, lda, 1, bp, NR, &o, ldy, &s, 0);
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
    const int kb = kc_for(K);
    for (int t = t0; t < t1; t++) {
        int n = t / panels, j = (t % panels) * NR, nr = L - j < NR ? L - j : NR;
        const float *xp = X + (long)n * xs + j;
        for (int k = 0; k < K; k++)
#pragma GCC unroll 8
            for (int v = 0; v < NR / VW; v++)
                vstore(panel + k * NR + v * VW,
                       vload_lanes(first_lanes(nr - v * VW), xp + (long)k * ldx + v * VW));
        float *yp = Y + (long)n * ys + j;
        for (int k0 = 0; k0 < K; k0 += kb) {
            int kc = K - k0 < kb ? K - k0 : kb;
            store_t s = store_for(k0, kc, K, 0, act, lo, hi);
            for (int i0 = m0; i0 < m1; i0 += MR_LEFT) {
                int mr = m1 - i0 < MR_LEFT ? m1 - i0 : MR_LEFT;
                s.rbias = bias ? bias + i0 : 0;
                s.ldz = L;
                tile_out o = gemm_out(yp + (long)i0 * L,
                                      z ? z + (long)n * ys + (long)i0 * L + j : 0, nr);
                tile_rows(mr, kc, Wp + (long)i0 * K + (long)k0 * MR_LEFT, 1, MR_LEFT,
                          panel + (long)k0 * NR, NR, &o, L, &s, 0);
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
