/* Depthwise convolution of small planes along the channels (float32, simd.h): VW
 * channels of one image a vector (16 with AVX-512). For a 4x4 or 8x8 plane the plane kernel (depthwise.c)
 * pads every plane and fills 16-lane runs that hold a few pixels each; here a block of 16
 * channels is gathered pixel by pixel into one padded channels-last buffer (a vector a
 * pixel, zero borders), every output pixel is KH x KW full-width FMAs by the taps'
 * weight vectors, and the sums are scattered back to NCHW with bias, residual and
 * Relu/Clip applied. MobileNetV2's and ConvNeXt's late layers at batch 8 ran their
 * depthwise convs at 4-20 GFLOP/s in the plane kernel, onnxruntime's NCHWc ones at 15-65. */
#include "kernels.h"

#define GROUP 8 /* output pixels summed at once: 8 independent FMA chains */

#if defined(HE_ISA_AVX2)
/* r[i][j] <- r[j][i], an 8 x 8 block in eight registers: AVX2 has no gather-free way to
 * move between NCHW and channels-last a float at a time (no scatter; its gather, and
 * simd.h's a float at a time, cost AVX2 1.3-1.8x AVX-512's time on MobileNetV2's 7 x 7
 * planes), so a block of 8 channels x 8 pixels is loaded as rows and transposed */
ALWAYS_INLINE void transpose8(vf *r)
{
    __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    __m256 u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    __m256 u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
    r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
    r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
    r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
    r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}
#endif

typedef struct {
    const float *X, *W, *bias, *z;
    float *Y;
    int C, H, Wd, OH, OW, KT, pt, pl, Hp, Wp, blocks;
    const int *base; /* per output pixel: its first tap's offset in the padded buffer */
    const int *off;  /* per tap: its offset from there */
    int act;
    float lo, hi;
    int failed;
} dwcl_args;

/* output pixels [o, o + g) of one block of VW channels: sums over the taps, then the
 * epilogue, scattered to NCHW */
ALWAYS_INLINE void pixels(const dwcl_args *a, const float *p, const float *wt, vf b, float *y,
                          const float *z, int nc, vidx out_idx, int o, const int g)
{
    vf s[GROUP];
    const float *q[GROUP];
#pragma GCC unroll 8
    for (int u = 0; u < g; u++) {
        s[u] = b;
        q[u] = p + a->base[o + u];
    }
    for (int k = 0; k < a->KT; k++) {
        vf w = vload(wt + k * VW);
        int d = a->off[k];
#pragma GCC unroll 8
        for (int u = 0; u < g; u++)
            s[u] = vfma(w, vload(q[u] + d), s[u]);
    }
    const vf zero = vzero();
#pragma GCC unroll 8
    for (int u = 0; u < g; u++) {
        vf v = s[u];
        if (z)
            v = vadd(v, vgather(z + o + u, out_idx, nc));
        /* max/min return their second operand when either is NaN: NaN stays NaN */
        if (a->act == ACT_RELU)
            v = vmax(zero, v);
        else if (a->act == ACT_CLIP)
            v = vmin(vset1(a->hi), vmax(vset1(a->lo), v));
#if defined(HE_ISA_AVX2)
        s[u] = v;
    }
    if (g == GROUP && nc == VW) { /* 8 pixels x 8 channels: a row of 8 pixels a channel */
        const long plane = (long)a->OH * a->OW;
        transpose8(s);
#pragma GCC unroll 8
        for (int c = 0; c < VW; c++)
            vstoreu(y + c * plane + o, s[c]);
        return;
    }
#pragma GCC unroll 8
    for (int u = 0; u < g; u++) {
        vf v = s[u];
#endif
        vscatter(y + o + u, out_idx, nc, v);
    }
}

