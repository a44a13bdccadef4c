/* float32 GEMM on weights packed once (AVX-512F), for the cpu provider's products with a
 * constant operand: MatMul / Gemm / FusedMatMul (weights on the right) and Conv's
 * pointwise and im2col paths (weights on the left). Built on first use by
 * native/packed_gemm.py; numpy's BLAS stays the path everywhere else.
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
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NR 32
#define MR_LEFT 12 /* 24 accumulators + 2 loads + 1 broadcast of the 32 zmm registers */
#define MR_RIGHT 8
#define KC 256     /* a 32-column panel of KC rows is 32 KB: it stays in L1/L2 */
#define MC 96      /* rows of A per block (right): 96 KB at KC */
#define KC_CONV 1024 /* a conv tile's block of taps (fewer blocks store and reload the
                       output tile less often; measured no slower than 256 or 512) */

enum { ACT_NONE = 0, ACT_RELU = 1, ACT_CLIP = 2 };

typedef struct {
    const float *rbias; /* one value per row of the tile, or NULL */
    const float *cbias; /* one value per column, or NULL */
    const float *z;     /* a residual of the output's layout, or NULL */
    long ldz;
    int act;            /* ACT_*; applied only when last */
    float lo, hi;
    int accumulate;     /* add to what the output holds (a later K block) */
    int last;           /* the last K block: bias, residual and activation */
} store_t;

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

static inline void col_masks(int nr, __mmask16 *m0, __mmask16 *m1)
{
    *m0 = nr >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << nr) - 1);
    *m1 = nr >= 32 ? (__mmask16)0xFFFF : nr <= 16 ? (__mmask16)0 : (__mmask16)((1u << (nr - 16)) - 1);
}

