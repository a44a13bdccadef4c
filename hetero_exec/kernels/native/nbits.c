/* MatMulNBits (com.microsoft) with 4- or 8-bit weights, unpacked a block at a time inside
 * the product: Y = A @ dequantize(B).T + bias (kernels/contrib/quant_matmul.py wraps it).
 *
 * B is onnxruntime's layout as it lies in the model, uint8 [N, k_blocks, blob]: a column n
 * of the product is one row of B, its K codes contiguous, so a decode step (M = 1) reads
 * the 4-bit weight once, in order, and is split over the library's workers by columns.
 * For each (column, block) the codes are unpacked into block_size floats (L1) and dotted
 * with each row of A; the zero point comes out by A's block sums:
 *   sum_k a_k (c_k - z) s = s (sum_k a_k c_k - z sum_k a_k).
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

static void nb_task(void *p, int n0, int n1)
{
    const nb_args *a = (const nb_args *)p;
    int bs = a->bs, half = bs / 2, M = a->M;
    long kp = (long)a->kb * bs;
    float tmp[256] __attribute__((aligned(64)));
    float dflt = (float)(1 << (a->bits - 1));
    for (int n = n0; n < n1; n++) {
        float yr[8];
        for (int m0 = 0; m0 < M; m0 += 8) {
            int R = M - m0 < 8 ? M - m0 : 8;
            for (int r = 0; r < R; r++)
                yr[r] = a->bias ? a->bias[n] : 0.0f;
            for (int b = 0; b < a->kb; b++) {
                const uint8_t *code = a->B + ((long)n * a->kb + b) * a->blob;
                if (a->bits == 4) {
                    for (int j = 0; j < half; j++) {
                        tmp[j] = (float)(code[j] & 15);
                        tmp[half + j] = (float)(code[j] >> 4);
                    }
                } else {
                    for (int j = 0; j < bs; j++)
                        tmp[j] = (float)code[j];
                }
                float z;
                if (a->zpf)
                    z = a->zpf[(long)n * a->kb + b];
                else if (a->zp) {
                    uint8_t zb = a->zp[(long)n * a->zbytes + (a->bits == 4 ? b / 2 : b)];
                    z = (float)(a->bits == 4 ? (zb >> ((b & 1) * 4)) & 15 : zb);
                } else
                    z = dflt;
                float s = a->scales[(long)n * a->kb + b];
                for (int r = 0; r < R; r++) {
                    const float *ar = a->Ap + (long)(m0 + r) * kp + (long)b * bs;
                    vf acc0 = vzero(), acc1 = vzero();
                    int j = 0;
                    for (; j + 2 * VW <= bs; j += 2 * VW) {
                        acc0 = vfma(vloadu(ar + j), vloadu(tmp + j), acc0);
                        acc1 = vfma(vloadu(ar + j + VW), vloadu(tmp + j + VW), acc1);
                    }
                    for (; j < bs; j += VW)
                        acc0 = vfma(vloadu(ar + j), vloadu(tmp + j), acc0);
                    float d = vreduce_add(vadd(acc0, acc1));
                    yr[r] += s * (d - z * a->asum[(long)(m0 + r) * a->kb + b]);
                }
            }
            for (int r = 0; r < R; r++)
                a->Y[(long)(m0 + r) * a->ldy + n] = yr[r];
        }
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
    he_parallel(nb_task, &a, N, parts);
    free(Ap);
    return 0;
}
