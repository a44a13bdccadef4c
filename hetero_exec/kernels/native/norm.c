/* LayerNorm over the channels of (n, C, L) in float32 (AVX-512F): ConvNeXt's
 * channels-first LayerNorm, as exporters write it (ReduceMean over axis 1 and the rest
 * of the chain, fused into FusedLayerNorm). numpy took six passes over the whole tensor,
 * each a strided reduction or a temporary; here a run of 16 pixels is read for its
 * means over the channels, again for the variances (two passes: no sum of squares minus
 * the squared mean, which cancels), and once for the output, while its C x 16 floats
 * stay in L1. (The row norms over the last axis stay numba's, native/norm.py: a C
 * version measured no faster.) */
#include "he.h"

typedef struct {
    const float *x, *g, *b;
    float *y;
    int C, L, runs;
    float eps;
    int nhwc; /* write y as (n, L, C): a LayerNorm over the last axis of a permuted view */
    int failed;
} norm_args;

/* items t = (image, run of 16 pixels): LayerNorm of each pixel over the C channels, 16
 * pixels a vector, the channels L floats apart */
static void channels_task(void *p, int t0, int t1)
{
    norm_args *a = (norm_args *)p;
    const int C = a->C, L = a->L;
    const __m512 one = _mm512_set1_ps(1.0f), eps = _mm512_set1_ps(a->eps),
                 inv_c = _mm512_set1_ps(1.0f / C);
    const __m512i by16 = _mm512_mullo_epi32(
        _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
    /* nhwc: a run's outputs (C x 16) kept here, then written a pixel (C floats) at a time */
    float *block = a->nhwc ? (float *)aligned_alloc(64, (size_t)C * 16 * sizeof(float)) : 0;
    if (a->nhwc && !block) {
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int t = t0; t < t1; t++) {
        int n = t / a->runs, l0 = (t % a->runs) * 16;
        __mmask16 k = first_lanes(L - l0);
        const float *x = a->x + (long)n * C * L + l0;
        float *y = a->y + (long)n * C * L + l0;
        __m512 s = _mm512_setzero_ps();
        for (int c = 0; c < C; c++)
            s = _mm512_add_ps(s, _mm512_maskz_loadu_ps(k, x + (long)c * L));
        __m512 m = _mm512_mul_ps(s, inv_c), v = _mm512_setzero_ps();
        for (int c = 0; c < C; c++) {
            __m512 d = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + (long)c * L), m);
            v = _mm512_fmadd_ps(d, d, v);
        }
        __m512 iv = _mm512_div_ps(one, _mm512_sqrt_ps(_mm512_fmadd_ps(v, inv_c, eps)));
        for (int c = 0; c < C; c++) {
            __m512 o = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + (long)c * L), m), iv);
            if (a->g)
                o = _mm512_mul_ps(o, _mm512_set1_ps(a->g[c]));
            if (a->b)
                o = _mm512_add_ps(o, _mm512_set1_ps(a->b[c]));
            if (block)
                _mm512_store_ps(block + (long)c * 16, o);
            else
                _mm512_mask_storeu_ps(y + (long)c * L, k, o);
        }
        if (block) {
            int nk = L - l0 < 16 ? L - l0 : 16;
            for (int q = 0; q < nk; q++) {
                float *out = a->y + ((long)n * L + l0 + q) * C;
                for (int c0 = 0; c0 < C; c0 += 16) {
                    __mmask16 mc = first_lanes(C - c0);
                    _mm512_mask_storeu_ps(out + c0, mc, _mm512_mask_i32gather_ps(
                        _mm512_setzero_ps(), mc, by16, block + (long)c0 * 16 + q, 4));
                }
            }
        }
    }
    free(block);
}

/* y = LayerNorm over axis 1 of x (n, C, L), g and b (C) or NULL; y (n, C, L), or with
 * nhwc (n, L, C): 0, or -1 when a task's buffer could not be allocated */
int he_layer_norm_channels_mt(const float *x, const float *g, const float *b, float eps,
                              float *y, int n, int C, int L, int nhwc, int parts)
{
    norm_args a = {x, g, b, y, C, L, (L + 15) / 16, eps, nhwc, 0};
    he_parallel(channels_task, &a, n * a.runs, parts);
    return a.failed ? -1 : 0;
}