static inline store_t store_for(int k0, int kc, int K, int accumulate, int act, float lo, float hi)
{
    store_t s = {0};
    s.act = act;
    s.lo = lo;
    s.hi = hi;
    s.accumulate = accumulate || k0 > 0;
    s.last = k0 + kc == K;
    return s;
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
void he_gemm_right(int N, int K, const float *A, long lda, const float *Bp, float *Y, long ldy,
                   int m0, int m1, int p0, int p1, const float *bias, const float *z, long ldz,
                   int act, float lo, float hi)
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

/* Per image n: Y_n (M x L) = act(W @ X_n + bias + Z_n), X_n (K x L) at X + n * xs with rows
 * ldx apart, Y_n and Z_n at n * ys with rows L apart (NCHW). Work items t in [t0, t1) are
 * (image, 32-column panel) pairs: t = n * panels + panel. Returns 0, or -1 when the
 * panel's scratch could not be allocated. */
int he_gemm_left(int M, int K, int L, const float *Wp, const float *X, long ldx, long xs,
                 float *Y, long ys, int t0, int t1, const float *bias, const float *z,
                 int act, float lo, float hi)
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
            for (int i0 = 0; i0 < M; i0 += MR_LEFT) {
                int mr = M - i0 < MR_LEFT ? M - i0 : MR_LEFT;
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

/* ----------------------------------------------- convolution by indirection (no im2col) */

/* One row of a conv tile stored: act(v + bias + z) under the lane mask. `compress`: the
 * lanes set in m are consecutive pixels of the output with junk lanes between them (a
 * run over the padded grid that crosses a row's end), stored packed from c on. */
static inline __attribute__((always_inline)) void
finish(__m512 v, float *c, const float *z, __mmask16 m, float rbias, const store_t *s,
       int compress)
{
    if (s->accumulate)
        v = _mm512_add_ps(v, compress ? _mm512_maskz_expandloadu_ps(m, c)
                                      : _mm512_maskz_loadu_ps(m, c));
    if (s->last) {
        v = _mm512_add_ps(v, _mm512_set1_ps(rbias));
        if (z)
            v = _mm512_add_ps(v, compress ? _mm512_maskz_expandloadu_ps(m, z)
                                          : _mm512_maskz_loadu_ps(m, z));
        if (s->act == ACT_RELU)
            v = _mm512_max_ps(_mm512_setzero_ps(), v);
        else if (s->act == ACT_CLIP)
            v = _mm512_min_ps(_mm512_set1_ps(s->hi), _mm512_max_ps(_mm512_set1_ps(s->lo), v));
    }
    if (compress)
        _mm512_mask_compressstoreu_ps(c, m, v);
    else
        _mm512_mask_storeu_ps(c, m, v);
}

/* acc[r][h] += sum_k a(r, k) * in_h[off[k] + 0..15] for two runs of 16 lanes, whose
 * inputs for tap k lie at in_h + off[k]; l0/l1 the lanes loaded, m0/m1 the lanes stored */
static inline __attribute__((always_inline)) void
ctile(const int mr, int K, const float *a, const int *off, const float *in0, const float *in1,
      __mmask16 l0, __mmask16 l1, __mmask16 m0, __mmask16 m1, float *c0, float *c1,
      const float *z0, const float *z1, long ldc, const float *rbias, const store_t *s)
{
    __m512 acc0[MR_LEFT], acc1[MR_LEFT];
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) {
        acc0[r] = _mm512_setzero_ps();
        acc1[r] = _mm512_setzero_ps();
    }
    for (int k = 0; k < K; k++) {
        __m512 b0 = _mm512_maskz_loadu_ps(l0, in0 + off[k]);
        __m512 b1 = _mm512_maskz_loadu_ps(l1, in1 + off[k]);
#pragma GCC unroll 12
        for (int r = 0; r < mr; r++) {
            __m512 av = _mm512_set1_ps(a[r]);
            acc0[r] = _mm512_fmadd_ps(av, b0, acc0[r]);
            acc1[r] = _mm512_fmadd_ps(av, b1, acc1[r]);
        }
        a += MR_LEFT;
    }
#pragma GCC unroll 12
    for (int r = 0; r < mr; r++) {
        float rb = s->last && rbias ? rbias[r] : 0.0f;
        /* lanes 0..n-1 (a mask 2^n - 1) are a plain run of the output; others have junk
         * lanes between pixels */
        if (m0)
            finish(acc0[r], c0 + r * ldc, z0 ? z0 + r * ldc : 0, m0, rb, s, (m0 & (m0 + 1)) != 0);
        if (m1)
            finish(acc1[r], c1 + r * ldc, z1 ? z1 + r * ldc : 0, m1, rb, s, (m1 & (m1 + 1)) != 0);
    }
}

static void ctile_rows(int mr, int K, const float *a, const int *off, const float *in0,
                       const float *in1, __mmask16 l0, __mmask16 l1, __mmask16 m0, __mmask16 m1,
                       float *c0, float *c1, const float *z0, const float *z1, long ldc,
                       const float *rbias, const store_t *s)
{
#define T(n) case n: ctile(n, K, a, off, in0, in1, l0, l1, m0, m1, c0, c1, z0, z1, ldc, rbias, s); \
                     break;
    switch (mr) {
        T(1) T(2) T(3) T(4) T(5) T(6) T(7) T(8) T(9) T(10) T(11)
        default: ctile(12, K, a, off, in0, in1, l0, l1, m0, m1, c0, c1, z0, z1, ldc, rbias, s);
                 break;
    }
#undef T
}

/* Y_n (M x OH*OW) = act(conv(X_n, W) + bias + Z_n) for a 2-D conv on an input padded
 * already and laid out so that a run of output pixels reads a run of input for every
 * tap (column stride 1, or rows split into their column phases by the caller): X_n at
 * X + n * xs, input rows `pitch` apart, W packed by he_pack_left as (M, C*KH*KW), off[k]
 * the input offset of tap k from an output pixel's origin, sh the row stride.
 *
 * The output is cut into runs of 16 lanes, two runs a tile; work items t in [t0, t1)
 * are (image, tile) pairs. `flat` (row and column stride 1): runs over the padded grid
 * of OH rows of `pitch` pixels, contiguous in the input across rows; the pitch - OW
 * junk columns a row are computed and left out of the store (compress). Else runs of
 * at most 16 pixels within one output row. */
static inline int conv_runs(int flat, int OH, int OW, int pitch)
{
    return flat ? ((OH - 1) * pitch + OW + 15) / 16 : OH * ((OW + 15) / 16);
}

int he_conv_tiles(int flat, int OH, int OW, int pitch)
{
    return (conv_runs(flat, OH, OW, pitch) + 1) / 2;
}

int he_conv_left(int M, int K, const float *Wp, const int *off, const float *X, long xs,
                 int pitch, int sh, int flat, int OH, int OW, float *Y, int t0, int t1,
                 const float *bias, const float *z, int act, float lo, float hi)
{
    int runs_row = (OW + 15) / 16, runs = conv_runs(flat, OH, OW, pitch), tiles = (runs + 1) / 2;
    long L = (long)OH * OW, grid = (long)(OH - 1) * pitch + OW;
    /* rows of W per group: the group's packed weights (about 1 MB) stay in L2 while every
     * tile of this call passes them; a deep layer's whole weight would not (512 x 4608
     * floats is 9.4 MB, streamed again for every tile) */
    int mg = (int)((1L << 20) / ((long)K * sizeof(float)) / MR_LEFT * MR_LEFT);
    if (mg < MR_LEFT)
        mg = MR_LEFT;
    /* each tile's inputs copied into an aligned panel first: the tile's loads are then
     * aligned, where from the input most cross a cache line (16 floats at any offset) */
    float *panel = (float *)aligned_alloc(64, (size_t)K * NR * sizeof(float) + 64);
    int *seq = (int *)malloc((size_t)K * sizeof(int));
    if (!panel || !seq) {
        free(panel);
        free(seq);
        return -1;
    }
    for (int k = 0; k < K; k++)
        seq[k] = k * NR;
    for (int g0 = 0; g0 < M; g0 += mg) {
        int g1 = g0 + mg < M ? g0 + mg : M;
        for (int t = t0; t < t1; t++) {
            int n = t / tiles, u = t % tiles;
            const float *in[2] = {0, 0};
            float *c[2] = {0, 0};
            const float *zz[2] = {0, 0};
            __mmask16 l[2] = {0, 0}, m[2] = {0, 0};
            for (int h = 0; h < 2; h++) {
                int run = 2 * u + h;
                long o;
                if (run >= runs) {  /* an odd last run: the second half stays masked off */
                    in[h] = in[0];
                    c[h] = c[0];
                    continue;
                }
                if (flat) {
                    long q0 = (long)run * 16, first = -1;
                    int len = grid - q0 < 16 ? (int)(grid - q0) : 16;
                    l[h] = (__mmask16)((1u << len) - 1);
                    for (int i = 0; i < len; i++)
                        if ((q0 + i) % pitch < OW) {
                            m[h] |= (__mmask16)(1u << i);
                            if (first < 0)
                                first = q0 + i;
                        }
                    in[h] = X + (long)n * xs + q0;
                    o = (long)n * M * L + (first < 0 ? 0 : first / pitch * OW + first % pitch);
                } else {
                    int oh = run / runs_row, ow0 = (run % runs_row) * 16;
                    int len = OW - ow0 < 16 ? OW - ow0 : 16;
                    l[h] = m[h] = (__mmask16)((1u << len) - 1);
                    in[h] = X + (long)n * xs + (long)oh * sh * pitch + ow0;
                    o = (long)n * M * L + (long)oh * OW + ow0;
                }
                c[h] = Y + o;
                zz[h] = z ? z + o : 0;
            }
            for (int k = 0; k < K; k++) {
                _mm512_store_ps(panel + (long)k * NR, _mm512_maskz_loadu_ps(l[0], in[0] + off[k]));
                _mm512_store_ps(panel + (long)k * NR + 16,
                                _mm512_maskz_loadu_ps(l[1], in[1] + off[k]));
            }
            for (int k0 = 0; k0 < K; k0 += KC_CONV) {
                int kc = K - k0 < KC_CONV ? K - k0 : KC_CONV;
                store_t s = store_for(k0, kc, K, 0, act, lo, hi);
                for (int i0 = g0; i0 < g1; i0 += MR_LEFT) {
                    int mr = g1 - i0 < MR_LEFT ? g1 - i0 : MR_LEFT;
                    long ro = (long)i0 * L;
                    ctile_rows(mr, kc, Wp + (long)i0 * K + (long)k0 * MR_LEFT, seq + k0,
                               panel, panel + 16, 0xFFFF, 0xFFFF, m[0], m[1], c[0] + ro,
                               c[1] + ro, zz[0] ? zz[0] + ro : 0, zz[1] ? zz[1] + ro : 0, L,
                               bias ? bias + i0 : 0, &s);
                }
            }
        }
    }
    free(panel);
    free(seq);
    return 0;
}

/* ------------------------------------------------------------- our own worker threads */

/* A split of this file's products over worker threads, entirely in C.
 *
 * Why not kernels/_threads.py's Python helpers: handing a part to a thread that sleeps,
 * and taking the GIL back on the way, costs 40-130 us on a 2-vCPU VM (a split of 80 us
 * of work took 155 us). These workers spin for a bounded time after each part
 * (OpenBLAS's do the same, far longer), and neither side needs the GIL: ctypes
 * releases it for the whole call. One split runs at a time; a caller that finds the
 * pool busy (a concurrent run's split) does all its parts itself. */
#include <pthread.h>
#include <sched.h>
#include <time.h>

typedef void (*task_fn)(void *args, int i0, int i1);

#define MAX_WORKERS 63

static struct {
    pthread_mutex_t lock; /* the sleepers' wake-up, the caller's sleep, starting workers */
    pthread_cond_t wake;  /* workers that spun out */
    pthread_cond_t idle;  /* the caller, once it spun out */
    pthread_mutex_t busy; /* held for one split */
    int workers;
    long spin_ns;
    task_fn fn;
    void *args;
    int parts;
    int bounds[MAX_WORKERS + 2];
    int gen;       /* atomic: the split's generation */
    int remaining; /* atomic: workers yet to finish this generation */
    int sleepers;  /* under lock */
    int caller_sleeping; /* under lock */
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER,
       PTHREAD_MUTEX_INITIALIZER};

static long now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

/* spin while *word == value for at most ns: the word's value then. It yields every few
 * microseconds, so that a thread waiting for this core (a Python helper's part of a
 * numba kernel) runs at once rather than sharing it with the spin. */
static int spin_while_equal(const int *word, int value, long ns)
{
    long end = now_ns() + ns;
    for (;;) {
        for (int i = 0; i < 32; i++) {
            int v = __atomic_load_n(word, __ATOMIC_ACQUIRE);
            if (v != value)
                return v;
            _mm_pause();
        }
        if (now_ns() >= end)
            return __atomic_load_n(word, __ATOMIC_ACQUIRE);
        sched_yield();
    }
}

static void *worker(void *arg)
{
    int id = (int)(long)arg; /* the part this worker takes: 1 .. workers */
    int seen = 0;
    for (;;) {
        int g = spin_while_equal(&P.gen, seen, P.spin_ns);
        if (g == seen) {
            pthread_mutex_lock(&P.lock);
            P.sleepers++;
            while ((g = __atomic_load_n(&P.gen, __ATOMIC_ACQUIRE)) == seen)
                pthread_cond_wait(&P.wake, &P.lock);
            P.sleepers--;
            pthread_mutex_unlock(&P.lock);
        }
        seen = g;
        if (id < P.parts)
            P.fn(P.args, P.bounds[id], P.bounds[id + 1]);
        if (__atomic_sub_fetch(&P.remaining, 1, __ATOMIC_ACQ_REL) == 0) {
            pthread_mutex_lock(&P.lock);
            if (P.caller_sleeping)
                pthread_cond_signal(&P.idle);
            pthread_mutex_unlock(&P.lock);
        }
    }
    return 0;
}

static void after_fork_in_child(void)
{
    /* the parent's workers do not exist here: start again with none */
    pthread_mutex_init(&P.lock, 0);
    pthread_cond_init(&P.wake, 0);
    pthread_cond_init(&P.idle, 0);
    pthread_mutex_init(&P.busy, 0);
    P.workers = P.sleepers = P.caller_sleeping = 0;
    P.gen = P.remaining = 0;
}

/* Start workers up to n (at most MAX_WORKERS), spinning spin_ns after each part: the
 * number running. */
int he_pool_start(int n, long spin_ns)
{
    static int registered = 0;
    if (n > MAX_WORKERS)
        n = MAX_WORKERS;
    pthread_mutex_lock(&P.busy); /* no split in flight while workers join */
    pthread_mutex_lock(&P.lock);
    if (!registered) {
        pthread_atfork(0, 0, after_fork_in_child);
        registered = 1;
    }
    P.spin_ns = spin_ns;
    while (P.workers < n) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        /* the new worker's first generation must be the current one */
        if (pthread_create(&t, &attr, worker, (void *)(long)(P.workers + 1)) != 0) {
            pthread_attr_destroy(&attr);
            break;
        }
        pthread_attr_destroy(&attr);
        P.workers++;
    }
    int running = P.workers;
    pthread_mutex_unlock(&P.lock);
    pthread_mutex_unlock(&P.busy);
    return running;
}

