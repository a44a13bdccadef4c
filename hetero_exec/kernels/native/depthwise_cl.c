/* Depthwise convolution of small planes along the channels (float32, AVX-512F): 16
 * channels of one image a vector. For a 4x4 or 8x8 plane the plane kernel (depthwise.c)
 * pads every plane and fills 16-lane runs that hold a few pixels each; here a block of 16
 * channels is gathered pixel by pixel into one padded channels-last buffer (a vector a
 * pixel, zero borders), every output pixel is KH x KW full-width FMAs by the taps'
 * weight vectors, and the sums are scattered back to NCHW with bias, residual and
 * Relu/Clip applied. MobileNetV2's and ConvNeXt's late layers at batch 8 ran their
 * depthwise convs at 4-20 GFLOP/s in the plane kernel, onnxruntime's NCHWc ones at 15-65. */
#include "he.h"

#define GROUP 8 /* output pixels summed at once: 8 independent FMA chains */

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

/* output pixels [o, o + g) of one block of 16 channels: sums over the taps, then the
 * epilogue, scattered to NCHW */
static inline __attribute__((always_inline)) void
pixels(const dwcl_args *a, const float *p, const float *wt, __m512 b, float *y, const float *z,
       __mmask16 m, __m512i out_idx, int o, const int g)
{
    __m512 s[GROUP];
    const float *q[GROUP];
#pragma GCC unroll 8
    for (int u = 0; u < g; u++) {
        s[u] = b;
        q[u] = p + a->base[o + u];
    }
    for (int k = 0; k < a->KT; k++) {
        __m512 w = _mm512_load_ps(wt + k * 16);
        int d = a->off[k];
#pragma GCC unroll 8
        for (int u = 0; u < g; u++)
            s[u] = _mm512_fmadd_ps(w, _mm512_load_ps(q[u] + d), s[u]);
    }
    const __m512 zero = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int u = 0; u < g; u++) {
        __m512 v = s[u];
        if (z)
            v = _mm512_add_ps(v, _mm512_mask_i32gather_ps(zero, m, out_idx, z + o + u, 4));
        /* max/min return their second operand when either is NaN: NaN stays NaN */
        if (a->act == ACT_RELU)
            v = _mm512_max_ps(zero, v);
        else if (a->act == ACT_CLIP)
            v = _mm512_min_ps(_mm512_set1_ps(a->hi), _mm512_max_ps(_mm512_set1_ps(a->lo), v));
        _mm512_mask_i32scatter_ps(y + o + u, m, out_idx, v, 4);
    }
}

static void dwcl_task(void *args, int t0, int t1)
{
    dwcl_args *a = (dwcl_args *)args;
    const int C = a->C, H = a->H, Wd = a->Wd, KT = a->KT;
    const long in_plane = (long)H * Wd, out_plane = (long)a->OH * a->OW;
    const size_t buf = (size_t)a->Hp * a->Wp * 16;
    float *p = (float *)aligned_alloc(64, (buf + (size_t)KT * 16) * sizeof(float));
    if (!p) {
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    float *wt = p + buf; /* the taps' weight vectors */
    memset(p, 0, buf * sizeof(float)); /* the borders stay zero */
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i in_idx = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)in_plane));
    const __m512i out_idx = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)out_plane));
    const __m512i w_idx = _mm512_mullo_epi32(lane, _mm512_set1_epi32(KT));
    const __m512 zero = _mm512_setzero_ps();
    for (int t = t0; t < t1; t++) {
        int n = t / a->blocks, c0 = (t % a->blocks) * 16;
        __mmask16 m = first_lanes(C - c0);
        const float *x = a->X + ((long)n * C + c0) * in_plane;
        for (int h = 0; h < H; h++) {
            float *row = p + ((long)(h + a->pt) * a->Wp + a->pl) * 16;
            for (int w = 0; w < Wd; w++)
                _mm512_store_ps(row + w * 16,
                                _mm512_mask_i32gather_ps(zero, m, in_idx, x + (long)h * Wd + w, 4));
        }
        for (int k = 0; k < KT; k++)
            _mm512_store_ps(wt + k * 16, _mm512_mask_i32gather_ps(zero, m, w_idx, a->W + (long)c0 * KT + k, 4));
        const __m512 b = a->bias ? _mm512_maskz_loadu_ps(m, a->bias + c0) : zero;
        float *y = a->Y + ((long)n * C + c0) * out_plane;
        const float *z = a->z ? a->z + ((long)n * C + c0) * out_plane : 0;
        int o = 0;
        for (; o + GROUP <= out_plane; o += GROUP)
            pixels(a, p, wt, b, y, z, m, out_idx, o, GROUP);
        switch (out_plane - o) {
#define T(g) case g: pixels(a, p, wt, b, y, z, m, out_idx, o, g); break;
            T(1) T(2) T(3) T(4) T(5) T(6) T(7)
#undef T
            default: break;
        }
    }
    free(p);
}

/* As he_depthwise_mt (depthwise.c), the work items (image, block of 16 channels); pt, pl
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
    int blocks = (C + 15) / 16, KT = KH * KW, OP = OH * OW;
    int *base = (int *)malloc((size_t)OP * sizeof(int)), *off = (int *)malloc((size_t)KT * sizeof(int));
    if (!base || !off) {
        free(base);
        free(off);
        return -1;
    }
    for (int oh = 0, o = 0; oh < OH; oh++)
        for (int ow = 0; ow < OW; ow++, o++)
            base[o] = (oh * sh * Wp + ow * sw) * 16;
    for (int i = 0, k = 0; i < KH; i++)
        for (int j = 0; j < KW; j++, k++)
            off[k] = (i * dh * Wp + j * dw) * 16;
    dwcl_args a = {X, W, bias, z, Y, C, H, Wd, OH, OW, KT, pt, pl, Hp, Wp, blocks, base, off,
                   act, lo, hi, 0};
    he_parallel(dwcl_task, &a, n * blocks, parts);
    free(base);
    free(off);
    return a.failed ? -1 : 0;
}
