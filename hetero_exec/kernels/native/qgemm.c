/* 8-bit integer GEMM with int32 accumulation (MatMulInteger, QLinearMatMul, QGemm,
 * DynamicQuantizeMatMul, MatMulIntegerToFloat; kernels/_int_gemm.py wraps it):
 *   Y = (A - a_zp) @ (B - b_zp), A [M, K] uint8 or int8, B [K, N] uint8 or int8,
 * as int32, or as float32 ``Y * scale[n] + bias[n]`` stored from the tile.
 *
 * Every operand pair is computed as uint8 x int8: an int8 A is shifted by +128 (x ^ 0x80)
 * and its zero point with it, a uint8 B by -128. The zero points then come out by sums:
 *   sum (a - za)(b - zb) = sum ab - zb * rowsum(a) - za * colsum(b) + K za zb,
 * the column sums of B made once when B is packed, A's row sums when A is copied.
 * int32 arithmetic wraps as onnxruntime's does (and the spec allows).
 *
 * B is packed once per node (he_qgemm_pack) in panels of QN = 32 columns:
 *   VNNI (the avx512 variant on a CPU with AVX512-VNNI): 4 consecutive k of a column as
 *     4 bytes, 32 columns a row of 128 bytes; vpdpbusd sums 4 u8 x s8 products exactly.
 *   otherwise: 2 consecutive k of a column as 2 int16 (the same 128 bytes a row);
 *     vpmaddwd (AVX2) sums 2 s16 x s16 products exactly, where vpmaddubsw would saturate
 *     (255 * 127 * 2 > 32767); the baseline runs the same layout in plain C.
 * A is copied (row sums, the shift, zero padding of K) into the same grouping per call.
 * VNNI is picked at run time (cpuid) and recorded in the packed buffer's header, so a
 * weight packed by one path is only ever read by it. */
#include <math.h>

#include "kernels.h"

#define QN 32       /* columns a panel */
#define QHEAD 64    /* bytes of header before the column sums */
#define QMB 64      /* rows of A a work item */

enum { LAYOUT_I16 = 1, LAYOUT_VNNI = 2 };

static int vnni_here(void)
{
#if defined(HE_ISA_AVX512)
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") ? 1 : 0;
    }
    return known;
#else
    return 0;
#endif
}

static int group_of(int layout) { return layout == LAYOUT_VNNI ? 4 : 2; }

static long padded(long n, long to) { return (n + to - 1) / to * to; }

/* bytes of one panel: rows of QN columns, each row `group` k as bytes or int16 */
static long panel_bytes(int layout, int K)
{
    int g = group_of(layout);
    return padded(K, g) / g * QN * 4;
}

long he_qgemm_pack_size(int K, int N)
{
    int layout = vnni_here() ? LAYOUT_VNNI : LAYOUT_I16;
    long panels = (N + QN - 1) / QN;
    return QHEAD + 4L * panels * QN + panels * panel_bytes(layout, K);
}

/* B's k, n as int8 (a uint8 B shifted by -128) */
static inline int b_at(const uint8_t *B, long rs, long cs, int k, int n, int b_signed)
{
    uint8_t v = B[k * rs + n * cs];
    return b_signed ? (int)(int8_t)v : (int)v - 128;
}

void he_qgemm_pack(int K, int N, const void *Bv, long rs, long cs, int b_signed, void *out)
{
    const uint8_t *B = (const uint8_t *)Bv;
    int layout = vnni_here() ? LAYOUT_VNNI : LAYOUT_I16, g = group_of(layout);
    long panels = (N + QN - 1) / QN, pb = panel_bytes(layout, K);
    int32_t *head = (int32_t *)out;
    memset(out, 0, he_qgemm_pack_size(K, N));
    head[0] = layout, head[1] = b_signed, head[2] = K, head[3] = N;
    int32_t *colsum = (int32_t *)((char *)out + QHEAD);
    char *body = (char *)out + QHEAD + 4L * panels * QN;
    for (long p = 0; p < panels; p++) {
        char *panel = body + p * pb;
        for (int j = 0; j < QN && p * QN + j < N; j++) {
            int n = (int)(p * QN + j);
            int32_t s = 0;
            for (int k = 0; k < K; k++) {
                int v = b_at(B, rs, cs, k, n, b_signed);
                s += v;
                long row = k / g, at = (row * QN + j) * g + k % g;
                if (layout == LAYOUT_VNNI)
                    ((int8_t *)panel)[at] = (int8_t)v;
                else
                    ((int16_t *)panel)[at] = (int16_t)v;
            }
            colsum[n] = s;
        }
    }
}