/* fn(args, i0, i1) over [0, n) in `parts` parts: the first here, the others on the
 * workers; returns when all are done. */
static void parallel(task_fn fn, void *args, int n, int parts)
{
    if (parts > P.workers + 1)
        parts = P.workers + 1;
    if (parts > n)
        parts = n;
    if (parts < 2 || pthread_mutex_trylock(&P.busy) != 0) {
        fn(args, 0, n);
        return;
    }
    P.fn = fn;
    P.args = args;
    P.parts = parts;
    for (int i = 0; i <= parts; i++)
        P.bounds[i] = (int)((long)n * i / parts);
    __atomic_store_n(&P.remaining, P.workers, __ATOMIC_RELAXED);
    __atomic_add_fetch(&P.gen, 1, __ATOMIC_RELEASE);
    pthread_mutex_lock(&P.lock);
    if (P.sleepers)
        pthread_cond_broadcast(&P.wake);
    pthread_mutex_unlock(&P.lock);
    fn(args, P.bounds[0], P.bounds[1]);
    long end = now_ns() + P.spin_ns; /* the workers' parts end about when this one does */
    while (__atomic_load_n(&P.remaining, __ATOMIC_ACQUIRE) != 0 && now_ns() < end)
        for (int i = 0; i < 32; i++)
            _mm_pause();
    if (__atomic_load_n(&P.remaining, __ATOMIC_ACQUIRE) != 0) {
        pthread_mutex_lock(&P.lock);
        P.caller_sleeping = 1;
        while (__atomic_load_n(&P.remaining, __ATOMIC_ACQUIRE) != 0)
            pthread_cond_wait(&P.idle, &P.lock);
        P.caller_sleeping = 0;
        pthread_mutex_unlock(&P.lock);
    }
    pthread_mutex_unlock(&P.busy);
}

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
    parallel(right_task, &a, a.by_rows ? (M + MR_RIGHT - 1) / MR_RIGHT : a.panels, parts);
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
    int failed;
} left_args;