static void dwcl_task(void *args, int t0, int t1)
{
    dwcl_args *a = (dwcl_args *)args;
    const int C = a->C, H = a->H, Wd = a->Wd, KT = a->KT;
    const long in_plane = (long)H * Wd, out_plane = (long)a->OH * a->OW;
    const size_t buf = (size_t)a->Hp * a->Wp * VW;
    float *p = (float *)aligned_alloc(64, ((buf + (size_t)KT * VW) * sizeof(float) + 63) / 64 * 64);
    if (!p) {
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    float *wt = p + buf; /* the taps' weight vectors */
    memset(p, 0, buf * sizeof(float)); /* the borders stay zero */
    const vidx in_idx = vidx_stride(in_plane), out_idx = vidx_stride(out_plane),
               w_idx = vidx_stride(KT);
    for (int t = t0; t < t1; t++) {
        int n = t / a->blocks, c0 = (t % a->blocks) * VW;
        int nc = C - c0 < VW ? C - c0 : VW;
        const float *x = a->X + ((long)n * C + c0) * in_plane;
        for (int h = 0; h < H; h++) {
            float *row = p + ((long)(h + a->pt) * a->Wp + a->pl) * VW;
            int w = 0;
#if defined(HE_ISA_AVX2)
            if (nc == VW) /* 8 pixels of the 8 channels' rows, transposed */
                for (; w + 8 <= Wd; w += 8) {
                    vf r[8];
#pragma GCC unroll 8
                    for (int c = 0; c < 8; c++)
                        r[c] = vloadu(x + c * in_plane + (long)h * Wd + w);
                    transpose8(r);
#pragma GCC unroll 8
                    for (int i = 0; i < 8; i++)
                        vstore(row + (w + i) * VW, r[i]);
                }
#endif
            for (; w < Wd; w++)
                vstore(row + w * VW, vgather(x + (long)h * Wd + w, in_idx, nc));
        }
        for (int k = 0; k < KT; k++)
            vstore(wt + k * VW, vgather(a->W + (long)c0 * KT + k, w_idx, nc));
        const vf b = a->bias ? vload_lanes(first_lanes(nc), a->bias + c0) : vzero();
        float *y = a->Y + ((long)n * C + c0) * out_plane;
        const float *z = a->z ? a->z + ((long)n * C + c0) * out_plane : 0;
        int o = 0;
        for (; o + GROUP <= out_plane; o += GROUP)
            pixels(a, p, wt, b, y, z, nc, out_idx, o, GROUP);
        switch (out_plane - o) {
#define T(g) case g: pixels(a, p, wt, b, y, z, nc, out_idx, o, g); break;
            T(1) T(2) T(3) T(4) T(5) T(6) T(7)
#undef T
            default: break;
        }
    }
    free(p);
}

/* As he_depthwise_mt (depthwise.c), the work items (image, block of VW channels); pt, pl
 * the top and left pads: 0, or -1 when the buffer could not be allocated */
int he_depthwise_cl_mt(const float *X, const float *W, const float *bias, const float *z,
                       float *Y, int n, int C, int H, int Wd, int OH, int OW, int KH, int KW,
                       int sh, int sw, int dh, int dw, int pt, int pl, int act, float lo,
                       float hi, int parts)
{
    int Hp = (OH - 1) * sh + (KH - 1) * dh + 1, Wp = (OW - 1) * sw + (KW - 1) * dw + 1;
    if (Hp < pt + H)
        Hp = pt + H;
    if (Wp < pl + Wd)
        Wp = pl + Wd;
    int blocks = (C + VW - 1) / VW, KT = KH * KW, OP = OH * OW;
    int *base = (int *)malloc((size_t)OP * sizeof(int)), *off = (int *)malloc((size_t)KT * sizeof(int));
    if (!base || !off) {
        free(base);
        free(off);
        return -1;
    }
    for (int oh = 0, o = 0; oh < OH; oh++)
        for (int ow = 0; ow < OW; ow++, o++)
            base[o] = (oh * sh * Wp + ow * sw) * VW;
    for (int i = 0, k = 0; i < KH; i++)
        for (int j = 0; j < KW; j++, k++)
            off[k] = (i * dh * Wp + j * dw) * VW;
    dwcl_args a = {X, W, bias, z, Y, C, H, Wd, OH, OW, KT, pt, pl, Hp, Wp, blocks, base, off,
                   act, lo, hi, 0};
    he_parallel(dwcl_task, &a, n * blocks, parts);
    free(base);
    free(off);
    return a.failed ? -1 : 0;
}