/* ------------------------------------------------------------------ the tiles */

typedef struct {
    int M, N, K, Kg, layout;
    const uint8_t *A8;    /* A shifted to uint8, [M, Kg] (VNNI) */
    const int16_t *A16;   /* or as int16, [M, Kg] */
    const int32_t *rowsum, *colsum, *a_zp, *b_zp; /* zero points already shifted */
    const char *body;
    long pb, panels, ldy;
    int32_t *Yi;
    float *Yf;
    const float *scale, *bias;
} q_args;

/* acc (R rows of QN int32) corrected for the zero points and stored: per row two
 * vectorizable loops over the tile's columns (unsigned: the sums wrap) */
static void q_store(const q_args *a, int m0, int R, int n0, int32_t acc[][QN])
{
    int cols = a->N - n0 < QN ? a->N - n0 : QN;
    const int32_t *restrict zb = a->b_zp + n0, *restrict cs = a->colsum + n0;
    uint32_t kz[QN];
    for (int j = 0; j < cols; j++)
        kz[j] = (uint32_t)a->K * (uint32_t)zb[j];
    for (int r = 0; r < R; r++) {
        int m = m0 + r;
        uint32_t za = (uint32_t)a->a_zp[m], rs = (uint32_t)a->rowsum[m];
        const int32_t *restrict ac = acc[r];
        int32_t v[QN];
        for (int j = 0; j < cols; j++)
            v[j] = (int32_t)((uint32_t)ac[j] - (uint32_t)zb[j] * rs - za * (uint32_t)cs[j]
                             + za * kz[j]);
        if (a->Yf) {
            float *restrict y = a->Yf + m * a->ldy + n0;
            const float *restrict sc = a->scale + n0;
            if (a->bias) {
                const float *restrict b = a->bias + n0;
                for (int j = 0; j < cols; j++)
                    y[j] = (float)v[j] * sc[j] + b[j];
            } else {
                for (int j = 0; j < cols; j++)
                    y[j] = (float)v[j] * sc[j];
            }
        } else {
            int32_t *restrict y = a->Yi + m * a->ldy + n0;
            for (int j = 0; j < cols; j++)
                y[j] = v[j];
        }
    }
}

#if !defined(HE_ISA_AVX512) && !defined(HE_ISA_AVX2)
/* portable: int16 layout, R <= 4 rows of a panel */
static void tile_i16_plain(const q_args *a, int m0, int R, const int16_t *panel, int32_t acc[][QN])
{
    int rows = a->Kg / 2;
    for (int r = 0; r < R; r++)
        for (int j = 0; j < QN; j++)
            acc[r][j] = 0;
    for (int r = 0; r < R; r++) {
        const int16_t *ar = a->A16 + (long)(m0 + r) * a->Kg;
        int32_t *ac = acc[r];
        for (int kr = 0; kr < rows; kr++) {
            int32_t a0 = ar[2 * kr], a1 = ar[2 * kr + 1];
            const int16_t *b = panel + (long)kr * QN * 2;
            for (int j = 0; j < QN; j++)
                ac[j] = (int32_t)((uint32_t)ac[j] + (uint32_t)(a0 * b[2 * j] + a1 * b[2 * j + 1])); /* wraps */
        }
    }
}

#endif