static void left_task(void *p, int i0, int i1)
{
    left_args *a = (left_args *)p;
    if (he_gemm_left(a->M, a->K, a->L, a->Wp, a->X, a->ldx, a->xs, a->Y, a->ys, i0, i1, a->bias,
                     a->z, a->act, a->lo, a->hi))
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
}

/* he_gemm_left over `items` (image, panel) pairs in `parts` parts: 0, or -1 when a
 * panel's scratch could not be allocated */
int he_gemm_left_mt(int M, int K, int L, const float *Wp, const float *X, long ldx, long xs,
                    float *Y, long ys, int items, const float *bias, const float *z, int act,
                    float lo, float hi, int parts)
{
    left_args a = {M, K, L, Wp, X, ldx, xs, Y, ys, bias, z, act, lo, hi, 0};
    parallel(left_task, &a, items, parts);
    return a.failed ? -1 : 0;
}

typedef struct {
    int M, K;
    const float *Wp;
    const int *off;
    const float *X;
    long xs;
    int pitch, sh, flat, OH, OW;
    float *Y;
    const float *bias, *z;
    int act;
    float lo, hi;
    int failed;
} conv_args;

static void conv_task(void *p, int i0, int i1)
{
    conv_args *a = (conv_args *)p;
    if (he_conv_left(a->M, a->K, a->Wp, a->off, a->X, a->xs, a->pitch, a->sh, a->flat, a->OH,
                     a->OW, a->Y, i0, i1, a->bias, a->z, a->act, a->lo, a->hi))
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
}

