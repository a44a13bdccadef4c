/* MatMulNBits (com.microsoft) with 4- or 8-bit weights, unpacked a block at a time inside
 * the product: Y = A @ dequantize(B).T + bias (kernels/contrib/quant_matmul.py wraps it).
 *
 * B is onnxruntime's layout as it lies in the model, uint8 [N, k_blocks, blob]: a column n
 * of the product is one row of B, its K codes contiguous, so a decode step (M = 1) reads
 * the 4-bit weight once, in order, and is split over the library's workers by columns.
 * For each (column, block) the codes are unpacked into block_size floats (L1) and dotted
 * with each row of A. At one row the zero point comes out by A's block sums,
 *   sum_k a_k (c_k - z) s = s (sum_k a_k c_k - z sum_k a_k),
 * and the scale once a block; with more rows the codes are dequantized once, (c - z) s
 * as one FMA a vector, and shared by the rows (no per-row scale or correction).
 * A 4-bit byte holds codes k (low nibble) and k + 1 (high): A is copied once per call
 * with each block's even k first and odd k after, so the low nibbles of a block's bytes
 * form one contiguous run of codes and the high nibbles the next (no interleaving store).
 * A is zero-padded to whole blocks, so the codes past K (whatever they hold) add nothing. */
#include "kernels.h"

typedef struct {
    int M, N, K, kb, bs, bits, blob, zbytes;
    const float *Ap, *asum; /* A rearranged [M, kb * bs], its block sums [M, kb] */
    const uint8_t *B, *zp;
    const float *zpf, *scales, *bias;
    float *Y;
    long ldy;
} nb_args;

/* VW codes as floats: bytes j..j+VW of a block, their low (or, with hi, high) nibbles,
 * or the bytes themselves for 8 bits */
#if defined(HE_ISA_AVX512)
ALWAYS_INLINE __m512i bytes_vw(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
ALWAYS_INLINE vf codes_lo(__m512i b) { return _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))); }
ALWAYS_INLINE vf codes_hi(__m512i b) { return _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)); }
ALWAYS_INLINE vf codes_all(__m512i b) { return _mm512_cvtepi32_ps(b); }
typedef __m512i vbytes;
#elif defined(HE_ISA_AVX2)
ALWAYS_INLINE __m256i bytes_vw(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
ALWAYS_INLINE vf codes_lo(__m256i b) { return _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))); }
ALWAYS_INLINE vf codes_hi(__m256i b) { return _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)); }
ALWAYS_INLINE vf codes_all(__m256i b) { return _mm256_cvtepi32_ps(b); }
typedef __m256i vbytes;
#else
typedef struct { float lo[VW], hi[VW], all[VW]; } vbytes;
ALWAYS_INLINE vbytes bytes_vw(const uint8_t *p)
{
    vbytes v;
    for (int i = 0; i < VW; i++) {
        v.lo[i] = (float)(p[i] & 15);
        v.hi[i] = (float)(p[i] >> 4);
        v.all[i] = (float)p[i];
    }
    return v;
}
ALWAYS_INLINE vf codes_lo(vbytes b) { return vloadu(b.lo); }
ALWAYS_INLINE vf codes_hi(vbytes b) { return vloadu(b.hi); }
ALWAYS_INLINE vf codes_all(vbytes b) { return vloadu(b.all); }
#endif

/* a block's zero point as a float: float zero points, packed codes, or the middle code */
ALWAYS_INLINE float zero_point(const nb_args *a, long n, int b)
{
    if (a->zpf)
        return a->zpf[n * a->kb + b];
    if (a->zp) {
        uint8_t zb = a->zp[n * a->zbytes + (a->bits == 4 ? b / 2 : b)];
        return (float)(a->bits == 4 ? (zb >> ((b & 1) * 4)) & 15 : zb);
    }
    return (float)(1 << (a->bits - 1));
}

/* rows of A four at a time (a few rows: a prompt's short chunk, a batch's decode step):
 * each block's codes unpacked once into dequantized floats, (c - z) s as one FMA a
 * vector, then a product into each row's accumulator (no per-row scale or zero point) */
static void nb_task(void *p, int n0, int n1)
{
    const nb_args *a = (const nb_args *)p;
    int bs = a->bs, half = bs / 2, M = a->M;
    long kp = (long)a->kb * bs;
    for (int n = n0; n < n1; n++) {
        for (int m0 = 0; m0 < M; m0 += 4) {
            int R = M - m0 < 4 ? M - m0 : 4;
            vf tot[4];
            for (int r = 0; r < 4; r++)
                tot[r] = vzero();
            const float *ab = a->Ap + (long)m0 * kp;
            for (int b = 0; b < a->kb; b++, ab += bs) {
                const uint8_t *code = a->B + ((long)n * a->kb + b) * a->blob;
                const float s = a->scales[(long)n * a->kb + b];
                const vf sv = vset1(s), zs = vset1(-zero_point(a, n, b) * s);
                if (a->bits == 4 && half < VW) { /* 16-code blocks, 16 lanes: one vector */
                    float t[VW] __attribute__((aligned(64)));
                    for (int j = 0; j < half; j++)
                        t[j] = (float)(code[j] & 15), t[half + j] = (float)(code[j] >> 4);
                    vf c = vfma(vloadu(t), sv, zs);
                    for (int r = 0; r < R; r++)
                        tot[r] = vfma(vloadu(ab + r * kp), c, tot[r]);
                } else if (a->bits == 4) {
                    for (int j = 0; j < half; j += VW) {
                        vbytes v = bytes_vw(code + j);
                        vf lo = vfma(codes_lo(v), sv, zs), hi = vfma(codes_hi(v), sv, zs);
#pragma GCC unroll 4
                        for (int r = 0; r < 4; r++)
                            if (r < R) {
                                const float *ar = ab + r * kp;
                                tot[r] = vfma(vloadu(ar + j), lo, tot[r]);
                                tot[r] = vfma(vloadu(ar + half + j), hi, tot[r]);
                            }
                    }
                } else {
                    for (int j = 0; j < bs; j += VW) {
                        vf c = vfma(codes_all(bytes_vw(code + j)), sv, zs);
#pragma GCC unroll 4
                        for (int r = 0; r < 4; r++)
                            if (r < R)
                                tot[r] = vfma(vloadu(ab + r * kp + j), c, tot[r]);
                    }
                }
            }
            for (int r = 0; r < R; r++)
                a->Y[(long)(m0 + r) * a->ldy + n] =
                    vreduce_add(tot[r]) + (a->bias ? a->bias[n] : 0.0f);
        }
    }
}