#if defined(HE_ISA_AVX512) || defined(HE_ISA_AVX2)
/* AVX2: int16 layout, R <= 6 rows x 16 columns (half a panel) by vpmaddwd */
#define I16_ROWS 6
static void tile_i16_avx2(const q_args *a, int m0, int R, const int16_t *panel, int32_t acc[][QN])
{
    int rows = a->Kg / 2;
    for (int half = 0; half < 2; half++) {
        __m256i c[I16_ROWS][2];
        for (int r = 0; r < I16_ROWS; r++)
            c[r][0] = c[r][1] = _mm256_setzero_si256();
        const int32_t *ar[I16_ROWS];
        for (int r = 0; r < I16_ROWS; r++)
            ar[r] = (const int32_t *)(a->A16 + (long)(m0 + (r < R ? r : 0)) * a->Kg);
        const int16_t *b = panel + half * 32;
        for (int kr = 0; kr < rows; kr++, b += QN * 2) {
            __m256i b0 = _mm256_loadu_si256((const __m256i *)b);
            __m256i b1 = _mm256_loadu_si256((const __m256i *)(b + 16));
#pragma GCC unroll 6
            for (int r = 0; r < I16_ROWS; r++) {
                if (r < R) {
                    __m256i av = _mm256_set1_epi32(ar[r][kr]);
                    c[r][0] = _mm256_add_epi32(c[r][0], _mm256_madd_epi16(av, b0));
                    c[r][1] = _mm256_add_epi32(c[r][1], _mm256_madd_epi16(av, b1));
                }
            }
        }
        for (int r = 0; r < R; r++) {
            _mm256_storeu_si256((__m256i *)(acc[r] + half * 16), c[r][0]);
            _mm256_storeu_si256((__m256i *)(acc[r] + half * 16 + 8), c[r][1]);
        }
    }
}
#endif

#if defined(HE_ISA_AVX512)
/* VNNI: R <= 8 rows x 32 columns by vpdpbusd, 4 k a step */
#define VNNI_ROWS 8
__attribute__((target("avx512vnni,avx512bw")))
static void tile_vnni(const q_args *a, int m0, int R, const int8_t *panel, int32_t acc[][QN])
{
    int rows = a->Kg / 4;
    __m512i c[VNNI_ROWS][2];
    const int32_t *ar[VNNI_ROWS];
    for (int r = 0; r < VNNI_ROWS; r++) {
        c[r][0] = c[r][1] = _mm512_setzero_si512();
        ar[r] = (const int32_t *)(a->A8 + (long)(m0 + (r < R ? r : 0)) * a->Kg);
    }
    const int8_t *b = panel;
    for (int kr = 0; kr < rows; kr++, b += QN * 4) {
        __m512i b0 = _mm512_loadu_si512((const void *)b);
        __m512i b1 = _mm512_loadu_si512((const void *)(b + 64));
#pragma GCC unroll 8
        for (int r = 0; r < VNNI_ROWS; r++) {
            if (r < R) {
                __m512i av = _mm512_set1_epi32(ar[r][kr]);
                c[r][0] = _mm512_dpbusd_epi32(c[r][0], av, b0);
                c[r][1] = _mm512_dpbusd_epi32(c[r][1], av, b1);
            }
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_si512((void *)acc[r], c[r][0]);
        _mm512_storeu_si512((void *)(acc[r] + 16), c[r][1]);
    }
}

/* A full VNNI tile (8 rows) with its epilogue in registers: no branch per row in the k
 * loop, and the zero-point correction, the int-to-float, scale and bias done a vector of
 * columns at a time, stored straight to Y (at short K the tile's trip through `acc` and
 * the scalar store cost as much as the products) */
__attribute__((target("avx512vnni,avx512bw")))
static void tile_vnni8(const q_args *a, int m0, const int8_t *panel, int n0)
{
    const int rows = a->Kg / 4;
    const long lda = a->Kg / 4; /* in groups of 4 bytes */
    const int32_t *A = (const int32_t *)(a->A8 + (long)m0 * a->Kg);
    __m512i c[VNNI_ROWS][2];
#pragma GCC unroll 8
    for (int r = 0; r < VNNI_ROWS; r++)
        c[r][0] = c[r][1] = _mm512_setzero_si512();
    const int8_t *b = panel;
    for (int kr = 0; kr < rows; kr++, b += QN * 4) {
        const __m512i b0 = _mm512_loadu_si512((const void *)b);
        const __m512i b1 = _mm512_loadu_si512((const void *)(b + 64));
#pragma GCC unroll 8
        for (int r = 0; r < VNNI_ROWS; r++) {
            const __m512i av = _mm512_set1_epi32(A[r * lda + kr]);
            c[r][0] = _mm512_dpbusd_epi32(c[r][0], av, b0);
            c[r][1] = _mm512_dpbusd_epi32(c[r][1], av, b1);
        }
    }
    const int cols = a->N - n0 < QN ? a->N - n0 : QN;
    const __m512i K = _mm512_set1_epi32(a->K);
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) { /* (constant h once unrolled: c stays in registers) */
        const int w = cols - 16 * h;
        const __mmask16 keep = (__mmask16)(w >= 16 ? 0xFFFF : w <= 0 ? 0 : (1u << w) - 1);
        if (!keep)
            continue;
        const int j = n0 + 16 * h;
        const __m512i zb = _mm512_maskz_loadu_epi32(keep, a->b_zp + j);
        /* sum (a - za)(b - zb) = acc - zb * rowsum - za * (colsum - K zb), wrapping */
        const __m512i corr = _mm512_sub_epi32(_mm512_maskz_loadu_epi32(keep, a->colsum + j),
                                              _mm512_mullo_epi32(K, zb));
        __m512 sc = _mm512_setzero_ps(), bias = _mm512_setzero_ps();
        if (a->Yf) {
            sc = _mm512_maskz_loadu_ps(keep, a->scale + j);
            if (a->bias)
                bias = _mm512_maskz_loadu_ps(keep, a->bias + j);
        }
#pragma GCC unroll 8
        for (int r = 0; r < VNNI_ROWS; r++) {
            const int m = m0 + r;
            __m512i v = _mm512_sub_epi32(c[r][h], _mm512_mullo_epi32(zb, _mm512_set1_epi32(a->rowsum[m])));
            v = _mm512_sub_epi32(v, _mm512_mullo_epi32(_mm512_set1_epi32(a->a_zp[m]), corr));
            if (a->Yf)
                _mm512_mask_storeu_ps(a->Yf + (long)m * a->ldy + j, keep,
                                      _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), sc, bias));
            else
                _mm512_mask_storeu_epi32(a->Yi + (long)m * a->ldy + j, keep, v);
        }
    }
}
#endif