/* he_conv_left over `items` (image, tile) pairs in `parts` parts: 0, or -1 when a
 * tile's panel could not be allocated */
int he_conv_left_mt(int M, int K, const float *Wp, const int *off, const float *X, long xs,
                     int pitch, int sh, int flat, int OH, int OW, float *Y, int items,
                     const float *bias, const float *z, int act, float lo, float hi, int parts)
{
    conv_args a = {M, K, Wp, off, X, xs, pitch, sh, flat, OH, OW, Y, bias, z, act, lo, hi, 0};
    parallel(conv_task, &a, items, parts);
    return a.failed ? -1 : 0;
}

/* ------------------------------------------------- a conv's input, padded and phased */

typedef struct {
    const float *X;
    float *out;
    int H, W, pt, pl, Hp, sw, Wq;
    float fill;
} pad_args;

static inline void fill_floats(float *o, long n, float v)
{
    for (long i = 0; i < n; i++)
        o[i] = v;
}

/* planes [p0, p1) of X (planes x H x W) padded with `fill` into out (planes x Hp x sw x
 * Wq): padded row hp, phase p, column q holds X[hp - pt][q * sw + p - pl] */
static void pad_task(void *args, int p0, int p1)
{
    const pad_args *a = (const pad_args *)args;
    long in_plane = (long)a->H * a->W, out_row = (long)a->sw * a->Wq;
    for (int pi = p0; pi < p1; pi++) {
        const float *x = a->X + pi * in_plane;
        float *o = a->out + pi * a->Hp * out_row;
        for (int hp = 0; hp < a->Hp; hp++, o += out_row) {
            int h = hp - a->pt;
            if (h < 0 || h >= a->H) {
                fill_floats(o, out_row, a->fill);
                continue;
            }
            const float *xr = x + (long)h * a->W;
            if (a->sw == 1) {
                int lead = a->pl < a->Wq ? a->pl : a->Wq;
                int body = a->Wq - lead < a->W ? a->Wq - lead : a->W;
                fill_floats(o, lead, a->fill);
                memcpy(o + lead, xr, body * sizeof(float));
                fill_floats(o + lead + body, a->Wq - lead - body, a->fill);
                continue;
            }
            for (int p = 0; p < a->sw; p++) {
                float *op = o + (long)p * a->Wq;
                /* the columns q of this phase that read X: col = q * sw + p - pl in [0, W) */
                int q_lo = (a->pl - p + a->sw - 1) / a->sw, q_hi = (a->W - 1 + a->pl - p) / a->sw + 1;
                if (a->pl - p < 0)
                    q_lo = 0;
                if (a->W - 1 + a->pl - p < 0) /* (C's division truncates toward zero) */
                    q_hi = 0;
                if (q_hi > a->Wq)
                    q_hi = a->Wq;
                if (q_lo > q_hi)
                    q_lo = q_hi;
                fill_floats(op, q_lo, a->fill);
                int q = q_lo;
                if (a->sw == 2) { /* 16 columns of a phase from 32 of the row: one permute */
                    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12,
                                                          10, 8, 6, 4, 2, 0);
                    for (; q + 16 <= q_hi; q += 16) {
                        long col = 2L * q + p - a->pl;
                        int left = a->W - (int)col; /* columns of X from col on */
                        __mmask16 m0 = left >= 16 ? 0xFFFF : (__mmask16)((1u << left) - 1);
                        __mmask16 m1 = left >= 32 ? 0xFFFF : left <= 16 ? 0
                                                          : (__mmask16)((1u << (left - 16)) - 1);
                        __m512 lo = _mm512_maskz_loadu_ps(m0, xr + col);
                        __m512 hi = _mm512_maskz_loadu_ps(m1, xr + col + 16);
                        _mm512_storeu_ps(op + q, _mm512_permutex2var_ps(lo, even, hi));
                    }
                }
                for (; q < q_hi; q++)
                    op[q] = xr[q * a->sw + p - a->pl];
                fill_floats(op + q_hi, a->Wq - q_hi, a->fill);
            }
        }
    }
}