#define NB_COLS 4

/* one row of A (a decode step), 4 bits, blocks of whole vectors of codes per nibble:
 * NB_COLS columns at a time, each its own chain of FMAs, so the unpacking and products
 * of one column overlap another's instead of waiting on one accumulator (a column past
 * n1 repeats the last, its result not stored) */
static void nb_row4_task(void *p, int n0, int n1)
{
    const nb_args *a = (const nb_args *)p;
    const int bs = a->bs, half = bs / 2, kb = a->kb;
    for (int n = n0; n < n1; n += NB_COLS) {
        long col[NB_COLS];
        vf tot[NB_COLS];
        float corr[NB_COLS];
        for (int c = 0; c < NB_COLS; c++) {
            col[c] = n + c < n1 ? n + c : n1 - 1;
            tot[c] = vzero();
            corr[c] = 0.0f;
        }
        const float *ab = a->Ap;
        for (int b = 0; b < kb; b++, ab += bs) {
            const float as = a->asum[b];
#pragma GCC unroll 4
            for (int c = 0; c < NB_COLS; c++) {
                const long nb = col[c] * kb + b;
                const uint8_t *code = a->B + nb * a->blob;
                const float s = a->scales[nb];
                vf d = vzero();
                for (int j = 0; j < half; j += VW) {
                    vbytes v = bytes_vw(code + j);
                    d = vfma(vloadu(ab + j), codes_lo(v), d);
                    d = vfma(vloadu(ab + half + j), codes_hi(v), d);
                }
                tot[c] = vfma(vset1(s), d, tot[c]);
                corr[c] += s * zero_point(a, col[c], b) * as;
            }
        }
        for (int c = 0; c < NB_COLS && n + c < n1; c++)
            a->Y[n + c] = vreduce_add(tot[c]) - corr[c] + (a->bias ? a->bias[n + c] : 0.0f);
    }
}

/* Y [M, N] (row stride ldy) = A [M, K] (row stride lda) @ dequantize(B).T + bias for
 * bits 4 or 8 and block_size a power of two in [16, 256]; zero points packed uint8
 * ([N, zbytes], codes of `bits` low first) or float ([N, kb], zpf) or neither (the
 * middle code); scales float [N, kb]; bias [N] or NULL. Returns 0, -1 when the scratch
 * could not be allocated, -2 for bits or block_size it does not take. */
int he_nbits_mt(int M, int N, int K, const float *A, long lda, const void *B,
                const float *scales, const void *zp, const float *zpf, int bits,
                int block_size, const float *bias, float *Y, long ldy, int parts)
{
    if ((bits != 4 && bits != 8) || block_size < 16 || block_size > 256 ||
        (block_size & (block_size - 1)))
        return -2;
    int bs = block_size, kb = (K + bs - 1) / bs, half = bs / 2;
    long kp = (long)kb * bs;
    float *Ap = malloc(sizeof(float) * ((size_t)M * kp + (size_t)M * kb) + 64);
    if (!Ap)
        return -1;
    float *asum = Ap + (size_t)M * kp;
    for (int m = 0; m < M; m++) {
        const float *ar = A + m * lda;
        float *o = Ap + m * kp;
        for (int b = 0; b < kb; b++) {
            float *ob = o + (long)b * bs;
            int k0 = b * bs;
            float s = 0.0f;
            for (int j = 0; j < bs; j++) {
                int k = k0 + j;
                float v = k < K ? ar[k] : 0.0f;
                s += v;
                if (bits == 4)
                    ob[(j & 1) ? half + j / 2 : j / 2] = v;
                else
                    ob[j] = v;
            }
            asum[(long)m * kb + b] = s;
        }
    }
    nb_args a = {M, N, K, kb, bs, bits, bs * bits / 8, (kb * bits + 7) / 8, Ap, asum,
                 (const uint8_t *)B, (const uint8_t *)zp, zpf, scales, bias, Y, ldy};
    if (M == 1 && bits == 4 && half % VW == 0) /* columns split in whole groups */
        he_parallel(nb_row4_task, &a, N, parts);
    else
        he_parallel(nb_task, &a, N, parts);
    free(Ap);
    return 0;
}