static int tile_rows_for(int layout)
{
#if defined(HE_ISA_AVX512)
    if (layout == LAYOUT_VNNI)
        return VNNI_ROWS;
#endif
#if defined(HE_ISA_AVX512) || defined(HE_ISA_AVX2)
    return I16_ROWS;
#else
    return 4;
#endif
}

static void q_tile(const q_args *a, int m0, int R, long p, int32_t acc[][QN])
{
    const char *panel = a->body + p * a->pb;
#if defined(HE_ISA_AVX512)
    if (a->layout == LAYOUT_VNNI) {
        tile_vnni(a, m0, R, (const int8_t *)panel, acc);
        return;
    }
#endif
#if defined(HE_ISA_AVX512) || defined(HE_ISA_AVX2)
    tile_i16_avx2(a, m0, R, (const int16_t *)panel, acc);
#else
    tile_i16_plain(a, m0, R, (const int16_t *)panel, acc);
#endif
}

static void q_task(void *p, int i0, int i1)
{
    const q_args *a = (const q_args *)p;
    int tr = tile_rows_for(a->layout);
    int32_t acc[8][QN];
    for (int i = i0; i < i1; i++) {
        int mb = (int)(i / a->panels);
        long panel = i % a->panels;
        int m1 = (mb + 1) * QMB < a->M ? (mb + 1) * QMB : a->M;
        for (int m = mb * QMB; m < m1; m += tr) {
            int R = m1 - m < tr ? m1 - m : tr;
#if defined(HE_ISA_AVX512)
            if (R == VNNI_ROWS && a->layout == LAYOUT_VNNI) {
                tile_vnni8(a, m, (const int8_t *)(a->body + panel * a->pb), (int)(panel * QN));
                continue;
            }
#endif
            q_tile(a, m, R, panel, acc);
            q_store(a, m, R, (int)(panel * QN), acc);
        }
    }
}

/* Y = (A - a_zp) @ (B - b_zp) for B packed by he_qgemm_pack: int32 into Yi, or (Yf not
 * NULL) float32 ``Y * scale[n] + bias[n]`` (bias may be NULL); a_zp has M values, b_zp
 * N (raw zero points, in the operands' own types); returns 0, -1 when the scratch could
 * not be allocated, -2 when Bp was packed by another layout (or for another K, N) */