/* X (planes x H x W) into out (planes x Hp x sw x Wq), padded by pt rows above and pl
 * columns before (and with `fill` beyond X), each row split into its sw column phases
 * of Wq columns; over `parts` parts */
void he_pad_mt(const float *X, float *out, int planes, int H, int W, int pt, int pl, int Hp,
               int sw, int Wq, float fill, int parts)
{
    pad_args a = {X, out, H, W, pt, pl, Hp, sw, Wq, fill};
    parallel(pad_task, &a, planes, parts);
}

/* ---------------------------------------------------------------------- 2-D MaxPool */

typedef struct {
    const float *X;
    float *Y;
    const int *off;
    int taps, pitch, Hp, sh, OH, OW;
} maxpool_args;

/* planes [p0, p1): Y[oh][ow] = max over the taps of X[oh*sh*pitch + ow + off[t]] on an
 * input padded with -inf and phased as for he_conv_left; NaN propagates, as numpy's */
static void maxpool_task(void *args, int p0, int p1)
{
    const maxpool_args *a = (const maxpool_args *)args;
    const __m512 ninf = _mm512_set1_ps(-__builtin_inff()), nan = _mm512_set1_ps(__builtin_nanf(""));
    for (int pi = p0; pi < p1; pi++) {
        const float *x = a->X + (long)pi * a->Hp * a->pitch;
        float *y = a->Y + (long)pi * a->OH * a->OW;
        for (int oh = 0; oh < a->OH; oh++) {
            const float *row = x + (long)oh * a->sh * a->pitch;
            for (int ow0 = 0; ow0 < a->OW; ow0 += 16) {
                int len = a->OW - ow0 < 16 ? a->OW - ow0 : 16;
                __mmask16 m = (__mmask16)((1u << len) - 1), isnan = 0;
                __m512 acc = ninf;
                for (int t = 0; t < a->taps; t++) {
                    __m512 v = _mm512_maskz_loadu_ps(m, row + ow0 + a->off[t]);
                    isnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
                    acc = _mm512_max_ps(acc, v);
                }
                acc = _mm512_mask_mov_ps(acc, isnan, nan);
                _mm512_mask_storeu_ps(y + (long)oh * a->OW + ow0, m, acc);
            }
        }
    }
}

void he_maxpool_mt(const float *X, float *Y, int planes, const int *off, int taps, int pitch,
                   int Hp, int sh, int OH, int OW, int parts)
{
    maxpool_args a = {X, Y, off, taps, pitch, Hp, sh, OH, OW};
    parallel(maxpool_task, &a, planes, parts);
}