int he_qgemm_mt(int M, int N, int K, const void *Av, long lda, int a_signed, const void *Bp,
                const int *a_zp, const int *b_zp, int *Yi, float *Yf, long ldy,
                const float *scale, const float *bias, int parts)
{
    const int32_t *head = (const int32_t *)Bp;
    int layout = vnni_here() ? LAYOUT_VNNI : LAYOUT_I16;
    if (head[0] != layout || head[2] != K || head[3] != N)
        return -2;
    int b_signed = head[1], g = group_of(layout);
    int Kg = (int)padded(K, g);
    long panels = (N + QN - 1) / QN;
    size_t abytes = (size_t)M * Kg * (layout == LAYOUT_VNNI ? 1 : 2);
    char *scratch = malloc(abytes + 4 * ((size_t)M * 2 + N) + 64);
    if (!scratch)
        return -1;
    int32_t *rowsum = (int32_t *)(scratch + padded(abytes, 64));
    int32_t *za = rowsum + M, *zb = za + M;
    const uint8_t *A = (const uint8_t *)Av;
    uint8_t flip = a_signed ? 0x80 : 0;
    for (int m = 0; m < M; m++) {
        const uint8_t *ar = A + m * lda;
        int32_t s = 0;
        if (layout == LAYOUT_VNNI) {
            uint8_t *o = (uint8_t *)scratch + (long)m * Kg;
            for (int k = 0; k < K; k++) {
                o[k] = ar[k] ^ flip;
                s += o[k];
            }
            for (int k = K; k < Kg; k++)
                o[k] = 0;
        } else {
            int16_t *o = (int16_t *)scratch + (long)m * Kg;
            for (int k = 0; k < K; k++) {
                o[k] = (int16_t)(uint8_t)(ar[k] ^ flip);
                s += o[k];
            }
            for (int k = K; k < Kg; k++)
                o[k] = 0;
        }
        rowsum[m] = s;
        za[m] = a_zp[m] + (a_signed ? 128 : 0);
    }
    for (int n = 0; n < N; n++)
        zb[n] = b_zp[n] - (b_signed ? 0 : 128);
    q_args a = {M, N, K, Kg, layout, (const uint8_t *)scratch, (const int16_t *)scratch, rowsum,
                (const int32_t *)((const char *)Bp + QHEAD), za, zb,
                (const char *)Bp + QHEAD + 4L * panels * QN, panel_bytes(layout, K), panels,
                ldy, Yi, Yf, scale, bias};
    long items = (long)((M + QMB - 1) / QMB) * panels;
    he_parallel(q_task, &a, (int)items, parts);
    free(scratch);
    return 0;
}

/* DynamicQuantizeLinear of n floats: y uint8, its scale and zero point, as the operator
 * (and kernels/quant.py) define them: range [min(0, x), max(0, x)] over 255 steps,
 * rounding half to even */
void he_dynamic_quantize(const float *x, long n, void *yv, float *scale, void *zpv)
{
    uint8_t *y = (uint8_t *)yv;
    /* the range a vector at a time; a NaN is skipped, as the scalar `x > mx ? x : mx`
     * skips it (vmax returns its second operand when the first is NaN) */
    vf vmx = vzero(), vnm = vzero(); /* max(x) and max(-x): both from 0, as the range is */
    long i = 0;
    for (; i + VW <= n; i += VW) {
        const vf v = vloadu(x + i);
        vmx = vmax(v, vmx);
        vnm = vmax(vsub(vzero(), v), vnm);
    }
    float mx = vreduce_max(vmx), mn = -vreduce_max(vnm);
    for (; i < n; i++) {
        mx = x[i] > mx ? x[i] : mx;
        mn = x[i] < mn ? x[i] : mn;
    }
    float range = mx == mn ? 1.0f : mx - mn;
    float s = range / 255.0f;
    float z = -mn / s;
    z = rintf(z < 0.0f ? 0.0f : z > 255.0f ? 255.0f : z);
    /* rint(x / s) + z, clamped to [0, 255]: the same division and rounding (half to even)
     * as the scalar tail */
    const vf vs = vset1(s), vz = vset1(z), top = vset1(255.0f);
    float q[VW];
    for (i = 0; i + VW <= n; i += VW) {
        vf v = vadd(vround(vdiv(vloadu(x + i), vs)), vz);
        vstoreu(q, vmin(vmax(v, vzero()), top));
        for (int j = 0; j < VW; j++)
            y[i + j] = (uint8_t)q[j];
    }
    for (; i < n; i++) {
        float v = rintf(x[i] / s) + z;
        y[i] = (uint8_t)(v < 0.0f ? 0.0f : v > 255.0f ? 255.0f : v);
    }
    *scale = s;
    *(uint8_t *)zpv = (uint8_t)z;
}
